"""`kinfer-rpc --attach` (or KINFER_ATTACH=1): the process an editor spawns becomes a thin proxy
between its stdio and the daemon's socket (kinfer_rpc.protocol.daemon), starting the daemon when
none answers. The editor changes nothing: the same command, the same protocol.

Bytes pass through as they are; the proxy only reads the frames' ids, so that when the daemon
goes away (killed, crashed) every request still waiting is answered -32099 ("server gone")
before the proxy exits, and the editor's next `kinfer-rpc --attach` starts a fresh daemon. The
proxy exits when stdin closes, when the daemon closes the connection (after `exit`: 0 if
`shutdown` came first, else 1, as `kinfer-rpc` does), and when its parent process dies.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kinfer_rpc import errors
from kinfer_rpc.host.store import kinfer_home
from kinfer_rpc.protocol.framing import encode
from kinfer_rpc.protocol.rendezvous import default_socket, live, start_lock

log = logging.getLogger("kinfer_rpc.attach")

START_SECONDS = 120.0  # how long a daemon may take to answer after it was started


class NoDaemon(Exception):
    """No daemon answers and none could be started."""


def daemon_log() -> Path:
    """Where a daemon started by a proxy writes its log (it has no terminal)."""
    return kinfer_home() / "logs" / "daemon.log"


def connect(path: Path, *, start: bool = True) -> socket.socket:
    """A connection to the daemon on `path`, starting one (`kinfer serve`, detached) when none
    answers and `start` says so. Two proxies starting at once end with one daemon: the start
    lock serializes them, and the second finds the first's daemon answering."""
    try:
        return _dial(path)
    except OSError:
        if not start:
            raise NoDaemon(f"no kinfer daemon answers on {path}") from None
    with start_lock(path):
        if not live(path):
            _start(path)
    return _dial(path)


def _dial(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except OSError:
        s.close()
        raise
    return s


def _start(path: Path) -> None:
    """Start a daemon on `path` (the caller holds the start lock) and wait until it answers."""
    logfile = daemon_log()
    logfile.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "kinfer_rpc.protocol.daemon", "--socket", str(path), "--locked"]
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, close_fds=True
        )
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if live(path, timeout=0.5):
            return
        if proc.poll() is not None:
            raise NoDaemon(f"the kinfer daemon exited with {proc.returncode} as it started; see {logfile}")
        time.sleep(0.05)
    raise NoDaemon(f"the kinfer daemon did not answer on {path} within {START_SECONDS:g} s; see {logfile}")


class _Frames:
    """Whole frames out of a byte stream, as (header + body) bytes and the body."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._buf += data
        out: list[tuple[bytes, bytes]] = []
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return out
            length = -1
            for line in bytes(self._buf[:end]).split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length" and value.strip().isdigit():
                    length = int(value.strip())
            if length < 0:  # not a frame we can follow: pass the bytes through as they came
                raw = bytes(self._buf)
                self._buf.clear()
                out.append((raw, b""))
                return out
            total = end + 4 + length
            if len(self._buf) < total:
                return out
            frame = bytes(self._buf[:total])
            del self._buf[:total]
            out.append((frame, frame[end + 4 :]))


class Proxy:
    """Pumps bytes both ways, keeping the ids of the requests not answered yet."""

    def __init__(self, sock: socket.socket, stdin: int = 0, stdout: int = 1):
        self.sock = sock
        self.stdin = stdin
        self.stdout = stdout
        self.pending: set[Any] = set()
        self.lock = threading.Lock()
        self.shutdown_asked = False
        self.exit_sent = False
        self.done = threading.Event()
        self.code = 1

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.stdout, view)
            view = view[n:]

    def editor_to_daemon(self) -> None:
        frames = _Frames()
        try:
            while True:
                data = os.read(self.stdin, 1 << 16)
                if not data:
                    break
                for _frame, body in frames.feed(data):
                    self._note_request(body)
                self.sock.sendall(data)
        except OSError:
            pass
        finally:
            # The editor is gone (stdin closed): the daemon ends the session when the socket does.
            try:
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            if not self.exit_sent:
                self.code = 0 if self.shutdown_asked else 1
            self.done.set()

    def _note_request(self, body: bytes) -> None:
        try:
            message = json.loads(body)
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        method = message.get("method")
        if "id" in message and isinstance(method, str):
            with self.lock:
                self.pending.add(_key(message["id"]))
            if method == "shutdown":
                self.shutdown_asked = True
        elif method == "exit":
            self.exit_sent = True

    def daemon_to_editor(self) -> None:
        frames = _Frames()
        try:
            while True:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                for _frame, body in frames.feed(data):
                    # Only answers end a request: notifications and the server's own requests
                    # name their method within the first bytes (the daemon writes it second).
                    if body and b'"method":' not in body[:200]:
                        self._note_answer(body)
                self._write(data)
        except OSError:
            pass
        finally:
            if not self.exit_sent:
                self._gone()
            else:
                self.code = 0 if self.shutdown_asked else 1
            self.done.set()

    def _note_answer(self, body: bytes) -> None:
        try:
            message = json.loads(body)
        except ValueError:
            return
        if isinstance(message, dict) and "id" in message:
            with self.lock:
                self.pending.discard(_key(message["id"]))

    def _gone(self) -> None:
        """The daemon went away: every request still waiting is answered -32099."""
        with self.lock:
            waiting, self.pending = list(self.pending), set()
        for _, rid in waiting:
            error = {
                "code": errors.SERVER_GONE,
                "message": "the kinfer daemon went away before it answered; the next kinfer-rpc --attach starts "
                "a fresh one",
            }
            try:
                self._write(encode({"jsonrpc": "2.0", "id": rid, "error": error}))
            except OSError:
                return
        self.code = 1


def _key(rid: Any) -> tuple[str, Any]:
    """An id as JSON tells it apart: 1 and "1" are different requests."""
    return (type(rid).__name__, rid)


def run(path: Path | None = None, *, stdout_fd: int = 1) -> int:
    """Connect (starting the daemon if need be) and proxy until either side ends."""
    path = path or default_socket()
    try:
        sock = connect(path)
    except (NoDaemon, OSError) as exc:
        print(f"kinfer-rpc --attach: {exc}", file=sys.stderr)
        return 1
    proxy = Proxy(sock, stdout=stdout_fd)
    parent = os.getppid()
    threading.Thread(target=proxy.editor_to_daemon, name="kinfer-attach-in", daemon=True).start()
    threading.Thread(target=proxy.daemon_to_editor, name="kinfer-attach-out", daemon=True).start()
    while not proxy.done.wait(1.0):
        if os.getppid() != parent:  # the editor died without closing our stdin
            log.warning("the parent process %d died; exiting", parent)
            break
    sock.close()
    return proxy.code
