"""The models a server holds, and the inference methods on them.

Each loaded model is one Engine (one worker thread). Handlers here are the `model/*` and
`inference/*` methods; they receive a RequestContext for progress and partial results.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random

import anyio
import attrs

from kinfer_rpc import errors

from kinfer_rpc.host import templates as chat

from kinfer_rpc.host import gguf as gguf_meta

from kinfer_rpc.protocol import params as params
from kinfer_rpc.engine.scheduler import Engine, Job
from kinfer_rpc.host.plugins import Plugins
from kinfer_rpc.host.store import ModelStore
from kinfer_rpc.types import LoadOptions, MachineInfo, ModelFacts, PlacementPlan

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 4
DEFAULT_CONTEXT = 4096


@attrs.define(eq=False)
class Loaded:
    name: str
    backend: str
    options: LoadOptions
    engine: Engine
    ready: anyio.Event
    error: Exception | None = None
    source: str = ""
    draft_policy: str | None = None
    placement: str | None = None  # the placement that decided, or None when the backend places its own
    placement_reason: str = ""
    defaults: dict = attrs.field(factory=dict)  # the model's default generate options (Ollama params)
    system: str | None = None  # the model's default system message (Ollama system layer)


def _with_defaults(defaults: dict, options):
    """A model's default options under the request's (a null option counts as absent)."""
    if not defaults or not isinstance(options, (dict, type(None))):
        return options
    return {**defaults, **{k: v for k, v in (options or {}).items() if v is not None}}


def _load_options(obj, context_default: int | None = None) -> tuple[LoadOptions, dict]:
    f = params.Fields(obj, "options")
    slots = f.int("slots", DEFAULT_SLOTS, lo=1, hi=1024)
    batch = f.int("batch", 2048, lo=1, hi=1 << 20)
    opts = LoadOptions(
        context_length=f.int("contextLength", context_default or DEFAULT_CONTEXT, lo=16, hi=1 << 24),
        slots=slots,
        batch=batch,
        ubatch=f.int("ubatch", min(512, batch), lo=1, hi=1 << 20),
        threads=f.int("threads", None, lo=1, hi=1024),
        gpu_layers=f.int("gpuLayers", -1, lo=-1, hi=100000),
        flash_attention=f.bool("flashAttention", True),
        kv_type=f.str("kvType", None, choices={"f16", "q8_0"}),
        weights=f.str("weights", None, choices={"quantized", "dense"}),
    )
    extra = {
        "maxQueue": f.int("maxQueue", 4096, lo=1, hi=1 << 20),
        "verify": f.bool("verify", None),
        "draftPolicy": f.str("draftPolicy", None),
        "draftModel": f.str("draftModel", None),
        "drafts": f.int("drafts", None, lo=0, hi=64),
        # Tokens of finished conversations the prefix pool keeps; -1: no pool, per-slot streams
        # kept contiguous by compaction. Default: whatever the free slots hold.
        "prefix": f.int("prefix", None, lo=-1, hi=1 << 30),
        "placement": f.str("placement", None),
        # The options a user set: they win over what the placement decides.
        "given": frozenset(k for k, v in (obj or {}).items() if v is not None) if isinstance(obj, dict) else frozenset(),
    }
    f.done()
    if opts.slots > opts.batch:
        raise errors.invalid_params(f"options.slots ({opts.slots}) must not exceed options.batch ({opts.batch})")
    return opts, extra


def model_facts(path: str) -> ModelFacts:
    """What a placement may know of a GGUF model, from its header (no weights read)."""
    info = gguf_meta.read(path)
    h = info.hparams
    layers = h.get("block_count", 0)
    n_head = h.get("attention.head_count", 0)
    n_kv = h.get("attention.head_count_kv", n_head)
    n_embd = h.get("embedding_length", 0)
    k_len = h.get("attention.key_length", n_embd // n_head if n_head else 0)
    v_len = h.get("attention.value_length", k_len)
    experts = h.get("expert_count", 0)
    return ModelFacts(
        path=path,
        size_bytes=info.data_end,
        layers=layers,
        experts=experts,
        architecture=info.architecture or "",
        experts_used=h.get("expert_used_count", 0),
        weight_bytes=info.weight_bytes,
        expert_bytes=info.expert_bytes,
        outside_bytes=info.outside_bytes,
        n_embd=n_embd,
        n_vocab=h.get("vocab_size", info.n_vocab or 0),
        n_ff=h.get("expert_feed_forward_length", 0) if experts else h.get("feed_forward_length", 0),
        kv_bytes_per_cell=layers * n_kv * (k_len + v_len) * 2,
    )


class Runtime:
    def __init__(self, plugins: Plugins, store: ModelStore | None = None):
        self.plugins = plugins
        self.store = store or ModelStore()
        self.loaded: dict[str, Loaded] = {}
        self._last: str | None = None

    # -- models ------------------------------------------------------------------------------
    async def model_list(self, ctx, /, **p):
        params.Fields(p, "params").done()
        store = self.store
        described = await anyio.to_thread.run_sync(lambda: [store.describe(r) for r in store.list()])
        return {"models": [{**d, "loaded": d["name"] in self.loaded} for d in described]}

    async def model_load(self, ctx, /, **p):
        f = params.Fields(p, "params")
        name = f.str("model")
        backend = f.str("backend")
        options = f.raw("options")
        f.done()
        entry = await self._load(ctx, name, backend, options)
        return self._describe(entry)

    def _describe(self, entry: Loaded) -> dict:
        info = entry.engine.model.info
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
            **self._placement_fields(entry),
        }

    @staticmethod
    def _placement_fields(entry: Loaded) -> dict:
        return {
            "placement": entry.placement,
            "placementReason": entry.placement_reason,
            "hostTensors": list(entry.options.host_tensors),
        }

    async def _load(self, ctx, name, backend_name, options) -> Loaded:
        ref = self.store.resolve(name)
        existing = self.loaded.get(ref.name)
        if existing is None:
            opts, extra = _load_options(options, ref.context_length)
            backend = self._backend_for(ref.format, backend_name)
            # A backend lists the weight forms it can run (`weights`); without the attribute it runs
            # them as stored (llama: llama.cpp computes with the GGUF's own types).
            if opts.weights is not None and opts.weights not in getattr(backend, "weights", ("quantized",)):
                raise errors.KinferError(
                    errors.NOT_SUPPORTED,
                    f"the {backend.name} backend runs the weights as the model stores them; weights "
                    f"{opts.weights!r} needs a backend that can expand them at load (mlx)")
            policy = extra["draftPolicy"]
            if policy is not None and policy != "none" and policy not in self.plugins.draft_policies:
                raise errors.invalid_params(
                    f"unknown draft policy {policy!r}; available: "
                    f"{', '.join(sorted(self.plugins.draft_policies)) or 'none'}"
                )
            # None lets the backend choose from what a pass over k+1 positions costs on its
            # device; the count is fixed for the life of the load either way.
            draft_model = await anyio.to_thread.run_sync(self._draft_model, policy, extra["draftModel"])
            opts = attrs.evolve(opts, drafts=extra["drafts"], mtp=policy == "mtp", draft_model=draft_model)
            placement = extra["placement"]
            if placement is not None and placement not in self.plugins.placements:
                raise errors.invalid_params(
                    f"unknown placement {placement!r}; available: {', '.join(sorted(self.plugins.placements)) or 'none'}"
                )
            # The digest and the GGUF header, off the loop (hashing takes a while), before any engine.
            await anyio.to_thread.run_sync(self.store.prepare, ref, extra["verify"])
            opts, placed = await anyio.to_thread.run_sync(self._place, ref, backend, opts, placement, extra["given"])
            existing = self.loaded.get(ref.name)  # a concurrent load of it may have begun meanwhile
        if existing is not None:
            if options is not None:
                _load_options(options)  # still refuse bad options
            await existing.ready.wait()
            if existing.error is not None:
                raise existing.error
            self._last = ref.name
            return existing
        loop = asyncio.get_running_loop()
        ready = anyio.Event()
        entry = None

        def on_ready(exc):
            entry.error = (
                None if exc is None else
                exc if isinstance(exc, errors.KinferError) else
                errors.KinferError(errors.LOAD_FAILED, f"loading {ref.name} failed: {exc}")
            )
            ready.set()

        progress_sent = [0]

        def on_progress(fraction):
            pct = int(fraction * 100)
            if progress_sent[0] < 0:  # the request was cancelled: its progress has ended
                return
            if pct >= progress_sent[0] + 10 or pct == 100:
                progress_sent[0] = pct
                if ctx is not None and ctx.work_done_token is not None:
                    loop.create_task(ctx.work_done("report", percentage=pct, message=f"loading {ref.name}"))

        engine = Engine(
            lambda progress: backend.load(ref.path, opts, progress),
            loop.call_soon_threadsafe,
            batch=opts.batch,
            max_queue=extra["maxQueue"],
            prefix=extra["prefix"] if extra["prefix"] is not None else opts.slots * opts.context_length,
            on_progress=on_progress,
            on_ready=on_ready,
            draft_session=lambda policy, model: policy.session(model, backend, opts),
            draft_policy=self.plugins.draft_policies.get(policy) if policy else None,
        )
        entry = Loaded(ref.name, backend.name, opts, engine, ready, source=ref.source,
                       defaults=dict(ref.defaults), system=ref.system,
                       draft_policy=None if policy == "none" else policy,
                       placement=placed[0], placement_reason=placed[1])
        self.loaded[ref.name] = entry
        engine.start()  # first: whatever happens to this request, the load itself goes on
        ending = "failed"
        try:
            if ctx is not None:
                await ctx.work_done("begin", title=f"Loading {ref.name}", cancellable=False, percentage=0)
            await ready.wait()
            ending = "loaded" if entry.error is None else "failed"
        except BaseException:
            # Cancelled: the load goes on (the next request for the model waits for it), but
            # this request's progress ends here.
            progress_sent[0] = -1
            ending = "cancelled; the load goes on"
            raise
        finally:
            if ctx is not None:
                # Without awaiting: a cancelled task's send could be cancelled in turn.
                ctx.work_done_nowait("end", message=ending)
        if entry.error is not None:
            self.loaded.pop(ref.name, None)
            raise entry.error
        self._last = ref.name
        log.info("loaded %s with %s: %s", ref.name, backend.name, engine.model.info.description)
        return entry

    def _draft_model(self, policy: str | None, name: str | None) -> str | None:
        """The draft-model policy's GGUF: a name the store knows or a path."""
        if name is None:
            if policy == "draft-model":
                raise errors.invalid_params(
                    "draftPolicy draft-model needs options.draftModel: a GGUF model with the same vocabulary")
            return None
        if policy != "draft-model":
            raise errors.invalid_params("options.draftModel is only used with draftPolicy draft-model")
        ref = self.store.resolve(name)
        if ref.format != "gguf":
            raise errors.KinferError(errors.NOT_SUPPORTED, f"the draft model {ref.name} is not a GGUF file")
        self.store.prepare(ref, None)
        return ref.path

    def _place(self, ref, backend, opts: LoadOptions, name: str | None, given: frozenset):
        """Ask the placement what goes where; the options the user set win. Off the loop: the
        backend's machine() loads its library and asks the devices."""
        machine_of = getattr(backend, "machine", None)
        facts = model_facts(ref.path) if ref.format == "gguf" else None
        if machine_of is None or facts is None:
            if name is not None:
                raise errors.KinferError(
                    errors.NOT_SUPPORTED,
                    f"the {backend.name} backend places {ref.format} models itself; placements apply to "
                    "GGUF models on backends that report their machine (llama)")
            return opts, (None, f"the {backend.name} backend places the model itself")
        if name is None and "gpuLayers" in given:
            return opts, (None, f"gpuLayers {opts.gpu_layers} set by the load options")
        name = name or "auto"
        try:
            machine = machine_of()
        except Exception as exc:  # the backend's library cannot run here: the load fails, nothing else
            raise errors.KinferError(errors.LOAD_FAILED, f"loading {ref.name} failed: {exc}", {"path": ref.path}) from exc
        try:
            plan = self.plugins.placements[name].plan(facts, machine, opts)
        except ValueError as exc:
            raise errors.KinferError(errors.LOAD_FAILED, f"{ref.name} does not fit: {exc}", {"path": ref.path}) from None
        except Exception as exc:  # a third-party placement's bug: this load fails, nothing else
            raise errors.KinferError(errors.LOAD_FAILED, f"placement {name!r} failed: {type(exc).__name__}: {exc}",
                                     {"path": ref.path}) from None
        if not isinstance(plan, PlacementPlan):
            raise errors.KinferError(errors.LOAD_FAILED, f"placement {name!r} returned {type(plan).__name__}, not a PlacementPlan",
                                     {"path": ref.path})
        changes = {"host_tensors": tuple(plan.host_tensors)}
        notes = []
        if "gpuLayers" in given:
            notes.append(f"gpuLayers {opts.gpu_layers} set by the load options")
        else:
            changes["gpu_layers"] = plan.gpu_layers
        batch = opts.batch if "batch" in given else (plan.batch or opts.batch)
        if "batch" in given and plan.batch and plan.batch != batch:
            notes.append(f"batch {batch} set by the load options")
        ubatch = opts.ubatch if "ubatch" in given else min(plan.ubatch or opts.ubatch, batch)
        changes.update(batch=batch, ubatch=ubatch)
        if opts.slots > batch:
            raise errors.invalid_params(f"options.slots ({opts.slots}) must not exceed the pass size ({batch})")
        reason = plan.reason + "".join(f"; {n}" for n in notes)
        return attrs.evolve(opts, **changes), (name, reason)

    def _backend_for(self, fmt: str, wanted: str | None):
        backends = self.plugins.backends
        if wanted is not None:
            if wanted not in backends:
                raise errors.KinferError(
                    errors.BACKEND_UNAVAILABLE,
                    f"backend {wanted!r} is not available; loaded backends: {', '.join(sorted(backends)) or 'none'}",
                )
            if fmt not in backends[wanted].formats:
                raise errors.KinferError(errors.BACKEND_UNAVAILABLE, f"backend {wanted!r} cannot read {fmt} models")
            return backends[wanted]
        # A backend whose own format it is (listed first) wins over one that also reads it: GGUF
        # goes to llama, MLX folders to mlx; `backend` in model/load picks another.
        readers = [b for b in backends.values() if fmt in b.formats]
        if readers:
            return min(readers, key=lambda b: (tuple(b.formats).index(fmt), b.name))
        raise errors.KinferError(errors.BACKEND_UNAVAILABLE, f"no loaded backend reads {fmt} models (needs the mlx backend?)")

    async def model_unload(self, ctx, /, **p):
        f = params.Fields(p, "params")
        name = f.str("model")
        f.done()
        if name is None:
            raise errors.invalid_params("params.model is required")
        entry = self.loaded.get(name)
        if entry is None:
            matches = [n for n in self.loaded if n.startswith(name)]
            if len(matches) != 1:
                raise errors.KinferError(errors.MODEL_NOT_FOUND, f"model {name!r} is not loaded; loaded: {', '.join(self.loaded) or 'none'}")
            entry = self.loaded[matches[0]]
        self.loaded.pop(entry.name, None)
        if self._last == entry.name:
            self._last = None
        await anyio.to_thread.run_sync(entry.engine.stop)
        return None

    async def model_status(self, ctx, /, **p):
        f = params.Fields(p, "params")
        name = f.str("model")
        f.done()
        out = []
        for entry in list(self.loaded.values()):
            if name is not None and entry.name != name:
                continue
            if not entry.ready.is_set() or entry.error is not None:
                out.append({"model": entry.name, "backend": entry.backend, "state": "loading"})
                continue
            out.append({"model": entry.name, "backend": entry.backend, "state": "ready", **entry.engine.status(),
                        "batch": entry.options.batch, "ubatch": entry.options.ubatch,
                        "gpuLayers": entry.options.gpu_layers, **self._placement_fields(entry)})
        return {"models": out}

    def close(self) -> None:
        for entry in list(self.loaded.values()):
            entry.engine.stop(timeout=2.0)
        self.loaded.clear()

    # -- inference ---------------------------------------------------------------------------
    async def _model_for(self, ctx, name) -> Loaded:
        if name is None and self._last is not None and self._last in self.loaded:
            name = self._last
        return await self._load(None, name, None, None)

    async def inference_generate(self, ctx, /, **p):
        f = params.Fields(p, "params")
        name = f.str("model")
        prompt = f.str("prompt")
        tokens = f.raw("tokens")
        add_special = f.bool("addSpecial", None)
        options = f.raw("options")
        f.done()
        if (prompt is None) == (tokens is None):
            raise errors.invalid_params("give exactly one of params.prompt and params.tokens")
        seed = random.getrandbits(63)
        opts = params.generate_options(options, seed)
        entry = await self._model_for(ctx, name)
        if entry.defaults:
            opts = params.generate_options(_with_defaults(entry.defaults, options), seed)
        model = entry.engine.model
        if tokens is not None:
            ids = params.tokens(tokens, model.info.n_vocab)
        else:
            add = model.info.add_bos if add_special is None else add_special
            ids = model.tokenize(prompt, add, True)
        return await self._run(ctx, entry, ids, opts)

    async def inference_chat(self, ctx, /, **p):
        f = params.Fields(p, "params")
        name = f.str("model")
        messages = params.messages(f.raw("messages"))
        options = f.raw("options")
        f.done()
        seed = random.getrandbits(63)
        opts = params.generate_options(options, seed)
        entry = await self._model_for(ctx, name)
        if entry.defaults:
            opts = params.generate_options(_with_defaults(entry.defaults, options), seed)
        if entry.system and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": entry.system}, *messages]
        model = entry.engine.model
        # Off the event loop: a model file's template is untrusted and may be slow; the server
        # keeps answering everyone else meanwhile (the sandbox also caps its loops).
        text = await anyio.to_thread.run_sync(
            functools.partial(chat.render, entry.engine.template, messages, bos=model.info.bos_text, eos=model.info.eos_text)
        )
        add_bos = model.info.add_bos and not (model.info.bos_text and text.startswith(model.info.bos_text))
        ids = model.tokenize(text, add_bos, True)
        return await self._run(ctx, entry, ids, opts)

    async def inference_tokenize(self, ctx, /, **p):
        f = params.Fields(p, "params")
        name = f.str("model")
        text = f.str("text")
        add_special = f.bool("addSpecial", None)
        parse_special = f.bool("parseSpecial", True)
        f.done()
        if text is None:
            raise errors.invalid_params("params.text is required")
        entry = await self._model_for(ctx, name)
        model = entry.engine.model
        add = model.info.add_bos if add_special is None else add_special
        ids = model.tokenize(text, add, parse_special)
        return {"tokens": ids, "pieces": [model.token_bytes(t).decode("utf-8", "replace") for t in ids]}

    def _drafting(self, entry: Loaded, opts):
        """The request's draft policy and count: the load's, unless the request overrides."""
        name = opts.draft_policy if opts.draft_policy is not None else entry.draft_policy
        if name in (None, "none"):
            return attrs.evolve(opts, draft_policy=None, drafts=0)
        policy = self.plugins.draft_policies.get(name)
        if policy is None:
            raise errors.invalid_params(
                f"unknown draft policy {name!r}; available: {', '.join(sorted(self.plugins.draft_policies)) or 'none'}"
            )
        if hasattr(policy, "session") and name != entry.draft_policy:
            raise errors.invalid_params(
                f"draft policy {name!r} keeps state per load (a draft model, an MTP head): load the model "
                f"with draftPolicy {name!r} to use it"
            )
        loaded_for = entry.engine.model.info.drafts
        drafts = loaded_for if opts.drafts is None else opts.drafts
        if drafts > loaded_for:
            raise errors.invalid_params(
                f"options.drafts ({drafts}) exceeds what the model was loaded for ({loaded_for}); "
                "load it with a larger drafts option"
            )
        return attrs.evolve(opts, draft_policy=policy, drafts=drafts)

    async def _run(self, ctx, entry: Loaded, ids: list[int], opts) -> dict:
        opts = self._drafting(entry, opts)
        done = anyio.Event()
        pieces: list = []
        wake = anyio.Event()

        def on_piece(text, toks):
            pieces.append((text, toks))
            wake.set()

        job = Job(ids, opts, on_piece=on_piece if ctx and ctx.partial_result_token is not None else None,
                  on_done=lambda j: (done.set(), wake.set()))
        if ctx is not None:
            ctx.partial = job.result
        entry.engine.submit(job)
        try:
            while not done.is_set() or pieces:
                if pieces:
                    batch = pieces[:]
                    pieces.clear()
                    text = "".join(t for t, _ in batch)
                    toks = [x for _, ts in batch for x in ts]
                    await ctx.report_partial({"text": text, "tokens": toks})
                    continue
                await wake.wait()
                wake = anyio.Event()
        except BaseException:
            entry.engine.cancel(job)
            raise
        if job.error is not None:
            raise job.error
        return {"model": entry.name, **job.result()}
