"""Large documents and hostile edits through kinfer-rpc's LSP mode: how long an edit takes to apply
and whether the server answers meanwhile.

    python bench/lsp_documents_bench.py [--case deep-edit,edit-50mb,edits-20k,open-files,text]
        [--repeat 5] [--edits 20000] [--timeout 120]

Run it from the checkout's root: the server it starts imports kinfer_rpc from there.

Each case starts the real `kinfer-rpc` (a subprocess) with `inference/infill` replaced by an
instant answer (no model: only the document work is timed), opens its document(s) and waits for
them to be ready (a completion answered), then sends `textDocument/didChange` and, in the same
write, `model/status` and `textDocument/completion`:

- `status_ms`: from the write to `model/status`'s answer: how long the event loop was held;
- `completion_ms`: from the write to the completion's answer: the edits applied, the document
  taken as of the request and its prefix and suffix built;
- `baseline_ms`: a completion alone, without an edit before it, for comparison.

Cases:

- `deep-edit`: a 4.8 MB document of 800,001 lines; one edit on line 800,000.
- `edit-50mb`: a 50 MB document (1,250,000 lines of 40 characters); one edit on a random line.
- `edits-20k`: the 4.8 MB document; one didChange of 20,000 edits at random places (typing,
  deleting, splitting a line and joining it again), each on the document the edits before it made.
- `open-files`: 1,100 Python documents open with `openFiles`; one completion (`ok`: answered
  rather than refused; `extra`: how many files went to infill).
- `text`: no server: kinfer_rpc.protocol.text.Text alone, the 4.8 MB and 50 MB documents and one of
  700,000 lines of `ab😀\r\n` (UTF-16 columns, \r\n line ends), 20,000 edits each (`edits_ms_*`),
  and the slowest of 20 single edits in the 50 MB one (`one_edit_50mb_ms`).

Prints one JSON line a case (bench/harness.py's format). Medians over `--repeat` rounds where a
case repeats. A case that gets no answer within `--timeout` seconds reports `timed_out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import emit
from lsp_replay import Lsp

# The real server with inference/infill answering at once (after checking `extra` as it does);
# each call's size is logged.
SERVER = r"""
import json, os, sys
from kinfer_rpc.protocol import handlers, params, server

LOG = os.environ["KINFER_BENCH_LOG"]


async def instant(self, ctx, /, **p):
    params.infill_extra(p.get("extra"))  # what the real method checks first
    with open(LOG, "a") as f:
        f.write(json.dumps({"prefix": len(p["prefix"]), "suffix": len(p["suffix"]),
                            "extra": len(p.get("extra") or [])}) + "\n")
    return {"model": "instant", "text": "x", "tokens": [1], "stopReason": "stop", "seed": 1,
            "usage": {"promptTokens": 1, "completionTokens": 1, "cachedTokens": 0}}


handlers.Handlers.inference_infill = instant
sys.exit(server.main(sys.argv[1:]))
"""

URI = "file:///bench/big.py"
SHORT = "abcde"  # the 4.8 MB document's lines
LONG = "value = compute(alpha, beta) + 12345678"  # 39 characters and a line break: 40


def pos(line: int, character: int) -> dict[str, int]:
    return {"line": line, "character": character}


def edit(sl: int, sc: int, el: int, ec: int, text: str) -> dict[str, Any]:
    return {"range": {"start": pos(sl, sc), "end": pos(el, ec)}, "text": text}


def hostile_edits(n: int, lines: int, width: int, seed: int = 0) -> tuple[list[dict[str, Any]], int]:
    """`n` edits at random places of a document of `lines` lines of `width` characters, each valid
    on the text the edits before it made, and the document's length change."""
    rng = random.Random(seed)
    length: dict[int, int] = {}  # line -> its length, where an edit changed it
    out: list[dict[str, Any]] = []
    delta = 0
    while len(out) < n:
        line = rng.randrange(lines)
        have = length.get(line, width)
        kind = rng.random()
        if kind < 0.5:  # typing
            c = rng.randint(0, have)
            text = rng.choice(["x", "yz", "(", "_q"])
            out.append(edit(line, c, line, c, text))
            length[line] = have + len(text)
            delta += len(text)
        elif kind < 0.8 and have > 0:  # deleting
            c = rng.randrange(have)
            k = min(have - c, rng.randint(1, 3))
            out.append(edit(line, c, line, c + k, ""))
            length[line] = have - k
            delta -= k
        elif n - len(out) >= 2:  # a line split, then joined again
            c = rng.randint(0, have)
            out.append(edit(line, c, line, c, "\n"))
            out.append(edit(line, c, line + 1, 0, ""))
    return out, delta


