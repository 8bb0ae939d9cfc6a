"""The client's typed results: what the server's answers are read into."""

from __future__ import annotations

import collections
import json
from typing import Any, Protocol, cast

import attrs

from kinfer_rpc.client import shapes


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
    def from_json(cls, u: shapes.Usage) -> Usage:
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
    def from_json(cls, t: shapes.Timings) -> Timings:
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
    def from_json(cls, d: shapes.InfillDropped) -> Dropped:
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
    def from_json(cls, v: shapes.TokenLogprob | shapes.TopLogprob) -> TokenLogprob:
        return cls(
            v.get("token", 0),
            v.get("text", ""),
            v.get("logprob", 0.0),
            [
                cls.from_json(t)
                for t in cast("list[shapes.TopLogprob]", v.get("topLogprobs") or [])
                if isinstance(t, dict)
            ],
        )


@attrs.frozen
class ToolCall:
    """A call of a tool that the model made: `arguments` is the parsed JSON object."""

    id: str
    name: str
    arguments: dict[str, Any] = attrs.field(factory=dict)

    @classmethod
    def from_json(cls, c: shapes.ToolCall) -> ToolCall:
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


class _Pieces(Protocol):
    """What a stream (sync or async) collects of its partial results."""

    text: str
    reasoning: str
    pending: collections.deque[str]
    tool_calls: list[ToolCall]
    logprobs: list[TokenLogprob]


def _take_piece(stream: _Pieces, value: dict[str, Any]) -> None:
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
    return [ToolCall.from_json(cast("shapes.ToolCall", c)) for c in v or [] if isinstance(c, dict)]


def _logprobs(v: Any) -> list[TokenLogprob]:
    return [TokenLogprob.from_json(cast("shapes.TokenLogprob", t)) for t in v or [] if isinstance(t, dict)]


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
    def from_json(cls, r: shapes.InferenceResult) -> Result:
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
    def from_json(cls, m: shapes.ModelListEntry) -> Model:
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
    def from_json(cls, r: shapes.Reproducibility) -> Reproducibility:
        return cls(bool(r.get("promised", False)), r.get("reason", ""))


def _reproducible(v: Any) -> Reproducibility | None:
    return Reproducibility.from_json(cast("shapes.Reproducibility", v)) if isinstance(v, dict) else None


@attrs.frozen
class IgnoredParameter:
    """A model's own default parameter (an Ollama model's) that kinfer does not apply, and why."""

    name: str
    reason: str = ""

    @classmethod
    def from_json(cls, p: shapes.IgnoredParameter) -> IgnoredParameter:
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
    answered, `pinned`, `keep_alive` (seconds it stays once idle; -1 until unloaded),
    `expires_in` (seconds until it is unloaded for being idle; None while it never expires),
    `evicted` the idle models this load unloaded to make room."""

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
    expires_in: float | None = None

    @classmethod
    def from_json(cls, m: shapes.LoadedModel) -> LoadedModel:
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
            [LayerDevice.from_json(cast("dict[str, Any]", d)) for d in m["devices"] if isinstance(d, dict)]
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
            m.get("expiresIn"),
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
    def from_json(cls, r: shapes.EmbedResult) -> Embeddings:
        return cls(r.get("model", ""), r.get("embeddings", []), r.get("usage", {}).get("promptTokens", 0))


@attrs.frozen
class Ranked:
    """One document of a rerank: its index in the request, its score, its text when asked."""

    index: int
    relevance_score: float
    document: str | None = None

    @classmethod
    def from_json(cls, r: shapes.RerankedDocument) -> Ranked:
        return cls(r["index"], r["relevanceScore"], r.get("document"))


@attrs.frozen
class Ranking:
    """inference/rerank's result: the documents best first, and the tokens scored."""

    model: str
    results: list[Ranked]
    prompt_tokens: int

    @classmethod
    def from_json(cls, r: shapes.RerankResult) -> Ranking:
        results = [Ranked.from_json(x) for x in r.get("results", [])]
        return cls(r.get("model", ""), results, r.get("usage", {}).get("promptTokens", 0))
