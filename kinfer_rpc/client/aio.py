"""The async client (anyio: asyncio or trio)."""

from __future__ import annotations

import collections
import itertools
import os
import subprocess
import threading
from collections.abc import Callable, Mapping
from typing import IO, TYPE_CHECKING, Any, Self

import anyio

from kinfer_rpc.protocol.framing import FrameError, FrameReader, encode

if TYPE_CHECKING:
    from anyio.abc import Process, TaskGroup
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kinfer_rpc.client.errors import (
    SERVER_GONE,
    RpcError,
)
from kinfer_rpc.client.results import (
    Embeddings,
    LoadedModel,
    Model,
    ModelStatus,
    Progress,
    Ranking,
    Result,
    TokenLogprob,
    ToolCall,
    _take_piece,
)
from kinfer_rpc.client.wire import (
    _DONE,
    _chat_params,
    _embed_params,
    _generate_params,
    _infill_params,
    _initialize_params,
    _Params,
    _params,
    _rerank_params,
    _unwrap,
    server_command,
)


class AsyncStream:
    """`async for piece in stream`: the pieces of a streamed reply; then `result` is the Result.
    Tool calls and logprobs as in Stream.

    Breaking out of the loop (the stream is collected), `await aclose()`, leaving an
    `async with` block early, or cancelling the task that iterates sends `$/cancelRequest`.
    """

    def __init__(self, client: AsyncClient, method: str, params: dict[str, Any]):
        self._client = client
        self.token = token = f"stream-{next(client._ids)}"
        send: MemoryObjectSendStream[Any]
        self._recv: MemoryObjectReceiveStream[Any]
        send, self._recv = anyio.create_memory_object_stream(float("inf"))
        client._tokens[token] = send
        box: list[dict[str, Any]] = []
        self._box = box

        def on_response(response: dict[str, Any]) -> None:  # holds no reference to the stream
            box.append(response)
            client._tokens.pop(token, None)
            try:
                send.send_nowait(_DONE)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass
            send.close()

        self.id = client._request_nowait(method, {**params, "partialResultToken": token}, on_response)
        self.text = ""
        self.reasoning = ""  # a thinking model's reasoning streamed so far (its pieces are Thoughts)
        self.pending: collections.deque[str] = collections.deque()  # pieces taken, not yet handed out
        self.tool_calls: list[ToolCall] = []  # the calls streamed so far (chat with tools)
        self.logprobs: list[TokenLogprob] = []  # the logprobs streamed so far (with logprobs)
        self.result: Result | None = None
        self._finished = False

    @property
    def response(self) -> dict[str, Any] | None:
        """The raw response message once it came."""
        return self._box[0] if self._box else None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> str:
        if self.pending:
            return self.pending.popleft()
        if self._finished:
            raise StopAsyncIteration
        try:
            while True:
                try:
                    value = await self._recv.receive()
                except anyio.EndOfStream:
                    value = _DONE
                if value is _DONE:
                    self._finished = True
                    self.result = Result.from_json(
                        _unwrap(self.response or {"error": {"code": SERVER_GONE, "message": "the server exited"}})
                    )
                    raise StopAsyncIteration
                if not isinstance(value, dict):
                    continue
                _take_piece(self, value)
                if self.pending:
                    return self.pending.popleft()
        except (StopAsyncIteration, RpcError):
            raise
        except BaseException:  # our task was cancelled
            self.cancel()
            raise

    async def wait(self) -> Result | None:
        """Read to the end and return the Result (raises Cancelled if it was cancelled). None when
        this side ended the stream first (`cancel()`, `aclose()`) and no Result had come."""
        async for _ in self:
            pass
        return self.result

    def cancel(self) -> None:
        if self.response is None and not self._finished:
            self._finished = True
            self._client._cancel_nowait(self.id)

    async def aclose(self) -> None:
        self.cancel()
        self._finished = True

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        try:
            if self.response is None and not self._finished and threading.get_ident() == self._client._thread:
                self.cancel()
        except Exception:
            pass


