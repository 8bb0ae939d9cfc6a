"""Turning a reply's token bytes into streamed text.

Text is released only on whole UTF-8 characters, and never past a place where a stop string
could still begin: a client never sees half a character or part of a stop string. A line
completion (`stop_at_line`) ends at the first line break after non-blank text.
"""

from __future__ import annotations

import codecs


class TextStream:
    def __init__(self, stops: tuple[str, ...] = (), *, stop_at_line: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.stop_at_line = stop_at_line
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""  # everything decoded so far (up to a stop, once one is found)
        self.emitted = 0  # how much of self.text the client has been sent
        self.stopped = False

    def push(self, piece: bytes) -> str:
        """Add a token's bytes; return the text that may be streamed now."""
        self.text += self._decoder.decode(piece)
        hits = [at for stop in self.stops if (at := self.text.find(stop, self.emitted)) >= 0]
        if self.stop_at_line and (at := self._line_end()) >= 0:
            hits.append(at)
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held())

    def finish(self) -> str:
        """The reply ended: release what was held back."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self._release(len(self.text))

    def _line_end(self) -> int:
        """Where the first line break after non-blank text is, a "\r\n"'s included (-1: none yet)."""
        start = len(self.text) - len(self.text.lstrip())
        if start == len(self.text):
            return -1
        at = self.text.find("\n", max(start, self.emitted))
        return at - 1 if at > start and self.text[at - 1] == "\r" else at

    def _held(self) -> int:
        # The longest tail of the text that is a proper prefix of some stop string (a line
        # completion's "\r" too: it may begin the "\r\n" that ends the line).
        held = 1 if self.stop_at_line and self.text.endswith("\r") and len(self.text) > self.emitted else 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text) - self.emitted), held, -1):
                if self.text.endswith(stop[:n]):
                    held = n
                    break
        return held

    def _release(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
