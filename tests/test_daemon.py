"""The daemon (`kinfer serve`) and `kinfer-rpc --attach`, as users run them: real processes, the
embedded model, the Python client through the proxy, raw sockets where a hostile client is the
point. See the spec's "Daemon" section."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer_rpc.client import Client, InvalidParams, RequestCancelled, ServerGone
from kinfer_rpc.host.store import DEFAULT_MODEL

pytestmark = pytest.mark.model

BIN = Path(sys.executable).parent
KINFER = str(BIN / "kinfer")
KINFER_RPC = str(BIN / "kinfer-rpc")


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env.update(KINFER_HOME=str(home), KINFER_MODELS=str(home / "models"), OLLAMA_MODELS=str(home / "ollama"))
    return env


def _live(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def _wait(cond, timeout=60.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Daemon:
    def __init__(self, home: Path, *extra: str, env: dict[str, str] | None = None):
        self.home = home
        self.socket = home / "run" / "kinfer.sock"
        self.env = {**_env(home), **(env or {})}
        self.log = open(home / f"daemon-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [KINFER, "serve", "--socket", str(self.socket), "--log-level", "info", *extra],
            env=self.env,
            stdout=self.log,
            stderr=self.log,
        )
        _wait(lambda: _live(self.socket) or self.proc.poll() is not None, what="the daemon")
        assert self.proc.poll() is None, self.text()

    def text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def client(self, **kw) -> Client:
        return Client([KINFER_RPC, "--attach", "--socket", str(self.socket)], env=self.env, **kw)

    def status(self) -> list[dict]:
        with self.client() as c:
            return [m for m in c.request("model/status", {})["models"]]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self.log.close()
        return code


@pytest.fixture(autouse=True)
def _no_daemon_left(tmp_path):
    """A daemon a test's proxy started under tmp_path never outlives the test, failed or not."""
    yield
    subprocess.run(["pkill", "-f", f"--socket {tmp_path}"], check=False)


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    try:
        yield d
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(10)


def test_two_clients_share_one_loaded_model(daemon):
    a, b = daemon.client(), daemon.client()
    try:
        assert a.load(None).model == b.load(None).model == DEFAULT_MODEL
        (status,) = a.request("model/status", {})["models"]
        assert status["holders"] == 2 and status["loads"] == 2  # loaded once, held by both
        assert status["keepAlive"] == 300  # the daemon's default, 5 minutes
        alone = a.generate("Once upon a time", maxTokens=16, temperature=0, seed=1).tokens
        out = {}

        def other():
            out["b"] = b.generate("Once upon a time", maxTokens=16, temperature=0, seed=1).tokens

        t = threading.Thread(target=other)
        t.start()
        streamed = []
        for i, piece in enumerate(a.stream_generate("Tell me a long story", maxTokens=400, temperature=0)):
            streamed.append(piece)
            if i == 4:
                break  # cancels on the server; b's request goes on
        t.join(60)
        assert out["b"] == alone and len(streamed) == 5
    finally:
        a.close()
    assert [m["holders"] for m in b.request("model/status", {})["models"]] == [1]  # a released it
    b.close()
    assert daemon.proc.poll() is None  # shutdown and exit ended the connections, not the daemon
    assert daemon.stop() == 0


def test_a_load_with_other_options_is_refused_naming_the_option(daemon):
    with daemon.client() as a, daemon.client() as b:
        a.load(None, contextLength=512)
        with pytest.raises(InvalidParams) as e:
            b.load(None, contextLength=1024)
        assert "contextLength" in e.value.message and e.value.data["field"] == "options.contextLength"
        assert b.load(None, contextLength=512).model == DEFAULT_MODEL  # the same value: shared


