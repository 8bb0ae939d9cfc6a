"""A reply that begins inside the model's reasoning block (`<think>` ... `</think>`), as the engine
runs it.

The host opens the block in the prompt; the engine knows only the tokens that close it. Until
they are generated the reply's constraint (a format, grammar, regex or tool grammar) waits: the
model reasons freely, and the constraint holds the tokens after the block, so a held reply is
valid however long the model thought. A budget bounds the reasoning: once it is spent the closing
tokens are taken in place of sampled ones, and the model answers from there. A reply held to a
constraint cannot end inside the block either: an end of generation there closes it instead.

Everything here reads the job's own tokens, so a reply that reasons is as reproducible as any
other: alone or among others, drafting on or off.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Reasoning:
    """The reasoning part of a request: the reply begins inside the block, which `end` closes;
    `budget`: the most tokens taken inside before `end` is forced (None: no limit)."""

    end: tuple[int, ...]
    budget: int | None = None

    def __attrs_post_init__(self) -> None:
        if not self.end:
            raise ValueError("a reasoning block needs the tokens that end it")


@attrs.define(eq=False)
class Thinking:
    """A job's reasoning as it goes (written by the engine's worker only)."""

    options: Reasoning
    deferred: Any = None  # the job's constraint, held until the block closes
    inside: bool = True
    count: int = 0  # tokens taken inside the block, its end included
    forced: list[int] = attrs.field(factory=list)  # the end's tokens still to be taken in place of sampled ones
    closed_at: int | None = None  # how many of the reply's tokens the block took (its end included)
    # Where the block ends in the reply's text, once the text pass has read its end: the
    # reasoning is text[:reasoning_chars], the answer text[answer_chars:].
    reasoning_chars: int | None = None
    answer_chars: int | None = None
    changed: bool = False  # the last token taken closed the block or started forcing its end

    def __attrs_post_init__(self) -> None:
        if self.options.budget == 0:
            self.forced = list(self.options.end)

    def next_forced(self) -> int | None:
        """The token the next row must take instead of sampling (None: sample as usual)."""
        return self.forced[0] if self.inside and self.forced else None

    def steady(self, token: int) -> bool:
        """Whether taking `token` leaves the block as it is: still inside, nothing forced next
        (so a pass may be fed `token` before it is taken), or already closed."""
        if not self.inside:
            return True
        budget = self.options.budget
        return not self.forced and token not in self.options.end and (budget is None or self.count + 1 < budget)

    def holds_end(self) -> bool:
        """Whether an end of generation must close the block rather than the reply: a reply
        held to a constraint must reach it."""
        return self.inside and self.deferred is not None

    def close_now(self, generated: list[int]) -> int:
        """An end of generation inside the block: the end's next token takes its place, the rest
        of the end is forced. Returns the token taken."""
        self.forced = self._rest(generated)
        return self.forced[0]

    def took(self, generated: list[int]) -> bool:
        """After the reply took its last token: True when that closed the block or started
        forcing its end (a chunk's later outputs, drafted before, are then not taken)."""
        if not self.inside:
            return False
        token = generated[-1]
        if self.forced and token == self.forced[0]:
            del self.forced[0]
        self.count += 1
        end = self.options.end
        if not self.forced and len(generated) >= len(end) and tuple(generated[-len(end) :]) == end:
            self.inside = False
            self.closed_at = len(generated)
            return True
        budget = self.options.budget
        if not self.forced and budget is not None and self.count >= budget:
            self.forced = self._rest(generated)
            return True
        return False

    def _rest(self, generated: list[int]) -> list[int]:
        """The end's tokens that would complete it after `generated` (all of them unless the
        reply already ends with a start of it)."""
        end = self.options.end
        for k in range(min(len(end) - 1, len(generated)), 0, -1):
            if tuple(generated[-k:]) == end[:k]:
                return list(end[k:])
        return list(end)

    def mark_text(self, generated_read: int, text_chars: int, end_chars: int) -> None:
        """The text pass has read `generated_read` tokens, making `text_chars` characters: where
        the block closed, the answer begins there, after the end's `end_chars`."""
        if self.closed_at is not None and self.answer_chars is None and generated_read >= self.closed_at:
            self.answer_chars = text_chars
            self.reasoning_chars = max(0, text_chars - end_chars)
