"""The inference requests, from a typed request to a typed reply: which model, its defaults under
the request's options, the prompt (a chat's template rendered, a fill-in-the-middle prompt built,
text tokenized), the constraint compiled, the job run and streamed. Every face (the stdio and
socket protocol, the HTTP APIs, the LSP mode) turns its own params into these requests and the
replies into its own results; none of this knows JSON.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import attrs

from kinfer_rpc import errors
from kinfer_rpc.engine import trace as tracing
from kinfer_rpc.engine.job import GenerateOptions, Outcome
from kinfer_rpc.engine.reasoning import Reasoning
from kinfer_rpc.engine.sampling import TokenLogprob
from kinfer_rpc.host import embeddings, reasoning, tools
from kinfer_rpc.host import infill as fill
from kinfer_rpc.host.options import SEED_BITS, RequestOptions
from kinfer_rpc.host.render import Renderer
from kinfer_rpc.host.runtime import Loaded, Runtime
from kinfer_rpc.host.tools import ToolChoice
from kinfer_rpc.types import LoadedModel, Media, Vision


# -- requests --------------------------------------------------------------------------------
@attrs.frozen
class Generate:
    """A completion of a prompt given as text (tokenized with the model's BOS unless
    `add_special` says) or as token ids."""

    model: str | None = None
    prompt: str | None = None
    tokens: tuple[int, ...] | None = None
    add_special: bool | None = None
    options: RequestOptions = RequestOptions()
    keep_alive: float | None = None  # seconds the model stays loaded once idle (inf: until unloaded)


@attrs.frozen
class Infill:
    """Fill the gap between `prefix` and `suffix` with the model's fill-in-the-middle tokens;
    `extra`: other files' (name, text) as context; `middle`: the gap's start already written (an
    editor's current line before the cursor), which the prompt puts after [FIM_MID]."""

    prefix: str
    suffix: str = ""
    model: str | None = None
    extra: tuple[tuple[str, str], ...] = ()
    options: RequestOptions = RequestOptions()
    keep_alive: float | None = None  # seconds the model stays loaded once idle (inf: until unloaded)
    middle: str | None = None


@attrs.frozen
class Chat:
    """A conversation (messages shaped for chat templates), maybe with tools to call. A message's
    `images` (the bytes of image files) go before its content, where a model with a vision
    projector reads them."""

    messages: tuple[dict[str, Any], ...]
    model: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: ToolChoice = ToolChoice("auto")
    options: RequestOptions = RequestOptions()
    # False: at most one call (a grammar of one call where the calls are forced; else the first)
    parallel_tool_calls: bool = True
    keep_alive: float | None = None  # seconds the model stays loaded once idle (inf: until unloaded)
    # Whether the model reasons first (True, False, or a level: "low", "medium", "high"); None:
    # as its template does by default (kinfer_rpc.host.reasoning)
    think: reasoning.Think = attrs.field(default=None, validator=lambda _s, _a, v: reasoning.check_think(v))


@attrs.frozen
class Tokenize:
    text: str
    model: str | None = None
    add_special: bool | None = None
    parse_special: bool = True


# -- replies ---------------------------------------------------------------------------------
@attrs.frozen
class Logprob:
    """A reply token's log-probability with its text, and its position's best alternatives
    (token, text, logprob), best first."""

    token: int
    text: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    draft_tokens: int = 0
    draft_accepted: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those of the reasoning block (its end included)


@attrs.frozen
class Timings:
    queue_ms: float
    prompt_ms: float
    generate_ms: float
    tokens_per_second: float


@attrs.frozen
class Reply:
    """A reply, or what a cancelled one had (stop_reason "cancelled")."""

    model: str
    text: str
    tokens: tuple[int, ...]
    stop_reason: str
    seed: int
    usage: Usage
    timings: Timings
    logprobs: tuple[Logprob, ...] | None = None  # when the request asked for them
    tool_calls: tuple[dict[str, Any], ...] | None = None  # the calls a chat's reply made
    dropped: dict[str, int] | None = None  # an infill's context left out to fit (host.infill.Prompt)
    # the model's reasoning, apart from `text` (None: the reply began in no reasoning block)
    reasoning: str | None = None


@attrs.frozen
class Piece:
    """What a streamed reply sends as it goes: new text and tokens (and their logprobs when
    asked), and the tool calls completed with them."""

    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[Logprob, ...] | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    reasoning: str = ""  # new reasoning text (`text` is then the answer's alone)


@attrs.frozen
class Tokens:
    tokens: tuple[int, ...]
    pieces: tuple[str, ...]


class Sink(Protocol):
    """Where a reply goes as it runs (a face's progress notifications, an HTTP stream): told
    when it starts; its pieces when `streaming`."""

    streaming: bool

    def started(self, partial: Callable[[], Reply]) -> None:
        """The job runs: `partial()` is the reply so far (a cancelled request's answer)."""

    async def piece(self, piece: Piece) -> None: ...


def reply_of(done: Outcome, model: str = "", text_of: Callable[[int], str] | None = None) -> Reply:
    """A job's reply, from its Outcome (the whole of it once it is done, the reply so far while
    it runs); `text_of` gives a token's text for its logprobs."""
    t_end = done.t_end or time.perf_counter()
    prompt_s = (done.t_first - done.t_start) if done.t_first else 0.0
    gen_s = (t_end - done.t_first) if done.t_first else 0.0
    n = len(done.generated)
    text, thought, thought_tokens = done.text, None, 0
    if done.reasons:
        thought, text = reasoning.split(done.text, done.reasoning_chars, done.answer_chars)
        thought_tokens = min(n, done.closed_at if done.closed_at is not None else n)
    return Reply(
        model=model,
        text=text,
        reasoning=thought,
        tokens=done.generated,
        stop_reason=done.stop_reason or "cancelled",
        seed=done.options.sampling.seed,
        usage=Usage(done.prompt_tokens, n, done.cached, done.drafted, done.accepted, thought_tokens),
        timings=Timings(
            queue_ms=round(max(0.0, (done.t_start or t_end) - done.t_submit) * 1000, 3),
            prompt_ms=round(prompt_s * 1000, 3),
            generate_ms=round(gen_s * 1000, 3),
            tokens_per_second=round((n - 1) / gen_s, 2) if n > 1 and gen_s > 0 else 0.0,
        ),
        logprobs=_logprobs(list(done.logprobs[:n]), text_of)
        if done.options.logprobs is not None and text_of is not None
        else None,
    )


def _logprobs(entries: list[TokenLogprob], text_of: Callable[[int], str]) -> tuple[Logprob, ...]:
    return tuple(
        Logprob(e.token, text_of(e.token), e.logprob, tuple((t, text_of(t), lp) for t, lp in e.top)) for e in entries
    )


def _special_markers(entry: Loaded) -> dict[str, int]:
    """The tool-call markers that the model's vocabulary has as one special token (a grammar must
    name those by id: their text's bytes do not spell them)."""
    with entry.engine.hold() as model:
        out = {}
        for marker in tools.MARKERS:
            ids = model.tokenize(marker, False, True)
            if len(ids) == 1 and model.tokenize(marker, False, False) != ids:
                out[marker] = ids[0]
        return out


# Where a message's images go in the text its chat template renders (llama.cpp's own marker): the
# rendered prompt is cut there, and each image's embeddings take the place of the marker.
IMAGE_MARKER = "<__media__>"


def _images_of(
    messages: list[dict[str, Any]], model: LoadedModel, name: str
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The messages as the template renders them (each image a marker before its message's
    content) and the images in prompt order; -31006 for images to a model that reads none."""
    images: list[bytes] = []
    out = []
    for i, m in enumerate(messages):
        mine = m.get("images")
        if not mine:
            out.append({k: v for k, v in m.items() if k != "images"} if "images" in m else m)
            continue
        if not (isinstance(model, Vision) and model.vision):
            raise errors.KinferError(
                errors.NOT_SUPPORTED,
                f"model {name!r} reads no images: it was loaded without a vision projector (model/load's "
                "options.projector, or an Ollama model's projector layer)",
                {"field": f"messages[{i}].images", "model": name},
            )
        if IMAGE_MARKER in str(m.get("content") or ""):
            raise errors.invalid_params(
                f"messages[{i}].content holds {IMAGE_MARKER}, the marker of an image's place: "
                "a message with images cannot",
                {"field": f"messages[{i}].content"},
            )
        images += mine
        rest = {k: v for k, v in m.items() if k != "images"}
        out.append({**rest, "content": IMAGE_MARKER * len(mine) + m["content"]})
    return out, images


def _media_prompt(entry: Loaded, text: str, images: list[bytes], add_bos: bool) -> tuple[list[int], tuple[Media, ...]]:
    """The rendered prompt's tokens, its images' placeholders among them, and the images."""
    pieces: list[str | bytes] = []
    parts = text.split(IMAGE_MARKER)
    if len(parts) != len(images) + 1:
        raise errors.invalid_params(
            f"the chat template of {entry.name!r} rendered {len(parts) - 1} of the messages' {len(images)} images "
            "(it drops or repeats a message's content)",
            {"field": "messages"},
        )
    for part, image in zip(parts, images):
        pieces += [part, image]
    pieces.append(parts[-1])
    with entry.engine.hold() as model:
        assert isinstance(model, Vision), "_images_of let images through only to a model that reads them"
        try:
            ids, media = model.media_prompt(pieces, add_bos)
        except ValueError as exc:
            raise errors.invalid_params(f"an image of the messages: {exc}", {"field": "messages"}) from None
    if media and media[-1].start + media[-1].length >= len(ids):
        raise errors.invalid_params("the prompt ends with an image: the chat template adds nothing after it")
    context = model.info.context_length
    if len(ids) > context:
        raise errors.KinferError(
            errors.CONTEXT_OVERFLOW,
            f"the prompt is {len(ids)} tokens (its images' included), more than the context's {context}",
            {"promptTokens": len(ids), "contextLength": context},
        )
    return ids, tuple(media)


def _model_of(entry: Loaded) -> LoadedModel:
    """The entry's model; a clear error when an unload (or the server's end) took it while the
    request was on its way (a thread hop or a render since the entry was found)."""
    model = entry.engine.model
    if model is None:
        raise errors.KinferError(errors.INTERNAL_ERROR, "the model was unloaded")
    return model


class Requests:
    """The inference requests over one Runtime (and the workers that render chat templates)."""

    def __init__(self, runtime: Runtime, renderer: Renderer | None = None):
        self.runtime = runtime
        self.renderer = renderer or Renderer()

    async def _options(
        self, name: str | None, given: RequestOptions, owner: int, keep_alive: float | None, chat: bool = False
    ) -> tuple[Loaded, GenerateOptions]:
        """The request's model (held by its connection) and its options over the model's
        defaults, resolved once."""
        if not chat and given.max_reasoning_tokens is not None:
            raise errors.invalid_params(
                "options.maxReasoningTokens applies to inference/chat, where the chat template opens the reasoning",
                {"field": "options.maxReasoningTokens"},
            )
        seed = random.getrandbits(SEED_BITS)
        entry = await self.runtime.model_for(name, owner or None, keep_alive)
        embeddings.refuse_generation(entry)
        opts = given.over(entry.defaults).resolve(seed)
        # In use from here (no await since the entry was found): an idle model whose keep-alive
        # has run out is not unloaded under a request on its way to the engine (_done_with).
        entry.running += 1
        return entry, opts

    def _done_with(self, entry: Loaded) -> None:
        """The request that _options gave `entry` to has ended."""
        entry.running -= 1
        entry.idle_since = time.monotonic()

    async def embed(self, req: embeddings.Embed) -> embeddings.Embeddings:
        """Each input's vector (kinfer_rpc.host.embeddings)."""
        return await embeddings.embed(self.runtime, req)

    async def rerank(self, req: embeddings.Rerank) -> embeddings.Ranking:
        """The documents by their relevance to the query, best first (kinfer_rpc.host.embeddings)."""
        return await embeddings.rerank(self.runtime, req)

    async def generate(
        self, req: Generate, sink: Sink | None = None, *, owner: int = 0, received: float | None = None
    ) -> Reply:
        if (req.prompt is None) == (req.tokens is None):
            raise errors.invalid_params("give exactly one of params.prompt and params.tokens")
        entry, opts = await self._options(req.model, req.options, owner, req.keep_alive)
        try:
            model = _model_of(entry)
            if req.tokens is not None:
                n_vocab = model.info.n_vocab
                if bad := [t for t in req.tokens if not 0 <= t < n_vocab]:
                    raise errors.invalid_params(f"token ids out of the vocabulary (0..{n_vocab - 1}): {bad[:5]}")
                ids = list(req.tokens)
            else:
                assert req.prompt is not None  # exactly one of prompt and tokens was given
                add = model.info.add_bos if req.add_special is None else req.add_special
                context = model.info.context_length
                ids = await anyio.to_thread.run_sync(
                    entry.tokenize, req.prompt, add, True, context, limiter=entry.tokenizer
                )
            return await self._run(entry, ids, opts, sink, owner=owner, received=received)
        finally:
            self._done_with(entry)

    async def infill(
        self, req: Infill, sink: Sink | None = None, *, owner: int = 0, received: float | None = None
    ) -> Reply:
        """Fill the gap between prefix and suffix (kinfer_rpc.host.infill): the model's FIM
        prompt, ended by its pad and file separator tokens too; a reply that repeats the suffix
        loses the repeat."""
        entry, opts = await self._options(req.model, req.options, owner, req.keep_alive)
        try:
            fim = await anyio.to_thread.run_sync(entry.fim_tokens, limiter=entry.tokenizer)
            if lacking := fill.missing(fim):
                raise errors.invalid_params(
                    f"model {entry.name!r} cannot fill in the middle: its vocabulary has no "
                    + "/".join(f"fim_{k}" for k in lacking)
                    + " token",
                    {"field": "model", "fimTokens": fim},
                )
            n_predict = opts.max_tokens if opts.max_tokens is not None else fill.DEFAULT_PREDICT
            spm = bool(req.options.over(entry.defaults).spm)
            prompt = await anyio.to_thread.run_sync(
                entry.infill_prompt,
                req.prefix,
                req.suffix,
                list(req.extra),
                n_predict,
                spm,
                req.middle,
                limiter=entry.tokenizer,
            )
            stops = tuple(fim[k] for k in fill.STOPS if k in fim)
            reply = await self._run(
                entry, prompt.tokens, attrs.evolve(opts, stop_tokens=stops), sink, owner=owner, received=received
            )
            return attrs.evolve(reply, text=fill.trim_repeated_suffix(reply.text, req.suffix), dropped=prompt.dropped)
        finally:
            self._done_with(entry)

    async def chat(
        self, req: Chat, sink: Sink | None = None, *, owner: int = 0, received: float | None = None
    ) -> Reply:
        entry, opts = await self._options(req.model, req.options, owner, req.keep_alive, chat=True)
        try:
            template = entry.engine.template
            found = await anyio.to_thread.run_sync(entry.reasoning_markers, limiter=entry.tokenizer)
            budget = req.options.over(entry.defaults).max_reasoning_tokens
            reasoning.refuse(found, template, entry.name, req.think, budget)
            messages = list(req.messages)
            if entry.system and not any(m["role"] == "system" for m in messages):
                messages = [{"role": "system", "content": entry.system}, *messages]
            model = _model_of(entry)
            messages, images = _images_of(messages, model, entry.name)
            tool_list = list(req.tools)
            choice = req.tool_choice
            calling = bool(tool_list) and choice.mode != "none"  # "none": the tools are not offered
            fmt = ""
            if calling:
                template = entry.engine.template
                if not tools.template_supports_tools(template):
                    raise errors.invalid_params(
                        f"the chat template of {entry.name!r} does not support tools (it never mentions them)",
                        {"field": "tools"},
                    )
                fmt = tools.call_format(template)
                if choice.mode in ("required", "function"):
                    if opts.constraint is not None:
                        raise errors.invalid_params(
                            f"toolChoice {choice.mode!r} holds the reply to tool calls: it cannot also take "
                            f"options.{opts.constraint[0]}",
                            {"field": "toolChoice"},
                        )
                    special = await anyio.to_thread.run_sync(_special_markers, entry, limiter=entry.tokenizer)
                    grammar = tools.call_grammar(
                        tool_list, choice, fmt, parallel=req.parallel_tool_calls, special=special
                    )
                    opts = attrs.evolve(opts, constraint=("tools", grammar))
            # In a worker process: a model file's template is untrusted and may be slow or huge; the
            # server keeps answering everyone else meanwhile (kinfer_rpc.host.render).
            text = await self.renderer.render(
                entry,
                entry.engine.template,
                messages,
                bos=model.info.bos_text,
                eos=model.info.eos_text,
                tools=tool_list if calling else None,
                variables=reasoning.switches(found, req.think) if found is not None else None,
                client=owner,
                share=self.runtime.connections > 1,
            )
            if self.runtime.loaded.get(entry.name) is not entry:  # unloaded as the render ended: as stop() says
                raise errors.KinferError(
                    errors.REQUEST_CANCELLED, "the model was unloaded during its chat template's render"
                )
            if found is not None:
                text, inside = reasoning.prompt_end(found, text, req.think)
                if inside:
                    end = await anyio.to_thread.run_sync(
                        entry.tokenize, found.close, False, True, limiter=entry.tokenizer
                    )
                    opts = attrs.evolve(opts, reasoning=Reasoning(tuple(end), budget))
            add_bos = model.info.add_bos and not (model.info.bos_text and text.startswith(model.info.bos_text))
            media: tuple[Media, ...] = ()
            if images:
                ids, media = await anyio.to_thread.run_sync(
                    _media_prompt, entry, text, images, add_bos, limiter=entry.tokenizer
                )
            else:
                ids = await anyio.to_thread.run_sync(
                    entry.tokenize, text, add_bos, True, model.info.context_length, limiter=entry.tokenizer
                )
            if not calling:
                return await self._run(entry, ids, opts, sink, owner=owner, received=received, media=media)
            names = [t["function"]["name"] for t in tool_list]
            reply = await self._run(
                entry, ids, opts, sink, tools.CallStream(fmt, names), owner=owner, received=received, media=media
            )
            content, calls = tools.parse_calls(reply.text, fmt, names)
            if not req.parallel_tool_calls:
                calls = calls[:1]
            if calls:
                return attrs.evolve(reply, text=content, tool_calls=tuple(calls), stop_reason="toolCalls")
            return reply
        finally:
            self._done_with(entry)

    async def tokenize(self, req: Tokenize) -> Tokens:
        entry = await self.runtime.model_for(req.model)
        model = _model_of(entry)
        add = model.info.add_bos if req.add_special is None else req.add_special

        def run() -> Tokens:  # one hold for the tokens and their pieces
            with entry.engine.hold() as held:
                ids = held.tokenize(req.text, add, req.parse_special)
                return Tokens(tuple(ids), tuple(held.token_bytes(t).decode("utf-8", "replace") for t in ids))

        return await anyio.to_thread.run_sync(run, limiter=entry.tokenizer)

    async def _run(
        self,
        entry: Loaded,
        ids: list[int],
        opts: GenerateOptions,
        sink: Sink | None,
        calls: tools.CallStream | None = None,
        *,
        owner: int = 0,
        received: float | None = None,
        media: tuple[Media, ...] = (),
    ) -> Reply:
        """Run a job, sending its pieces to `sink` as they come (with the tool calls each
        completed, when `calls` reads them). `received`: when the request arrived (traces).
        `media`: the prompt's images (Vision.media_prompt)."""
        # A cancel answers at once: an abandoned compile ends on its own thread (bounded by the
        # grammar limits and grammar.COMPILES), its matcher dropped.
        constraint = None
        if opts.constraint is not None:
            constraint = await anyio.to_thread.run_sync(
                entry.constrain, opts, limiter=entry.compiler, abandon_on_cancel=True
            )
        model = entry.engine.model
        if model is None:  # unloaded (model/unload, shutdown) while the constraint compiled
            raise errors.KinferError(errors.INTERNAL_ERROR, "the model was unloaded")

        def text_of(token: int) -> str:
            return model.token_bytes(token).decode("utf-8", "replace")

        logprobs = opts.logprobs is not None
        sent = 0  # tokens whose logprobs went out in pieces
        splitter = reasoning.Splitter() if opts.reasoning is not None else None
        done = anyio.Event()
        outcome: list[Outcome] = []  # the engine's, once the job is done
        pieces: list[tuple[str, list[int]]] = []
        wake = anyio.Event()

        def on_piece(text: str, toks: list[int]) -> None:
            pieces.append((text, toks))
            wake.set()

        def on_done(ended: Outcome) -> None:
            outcome.append(ended)
            done.set()
            wake.set()

        streaming = sink is not None and sink.streaming
        job = self.runtime.start(
            entry,
            ids,
            opts,
            on_piece=on_piece if streaming else None,
            on_done=on_done,
            constraint=constraint,
            owner=owner,
            media=media,
        )
        if sink is not None:
            sink.started(lambda: reply_of(Outcome.of(job), entry.name, text_of))
        try:
            while not done.is_set() or pieces:
                if pieces:
                    batch = pieces[:]
                    pieces.clear()
                    assert sink is not None  # pieces come only through on_piece, set only with a sink
                    text = "".join(t for t, _ in batch)
                    toks = tuple(x for _, ts in batch for x in ts)
                    lps = None
                    if logprobs:  # (a token's logprob is in job.logprobs before its piece is sent)
                        lps = _logprobs(job.logprobs[sent : sent + len(toks)], text_of)
                        sent += len(toks)
                    thought = ""
                    if splitter is not None and (thinking := job.thinking) is not None:
                        # (where the block ends is set before the piece that ends it is sent)
                        thought, text = splitter.feed(text, thinking.reasoning_chars, thinking.answer_chars)
                    completed = tuple(calls.feed(text)) if calls is not None else ()
                    await sink.piece(Piece(text, toks, lps, completed, thought))
                    continue
                await wake.wait()
                wake = anyio.Event()
            if calls is not None and sink is not None and streaming:
                if completed := tuple(calls.finish()):  # calls only the whole reply shows (a bare JSON one)
                    await sink.piece(Piece("", (), None, completed))
        except BaseException:
            entry.engine.cancel(job)
            raise
        ended = outcome[0]
        if (trace := tracing.current()) is not None:
            arrived = received if received is not None else ended.t_submit
            trace.write("request", received=arrived, submit=ended.t_submit, answered=time.perf_counter())
        if ended.error is not None:
            if isinstance(ended.error, errors.KinferError):
                raise ended.error
            # the engine failed (a decode, a device, an RPC server): -32603 with what failed
            raise errors.KinferError(errors.INTERNAL_ERROR, str(ended.error) or type(ended.error).__name__)
        return reply_of(ended, entry.name, text_of)
