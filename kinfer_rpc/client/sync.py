"""The blocking client: a thread reads the frames; calls and streams block."""

from __future__ import annotations

import collections
import os
import queue
import signal
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import IO, TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    pass

from kinfer_rpc.client.errors import (
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
    _Wire,
    server_command,
)


class _Interrupts:
    """Ctrl-C while a stream is open cancels it, wherever the KeyboardInterrupt lands: in the
    stream's own wait, or in the caller's loop body, where the stream cannot see it (a bare
    `for piece in stream:` holds the stream until it is collected). While a stream is open the
    main thread's SIGINT handler, if it is Python's default, becomes one that sends the open
    streams' `$/cancelRequest` (from a thread of its own: the signal may land while this thread
    writes to the server) and then raises KeyboardInterrupt as the default does. The default comes
    back when no stream is open. A program's own SIGINT handler is left alone."""

    def __init__(self) -> None:
        self.open: weakref.WeakSet[Stream] = weakref.WeakSet()
        self.installed = False

    def add(self, stream: Stream) -> None:
        self.open.add(stream)
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                signal.signal(signal.SIGINT, self._on_sigint)
                self.installed = True
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            pass

    def discard(self, stream: Stream) -> None:
        self.open.discard(stream)
        if not self.installed or len(self.open) or threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGINT) == self._on_sigint:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            self.installed = False
        except (ValueError, OSError):
            pass

    def _on_sigint(self, signum: int, frame: Any) -> None:
        streams = list(self.open)

        def cancel() -> None:
            for stream in streams:
                stream.cancel()

        if streams:
            threading.Thread(target=cancel, daemon=True).start()
        signal.default_int_handler(signum, frame)


_interrupts = _Interrupts()


