"""The `model/*` and `inference/*` methods: params in, calls on the host's Runtime, results out.

Each handler receives the request's context (kinfer_rpc.protocol.connection.RequestContext) for
work-done progress and partial results.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import threading
from typing import Any

import anyio
import attrs

from kinfer_rpc import errors
from kinfer_rpc.engine.scheduler import GenerateOptions, Job
from kinfer_rpc.host import infill as fill
from kinfer_rpc.host import tools
from kinfer_rpc.host.options import SEED_BITS, Fields, generate_options, infill_options, with_defaults
from kinfer_rpc.host.render import Renderer
from kinfer_rpc.host.runtime import Loaded, Runtime, reproducibility
from kinfer_rpc.protocol import params
from kinfer_rpc.protocol.connection import RequestContext
from kinfer_rpc.protocol.results import engine_status, job_result, token_logprobs
from kinfer_rpc.types import LoadedModel, LoadOptions


class _Progress:
    """A load's progress as the request's work-done progress."""

    def __init__(self, ctx: RequestContext):
        self.ctx = ctx
        self.loop = asyncio.get_running_loop()

    async def begin(self, title: str) -> None:
        await self.ctx.work_done("begin", title=title, cancellable=False, percentage=0)

    def report(self, percentage: int, message: str) -> None:
        if self.ctx.work_done_token is not None:
            self.loop.create_task(self.ctx.work_done("report", percentage=percentage, message=message))

    def end(self, message: str) -> None:
        self.ctx.work_done_nowait("end", message=message)


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


def list_seconds() -> float:
    """How long model/list waits for the stores (KINFER_LIST_SECONDS, default 30)."""
    try:
        return max(0.1, float(os.environ.get("KINFER_LIST_SECONDS", "30")))
    except ValueError:
        return 30.0


class Handlers:
    """The methods the server registers, over one Runtime."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.renderer = Renderer()
        # model/list's store reads that ran out of time and are still running (stuck in a hung file
        # system?): no other starts meanwhile, so a hung store never takes more than one thread
        self._stuck_reads = 0
        self._stuck_lock = threading.Lock()

    # -- models ------------------------------------------------------------------------------
    async def model_list(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        Fields(p, "params").done()
        store = self.runtime.store
        seconds = list_seconds()
        if self._stuck_reads:  # a read that ran out of time is still stuck: don't start another
            raise errors.KinferError(
                errors.INTERNAL_ERROR,
                f"the model stores could not be read within {seconds:g} s (a hung file system?); "
                "the read is still waiting",
            )
        refs: list[Any] = []
        described: list[dict[str, Any]] = []
        state = {"done": False, "stuck": False}

        def read() -> None:  # off the loop; what it has done so far counts if it runs out of time
            try:
                refs.extend(store.list())
                for ref in refs:
                    described.append(store.describe(ref))
            finally:
                with self._stuck_lock:
                    state["done"] = True
                    if state["stuck"]:
                        self._stuck_reads -= 1

        # A store on a hung file system must not hang the answer: after `seconds` the list is what
        # was read by then, each model not read yet with an error (the thread is left to finish).
        with anyio.move_on_after(seconds) as scope:
            await anyio.to_thread.run_sync(read, abandon_on_cancel=True)
        if scope.cancelled_caught:
            with self._stuck_lock:
                if not state["done"]:
                    state["stuck"] = True
                    self._stuck_reads += 1
            if not refs:
                raise errors.KinferError(
                    errors.INTERNAL_ERROR,
                    f"the model stores could not be listed within {seconds:g} s (a hung file system?)",
                )
        done = list(described)
        late = {"error": f"its header could not be read within {seconds:g} s (a hung file system?)"}
        done += [{**store.listed(ref), **late} for ref in refs[len(done) :]]
        return {"models": [{**d, "loaded": d["name"] in self.runtime.loaded} for d in done]}

    async def model_load(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        backend = f.str("backend")
        options = f.raw("options")
        f.done()
        entry = await self.runtime.load(name, backend, options, _Progress(ctx) if ctx is not None else None)
        return self._describe(entry)

    def _describe(self, entry: Loaded) -> dict[str, Any]:
        model = entry.engine.model
        assert model is not None  # a loaded entry's engine holds its model
        info = model.info
        return {
            "model": entry.name,
            "backend": entry.backend,
            "path": info.path,
            "source": entry.source,
            "architecture": info.architecture,
            "parameters": info.parameters,
            "sizeBytes": info.size_bytes,
            "contextLength": info.context_length,
            "contextTrain": info.context_train,
            "slots": info.slots,
            "batch": entry.options.batch,
            "ubatch": entry.options.ubatch,
            "gpuLayers": entry.options.gpu_layers,
            "flashAttention": entry.options.flash_attention,
            "draftPolicy": entry.draft_policy,
            "prefix": entry.engine.prefix,
            "drafts": info.drafts,
            "weights": info.weights,
            "reproducible": self._reproducible(model),
            **self._placement_fields(entry),
            **self._template_fields(entry),
            "ignoredParameters": [{"name": n, "reason": why} for n, why in entry.ignored],
            **({"devices": [dict(d) for d in info.devices]} if info.devices else {}),
            **({"rpcServers": list(entry.options.rpc_servers)} if entry.options.rpc_servers else {}),
            **self._split_fields(entry.options),
        }

    @staticmethod
    def _split_fields(opts: LoadOptions) -> dict[str, Any]:
        """How the layers were spread over several GPUs, where the placement or the options said."""
        out: dict[str, Any] = {}
        if opts.split_mode is not None:
            out["splitMode"] = opts.split_mode
        if opts.tensor_split:
            out["tensorSplit"] = list(opts.tensor_split)
        if opts.main_gpu is not None:
            out["mainGpu"] = opts.main_gpu
        return out

    @staticmethod
    def _template_fields(entry: Loaded) -> dict[str, Any]:
        """Which chat template chats use; where an Ollama model brought a Go template (which kinfer
        never runs), a note saying what is used instead."""
        used = "gguf" if entry.engine.template else "chatml"
        out: dict[str, Any] = {"chatTemplate": used}
        if entry.go_template:
            instead = "the GGUF's own chat template" if used == "gguf" else "ChatML (the GGUF has no chat template)"
            out["chatTemplateNote"] = f"Ollama's Go template is not run: chats use {instead}"
        return out

    @staticmethod
    def _reproducible(model: LoadedModel) -> dict[str, Any]:
        promised, reason = reproducibility(model)
        return {"promised": promised, "reason": reason}

    @staticmethod
    def _placement_fields(entry: Loaded) -> dict[str, Any]:
        return {
            "placement": entry.placement,
            "placementReason": entry.placement_reason,
            "hostTensors": list(entry.options.host_tensors),
        }

    async def model_unload(self, ctx: RequestContext | None, /, **p: Any) -> None:
        f = Fields(p, "params")
        name = f.str("model")
        f.done()
        if not name:
            raise errors.invalid_params("params.model is required (the name of a loaded model)")
        before = dict(self.runtime.loaded)
        await self.runtime.unload(name)
        for gone in (e for n, e in before.items() if self.runtime.loaded.get(n) is not e):
            self.renderer.stop(gone)  # its chats' renders end now, with an error
        return None

    async def model_status(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        f.done()
        out: list[dict[str, Any]] = [
            {"model": failed, "backend": backend, "state": "failed", "error": error}
            for failed, (backend, error) in self.runtime.failed.items()
            if name is None or failed == name
        ]
        for entry in list(self.runtime.loaded.values()):
            if name is not None and entry.name != name:
                continue
            if not entry.ready.is_set() or entry.error is not None:
                out.append({"model": entry.name, "backend": entry.backend, "state": "loading"})
                continue
            model = entry.engine.model  # None once an unload has begun
            out.append(
                {
                    "model": entry.name,
                    "backend": entry.backend,
                    "state": "ready",
                    **engine_status(entry.engine.stats()),
                    "batch": entry.options.batch,
                    "ubatch": entry.options.ubatch,
                    "gpuLayers": entry.options.gpu_layers,
                    **({"reproducible": self._reproducible(model)} if model is not None else {}),
                    **self._placement_fields(entry),
                }
            )
        return {"models": out}

    async def inference_generate(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        prompt = f.str("prompt")
        tokens = f.raw("tokens")
        suffix = f.str("suffix")
        add_special = f.bool("addSpecial", None)
        options = f.raw("options")
        f.done()
        if (prompt is None) == (tokens is None):
            raise errors.invalid_params("give exactly one of params.prompt and params.tokens")
        if suffix is not None:  # Ollama's fill-in-the-middle: the prompt is the text before the gap
            if prompt is None or add_special is not None:
                raise errors.invalid_params(
                    "params.suffix goes with params.prompt (not tokens or addSpecial)", {"field": "params.suffix"}
                )
            return await self._infill(ctx, name, prompt, suffix, [], options, infill=False)
        seed = random.getrandbits(SEED_BITS)
        opts = generate_options(options, seed)
        entry = await self.runtime.model_for(name)
        if entry.defaults:
            opts = generate_options(with_defaults(entry.defaults, options), seed)
        model = entry.engine.model
        assert model is not None  # a loaded entry's engine holds its model
        if tokens is not None:
            ids = params.tokens(tokens, model.info.n_vocab)
        else:
            assert prompt is not None  # exactly one of prompt and tokens was given
            add = model.info.add_bos if add_special is None else add_special
            context = model.info.context_length
            ids = await anyio.to_thread.run_sync(entry.tokenize, prompt, add, True, context, limiter=entry.tokenizer)
        return await self._stream(ctx, entry, ids, opts)

    async def inference_infill(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        prefix = f.str("prefix")
        suffix = f.str("suffix", "")
        extra = params.infill_extra(f.raw("extra"))
        options = f.raw("options")
        f.done()
        if prefix is None:
            raise errors.invalid_params("params.prefix is required", {"field": "params.prefix"})
        return await self._infill(ctx, name, prefix, suffix, extra, options, infill=True)

    async def _infill(
        self,
        ctx: RequestContext | None,
        name: str | None,
        prefix: str,
        suffix: str,
        extra: list[tuple[str, str]],
        options: Any,
        *,
        infill: bool,
    ) -> dict[str, Any]:
        """Fill the gap between `prefix` and `suffix` (kinfer_rpc.host.infill): the model's FIM
        prompt, ended by its pad and file separator tokens too; a reply that repeats the suffix
        loses the repeat."""
        seed = random.getrandbits(SEED_BITS)

        def parse(obj: Any) -> tuple[GenerateOptions, bool]:
            return infill_options(obj, seed) if infill else (generate_options(obj, seed), False)

        opts, spm = parse(options)
        entry = await self.runtime.model_for(name)
        if entry.defaults:
            opts, spm = parse(with_defaults(entry.defaults, options))
        fim = await anyio.to_thread.run_sync(entry.fim_tokens, limiter=entry.tokenizer)
        if lacking := fill.missing(fim):
            raise errors.invalid_params(
                f"model {entry.name!r} cannot fill in the middle: its vocabulary has no "
                + "/".join(f"fim_{k}" for k in lacking)
                + " token",
                {"field": "model", "fimTokens": fim},
            )
        n_predict = opts.max_tokens if opts.max_tokens is not None else fill.DEFAULT_PREDICT
        prompt = await anyio.to_thread.run_sync(
            entry.infill_prompt, prefix, suffix, extra, n_predict, spm, limiter=entry.tokenizer
        )
        stops = tuple(fim[k] for k in fill.STOPS if k in fim)
        result = await self._stream(ctx, entry, prompt.tokens, attrs.evolve(opts, stop_tokens=stops))
        result["text"] = fill.trim_repeated_suffix(result["text"], suffix)
        result["dropped"] = prompt.dropped
        return result

    async def inference_chat(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        messages = params.messages(f.raw("messages"))
        options = f.raw("options")
        tool_list = params.tools(f.raw("tools"))
        choice = params.tool_choice(f.raw("toolChoice"), tool_list)
        f.done()
        seed = random.getrandbits(SEED_BITS)
        opts = generate_options(options, seed)
        entry = await self.runtime.model_for(name)
        if entry.defaults:
            opts = generate_options(with_defaults(entry.defaults, options), seed)
        if entry.system and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": entry.system}, *messages]
        model = entry.engine.model
        assert model is not None  # a loaded entry's engine holds its model
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
                grammar = tools.call_grammar(tool_list, choice, fmt, special=special)
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
        )
        if self.runtime.loaded.get(entry.name) is not entry:  # unloaded as the render ended: as stop() says
            raise errors.KinferError(
                errors.REQUEST_CANCELLED, "the model was unloaded during its chat template's render"
            )
        add_bos = model.info.add_bos and not (model.info.bos_text and text.startswith(model.info.bos_text))
        ids = await anyio.to_thread.run_sync(
            entry.tokenize, text, add_bos, True, model.info.context_length, limiter=entry.tokenizer
        )
        if not calling:
            return await self._stream(ctx, entry, ids, opts)
        names = [t["function"]["name"] for t in tool_list]
        result = await self._stream(ctx, entry, ids, opts, tools.CallStream(fmt, names))
        content, calls = tools.parse_calls(result["text"], fmt, names)
        if calls:
            result.update(text=content, toolCalls=calls, stopReason="toolCalls")
        return result

    async def inference_tokenize(self, ctx: RequestContext | None, /, **p: Any) -> dict[str, Any]:
        f = Fields(p, "params")
        name = f.str("model")
        text = f.str("text")
        add_special = f.bool("addSpecial", None)
        parse_special = f.bool("parseSpecial", True)
        f.done()
        if text is None:
            raise errors.invalid_params("params.text is required")
        entry = await self.runtime.model_for(name)
        model = entry.engine.model
        assert model is not None  # a loaded entry's engine holds its model
        add = model.info.add_bos if add_special is None else add_special

        def tokenize() -> dict[str, Any]:  # one hold for the tokens and their pieces
            with entry.engine.hold() as held:
                ids = held.tokenize(text, add, parse_special)
                return {"tokens": ids, "pieces": [held.token_bytes(t).decode("utf-8", "replace") for t in ids]}

        return await anyio.to_thread.run_sync(tokenize, limiter=entry.tokenizer)

    async def _stream(
        self,
        ctx: RequestContext | None,
        entry: Loaded,
        ids: list[int],
        opts: GenerateOptions,
        calls: tools.CallStream | None = None,
    ) -> dict[str, Any]:
        """Run a job, sending its pieces as partial results when the client asked for them (with
        the tool calls each completed, when `calls` reads them)."""
        constraint = await anyio.to_thread.run_sync(entry.constrain, opts, limiter=entry.tokenizer)
        model = entry.engine.model
        if model is None:  # unloaded (model/unload, shutdown) while the constraint compiled
            raise errors.KinferError(errors.INTERNAL_ERROR, "the model was unloaded")

        def text_of(token: int) -> str:
            return model.token_bytes(token).decode("utf-8", "replace")

        logprobs = opts.logprobs is not None
        sent = 0  # tokens whose logprobs went out in partial results
        done = anyio.Event()
        pieces: list[tuple[str, list[int]]] = []
        wake = anyio.Event()

        def on_piece(text: str, toks: list[int]) -> None:
            pieces.append((text, toks))
            wake.set()

        def on_done(_job: Job) -> None:
            done.set()
            wake.set()

        job = self.runtime.start(
            entry,
            ids,
            opts,
            on_piece=on_piece if ctx and ctx.partial_result_token is not None else None,
            on_done=on_done,
            constraint=constraint,
        )
        if ctx is not None:
            ctx.partial = functools.partial(job_result, job, text_of)
        try:
            while not done.is_set() or pieces:
                if pieces:
                    batch = pieces[:]
                    pieces.clear()
                    text = "".join(t for t, _ in batch)
                    toks = [x for _, ts in batch for x in ts]
                    assert ctx is not None  # pieces come only through on_piece, set only with a ctx
                    partial: dict[str, Any] = {"text": text, "tokens": toks}
                    if logprobs:  # (a token's logprob is in job.logprobs before its piece is sent)
                        partial["logprobs"] = token_logprobs(job.logprobs[sent : sent + len(toks)], text_of)
                        sent += len(toks)
                    if calls is not None and (completed := calls.feed(text)):
                        partial["toolCalls"] = completed
                    await ctx.report_partial(partial)
                    continue
                await wake.wait()
                wake = anyio.Event()
            if calls is not None and ctx is not None and ctx.partial_result_token is not None:
                if completed := calls.finish():  # calls only the whole reply shows (a bare JSON one)
                    await ctx.report_partial({"text": "", "tokens": [], "toolCalls": completed})
        except BaseException:
            entry.engine.cancel(job)
            raise
        if job.error is not None:
            if isinstance(job.error, errors.KinferError):
                raise job.error
            # the engine failed (a decode, a device, an RPC server): -32603 with what failed
            raise errors.KinferError(errors.INTERNAL_ERROR, str(job.error) or type(job.error).__name__)
        return {"model": entry.name, **job_result(job, text_of)}
