"""Where a round's time goes: one JSON line per device pass and per job, written to the file that
`KINFER_TRACE` names (nothing is recorded without it).

A pass line: when the engine asked the backend for it (`launch`), when that call returned
(`called`), when its logits were back (`done`), and what it held (one-token rows, prompt chunks
and their tokens). The time between one pass's `done` and the next one's `launch` is the host's
work between passes, during which the device idles unless a pass was started ahead. A job line:
when it was submitted, took a slot, got its first token and ended, with its prompt and reply
lengths. The protocol adds a line per request (`kind: "request"`): when it arrived and when it
was answered. Times are `time.perf_counter()` seconds, which every line of one process shares;
`bench/trace_summary.py` turns a file into the round's figures.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from kinfer_rpc.types import LoadedModel, SeqChunk

ENV = "KINFER_TRACE"


class Trace:
    """Appends trace lines to one file, from any thread."""

    def __init__(self, path: str):
        # Line by line: the server ends with os._exit, which flushes nothing.
        self._file: IO[str] = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, **fields}, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def attach(self, model: LoadedModel) -> None:
        """Time every pass the engine launches on `model` (its decode and decode_next calls, and
        the waits they return), as instance attributes over the backend's own methods."""
        for name in ("decode", "decode_next"):
            inner = getattr(model, name, None)
            if callable(inner):
                setattr(model, name, self._timed(name, inner))

    def _timed(self, name: str, inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def call(arg: Sequence[SeqChunk] | Sequence[int]) -> Any:
            launch = time.perf_counter()
            wait = inner(arg)
            called = time.perf_counter()
            if wait is None:  # decode_next could not repeat the pass: decode follows
                return None
            if name == "decode_next":
                rows, chunks, tokens = len(arg), 0, 0
            else:
                long = [len(c.tokens) for c in arg if isinstance(c, SeqChunk) and len(c.tokens) > 1]
                rows, chunks, tokens = len(arg) - len(long), len(long), sum(long)

            def timed_wait() -> Any:
                out = wait()
                self.write(
                    "pass",
                    launch=launch,
                    called=called,
                    done=time.perf_counter(),
                    rows=rows,
                    promptChunks=chunks,
                    promptTokens=tokens,
                )
                return out

            return timed_wait

        return call


_trace: Trace | None = None
_checked = False
_lock = threading.Lock()


def current() -> Trace | None:
    """The process's trace, opened at the first call when KINFER_TRACE names a file."""
    global _trace, _checked
    if _checked:
        return _trace
    with _lock:
        if not _checked:
            path = os.environ.get(ENV)
            _trace = Trace(path) if path else None
            _checked = True
    return _trace
