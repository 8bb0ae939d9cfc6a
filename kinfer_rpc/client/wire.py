"""The process and its frames, and the params the clients send."""

from __future__ import annotations

import base64
import io
import itertools
import os
import queue
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from typing import IO, Any, TypeAlias

from kinfer_rpc.client.errors import ERRORS, SERVER_GONE, RpcError
from kinfer_rpc.protocol.framing import FrameError, FrameParser, encode

REQUEST_CANCELLED = -32800

_Params: TypeAlias = "dict[str, Any] | list[Any]"  # a request's params: a JSON object or array


def _embed_params(
    input: str | list[str], model: str | None, normalize: bool, truncate: bool, dimensions: int | None
) -> dict[str, Any]:
    return _params(model, None, input=input, normalize=normalize, truncate=truncate, dimensions=dimensions)


def _rerank_params(
    query: str, documents: list[str], model: str | None, top_n: int | None, return_documents: bool
) -> dict[str, Any]:
    return _params(model, None, query=query, documents=documents, topN=top_n, returnDocuments=return_documents)


def server_command() -> list[str]:
    """`$KINFER_RPC`, the `kinfer-rpc` next to this Python, on PATH, or `python -m kinfer_rpc`."""
    env = os.environ.get("KINFER_RPC")
    if env:
        return [env]
    here = os.path.join(os.path.dirname(sys.executable), "kinfer-rpc")
    if os.path.exists(here):
        return [here]
    found = shutil.which("kinfer-rpc")
    return [found] if found else [sys.executable, "-m", "kinfer_rpc"]


