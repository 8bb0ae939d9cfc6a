"""Tables that fit the window: aligned columns, and where the row is too wide, the one column
that may give (a path, a list of models) elided in its middle, or left out when too little room
is left for it to say anything. Everything else is kept whole: it is what a person types next."""

from __future__ import annotations

import os
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from rich.cells import cell_len

ELLIPSIS = "..."
MIN_ELASTIC = 12  # an elided column narrower than this says nothing: it is left out


def home_short(path: str) -> str:
    """~/... for a path under the home folder."""
    home = os.path.expanduser("~")
    if home not in ("", "/") and (path == home or path.startswith(home + os.sep)):
        return "~" + path[len(home) :]
    return path


def elide(text: str, width: int, middle: bool = True) -> str:
    """`text` in at most `width` cells: its start and its end joined by "..." (a path's end names
    the file, its start the store), or with `middle` False its start and "..."."""
    if cell_len(text) <= width:
        return text
    if width <= len(ELLIPSIS):
        return ELLIPSIS[:width]
    keep = width - len(ELLIPSIS)
    head = keep // 3 if middle else keep
    tail = keep - head
    if not tail:
        return _cells_head(text, head) + ELLIPSIS
    return _cells_head(text, head) + ELLIPSIS + _cells_tail(text, tail)


def _cells_head(text: str, cells: int) -> str:
    out = ""
    for ch in text:
        if cell_len(out + ch) > cells:
            break
        out += ch
    return out


def _cells_tail(text: str, cells: int) -> str:
    return _cells_head(text[::-1], cells)[::-1]


def fit(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    width: int | None,
    elastic: int | None = None,
    right: AbstractSet[int] = frozenset(),
    drop: bool = True,
    middle: bool = True,
) -> list[str]:
    """The table's lines (header first), two spaces between columns. With a `width`, the
    `elastic` column is elided to make each line fit, or, where less than MIN_ELASTIC cells would
    be left for it, left out (`drop`) or elided to MIN_ELASTIC; None: nothing is cut. `middle`:
    elided in its middle (a path), else at its end (a list)."""
    columns = list(range(len(headers)))
    table = [list(headers)] + [list(r) for r in rows]
    if width is not None and elastic is not None:
        others = [i for i in columns if i != elastic]
        used = sum(max(cell_len(r[i]) for r in table) for i in others) + 2 * len(others)
        room = width - used
        if room < MIN_ELASTIC and max(cell_len(r[elastic]) for r in table) > room and drop:
            columns = others
        else:
            for r in table[1:]:
                r[elastic] = elide(r[elastic], max(room, MIN_ELASTIC), middle)
    widths = {i: max(cell_len(r[i]) for r in table) for i in columns}
    lines = []
    for r in table:
        cells = [_pad(r[i], widths[i], i in right) for i in columns]
        lines.append("  ".join(cells).rstrip())
    return lines


def _pad(text: str, width: int, right: bool) -> str:
    gap = " " * (width - cell_len(text))
    return gap + text if right else text + gap
