"""Option objects (a load's, a request's) turned into checked values, so the inside never re-checks.

Every error names the field and what was wrong; unknown fields are errors (a misspelt option
silently ignored is the bug users hate most). The protocol layer reads its params with the same
Fields; the store checks a model's own default options (Ollama's params) with generate_options.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Collection
from typing import Any, overload

from kinfer_rpc import errors
from kinfer_rpc.engine.job import GenerateOptions
from kinfer_rpc.engine.sampling import SamplingOptions
from kinfer_rpc.types import LoadOptions

DEFAULT_SLOTS = 4
DEFAULT_CONTEXT = 4096
INT_MAX = 2**31 - 1


class Fields:
    """Reads fields out of one params object, recording which were used."""

    # The methods int, float, bool and str shadow the builtins in this class's scope: its
    # annotations name the builtins through `builtins`.

    def __init__(self, obj: object, where: builtins.str):
        if obj is None:
            obj = {}
        if not isinstance(obj, dict):
            raise errors.invalid_params(f"{where} must be an object")
        self.obj: dict[builtins.str, Any] = obj
        self.where = where
        self.used: set[builtins.str] = set()

    def _get(self, name: builtins.str) -> Any:
        self.used.add(name)
        return self.obj.get(name)

    def _bad(self, name: builtins.str, what: builtins.str) -> errors.KinferError:
        return errors.invalid_params(f"{self.where}.{name} must be {what}", {"field": f"{self.where}.{name}"})

    @overload
    def int(
        self,
        name: builtins.str,
        default: None = None,
        lo: builtins.int | None = None,
        hi: builtins.int | None = INT_MAX,
    ) -> builtins.int | None: ...

    @overload
    def int(
        self,
        name: builtins.str,
        default: builtins.int,
        lo: builtins.int | None = None,
        hi: builtins.int | None = INT_MAX,
    ) -> builtins.int: ...

    def int(
        self,
        name: builtins.str,
        default: builtins.int | None = None,
        lo: builtins.int | None = None,
        hi: builtins.int | None = INT_MAX,
    ) -> builtins.int | None:
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(name, "an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self._bad(name, f"between {lo} and {hi}")
        return v

    @overload
    def float(
        self,
        name: builtins.str,
        default: None = None,
        lo: builtins.float | None = None,
        hi: builtins.float | None = None,
    ) -> builtins.float | None: ...

    @overload
    def float(
        self,
        name: builtins.str,
        default: builtins.float,
        lo: builtins.float | None = None,
        hi: builtins.float | None = None,
    ) -> builtins.float: ...

    def float(
        self,
        name: builtins.str,
        default: builtins.float | None = None,
        lo: builtins.float | None = None,
        hi: builtins.float | None = None,
    ) -> builtins.float | None:
        v = self._get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            raise self._bad(name, "a number")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self._bad(name, f"between {lo} and {hi}")
        return float(v)

    @overload
    def bool(self, name: builtins.str, default: None = None) -> builtins.bool | None: ...

    @overload
    def bool(self, name: builtins.str, default: builtins.bool) -> builtins.bool: ...

    def bool(self, name: builtins.str, default: builtins.bool | None = None) -> builtins.bool | None:
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self._bad(name, "true or false")
        return v

    @overload
    def str(
        self, name: builtins.str, default: None = None, choices: Collection[builtins.str] | None = None
    ) -> builtins.str | None: ...

    @overload
    def str(
        self, name: builtins.str, default: builtins.str, choices: Collection[builtins.str] | None = None
    ) -> builtins.str: ...

    def str(
        self, name: builtins.str, default: builtins.str | None = None, choices: Collection[builtins.str] | None = None
    ) -> builtins.str | None:
        v = self._get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self._bad(name, "a string")
        check_text(v, f"{self.where}.{name}")
        if choices is not None and v not in choices:
            raise self._bad(name, "one of " + ", ".join(sorted(choices)))
        return v

    def raw(self, name: builtins.str) -> Any:
        return self._get(name)

    def done(self) -> None:
        extra = sorted(set(self.obj) - self.used)
        if extra:
            raise errors.invalid_params(
                f"unknown field{'s' if len(extra) > 1 else ''} in {self.where}: {', '.join(extra)}",
                {"unknown": extra},
            )


def check_text(value: str, where: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.invalid_params(f"{where} is not valid Unicode (a lone surrogate?)") from None


# Seeds are integers below 2^53, which every JSON parser (JavaScript's included) reads exactly: a
# seed handed back must give the same reply.
SEED_BITS = 53
CONSTRAINTS = ("format", "grammar", "regex")  # request options that hold a reply to a shape
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 64  # stop strings a request may give, each at most MAX_STOP_CHARS long
MAX_STOP_CHARS = 256


def generate_options(obj: object, seed_default: int, *, infill: bool = False) -> GenerateOptions:
    """A request's options; `infill`: inference/infill's, which also take stopAtLine."""
    f = Fields(obj, "options")
    stop_at_line = f.bool("stopAtLine", False) if infill else False
    max_tokens = f.int("maxTokens", None, lo=0)
    stop = f.raw("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        check_text(stop, "options.stop")
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
        for s in stop:
            check_text(s, "options.stop")
    else:
        raise errors.invalid_params("options.stop must be a string or a list of strings")
    if len(stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise errors.invalid_params(
            f"options.stop: at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each",
            {"stops": len(stop), "longest": max(map(len, stop))},
        )
    repeat_penalty = f.float("repeatPenalty", 1.0, lo=0.0, hi=100.0)
    if repeat_penalty == 0:  # a repeated token's positive logit is divided by it
        raise errors.invalid_params("options.repeatPenalty must be greater than 0 (1 turns it off)")
    sampling = SamplingOptions(
        temperature=f.float("temperature", 0.8, lo=0.0, hi=100.0),
        top_k=f.int("topK", 40, lo=0),
        top_p=f.float("topP", 0.95, lo=0.0, hi=1.0),
        min_p=f.float("minP", 0.05, lo=0.0, hi=1.0),
        repeat_penalty=repeat_penalty,
        repeat_last_n=f.int("repeatLastN", 64, lo=-1),
        seed=f.int("seed", seed_default, lo=0, hi=2**SEED_BITS - 1),
    )
    ignore_eos = f.bool("ignoreEos", False)
    drafts = f.int("drafts", None, lo=0, hi=64)
    policy = f.str("draftPolicy", None)
    constraint = _constraint(f)
    logprobs = f.bool("logprobs", False)
    top = f.int("topLogprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise errors.invalid_params(
            "options.topLogprobs needs options.logprobs: true", {"field": "options.topLogprobs"}
        )
    f.done()
    return GenerateOptions(
        max_tokens=max_tokens,
        stop=stop,
        ignore_eos=ignore_eos,
        sampling=sampling,
        # None: the load's count (Runtime.drafting). GenerateOptions.drafts is declared int in
        # engine/scheduler.py; once it says int | None, mypy reports this ignore as unused.
        drafts=drafts,
        draft_policy=policy,
        constraint=constraint,
        logprobs=top if logprobs else None,
        stop_at_line=stop_at_line,
    )


MAX_DEVICES = 16  # llama.cpp's llama_max_devices()
# How a model's layers are spread over several GPUs (llama.cpp's split modes): one GPU, a range of
# layers each, every weight matrix cut by rows, every matrix and the KV cache cut (tensor parallelism)
SPLIT_MODES = ("none", "layer", "row", "tensor")


def _rpc_servers(value: object) -> tuple[str, ...]:
    """options.rpcServers: "host:port" strings, at most MAX_DEVICES, no repeats."""
    if value is None:
        return ()
    where = "options.rpcServers"
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise errors.invalid_params(f'{where} must be a list of "host:port" strings', {"field": where})
    if len(value) > MAX_DEVICES or len(set(value)) != len(value):
        raise errors.invalid_params(f"{where}: at most {MAX_DEVICES} servers, each once", {"field": where})
    for v in value:
        host, _, port = v.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in v):
            raise errors.invalid_params(f'{where}: {v[:100]!r} is not "host:port"', {"field": where})
    return tuple(value)


def _tensor_split(value: object) -> tuple[float, ...]:
    """options.tensorSplit: each device's share of the offloaded layers (numbers >= 0, not all 0)."""
    if value is None:
        return ()
    where = "options.tensorSplit"
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_DEVICES
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1e9 for v in value)
        or not sum(value) > 0
    ):
        raise errors.invalid_params(
            f"{where} must be a list of at most {MAX_DEVICES} numbers >= 0, not all 0", {"field": where}
        )
    return tuple(float(v) for v in value)