def _params(model: str | None, options: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    params = {k: v for k, v in fields.items() if v is not None}
    if model is not None:
        params["model"] = model
    if options:
        params["options"] = options
    return params


def _inference_options(options: dict[str, Any]) -> dict[str, Any]:
    """Request options as given, but a `format` that is a class with `model_json_schema()` (a
    pydantic model) becomes its JSON schema, and `keep_alive` (the request's, not an option) is
    sent beside the options, as the request's `keepAlive`."""
    options = {k: v for k, v in options.items() if k != "keep_alive"}
    fmt = options.get("format")
    if fmt is not None and not isinstance(fmt, (str, dict)):
        schema = getattr(fmt, "model_json_schema", None)
        if callable(schema):
            return {**options, "format": schema()}
    return options


def _generate_params(
    prompt: str, model: str | None, options: dict[str, Any], suffix: str | None = None
) -> dict[str, Any]:
    return _params(
        model, _inference_options(options), prompt=prompt, suffix=suffix, keepAlive=options.get("keep_alive")
    )


def _infill_params(
    prefix: str,
    suffix: str,
    model: str | None,
    extra: list[dict[str, str]] | Mapping[str, str] | None,
    options: dict[str, Any],
    middle: str | None = None,
) -> dict[str, Any]:
    files = [{"filename": k, "text": v} for k, v in extra.items()] if isinstance(extra, Mapping) else extra
    return _params(
        model,
        _inference_options(options),
        prefix=prefix,
        suffix=suffix,
        middle=middle,
        extra=files,
        keepAlive=options.get("keep_alive"),
    )


def _chat_params(
    messages: list[dict[str, Any]],
    model: str | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    options: dict[str, Any],
    parallel_tool_calls: bool | None = None,
    think: bool | str | None = None,
) -> dict[str, Any]:
    return _params(
        model,
        _inference_options(options),
        messages=[_with_images(m) for m in messages],
        tools=tools,
        toolChoice=tool_choice,
        parallelToolCalls=parallel_tool_calls,
        think=think,
        keepAlive=options.get("keep_alive"),
    )


def _with_images(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose `images` are as the protocol takes them: bytes (an image file's) as
    base64, a path (os.PathLike) as its absolute path; strings (base64, a data: URL, an
    absolute path) as they are."""
    images = message.get("images")
    if not images:
        return message
    out = []
    for image in images:
        if isinstance(image, (bytes, bytearray, memoryview)):
            out.append(base64.b64encode(bytes(image)).decode("ascii"))
        elif isinstance(image, os.PathLike):
            out.append(os.path.abspath(os.fspath(image)))
        else:
            out.append(image)
    return {**message, "images": out}


def _error(response: dict[str, Any]) -> RpcError:
    e: dict[str, Any] = response.get("error") or {}
    code = e.get("code")
    cls = ERRORS.get(code, RpcError) if isinstance(code, int) else RpcError
    return cls(e.get("code"), e.get("message"), e.get("data"))


def _unwrap(response: dict[str, Any]) -> Any:
    if "error" in response:
        raise _error(response)
    return response.get("result")


def _initialize_params(initialization_options: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "processId": os.getpid(),
        "clientInfo": {"name": "kinfer_rpc.client"},
        "capabilities": {},
        "initializationOptions": initialization_options or {},
    }


_DONE = object()


def _gone() -> dict[str, Any]:
    return {"error": {"code": SERVER_GONE, "message": "the server exited"}}


class _Wire:
    """The process and its frames. Holds no reference to the Client, so a Client can be collected."""

    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str] | None,
        stderr: int | IO[Any] | None,
        cwd: str | os.PathLike[str] | None,
    ):
        # A session of its own: a terminal's Ctrl-C (SIGINT to its foreground process group)
        # reaches the client, which cancels what it waits for, never the server it shares.
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both are PIPE
        self.stdin: IO[bytes] = self.proc.stdin
        self.ids = itertools.count(1)
        self.pending: dict[int, Future[dict[str, Any]]] = {}
        self.tokens: dict[str, queue.Queue[Any]] = {}  # $/progress tokens -> their queue
        self.lock = threading.Lock()
        self.notifications: queue.Queue[dict[str, Any]] = queue.Queue()
        self.closed = False
        self.reading = True  # until the reader has seen the server's end; under `plock` with `pending`
        self.plock = threading.Lock()
        threading.Thread(target=self._read, name="kinfer-client-reader", daemon=True).start()

    def send(self, message: dict[str, Any]) -> None:
        data = encode(message)
        with self.lock:
            self.stdin.write(data)
            self.stdin.flush()

    def _read(self) -> None:
        assert isinstance(self.proc.stdout, io.BufferedReader)  # stdout is PIPE, buffered
        out = self.proc.stdout
        parser = FrameParser()
        try:
            while True:
                message = parser.next()
                if message is None:
                    data = out.read1(65536)
                    if not data:
                        return
                    parser.feed(data)
                    continue
                if isinstance(message, FrameError):  # the server broke the protocol: treat as its end
                    return
                if "id" in message and "method" not in message:
                    fut = self.pending.pop(message["id"], None)
                    if fut is not None and not fut.done():
                        fut.set_result(message)
                elif (
                    message.get("method") == "$/progress" and (message.get("params") or {}).get("token") in self.tokens
                ):
                    q = self.tokens.get(message["params"]["token"])
                    if q is not None:
                        q.put(message["params"].get("value"))
                else:
                    self.notifications.put(message)
        except Exception:  # a broken stream: treat as the end
            pass
        finally:
            with self.plock:  # a request made from now on is answered at once (request())
                self.reading = False
                left = list(self.pending.values())
                self.pending.clear()
            for fut in left:
                if not fut.done():
                    fut.set_result(_gone())

    def request(self, method: str, params: _Params | None) -> tuple[int, Future[dict[str, Any]]]:
        rid = next(self.ids)
        fut: Future[dict[str, Any]] = Future()
        with self.plock:
            if not self.reading:  # the server's end was seen: nothing would ever answer it
                fut.set_result(_gone())
                return rid, fut
            self.pending[rid] = fut
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            message["params"] = params
        try:
            self.send(message)
        except (OSError, ValueError):
            with self.plock:
                self.pending.pop(rid, None)
            if not fut.done():
                fut.set_result(_gone())
        return rid, fut

    def notify(self, method: str, params: _Params | None = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)

    def cancel(self, rid: int) -> None:
        try:
            self.notify("$/cancelRequest", {"id": rid})
        except (OSError, ValueError):
            pass

    def close(self, timeout: float = 10.0) -> int:
        """shutdown, exit, wait. Idempotent; returns the exit code."""
        if self.closed:
            return self.proc.wait()
        self.closed = True
        if self.proc.poll() is None:
            try:
                _, fut = self.request("shutdown", None)
                fut.result(timeout)
                self.notify("exit")
            except Exception:
                pass
            try:
                self.stdin.close()
            except Exception:
                pass
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
