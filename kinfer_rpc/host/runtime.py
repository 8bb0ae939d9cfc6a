"""The models a server holds: loading (backend, placement, draft policy), unloading, and starting
jobs on them. Each loaded model is one Engine (one worker thread). The protocol's handlers
(kinfer_rpc.protocol.handlers) turn params into calls here and what comes back into results.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypedDict

import anyio
import attrs

from kinfer_rpc import errors
from kinfer_rpc.engine.grammar import Grammars
from kinfer_rpc.engine.job import GenerateOptions, Job, Outcome
from kinfer_rpc.engine.scheduler import Engine
from kinfer_rpc.engine.scheduler import EngineStats as EngineStats  # what model/status reports
from kinfer_rpc.host import gguf as gguf_meta
from kinfer_rpc.host import infill, reasoning
from kinfer_rpc.host.options import LoadRequest, RequestOptions
from kinfer_rpc.host.plugins import Plugins
from kinfer_rpc.host.store import ModelRef, ModelStore
from kinfer_rpc.types import (
    Backend,
    BackendFeatures,
    LoadedModel,
    LoadOptions,
    MachineAware,
    MachineInfo,
    Media,
    ModelFacts,
    PlacementPlan,
    Reproducible,
    SessionPolicy,
    ShiftsCells,
    WeightForms,
)

log = logging.getLogger(__name__)


# model file -> the most bytes one token of its vocabulary stands for (Loaded.tokenize)
_max_piece: dict[str, int] = {}


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
    defaults: RequestOptions = RequestOptions()  # the model's default generate options (Ollama params)
    system: str | None = None  # the model's default system message (Ollama system layer)
    ignored: tuple[tuple[str, str], ...] = ()  # Ollama parameters left out, and why
    go_template: bool = False  # the model came with Ollama's Go template (never run)
    # One tokenizing thread a model: requests reach the engine in the order they came.
    tokenizer: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(1))
    grammars: Grammars = attrs.field(factory=Grammars)  # compiles requests' formats, grammars, regexes
    # Compiles of a model's constraints at once: apart from its tokenizing thread, so that a slow
    # schema holds up no other request's prompt
    compiler: anyio.CapacityLimiter = attrs.field(factory=lambda: anyio.CapacityLimiter(2))
    fim: dict[str, int] | None = None  # the model's fill-in-the-middle tokens, once asked for
    # how the model marks its reasoning (host.reasoning.Markers, None: it does not), once asked for
    thinks: tuple[reasoning.Markers | None] | None = None
    # -- sharing (one runtime, many connections) --
    request: LoadRequest = LoadRequest()  # the load's options as given (a later load must agree)
    holders: set[int] = attrs.field(factory=set)  # the connections that loaded it or ran requests on it
    loads: int = 1  # model/load calls answered with this instance (the first one loaded it)
    pinned: bool = False  # never evicted for another load, never unloaded for being idle
    # Seconds it stays loaded once idle (Ollama's keep_alive); inf: until unloaded
    keep_alive: float = float("inf")
    running: int = 0  # requests in flight on it
    idle_since: float = attrs.field(factory=time.monotonic)  # when its last request ended

    def expires(self) -> float | None:
        """When it is unloaded for being idle (time.monotonic()), or None: never (pinned, running,
        or kept until unloaded)."""
        if self.pinned or self.running or self.keep_alive == float("inf"):
            return None
        return self.idle_since + self.keep_alive

    def tokenize(self, text: str, add_special: bool, parse_special: bool, context: int | None = None) -> list[int]:
        """Tokenize with the model held open (an unload waits), off the event loop. With a
        `context`, a text too long for it even at the vocabulary's longest token per token is
        -31002 before any of it is tokenized."""
        with self.engine.hold() as model:
            if context is not None:
                piece = _piece(model)
                size = len(text.encode("utf-8", "surrogatepass"))
                if size > context * piece:
                    raise errors.KinferError(
                        errors.CONTEXT_OVERFLOW,
                        f"the prompt is {size} bytes, more than {context} tokens can hold (at most "
                        f"{piece} bytes a token)",
                        {"promptBytes": size, "contextLength": context},
                    )
            return model.tokenize(text, add_special, parse_special)

    def fim_tokens(self) -> dict[str, int]:
        """The model's fill-in-the-middle tokens (kinfer_rpc.host.infill), found once."""
        if self.fim is None:
            with self.engine.hold() as model:
                self.fim = infill.fim_tokens(model)
        return self.fim

    def reasoning_markers(self) -> reasoning.Markers | None:
        """How the model marks its reasoning (kinfer_rpc.host.reasoning), found once."""
        if self.thinks is None:
            with self.engine.hold() as model:

                def one_token(text: str) -> bool:
                    return len(model.tokenize(text, False, True)) == 1

                self.thinks = (reasoning.markers(self.engine.template, one_token),)
        return self.thinks[0]

    def infill_prompt(
        self,
        prefix: str,
        suffix: str,
        extra: list[tuple[str, str]],
        n_predict: int,
        spm: bool = False,
        middle: str | None = None,
    ) -> infill.Prompt:
        """A fill-in-the-middle prompt for this model (its FIM tokens known to be there), with the
        model held open, off the event loop."""
        fim = self.fim_tokens()
        with self.engine.hold() as model:
            context = model.info.context_length
            budget = infill.Budget.of(self.options.batch, context, n_predict, middle=middle is not None)
            return infill.build(model, fim, prefix, suffix, extra, budget, _piece(model), spm=spm, middle=middle)

    def constrain(self, opts: GenerateOptions) -> Any:
        """The matcher of a request's format, grammar or regex (None without one), compiled
        against the model's vocabulary with the model held open, off the event loop."""
        if opts.constraint is None:
            return None
        with self.engine.hold() as model:
            return self.grammars.matcher(model, *opts.constraint)


