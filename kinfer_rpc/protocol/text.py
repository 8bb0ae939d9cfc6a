"""A document's text with a line index: an LSP position becomes an offset, and an edit is applied,
in time that grows with the logarithm of the document's size and with the edit's own size, never
with the whole document (a 50 MB file edited at its last line costs what a small one does).

The text is cut into chunks of at most MAX_CHUNK characters, kept in blocks of at most MAX_BLOCK
chunks. Beside each chunk are its length, its line breaks and its length in UTF-16 code units
(LSP's positions count those); each block keeps the running sums of these over its chunks, and
three Fenwick trees (`Sums`) keep the blocks' totals. Finding the chunk that holds an offset, a
line's start or a UTF-16 unit is a descent of a tree and a bisection in one block, then a search
inside one chunk with the str methods (C speed). An edit rewrites the chunks it touches and updates
one block's sums and the trees; only a block that splits or empties makes the trees be rebuilt,
and that happens once per BLOCK chunks created or removed.

Lines end at \\n, \\r\\n or \\r, as LSP says. A chunk never ends between the \\r and the \\n of one
line break, so that every chunk's breaks are its own.
"""

from __future__ import annotations

import itertools
import re
from bisect import bisect_right
from collections.abc import Iterator, Sequence

import attrs

CHUNK = 2048  # characters of the chunks a long text is cut into
MAX_CHUNK = 2 * CHUNK  # an edit that makes a chunk longer cuts it again
BLOCK = 64  # chunks of the blocks a long text is grouped into
MAX_BLOCK = 2 * BLOCK

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_SURROGATE = re.compile("[\ud800-\udfff]")


