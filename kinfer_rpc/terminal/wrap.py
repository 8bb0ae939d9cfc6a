"""Streamed text that wraps at word boundaries, as `ollama run` does: a word is held until the
space or newline after it, then written on this line if it fits the width and on the next one if
not, so that the terminal never cuts a word at its edge."""

from __future__ import annotations

from collections.abc import Callable

from rich.cells import cell_len


class WordWrap:
    """A writer for one reply: `write(piece)` as pieces stream in, `end()` once it is over.

    Widths are terminal cells (a CJK character takes two). A word longer than the line is written
    as it comes, the terminal cutting it where it must; spaces at a line's end are dropped."""

    def __init__(self, write: Callable[[str], None], width: int):
        self._out = write
        self.width = max(width, 10)
        self.column = 0  # cells written on the current line
        self._word = ""  # held until the blank after it
        self._blanks = ""  # written before the next word, if it fits on this line

    def write(self, text: str) -> None:
        for ch in text:
            if ch == "\n":
                self._place()
                self._blanks = ""
                self._out("\n")
                self.column = 0
            elif ch in " \t":
                self._place()
                self._blanks += ch
            else:
                self._word += ch
                if cell_len(self._word) >= self.width:  # a word as long as a line: no use holding it
                    self._place()

    def end(self) -> None:
        """The reply is over: write the held word (trailing blanks are dropped)."""
        self._place()
        self._blanks = ""

    def _place(self) -> None:
        if not self._word:
            return
        word, blanks = self._word, self._blanks
        self._word = self._blanks = ""
        after_blanks = _advance(self.column, blanks)
        if self.column == 0 or after_blanks + cell_len(word) <= self.width:
            # it fits (or the line is empty: blanks at a line's start are the text's indentation)
            text = blanks + word
            self.column = after_blanks + cell_len(word)
        else:
            text = "\n" + word  # the blanks before it are dropped at the break
            self.column = cell_len(word)
        if self.column >= self.width:  # the terminal's own wrap took it to a new line
            self.column %= self.width
        self._out(text)


def _advance(column: int, blanks: str) -> int:
    """The column after writing `blanks` (spaces and tabs, a tab to the next multiple of 8)."""
    for ch in blanks:
        column = column + 8 - column % 8 if ch == "\t" else column + 1
    return column
