"""What `kinfer` prints: JSON for scripts, tables that fit, errors with what to do next, progress bars."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Set as AbstractSet
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

from kinfer_rpc.client import (
    RpcError,
)
from kinfer_rpc.terminal import advice, columns

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _size(n: float | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _width(wide: bool = False) -> int | None:
    """The columns a table may take: the terminal's; None (all of it) with --wide or when stdout
    is not a terminal (a pipe, a file: nothing to fit, and grep finds the whole path)."""
    if wide or not out.is_terminal:
        return None
    return out.width


def _table(
    headers: list[str],
    rows: list[list[str]],
    right: AbstractSet[int] = frozenset(),
    elastic: int | None = None,
    wide: bool = False,
    drop: bool = True,
    middle: bool = True,
) -> None:
    """Aligned columns that fit the width, the `elastic` one elided where they would not (all of
    it with --wide); the header bold on a terminal."""
    for n, line in enumerate(columns.fit(headers, rows, _width(wide), elastic, right, drop, middle)):
        out.print(line, style="bold" if n == 0 else None, markup=False, highlight=False, soft_wrap=True)


# -- errors: what happened, and what to do next --------------------------------------------------
def _fail(args: argparse.Namespace | None, said: advice.Advice, code: int | None = None, data: Any = None) -> int:
    """Say an error: the words and next steps on stderr, and with --json the same as a JSON
    document on stdout; exit code 1."""
    if args is not None and getattr(args, "json", False):
        _emit(said.json(code, data))
    err.print(said.text(_message_width(), "kinfer: "), markup=False, highlight=False)
    return 1


def _message_width() -> int | None:
    """Messages wrap at words on a terminal (at most 80 columns); elsewhere a line a message."""
    return min(err.width, 80) - 1 if err.is_terminal else None


def _rpc_failure(args: argparse.Namespace | None, exc: RpcError) -> int:
    return _fail(args, advice.for_error(exc.code, exc.message, exc.data), exc.code, _plain(exc.data))


def _plain(data: Any) -> Any:
    """An error's data when it is JSON (a cancelled request's partial result is not kept)."""
    try:
        json.dumps(data)
    except (TypeError, ValueError):
        return None
    return data


def _bar(transient: bool = True, quiet: bool = False) -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=transient,
        disable=quiet or not err.is_terminal,
    )


def _fill(text: str) -> str:
    """A message wrapped at words to the terminal (at most 80 columns)."""
    import textwrap

    width = min(out.width, 80) if out.is_terminal else 80
    return "\n".join(textwrap.fill(line, width - 1, subsequent_indent="  ") for line in text.splitlines())


# -- list --------------------------------------------------------------------------------------
def _human(n: float | None, units: list[str], step: float = 1000.0, digits: int = 1) -> str:
    if n is None:
        return "-"
    for unit in units:
        if abs(n) < step or unit == units[-1]:
            return f"{n:.{digits if unit != units[0] else 0}f}{unit}"
        n /= step
    return "-"
