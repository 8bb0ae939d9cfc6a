"""Helpers for the LSP tests: `kinfer-rpc` with a fake `inference/infill`, and a FIM model.

The fake server is the real one (framing, connection, lifecycle, LSP layer) with
`Handlers.inference_infill` and `Handlers.model_load` replaced: infill waits `KINFER_FAKE_DELAY`
seconds (cancellable) and answers a text made from the prefix and suffix it was given; both write
one JSON line per event to `KINFER_FAKE_LOG`, so a test can see what the server asked for and
which calls ran to the end. The log's `prefix` is the whole text before the cursor (infill's
`prefix` and `middle` together), and `middle` the middle alone. With `KINFER_FAKE_SIZES` the log
has the prefix's and suffix's lengths and the extra files' names instead of the texts (for
documents of many megabytes).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio

from kinfer_rpc.protocol.lsp import Editor

FAKE_SERVER = r"""
import json, os, sys, time
import anyio
from kinfer_rpc.protocol import handlers, server

LOG = os.environ["KINFER_FAKE_LOG"]
DELAY = float(os.environ.get("KINFER_FAKE_DELAY", "0"))
SIZES = bool(os.environ.get("KINFER_FAKE_SIZES"))


def record(event, **fields):
    with open(LOG, "a") as f:
        f.write(json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n")


async def inference_infill(self, ctx, /, **p):
    middle = p.get("middle")
    p = {**p, "prefix": p["prefix"] + (middle or "")}  # the text before the cursor, as one
    cut = p["prefix"].find("\n")
    doc = p["prefix"] if cut < 0 else p["prefix"][:cut]  # the first line (split would copy the rest)
    if SIZES:
        doc = doc[:100]
        record("start", doc=doc, prefix=len(p["prefix"]), suffix=len(p["suffix"]),
               extra=[e["filename"] for e in p.get("extra") or []])
    else:
        record("start", doc=doc, prefix=p["prefix"], suffix=p["suffix"], options=p.get("options"),
               model=p.get("model"), extra=p.get("extra"), middle=middle)
    try:
        await anyio.sleep(DELAY)
    except anyio.get_cancelled_exc_class():
        record("cancelled", doc=doc)
        raise
    record("done", doc=doc, prefix=len(p["prefix"]) if SIZES else p["prefix"])
    text = os.environ.get("KINFER_FAKE_TEXT") or f"_fake({len(p['prefix'])},{len(p['suffix'])})"
    n = len(p["prefix"]) // 4
    return {"model": p.get("model") or "fake-fim", "text": text, "tokens": [1, 2, 3], "stopReason": "stop",
            "seed": 1, "usage": {"promptTokens": n, "completionTokens": 3, "cachedTokens": n - 1}}


async def model_load(self, ctx, /, **p):
    record("load", **p)
    return {"model": p.get("model") or "fake-fim"}


handlers.Handlers.inference_infill = inference_infill
handlers.Handlers.model_load = model_load
sys.exit(server.main(sys.argv[1:]))
"""


def fake_server(
    log: Path, delay: float = 0.0, text: str | None = None, sizes: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a fake server logging to `log`."""
    env = {k: v for k, v in os.environ.items() if k != "KINFER_RPC_PLUGINS"}
    env.update(KINFER_FAKE_LOG=str(log), KINFER_FAKE_DELAY=str(delay))
    if sizes:
        env["KINFER_FAKE_SIZES"] = "1"
    if text is not None:
        env["KINFER_FAKE_TEXT"] = text
    return [sys.executable, "-c", FAKE_SERVER], env


def events(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def fim_model(dst_dir: Path) -> str | None:
    """A GGUF with fill-in-the-middle tokens, written by tests/modelgen's FIM helper (`make_fim*`),
    or None when that helper or the server's `inference/infill` is not there."""
    import importlib
    import inspect

    from kinfer_rpc.protocol.handlers import Handlers

    if not hasattr(Handlers, "inference_infill"):
        return None
    for path in sorted((Path(__file__).resolve().parent / "modelgen").glob("make_fim*.py")):
        module = importlib.import_module(path.stem)
        makers = [f for n, f in inspect.getmembers(module, inspect.isfunction) if n.startswith("make_fim")]
        if makers:
            return str(makers[0](dst_dir / "fim.gguf"))
    return None


def typing_edits(n: int, lines: int, width: int, seed: int = 0) -> tuple[list[dict], int]:
    """`n` incremental edits at random places of a document of `lines` lines of `width`
    characters (typing, deleting, a line split and joined again), each valid on the text the
    edits before it made, and how much they change the document's length."""
    import random

    def edit(sl, sc, el, ec, text):
        return {"range": {"start": {"line": sl, "character": sc}, "end": {"line": el, "character": ec}}, "text": text}

    rng = random.Random(seed)
    length: dict[int, int] = {}  # line -> its length, where an edit changed it
    out: list[dict] = []
    delta = 0
    while len(out) < n:
        line = rng.randrange(lines)
        have = length.get(line, width)
        kind = rng.random()
        if kind < 0.5:
            c = rng.randint(0, have)
            text = rng.choice(["x", "yz", "(", "_q"])
            out.append(edit(line, c, line, c, text))
            length[line] = have + len(text)
            delta += len(text)
        elif kind < 0.8 and have > 0:
            c = rng.randrange(have)
            k = min(have - c, rng.randint(1, 3))
            out.append(edit(line, c, line, c + k, ""))
            length[line] = have - k
            delta -= k
        elif n - len(out) >= 2:
            c = rng.randint(0, have)
            out.append(edit(line, c, line, c, "\n"))
            out.append(edit(line, c, line + 1, 0, ""))
    return out, delta


URI = "file:///tmp/example.py"


def pos(line, character):
    return {"line": line, "character": character}


def change(sl, sc, el, ec, text):
    return {"range": {"start": pos(sl, sc), "end": pos(el, ec)}, "text": text}


# -- the editor over a fake infill ----------------------------------------------------------------
class FakeInfill:
    """inference/infill's contract: records calls; each waits for `release` unless told not to."""

    def __init__(self, wait: bool = False, text: str = "_name(x)\n    return x"):
        self.text = text
        self.calls: list[dict] = []
        self.cancelled = 0
        self.finished = 0
        self.wait = wait
        self.release = anyio.Event()
        self.started = anyio.Event()

    async def __call__(self, ctx, /, **p):
        self.calls.append(p)
        self.started.set()
        try:
            if self.wait:
                await self.release.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        self.finished += 1
        return {"model": "fake-fim", "text": self.text, "tokens": [1, 2], "stopReason": "stop"}


def before(call):
    """The text before the cursor an infill call was given: its prefix and middle."""
    return call["prefix"] + call["middle"]


def make_editor(infill, loads=None, notes=None):
    loads = [] if loads is None else loads
    notes = [] if notes is None else notes

    async def load(ctx, /, **p):
        loads.append(p)
        return {"model": p.get("model") or "default"}

    return Editor(infill, load, lambda name: False, lambda m, p: notes.append((m, p)))


def run(fn):
    anyio.run(fn, backend="asyncio")


def open_doc(editor, text, uri=URI, language="python"):
    async def go():
        await editor.did_open(textDocument={"uri": uri, "languageId": language, "version": 1, "text": text})

    return go()
