"""The options a request and a load carry, as values that check themselves when they are made, so
the inside never re-checks: every face (the protocol's params, a model's Ollama defaults, an HTTP
API's fields) builds these, and a value out of range is -32602 naming the option as the protocol
spells it (`options.topK`), whoever built it.

A value of None means "not given": a request's options lie over the model's defaults
(`RequestOptions.over`), and what neither gives takes the engine's default (`resolve`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from kinfer_rpc import errors
from kinfer_rpc.engine.job import GenerateOptions
from kinfer_rpc.engine.sampling import SamplingOptions
from kinfer_rpc.types import LoadOptions

DEFAULT_SLOTS = 4
DEFAULT_CONTEXT = 4096
INT_MAX = 2**31 - 1
# Seeds are integers below 2^53, which every JSON parser (JavaScript's included) reads exactly: a
# seed handed back must give the same reply.
SEED_BITS = 53
CONSTRAINTS = ("format", "grammar", "regex")  # request options that hold a reply to a shape
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 64  # stop strings a request may give, each at most MAX_STOP_CHARS long
MAX_STOP_CHARS = 256
MAX_DEVICES = 16  # llama.cpp's llama_max_devices()
# How a model's layers are spread over several GPUs (llama.cpp's split modes): one GPU, a range of
# layers each, every weight matrix cut by rows, every matrix and the KV cache cut (tensor parallelism)
SPLIT_MODES = ("none", "layer", "row", "tensor")

T = TypeVar("T")


def check_text(value: str, where: str) -> None:
    """-32602 for a string that is not valid Unicode (JSON lets a lone surrogate through)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.invalid_params(f"{where} is not valid Unicode (a lone surrogate?)") from None


def bad(where: str, what: str) -> errors.KinferError:
    return errors.invalid_params(f"{where} must be {what}", {"field": where})


# -- checks: each checks one option's value (None: not given) and returns it as kept ----------
def _int(where: str, lo: int | None = None, hi: int | None = INT_MAX) -> Callable[[Any], int | None]:
    def convert(v: Any) -> int | None:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad(where, "an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(where, f"between {lo} and {hi}")
        return v

    return convert


def _float(where: str, lo: float | None = None, hi: float | None = None) -> Callable[[Any], float | None]:
    def convert(v: Any) -> float | None:
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise bad(where, "a number")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(where, f"between {lo} and {hi}")
        return float(v)

    return convert


def _bool(where: str) -> Callable[[Any], bool | None]:
    def convert(v: Any) -> bool | None:
        if v is not None and not isinstance(v, bool):
            raise bad(where, "true or false")
        return v

    return convert


def _str(where: str, choices: tuple[str, ...] | None = None) -> Callable[[Any], str | None]:
    def convert(v: Any) -> str | None:
        if v is None:
            return None
        if not isinstance(v, str):
            raise bad(where, "a string")
        check_text(v, where)
        if choices is not None and v not in choices:
            raise bad(where, "one of " + ", ".join(sorted(choices)))
        return v

    return convert


def _stop(v: Any) -> tuple[str, ...] | None:
    where = "options.stop"
    if v is None:
        return None
    if isinstance(v, str):
        v = (v,)
    if not isinstance(v, (list, tuple)) or not all(isinstance(s, str) for s in v):
        raise errors.invalid_params(f"{where} must be a string or a list of strings")
    for s in v:
        check_text(s, where)
    if len(v) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in v):
        raise errors.invalid_params(
            f"{where}: at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each",
            {"stops": len(v), "longest": max(map(len, v))},
        )
    return tuple(v)


def _repeat_penalty(value: Any) -> float | None:
    v = _float("options.repeatPenalty", 0.0, 100.0)(value)
    if v == 0:  # a repeated token's positive logit is divided by it
        raise errors.invalid_params("options.repeatPenalty must be greater than 0 (1 turns it off)")
    return v


