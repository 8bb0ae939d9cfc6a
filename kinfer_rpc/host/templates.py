"""Chat templates: a model file's Jinja template, rendered in jinja2's sandbox.

A template comes from a model file someone downloaded: it is untrusted code. The immutable
sandbox refuses attribute access to Python internals and mutation of what we pass in.
"""

from __future__ import annotations

import datetime
import functools
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


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.globals["raise_exception"] = _raise
    env.globals["range"] = _range
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def render(
    template: str | None, messages: list[dict[str, Any]], *, bos: str = "", eos: str = "", tools: Any = None
) -> str:
    """Render `messages` with the model's template, ending with the assistant's turn opened."""
    _budget.left = LOOP_BUDGET
    try:
        compiled = _compile(template or CHATML)
        return compiled.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=bos,
            eos_token=eos,
            tools=tools,
        )
    except SecurityError as exc:
        raise errors.KinferError(
            errors.NOT_SUPPORTED, f"the model's chat template tried an unsafe operation: {exc}"
        ) from exc
    except (
        jinja2.TemplateError,
        TypeError,
        ValueError,
        OverflowError,
        MemoryError,
        RecursionError,
        LookupError,
        ArithmeticError,
        AttributeError,
    ) as exc:
        # include/import (no loader), huge numbers, runaway recursion...: the template's fault
        raise errors.invalid_params(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from exc
