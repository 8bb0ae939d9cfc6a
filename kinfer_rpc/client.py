"""Python clients: spawn `kinfer-rpc`, do the lifecycle, and offer generate/chat/infill.

Blocking, and an iterator of streamed pieces:

    from kinfer_rpc.client import Client

    with Client() as kinfer:
        print(kinfer.chat([{"role": "user", "content": "Hi"}], maxTokens=50).text)
        for piece in kinfer.stream_chat([{"role": "user", "content": "Hi"}]):
            print(piece, end="", flush=True)

Async (anyio: asyncio or trio):

    from kinfer_rpc.client import AsyncClient

    async with AsyncClient() as kinfer:
        result = await kinfer.chat([{"role": "user", "content": "Hi"}], maxTokens=50)
        async for piece in kinfer.stream_chat([{"role": "user", "content": "Hi"}]):
            print(piece, end="", flush=True)

Breaking out of a stream, closing it, cancelling the task that awaits a call (an anyio cancel
scope, a timeout) or Ctrl-C in a blocking call sends `$/cancelRequest`; the server stops the work
and answers -32800. The server runs in a session of its own, so a terminal's Ctrl-C reaches the
script alone: catch KeyboardInterrupt around a stream and the same server takes the next request.

Options are the protocol's camelCase ones (`maxTokens`, `temperature`, `seed`, `stop`,
`ignoreEos`, `logprobs`, `topLogprobs`, `grammar`, `regex`, ...), sent as given. `format` takes a
JSON schema (a dict), "json", or a class with a `model_json_schema()` classmethod (a pydantic
model), whose schema is sent. `close()`, leaving the `with` block, and garbage collection
of a `Client` shut the server down cleanly (`shutdown`, `exit`, exit code 0, the process reaped).

Errors: an error response raises the RpcError subclass of its code, one per documented code
(`ModelNotFound`, `ContextOverflow`, `InvalidParams`, `RequestCancelled` alias `Cancelled`, ...;
`ERRORS` maps code to class), and `ServerGone` (-32099) when the server exited before it answered.
Each keeps `code`, `message` and `data`:

    try:
        kinfer.chat(messages, model="no-such-model")
    except ModelNotFound as e:
        e.data["available"]

Agents: `chat(messages, tools=[...], tool_choice=...)` offers tools (OpenAI's shape); the
Result's `tool_calls` are the calls the model made (`stop_reason` "toolCalls"):

    reply = kinfer.chat(messages, tools=[weather_tool])
    messages.append(reply.message)                       # the assistant's turn, with its calls
    for call in reply.tool_calls:
        messages.append(call.answer(get_weather(**call.arguments)))   # a "tool" message

Code completion: `infill(prefix, suffix, extra=[...])` fills the gap between the text before and
after the cursor (a model with fill-in-the-middle tokens; else InvalidParams, -32602), with other files
as context; the Result's `dropped` says how much of a long prefix, suffix or extra context did not
fit. `stopAtLine=True` completes one line:

    done = kinfer.infill("def add(a, b):\n    return ", "\n", stopAtLine=True, maxTokens=32)
    done.text, done.dropped.prefix

Thinking models (Qwen3, DeepSeek-R1...): `chat(messages, think=True)` (or False, or "low",
"medium", "high") and `maxReasoningTokens=N`; the Result's `reasoning` is apart from its `text`,
and a stream's reasoning pieces are `Thought`s (a str):

    for piece in kinfer.stream_chat(messages, think=True):
        print(("(" + piece + ")") if isinstance(piece, Thought) else piece, end="")
"""

from __future__ import annotations

import base64
import collections
import io
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import IO, TYPE_CHECKING, Any, Self, TypeAlias

import anyio
import attrs

from kinfer_rpc.protocol.framing import FrameError, FrameParser, FrameReader, encode

if TYPE_CHECKING:
    from anyio.abc import Process, TaskGroup
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

REQUEST_CANCELLED = -32800
SERVER_GONE = -32099  # a client-side code: the server exited before it answered

_Params: TypeAlias = "dict[str, Any] | list[Any]"  # a request's params: a JSON object or array


# -- errors and typed results ------------------------------------------------------------------
class RpcError(Exception):
    """An error response. `data` is the error's data (for -32800, the partial result).

    The client raises the subclass of the error's code (`ModelNotFound`, `ContextOverflow`, ...;
    `ERRORS` maps each documented code to its class), or RpcError itself for a code the spec does
    not document. `code` and `message` are None only when the server sent an error object without
    them."""

    CODE: int | None = None  # the code this class stands for; None for RpcError itself

    def __init__(self, code: int | None, message: str | None, data: Any = None):
        super().__init__(f"{message} ({code})")
        self.code, self.message, self.data = code, message, data