def _constraint(v: Any) -> tuple[str, str] | None:
    if v is None:
        return None
    kind, source = v
    if kind not in (*CONSTRAINTS, "tools") or not isinstance(source, str) or not source:
        raise errors.invalid_params(f"options.{kind} must be a non-empty string", {"field": f"options.{kind}"})
    check_text(source, f"options.{kind}")
    return (kind, source)


def _meta(check: Callable[[Any], Any], wire: str | None = None) -> dict[str, Any]:
    """A field's check (run as the value is made, its result kept) and its name in the protocol."""
    return {"check": check, "wire": wire}


def _check(value: Any) -> None:
    """Run every field's check, keeping what it returns (a float for an int, a tuple for a list)."""
    for a in attrs.fields(type(value)):
        check = a.metadata.get("check")
        if check is not None:
            object.__setattr__(value, a.name, check(getattr(value, a.name)))


@attrs.frozen
class RequestOptions:
    """An inference request's options as given (None: not given). Checked as made."""

    stop_at_line: bool | None = attrs.field(default=None, metadata=_meta(_bool("options.stopAtLine")))
    max_tokens: int | None = attrs.field(default=None, metadata=_meta(_int("options.maxTokens", lo=0)))
    stop: tuple[str, ...] | None = attrs.field(default=None, metadata=_meta(_stop))
    repeat_penalty: float | None = attrs.field(default=None, metadata=_meta(_repeat_penalty))
    temperature: float | None = attrs.field(default=None, metadata=_meta(_float("options.temperature", 0.0, 100.0)))
    top_k: int | None = attrs.field(default=None, metadata=_meta(_int("options.topK", lo=0)))
    top_p: float | None = attrs.field(default=None, metadata=_meta(_float("options.topP", 0.0, 1.0)))
    min_p: float | None = attrs.field(default=None, metadata=_meta(_float("options.minP", 0.0, 1.0)))
    repeat_last_n: int | None = attrs.field(default=None, metadata=_meta(_int("options.repeatLastN", lo=-1)))
    seed: int | None = attrs.field(default=None, metadata=_meta(_int("options.seed", lo=0, hi=2**SEED_BITS - 1)))
    ignore_eos: bool | None = attrs.field(default=None, metadata=_meta(_bool("options.ignoreEos")))
    drafts: int | None = attrs.field(default=None, metadata=_meta(_int("options.drafts", lo=0, hi=64)))
    draft_policy: str | None = attrs.field(default=None, metadata=_meta(_str("options.draftPolicy")))
    # ("format" | "grammar" | "regex" | "tools", source): a JSON schema as JSON text, "json", a
    # Lark grammar or a regex; whether it compiles is found out against the model's vocabulary
    constraint: tuple[str, str] | None = attrs.field(default=None, metadata=_meta(_constraint))
    logprobs: bool | None = attrs.field(default=None, metadata=_meta(_bool("options.logprobs")))
    top_logprobs: int | None = attrs.field(
        default=None, metadata=_meta(_int("options.topLogprobs", lo=0, hi=MAX_TOP_LOGPROBS))
    )
    # infill's: whether the prompt puts the suffix before the prefix (models trained that way)
    spm: bool | None = attrs.field(default=None, metadata=_meta(_bool("options.spm")))
    # a chat's: the most tokens a model's reasoning block may take before its end is forced
    max_reasoning_tokens: int | None = attrs.field(
        default=None, metadata=_meta(_int("options.maxReasoningTokens", lo=0))
    )
    # reuse cached chunks of at least this many tokens that moved, shifting their cells (0: never)
    cache_reuse: int | None = attrs.field(default=None, metadata=_meta(_int("options.cacheReuse", lo=0)))

    def __attrs_post_init__(self) -> None:
        _check(self)
        if self.top_logprobs and not self.logprobs:
            raise errors.invalid_params(
                "options.topLogprobs needs options.logprobs: true", {"field": "options.topLogprobs"}
            )

    def over(self, defaults: RequestOptions) -> RequestOptions:
        """These options over a model's defaults: each given here wins."""
        given = {a.name: v for a in attrs.fields(RequestOptions) if (v := getattr(self, a.name)) is not None}
        return attrs.evolve(defaults, **given) if given else defaults

    def resolve(self, seed_default: int) -> GenerateOptions:
        """What the engine runs: the engine's defaults where nothing was given."""
        return GenerateOptions(
            max_tokens=self.max_tokens,
            stop=self.stop or (),
            ignore_eos=bool(self.ignore_eos),
            sampling=SamplingOptions(
                temperature=_or(self.temperature, 0.8),
                top_k=_or(self.top_k, 40),
                top_p=_or(self.top_p, 0.95),
                min_p=_or(self.min_p, 0.05),
                repeat_penalty=_or(self.repeat_penalty, 1.0),
                repeat_last_n=_or(self.repeat_last_n, 64),
                seed=_or(self.seed, seed_default),
            ),
            drafts=self.drafts,  # None: the load's count (Runtime.drafting)
            draft_policy=self.draft_policy,
            constraint=self.constraint,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            stop_at_line=bool(self.stop_at_line),
            cache_reuse=self.cache_reuse or 0,
        )


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _rpc_servers(value: Any) -> tuple[str, ...] | None:
    """options.rpcServers: "host:port" strings, at most MAX_DEVICES, no repeats."""
    if value is None:
        return None
    where = "options.rpcServers"
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise errors.invalid_params(f'{where} must be a list of "host:port" strings', {"field": where})
    if len(value) > MAX_DEVICES or len(set(value)) != len(value):
        raise errors.invalid_params(f"{where}: at most {MAX_DEVICES} servers, each once", {"field": where})
    for v in value:
        host, _, port = v.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in v):
            raise errors.invalid_params(f'{where}: {v[:100]!r} is not "host:port"', {"field": where})
    return tuple(value)


