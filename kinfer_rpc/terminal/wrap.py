"""Streamed text that wraps at word boundaries, as `ollama run` does: a word is held until the
space or newline after it, then written on this line if it fits and on the next one if not, so
that the terminal never cuts a word at its edge."""

from __future__ import annotations

from collections.abc import Callable

from rich.cells import cell_len


class WordWrap:
    """A writer for one reply on a terminal `width` cells wide: `write(piece)` as pieces stream
    in, `end()` once it is over.

    Lines are filled to `width - 1` cells: a line that filled the last column would leave the
    terminal waiting to wrap, and the next word's newline would then leave an empty line on some
    terminals. Widths are terminal cells (a CJK character takes two). A word longer than a line
    is written as it comes, the terminal cutting it where it must; the blanks where a line breaks
    are dropped, a line's own indentation is kept."""

    def __init__(self, write: Callable[[str], None], width: int):
        self._out = write
        self.width = max(width, 10)  # the terminal's
        self.limit = self.width - 1  # the most a wrapped line holds
        self.column = 0  # cells written on the current line
        self._word = ""  # held until the blank after it
        self._blanks = ""  # written before the next word, if it fits on this line
        self._broken = False  # the current line began where the terminal cut a long word
        self._long = False  # inside a word longer than a line: written as it comes

    def write(self, text: str) -> None:
        for ch in text:
            if ch == "\n":
                self._place()
                self._blanks, self._long = "", False
                self._out("\n")
                self.column, self._broken = 0, False
            elif ch in " \t":
                self._place()
                self._blanks += ch
                self._long = False
            elif self._long:
                self._out(ch)
                self._advance(cell_len(ch))
            else:
                self._word += ch
                if cell_len(self._word) >= self.limit:  # a word as long as a line: no use holding it
                    self._place()
                    self._long = True

    def _advance(self, cells: int) -> None:
        self.column += cells
        if self.column >= self.width:  # the terminal wrapped it
            self.column %= self.width
            self._broken = True

    def end(self) -> None:
        """The reply is over: write the held word (trailing blanks are dropped)."""
        self._place()
        self._blanks = ""

    def _place(self) -> None:
        if not self._word:
            return
        word, blanks = self._word, self._blanks
        self._word = self._blanks = ""
        if self.column == 0 and self._broken:
            blanks = ""  # the terminal's own break: no blanks at the new line's start
        after_blanks = _advance(self.column, blanks)
        if self.column == 0 or after_blanks + cell_len(word) <= self.limit:
            # it fits (or the line is empty: blanks at a line's start are the text's indentation)
            text = blanks + word
            self.column = after_blanks + cell_len(word)
        else:
            text = "\n" + word  # the blanks before it are dropped at the break
            self.column = cell_len(word)
        self._broken = False
        self._advance(0)
        self._out(text)


def _advance(column: int, blanks: str) -> int:
    """The column after writing `blanks` (spaces and tabs, a tab to the next multiple of 8)."""
    for ch in blanks:
        column = column + 8 - column % 8 if ch == "\t" else column + 1
    return column