class ParseError(RpcError):
    """-32700: a frame whose header is broken or whose body is not UTF-8 JSON."""

    CODE = -32700


class InvalidRequest(RpcError):
    """-32600: not a valid request (a batch, a bad `id`, a request after `shutdown`, ...)."""

    CODE = -32600


class MethodNotFound(RpcError):
    """-32601: no request method of that name (`data`: the name)."""

    CODE = -32601


class InvalidParams(RpcError):
    """-32602: a param of the wrong type or value, unknown or missing params, a constraint that
    does not compile, an infill of a model without fill-in-the-middle tokens."""

    CODE = -32602


class InternalError(RpcError):
    """-32603: a bug in the server, or a request whose model was unloaded or whose engine failed."""

    CODE = -32603


class ServerNotInitialized(RpcError):
    """-32002: a request before `initialize` succeeded."""

    CODE = -32002


class RequestCancelled(RpcError):
    """-32800: the request was cancelled. `partial` is what it had made (`Cancelled` is the same
    class)."""

    CODE = REQUEST_CANCELLED

    @property
    def partial(self) -> Result | None:
        d = self.data
        return Result.from_json(d) if isinstance(d, dict) and "text" in d else None


Cancelled = RequestCancelled


class ModelNotFound(RpcError):
    """-31001: no model has this name (`data`: `{model, available}` or `{model, candidates}`)."""

    CODE = -31001


class ContextOverflow(RpcError):
    """-31002: the prompt does not fit one slot's context (`data`: `{promptTokens,
    contextLength}` or `{promptBytes, contextLength}`)."""

    CODE = -31002


class LoadFailed(RpcError):
    """-31003: the model file is unusable, does not match its digest, or the backend failed to
    load it."""

    CODE = -31003


class QueueFull(RpcError):
    """-31004: `maxQueue` requests already wait for a slot of this model."""

    CODE = -31004


class BackendUnavailable(RpcError):
    """-31005: no registered backend reads the model (or the named one is not registered)."""

    CODE = -31005


class NotSupported(RpcError):
    """-31006: the store knows the model but kinfer cannot serve it, or its chat template tried
    an operation the sandbox refuses."""

    CODE = -31006


class ResponseTooLarge(RpcError):
    """-31007: the answer would be a frame over the server's `maxFrameBytes`."""

    CODE = -31007


class ServerGone(RpcError):
    """-32099, the client's own: the server exited (or the client was closed) before it answered."""

    CODE = SERVER_GONE


ERRORS: dict[int, type[RpcError]] = {
    c.CODE: c
    for c in (
        ParseError,
        InvalidRequest,
        MethodNotFound,
        InvalidParams,
        InternalError,
        ServerNotInitialized,
        RequestCancelled,
        ModelNotFound,
        ContextOverflow,
        LoadFailed,
        QueueFull,
        BackendUnavailable,
        NotSupported,
        ResponseTooLarge,
        ServerGone,
    )
    if c.CODE is not None
}


@attrs.frozen
class Usage:
    """A reply's token counts: `draft_tokens` the draft tokens checked and `draft_accepted` those
    kept (0 without drafts), `cached_tokens` the prompt tokens reused from the prefix pool."""

    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int = 0
    draft_accepted: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those of a thinking model's reasoning

    @classmethod
    def from_json(cls, u: dict[str, Any]) -> Usage:
        return cls(
            u.get("promptTokens", 0),
            u.get("completionTokens", 0),
            u.get("draftTokens", 0),
            u.get("draftAccepted", 0),
            u.get("cachedTokens", 0),
            u.get("reasoningTokens", 0),
        )


@attrs.frozen
class Timings:
    queue_ms: float = 0.0
    prompt_ms: float = 0.0
    generate_ms: float = 0.0
    tokens_per_second: float = 0.0

    @classmethod
    def from_json(cls, t: dict[str, Any]) -> Timings:
        return cls(
            t.get("queueMs", 0.0), t.get("promptMs", 0.0), t.get("generateMs", 0.0), t.get("tokensPerSecond", 0.0)
        )


@attrs.frozen
class Dropped:
    """What an infill left out of a short context, in characters: from the prefix's start, the
    suffix's end, the extra context's start (file names and separators included) and the
    middle's start."""

    prefix: int = 0
    suffix: int = 0
    extra: int = 0
    middle: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Dropped:
        return cls(d.get("prefix", 0), d.get("suffix", 0), d.get("extra", 0), d.get("middle", 0))