def _projector(ref: ModelRef, backend: Backend, given: str | None) -> str | None:
    """The vision projector a load gives the backend: the file options.projector names (a path;
    ~ is the home folder; -32602 if there is none, -31006 if the backend reads no images), else
    the one the store found (an Ollama model's projector layer) where the backend reads images;
    without that the model loads for text, and says so in the log."""
    features = backend.features() if isinstance(backend, BackendFeatures) else {}
    if given is None:
        if ref.projector is not None and not features.get("vision"):
            why = features.get("visionUnavailable") or f"the {backend.name} backend reads no images"
            log.warning("%s loads for text, without its vision projector: %s", ref.name, why)
            return None
        return ref.projector
    path = Path(given).expanduser()
    if not path.is_file():
        raise errors.invalid_params(
            f"options.projector: no file {given!r} (the path of a vision projector GGUF, llama.cpp's mmproj)",
            {"field": "options.projector"},
        )
    if not features.get("vision"):
        why = features.get("visionUnavailable") or f"the {backend.name} backend reads no images"
        raise errors.KinferError(errors.NOT_SUPPORTED, f"options.projector: {why}", {"field": "options.projector"})
    return str(path.resolve())


def _check_cache_reuse(entry: Loaded) -> None:
    """-32602 unless the load can reuse cached chunks that moved (options.cacheReuse): the prefix
    pool is on and the backend shifts cells for this model."""
    model = entry.engine.model
    why = ""
    if entry.engine.prefix < 0:
        why = "the load has no prefix pool (prefix -1)"
    elif not isinstance(model, ShiftsCells):
        why = f"its backend ({entry.backend}) cannot shift KV cells"
    elif not model.can_shift():
        why = "its KV cells cannot be shifted (the architecture's positions, or a multi-token-prediction head)"
    if why:
        raise errors.invalid_params(
            f"options.cacheReuse: {entry.name!r} cannot reuse cached chunks that moved: {why}",
            {"field": "options.cacheReuse"},
        )


def _piece(model: LoadedModel) -> int:
    """The most bytes one token of the model's vocabulary stands for."""
    piece = _max_piece.get(model.info.path)
    if piece is None:  # once a model file: the scan fills the backend's piece cache
        piece = max(1, max(len(model.token_bytes(t)) for t in range(model.info.n_vocab)))
        _max_piece[model.info.path] = piece
    return piece


