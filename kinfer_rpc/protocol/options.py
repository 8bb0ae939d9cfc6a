"""A request's and a load's `options` objects as the host's option values
(kinfer_rpc.host.options), which check each value as they are made; here, the JSON's shape: the
names as the protocol spells them, and no field that nobody reads."""

from __future__ import annotations

import json
from typing import Any

import attrs

from kinfer_rpc import errors
from kinfer_rpc.host.options import CONSTRAINTS, LoadRequest, RequestOptions, check_text
from kinfer_rpc.protocol.fields import Fields

# the protocol's name -> RequestOptions' field
REQUEST_FIELDS = {
    "stopAtLine": "stop_at_line",
    "maxTokens": "max_tokens",
    "stop": "stop",
    "repeatPenalty": "repeat_penalty",
    "temperature": "temperature",
    "topK": "top_k",
    "topP": "top_p",
    "minP": "min_p",
    "repeatLastN": "repeat_last_n",
    "seed": "seed",
    "ignoreEos": "ignore_eos",
    "drafts": "drafts",
    "draftPolicy": "draft_policy",
    "logprobs": "logprobs",
    "topLogprobs": "top_logprobs",
    "spm": "spm",
    "maxReasoningTokens": "max_reasoning_tokens",
    "cacheReuse": "cache_reuse",
}
ONLY_INFILL = ("stopAtLine", "spm")  # inference/infill's own options


def request_options(obj: object, *, infill: bool = False) -> RequestOptions:
    """An inference request's options; `infill`: inference/infill's, which also take stopAtLine and spm."""
    f = Fields(obj, "options")
    given: dict[str, Any] = {}
    for wire, field in REQUEST_FIELDS.items():
        if wire in ONLY_INFILL and not infill:
            continue
        value = f.raw(wire)
        if value is not None:
            given[field] = value
    constraint = _constraint(f)
    if constraint is not None:
        given["constraint"] = constraint
    out = RequestOptions(**given)
    f.done()
    return out


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


LOAD_FIELDS = {a.metadata["wire"]: a.name for a in attrs.fields(LoadRequest)}  # the protocol's name -> field


def load_request(obj: object) -> LoadRequest:
    """A load's options (model/load's `options`, the LSP settings' `loadOptions`)."""
    f = Fields(obj, "options")
    given = {field: v for wire, field in LOAD_FIELDS.items() if (v := f.raw(wire)) is not None}
    out = LoadRequest(**given)
    f.done()
    return out


def request_options_json(options: RequestOptions) -> dict[str, Any]:
    """The options given, as the protocol spells them (a model's defaults in `kinfer show`)."""
    out: dict[str, Any] = {}
    for wire, field in REQUEST_FIELDS.items():
        value = getattr(options, field)
        if value is not None:
            out[wire] = list(value) if isinstance(value, tuple) else value
    if options.constraint is not None:
        kind, source = options.constraint
        out[kind] = json.loads(source) if kind == "format" and source != "json" else source
    return out
