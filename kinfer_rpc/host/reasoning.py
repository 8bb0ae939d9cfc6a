"""A model's reasoning kept apart from its answer: which models reason, how a request's `think`
maps onto their chat templates, where the rendered prompt leaves the reply, and the reply's text
split in two as it streams.

A model reasons when its chat template marks a reasoning block with `<think>` and `</think>`
(Qwen3, QwQ, DeepSeek-R1 and its distills, SmolLM3, Phi-4-reasoning...) or reads the
`enable_thinking` switch, and its vocabulary has both markers as tokens of their own. `think`
sets the template's switches (`enable_thinking`; a level also `reasoning_effort`); then, as the
template left it, the prompt is made to open the block (the reply begins inside it: the engine
holds the reply's constraint until the block closes) or to close it empty (no reasoning).
Reasoning in channels (gpt-oss's harmony format) is refused for now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kinfer_rpc import errors

LEVELS = ("low", "medium", "high")
Think = bool | str | None  # a request's `think`: None when not given
OPEN, CLOSE = "<think>", "</think>"
CHANNELS = "<|channel|>"  # gpt-oss's harmony format, whose reasoning is a channel of its own


@attrs.frozen
class Markers:
    """How a model writes its reasoning: `open` ... `close`, each one token of its vocabulary;
    which of the template's switches it reads."""

    open: str = OPEN
    close: str = CLOSE
    switch: bool = False  # the template reads enable_thinking
    effort: bool = False  # the template reads reasoning_effort


def markers(template: str | None, one_token: Callable[[str], bool]) -> Markers | None:
    """The model's reasoning markers, or None when it does not reason apart (`one_token(text)`:
    whether the vocabulary has `text` as one token)."""
    source = template or ""
    switch = "enable_thinking" in source
    if not (switch or OPEN in source or CLOSE in source):
        return None
    if not (one_token(OPEN) and one_token(CLOSE)):
        return None
    return Markers(switch=switch, effort="reasoning_effort" in source)


def check_think(value: object, field: str = "think") -> Think:
    """A request's `think` as given: true, false, "low", "medium" or "high" (None: not given)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in LEVELS:
        return value
    raise errors.invalid_params(f'{field} must be true, false, "low", "medium" or "high"', {"field": field})


def refuse(found: Markers | None, template: str | None, model: str, think: Think, max_reasoning: int | None) -> None:
    """-32602 for `think` (true or a level) or `maxReasoningTokens` on a model that does not
    reason apart; -31006 for one that reasons in channels (gpt-oss). `think: false` asks nothing
    of a model that never reasons, and passes."""
    if found is not None or (think in (None, False) and max_reasoning is None):
        return
    field = "think" if think not in (None, False) else "options.maxReasoningTokens"
    # (the message names the field alone: the HTTP faces put their own name in its place)
    if CHANNELS in (template or ""):
        raise errors.KinferError(
            errors.NOT_SUPPORTED,
            f"{field}: model {model!r} reasons in channels (gpt-oss's harmony format), which kinfer "
            "does not keep apart yet",
            {"field": field, "model": model},
        )
    raise errors.invalid_params(
        f"{field} needs a model that reasons apart, and {model!r} does not: its chat template marks no "
        "reasoning block with markers that are tokens of its vocabulary",
        {"field": field, "model": model},
    )


def switches(found: Markers, think: Think) -> dict[str, Any]:
    """The template variables `think` sets (none when it is not given: the template's default)."""
    if think is None:
        return {}
    out: dict[str, Any] = {"enable_thinking": think is not False}
    if isinstance(think, str) and found.effort:
        out["reasoning_effort"] = think
    return out


def prompt_end(found: Markers, prompt: str, think: Think) -> tuple[str, bool]:
    """The rendered prompt as the reply continues it, and whether the reply begins inside the
    reasoning block. A template that opened the block leaves the reply in it (closed empty
    first for `think: false`); one that closed it leaves no reasoning; one that did neither
    gets the block opened, or closed empty for `think: false`, as Qwen3's template writes it."""
    tail = prompt.rstrip()
    empty = f"{found.open}\n\n{found.close}\n\n"
    if tail.endswith(found.open):
        if think is False:
            return tail[: -len(found.open)] + empty, False
        return prompt, True
    if tail.endswith(found.close):
        return prompt, False
    if think is False:
        return prompt + empty, False
    return prompt + found.open + "\n", True


def split(text: str, reasoning_chars: int | None, answer_chars: int | None) -> tuple[str, str]:
    """A whole reply's (reasoning, answer): the block's text without its markers or the white
    space around them. Offsets None: the block has not closed, all of it is reasoning."""
    if reasoning_chars is None or answer_chars is None:
        return text.strip(), ""
    return text[:reasoning_chars].strip(), text[answer_chars:].lstrip()


class Splitter:
    """A streamed reply's pieces as (reasoning, answer) pieces, which add up to what `split`
    gives the whole reply: white space at the ends of the reasoning and at the start of the
    answer is held back until text follows it, and dropped when none does."""

    def __init__(self) -> None:
        self.seen = 0  # characters of the reply read so far
        self._held = ""  # white space at the end of the reasoning sent so far
        self._reasoning_started = False
        self._answer_started = False

    def feed(self, text: str, reasoning_chars: int | None, answer_chars: int | None) -> tuple[str, str]:
        start, self.seen = self.seen, self.seen + len(text)
        if reasoning_chars is None or answer_chars is None:
            return self._reasoning(text), ""
        thought = text[: max(0, reasoning_chars - start)]
        answer = text[max(0, answer_chars - start) :]
        return self._reasoning(thought), self._answer(answer)

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip()
            if not text:
                return ""
            self._reasoning_started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        return body

    def _answer(self, text: str) -> str:
        if not self._answer_started:
            text = text.lstrip()
            if not text:
                return ""
            self._answer_started = True
        return text