def reproducibility(model: LoadedModel) -> tuple[bool, str]:
    """Whether a load promises the same reply for the same request whatever else runs, and why."""
    if isinstance(model, Reproducible):
        promised, reason = model.reproducible()
        return bool(promised), str(reason)
    return False, "its backend does not say whether its passes are batch-invariant"


def _load_reproducible(
    backend: Backend, path: str, opts: LoadOptions, progress: Callable[[float], None]
) -> LoadedModel:
    """backend.load, refusing a load asked to be reproducible (options.reproducible true) that
    cannot promise it."""
    model = backend.load(path, opts, progress)
    if opts.reproducible:
        promised, reason = reproducibility(model)
        if not promised:
            model.close()
            raise errors.invalid_params(
                f"options.reproducible: this load cannot promise the same reply whatever else runs: {reason}",
                {"reason": reason},
            )
    return model


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


class DoesNotFit(errors.KinferError):
    """A placement found no room for the model (-31003): idle models may be unloaded to make some."""


def _check_compatible(entry: Loaded, request: LoadRequest) -> None:
    """-32602 when a load of a model already loaded names an option with another value than
    the loaded instance runs with: one instance of a model is shared by every connection."""
    extras = entry.request.resolve(entry.options.context_length)[1]
    for a in attrs.fields(LoadRequest):
        wanted = getattr(request, a.name)
        wire = a.metadata["wire"]
        if wanted is None or wire == "verify":  # verifying the file again changes nothing loaded
            continue
        has = getattr(entry.request, a.name)
        if has is None:  # what the loaded instance runs with, as the placement and defaults set it
            where: Any = entry.options if hasattr(entry.options, a.name) else extras
            has = {"placement": entry.placement, "draft_policy": entry.draft_policy}.get(a.name, getattr(where, a.name))
        if wanted != has:
            raise errors.invalid_params(
                f"model {entry.name!r} is loaded with {wire} {_show(has)}, not {_show(wanted)}: a loaded model "
                "is shared by every client; unload it first, or load it without that option",
                {"field": f"options.{wire}", "loaded": list(has) if isinstance(has, tuple) else has},
            )


class LoadProgress(Protocol):
    """How a load reports its progress (the protocol layer sends it as work-done progress)."""

    async def begin(self, title: str) -> None: ...

    def report(self, percentage: int, message: str) -> None: ...

    def end(self, message: str) -> None: ...


class _Placed(TypedDict, total=False):
    """The load options a placement's plan changes (attrs.evolve's keywords)."""

    host_tensors: tuple[str, ...]
    gpu_layers: int
    batch: int
    ubatch: int
    split_mode: str | None
    tensor_split: tuple[float, ...]
    main_gpu: int | None


SPLIT_OPTIONS = {"splitMode": "split_mode", "tensorSplit": "tensor_split", "mainGpu": "main_gpu"}


def check_split(opts: LoadOptions, given: frozenset[str], machine: MachineInfo) -> None:
    """-32602 for a mainGpu or tensorSplit the machine's GPUs cannot take (a backend that gives
    only the sums of its GPUs' memory is not checked)."""
    count = len(machine.gpus) if machine.gpus or not machine.has_gpu else None
    if count is None:
        return
    seen = f"{count} GPU{'s' if count != 1 else ''}" if count else "no GPU"
    if "mainGpu" in given and opts.main_gpu is not None and opts.main_gpu >= count:
        raise errors.invalid_params(
            f"options.mainGpu {opts.main_gpu}: the backend sees {seen}" + (f" (0 to {count - 1})" if count else ""),
            {"field": "options.mainGpu", "gpus": count},
        )
    if "tensorSplit" in given and len(opts.tensor_split) > count:
        raise errors.invalid_params(
            f"options.tensorSplit gives {len(opts.tensor_split)} shares but the backend sees {seen}",
            {"field": "options.tensorSplit", "gpus": count},
        )


