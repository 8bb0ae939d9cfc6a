"""A model spread over llama.cpp RPC servers (load option `rpcServers`), on loopback: two
`kinfer rpc-server` processes (CPU) hold layers of the embedded model beside this host's CPU.
Replies are the same as the model's loaded here; a server that cannot be reached is -31003 naming
it; a server killed mid-reply fails that model's requests (-32603 naming it), and the rest of
kinfer-rpc goes on; so does one that stops answering (GGML_RPC_TIMEOUT). Every server a test
starts is ended by its pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from protocol_fixtures import server, spawn  # noqa: F401
from rpcclient import RpcError

from kinfer_rpc.default_plugins.llama import rpc as llama_rpc

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not llama_rpc.build_support()[0], reason="llama.cpp without its RPC backend"),
]

KINFER = os.path.join(os.path.dirname(sys.executable), "kinfer")
# kvType q8_0 everywhere: the CPU kernels (local and the servers') are then the same whatever the
# pass holds; layers 0-10 here, the rest over the two servers
LOCAL = {"contextLength": 512, "slots": 2, "threads": 1, "kvType": "q8_0"}
PROMPTS = ["Once upon a time", "The capital of France is", "def fib(n):"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [KINFER, "rpc-server", "--port", str(port), "--threads", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # listening: a HELLO is answered
        try:
            llama_rpc.probe(f"127.0.0.1:{port}", timeout=1)
            return proc, f"127.0.0.1:{port}"
        except ConnectionError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("kinfer rpc-server did not start listening")


@pytest.fixture
def servers():
    started = [start_server() for _ in range(2)]
    try:
        yield [endpoint for _, endpoint in started]
    finally:
        for proc, _ in started:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


def test_the_server_uses_its_own_libraries_whatever_ld_library_path_names():
    """Another llama.cpp's libggml (here llama-cpp-python's own, built without RPC) first on
    LD_LIBRARY_PATH: the server still loads the libraries beside it and answers."""
    import llama_cpp

    other = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    if not os.path.exists(os.path.join(other, "libggml.so")):
        pytest.skip("llama-cpp-python ships no libraries of its own here")
    proc, endpoint = start_server({**os.environ, "LD_LIBRARY_PATH": other})
    try:
        llama_rpc.probe(endpoint, timeout=2)  # ConnectionError if it stopped
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def replies(c, model):
    out = []
    for p in PROMPTS:
        for options in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
            r = c.call("inference/generate", {"model": model, "prompt": p, "options": {"maxTokens": 16, **options}})
            out.append(r["tokens"])
    return out


def test_the_servers_hold_layers_and_replies_are_the_local_ones(server, servers, tmp_path):
    caps = server.call("initialize", None) if False else None  # (initialized by the fixture)
    del caps
    local = server.call("model/load", {"options": LOCAL})
    expected = replies(server, local["model"])
    server.call("model/unload", {"model": local["model"]})
    spread = server.call("model/load", {"options": {**LOCAL, "rpcServers": servers, "gpuLayers": 20}}, timeout=120)
    assert spread["rpcServers"] == servers and "rpcServers" in spread["placementReason"]
    devices = spread["devices"]
    assert [d["server"] for d in devices] == [None, servers[0], servers[1]]
    assert devices[0]["device"] == "CPU" and devices[0]["layers"] == [[0, 10]]  # 30 layers, 20 off the CPU
    held = sorted(n for d in devices[1:] for a, b in d["layers"] for n in range(a, b + 1))
    assert held == list(range(11, 31))  # and the output layer, 30
    assert spread["reproducible"]["promised"] is False
    assert replies(server, spread["model"]) == expected
    # two at once, a cancel, then an unload: as with any model
    rids = [
        server.request_async(
            "inference/generate", {"prompt": p, "options": {"maxTokens": 400, "ignoreEos": True, "temperature": 0}}
        )
        for p in PROMPTS[:2]
    ]
    time.sleep(0.5)
    server.cancel(rids[0])
    assert server.response(rids[0], timeout=60)["error"]["code"] == -32800
    assert "result" in server.response(rids[1], timeout=120)
    server.call("model/unload", {"model": spread["model"]})


def test_tensor_split_shares_the_layers(server, servers):
    spread = server.call(
        "model/load", {"options": {**LOCAL, "rpcServers": servers, "tensorSplit": [1, 3]}}, timeout=120
    )
    counts = {d["server"]: sum(b - a + 1 for a, b in d["layers"]) for d in spread["devices"]}
    assert None not in counts  # every layer off this host's CPU (gpuLayers: all)
    assert counts[servers[1]] > 2 * counts[servers[0]] > 0


def test_a_server_that_cannot_be_reached_is_31003_naming_it(server, servers):
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(RpcError) as e:
        server.call("model/load", {"options": {**LOCAL, "rpcServers": [servers[0], dead]}}, timeout=60)
    assert e.value.code == -31003 and dead in e.value.message
    for bad in (["localhost"], ["a:0"], [1], "127.0.0.1:1", [servers[0], servers[0]]):
        with pytest.raises(RpcError) as e:
            server.call("model/load", {"options": {**LOCAL, "rpcServers": bad}})
        assert e.value.code == -32602 and "rpcServers" in e.value.message
    with pytest.raises(RpcError) as e:
        server.call("model/load", {"options": {**LOCAL, "rpcServers": servers, "tensorSplit": [0, 0]}})
    assert e.value.code == -32602 and "tensorSplit" in e.value.message
    # and the server goes on
    assert server.call("inference/generate", {"prompt": "Hi", "options": {"maxTokens": 2}})["text"]


def test_a_server_killed_mid_reply_fails_its_model_and_nothing_else(server, servers):
    other = server.call("model/load", {"options": {**LOCAL, "slots": 1}})
    spread = server.call(
        "model/load",
        {"model": llama_model_path(), "options": {**LOCAL, "rpcServers": servers, "gpuLayers": 20}},
        timeout=120,
    )
    assert spread["model"] != other["model"]
    rid = long_reply(server, spread["model"])
    os.kill(server_pid(servers[1]), signal.SIGKILL)
    err = server.response(rid, timeout=60)["error"]
    assert err["code"] == -32603 and servers[1] in err["message"], err
    status = {m["model"]: m for m in server.call("model/status", {})["models"]}
    assert status[spread["model"]]["state"] == "failed" and servers[1] in status[spread["model"]]["error"]
    # the other model, and kinfer-rpc itself, go on
    r = server.call("inference/generate", {"model": other["model"], "prompt": "Hi", "options": {"maxTokens": 3}})
    assert r["usage"]["completionTokens"] > 0


def test_a_server_that_stops_answering_fails_its_model_after_the_timeout(spawn, servers):
    """A stopped server keeps its connection open: nothing but the socket timeout ends the wait."""
    server = spawn(env={"GGML_RPC_TIMEOUT": "3"})
    server.initialize()
    spread = server.call("model/load", {"options": {**LOCAL, "rpcServers": servers, "gpuLayers": 20}}, timeout=120)
    rid = long_reply(server, spread["model"])
    pid = server_pid(servers[0])
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        err = server.response(rid, timeout=60)["error"]
        waited = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert err["code"] == -32603 and servers[0] in err["message"] and "3 s" in err["message"], err
    assert 2 < waited < 30, waited
    # kinfer-rpc goes on: another load of the model, here, answers
    local = server.call("model/load", {"model": llama_model_path(), "options": {**LOCAL, "slots": 1}})
    r = server.call("inference/generate", {"model": local["model"], "prompt": "Hi", "options": {"maxTokens": 3}})
    assert r["usage"]["completionTokens"] > 0


def long_reply(server, model: str) -> int:
    """A greedy reply of thousands of tokens on `model`, once it streams its first piece: its id."""
    rid = server.request_async(
        "inference/generate",
        {
            "model": model,
            "prompt": "Count to a thousand.",
            "options": {"maxTokens": 4000, "ignoreEos": True, "temperature": 0},
            "partialResultToken": "p",
        },
    )
    server.wait_for(lambda m: m.get("method") == "$/progress", timeout=60)
    return rid


def llama_model_path() -> str:
    """The embedded model by path: a second load beside the one loaded by name."""
    from kinfer_rpc.host.store import embedded_default_path

    return embedded_default_path()


def server_pid(endpoint: str) -> int:
    """The ggml-rpc-server listening on `endpoint`'s port (kinfer rpc-server execs it: same pid)."""
    port = int(endpoint.rsplit(":", 1)[1])
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"ggml-rpc-server") and str(port).encode() in argv:
            return int(entry)
    raise AssertionError(f"no ggml-rpc-server on port {port}")
