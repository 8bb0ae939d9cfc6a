"""Chat templates: a model file's Jinja template, rendered in jinja2's sandbox.

A template comes from a model file someone downloaded: it is untrusted code. The immutable
sandbox refuses attribute access to Python internals and mutation of what we pass in.
"""

from __future__ import annotations

import datetime
import functools

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from . import errors

# Used when a model has no template of its own (ChatML, as llama.cpp falls back to).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise(message):
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def render(template: str | None, messages: list[dict], *, bos: str = "", eos: str = "", tools=None) -> str:
    """Render `messages` with the model's template, ending with the assistant's turn opened."""
    try:
        compiled = _compile(template or CHATML)
        return compiled.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=bos,
            eos_token=eos,
            tools=tools,
        )
    except jinja2.exceptions.SecurityError as exc:
        raise errors.KinferError(
            errors.NOT_SUPPORTED, f"the model's chat template tried an unsafe operation: {exc}"
        ) from exc
    except jinja2.TemplateError as exc:
        raise errors.invalid_params(f"the chat template failed on these messages: {exc}") from exc