def test_keep_alive_zero_unloads_once_idle_and_pin_keeps_it(daemon):
    with daemon.client() as c:
        c.request("model/load", {"keepAlive": 0})
        c.generate("Hi", maxTokens=2, temperature=0)
        _wait(lambda: c.request("model/status", {})["models"] == [], 10, "the idle model's unload")
        c.request("model/load", {"keepAlive": "0s", "pin": True})
        time.sleep(1.5)
        (m,) = c.request("model/status", {})["models"]
        assert m["pinned"] is True and "expiresIn" not in m
        c.request("model/load", {"pin": False})
        _wait(lambda: c.request("model/status", {})["models"] == [], 10, "the unpinned model's unload")
        with pytest.raises(InvalidParams, match="keepAlive"):
            c.request("model/load", {"keepAlive": "soon"})


def test_the_daemon_killed_mid_stream_answers_minus_32099_and_a_new_one_starts(tmp_path):
    daemon = Daemon(tmp_path)
    c = daemon.client()
    c.load(None)
    got = []
    with pytest.raises(ServerGone):
        for piece in c.stream_generate("Tell me a very long story", maxTokens=2000, temperature=0, ignoreEos=True):
            got.append(piece)
            if len(got) == 3:
                daemon.proc.kill()
    assert len(got) >= 3  # what had come stays with the client
    c.close(timeout=10)
    daemon.proc.wait(10)
    # The next attach starts a fresh daemon (the socket left behind is a dead one's).
    with Client([KINFER_RPC, "--attach", "--socket", str(daemon.socket)], env=daemon.env) as fresh:
        assert fresh.generate("Hi", maxTokens=2, temperature=0).usage.completion_tokens == 2
    pid = int(
        subprocess.check_output(["pgrep", "-f", f"kinfer_rpc.protocol.daemon --socket {daemon.socket}"]).split()[0]
    )
    os.kill(pid, signal.SIGTERM)
    _wait(lambda: not _live(daemon.socket), 30, "the started daemon to stop")


def test_two_proxies_starting_at_once_end_with_one_daemon(tmp_path):
    sock = tmp_path / "run" / "kinfer.sock"
    env = _env(tmp_path)
    replies: list[int] = []

    def ask():
        with Client([KINFER_RPC, "--attach", "--socket", str(sock)], env=env) as c:
            replies.append(c.generate("Hi", maxTokens=2, temperature=0).usage.completion_tokens)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert replies == [2, 2, 2]
    pids = subprocess.check_output(["pgrep", "-f", f"kinfer_rpc.protocol.daemon --socket {sock}"]).split()
    assert len(pids) == 1
    os.kill(int(pids[0]), signal.SIGTERM)
    _wait(lambda: not _live(sock), 30, "the daemon to stop")