class Stream:
    """The pieces of a streamed reply, as they come. After the last, `result` is the Result.

    With tools the pieces are the raw reply, call markup included, while `result.text` is the
    reply without the calls; `tool_calls` collects the calls as each completes (and `logprobs`
    the streamed logprobs).

    Breaking out of the loop (the stream is collected), `close()` or leaving a `with` block
    before the end sends `$/cancelRequest`. `response` is the request's Future (the raw response).
    """

    def __init__(self, wire: _Wire, method: str, params: dict[str, Any]):
        self._wire = wire
        self.token = f"stream-{next(wire.ids)}"
        self._queue: queue.Queue[Any] = queue.Queue()
        wire.tokens[self.token] = self._queue
        self.id, self.response = wire.request(method, {**params, "partialResultToken": self.token})
        q = self._queue  # the callback must not hold the stream: a dropped stream is collected, and cancels
        self.response.add_done_callback(lambda _: q.put(_DONE))
        self.text = ""
        self.reasoning = ""  # a thinking model's reasoning streamed so far (its pieces are Thoughts)
        self.pending: collections.deque[str] = collections.deque()  # pieces taken, not yet handed out
        self.tool_calls: list[ToolCall] = []  # the calls streamed so far (chat with tools)
        self.logprobs: list[TokenLogprob] = []  # the logprobs streamed so far (with logprobs)
        self.result: Result | None = None
        self._finished = False
        _interrupts.add(self)

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> str:
        if self.pending:
            return self.pending.popleft()
        if self._finished:
            raise StopIteration
        try:
            while True:
                value = self._queue.get()
                if value is _DONE:
                    self._finished = True
                    self._wire.tokens.pop(self.token, None)
                    _interrupts.discard(self)
                    self.result = Result.from_json(_unwrap(self.response.result()))
                    raise StopIteration
                if not isinstance(value, dict):
                    continue
                _take_piece(self, value)
                if self.pending:
                    return self.pending.popleft()
        except (StopIteration, RpcError):
            raise
        except BaseException:  # Ctrl-C while waiting
            self.close()
            raise

    def wait(self, timeout: float | None = None) -> Result:
        """Wait for the end (without reading the rest); raises Cancelled if it was cancelled."""
        return Result.from_json(_unwrap(self.response.result(timeout)))

    def cancel(self) -> None:
        if not self.response.done():
            self._wire.cancel(self.id)

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self.cancel()
            self._wire.tokens.pop(self.token, None)
            _interrupts.discard(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Client:
    """A `kinfer-rpc` process of our own, initialized. Thread-safe: calls may come from many threads."""

    def __init__(
        self,
        command: list[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        initialization_options: dict[str, Any] | None = None,
        stderr: int | IO[Any] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ):
        argv = list(command or server_command()) + ["--clientProcessId", str(os.getpid())]
        self._wire = _Wire(argv, env, stderr, cwd)
        self._finalizer = weakref.finalize(self, self._wire.close, 5.0)
        try:
            self.server_info: dict[str, Any] = self.request(
                "initialize", _initialize_params(initialization_options), timeout=60
            )
            self.notify("initialized", {})
        except BaseException:
            self.close(timeout=2.0)
            raise

    @property
    def pid(self) -> int:
        return self._wire.proc.pid

    @property
    def returncode(self) -> int | None:
        """The server's exit code once it has exited (as AsyncClient's), else None."""
        return self._wire.proc.poll()

    @property
    def capabilities(self) -> dict[str, Any]:
        capabilities: dict[str, Any] = self.server_info.get("capabilities", {})
        return capabilities

    @property
    def notifications(self) -> queue.Queue[dict[str, Any]]:
        """Everything else the server sends (window/logMessage, ...)."""
        return self._wire.notifications

    # -- raw messages ------------------------------------------------------------------------
    def notify(self, method: str, params: _Params | None = None) -> None:
        self._wire.notify(method, params)

    def request_future(self, method: str, params: _Params | None = None) -> tuple[int, Future[dict[str, Any]]]:
        """Send a request; returns its id and a Future of the raw response message."""
        return self._wire.request(method, params)

    def request(self, method: str, params: _Params | None = None, timeout: float | None = None) -> Any:
        """Send a request and wait for its result (raises RpcError). Ctrl-C cancels it."""
        rid, fut = self._wire.request(method, params)
        try:
            response = fut.result(timeout)
        except BaseException:
            self._wire.cancel(rid)
            raise
        return _unwrap(response)

    def cancel(self, rid: int) -> None:
        self._wire.cancel(rid)

    # -- models ------------------------------------------------------------------------------
    def models(self) -> list[Model]:
        return [Model.from_json(m) for m in self.request("model/list", {})["models"]]

    def load(
        self,
        model: str | None = None,
        *,
        backend: str | None = None,
        progress: Callable[[Progress], Any] | None = None,
        keep_alive: float | str | None = None,
        pin: bool | None = None,
        **options: Any,
    ) -> LoadedModel:
        """Load a model (the default one without a name); `progress` is called with Progress values.
        `keep_alive` (seconds, or a duration such as "10m"; -1: until unloaded) and `pin` say how
        long it stays loaded once idle."""
        params = _params(model, options, backend=backend, keepAlive=keep_alive, pin=pin)
        if progress is None:
            return LoadedModel.from_json(self.request("model/load", params))
        token = f"load-{next(self._wire.ids)}"
        q: queue.Queue[Any] = queue.Queue()
        self._wire.tokens[token] = q
        try:
            rid, fut = self._wire.request("model/load", {**params, "workDoneToken": token})
            fut.add_done_callback(lambda _: q.put(_DONE))
            try:
                while (value := q.get()) is not _DONE:
                    progress(Progress.from_json(value or {}))
            except BaseException:  # Ctrl-C, or the callback raised: the load is not waited for
                self._wire.cancel(rid)
                raise
            while not q.empty():  # progress that raced the response
                value = q.get_nowait()
                if value is not _DONE:
                    progress(Progress.from_json(value or {}))
            return LoadedModel.from_json(_unwrap(fut.result()))
        finally:
            self._wire.tokens.pop(token, None)

    def unload(self, model: str) -> None:
        self.request("model/unload", {"model": model})

    def status(self, model: str | None = None) -> list[ModelStatus]:
        return [ModelStatus.from_json(m) for m in self.request("model/status", _params(model, None))["models"]]

    # -- inference ---------------------------------------------------------------------------
    def embed(
        self,
        input: str | list[str],
        model: str | None = None,
        *,
        normalize: bool = True,
        truncate: bool = True,
        dimensions: int | None = None,
    ) -> Embeddings:
        """inference/embed: one vector per input (a string is one input), with an embedding model."""
        return Embeddings.from_json(
            self.request("inference/embed", _embed_params(input, model, normalize, truncate, dimensions))
        )

    def rerank(
        self,
        query: str,
        documents: list[str],
        model: str | None = None,
        *,
        top_n: int | None = None,
        return_documents: bool = False,
    ) -> Ranking:
        """inference/rerank: the documents by their relevance to the query, best first, with a reranker."""
        return Ranking.from_json(
            self.request("inference/rerank", _rerank_params(query, documents, model, top_n, return_documents))
        )

    def generate(self, prompt: str, model: str | None = None, *, suffix: str | None = None, **options: Any) -> Result:
        """inference/generate. With `suffix` (Ollama's) the prompt is the text before a gap and the
        request is an infill of the two (see `infill`)."""
        return Result.from_json(self.request("inference/generate", _generate_params(prompt, model, options, suffix)))

    def infill(
        self,
        prefix: str,
        suffix: str = "",
        model: str | None = None,
        *,
        extra: list[dict[str, str]] | Mapping[str, str] | None = None,
        middle: str | None = None,
        **options: Any,
    ) -> Result:
        """inference/infill: fill the gap between `prefix` and `suffix` with a model that has
        fill-in-the-middle tokens. `extra`: other files as context, `[{"filename", "text"}]` or a
        mapping of file names to texts; `middle`: the gap's start already written (the current
        line before the cursor). Options as generate's, and `stopAtLine`."""
        params = _infill_params(prefix, suffix, model, extra, options, middle)
        return Result.from_json(self.request("inference/infill", params))

    def chat(
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
        """inference/chat. `tools` (OpenAI's shape), `tool_choice` ("auto", "none", "required", a
        function's name or `{"type": "function", "function": {"name": ...}}`),
        `parallel_tool_calls` (False: at most one call) and `think` (a thinking model: True,
        False or "low", "medium", "high"; `maxReasoningTokens=` bounds it) go beside the options."""
        params = _chat_params(messages, model, tools, tool_choice, options, parallel_tool_calls, think)
        return Result.from_json(self.request("inference/chat", params))

    def stream_generate(
        self, prompt: str, model: str | None = None, *, suffix: str | None = None, **options: Any
    ) -> Stream:
        return Stream(self._wire, "inference/generate", _generate_params(prompt, model, options, suffix))

    def stream_infill(
        self,
        prefix: str,
        suffix: str = "",
        model: str | None = None,
        *,
        extra: list[dict[str, str]] | Mapping[str, str] | None = None,
        **options: Any,
    ) -> Stream:
        """As infill, streamed. The pieces are the reply as generated: a repeat of the suffix that
        the final `result.text` leaves out may be among them."""
        return Stream(self._wire, "inference/infill", _infill_params(prefix, suffix, model, extra, options))

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
    ) -> Stream:
        params = _chat_params(messages, model, tools, tool_choice, options, parallel_tool_calls, think)
        return Stream(self._wire, "inference/chat", params)

    # -- lifetime ----------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> int:
        """shutdown + exit, then wait for the process; returns its exit code (0 when clean)."""
        self._finalizer.detach()
        return self._wire.close(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
