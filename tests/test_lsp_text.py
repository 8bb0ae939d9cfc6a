"""kinfer_rpc.protocol.text (a document's text with its line index) and the edits of
kinfer_rpc.protocol.documents, against a plain string edited the naive way: random texts and
edit sequences (hypothesis), with tiny chunks and blocks so that every edge is crossed often, and
at the real sizes with long lines; then the time one edit takes in a 50 MB text."""

from __future__ import annotations

import contextlib
import random
import re
import time
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer_rpc import errors
from kinfer_rpc.protocol import text as text_module
from kinfer_rpc.protocol.documents import apply_edits, parse_edits
from kinfer_rpc.protocol.text import Sums, Text

PROPERTY = settings(deadline=None, max_examples=200, suppress_health_check=list(HealthCheck))

# Line breaks of every kind, characters of one and two UTF-16 units, and lone surrogates (JSON
# can carry them; they count one unit each).
PIECES = ["a", "b", " ", "_", "\n", "\r", "\r\n", "é", "😀", "𝄞", "\ud83d", "\ude00"]
# Breaks drawn as often as all the rest: the \r\n kept whole across chunk edges is the subtle part.
texts = st.lists(st.sampled_from(PIECES) | st.sampled_from(["\r", "\n"]), max_size=50).map("".join)
# Long runs of one piece: lines and texts over many chunks at the real sizes.
runs = st.lists(st.tuples(st.sampled_from(PIECES), st.integers(1, 3000)), max_size=8).map(
    lambda parts: "".join(p * n for p, n in parts)
)
positions = st.tuples(st.integers(0, 14), st.integers(0, 12))


@contextlib.contextmanager
def tiny_chunks():
    """Chunks of 2-4 characters in blocks of 2-4 chunks: every edit meets the index's edges."""
    with mock.patch.multiple(text_module, CHUNK=2, MAX_CHUNK=4, BLOCK=2, MAX_BLOCK=4):
        yield


# -- the naive reference ---------------------------------------------------------------------------
def utf16(s: str) -> int:
    return len(s.encode("utf-16-le", "surrogatepass")) // 2


def lines_of(text: str) -> list[tuple[int, int]]:
    """(start, end) of each line; the end is where its line break starts."""
    spans, start = [], 0
    for m in re.finditer(r"\r\n|\r|\n", text):
        spans.append((start, m.start()))
        start = m.end()
    spans.append((start, len(text)))
    return spans


def naive_locate(text: str, line: int, character: int) -> tuple[int, int, int]:
    """LSP's position rules by walking the text: past a line's end is its end, past the last
    line is the text's end, inside a surrogate pair is after its character."""
    spans = lines_of(text)
    if line >= len(spans):
        start, _ = spans[-1]
        return len(text), len(spans) - 1, utf16(text[start:])
    start, end = spans[line]
    units = 0
    for i in range(start, end):
        if units >= character:
            return i, line, units
        units += 2 if ord(text[i]) > 0xFFFF else 1
    return end, line, units


def naive_apply(text: str, edits: list) -> str:
    for rng, new in edits:
        if rng is None:
            text = new
            continue
        a = naive_locate(text, *rng[0])[0]
        b = naive_locate(text, *rng[1])[0]
        a, b = min(a, b), max(a, b)
        text = text[:a] + new + text[b:]
    return text


def agree(t: Text, s: str, probes: list[tuple[int, int]]) -> None:
    t.check()
    assert str(t) == s
    assert t.length == len(s)
    assert t.line_count == len(lines_of(s))
    for line, character in probes:
        assert t.locate(line, character) == naive_locate(s, line, character), (s, line, character)


# -- properties --------------------------------------------------------------------------------------
@PROPERTY
@given(
    start=texts,
    edits=st.lists(st.tuples(positions, positions, texts), max_size=20),
    probes=st.lists(positions, max_size=6),
)
def test_edits_and_positions_match_a_plain_string(start, edits, probes):
    with tiny_chunks():
        t, s = Text(start), start
        agree(t, s, probes)
        for a, b, new in edits:
            assert t.locate(*a) == naive_locate(s, *a)
            x, y = sorted((t.locate(*a)[0], t.locate(*b)[0]))
            t.replace(x, y, new)
            s = s[:x] + new + s[y:]
            agree(t, s, probes)


@PROPERTY
@given(start=texts, data=st.data())
def test_edits_anywhere_by_offset_keep_the_index_whole(start, data):
    with tiny_chunks():
        t, s = Text(start), start
        for _ in range(data.draw(st.integers(0, 30))):
            x = data.draw(st.integers(0, len(s)))
            y = data.draw(st.integers(x, len(s)))
            new = data.draw(texts)
            t.replace(x, y, new)
            s = s[:x] + new + s[y:]
            agree(t, s, data.draw(st.lists(positions, max_size=2)))