def test_a_client_killed_mid_stream_leaves_nothing_behind(daemon, tmp_path):
    script = tmp_path / "client.py"
    script.write_text(
        "import sys\nfrom kinfer_rpc.client import Client\n"
        f"c = Client({[KINFER_RPC, '--attach', '--socket', str(daemon.socket)]!r})\n"
        "for piece in c.stream_generate('Tell me a very long story', maxTokens=4000, ignoreEos=True):\n"
        "    print(piece, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], env=daemon.env, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()  # streaming
    with daemon.client() as other:
        other.load(None)
        proc.kill()
        proc.wait(10)
        _wait(lambda: other.request("model/status", {})["models"][0]["slotsBusy"] == 0, 20, "the request's cancel")
        (m,) = other.request("model/status", {})["models"]
        assert m["holders"] == 1  # only `other`: the killed client's hold went with its connection
        assert other.generate("Hi", maxTokens=3, temperature=0).usage.completion_tokens == 3


def test_sigterm_answers_what_runs_and_exits_zero(daemon):
    c = daemon.client()
    c.load(None)
    errors: list[BaseException] = []

    def long():
        try:
            c.generate("Tell me a very long story", maxTokens=4000, ignoreEos=True)
        except BaseException as exc:  # noqa: BLE001 - the answer is what is checked
            errors.append(exc)

    t = threading.Thread(target=long)
    t.start()
    _wait(lambda: daemon.status()[0]["slotsBusy"] == 1, 30, "the request to run")
    assert subprocess.run([KINFER, "stop", "--socket", str(daemon.socket)], env=daemon.env).returncode == 0
    t.join(30)
    assert isinstance(errors[0], RequestCancelled) and "daemon is stopping" in errors[0].message
    assert errors[0].partial is not None and errors[0].partial.usage.completion_tokens > 0
    assert daemon.proc.wait(30) == 0
    assert not daemon.socket.exists()
    c.close(timeout=10)


def test_only_its_owner_gets_in(daemon):
    assert os.stat(daemon.socket).st_mode & 0o777 == 0o600
    assert os.stat(daemon.socket.parent).st_mode & 0o777 == 0o700
    if os.getuid() != 0:
        pytest.skip("connecting as another user needs root")
    probe = (
        "import os, socket, sys\nos.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n    print('refused', e.errno); sys.exit(0)\n"
        "s.settimeout(10); print(s.recv(4096).decode(errors='replace'))\n"
    )
    # Another user cannot even reach the socket...
    out = subprocess.run([sys.executable, "-c", probe, str(daemon.socket)], capture_output=True, text=True)
    assert out.stdout.startswith("refused"), out
    # ... and where the file system would let them (a socket made reachable by hand, in a folder
    # they can enter), the daemon still refuses them by their credentials.
    import tempfile

    open_home = Path(tempfile.mkdtemp(prefix="kinfer-peer-"))
    other = Daemon(open_home)
    try:
        for folder in (open_home, open_home / "run"):
            os.chmod(folder, 0o755)
        os.chmod(other.socket, 0o666)
        out = subprocess.run([sys.executable, "-c", probe, str(other.socket)], capture_output=True, text=True)
        assert "only the user who started it" in out.stdout, out
        assert "refused a connection from uid 65534" in other.text()
    finally:
        assert other.stop() == 0
        subprocess.run(["rm", "-rf", str(open_home)])


def test_a_live_socket_is_never_taken_and_a_dead_one_is_replaced(daemon, tmp_path):
    second = subprocess.run(
        [KINFER, "serve", "--socket", str(daemon.socket)], env=daemon.env, capture_output=True, text=True, timeout=60
    )
    assert second.returncode == 1 and "already answers" in second.stderr
    assert daemon.proc.poll() is None
    stale = tmp_path / "stale" / "kinfer.sock"
    stale.parent.mkdir(mode=0o700)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # a socket file nobody listens on
    replaced = subprocess.Popen([KINFER, "serve", "--socket", str(stale)], env=daemon.env, stderr=subprocess.PIPE)
    _wait(lambda: _live(stale), 60, "the daemon on the stale socket")
    replaced.send_signal(signal.SIGTERM)
    assert replaced.wait(30) == 0


def test_a_bad_frame_affects_only_its_connection(daemon):
    with daemon.client() as good:
        good.load(None)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(daemon.socket))
            s.sendall(b"Content-Length: 5\r\n\r\n{oops")
            s.settimeout(10)
            answer = s.recv(65536)
            assert b"-32700" in answer  # a parse error, answered on that connection only
        assert good.generate("Hi", maxTokens=3, temperature=0).usage.completion_tokens == 3


