"""Reliability: the lifecycle in message order, `exit` whatever its params, and the parent's death.

Each test drives a real `kinfer-rpc` process through tests/rpcclient.py (which checks that stdout
carries nothing but frames and that every message matches spec/metaModel.json); several messages
go to the server in ONE write, so that they all arrive before any of them is answered.
docs/reliability.md describes each test. No test here loads a model: a load-after-shutdown names a
model that does not exist, which is answered -31001 where the load is carried out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from protocol_fixtures import server, spawn  # noqa: F401  (fixtures)
from reliability_helpers import PARENT, subreaper  # noqa: F401  (subreaper: a fixture)
from rpcclient import KINFER_RPC, RpcClient, error_of, frame, result_of, send_together

INVALID_REQUEST = -32600
INVALID_PARAMS = -32602
SERVER_NOT_INITIALIZED = -32002
NO_MODEL = "no-such-model-anywhere"


def _empty_stores(tmp_path) -> dict:
    """Model stores with nothing in them, so that a load of an unknown name fails at once."""
    return {
        "KINFER_MODELS": str(tmp_path / "kinfer"),
        "OLLAMA_MODELS": str(tmp_path / "ollama"),
        "KINFER_HOME": str(tmp_path / "home"),
    }


def _request(c: RpcClient, method: str, params: dict | None = None) -> dict:
    message: dict = {"jsonrpc": "2.0", "id": c.next_id(), "method": method}
    if params is not None:
        message["params"] = params
    return message


# -- state changes take effect in message order -------------------------------------------------


def test_requests_after_shutdown_in_the_same_write_are_refused(spawn, tmp_path):
    c = spawn(env=_empty_stores(tmp_path))
    c.initialize()
    shutdown = _request(c, "shutdown")
    load = _request(c, "model/load", {"model": NO_MODEL})
    generate = _request(c, "inference/generate", {"model": NO_MODEL, "prompt": "hi", "maxTokens": 1})
    listing = _request(c, "model/list")
    send_together(c, [shutdown, load, generate, listing])
    assert result_of(c.response(shutdown["id"])) is None
    for m in (load, generate, listing):
        err = error_of(c.response(m["id"]))
        assert err["code"] == INVALID_REQUEST, (m["method"], err)
        assert "shutting down" in err["message"], err
    assert c.close(timeout=5) == 0


def test_second_initialize_in_the_same_write_is_refused(spawn):
    c = spawn()
    first = _request(c, "initialize", {})
    second = _request(c, "initialize", {})
    send_together(c, [first, second])
    assert "serverInfo" in result_of(c.response(first["id"]))
    err = error_of(c.response(second["id"]))
    assert err["code"] == INVALID_REQUEST, err
    assert "already" in err["message"], err


def test_requests_after_initialize_in_the_same_write_are_served(spawn):
    c = spawn()
    before = _request(c, "model/list")
    init = _request(c, "initialize", {})
    after = _request(c, "model/list")
    send_together(c, [before, init, after])
    assert error_of(c.response(before["id"]))["code"] == SERVER_NOT_INITIALIZED
    assert "serverInfo" in result_of(c.response(init["id"]))
    assert "models" in result_of(c.response(after["id"]))


def test_refused_initialize_leaves_the_server_uninitialized_for_what_follows(spawn):
    c = spawn()
    bad = _request(c, "initialize", {"processId": "not a number"})
    listing = _request(c, "model/list")
    good = _request(c, "initialize", {})
    send_together(c, [bad, listing, good])
    assert error_of(c.response(bad["id"]))["code"] == INVALID_PARAMS
    assert error_of(c.response(listing["id"]))["code"] == SERVER_NOT_INITIALIZED
    assert "serverInfo" in result_of(c.response(good["id"]))


def test_refused_shutdown_leaves_the_server_running_for_what_follows(server):
    bad = _request(server, "shutdown", {"now": True})
    listing = _request(server, "model/list")
    send_together(server, [bad, listing])
    assert error_of(server.response(bad["id"]))["code"] == INVALID_PARAMS
    assert "models" in result_of(server.response(listing["id"]))


def test_shutdown_then_exit_in_the_same_write_exits_0(server):
    shutdown = _request(server, "shutdown")
    send_together(server, [shutdown, {"jsonrpc": "2.0", "method": "exit"}])
    assert server.wait_exit(5.0) == 0


# -- exit whatever its params --------------------------------------------------------------------

EXIT_PARAMS = [{"x": 1}, [], [1, 2], {"self": 1}, {"exit_code": 0}, None, "now", 5, True]


@pytest.mark.parametrize("params", EXIT_PARAMS, ids=repr)
def test_exit_with_any_params_after_shutdown_exits_0(server, params):
    assert result_of(server.request("shutdown")) is None
    server.send_raw(frame({"jsonrpc": "2.0", "method": "exit", "params": params}))
    assert server.wait_exit(3.0) == 0


@pytest.mark.parametrize("params", EXIT_PARAMS, ids=repr)
def test_exit_with_any_params_without_shutdown_exits_1(server, params):
    server.send_raw(frame({"jsonrpc": "2.0", "method": "exit", "params": params}))
    assert server.wait_exit(3.0) == 1


# -- the parent's death, with no process id given ----------------------------------------------


def _wait_adopted(pid: int, timeout: float) -> int | None:
    """The exit code of `pid` (our child once its parent died), or None if it still runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not adopted yet
            done = 0
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    return None


