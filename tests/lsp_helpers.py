"""Helpers for the LSP tests: `kinfer-rpc` with a fake `inference/infill`, and a FIM model.

The fake server is the real one (framing, connection, lifecycle, LSP layer) with
`Handlers.inference_infill` and `Handlers.model_load` replaced: infill waits `KINFER_FAKE_DELAY`
seconds (cancellable) and answers a text made from the prefix and suffix it was given; both write
one JSON line per event to `KINFER_FAKE_LOG`, so a test can see what the server asked for and
which calls ran to the end.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

FAKE_SERVER = r"""
import json, os, sys, time
import anyio
from kinfer_rpc.protocol import handlers, server

LOG = os.environ["KINFER_FAKE_LOG"]
DELAY = float(os.environ.get("KINFER_FAKE_DELAY", "0"))


def record(event, **fields):
    with open(LOG, "a") as f:
        f.write(json.dumps({"event": event, "t": time.monotonic(), **fields}) + "\n")


async def inference_infill(self, ctx, /, **p):
    doc = p["prefix"].split("\n", 1)[0]
    record("start", doc=doc, prefix=p["prefix"], suffix=p["suffix"], options=p.get("options"),
           model=p.get("model"), extra=p.get("extra"))
    try:
        await anyio.sleep(DELAY)
    except anyio.get_cancelled_exc_class():
        record("cancelled", doc=doc)
        raise
    record("done", doc=doc, prefix=p["prefix"])
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


def fake_server(log: Path, delay: float = 0.0, text: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a fake server logging to `log`."""
    env = {k: v for k, v in os.environ.items() if k != "KINFER_RPC_PLUGINS"}
    env.update(KINFER_FAKE_LOG=str(log), KINFER_FAKE_DELAY=str(delay))
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
