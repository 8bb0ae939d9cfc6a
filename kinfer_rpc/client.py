"""A Python client: spawns `kinfer-rpc`, does the lifecycle, and offers generate/chat.

    with Client() as kinfer:
        print(kinfer.chat([{"role": "user", "content": "Hi"}], maxTokens=50).text)
        for piece in kinfer.stream_chat([{"role": "user", "content": "Hi"}]):
            print(piece, end="", flush=True)

Breaking out of a stream sends `$/cancelRequest`. Options are the protocol's camelCase ones.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from concurrent.futures import Future

import attrs


class RpcError(Exception):
    def __init__(self, code: int, message: str, data=None):
        super().__init__(f"{message} ({code})")
        self.code, self.message, self.data = code, message, data


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int


@attrs.frozen
class Result:
    """A finished reply."""

    text: str
    tokens: list
    stop_reason: str
    usage: Usage
    timings: dict
    seed: int | None = None
    model: str | None = None

    @classmethod
    def from_json(cls, r: dict) -> "Result":
        u = r.get("usage", {})
        return cls(r["text"], r["tokens"], r["stopReason"], Usage(u.get("promptTokens", 0), u.get("completionTokens", 0)),
                   r.get("timings", {}), r.get("seed"), r.get("model"))


def server_command() -> list[str]:
    here = os.path.join(os.path.dirname(sys.executable), "kinfer-rpc")
    if os.path.exists(here):
        return [here]
    found = shutil.which("kinfer-rpc")
    return [found] if found else [sys.executable, "-m", "kinfer_rpc"]


class Client:
    def __init__(self, command: list[str] | None = None, *, env=None, initialization_options=None, stderr=None):
        self._proc = subprocess.Popen(
            (command or server_command()) + ["--clientProcessId", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env,
        )
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._streams: dict[str, queue.Queue] = {}
        self._write_lock = threading.Lock()
        self._closed = False
        self.notifications: queue.Queue = queue.Queue()  # everything else the server sends
        self._reader = threading.Thread(target=self._read, name="kinfer-client-reader", daemon=True)
        self._reader.start()
        self.server_info = self.request("initialize", {"processId": os.getpid(), "clientInfo": {"name": "kinfer_rpc.client"},
                                                       "capabilities": {}, "initializationOptions": initialization_options or {}})
        self.notify("initialized", {})

    # -- wire --------------------------------------------------------------------------------
    def _send(self, message: dict) -> None:
        body = json.dumps(message).encode()
        with self._write_lock:
            self._proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)
            self._proc.stdin.flush()

    def _read(self) -> None:
        out = self._proc.stdout
        try:
            while True:
                length = None
                while True:
                    line = out.readline()
                    if not line:
                        return
                    line = line.strip()
                    if not line:
                        break
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                message = json.loads(out.read(length))
                if "id" in message and "method" not in message:
                    fut = self._pending.pop(message["id"], None)
                    if fut is not None:
                        fut.set_result(message)
                elif message.get("method") == "$/progress" and message["params"]["token"] in self._streams:
                    self._streams[message["params"]["token"]].put(message["params"]["value"])
                else:
                    self.notifications.put(message)
        finally:
            for fut in list(self._pending.values()):
                if not fut.done():
                    fut.set_result({"error": {"code": -32099, "message": "the server exited"}})
            for q in self._streams.values():
                q.put(None)

    def notify(self, method: str, params=None) -> None:
        self._send({"jsonrpc": "2.0", "method": method, "params": params})

    def request_future(self, method: str, params=None) -> tuple[int, Future]:
        rid = next(self._ids)
        fut: Future = Future()
        self._pending[rid] = fut
        self._send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
        return rid, fut

    def request(self, method: str, params=None, timeout: float | None = None):
        _, fut = self.request_future(method, params)
        return _unwrap(fut.result(timeout))

    def cancel(self, rid: int) -> None:
        self.notify("$/cancelRequest", {"id": rid})

    # -- inference ---------------------------------------------------------------------------
    def generate(self, prompt: str, model: str | None = None, **options) -> Result:
        return Result.from_json(self.request("inference/generate", _params(model, options, prompt=prompt)))

    def chat(self, messages: list[dict], model: str | None = None, **options) -> Result:
        return Result.from_json(self.request("inference/chat", _params(model, options, messages=messages)))

    def stream_generate(self, prompt: str, model: str | None = None, **options):
        return self._stream("inference/generate", _params(model, options, prompt=prompt))

    def stream_chat(self, messages: list[dict], model: str | None = None, **options):
        return self._stream("inference/chat", _params(model, options, messages=messages))

    def _stream(self, method, params):
        token = f"stream-{next(self._ids)}"
        q: queue.Queue = queue.Queue()
        self._streams[token] = q
        rid, fut = self.request_future(method, {**params, "partialResultToken": token})
        fut.add_done_callback(lambda _: q.put(None))
        finished = False
        try:
            while True:
                value = q.get()
                if value is None:
                    break
                if value["text"]:
                    yield value["text"]
            response = fut.result()
            finished = True
            _unwrap(response)
        finally:
            if not finished and not fut.done():
                self.cancel(rid)
            self._streams.pop(token, None)

    # -- lifetime ----------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> int:
        if self._closed:
            return self._proc.returncode
        self._closed = True
        try:
            self.request("shutdown", None, timeout=timeout)
            self.notify("exit")
            self._proc.stdin.close()
        except Exception:
            pass
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close(timeout=2.0)
        except Exception:
            pass


def _params(model, options, **fields):
    params = dict(fields)
    if model is not None:
        params["model"] = model
    if options:
        params["options"] = options
    return params


def _unwrap(response: dict):
    if "error" in response:
        e = response["error"]
        raise RpcError(e.get("code"), e.get("message"), e.get("data"))
    return response.get("result")