def split_of(plan: PlacementPlan, opts: LoadOptions, given: frozenset[str]) -> tuple[_Placed, list[str]]:
    """How the load's layers go over several GPUs: the plan's split mode, shares and main GPU,
    each unless the load options set it, and notes saying what the options changed. Shares
    given without a split mode split by layer (they mean nothing to split mode none); a main GPU
    given alone puts the whole model there (split mode none), as one GPU named means."""
    mode = opts.split_mode if "splitMode" in given else plan.split_mode
    shares = opts.tensor_split if "tensorSplit" in given else tuple(plan.tensor_split)
    main = opts.main_gpu if "mainGpu" in given else plan.main_gpu
    notes = {
        key: f"{key} {_show(getattr(opts, field))} set by the load options"
        for key, field in SPLIT_OPTIONS.items()
        if key in given
    }
    if "splitMode" not in given:
        if "tensorSplit" in given and mode in (None, "none"):
            mode = "layer"
            notes["tensorSplit"] += ", so split by layer"
        elif "mainGpu" in given and "tensorSplit" not in given and mode != "none":
            mode = "none"
            notes["mainGpu"] += f", so every layer on GPU {main} (splitMode none)"
    if mode == "none" and "tensorSplit" not in given:
        shares = ()  # nothing to share out
    if mode == "layer" and "mainGpu" not in given:
        main = None  # split mode layer has no main GPU
    return {"split_mode": mode, "tensor_split": shares, "main_gpu": main}, list(notes.values())


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(f"{v:g}" for v in value) + "]"
    return str(value)