@pytest.mark.parametrize("initialized", [False, True], ids=["uninitialized", "initialized"])
def test_parent_death_without_a_process_id_exits(subreaper, tmp_path, initialized):
    """No --clientProcessId and no initialize processId: the parent dies, stdin stays open (the test
    holds the pipe), so only the watch on the parent process can end the server."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    stderr_file = tempfile.TemporaryFile()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(in_r), str(out_w), KINFER_RPC],
        pass_fds=(in_r, out_w),
        stdout=subprocess.PIPE,
        stderr=stderr_file,
        env={**os.environ, **_empty_stores(tmp_path)},
    )
    os.close(in_r)
    os.close(out_w)
    server_pid = int(parent.stdout.readline())
    stdin = os.fdopen(in_w, "wb", buffering=0)
    stdout = os.fdopen(out_r, "rb", buffering=0)
    try:
        if initialized:
            stdin.write(frame({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}))
            assert b'"serverInfo"' in stdout.read(65536)
        time.sleep(1.5)  # a watch tick or more: the server stays up while its parent lives
        assert os.path.exists(f"/proc/{server_pid}")
        parent.kill()
        parent.wait()
        t = time.monotonic()
        code = _wait_adopted(server_pid, 5.0)
        elapsed = time.monotonic() - t
        state = "initialized" if initialized else "uninitialized"
        print(f"parent killed, no process id ({state}): exit {code} after {elapsed:.3f} s")
        assert code == 1
        assert elapsed < 3.0
        assert stdout.read(65536) == b""  # its stdout closed with it
    finally:
        parent.kill()
        parent.wait()
        try:
            os.kill(server_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait_adopted(server_pid, 5.0)
        stdin.close()
        stdout.close()
    stderr_file.seek(0)
    err = stderr_file.read().decode("utf-8", "replace")
    assert "Traceback" not in err, err


@pytest.mark.model
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_answers_the_requests_in_flight_then_exits(spawn, signum) -> None:  # noqa: F811
    """SIGTERM, SIGINT (Ctrl-C in the server's terminal) or SIGHUP (that terminal closed): every
    request still running is answered -32800 with its partial reply before the server exits with
    128 + the signal."""
    c = spawn()
    c.initialize()
    c.load_model(slots=2)
    long = {"prompt": "Count to a thousand.", "options": {"maxTokens": 5000, "ignoreEos": True}}
    rids = [c.request_async("inference/generate", long) for _ in range(2)]
    time.sleep(0.5)  # both are generating
    c.proc.send_signal(signum)
    assert c.proc.wait(30) == 128 + signum
    for rid in rids:
        err = c.response(rid, timeout=5)["error"]
        assert err["code"] == -32800 and err["data"]["usage"]["completionTokens"] > 0