def _tensor_split(value: Any) -> tuple[float, ...] | None:
    """options.tensorSplit: each device's share of the offloaded layers (numbers >= 0, not all 0)."""
    if value is None:
        return None
    where = "options.tensorSplit"
    if (
        not isinstance(value, (list, tuple))
        or not 0 < len(value) <= MAX_DEVICES
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9 for v in value)
        or not sum(value) > 0
    ):
        raise errors.invalid_params(
            f"{where} must be a list of at most {MAX_DEVICES} numbers >= 0, not all 0", {"field": where}
        )
    return tuple(float(v) for v in value)


@attrs.frozen
class LoadExtras:
    """What a load asks beyond the backend's LoadOptions: the engine's queue and prefix pool, the
    draft policy, the placement, whether to verify the file, and which options the user set."""

    max_queue: int = 4096
    verify: bool | None = None
    draft_policy: str | None = None
    draft_model: str | None = None
    drafts: int | None = None
    # Tokens of finished conversations the prefix pool keeps; -1: no pool, per-slot streams
    # kept contiguous by compaction. None: whatever the free slots hold.
    prefix: int | None = None
    placement: str | None = None
    # The options a user set (as the protocol spells them): they win over what the placement decides.
    given: frozenset[str] = frozenset()


@attrs.frozen
class LoadRequest:
    """A load's options as given (None: not given). Checked as made; `resolve` fills the rest."""

    slots: int | None = attrs.field(default=None, metadata=_meta(_int("options.slots", lo=1, hi=1024), "slots"))
    batch: int | None = attrs.field(default=None, metadata=_meta(_int("options.batch", lo=1, hi=1 << 20), "batch"))
    context_length: int | None = attrs.field(
        default=None, metadata=_meta(_int("options.contextLength", lo=16, hi=1 << 24), "contextLength")
    )
    ubatch: int | None = attrs.field(default=None, metadata=_meta(_int("options.ubatch", lo=1, hi=1 << 20), "ubatch"))
    threads: int | None = attrs.field(default=None, metadata=_meta(_int("options.threads", lo=1, hi=1024), "threads"))
    gpu_layers: int | None = attrs.field(
        default=None, metadata=_meta(_int("options.gpuLayers", lo=-1, hi=100000), "gpuLayers")
    )
    flash_attention: bool | None = attrs.field(
        default=None, metadata=_meta(_bool("options.flashAttention"), "flashAttention")
    )
    kv_type: str | None = attrs.field(default=None, metadata=_meta(_str("options.kvType", ("f16", "q8_0")), "kvType"))
    weights: str | None = attrs.field(
        default=None, metadata=_meta(_str("options.weights", ("quantized", "dense")), "weights")
    )
    reproducible: bool | None = attrs.field(default=None, metadata=_meta(_bool("options.reproducible"), "reproducible"))
    rpc_servers: tuple[str, ...] | None = attrs.field(default=None, metadata=_meta(_rpc_servers, "rpcServers"))
    tensor_split: tuple[float, ...] | None = attrs.field(default=None, metadata=_meta(_tensor_split, "tensorSplit"))
    split_mode: str | None = attrs.field(
        default=None, metadata=_meta(_str("options.splitMode", SPLIT_MODES), "splitMode")
    )
    main_gpu: int | None = attrs.field(
        default=None, metadata=_meta(_int("options.mainGpu", lo=0, hi=MAX_DEVICES - 1), "mainGpu")
    )
    max_queue: int | None = attrs.field(
        default=None, metadata=_meta(_int("options.maxQueue", lo=1, hi=1 << 20), "maxQueue")
    )
    verify: bool | None = attrs.field(default=None, metadata=_meta(_bool("options.verify"), "verify"))
    draft_policy: str | None = attrs.field(default=None, metadata=_meta(_str("options.draftPolicy"), "draftPolicy"))
    draft_model: str | None = attrs.field(default=None, metadata=_meta(_str("options.draftModel"), "draftModel"))
    drafts: int | None = attrs.field(default=None, metadata=_meta(_int("options.drafts", lo=0, hi=64), "drafts"))
    prefix: int | None = attrs.field(default=None, metadata=_meta(_int("options.prefix", lo=-1, hi=1 << 30), "prefix"))
    placement: str | None = attrs.field(default=None, metadata=_meta(_str("options.placement"), "placement"))
    projector: str | None = attrs.field(default=None, metadata=_meta(_str("options.projector"), "projector"))

    def __attrs_post_init__(self) -> None:
        _check(self)
        slots = _or(self.slots, DEFAULT_SLOTS)
        batch = _or(self.batch, 2048)
        if slots > batch:
            raise errors.invalid_params(f"options.slots ({slots}) must not exceed options.batch ({batch})")
        if self.split_mode == "tensor" and self.flash_attention is False:
            raise errors.invalid_params(
                "options.splitMode tensor needs flash attention (options.flashAttention true)",
                {"field": "options.splitMode"},
            )

    @property
    def given(self) -> frozenset[str]:
        """The options set, as the protocol spells them."""
        return frozenset(a.metadata["wire"] for a in attrs.fields(LoadRequest) if getattr(self, a.name) is not None)

    def resolve(self, context_default: int | None = None) -> tuple[LoadOptions, LoadExtras]:
        """The backend's options (defaults where nothing was given; the context a model's own
        default, e.g. Ollama's num_ctx, else 4096) and the rest of the load's."""
        batch = _or(self.batch, 2048)
        opts = LoadOptions(
            context_length=_or(self.context_length, context_default or DEFAULT_CONTEXT),
            slots=_or(self.slots, DEFAULT_SLOTS),
            batch=batch,
            ubatch=_or(self.ubatch, min(512, batch)),
            threads=self.threads,
            gpu_layers=_or(self.gpu_layers, -1),
            flash_attention=_or(self.flash_attention, True),
            kv_type=self.kv_type,
            weights=self.weights,
            reproducible=self.reproducible,
            rpc_servers=self.rpc_servers or (),
            tensor_split=self.tensor_split or (),
            split_mode=self.split_mode,
            main_gpu=self.main_gpu,
            projector=self.projector,
        )
        extras = LoadExtras(
            max_queue=_or(self.max_queue, 4096),
            verify=self.verify,
            draft_policy=self.draft_policy,
            draft_model=self.draft_model,
            drafts=self.drafts,
            prefix=self.prefix,
            placement=self.placement,
            given=self.given,
        )
        return opts, extras