@attrs.frozen
class TokenLogprob:
    """A generated token's log probability (natural log, from the model's raw logits: before the
    sampling transforms and any grammar's mask) and `top`, the most likely tokens of its position,
    best first (each a TokenLogprob whose own `top` is empty)."""

    token: int
    text: str
    logprob: float
    top: list[TokenLogprob] = attrs.field(factory=list)

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> TokenLogprob:
        return cls(
            v.get("token", 0),
            v.get("text", ""),
            v.get("logprob", 0.0),
            [cls.from_json(t) for t in v.get("topLogprobs") or [] if isinstance(t, dict)],
        )


@attrs.frozen
class ToolCall:
    """A call of a tool that the model made: `arguments` is the parsed JSON object."""

    id: str
    name: str
    arguments: dict[str, Any] = attrs.field(factory=dict)

    @classmethod
    def from_json(cls, c: dict[str, Any]) -> ToolCall:
        f = c.get("function") or {}
        arguments = f.get("arguments")
        if isinstance(arguments, str):  # OpenAI's form, should a server send it
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        return cls(c.get("id", ""), f.get("name", ""), arguments if isinstance(arguments, dict) else {})

    def to_json(self) -> dict[str, Any]:
        """The protocol's shape, as an assistant message's `toolCalls` carries it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def answer(self, content: Any) -> dict[str, Any]:
        """The `tool` message that gives this call's result to the model (`content` not a
        string is sent as JSON)."""
        text = content if isinstance(content, str) else json.dumps(content)
        return {"role": "tool", "toolCallId": self.id, "name": self.name, "content": text}


class Thought(str):
    """A streamed piece of a thinking model's reasoning (a str): a stream's pieces are these
    and pieces of the answer, in the order they came. `stream.reasoning` gathers these,
    `stream.text` the others."""


def _take_piece(stream: Stream | AsyncStream, value: dict[str, Any]) -> None:
    """A partial result's calls, logprobs, reasoning and text, onto the stream (its pieces to
    hand out in `pending`)."""
    stream.tool_calls += _tool_calls(value.get("toolCalls"))
    stream.logprobs += _logprobs(value.get("logprobs"))
    thought = value.get("reasoning")
    if isinstance(thought, str) and thought:
        stream.reasoning += thought
        stream.pending.append(Thought(thought))
    text = value.get("text")
    if isinstance(text, str) and text:
        stream.text += text
        stream.pending.append(text)


def _tool_calls(v: Any) -> list[ToolCall]:
    return [ToolCall.from_json(c) for c in v or [] if isinstance(c, dict)]


def _logprobs(v: Any) -> list[TokenLogprob]:
    return [TokenLogprob.from_json(t) for t in v or [] if isinstance(t, dict)]


@attrs.frozen
class Result:
    """A finished reply. `reasoning`: a thinking model's reasoning, apart from `text` (None
    when the reply began in no reasoning block); `tool_calls`: the calls the model made (chat
    with tools; then `stop_reason` is "toolCalls"); `logprobs`: one per token, None unless asked
    for; `dropped`: what an infill (or a generate with a suffix) left out of a short context, None
    otherwise."""

    text: str
    tokens: list[int]
    stop_reason: str
    usage: Usage
    timings: Timings
    seed: int | None = None
    model: str | None = None
    tool_calls: list[ToolCall] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] | None = None
    dropped: Dropped | None = None
    reasoning: str | None = None

    @classmethod
    def from_json(cls, r: dict[str, Any]) -> Result:
        return cls(
            r.get("text", ""),
            list(r.get("tokens", [])),
            r.get("stopReason", "cancelled"),
            Usage.from_json(r.get("usage") or {}),
            Timings.from_json(r.get("timings") or {}),
            r.get("seed"),
            r.get("model"),
            _tool_calls(r.get("toolCalls")),
            _logprobs(r["logprobs"]) if r.get("logprobs") is not None else None,
            Dropped.from_json(r["dropped"]) if isinstance(r.get("dropped"), dict) else None,
            r.get("reasoning"),
        )

    @property
    def message(self) -> dict[str, Any]:
        """The assistant's message, to append to the conversation (with its `toolCalls`, and
        its `reasoning`, which the model's template keeps or drops)."""
        m: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.reasoning:
            m["reasoning"] = self.reasoning
        if self.tool_calls:
            m["toolCalls"] = [c.to_json() for c in self.tool_calls]
        return m