class AsyncClient:
    """The async client: `async with AsyncClient() as kinfer:` spawns and initializes a server,
    leaving the block shuts it down. Runs on asyncio or trio (anyio)."""

    def __init__(
        self,
        command: list[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        initialization_options: dict[str, Any] | None = None,
        stderr: int | IO[Any] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ):
        self._argv = list(command or server_command()) + ["--clientProcessId", str(os.getpid())]
        self._env, self._init, self._stderr, self._cwd = env, initialization_options, stderr, cwd
        self._ids = itertools.count(1)
        self._pending: dict[int, Callable[[dict[str, Any]], None]] = {}
        # $/progress token -> a send stream or a callable
        self._tokens: dict[str, MemoryObjectSendStream[Any] | Callable[[Any], None]] = {}
        self._out_send: MemoryObjectSendStream[bytes]
        self._out_recv: MemoryObjectReceiveStream[bytes]
        self._out_send, self._out_recv = anyio.create_memory_object_stream(float("inf"))
        self._proc: Process | None = None
        self._tg: TaskGroup | None = None
        self._writer_done = anyio.Event()
        self._closed = False
        self._thread = threading.get_ident()
        self.notifications: list[dict[str, Any]] = []  # everything else the server sends
        self.server_info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("the server is not started yet: use `async with AsyncClient() as kinfer`")
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    @property
    def capabilities(self) -> dict[str, Any]:
        capabilities: dict[str, Any] = self.server_info.get("capabilities", {})
        return capabilities

    async def __aenter__(self) -> AsyncClient:
        self._thread = threading.get_ident()
        self._proc = await anyio.open_process(  # a session of its own, as in Client
            self._argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=self._env,
            cwd=self._cwd,
            start_new_session=True,
        )
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            self._tg.start_soon(self._writer)
            self._tg.start_soon(self._reader)
            with anyio.fail_after(60):
                self.server_info = await self.request("initialize", _initialize_params(self._init))
            await self.notify("initialized", {})
        except BaseException as exc:
            await self.aclose(timeout=2.0)
            await self._tg.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.aclose()
        finally:
            assert self._tg is not None  # set by __aenter__
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(*exc)

    # -- wire --------------------------------------------------------------------------------
    async def _writer(self) -> None:
        assert self._proc is not None and self._proc.stdin is not None  # __aenter__ started it, stdin a PIPE
        stdin = self._proc.stdin
        try:
            async for data in self._out_recv:
                await stdin.send(data)
        except Exception:
            pass
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await stdin.aclose()
                except Exception:
                    pass
            self._writer_done.set()

    async def _reader(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None  # __aenter__ started it, stdout a PIPE
        try:
            async for message in FrameReader(self._proc.stdout):
                if isinstance(message, FrameError):  # the server broke the protocol: treat as its end
                    break
                self._dispatch(message)
        finally:
            gone = {"error": {"code": SERVER_GONE, "message": "the server exited"}}
            for callback in list(self._pending.values()):
                callback(gone)
            self._pending.clear()

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "id" in message and "method" not in message:
            callback = self._pending.pop(message["id"], None)
            if callback is not None:
                callback(message)
            return
        params = message.get("params") or {}
        if message.get("method") == "$/progress" and isinstance(params, dict) and params.get("token") in self._tokens:
            target = self._tokens[params["token"]]
            if callable(target):
                target(params.get("value"))
            else:
                try:
                    target.send_nowait(params.get("value"))
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass
            return
        self.notifications.append(message)

    def _send_nowait(self, message: dict[str, Any]) -> None:
        try:
            self._out_send.send_nowait(encode(message))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    def _request_nowait(
        self, method: str, params: _Params | None, on_response: Callable[[dict[str, Any]], None]
    ) -> int:
        rid = next(self._ids)
        if self._closed and method != "shutdown" or self._proc is None or self._proc.returncode is not None:
            on_response({"error": {"code": SERVER_GONE, "message": "the client is closed"}})
            return rid
        self._pending[rid] = on_response
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            message["params"] = params
        self._send_nowait(message)
        return rid

    def _cancel_nowait(self, rid: int) -> None:
        self._send_nowait({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": rid}})

    # -- raw messages ------------------------------------------------------------------------
    async def notify(self, method: str, params: _Params | None = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self._send_nowait(message)

    async def request(self, method: str, params: _Params | None = None) -> Any:
        """Send a request and wait for its result (raises RpcError). Cancelling the waiting
        task sends `$/cancelRequest`."""
        done = anyio.Event()
        box: list[dict[str, Any]] = []

        def on_response(response: dict[str, Any]) -> None:
            box.append(response)
            done.set()

        rid = self._request_nowait(method, params, on_response)
        try:
            await done.wait()
        except BaseException:
            if not box:
                self._pending.pop(rid, None)
                self._cancel_nowait(rid)
            raise
        return _unwrap(box[0])

    # -- models ------------------------------------------------------------------------------
    async def models(self) -> list[Model]:
        return [Model.from_json(m) for m in (await self.request("model/list", {}))["models"]]

    async def load(
        self,
        model: str | None = None,
        *,
        backend: str | None = None,
        progress: Callable[[Progress], Any] | None = None,
        keep_alive: float | str | None = None,
        pin: bool | None = None,
        **options: Any,
    ) -> LoadedModel:
        params = _params(model, options, backend=backend, keepAlive=keep_alive, pin=pin)
        if progress is None:
            return LoadedModel.from_json(await self.request("model/load", params))
        token = f"load-{next(self._ids)}"
        self._tokens[token] = lambda value: progress(Progress.from_json(value or {}))
        try:
            return LoadedModel.from_json(await self.request("model/load", {**params, "workDoneToken": token}))
        finally:
            self._tokens.pop(token, None)

    async def unload(self, model: str) -> None:
        await self.request("model/unload", {"model": model})

    async def status(self, model: str | None = None) -> list[ModelStatus]:
        return [ModelStatus.from_json(m) for m in (await self.request("model/status", _params(model, None)))["models"]]

    # -- inference ---------------------------------------------------------------------------
    async def embed(
        self,
        input: str | list[str],
        model: str | None = None,
        *,
        normalize: bool = True,
        truncate: bool = True,
        dimensions: int | None = None,
    ) -> Embeddings:
        """inference/embed: one vector per input (a string is one input), with an embedding model."""
        params = _embed_params(input, model, normalize, truncate, dimensions)
        return Embeddings.from_json(await self.request("inference/embed", params))

    async def rerank(
        self,
        query: str,
        documents: list[str],
        model: str | None = None,
        *,
        top_n: int | None = None,
        return_documents: bool = False,
    ) -> Ranking:
        """inference/rerank: the documents by their relevance to the query, best first, with a reranker."""
        params = _rerank_params(query, documents, model, top_n, return_documents)
        return Ranking.from_json(await self.request("inference/rerank", params))

    async def generate(
        self, prompt: str, model: str | None = None, *, suffix: str | None = None, **options: Any
    ) -> Result:
        """As Client.generate."""
        params = _generate_params(prompt, model, options, suffix)
        return Result.from_json(await self.request("inference/generate", params))

    async def infill(
        self,
        prefix: str,
        suffix: str = "",
        model: str | None = None,
        *,
        extra: list[dict[str, str]] | Mapping[str, str] | None = None,
        middle: str | None = None,
        **options: Any,
    ) -> Result:
        """As Client.infill."""
        params = _infill_params(prefix, suffix, model, extra, options, middle)
        return Result.from_json(await self.request("inference/infill", params))

    async def chat(
        self,
        messages: list[dict[str, Any]],
        model: str | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        think: bool | str | None = None,
        **options: Any,
    ) -> Result:
        """As Client.chat."""
        params = _chat_params(messages, model, tools, tool_choice, options, parallel_tool_calls, think)
        return Result.from_json(await self.request("inference/chat", params))

    def stream_generate(
        self, prompt: str, model: str | None = None, *, suffix: str | None = None, **options: Any
    ) -> AsyncStream:
        return AsyncStream(self, "inference/generate", _generate_params(prompt, model, options, suffix))

    def stream_infill(
        self,
        prefix: str,
        suffix: str = "",
        model: str | None = None,
        *,
        extra: list[dict[str, str]] | Mapping[str, str] | None = None,
        **options: Any,
    ) -> AsyncStream:
        """As Client.stream_infill."""
        return AsyncStream(self, "inference/infill", _infill_params(prefix, suffix, model, extra, options))

    def stream_chat(
        self,
        messages: list[dict[str, Any]],
        model: str | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        think: bool | str | None = None,
        **options: Any,
    ) -> AsyncStream:
        params = _chat_params(messages, model, tools, tool_choice, options, parallel_tool_calls, think)
        return AsyncStream(self, "inference/chat", params)

    # -- lifetime ----------------------------------------------------------------------------
    async def aclose(self, timeout: float = 10.0) -> int:
        """shutdown + exit, then wait for the process; returns its exit code (0 when clean)."""
        if self._proc is None:
            return 0
        if self._closed:
            with anyio.CancelScope(shield=True):
                return await self._proc.wait()
        self._closed = True
        with anyio.move_on_after(timeout, shield=True):
            if self._proc.returncode is None:
                try:
                    await self.request("shutdown")
                except Exception:
                    pass
                await self.notify("exit")
            self._out_send.close()
            await self._writer_done.wait()
            await self._proc.wait()
        with anyio.CancelScope(shield=True):
            if self._proc.returncode is None:
                self._proc.kill()
            code = await self._proc.wait()
            for s in (self._proc.stdout, self._proc.stderr):
                if s is not None:
                    await s.aclose()
        return code