class Server:
    def __init__(self, lsp: Lsp, proc: asyncio.subprocess.Process, log: Path):
        self.lsp, self.proc, self.log = lsp, proc, log
        self.version = 1

    @classmethod
    async def start(cls, init: dict[str, Any] | None = None) -> Server:
        log = Path(tempfile.mkdtemp(prefix="lsp-documents-")) / "infill.jsonl"
        env = {**os.environ, "KINFER_BENCH_LOG": str(log)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            SERVER,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=1 << 26,
        )
        lsp = Lsp(proc)
        reply = await lsp.request(
            "initialize", {"processId": os.getpid(), "capabilities": {}, "initializationOptions": init or {}}
        )
        assert "result" in reply, reply
        lsp.notify("initialized", {})
        return cls(lsp, proc, log)

    def open(self, text: str, uri: str = URI) -> None:
        doc = {"uri": uri, "languageId": "python", "version": 1, "text": text}
        self.lsp.notify("textDocument/didOpen", {"textDocument": doc})

    async def complete(self, line: int, character: int, timeout: float, uri: str = URI) -> tuple[float, dict]:
        t0 = time.perf_counter()
        params = {"textDocument": {"uri": uri}, "position": pos(line, character)}
        reply = await asyncio.wait_for(self.lsp.request("textDocument/completion", params), timeout)
        return (time.perf_counter() - t0) * 1000, reply

    async def change(self, changes: list[dict[str, Any]], line: int, timeout: float) -> dict[str, float]:
        """didChange, model/status and a completion in one write; when each answer came."""
        self.version += 1
        t0 = time.perf_counter()
        self.lsp.notify("textDocument/didChange", {"textDocument": {"uri": URI, "version": self.version},
                                                   "contentChanges": changes})  # fmt: skip
        status = self.lsp.request("model/status", {})
        completion = self.lsp.request(
            "textDocument/completion", {"textDocument": {"uri": URI}, "position": pos(line, 0)}
        )
        out: dict[str, float] = {}
        status.add_done_callback(lambda f: out.__setitem__("status_ms", round((time.perf_counter() - t0) * 1000, 1)))
        reply = await asyncio.wait_for(completion, timeout)
        await asyncio.wait_for(status, timeout)
        assert "result" in reply, reply
        out["completion_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        return out

    def infill_calls(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.log.read_text().splitlines()] if self.log.exists() else []

    async def close(self) -> None:
        self.proc.kill()
        await self.proc.wait()
        self.lsp.reader.cancel()


def median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


async def one_edit(case: str, lines: int, line_text: str, args: argparse.Namespace) -> dict[str, Any]:
    server = await Server.start()
    try:
        t0 = time.perf_counter()
        server.open((line_text + "\n") * lines)
        await server.complete(0, 0, args.timeout * 4)
        opened = (time.perf_counter() - t0) * 1000
        rng = random.Random(1)
        rounds, baseline = [], []
        for _ in range(args.repeat):
            line = lines - 1 if case == "deep-edit" else rng.randrange(lines)
            baseline.append((await server.complete(line, 0, args.timeout))[0])
            rounds.append(await server.change([edit(line, 2, line, 2, "x")], line, args.timeout))
        return {
            "chars": lines * (len(line_text) + 1),
            "lines": lines,
            "open_and_first_completion_ms": round(opened, 1),
            "status_ms": median([r["status_ms"] for r in rounds]),
            "completion_ms": median([r["completion_ms"] for r in rounds]),
            "baseline_ms": median(baseline),
        }
    except TimeoutError:
        return {"timed_out": args.timeout}
    finally:
        await server.close()


async def many_edits(args: argparse.Namespace) -> dict[str, Any]:
    lines = 800_001
    server = await Server.start()
    try:
        server.open((SHORT + "\n") * lines)
        await server.complete(0, 0, args.timeout * 4)
        changes, delta = hostile_edits(args.edits, lines, len(SHORT))
        body = len(json.dumps(changes))
        r = await server.change(changes, 0, args.timeout)
        last = server.infill_calls()[-1]
        assert last["prefix"] + last["suffix"] == lines * (len(SHORT) + 1) + delta, (last, delta)
        return {"edits": len(changes), "message_bytes": body, "chars": lines * (len(SHORT) + 1), **r}
    except TimeoutError:
        return {"edits": args.edits, "timed_out": args.timeout}
    finally:
        await server.close()


async def open_files(args: argparse.Namespace) -> dict[str, Any]:
    server = await Server.start({"completion": {"openFiles": True}})
    try:
        body = "def helper_{i}(x):\n    return x + {i}\n" * 50
        for i in range(1100):
            server.open(body.format(i=i), uri=f"file:///bench/src/pkg{i % 7}/m{i}.py")
        ms, reply = await server.complete(0, 0, args.timeout, uri="file:///bench/src/pkg0/m0.py")
        calls = server.infill_calls()
        return {
            "open": 1100,
            "ok": "result" in reply,
            "error": reply.get("error", {}).get("message"),
            "extra": calls[-1]["extra"] if calls else None,
            "completion_ms": round(ms, 1),
        }
    finally:
        await server.close()


def text_alone(args: argparse.Namespace) -> dict[str, Any]:
    from kinfer_rpc.protocol.documents import apply_edits, parse_edits
    from kinfer_rpc.protocol.text import Text

    out: dict[str, Any] = {}
    for name, line_text, lines, end in [
        ("4.8mb", SHORT, 800_001, "\n"),
        ("50mb", LONG, 1_250_000, "\n"),
        ("4.8mb_crlf_emoji", "ab😀", 700_000, "\r\n"),
    ]:
        text = Text((line_text + end) * lines)
        changes, _ = hostile_edits(args.edits, lines, len(line_text.encode("utf-16-le")) // 2)
        edits = parse_edits(changes)
        t0 = time.perf_counter()
        apply_edits(text, edits)
        out[f"edits_ms_{name}"] = round((time.perf_counter() - t0) * 1000, 1)
        if name == "50mb":
            rng, worst = random.Random(2), 0.0
            for _ in range(20):
                line = rng.randrange(lines)
                t0 = time.perf_counter()
                apply_edits(text, parse_edits([edit(line, 3, line + 1, 1, "x")]))
                worst = max(worst, time.perf_counter() - t0)
            out["one_edit_50mb_ms"] = round(worst * 1000, 3)
    return {"edits": args.edits, **out}


async def main_async(args: argparse.Namespace) -> None:
    for case in args.case.split(","):
        if case == "deep-edit":
            record = await one_edit(case, 800_001, SHORT, args)
        elif case == "edit-50mb":
            record = await one_edit(case, 1_250_000, LONG, args)
        elif case == "edits-20k":
            record = await many_edits(args)
        elif case == "open-files":
            record = await open_files(args)
        elif case == "text":
            record = text_alone(args)
        else:
            raise SystemExit(f"unknown case {case!r}")
        emit(case, record)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--case", default="deep-edit,edit-50mb,edits-20k,open-files,text")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--edits", type=int, default=20_000)
    ap.add_argument("--timeout", type=float, default=120.0)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
