"""Reliability: the end of the server cannot be starved. With its event loop held by a real
request, a signal, the end of stdin and the parent's death still end the process within 2 s, with
the exit code the graceful path would give (kinfer_rpc.protocol.watchdog).

What holds the loop: tests/hold_loop.py, kinfer-rpc whose `model/list` blocks the loop's thread
(no request of the product holds it that long any more). docs/reliability.md describes the tests
and the figures measured.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from reliability_helpers import PARENT, subreaper  # noqa: F401  (subreaper: a fixture)
from rpcclient import RpcClient, Timeout, frame

HOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hold_loop.py")
HARD_EXIT = "did not end within"  # what the watchdog writes to stderr when it ends the process


def holding_the_loop() -> list[dict]:
    """The request that holds the server's event loop for two minutes (with tests/hold_loop.py)."""
    return [{"jsonrpc": "2.0", "id": "hold", "method": "model/list"}]


def held_client() -> RpcClient:
    """A server whose loop is held: a request sent after the holder goes unanswered for a second."""
    c = RpcClient.spawn(HOLDER, executable=sys.executable)
    c.initialize()
    c.request_async("model/list")  # the one that holds the loop
    rid = c.request_async("model/status")
    with pytest.raises(Timeout):
        c.response(rid, timeout=1.0)
    return c


@pytest.mark.parametrize("signum", [signal.SIGTERM])  # SIGINT and SIGHUP take the same path
def test_a_signal_ends_a_server_whose_loop_is_held(signum):
    c = held_client()
    try:
        c.proc.send_signal(signum)
        t = time.monotonic()
        code = c.proc.wait(10)
        elapsed = time.monotonic() - t
        print(f"{signal.Signals(signum).name} with the loop held: exit {code} after {elapsed:.3f} s")
        assert code == 128 + signum and elapsed < 2.0
        assert HARD_EXIT in c.stderr_tail() and "Traceback" not in c.stderr_tail()
    finally:
        c.kill()


def test_stdin_closed_ends_a_server_whose_loop_is_held():
    c = held_client()
    try:
        c.proc.stdin.close()
        t = time.monotonic()
        code = c.proc.wait(10)
        elapsed = time.monotonic() - t
        print(f"stdin closed with the loop held: exit {code} after {elapsed:.3f} s")
        assert code == 1 and elapsed < 2.0
        assert HARD_EXIT in c.stderr_tail() and "Traceback" not in c.stderr_tail()
    finally:
        c.kill()


@pytest.mark.parametrize("process_id", [False, True], ids=["parent", "processId"])
def test_parent_death_ends_a_server_whose_loop_is_held(subreaper, process_id):  # noqa: F811
    """The editor dies while the server's stdin stays open (the test holds the pipe): the watch
    on the parent's process (or on initialize's processId) ends the server all the same."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    stderr_file = tempfile.TemporaryFile()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(in_r), str(out_w), sys.executable, HOLDER],
        pass_fds=(in_r, out_w),
        stdout=subprocess.PIPE,
        stderr=stderr_file,
    )
    os.close(in_r)
    os.close(out_w)
    server_pid = int(parent.stdout.readline())
    stdin = os.fdopen(in_w, "wb", buffering=0)
    stdout = os.fdopen(out_r, "rb", buffering=0)
    code = None
    try:
        params = {"processId": parent.pid} if process_id else {}
        stdin.write(frame({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": params}))
        assert b'"serverInfo"' in stdout.read(65536)
        for message in [*holding_the_loop(), {"jsonrpc": "2.0", "id": 2, "method": "model/status"}]:
            stdin.write(frame(message))
        assert select.select([stdout], [], [], 1.0)[0] == []  # held: model/status unanswered
        parent.kill()
        parent.wait()
        t = time.monotonic()
        code = _wait_adopted(server_pid, 10.0)
        elapsed = time.monotonic() - t
        watched = "processId" if process_id else "no process id"
        print(f"parent killed with the loop held ({watched}): exit {code} after {elapsed:.3f} s")
        assert code == 1 and elapsed < 2.5
    finally:
        parent.kill()
        parent.wait()
        if code is None:  # still running (or not reaped): end it
            try:
                os.kill(server_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_adopted(server_pid, 5.0)
        stdin.close()
        stdout.close()
    stderr_file.seek(0)
    err = stderr_file.read().decode("utf-8", "replace")
    assert HARD_EXIT in err and "Traceback" not in err, err


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
