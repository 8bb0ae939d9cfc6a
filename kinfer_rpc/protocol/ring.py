"""The repository as context: a ring of chunks of the documents the editor showed the server.

As llama.vim keeps one, with no plugin: a chunk is `chunkLines` lines (64) of a document, taken
where the editor worked: the start of a document when it is opened, the lines around an edit
when it changes, around the last edit when it is saved, and around the cursor when a completion
is asked for. A chunk replaces those it is nearly the same as (more than 0.9 of their lines in
common, counted as llama.vim does: twice the lines in common over the lines of both), so the
chunk of a region being typed in stays one chunk; past `chunks` chunks (16) or `chars`
characters, the oldest go.

A completion sends the chunks of its language, but not those of the documents `openFiles` sends
whole, to `inference/infill` as `extra`, oldest first: infill keeps the extra context's end when
it cuts it. Of its own document it sends only the chunks far from the cursor (a chunk's length
away or more, as their lines were when taken): infill's prefix and suffix keep only the text
near the cursor, so the far text of a long document is context like another file's (llama.vim
gathers it for that too: a completion also takes the chunks a chunk's length above and below
the cursor).

Chunks are added from the documents' jobs (possibly the worker thread) and read on the event
loop: a lock guards them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Collection

import attrs

from kinfer_rpc.protocol.text import Text

SIMILAR = 0.9  # a new chunk evicts those more alike than this
MIN_LINES = 3  # a chunk of fewer non-blank lines is not worth the prompt's room


@attrs.frozen
class Chunk:
    filename: str
    language: str
    text: str
    lines: frozenset[str]
    first: int = 0  # its lines in its document when taken: [first, last)
    last: int = 0


def similarity(a: frozenset[str], b: frozenset[str]) -> float:
    """Twice the lines in common over the lines of both (1: the same lines)."""
    if not a and not b:
        return 1.0
    return 2 * len(a & b) / (len(a) + len(b))


def _lines(text: str) -> frozenset[str]:
    return frozenset(line.strip() for line in text.splitlines() if line.strip())


class Ring:
    """The chunks, bounded by count and characters; `version` counts the changes."""

    def __init__(self, chunks: int = 16, chunk_lines: int = 64, chars: int = 16384) -> None:
        self._lock = threading.Lock()
        self._chunks: deque[Chunk] = deque()
        self.version = 0
        self.configure(chunks, chunk_lines, chars)

    def configure(self, chunks: int, chunk_lines: int, chars: int) -> None:
        with self._lock:
            self.chunks, self.chunk_lines, self.chars = chunks, max(1, chunk_lines), chars
            if self._trim():
                self.version += 1

    def _trim(self) -> bool:
        dropped = False
        total = sum(len(c.text) for c in self._chunks)
        while self._chunks and (len(self._chunks) > self.chunks or total > self.chars):
            total -= len(self._chunks.popleft().text)
            dropped = True
        return dropped

    def add(self, filename: str, language: str, text: str, first: int = 0, last: int = 0) -> bool:
        """Take `text` (lines `first` to `last` of its document) as a chunk; whether the ring
        changed."""
        if self.chunks <= 0:
            return False
        lines = _lines(text)
        if len(lines) < MIN_LINES or len(text) > self.chars:
            return False
        with self._lock:
            if any(c.filename == filename and c.text == text for c in self._chunks):
                return False
            kept = [c for c in self._chunks if similarity(c.lines, lines) <= SIMILAR]
            self._chunks = deque(kept)
            self._chunks.append(Chunk(filename, language, text, lines, first, last))
            self._trim()
            self.version += 1
            return True

    def pick(self, filename: str, language: str, text: Text, line: int) -> bool:
        """Take the chunk of `text` around `line` (on a grid of half chunks, so that edits in one
        region make the same chunk again); whether the ring changed. Called inside a job."""
        if self.chunks <= 0:
            return False
        half = max(1, self.chunk_lines // 2)
        return self._take(filename, language, text, max(0, (line // half - 1) * half))

    def pick_far(self, filename: str, language: str, text: Text, line: int) -> bool:
        """Take the chunks of `text` a chunk's length above and below `line` (those that exist);
        whether the ring changed. Called inside a job."""
        if self.chunks <= 0:
            return False
        half = max(1, self.chunk_lines // 2)
        above = (line - 2 * self.chunk_lines) // half * half
        below = -(-(line + self.chunk_lines) // half) * half
        changed = above >= 0 and self._take(filename, language, text, above)
        if below < text.line_count:
            changed = self._take(filename, language, text, below) or changed
        return changed

    def _take(self, filename: str, language: str, text: Text, first: int) -> bool:
        last = first + self.chunk_lines
        start = text.line_start(min(first, text.line_count - 1))
        end = text.line_start(last) if last < text.line_count else text.length
        return self.add(filename, language, text.slice(start, end), first, last)

    def extra(
        self, language: str, exclude: Collection[str], own: tuple[str, int] | None = None
    ) -> list[tuple[str, str]]:
        """(filename, text) of the chunks of `language` from other files than `exclude`, oldest
        first; of the file `own[0]`, only those a chunk's length or more from line `own[1]`."""
        with self._lock:
            return [
                (c.filename, c.text)
                for c in self._chunks
                if c.language == language and c.filename not in exclude and (own is None or self._far(c, *own))
            ]

    def _far(self, c: Chunk, filename: str, line: int) -> bool:
        return c.filename != filename or c.last <= line - self.chunk_lines or c.first >= line + self.chunk_lines

    def __len__(self) -> int:
        return len(self._chunks)