def utf16_len(text: str) -> int:
    """The length of `text` in UTF-16 code units (a character above U+FFFF counts two)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def _breaks(s: str) -> int:
    n = s.count("\n")
    r = s.count("\r")
    return n + r - s.count("\r\n") if r else n


class Sums:
    """Running sums over a list of counts (a Fenwick tree): a prefix's sum, a change to one count,
    and where the running sum passes a value, each in O(log n)."""

    __slots__ = ("_tree", "_top", "n")

    def __init__(self, values: Sequence[int]) -> None:
        n = len(values)
        tree = [0, *values]
        for i in range(1, n + 1):
            j = i + (i & -i)
            if j <= n:
                tree[j] += tree[i]
        self._tree = tree
        self._top = 1 << (n.bit_length() - 1) if n else 0
        self.n = n

    def add(self, i: int, delta: int) -> None:
        """Count `i` (from 0) changes by `delta`."""
        tree, n = self._tree, self.n
        i += 1
        while i <= n:
            tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:
        """The sum of the first `i` counts."""
        tree = self._tree
        total = 0
        while i > 0:
            total += tree[i]
            i &= i - 1
        return total

    def find(self, x: int) -> tuple[int, int]:
        """The first count whose running sum (itself included) exceeds `x`, and the sum of the
        counts before it; (n, total) when the whole sum is at most `x`."""
        tree, n = self._tree, self.n
        k, left, step = 0, x, self._top
        while step:
            j = k + step
            if j <= n and tree[j] <= left:
                k = j
                left -= tree[j]
            step >>= 1
        return k, x - left


@attrs.define(slots=True, eq=False)
class _Block:
    """Consecutive chunks, their sizes, and the running sums of those (built when first needed
    after a change)."""

    chunks: list[str]
    chars: list[int]
    breaks: list[int]
    units: list[int]
    sums: tuple[list[int], list[int], list[int]] | None = None

    @classmethod
    def of(cls, chunks: list[str]) -> _Block:
        return cls(chunks, [len(c) for c in chunks], [_breaks(c) for c in chunks], [utf16_len(c) for c in chunks])

    def running(self) -> tuple[list[int], list[int], list[int]]:
        if self.sums is None:
            self.sums = (
                list(itertools.accumulate(self.chars, initial=0)),
                list(itertools.accumulate(self.breaks, initial=0)),
                list(itertools.accumulate(self.units, initial=0)),
            )
        return self.sums

    def totals(self) -> tuple[int, int, int]:
        sums = self.running()
        return sums[0][-1], sums[1][-1], sums[2][-1]


CHARS, BREAKS, UNITS = 0, 1, 2  # the measures a position can be sought by


class Text:
    """A document's text, edited in place: `locate` turns an LSP position into an offset, `replace`
    applies an edit by offsets, `split` and `tail` read it out. Not thread-safe: one user at a
    time (the documents' jobs, protocol/documents.py, see to that)."""

    def __init__(self, text: str = "") -> None:
        self._blocks: list[_Block] = []
        self._trees: tuple[Sums, Sums, Sums] = (Sums([]), Sums([]), Sums([]))
        self.reset(text)

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Characters (Python's, code points)."""
        return self._trees[CHARS].prefix(len(self._blocks))

    @property
    def line_count(self) -> int:
        """Lines: one more than the line breaks (an empty text has one, empty, line)."""
        return self._trees[BREAKS].prefix(len(self._blocks)) + 1

    # -- whole text ------------------------------------------------------------------------------
    def reset(self, text: str) -> None:
        """The text becomes `text`."""
        self._blocks = _group(_cut(text))
        self._rebuild()

    def _rebuild(self) -> None:
        totals = [b.totals() for b in self._blocks]
        self._trees = (Sums([t[0] for t in totals]), Sums([t[1] for t in totals]), Sums([t[2] for t in totals]))

    def chunks(self) -> Iterator[str]:
        """The text, chunk by chunk."""
        return itertools.chain.from_iterable(b.chunks for b in self._blocks)

    def __str__(self) -> str:
        return "".join(self.chunks())

    # -- seeking ---------------------------------------------------------------------------------
    def _seek(self, measure: int, x: int) -> tuple[int, int, int]:
        """The chunk holding unit `x` (from 0) of a measure (CHARS, BREAKS, UNITS), as (block,
        chunk, that measure's units before the chunk); x must be under the measure's total."""
        bi, before = self._trees[measure].find(x)
        sums = self._blocks[bi].running()[measure]
        ci = bisect_right(sums, x - before) - 1
        return bi, ci, before + sums[ci]

    def _before(self, bi: int, ci: int, measure: int) -> int:
        """A measure's units before chunk `ci` of block `bi`."""
        return self._trees[measure].prefix(bi) + self._blocks[bi].running()[measure][ci]

    def line_start(self, line: int) -> int:
        """The offset where `line` (at most line_count - 1) starts."""
        if line == 0:
            return 0
        bi, ci, before = self._seek(BREAKS, line - 1)
        _, end = _nth_break(self._blocks[bi].chunks[ci], line - 1 - before)
        return self._before(bi, ci, CHARS) + end

    def line_end(self, line: int) -> int:
        """The offset where `line` ends, before its line break (the text's end for the last)."""
        if line >= self.line_count - 1:
            return self.length
        bi, ci, before = self._seek(BREAKS, line)
        start, _ = _nth_break(self._blocks[bi].chunks[ci], line - before)
        return self._before(bi, ci, CHARS) + start

    def units_at(self, offset: int) -> int:
        """UTF-16 code units before `offset`."""
        if offset >= self.length:
            return self._trees[UNITS].prefix(len(self._blocks))
        bi, ci, before = self._seek(CHARS, offset)
        block = self._blocks[bi]
        inside = offset - before
        if block.units[ci] != block.chars[ci]:
            inside = utf16_len(block.chunks[ci][:inside])
        return self._before(bi, ci, UNITS) + inside

    def _offset_of_units(self, units: int) -> int:
        """The offset of UTF-16 unit `units`; one inside a surrogate pair falls after its character."""
        bi, ci, before = self._seek(UNITS, units)
        block = self._blocks[bi]
        start = self._before(bi, ci, CHARS)
        if block.units[ci] == block.chars[ci]:
            return start + units - before
        return start + _index_of_units(block.chunks[ci], units - before)

    def locate(self, line: int, character: int) -> tuple[int, int, int]:
        """An LSP position (UTF-16 `character`) as (offset, line, character) clamped to the text:
        a character past its line's end is that end (as LSP says), a line past the last is the
        text's end, a character inside a surrogate pair is after its character."""
        last = self.line_count - 1
        if line > last:
            start = self.line_start(last)
            return self.length, last, self.units_at(self.length) - self.units_at(start)
        start = self.line_start(line)
        if character == 0 or start == self.length:
            return start, line, 0
        bi, ci, before = self._seek(CHARS, start)
        block = self._blocks[bi]
        chunk = block.chunks[ci]
        # Where the line ends, looked for in the chunk it starts in (lines mostly end there).
        if "\r" in chunk:
            m = _LINE_BREAK.search(chunk, start - before)
            stop = m.start() if m is not None else -1
        else:
            stop = chunk.find("\n", start - before)
        end = before + stop if stop >= 0 else self.line_end(line)
        if stop >= 0 or end <= before + block.chars[ci]:  # the line lies in one chunk
            if block.units[ci] == block.chars[ci]:
                c = min(character, end - start)
                return start + c, line, c
            text = chunk[start - before : end - before]
            width = utf16_len(text)
            if character >= width:
                return end, line, width
            i = _index_of_units(text, character)
            return start + i, line, utf16_len(text[:i])
        first = self.units_at(start)
        width = self.units_at(end) - first
        if character >= width:
            return end, line, width
        offset = self._offset_of_units(first + character)
        return offset, line, self.units_at(offset) - first

    # -- editing ---------------------------------------------------------------------------------
    def replace(self, start: int, end: int, new: str) -> None:
        """Characters start..end (0 <= start <= end <= length) become `new`."""
        if start == end and not new:
            return
        blocks = self._blocks
        if not blocks:
            self.reset(new)
            return
        length = self.length
        if start < length:
            b0, c0, before0 = self._seek(CHARS, start)
        else:  # at the very end: the last chunk grows
            b0 = len(blocks) - 1
            c0 = len(blocks[b0].chunks) - 1
            before0 = length - blocks[b0].chars[c0]
        if end > start:
            b1, c1, before1 = self._seek(CHARS, end - 1)
        else:
            b1, c1, before1 = b0, c0, before0
        mid = blocks[b0].chunks[c0][: start - before0] + new + blocks[b1].chunks[c1][end - before1 :]
        # A \r\n must not straddle the edges of what is rewritten: take in the neighbour.
        prev = (b0, c0 - 1) if c0 > 0 else (b0 - 1, len(blocks[b0 - 1].chunks) - 1) if b0 > 0 else None
        nxt = (b1, c1 + 1) if c1 + 1 < len(blocks[b1].chunks) else (b1 + 1, 0) if b1 + 1 < len(blocks) else None
        if prev is not None:
            left = blocks[prev[0]].chunks[prev[1]]
            follows = mid or (blocks[nxt[0]].chunks[nxt[1]] if nxt is not None else "")
            if left.endswith("\r") and follows.startswith("\n"):
                (b0, c0), mid = prev, left + mid
        if nxt is not None and mid.endswith("\r"):
            right = blocks[nxt[0]].chunks[nxt[1]]
            if right.startswith("\n"):
                (b1, c1), mid = nxt, mid + right
        self._splice(b0, c0, b1, c1, _cut(mid))

    def _splice(self, b0: int, c0: int, b1: int, c1: int, pieces: list[str]) -> None:
        """Chunks c0 of block b0 through c1 of block b1 become `pieces`."""
        blocks = self._blocks
        if b0 == b1:
            block = blocks[b0]
            old = block.totals()
            fresh = _Block.of(pieces)
            block.chunks[c0 : c1 + 1] = fresh.chunks
            block.chars[c0 : c1 + 1] = fresh.chars
            block.breaks[c0 : c1 + 1] = fresh.breaks
            block.units[c0 : c1 + 1] = fresh.units
            block.sums = None
            n = len(block.chunks)
            if 0 < n <= MAX_BLOCK:
                for tree, was, now in zip(self._trees, old, block.totals(), strict=True):
                    if now != was:
                        tree.add(b0, now - was)
                return
            blocks[b0 : b0 + 1] = _group(block.chunks, block)
        else:
            chunks = blocks[b0].chunks[:c0] + pieces + blocks[b1].chunks[c1 + 1 :]
            blocks[b0 : b1 + 1] = _group(chunks)
        self._rebuild()

    # -- reading ---------------------------------------------------------------------------------
    def split(self, offset: int) -> tuple[list[str], list[str]]:
        """The text before `offset` and after it, as chunks (cheap: no text is copied but the
        chunk `offset` falls in)."""
        if offset >= self.length:
            return list(self.chunks()), []
        bi, ci, before = self._seek(CHARS, offset)
        blocks = self._blocks
        head = [c for b in blocks[:bi] for c in b.chunks] + blocks[bi].chunks[:ci]
        tail = blocks[bi].chunks[ci + 1 :] + [c for b in blocks[bi + 1 :] for c in b.chunks]
        chunk = blocks[bi].chunks[ci]
        cut = offset - before
        if cut:
            head.append(chunk[:cut])
        tail.insert(0, chunk[cut:])
        return head, tail

    def slice(self, start: int, end: int) -> str:
        """The characters from `start` to `end` (clamped to the text), reading only the chunks
        that hold them."""
        start, end = max(0, start), min(end, self.length)
        if start >= end:
            return ""
        bi, ci, pos = self._seek(CHARS, start)
        rest = itertools.chain(
            self._blocks[bi].chunks[ci:],
            itertools.chain.from_iterable(b.chunks for b in itertools.islice(self._blocks, bi + 1, None)),
        )
        out: list[str] = []
        for chunk in rest:
            out.append(chunk[max(0, start - pos) : end - pos])
            pos += len(chunk)
            if pos >= end:
                break
        return "".join(out)

    def tail(self, n: int) -> str:
        """The last `n` characters."""
        out: list[str] = []
        for chunk in itertools.chain.from_iterable(reversed(b.chunks) for b in reversed(self._blocks)):
            if n <= 0:
                break
            out.append(chunk[-n:] if len(chunk) > n else chunk)
            n -= len(chunk)
        return "".join(reversed(out))

    def check(self) -> None:
        """Raise AssertionError where the index disagrees with the text (for tests)."""
        for b in self._blocks:
            assert b.chunks and len(b.chunks) <= MAX_BLOCK
            assert b.chars == [len(c) for c in b.chunks]
            assert b.breaks == [_breaks(c) for c in b.chunks]
            assert b.units == [utf16_len(c) for c in b.chunks]
            assert all(0 < len(c) <= MAX_CHUNK for c in b.chunks)
        chunks = list(self.chunks())
        assert not any(a.endswith("\r") and b.startswith("\n") for a, b in itertools.pairwise(chunks))
        for m in (CHARS, BREAKS, UNITS):
            want = list(itertools.accumulate((b.totals()[m] for b in self._blocks), initial=0))
            assert [self._trees[m].prefix(i) for i in range(len(self._blocks) + 1)] == want


def _cut(text: str) -> list[str]:
    """`text` as chunks of about CHUNK characters (none between a \\r and its \\n)."""
    if len(text) <= MAX_CHUNK:
        return [text] if text else []
    out = []
    i, n = 0, len(text)
    while n - i > MAX_CHUNK:
        j = i + CHUNK
        if text[j - 1] == "\r" and text[j] == "\n":
            j += 1
        out.append(text[i:j])
        i = j
    out.append(text[i:])
    return out


def _group(chunks: list[str], block: _Block | None = None) -> list[_Block]:
    """Chunks as blocks of about BLOCK (reusing `block`'s sizes when they are its chunks)."""
    if not chunks:
        return []
    if len(chunks) <= MAX_BLOCK:
        return [block if block is not None else _Block.of(chunks)]
    out = []
    for i in range(0, len(chunks), BLOCK):
        if block is not None:
            j = i + BLOCK
            out.append(_Block(chunks[i:j], block.chars[i:j], block.breaks[i:j], block.units[i:j]))
        else:
            out.append(_Block.of(chunks[i : i + BLOCK]))
    return out


def _index_of_units(text: str, units: int) -> int:
    """The index in `text` of UTF-16 unit `units` (at most its length in units); one inside a
    surrogate pair falls after its character."""
    if _SURROGATE.search(text) is None:
        # Cut the UTF-16 bytes there: a cut inside a pair decodes its first half as a character.
        return len(text[:units].encode("utf-16-le")[: 2 * units].decode("utf-16-le", "surrogatepass"))
    n = 0  # lone surrogates, which a decode would pair up: count them one by one
    for i, c in enumerate(text):
        if n >= units:
            return i
        n += 2 if c > "\uffff" else 1
    return len(text)


def _nth_break(chunk: str, k: int) -> tuple[int, int]:
    """Where line break `k` (from 0) of `chunk` starts and ends."""
    cr = chunk.count("\r") if "\r" in chunk else 0
    if cr == 0 or cr == chunk.count("\r\n"):  # every break ends at a \n
        p = _nth_newline(chunk, k)
        return (p - 1 if p and chunk[p - 1] == "\r" else p), p + 1
    m = next(itertools.islice(_LINE_BREAK.finditer(chunk), k, None))
    return m.start(), m.end()


def _nth_newline(s: str, k: int) -> int:
    """The index of the `k`-th (from 0) \\n of `s`, which has more than k."""
    if k < 8:
        p = -1
        for _ in range(k + 1):
            p = s.index("\n", p + 1)
        return p
    lo, hi, seen = 0, len(s) - 1, 0  # the answer is in lo..hi; `seen`: the \n in s[:lo]
    while lo < hi:
        mid = (lo + hi) // 2
        n = s.count("\n", lo, mid + 1)
        if seen + n > k:
            hi = mid
        else:
            seen += n
            lo = mid + 1
    return lo