class Runtime:
    def __init__(self, plugins: Plugins, store: ModelStore | None = None):
        self.plugins = plugins
        self.store = store or ModelStore()
        self.loaded: dict[str, Loaded] = {}
        self.failed: dict[str, tuple[str, str]] = {}  # name -> (backend, error): see _failed
        # name -> the engine of a failed load, still closing its model (see _failed, _settle)
        self._closing: dict[str, Engine] = {}
        self._last: str | None = None
        # How long a model stays loaded once idle, unless a load or request says (seconds; inf:
        # until unloaded, as a server that one client spawned keeps it). A daemon sets its own.
        self.keep_alive = float("inf")
        self.connections = 0  # open connections: with more than one, a model's slots are shared (Engine.share)

    async def load(
        self,
        name: str | None,
        backend_name: str | None = None,
        request: LoadRequest | None = None,
        progress: LoadProgress | None = None,
        *,
        owner: int | None = None,
        keep_alive: float | None = None,
        pin: bool | None = None,
        evicted: list[str] | None = None,
    ) -> Loaded:
        """Load (or join the load of) a model by name with the load's options; returns once
        ready. A model already loaded is shared: a load that names an option must name the value
        it was loaded with (-32602 names the first that differs). `owner` (a connection) becomes
        one of its holders; `keep_alive` (seconds, inf: until unloaded) and `pin` change how long
        it stays. When the model does not fit, idle unpinned models are unloaded, least recently
        used first, until it does: their names go to `evicted`."""
        ref = self.store.resolve(name)
        existing = self.loaded.get(ref.name)
        if existing is not None and request is not None and existing.ready.is_set() and existing.error is None:
            _check_compatible(existing, request)
        if existing is None:
            await self._settle(ref.name)  # a failed load of it frees its memory before this one places
            opts, extra = (request or LoadRequest()).resolve(ref.context_length)
            backend = self._backend_for(ref.format, backend_name)
            # A backend lists the weight forms it can run (`weights`); without the attribute it runs
            # them as stored (llama: llama.cpp computes with the GGUF's own types).
            forms = backend.weights if isinstance(backend, WeightForms) else ("quantized",)
            if opts.weights is not None and opts.weights not in forms:
                raise errors.KinferError(
                    errors.NOT_SUPPORTED,
                    f"the {backend.name} backend runs the weights as the model stores them; weights "
                    f"{opts.weights!r} needs a backend that can expand them at load (mlx)",
                )
            policy = extra.draft_policy
            if policy is not None and policy != "none" and policy not in self.plugins.draft_policies:
                raise errors.invalid_params(
                    f"unknown draft policy {policy!r}; available: "
                    f"{', '.join(sorted(self.plugins.draft_policies)) or 'none'}"
                )
            # None lets the backend choose from what a pass over k+1 positions costs on its
            # device; the count is fixed for the life of the load either way.
            draft_model = await anyio.to_thread.run_sync(self._draft_model, policy, extra.draft_model, backend)
            opts = attrs.evolve(opts, drafts=extra.drafts, mtp=policy == "mtp", draft_model=draft_model)
            # A projector named by the load, else the one the store found (an Ollama model's layer).
            opts = attrs.evolve(opts, projector=_projector(ref, backend, opts.projector))
            placement = extra.placement
            if placement is not None and placement not in self.plugins.placements:
                raise errors.invalid_params(
                    f"unknown placement {placement!r}; "
                    f"available: {', '.join(sorted(self.plugins.placements)) or 'none'}"
                )
            # The digest and the GGUF header, off the loop (hashing takes a while), before any engine.
            await anyio.to_thread.run_sync(self.store.prepare, ref, extra.verify)
            if backend.name == "llama":  # llama.cpp aborts the process on some bad hparams: refuse them first
                for path in (ref.path, draft_model) if draft_model else (ref.path,):
                    await anyio.to_thread.run_sync(gguf_meta.check_llama, path)
            while True:
                try:
                    placed_opts, placed = await anyio.to_thread.run_sync(
                        self._place, ref, backend, opts, placement, extra.given
                    )
                    break
                except DoesNotFit:
                    victim = self._least_recently_used(ref.name)
                    if victim is None:
                        raise
                    log.warning("unloading %s (idle since its last request) to make room for %s", victim, ref.name)
                    await self.unload(victim)
                    if evicted is not None:
                        evicted.append(victim)
            opts = placed_opts
            existing = self.loaded.get(ref.name)  # a concurrent load of it may have begun meanwhile
        if existing is not None:
            await existing.ready.wait()
            if existing.error is not None:
                raise existing.error
            if request is not None:
                _check_compatible(existing, request)
                existing.loads += 1
            self._hold(existing, owner, keep_alive, pin)
            self._last = ref.name
            return existing
        loop = asyncio.get_running_loop()
        ready = anyio.Event()
        entry: Loaded | None = None

        def on_ready(exc: Exception | None) -> None:
            assert entry is not None, "the entry is made before its engine starts"
            entry.error = (
                None
                if exc is None
                else exc
                if isinstance(exc, errors.KinferError)
                else errors.KinferError(errors.LOAD_FAILED, f"loading {ref.name} failed: {exc}")
            )
            ready.set()

        progress_sent = [0]

        def on_progress(fraction: float) -> None:
            pct = int(fraction * 100)
            if progress_sent[0] < 0:  # the request was cancelled: its progress has ended
                return
            if pct >= progress_sent[0] + 10 or pct == 100:
                progress_sent[0] = pct
                if progress is not None:
                    progress.report(pct, f"loading {ref.name}")

        engine = Engine(
            lambda progress: _load_reproducible(backend, ref.path, opts, progress),
            loop.call_soon_threadsafe,
            batch=opts.batch,
            max_queue=extra.max_queue,
            prefix=extra.prefix if extra.prefix is not None else opts.slots * opts.context_length,
            on_progress=on_progress,
            on_ready=on_ready,
            on_failed=lambda exc: self._failed(ref.name, entry, exc),
            draft_session=lambda policy, model: policy.session(model, backend, opts),
            draft_policy=self.plugins.draft_policies.get(policy) if policy else None,
        )
        entry = Loaded(
            ref.name,
            backend.name,
            opts,
            engine,
            ready,
            source=ref.source,
            defaults=ref.defaults,
            system=ref.system,
            ignored=ref.ignored,
            go_template=ref.template is not None,
            draft_policy=None if policy == "none" else policy,
            placement=placed[0],
            placement_reason=placed[1],
            request=request or LoadRequest(),
            keep_alive=self.keep_alive,
        )
        self._hold(entry, owner, keep_alive, pin)
        self.loaded[ref.name] = entry
        self.failed.pop(ref.name, None)
        engine.start()  # first: whatever happens to this request, the load itself goes on
        ending = "failed"
        try:
            if progress is not None:
                await progress.begin(f"Loading {ref.name}")
            await ready.wait()
            ending = "loaded" if entry.error is None else "failed"
        except BaseException:
            # Cancelled: the load goes on (the next request for the model waits for it), but
            # this request's progress ends here.
            progress_sent[0] = -1
            ending = "cancelled; the load goes on"
            raise
        finally:
            if progress is not None:
                progress.end(ending)  # never awaits: a cancelled task's send could be cancelled in turn
        if entry.error is not None:
            self.loaded.pop(ref.name, None)
            raise entry.error
        self._last = ref.name
        model = engine.model
        assert model is not None, "a loaded engine holds its model"
        log.info("loaded %s with %s: %s", ref.name, backend.name, model.info.description)
        return entry

    def _hold(self, entry: Loaded, owner: int | None, keep_alive: float | None, pin: bool | None) -> None:
        if owner is not None:
            entry.holders.add(owner)
        if keep_alive is not None:
            entry.keep_alive = keep_alive
            entry.idle_since = time.monotonic()
        if pin is not None:
            entry.pinned = pin
        entry.engine.share = self.connections > 1

    def release(self, owner: int) -> None:
        """A connection ended: it holds no model any more (each stays for its keep-alive)."""
        for entry in list(self.loaded.values()):
            if owner in entry.holders:
                entry.holders.discard(owner)
                if not entry.running:
                    entry.idle_since = time.monotonic()

    def share(self, connections: int) -> None:
        """How many connections are open: with more than one, no connection takes a model's last
        free slot while it holds one (Engine.share)."""
        self.connections = connections
        for entry in list(self.loaded.values()):
            entry.engine.share = connections > 1

    def _least_recently_used(self, sparing: str) -> str | None:
        """The idle, unpinned, loaded model (not `sparing`) whose last request ended longest ago."""
        idle = [
            e
            for e in self.loaded.values()
            if e.name != sparing and e.ready.is_set() and e.error is None and not e.pinned and not e.running
        ]
        return min(idle, key=lambda e: e.idle_since).name if idle else None

    async def reap(self) -> list[Loaded]:
        """Unload the models idle past their keep-alive; returns them."""
        now = time.monotonic()
        gone = []
        for entry in list(self.loaded.values()):
            expires = entry.expires() if entry.ready.is_set() and entry.error is None else None
            if expires is not None and now >= expires and self.loaded.get(entry.name) is entry:
                log.info("unloading %s: idle for %.0f s (keepAlive)", entry.name, now - entry.idle_since)
                await self.unload(entry.name)
                gone.append(entry)
        return gone

    def _draft_model(self, policy: str | None, name: str | None, backend: Backend) -> str | None:
        """The draft-model policy's model, which the target's backend loads: a name the store
        knows or a path, in a format that backend reads."""
        if name is None:
            if policy == "draft-model":
                raise errors.invalid_params(
                    "draftPolicy draft-model needs options.draftModel: a model with the same vocabulary"
                )
            return None
        if policy != "draft-model":
            raise errors.invalid_params("options.draftModel is only used with draftPolicy draft-model")
        ref = self.store.resolve(name)
        if ref.format not in backend.formats:
            raise errors.KinferError(
                errors.NOT_SUPPORTED,
                f"the draft model {ref.name} is a {ref.format} model and the {backend.name} backend, which"
                f" runs it beside the model, reads {' and '.join(backend.formats)}",
            )
        self.store.prepare(ref, None)
        return ref.path

    def _place(
        self, ref: ModelRef, backend: Backend, opts: LoadOptions, name: str | None, given: frozenset[str]
    ) -> tuple[LoadOptions, tuple[str | None, str]]:
        """Ask the placement what goes where; the options the user set win. Off the loop: the
        backend's machine() loads its library and asks the devices."""
        if opts.rpc_servers:
            if backend.name != "llama":
                raise errors.KinferError(
                    errors.NOT_SUPPORTED, f"options.rpcServers needs the llama backend, not {backend.name}"
                )
            if name is not None:
                raise errors.invalid_params(
                    "options.rpcServers places the model over its servers: it takes no placement",
                    {"field": "placement"},
                )
            layers = f"gpuLayers {opts.gpu_layers}" if "gpuLayers" in given else "every layer"
            split = "tensorSplit" if opts.tensor_split else "each device's free memory"
            return opts, (
                None,
                f"rpcServers: {layers} off this host's CPU, spread over "
                f"{len(opts.rpc_servers)} RPC server(s) (and this host's GPUs) by {split}",
            )
        machine_of = backend.machine if isinstance(backend, MachineAware) else None
        facts = model_facts(ref.path) if ref.format == "gguf" else None
        if machine_of is None or facts is None:
            asked = sorted(k for k in SPLIT_OPTIONS if k in given)
            if asked and backend.name != "llama":
                raise errors.KinferError(
                    errors.NOT_SUPPORTED, f"options.{asked[0]} needs the llama backend, not {backend.name}"
                )
            if name is not None:
                raise errors.KinferError(
                    errors.NOT_SUPPORTED,
                    f"the {backend.name} backend places {ref.format} models itself; placements apply to "
                    "GGUF models on backends that report their machine (llama)",
                )
            return opts, (None, f"the {backend.name} backend places the model itself")
        if name is None and "gpuLayers" in given:
            reason = f"gpuLayers {opts.gpu_layers} set by the load options"
            if not given & SPLIT_OPTIONS.keys():
                return opts, (None, reason)
            check_split(opts, given, self._machine(ref, machine_of))
            own, own_notes = split_of(PlacementPlan(gpu_layers=opts.gpu_layers), opts, given)
            return attrs.evolve(opts, **own), (None, "; ".join([reason, *own_notes]))
        name = name or "auto"
        machine = self._machine(ref, machine_of)
        check_split(opts, given, machine)
        try:
            plan = self.plugins.placements[name].plan(facts, machine, opts)
        except ValueError as exc:
            raise DoesNotFit(errors.LOAD_FAILED, f"{ref.name} does not fit: {exc}", {"path": ref.path}) from None
        except Exception as exc:  # a third-party placement's bug: this load fails, nothing else
            raise errors.KinferError(
                errors.LOAD_FAILED, f"placement {name!r} failed: {type(exc).__name__}: {exc}", {"path": ref.path}
            ) from None
        if not isinstance(plan, PlacementPlan):
            raise errors.KinferError(
                errors.LOAD_FAILED,
                f"placement {name!r} returned {type(plan).__name__}, not a PlacementPlan",
                {"path": ref.path},
            )
        changes: _Placed = {"host_tensors": tuple(plan.host_tensors)}
        notes: list[str] = []
        if "gpuLayers" in given:
            notes.append(f"gpuLayers {opts.gpu_layers} set by the load options")
        else:
            changes["gpu_layers"] = plan.gpu_layers
        batch = opts.batch if "batch" in given else (plan.batch or opts.batch)
        if "batch" in given and plan.batch and plan.batch != batch:
            notes.append(f"batch {batch} set by the load options")
        ubatch = opts.ubatch if "ubatch" in given else min(plan.ubatch or opts.ubatch, batch)
        changes.update({"batch": batch, "ubatch": ubatch})
        spread, spread_notes = split_of(plan, opts, given)
        changes.update(spread)
        notes += spread_notes
        if opts.slots > batch:
            raise errors.invalid_params(f"options.slots ({opts.slots}) must not exceed the pass size ({batch})")
        reason = plan.reason + "".join(f"; {n}" for n in notes)
        return attrs.evolve(opts, **changes), (name, reason)

    @staticmethod
    def _machine(ref: ModelRef, machine_of: Callable[[], MachineInfo]) -> MachineInfo:
        try:
            return machine_of()
        except Exception as exc:  # the backend's library cannot run here: the load fails, nothing else
            raise errors.KinferError(
                errors.LOAD_FAILED, f"loading {ref.name} failed: {exc}", {"path": ref.path}
            ) from exc

    def _backend_for(self, fmt: str, wanted: str | None) -> Backend:
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
        raise errors.KinferError(
            errors.BACKEND_UNAVAILABLE, f"no loaded backend reads {fmt} models (needs the mlx backend?)"
        )

    def close(self) -> None:
        for engine in [entry.engine for entry in self.loaded.values()] + list(self._closing.values()):
            engine.stop(timeout=2.0)
        self.loaded.clear()
        self._closing.clear()

    # -- inference ---------------------------------------------------------------------------
    async def model_for(self, name: str | None, owner: int | None = None, keep_alive: float | None = None) -> Loaded:
        """The model a request names, else the one used last; loaded with its defaults if need
        be. `owner` (the request's connection) becomes one of its holders."""
        if name is None and self._last is not None and self._last in self.loaded:
            name = self._last
        return await self.load(name, None, None, owner=owner, keep_alive=keep_alive)

    def drafting(self, entry: Loaded, opts: GenerateOptions) -> GenerateOptions:
        """The request's draft policy and count: the load's, unless the request overrides."""
        requested = opts.draft_policy
        assert requested is None or isinstance(requested, str), "a request names its draft policy"
        name = requested if requested is not None else entry.draft_policy
        if name is None or name == "none":
            return attrs.evolve(opts, draft_policy=None, drafts=0)
        policy = self.plugins.draft_policies.get(name)
        if policy is None:
            raise errors.invalid_params(
                f"unknown draft policy {name!r}; available: {', '.join(sorted(self.plugins.draft_policies)) or 'none'}"
            )
        if isinstance(policy, SessionPolicy) and name != entry.draft_policy:
            raise errors.invalid_params(
                f"draft policy {name!r} keeps state per load (a draft model, an MTP head): load the model "
                f"with draftPolicy {name!r} to use it"
            )
        model = entry.engine.model
        assert model is not None, "a loaded engine holds its model"
        loaded_for = model.info.drafts
        drafts = loaded_for if opts.drafts is None else opts.drafts
        if drafts > loaded_for:
            raise errors.invalid_params(
                f"options.drafts ({drafts}) exceeds what the model was loaded for ({loaded_for}); "
                "load it with a larger drafts option"
            )
        return attrs.evolve(opts, draft_policy=policy, drafts=drafts)

    def start(
        self,
        entry: Loaded,
        ids: list[int],
        opts: GenerateOptions,
        on_piece: Callable[[str, list[int]], None] | None = None,
        on_done: Callable[[Outcome], None] | None = None,
        constraint: Any = None,
        owner: int = 0,
        media: tuple[Media, ...] = (),
    ) -> Job:
        """Submit a job of `ids` with generate options `opts` (and the matcher Loaded.constrain
        compiled from them) to the entry's engine; `media`: the prompt's images."""
        if opts.cache_reuse:
            _check_cache_reuse(entry)
        job = Job(
            ids,
            self.drafting(entry, opts),
            on_piece=on_piece,
            on_done=on_done,
            constraint=constraint,
            owner=owner,
            media=media,
        )
        entry.engine.submit(job)
        return job

    def _failed(self, name: str, entry: Loaded | None, exc: Exception) -> None:
        """On the loop: the entry's engine failed a step and closed its model. It leaves the
        loaded models; model/status reports it failed until it is loaded again or unloaded."""
        if entry is None or self.loaded.get(name) is not entry:
            return
        self.loaded.pop(name, None)
        if self._last == name:
            self._last = None
        self.failed[name] = (entry.backend, str(exc) or type(exc).__name__)
        self._closing[name] = entry.engine  # it answers its requests, then closes its model
        log.error("%s failed and was unloaded: %s", name, exc)

    async def _settle(self, name: str) -> None:
        """Wait until the engine of a failed load of `name`, if any, has closed its model."""
        engine = self._closing.pop(name, None)
        if engine is not None:
            await anyio.to_thread.run_sync(functools.partial(engine.stop, timeout=60.0))

    async def unload(self, name: str) -> None:
        """Stop the model of that name (or the one loaded model it is a prefix of)."""
        if name in self.failed and name not in self.loaded:
            del self.failed[name]  # forget the failure, once its model is closed
            await self._settle(name)
            return
        entry = self.loaded.get(name)
        if entry is None:
            matches = [n for n in self.loaded if n.startswith(name)]
            if len(matches) != 1:
                raise errors.KinferError(
                    errors.MODEL_NOT_FOUND, f"model {name!r} is not loaded; loaded: {', '.join(self.loaded) or 'none'}"
                )
            entry = self.loaded[matches[0]]
        self.loaded.pop(entry.name, None)
        if self._last == entry.name:
            self._last = None
        await anyio.to_thread.run_sync(entry.engine.stop)