@PROPERTY
@given(start=runs, edits=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1), runs), max_size=6), data=st.data())
def test_long_lines_over_many_chunks_at_the_real_sizes(start, edits, data):
    t, s = Text(start), start
    for fa, fb, new in edits:
        x, y = sorted((int(fa * len(s)), int(fb * len(s))))
        t.replace(x, y, new)
        s = s[:x] + new + s[y:]
        n = len(lines_of(s))
        probes = data.draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, 7000)), max_size=4))
        agree(t, s, probes)
        cut = data.draw(st.integers(0, len(s)))
        head, tail = t.split(cut)
        assert "".join(head) == s[:cut] and "".join(tail) == s[cut:]
        assert t.tail(cut) == s[len(s) - cut :]


@PROPERTY
@given(start=texts, changes=st.lists(st.tuples(st.none() | st.tuples(positions, positions), texts), max_size=12))
def test_a_batch_of_changes_applies_in_order_with_out_of_range_ones_clamped(start, changes):
    wire = [
        {"text": new} if rng is None else {"range": {"start": pos(*rng[0]), "end": pos(*rng[1])}, "text": new}
        for rng, new in changes
    ]
    with tiny_chunks():
        t = Text(start)
        odd = apply_edits(t, parse_edits(wire))
        t.check()
    assert str(t) == naive_apply(start, changes)
    assert odd >= 0


def pos(line, character):
    return {"line": line, "character": character}


@PROPERTY
@given(
    values=st.lists(st.integers(0, 5), max_size=40), changes=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 5)))
)
def test_sums_find_and_prefix(values, changes):
    sums = Sums(values)
    for i, v in changes:
        if i < len(values):
            sums.add(i, v - values[i])
            values[i] = v
    running = [sum(values[:i]) for i in range(len(values) + 1)]
    assert [sums.prefix(i) for i in range(len(values) + 1)] == running
    for x in range(running[-1] + 2):
        k, before = sums.find(x)
        want = next((i for i in range(len(values)) if running[i + 1] > x), len(values))
        assert (k, before) == (want, running[want])


# -- cases ------------------------------------------------------------------------------------------
def test_crlf_is_never_split_between_chunks():
    with tiny_chunks():
        t = Text("ab\r\ncd\r\nef")
        t.replace(2, 2, "\r")  # "ab\r\r\ncd..."
        t.replace(3, 3, "x")  # "ab\rx\r\ncd...": a \r then a \r\n
        t.replace(3, 4, "")  # the x goes: \r and \r\n meet again
        t.check()
        assert str(t) == "ab\r\r\ncd\r\nef"
        assert t.line_count == 4
        t.replace(2, 3, "")
        t.replace(0, 0, "\n" * 9 + "\r")  # a \r before "ab": a line break of its own
        t.replace(10, 12, "\n")  # "ab" goes, a \n comes: the \r and it are one break
        agree(t, "\n" * 9 + "\r\n\r\ncd\r\nef", [(n, 1) for n in range(14)])


def test_bad_changes_are_refused_whole_with_the_field_named():
    for changes, field in [
        ({"text": "x"}, "params.contentChanges"),
        ([{"text": 5}], "params.contentChanges[0].text"),
        ([{"text": "x"}, {"range": [], "text": "x"}], "params.contentChanges[1].range"),
        ([{"range": {"start": pos(0, 0)}, "text": ""}], "params.contentChanges[0].range.end"),
        ([{"range": {"start": pos(-1, 0), "end": pos(0, 0)}, "text": ""}], "params.contentChanges[0].range.start.line"),
        ([{"range": {"start": pos(0, True), "end": pos(0, 0)}, "text": ""}], "range.start.character"),
        ([{"range": {"start": pos(0, 2**40), "end": pos(0, 0)}, "text": ""}], "range.start.character"),
        (["x"], "params.contentChanges[0]"),
    ]:
        with pytest.raises(errors.KinferError) as raised:
            parse_edits(changes)
        assert raised.value.code == errors.INVALID_PARAMS
        assert field in raised.value.message


def test_ranges_past_the_end_or_backwards_are_clamped_and_counted():
    t = Text("one\ntwo")
    odd = apply_edits(
        t,
        parse_edits(
            [
                {"range": {"start": pos(1, 99), "end": pos(1, 99)}, "text": "!"},  # past the line: LSP's rule
                {"range": {"start": pos(7, 0), "end": pos(9, 9)}, "text": "?"},  # past the document
                {"range": {"start": pos(0, 3), "end": pos(0, 0)}, "text": "ONE"},  # backwards
            ]
        ),
    )
    assert str(t) == "ONE\ntwo!?"
    assert odd == 2


def test_one_edit_anywhere_in_a_50_mb_text_takes_well_under_100_ms():
    t = Text("value = compute(alpha, beta) + 12345678\n" * 1_250_000)
    rng = random.Random(0)
    worst, length = 0.0, t.length
    for line in [0, 1_249_999, 1_250_000, *(rng.randrange(1_250_000) for _ in range(20))]:
        t0 = time.perf_counter()
        a = t.locate(line, 7)[0]
        b = t.locate(line + 1, 3)[0]
        t.replace(a, b, "x\n")
        worst = max(worst, time.perf_counter() - t0)
        length += 2 - (b - a)
    t.check()
    assert t.length == length
    assert worst < 0.1, f"{worst * 1000:.1f} ms"
