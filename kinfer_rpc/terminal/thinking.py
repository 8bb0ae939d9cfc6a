"""A thinking model's reasoning at a terminal: dimmed as it streams, then folded into one line
once the answer begins (`/show thinking` shows it again), so the answer reads on its own.

`think` as a person gives it: `--think`, `--think=high`, `--think=false`; `/set think`, `/set think
low`, `/set nothink`, as Ollama's command line names them."""

from __future__ import annotations

import time
from collections.abc import Callable

from kinfer_rpc.terminal.wrap import WordWrap

DIM, UNDIM = "\x1b[2m", "\x1b[22m"
LEVELS = ("low", "medium", "high")
WORDS: dict[str, bool | str] = {"true": True, "false": False, **{level: level for level in LEVELS}}


def think_value(text: str) -> bool | str:
    """--think's value: true, false, low, medium or high (ValueError otherwise)."""
    value = WORDS.get(text.strip().lower())
    if value is None:
        raise ValueError(f"think is true, false, low, medium or high, not {text!r}")
    return value


def shown(think: bool | str | None) -> str:
    """`think` as /show parameters says it."""
    return "the model's default" if think is None else str(think).lower()


class Reasoning:
    """One reply's reasoning on a terminal `width` cells wide and `height` lines high: `write` its
    pieces as they stream, `fold()` once the answer begins (or the reply ends). The reasoning
    goes out dimmed and wrapped at words under a "Thinking..." line; folding moves the cursor back
    over those lines, clears them and writes one dim line in their place. Reasoning taller than
    the terminal has scrolled out of reach: it stays, and the line goes under it."""

    def __init__(self, write: Callable[[str], None], width: int, height: int):
        self._write = write
        self.height = height
        self.started = time.monotonic()
        self.breaks = 0  # line breaks written since the "Thinking..." line began
        self.open = False
        self.folded = False
        self._wrap = WordWrap(self._dim, width)

    def _dim(self, text: str) -> None:
        self.breaks += text.count("\n")
        self._write(DIM + text + UNDIM)

    def write(self, piece: str) -> None:
        if self.folded:
            return
        if not self.open:
            self.open = True
            self._dim("Thinking...\n")
        self._wrap.write(piece)

    def fold(self) -> None:
        if not self.open or self.folded:
            return
        self.folded = True
        self._wrap.end()
        seconds = time.monotonic() - self.started
        if self.breaks < self.height - 1:
            # to the start of the "Thinking..." line, and clear from there down
            self._write("\r" + (f"\x1b[{self.breaks}A" if self.breaks else "") + "\x1b[J")
        else:
            self._write("\n")
        self._write(f"{DIM}Thought for {seconds:.1f} s (/show thinking){UNDIM}\n")

    def interrupted(self) -> None:
        """Ctrl-C inside the reasoning: leave the terminal's attributes as they were."""
        self._write(UNDIM)