def test_kinfer_uses_the_daemon_when_one_runs(tmp_path):
    env = _env(tmp_path)
    d = Daemon(tmp_path)
    default = tmp_path / "run" / "kinfer.sock"
    assert d.socket == default
    try:
        out = subprocess.run(
            [KINFER, "chat", "Say hi", "--max-tokens", "4", "--temperature", "0"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "connection" in d.text()  # the chat's kinfer-rpc attached to the daemon
        ps = subprocess.run([KINFER, "ps", "--json"], env=env, capture_output=True, text=True, timeout=60)
        servers = json.loads(ps.stdout)
        (mine,) = [s for s in servers if s["pid"] == d.proc.pid]
        assert mine["daemon"]["socket"] == str(default)
        assert [m["name"] for m in mine["models"]] == [DEFAULT_MODEL]  # loaded by the chat, kept warm
    finally:
        assert d.stop() == 0


# -- the promise across connections ----------------------------------------------------------------
@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("promise"))
    clients = [d.client() for _ in range(3)]
    try:
        for c in clients:
            c.load(None)
        yield clients
    finally:
        for c in clients:
            c.close()
        d.stop()


WORDS = ["river", "cloud", "seven", "quiet", "engine", "maple", "north", "glass", "paper", "lion"]
requests_ = st.lists(
    st.tuples(
        st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join),
        st.integers(1, 24),  # maxTokens
        st.sampled_from([0.0, 0.8]),  # greedy or seeded
        st.integers(0, 2**31),  # seed
        st.integers(0, 2),  # which connection sends it
    ),
    min_size=2,
    max_size=8,
)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=requests_)
def test_a_request_gets_its_lone_reply_whatever_other_connections_run(shared, batch):
    def ask(client, prompt, max_tokens, temperature, seed):
        return client.generate(prompt, maxTokens=max_tokens, temperature=temperature, seed=seed).tokens

    alone = [ask(shared[0], p, n, t, s) for p, n, t, s, _ in batch]
    together: dict[int, list[int]] = {}

    def one(i: int) -> None:
        p, n, t, s, who = batch[i]
        together[i] = ask(shared[who], p, n, t, s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [together[i] for i in range(len(batch))] == alone


def _frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def test_a_client_that_never_reads_is_closed_and_others_are_served(tmp_path):
    d = Daemon(tmp_path, env={"KINFER_SEND_SECONDS": "2"})
    try:
        with d.client() as good:
            good.load(None)
            s = socket.socket(socket.AF_UNIX)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(str(d.socket))
            s.sendall(_frame({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}}))
            text = "word " * 20000  # each answer a few hundred kilobytes, never read
            for i in range(40):
                s.sendall(
                    _frame({"jsonrpc": "2.0", "id": i + 1, "method": "inference/tokenize", "params": {"text": text}})
                )
            t = time.monotonic()
            assert good.generate("Hi", maxTokens=3, temperature=0).usage.completion_tokens == 3
            assert time.monotonic() - t < 20
            _wait(lambda: "read nothing for 2 s" in d.text(), 30, "the stuck connection to be closed")
            s.close()
            assert good.generate("Hi", maxTokens=3, temperature=0).usage.completion_tokens == 3
    finally:
        assert d.stop() == 0


def test_connections_past_the_limit_are_refused_and_the_rest_served(daemon):
    from kinfer_rpc.protocol.daemon import MAX_CONNECTIONS

    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(daemon.socket))
            held.append(s)
        _wait(lambda: f"({MAX_CONNECTIONS} open)" in daemon.text(), 60, "every connection to be accepted")
        with socket.socket(socket.AF_UNIX) as extra:
            extra.connect(str(daemon.socket))
            extra.settimeout(10)
            assert b"connections open, its most" in extra.recv(4096)
    finally:
        for s in held:
            s.close()
    _wait(lambda: "(0 open)" in daemon.text(), 60, "the connections to close")
    with daemon.client() as c:  # served again
        assert c.generate("Hi", maxTokens=2, temperature=0).usage.completion_tokens == 2


def test_the_python_client_sends_a_requests_keep_alive(daemon):
    with daemon.client() as c:
        c.generate("Hi", maxTokens=2, temperature=0, keep_alive="7m")
        (m,) = c.request("model/status", {})["models"]
        assert m["keepAlive"] == 420
        c.chat([{"role": "user", "content": "Hi"}], maxTokens=2, keep_alive=-1)
        assert c.request("model/status", {})["models"][0]["keepAlive"] == -1
