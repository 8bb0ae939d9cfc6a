"""Chat templates: a model file's Jinja template, rendered in jinja2's sandbox.

A template comes from a model file someone downloaded: it is untrusted code. The immutable
sandbox refuses attribute access to Python internals and mutation of what we pass in; a value
that is not data (a function, a class, any object whose text would be its address) cannot be
written into the prompt. The server renders in worker processes it can kill
(kinfer_rpc.host.render), which bound a render's time and memory; `max_chars` bounds its output.
"""

from __future__ import annotations

import datetime
import functools
import json
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

from kinfer_rpc import errors

# Used when a model has no template of its own (ChatML, as llama.cpp falls back to).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


LOOP_BUDGET = 1_000_000  # range() items one render may walk through, all loops together
_budget = threading.local()


def _range(*args: int) -> Iterator[int]:
    """The sandbox's range, but every item counts against the render's budget: nested loops
    inside the sandbox's size limit could otherwise run for hours."""
    items = range(*args)
    if len(items) > MAX_RANGE:
        raise SecurityError(f"range of {len(items)} items is too big")

    def walk() -> Iterator[int]:
        for i in items:
            _budget.left -= 1
            if _budget.left < 0:
                raise SecurityError("the template loops too long")
            yield i

    return walk()


_DATA = (str, int, float, bool, type(None), jinja2.Undefined)


def _only_data(value: Any) -> Any:
    """What `{{ ... }}` may write: data, never an object's repr (which would put a memory address,
    different in every process, into the prompt)."""
    stack, seen = [value], 0
    while stack:
        v = stack.pop()
        seen += 1
        if isinstance(v, _DATA) or seen > 100_000:
            continue
        if isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        else:
            raise jinja2.TemplateError(f"the template writes a {type(v).__name__} object into the prompt")
    return value


MAX_VALUE = 1 << 24  # the longest string or list `*` may make, the most bits `**` may
_SEQUENCES = (str, list, tuple)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*` and `**` sized before they run: they work in C, where no
    time limit reaches, and intercepting them also keeps them out of compile-time folding."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            seq, n = (left, right) if isinstance(left, _SEQUENCES) else (right, left)
            if isinstance(seq, _SEQUENCES) and isinstance(n, int) and len(seq) * n > MAX_VALUE:
                raise errors.invalid_params(
                    f"the chat template's `*` would make a value of {len(seq) * n} items, over the limit of {MAX_VALUE}"
                )
        elif isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(1, abs(left).bit_length()) * right > MAX_VALUE:
                raise errors.invalid_params(
                    f"the chat template's `**` would make a number of about {abs(left).bit_length() * right} bits,"
                    f" over the limit of {MAX_VALUE}"
                )
        return super().call_binop(context, operator, left, right)


MAX_INDENT = 64  # the widest indent tojson writes


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's tojson (transformers' chat templates, as llama.cpp's minja follows): plain
    json.dumps, keys in their order, non-ASCII as is. Jinja's own sorts the keys and escapes
    `<`, `>`, `&` and `'` for HTML, which no model was trained on."""
    width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    if width > MAX_INDENT:
        raise jinja2.TemplateError(f"tojson's indent is over the limit of {MAX_INDENT}")
    if separators is not None:
        separators = tuple(separators)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Arguments(dict[str, Any]):
    """A tool call's arguments (kinfer_rpc.protocol.params.messages passes a dict): the template
    reads it as a dict, and `{{ arguments }}` writes it as JSON, as minja does, not as Python's
    repr: templates written for OpenAI's string arguments print it so."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)


def _with_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            shaped = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), dict):
                    c = {**c, "function": {**fn, "arguments": _Arguments(fn["arguments"])}}
                shaped.append(c)
            m = {**m, "tool_calls": shaped}
        out.append(m)
    return out


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False, finalize=_only_data)
    env.globals["raise_exception"] = _raise
    env.globals["range"] = _range
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def render(
    template: str | None,
    messages: list[dict[str, Any]],
    *,
    bos: str = "",
    eos: str = "",
    tools: Any = None,
    max_chars: int | None = None,
    variables: dict[str, Any] | None = None,
) -> str:
    """Render `messages` with the model's template, ending with the assistant's turn opened; a
    prompt over `max_chars` characters is refused (-32602). `variables`: the template's switches
    a request sets (`enable_thinking`, `reasoning_effort`), beside the usual ones."""
    _budget.left = LOOP_BUDGET
    try:
        compiled = _compile(template or CHATML)
        pieces = compiled.generate(
            **(variables or {}),
            messages=_with_arguments(messages),
            add_generation_prompt=True,
            bos_token=bos,
            eos_token=eos,
            tools=tools,
        )
        if max_chars is None:
            return "".join(pieces)
        out, size = [], 0
        for piece in pieces:
            size += len(piece)
            if size > max_chars:
                raise errors.invalid_params(f"the chat template's prompt is over the limit of {max_chars} characters")
            out.append(piece)
        return "".join(out)
    except MemoryError as exc:
        raise errors.invalid_params("the chat template used too much memory") from exc
    except SecurityError as exc:
        raise errors.KinferError(
            errors.NOT_SUPPORTED, f"the model's chat template tried an unsafe operation: {exc}"
        ) from exc
    except (
        jinja2.TemplateError,
        TypeError,
        ValueError,
        OverflowError,
        RecursionError,
        LookupError,
        ArithmeticError,
        AttributeError,
    ) as exc:
        # include/import (no loader), huge numbers, runaway recursion...: the template's fault
        raise errors.invalid_params(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from exc
