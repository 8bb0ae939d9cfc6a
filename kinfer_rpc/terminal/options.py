"""Request options as a person names them: Ollama's names (`num_predict`, `top_k`), their
snake_case spelling or kinfer's camelCase (`maxTokens`, `topK`), each checked for its type.
`-o NAME VALUE`, `/set parameter NAME VALUE` and the config file's [options] take them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kinfer_rpc.terminal.advice import did_you_mean

# kinfer's name -> its type, in the order a person is shown them
TYPES: dict[str, str] = {
    "maxTokens": "int",
    "temperature": "float",
    "seed": "int",
    "topK": "int",
    "topP": "float",
    "minP": "float",
    "repeatPenalty": "float",
    "repeatLastN": "int",
    "stop": "list",
    "drafts": "int",
    "draftPolicy": "str",
    "ignoreEos": "bool",
    "grammar": "str",
    "regex": "str",
    "logprobs": "bool",
    "topLogprobs": "int",
    "maxReasoningTokens": "int",
}


def snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name)


# The spelling a person is shown: Ollama's where it has one, else snake_case.
SHOWN: dict[str, str] = {key: "num_predict" if key == "maxTokens" else snake(key) for key in TYPES}

NAMES: dict[str, str] = {
    **{name: name for name in TYPES},
    **{snake(name): name for name in TYPES},
    "num_predict": "maxTokens",
}

# Ollama's parameters that are the load's, not a request's
LOAD_ONLY = {"num_ctx": "--context-length N", "num_gpu": "--gpu-layers N", "num_thread": "--threads N"}

UNSET = object()  # a value that takes the option away (Ollama's seed -1)


class OptionError(ValueError):
    """A name that names no option, or a value of the wrong type; the message says which."""


def shown_names() -> str:
    return ", ".join(SHOWN.values())


def key_of(name: str) -> str:
    """kinfer's name for an option named any way; OptionError (with the closest names) if none."""
    if name in LOAD_ONLY:
        raise OptionError(f"{name} is the load's, not a request's: {LOAD_ONLY[name]} when starting")
    key = NAMES.get(name)
    if key is None:
        hint = did_you_mean(name, [*SHOWN.values(), *TYPES], lambda n: SHOWN[NAMES[n]])
        raise OptionError(f"unknown parameter {name!r}.{hint} Parameters: {shown_names()}")
    return key


def parse(name: str, values: Sequence[str]) -> tuple[str, Any]:
    """An option from its name and its words as typed, checked for its type."""
    key = key_of(name)
    kind = TYPES[key]
    if not values:
        raise OptionError(f"{name} needs a value")
    if kind == "list":  # stop: each word one stop string, as Ollama's /set parameter stop a b
        return key, list(values)
    if len(values) > 1 and kind != "str":
        raise OptionError(f"{name} takes one value, not {len(values)}")
    value = " ".join(values)
    if kind == "int":
        try:
            return _number(key, int(value))
        except ValueError:
            raise OptionError(f"{name} must be an integer, not {value!r}") from None
    if kind == "float":
        try:
            return key, float(value)
        except ValueError:
            raise OptionError(f"{name} must be a number, not {value!r}") from None
    if kind == "bool":
        if value.lower() in ("true", "1", "yes", "on"):
            return key, True
        if value.lower() in ("false", "0", "no", "off"):
            return key, False
        raise OptionError(f"{name} must be true or false, not {value!r}")
    return key, value


def from_value(name: str, value: Any) -> tuple[str, Any]:
    """An option from its name and a value already typed (the config file's TOML)."""
    key = key_of(name)
    kind = TYPES[key]
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "list": isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
    }[kind]
    if not ok:
        wanted = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
        raise OptionError(f"must be {wanted.get(kind, 'a string or a list of strings')}, not {value!r}")
    if kind == "int":
        return _number(key, value)
    if kind == "float":
        return key, float(value)
    if kind == "list" and isinstance(value, str):
        return key, [value]
    return key, value


def _number(key: str, number: int) -> tuple[str, Any]:
    if number == -1 and key == "maxTokens":  # Ollama's num_predict -1: no limit
        return key, 2**31 - 1
    if number == -1 and key == "seed":  # Ollama's seed -1: none (the model's own, or random)
        return key, UNSET
    return key, number
