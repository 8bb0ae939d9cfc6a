"""The config file: defaults for the `kinfer` command, in $KINFER_HOME/config.toml
(~/.kinfer/config.toml). Every key is optional; the command line wins over the file.

    model = "qwen3:0.6b"     # chat's and bench's model when -m names none
    log_level = "error"      # what the server logs on stderr: debug, info, warning, error
    wordwrap = true          # replies wrapped at word boundaries at a terminal
    verbose = false          # timings after each reply
    context_length = 4096    # load options: --context-length, --threads, --gpu-layers
    threads = 4
    gpu_layers = -1

    [options]                # request options, by Ollama's or kinfer's names (as -o takes them)
    temperature = 0.7
    num_predict = 512
    stop = ["<|end|>"]

A file that is not TOML, a key kinfer does not know or a value of the wrong type is an error that
names the file and the key."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, cast

import attrs

from kinfer_rpc.host.files import read_regular
from kinfer_rpc.terminal import options as request_options
from kinfer_rpc.terminal.advice import did_you_mean
from kinfer_rpc.types import kinfer_home

LOG_LEVELS = ("debug", "info", "warning", "error")
_KEYS: dict[str, tuple[type, str]] = {  # each setting's type, and how a person says it
    "model": (str, "a string"),
    "log_level": (str, "a string"),
    "wordwrap": (bool, "true or false"),
    "verbose": (bool, "true or false"),
    "context_length": (int, "an integer"),
    "threads": (int, "an integer"),
    "gpu_layers": (int, "an integer"),
    "options": (dict, "a table ([options])"),
}


class ConfigError(ValueError):
    """The config file cannot be used; the message names the file and the key."""


@attrs.frozen
class Config:
    path: Path
    model: str | None = None
    log_level: str | None = None
    wordwrap: bool | None = None
    verbose: bool | None = None
    context_length: int | None = None
    threads: int | None = None
    gpu_layers: int | None = None
    options: dict[str, Any] = attrs.field(factory=dict)  # kinfer's names, values checked


MAX_BYTES = 1 << 20  # a config file larger than this is not read


def path() -> Path:
    return kinfer_home() / "config.toml"


def read(file: Path | None = None) -> Config:
    """The config file's settings; a Config of nothing where there is no file."""
    file = file or path()
    try:
        text = read_regular(file, MAX_BYTES).decode("utf-8")
    except FileNotFoundError:
        return Config(file)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: not valid TOML: {exc}") from None
    settings: dict[str, Any] = {}
    for key, value in doc.items():
        where = f"{file}: {key}"
        if key not in _KEYS:
            if key in request_options.NAMES:
                raise ConfigError(f"{where}: a request option: put it under [options]")
            hint = did_you_mean(key, _KEYS)
            raise ConfigError(f"{where}: not a setting kinfer knows.{hint} Settings: {', '.join(_KEYS)}")
        wanted, kind = _KEYS[key]
        if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
            raise ConfigError(f"{where}: must be {kind}, not {value!r}")
        if key == "log_level" and value not in LOG_LEVELS:
            raise ConfigError(f"{where}: must be one of {', '.join(LOG_LEVELS)}, not {value!r}")
        if key == "options":
            settings["options"] = _options(file, cast(dict[str, Any], value))
        else:
            settings[key] = value
    return Config(file, **settings)


def _options(file: Path, table: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, value in table.items():
        try:
            key, parsed = request_options.from_value(name, value)
        except request_options.OptionError as exc:
            raise ConfigError(f"{file}: options.{name}: {exc}") from None
        if parsed is not request_options.UNSET:
            found[key] = parsed
    return found