def infill_options(obj: object, seed_default: int) -> tuple[GenerateOptions, bool]:
    """inference/infill's options: inference/generate's, `stopAtLine`, and `spm` (whether the
    prompt puts the suffix before the prefix, for models trained that way)."""
    spm = None
    if isinstance(obj, dict) and "spm" in obj:
        obj = dict(obj)
        spm = obj.pop("spm")
        if spm is not None and not isinstance(spm, bool):
            raise errors.invalid_params("options.spm must be true or false", {"field": "options.spm"})
    return generate_options(obj, seed_default, infill=True), bool(spm)


def _constraint(f: Fields) -> tuple[str, str] | None:
    """The reply's constraint as (option, source): a JSON schema (as JSON text), "json", a
    grammar or a regex. Whether it compiles is found out against the model's vocabulary."""
    given = [(k, f.raw(k)) for k in CONSTRAINTS]
    given = [(k, v) for k, v in given if v is not None]
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(f"options.{k}" for k, _ in given)
        raise errors.invalid_params(f"give at most one of options.format, grammar and regex (got {names})")
    kind, value = given[0]
    if kind == "format":
        if value == "json":
            return kind, value
        if not isinstance(value, dict):
            raise errors.invalid_params(
                'options.format must be a JSON schema (an object) or "json"', {"field": "options.format"}
            )
        return kind, json.dumps(value)
    if not isinstance(value, str) or not value:
        raise errors.invalid_params(f"options.{kind} must be a non-empty string", {"field": f"options.{kind}"})
    check_text(value, f"options.{kind}")
    return kind, value


