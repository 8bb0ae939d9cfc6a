"""Turning a reply's token bytes into streamed text.

Text is released only on whole UTF-8 characters, and never past a place where a stop string
could still begin: a client never sees half a character or part of a stop string.
"""

from __future__ import annotations

import codecs


class TextStream:
    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = tuple(s for s in stops if s)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""  # everything decoded so far (up to a stop, once one is found)
        self.emitted = 0  # how much of self.text the client has been sent
        self.stopped = False

    def push(self, piece: bytes) -> str:
        """Add a token's bytes; return the text that may be streamed now."""
        self.text += self._decoder.decode(piece)
        hits = [at for stop in self.stops if (at := self.text.find(stop, self.emitted)) >= 0]
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

    def _held(self) -> int:
        # The longest tail of the text that is a proper prefix of some stop string.
        held = 0
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
