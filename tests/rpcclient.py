"""A raw test client for `kinfer-rpc`: frames over the process's stdin/stdout, nothing else.

It records every message the server sends, checks that stdout carries nothing but well-formed
frames, and validates each message against spec/metaModel.json; anything wrong is recorded in
`failures` (`assert_clean()` raises on them). Every wait has a timeout, so no test can hang.

    with RpcClient.spawn() as c:
        c.initialize()
        r = c.request("model/list")          # the whole response message
        c.call("model/status")               # the result, or raises RpcError
        c.notify("$/cancelRequest", {"id": 3})
        c.send_raw(b"garbage")
        c.wait_for(lambda m: m.get("method") == "window/logMessage")
        code = c.close()                     # closes stdin, returns the exit code
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import metamodel

# the server as clients find it: $KINFER_RPC when set (an installed copy), else the one beside this Python
KINFER_RPC = os.environ.get("KINFER_RPC") or os.path.join(os.path.dirname(sys.executable), "kinfer-rpc")
DEFAULT_MODEL = "smollm2-135m-instruct"
_HEADER = re.compile(
    rb"Content-Length: ([0-9]+)\r\n(?:Content-Type: application/vscode-jsonrpc; charset=utf-8\r\n)?\r\n"
)


class RpcError(Exception):
    """An error response, raised by `call`."""

    def __init__(self, error: dict):
        super().__init__(f"{error.get('code')}: {error.get('message')}")
        self.code = error.get("code")
        self.message = error.get("message")
        self.data = error.get("data")
        self.error = error


class Timeout(AssertionError):
    pass


def _no_constants(name):
    raise ValueError(f"{name} is not JSON")


class RpcClient:
    def __init__(self, proc: subprocess.Popen, stderr_file, started: float):
        self.proc = proc
        self.started = started
        self._stderr = stderr_file
        self._cond = threading.Condition()
        self.messages: list[dict] = []  # every message the server sent, in order
        self.times: list[float] = []  # when each arrived (time.monotonic())
        self.responses: dict[Any, dict] = {}
        self.failures: list[str] = []
        self.methods: dict[Any, str] = {}  # request id -> method, for what we sent
        self._all_methods: dict[Any, list[str]] = {}  # request id -> every method sent with it
        self.tokens: dict[Any, tuple[str, str]] = {}  # progress token -> (method, kind)
        self.stdout_bytes = 0  # every byte read from stdout
        self.frame_bytes = 0  # the bytes of well-formed frames among them
        self._sent_ids: dict = {}  # request id -> how many requests we sent with it
        self._answered: dict = {}  # request id -> how many responses came
        self.eof = False
        self._ids = itertools.count(1)
        self._reader = threading.Thread(target=self._read, name="rpcclient-reader", daemon=True)
        self._reader.start()

    @classmethod
    def spawn(cls, *args: str, env: dict | None = None, executable: str = KINFER_RPC) -> RpcClient:
        stderr_file = tempfile.TemporaryFile()
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        started = time.monotonic()
        proc = subprocess.Popen(
            [executable, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr_file,
            env=full_env,
            bufsize=0,
        )
        return cls(proc, stderr_file, started)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(check=False)

    # -- reading ----------------------------------------------------------------------------
    def _fail(self, text: str) -> None:
        with self._cond:
            self.failures.append(text)
            self._cond.notify_all()

    def _read(self) -> None:
        buf = b""
        fd = self.proc.stdout.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            self.stdout_bytes += len(chunk)
            buf += chunk
            while buf:
                m = _HEADER.match(buf)
                if m is None:
                    if len(buf) >= 200 or not _could_be_header(buf):
                        self._fail(f"stdout carries something that is not a frame: {buf[:200]!r}")
                        nxt = buf.find(b"Content-Length: ", 1)
                        buf = buf[nxt:] if nxt > 0 else b""
                        continue
                    break
                n = int(m.group(1))
                if len(buf) < m.end() + n:
                    break
                body = buf[m.end() : m.end() + n]
                buf = buf[m.end() + n :]
                self.frame_bytes += m.end() + n
                self._take(body)
        if buf:
            self._fail(f"stdout ended inside a frame: {buf[:200]!r}")
        with self._cond:
            self.eof = True
            self._cond.notify_all()

    def _take(self, body: bytes) -> None:
        try:
            message = json.loads(body.decode("utf-8"), parse_constant=_no_constants)
        except (UnicodeDecodeError, ValueError) as exc:
            self._fail(f"a frame body is not UTF-8 JSON ({exc}): {body[:200]!r}")
            return
        problems = self._problems(message)
        with self._cond:
            self.messages.append(message)
            self.times.append(time.monotonic())
            for p in problems:
                self.failures.append(f"{p}\n  message: {json.dumps(message)[:600]}")
            if isinstance(message, dict) and "method" not in message and ("result" in message or "error" in message):
                rid = message.get("id")
                if rid is not None:
                    key = _key(rid)
                    self._answered[key] = self._answered.get(key, 0) + 1
                    if key in self._sent_ids and self._answered[key] > self._sent_ids[key]:
                        self.failures.append(f"more responses to id {rid!r} than requests sent with it")
                    self.responses[key] = message
            self._cond.notify_all()

    def _problems(self, message) -> list[str]:
        # An id the client reused may belong to several methods: the response may be any one's.
        try:
            candidates = self._all_methods.get(_key(message.get("id")), [None]) if isinstance(message, dict) else [None]
        except TypeError:
            candidates = [None]
        problems: list[str] = []
        for method in candidates[::-1] or [None]:
            problems = metamodel.model().problems(message, lambda rid, m=method: m, self._token_owner)
            if not problems:
                return []
        return problems

    def _token_owner(self, token):
        try:
            return self.tokens.get(_key(token))
        except TypeError:
            return None

    # -- writing ----------------------------------------------------------------------------
    def send_raw(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise ConnectionError(f"the server's stdin is closed ({exc}); stderr:\n{self.stderr_tail()}") from exc

    def send(self, message: dict, prefix: bytes = b"") -> None:
        """Send one message as a frame (after `prefix`, in the same write), remembering the method of
        request ids and progress tokens."""
        if "id" in message:
            try:
                key = _key(message["id"])
                self._sent_ids[key] = self._sent_ids.get(key, 0) + 1  # each may be answered once
                if "method" in message:
                    self.methods[key] = message["method"]
                    self._all_methods.setdefault(key, []).append(message["method"])
            except TypeError:  # an id that is not hashable (a test of bad ids)
                pass
        if "id" in message and "method" in message:
            params = message.get("params")
            if isinstance(params, dict):
                for name, kind in (("partialResultToken", "partialResult"), ("workDoneToken", "workDone")):
                    tok = params.get(name)
                    if tok is not None:
                        try:
                            self.tokens[_key(tok)] = (message["method"], kind)
                        except TypeError:
                            pass
        self.send_raw(prefix + frame(message))

    def expect(self, rid: Any, method: str) -> None:
        """Tell the client that bytes sent raw may hold requests with this id for this method (any number)."""
        key = _key(rid)
        self.methods[key] = method
        self._all_methods.setdefault(key, []).append(method)
        self._sent_ids[key] = float("inf")

    def next_id(self) -> str:
        return f"t{next(self._ids)}"

    def request_async(
        self, method: str, params: Any = None, *, id: Any = None, omit_params: bool = False, prefix: bytes = b""
    ) -> Any:
        """Send a request without waiting (after `prefix` bytes, in the same write); return its id."""
        rid = self.next_id() if id is None else id
        message = {"jsonrpc": "2.0", "id": rid, "method": method}
        if not omit_params:
            message["params"] = params if params is not None else {}
        self.send(message, prefix)
        return rid

    def request(
        self, method: str, params: Any = None, *, timeout: float = 30.0, id: Any = None, omit_params: bool = False
    ) -> dict:
        """Send a request and return its response message (result or error)."""
        rid = self.request_async(method, params, id=id, omit_params=omit_params)
        return self.response(rid, timeout=timeout)

    def call(self, method: str, params: Any = None, *, timeout: float = 30.0) -> Any:
        """Send a request and return its result; raise RpcError for an error response."""
        response = self.request(method, params, timeout=timeout)
        if "error" in response:
            raise RpcError(response["error"])
        return response["result"]

    def notify(self, method: str, params: Any = None) -> None:
        message = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)

    def cancel(self, rid: Any) -> None:
        self.notify("$/cancelRequest", {"id": rid})

    def initialize(self, params: dict | None = None, *, timeout: float = 10.0) -> dict:
        """`initialize` (processId null unless given) then `initialized`; return the result."""
        p = {"processId": None, "clientInfo": {"name": "rpcclient"}, "capabilities": {}}
        p.update(params or {})
        result = self.call("initialize", p, timeout=timeout)
        self.notify("initialized", {})
        return result

    def load_model(self, model: str = DEFAULT_MODEL, timeout: float = 60.0, **options) -> dict:
        """`model/load` with small defaults (contextLength 256, one slot) unless options say otherwise."""
        opts = {"contextLength": 256, "slots": 1}
        opts.update(options)
        return self.call("model/load", {"model": model, "options": opts}, timeout=timeout)

    # -- waiting ----------------------------------------------------------------------------
    def response(self, rid: Any, timeout: float = 30.0) -> dict:
        key = _key(rid)
        msg = self._wait(lambda: self.responses.get(key), timeout, f"the response to id {rid!r}")
        return msg

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float = 10.0, start: int = 0) -> dict:
        """The first message (from index `start`) the predicate accepts; raises Timeout."""

        def find():
            for m in self.messages[start:]:
                if predicate(m):
                    return m
            return None

        return self._wait(find, timeout, "a message matching the predicate")

    def _wait(self, find, timeout, what):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = find()
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(
                        f"no {what} within {timeout} s; last messages: "
                        f"{[json.dumps(m)[:200] for m in self.messages[-5:]]}; stderr:\n{self.stderr_tail()}"
                    )
                if self.eof:
                    raise ConnectionError(
                        f"the server closed stdout before {what}; exit code "
                        f"{self.proc.poll()}; stderr:\n{self.stderr_tail()}"
                    )
                self._cond.wait(min(left, 0.1))

    def progress(self, token) -> list:
        """The values of every $/progress sent so far for a token, in order."""
        with self._cond:
            return [
                m["params"]["value"]
                for m in self.messages
                if m.get("method") == "$/progress"
                and isinstance(m.get("params"), dict)
                and m["params"].get("token") == token
            ]

    def notifications(self, method: str) -> list[dict]:
        with self._cond:
            return [m for m in self.messages if m.get("method") == method and "id" not in m]

    def index_of(self, message: dict) -> int:
        with self._cond:
            for i, m in enumerate(self.messages):
                if m is message:
                    return i
        raise ValueError("not a message of this client")

    # -- ending -----------------------------------------------------------------------------
    def wait_exit(self, timeout: float) -> int | None:
        """The exit code once the process ends within `timeout`, else None (it keeps running)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(2.0)
        return code

    def close(self, timeout: float = 5.0, check: bool = True) -> int:
        """Close stdin and wait for the exit; return the exit code. Kills it after `timeout`."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        code = self.wait_exit(timeout)
        if code is None:
            self.kill()
            if check:
                raise Timeout(
                    f"the server did not exit within {timeout} s of stdin closing; stderr:\n{self.stderr_tail()}"
                )
            return self.proc.returncode
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self._reader.join(2.0)

    def stderr_tail(self, n: int = 4000) -> str:
        try:
            self._stderr.seek(0)
            data = self._stderr.read()
        except (OSError, ValueError):
            return ""
        return data[-n:].decode("utf-8", "replace")

    def assert_clean(self) -> None:
        """Raise if the server sent anything invalid (a bad frame, a message off the meta model)."""
        with self._cond:
            failures = list(self.failures)
        if failures:
            raise AssertionError(f"{len(failures)} invalid output(s) from the server:\n- " + "\n- ".join(failures[:20]))


def frame(message: Any) -> bytes:
    body = json.dumps(message).encode("utf-8")
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def raw_frame(body: bytes, headers: bytes | None = None) -> bytes:
    """A frame around arbitrary body bytes (headers default to a correct Content-Length)."""
    if headers is None:
        headers = b"Content-Length: %d\r\n" % len(body)
    return headers + b"\r\n" + body


def _key(rid):
    # JSON ids 1 and 1.0 and True differ; keep the type in the key.
    return (type(rid).__name__, rid)


def _could_be_header(buf: bytes) -> bool:
    """Whether buf may still grow into a well-formed header."""
    want = b"Content-Length: "
    if not (buf.startswith(want) or want.startswith(buf)):
        return False
    return b"\r\n\r\n" not in buf


def error_of(response: dict) -> dict:
    assert "error" in response, f"expected an error, got {json.dumps(response)[:500]}"
    return response["error"]


def result_of(response: dict):
    assert "result" in response, f"expected a result, got {json.dumps(response)[:500]}"
    return response["result"]


def send_together(c: RpcClient, messages: list[dict]) -> None:
    """Send several messages in ONE write; the client still books their ids and progress tokens."""
    chunks: list[bytes] = []
    c.send_raw = chunks.append  # an instance attribute shadows the method while we collect
    try:
        for m in messages:
            c.send(m)
    finally:
        del c.send_raw
    c.send_raw(b"".join(chunks))


def responses_by_id(c: RpcClient) -> dict:
    """id -> every response the server sent with that id, in order."""
    out = collections.defaultdict(list)
    with c._cond:
        for m in c.messages:
            if "method" not in m and ("result" in m or "error" in m):
                out[m.get("id")].append(m)
    return out