def with_defaults(defaults: dict[str, Any], options: Any) -> Any:
    """A model's default options under the request's (a null option counts as absent)."""
    if not defaults or not isinstance(options, (dict, type(None))):
        return options
    return {**defaults, **{k: v for k, v in (options or {}).items() if v is not None}}


def load_options(obj: object, context_default: int | None = None) -> tuple[LoadOptions, dict[str, Any]]:
    f = Fields(obj, "options")
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
        reproducible=f.bool("reproducible", None),
        rpc_servers=_rpc_servers(f.raw("rpcServers")),
        tensor_split=_tensor_split(f.raw("tensorSplit")),
        split_mode=f.str("splitMode", None, choices=SPLIT_MODES),
        main_gpu=f.int("mainGpu", None, lo=0, hi=MAX_DEVICES - 1),
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
        "given": frozenset(k for k, v in (obj or {}).items() if v is not None)
        if isinstance(obj, dict)
        else frozenset(),
    }
    f.done()
    if opts.slots > opts.batch:
        raise errors.invalid_params(f"options.slots ({opts.slots}) must not exceed options.batch ({opts.batch})")
    if opts.split_mode == "tensor" and not opts.flash_attention:
        raise errors.invalid_params(
            "options.splitMode tensor needs flash attention (options.flashAttention true)",
            {"field": "options.splitMode"},
        )
    return opts, extra