@attrs.frozen
class Model:
    """One entry of `model/list`."""

    name: str
    source: str
    format: str
    path: str
    size_bytes: int
    loaded: bool
    architecture: str | None = None
    parameters: int | None = None
    quantization: str | None = None
    context_length: int | None = None
    error: str | None = None  # set when the file could not be read

    @classmethod
    def from_json(cls, m: dict[str, Any]) -> Model:
        return cls(
            m["name"],
            m["source"],
            m["format"],
            m["path"],
            m.get("sizeBytes", 0),
            m.get("loaded", False),
            m.get("architecture"),
            m.get("parameters"),
            m.get("quantization"),
            m.get("contextLength"),
            m.get("error"),
        )


@attrs.frozen
class Reproducibility:
    """Whether a load promises the same reply for the same request whatever else runs, and why."""

    promised: bool = False
    reason: str = ""

    @classmethod
    def from_json(cls, r: dict[str, Any]) -> Reproducibility:
        return cls(bool(r.get("promised", False)), r.get("reason", ""))


def _reproducible(v: Any) -> Reproducibility | None:
    return Reproducibility.from_json(v) if isinstance(v, dict) else None


@attrs.frozen
class IgnoredParameter:
    """A model's own default parameter (an Ollama model's) that kinfer does not apply, and why."""

    name: str
    reason: str = ""

    @classmethod
    def from_json(cls, p: dict[str, Any]) -> IgnoredParameter:
        return cls(p.get("name", ""), p.get("reason", ""))


@attrs.frozen
class LayerDevice:
    """One device of a load and the layers it holds: `layers` are `(first, last)` ranges;
    `server` is the RPC server (`host:port`) the device belongs to, None for this host's."""

    device: str
    server: str | None = None
    layers: list[tuple[int, int]] = attrs.field(factory=list)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LayerDevice:
        layers = [(r[0], r[1]) for r in d.get("layers") or [] if isinstance(r, list) and len(r) == 2]
        return cls(d.get("device", ""), d.get("server"), layers)


@attrs.frozen
class LoadedModel:
    """The result of `model/load`. `placement` is the placement that decided what lives in GPU and
    host memory (None when none ran) and `placement_reason` what it chose and why; `weights` is
    "quantized" or "dense"; `draft_policy` the requests' default draft policy (None for none) and
    `drafts` the draft tokens per step and slot there is room for; `prefix` the prefix pool's
    token budget (-1: off); `rpc_servers` and `devices` (where the layers went) are set for a load
    over llama.cpp RPC servers, `devices` also for one split over several GPUs; `split_mode`,
    `tensor_split` and `main_gpu` say how the layers were spread over the GPUs, where the placement
    or the load options said (None otherwise). A loaded model is shared by every client of one
    server or daemon: `holders` the connections holding it, `loads` the model/load calls it
    answered, `pinned`, `keep_alive` (seconds it stays once idle; -1 until unloaded), `evicted`
    the idle models this load unloaded to make room."""

    model: str
    backend: str
    path: str
    source: str
    architecture: str
    parameters: int
    size_bytes: int
    context_length: int
    context_train: int
    slots: int
    batch: int
    ubatch: int
    gpu_layers: int
    flash_attention: bool
    draft_policy: str | None = None
    drafts: int = 0
    weights: str = "quantized"
    reproducible: Reproducibility | None = None
    prefix: int = -1
    placement: str | None = None
    placement_reason: str = ""
    host_tensors: list[str] = attrs.field(factory=list)
    chat_template: str = "gguf"
    chat_template_note: str | None = None
    ignored_parameters: list[IgnoredParameter] = attrs.field(factory=list)
    rpc_servers: list[str] | None = None
    devices: list[LayerDevice] | None = None
    split_mode: str | None = None
    tensor_split: list[float] | None = None
    main_gpu: int | None = None
    holders: int = 0
    loads: int = 1
    pinned: bool = False
    keep_alive: float = -1.0
    evicted: list[str] = attrs.field(factory=list)

    @classmethod
    def from_json(cls, m: dict[str, Any]) -> LoadedModel:
        return cls(
            m["model"],
            m["backend"],
            m["path"],
            m["source"],
            m.get("architecture", ""),
            m.get("parameters", 0),
            m.get("sizeBytes", 0),
            m.get("contextLength", 0),
            m.get("contextTrain", 0),
            m.get("slots", 0),
            m.get("batch", 0),
            m.get("ubatch", 0),
            m.get("gpuLayers", -1),
            m.get("flashAttention", False),
            m.get("draftPolicy"),
            m.get("drafts", 0),
            m.get("weights", "quantized"),
            _reproducible(m.get("reproducible")),
            m.get("prefix", -1),
            m.get("placement"),
            m.get("placementReason", ""),
            list(m.get("hostTensors") or []),
            m.get("chatTemplate", "gguf"),
            m.get("chatTemplateNote"),
            [IgnoredParameter.from_json(p) for p in m.get("ignoredParameters") or [] if isinstance(p, dict)],
            list(m["rpcServers"]) if isinstance(m.get("rpcServers"), list) else None,
            [LayerDevice.from_json(d) for d in m["devices"] if isinstance(d, dict)]
            if isinstance(m.get("devices"), list)
            else None,
            m.get("splitMode"),
            [float(x) for x in m["tensorSplit"]] if isinstance(m.get("tensorSplit"), list) else None,
            m.get("mainGpu"),
            m.get("holders", 0),
            m.get("loads", 1),
            m.get("pinned", False),
            m.get("keepAlive", -1.0),
            list(m.get("evicted") or []),
        )


