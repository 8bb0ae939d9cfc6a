"""Reliability: dying clients. The server exits promptly, leaving nothing behind, when its client
closes stdin, sends exit, closes stdout, or dies while another process holds the pipe.

Each test drives a real `kinfer-rpc` process through tests/rpcclient.py (which checks that stdout
carries nothing but frames and that every message matches spec/metaModel.json); docs/reliability.md
describes each test and the figures measured. Shared helpers: reliability_helpers.py, conftest.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from protocol_fixtures import spawn  # noqa: F401  (fixture)
from reliability_helpers import (  # noqa: F401  (subreaper: a fixture)
    PARENT,
    children_of,
    no_traceback,
    subreaper,
    threads_and_fds,
)
from rpcclient import DEFAULT_MODEL, KINFER_RPC, RpcClient, responses_by_id

pytestmark = pytest.mark.model  # every test here loads a real model


def _isolated_env(tmp_path) -> tuple[dict, str, str]:
    tmp = tmp_path / "server-tmp"
    home = tmp_path / "kinfer-home"
    tmp.mkdir()
    home.mkdir()
    return {"TMPDIR": str(tmp), "KINFER_HOME": str(home)}, str(tmp), str(home)


def _start_long_generations(c: RpcClient, n: int, slots: int) -> list:
    c.call("model/load", {"model": DEFAULT_MODEL, "options": {"contextLength": 2048, "slots": slots}}, timeout=60)
    rids = [
        c.request_async(
            "inference/generate",
            {
                "prompt": f"Story {i}:",
                "partialResultToken": f"long{i}",
                "options": {"maxTokens": 2000, "ignoreEos": True},
            },
        )
        for i in range(n)
    ]
    for i in range(min(n, slots)):
        c.wait_for(lambda m, t=f"long{i}": m.get("method") == "$/progress" and m["params"]["token"] == t, timeout=60)
    return rids


def _deleted_or_tmp_files(pid: int, tmp: str) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(tmp):
            out.append(target)
    return out


def test_stdin_closed_mid_generation_exits_within_2_seconds_leaving_nothing(spawn, tmp_path):
    env, tmp, home = _isolated_env(tmp_path)
    c = spawn(env=env)
    c.initialize()
    rids = _start_long_generations(c, 6, slots=4)  # 4 decoding, 2 queued
    pid = c.proc.pid
    assert children_of(pid) == []
    assert _deleted_or_tmp_files(pid, tmp) == []
    threads, _ = threads_and_fds(pid)
    t = time.monotonic()
    code = c.close(timeout=10)
    elapsed = time.monotonic() - t
    print(f"stdin closed with 4 decoding + 2 queued ({threads} threads): exit {code} after {elapsed:.3f} s")
    assert code == 1
    assert elapsed < 2.0
    assert not os.path.exists(f"/proc/{pid}")  # reaped: no zombie
    assert os.listdir(tmp) == [] and os.listdir(home) == []
    # nothing is answered twice; what is answered before the exit is a whole frame (assert_clean)
    for rid in rids:
        assert len(responses_by_id(c).get(rid, [])) <= 1
    c.assert_clean()
    no_traceback(c)


def test_exit_notification_mid_generation_exits_promptly(spawn, tmp_path):
    env, tmp, home = _isolated_env(tmp_path)
    c = spawn(env=env)
    c.initialize()
    _start_long_generations(c, 3, slots=2)
    t = time.monotonic()
    c.notify("exit")
    code = c.wait_exit(10)
    elapsed = time.monotonic() - t
    print(f"exit notification with 2 decoding + 1 queued: exit {code} after {elapsed:.3f} s")
    assert code == 1 and elapsed < 2.0
    assert os.listdir(tmp) == [] and os.listdir(home) == []


def test_stdout_closed_mid_generation_exits_promptly(tmp_path):
    """A client that stops reading (closes its end of the server's stdout) while tokens stream: the next
    write fails (EPIPE) and the server exits instead of generating for nobody."""
    env, tmp, home = _isolated_env(tmp_path)
    stderr_file = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [KINFER_RPC],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr_file,
        env={**os.environ, **env},
        bufsize=0,
    )
    try:

        def send(message):
            body = json.dumps(message).encode()
            proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

        send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"processId": None}})
        send(
            {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "model/load",
                "params": {"model": DEFAULT_MODEL, "options": {"contextLength": 2048, "slots": 2}},
            }
        )
        for i in range(3):
            send(
                {
                    "jsonrpc": "2.0",
                    "id": 10 + i,
                    "method": "inference/generate",
                    "params": {
                        "prompt": "Story:",
                        "partialResultToken": i,
                        "options": {"maxTokens": 2000, "ignoreEos": True},
                    },
                }
            )
        seen = b""
        deadline = time.monotonic() + 60
        while seen.count(b'"$/progress"') < 4:  # the generations are streaming
            assert time.monotonic() < deadline, seen[-2000:]
            seen += os.read(proc.stdout.fileno(), 65536)
        t = time.monotonic()
        proc.stdout.close()
        code = proc.wait(10)
        elapsed = time.monotonic() - t
        print(f"stdout closed with 2 decoding + 1 queued: exit {code} after {elapsed:.3f} s")
        assert code == 1 and elapsed < 2.0
        assert os.listdir(tmp) == [] and os.listdir(home) == []
        stderr_file.seek(0)
        err = stderr_file.read().decode("utf-8", "replace")
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


class Adopted:
    """A Popen-like handle on a process that is not our child until its parent dies: we are its subreaper."""

    def __init__(self, pid: int, stdin_fd: int, stdout_fd: int):
        self.pid = pid
        self.stdin = os.fdopen(stdin_fd, "wb", buffering=0)
        self.stdout = os.fdopen(stdout_fd, "rb", buffering=0)
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not adopted yet
                return None
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.005)
        return self.returncode

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("how", ["processId", "--clientProcessId"])
def test_parent_death_exits_within_3_seconds(subreaper, tmp_path, how):
    """The editor dies but the server's stdin stays open (someone else holds the pipe): only the
    process watch can notice (it checks five times a second, kinfer_rpc.protocol.watchdog). The
    server must exit within 3 seconds with code 1, leaving nothing behind."""
    env, tmp, home = _isolated_env(tmp_path)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    stderr_file = tempfile.TemporaryFile()
    extra = ["--clientProcessId", "PARENT_PID"] if how == "--clientProcessId" else []
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(in_r), str(out_w), KINFER_RPC, *extra],
        pass_fds=(in_r, out_w),
        stdout=subprocess.PIPE,
        stderr=stderr_file,
        env={**os.environ, **env},
    )
    os.close(in_r)
    os.close(out_w)
    server_pid = int(parent.stdout.readline())
    proc = Adopted(server_pid, in_w, out_r)
    c = RpcClient(proc, stderr_file, time.monotonic())
    try:
        c.initialize({"processId": parent.pid} if how == "processId" else None)
        _start_long_generations(c, 3, slots=2)
        parent.kill()
        parent.wait()
        t = time.monotonic()
        code = proc.wait(10)
        elapsed = time.monotonic() - t
        print(f"parent killed ({how}) with 2 decoding + 1 queued: exit {code} after {elapsed:.3f} s")
        assert code == 1
        assert elapsed < 3.0
        assert not os.path.exists(f"/proc/{server_pid}")
        assert os.listdir(tmp) == [] and os.listdir(home) == []
        c._reader.join(5)
        assert c.eof  # its stdout closed with it
        c.assert_clean()
        no_traceback(c)
    finally:
        proc.kill()
        parent.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        proc.stdin.close()