@attrs.frozen
class ModelStatus:
    """One entry of `model/status`: state is "loading", "failed" (then `error` says why) or
    "ready" (then the rest is filled; `expires_in`: seconds until it is unloaded for being idle,
    None while it never expires)."""

    model: str
    backend: str
    state: str
    slots: int = 0
    slots_busy: int = 0
    queue_length: int = 0
    cells_used: int = 0
    tokens_per_second: float = 0.0
    steps: int = 0
    memory: dict[str, Any] = attrs.field(factory=dict)
    draft_tokens: int = 0
    draft_acceptance: float = 0.0
    prefix: int = -1
    cached_tokens: int = 0
    prefix_hits: int = 0
    batch: int = 0
    ubatch: int = 0
    gpu_layers: int = 0
    reproducible: Reproducibility | None = None
    placement: str | None = None
    placement_reason: str = ""
    host_tensors: list[str] = attrs.field(factory=list)
    error: str | None = None
    holders: int = 0
    loads: int = 0
    pinned: bool = False
    keep_alive: float = -1.0
    expires_in: float | None = None
    # a model loaded with a vision projector: {"encoded", "cached", "kept"} images (None: none)
    images: dict[str, int] | None = None

    @classmethod
    def from_json(cls, m: dict[str, Any]) -> ModelStatus:
        return cls(
            m["model"],
            m["backend"],
            m["state"],
            m.get("slots", 0),
            m.get("slotsBusy", 0),
            m.get("queueLength", 0),
            m.get("cellsUsed", 0),
            m.get("tokensPerSecond", 0.0),
            m.get("steps", 0),
            m.get("memory") or {},
            m.get("draftTokens", 0),
            m.get("draftAcceptance", 0.0),
            m.get("prefix", -1),
            m.get("cachedTokens", 0),
            m.get("prefixHits", 0),
            m.get("batch", 0),
            m.get("ubatch", 0),
            m.get("gpuLayers", 0),
            _reproducible(m.get("reproducible")),
            m.get("placement"),
            m.get("placementReason", ""),
            list(m.get("hostTensors") or []),
            m.get("error"),
            m.get("holders", 0),
            m.get("loads", 0),
            m.get("pinned", False),
            m.get("keepAlive", -1.0),
            m.get("expiresIn"),
            m.get("images"),
        )


@attrs.frozen
class Progress:
    """A work-done `$/progress` value (model loads): kind is begin, report or end."""

    kind: str
    title: str | None = None
    message: str | None = None
    percentage: int | None = None

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> Progress:
        return cls(v.get("kind", "report"), v.get("title"), v.get("message"), v.get("percentage"))


@attrs.frozen
class Embeddings:
    """inference/embed's result: one vector per input, in input order (float32 values), and the
    tokens embedded."""

    model: str
    embeddings: list[list[float]]
    prompt_tokens: int

    @classmethod
    def from_json(cls, r: dict[str, Any]) -> Embeddings:
        return cls(r.get("model", ""), r.get("embeddings", []), r.get("usage", {}).get("promptTokens", 0))


@attrs.frozen
class Ranked:
    """One document of a rerank: its index in the request, its score, its text when asked."""

    index: int
    relevance_score: float
    document: str | None = None

    @classmethod
    def from_json(cls, r: dict[str, Any]) -> Ranked:
        return cls(r["index"], r["relevanceScore"], r.get("document"))


@attrs.frozen
class Ranking:
    """inference/rerank's result: the documents best first, and the tokens scored."""

    model: str
    results: list[Ranked]
    prompt_tokens: int

    @classmethod
    def from_json(cls, r: dict[str, Any]) -> Ranking:
        results = [Ranked.from_json(x) for x in r.get("results", [])]
        return cls(r.get("model", ""), results, r.get("usage", {}).get("promptTokens", 0))


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


# -- the blocking client -----------------------------------------------------------------------
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


# -- the async client (anyio) ------------------------------------------------------------------
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
