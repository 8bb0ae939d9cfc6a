"""Typing replayed into `kinfer-rpc` as an editor's LSP client does it: one completion per keystroke.

    python bench/lsp_replay.py --model FIM.gguf [--file bench/replay/options.py]
        [--function generate_options] [--lines 30] [--interval-ms 0] [--max-tokens 32] [--threads N] [--gpu-layers N]
        [--spm] [--cache-reuse N] [--keys N] [--llama-server PATH]

The first `--lines` lines of the function are taken out of the source file, the file is opened
with `textDocument/didOpen`, and the lines are typed back character by character: each keystroke
is one incremental `textDocument/didChange` and one `textDocument/completion` at the cursor. With
`--interval-ms 0` each completion is awaited before the next keystroke; with N > 0 keystrokes
come every N ms whatever happens, so a completion still running when the next keystroke comes is
stale (the server stops it and answers an empty list), as in an editor.

With `--spm` completions ask for infill's `spm` order (suffix first; for models trained on it),
where a keystroke changes only the prompt's end.
With `--cache-reuse N` they ask for infill's `cacheReuse` (cached chunks that moved are shifted
into place: the prefix's window moving on reads only what is new).

Runs twice: with the prefix pool (the default load) and without (load option `prefix: -1`; there
every request reads its whole prompt, so only the first `--no-pool-keys` keystrokes are typed).
Each prints one JSON line (bench/harness.py's format), with:

- `ttc_p50_ms`, `ttc_p95_ms`: time to the completion, from the request to its answer, over the
  requests that were answered (not stale);
- `read_p50`, `read_p95`, `read_mean`: prompt tokens read per answered request, `promptTokens -
  cachedTokens` of its `inference/infill` call (what the prefix pool did not have);
- `prompt_p50`: the prompt's length in tokens; `prompt_ms_p50`, `generate_ms_p50`: the infill's
  own timings; `answered`, `stale`, `keystrokes`.

With `--llama-server PATH` the same keystrokes go to llama.cpp's server instead (see
replay_llama_server): one JSON line with the same figures, from its `timings`.

The server is the real `kinfer-rpc` (a subprocess); `inference/infill` is wrapped only to write
each call's usage to a file the script reads (LSP results do not carry usage). The model needs
fill-in-the-middle tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import emit

ROOT = Path(__file__).resolve().parent.parent

# The real server, with inference/infill's usage written to KINFER_REPLAY_LOG (one JSON line a call).
SERVER = r"""
import json, os, sys, time
import anyio
from kinfer_rpc.protocol import handlers, server

LOG = os.environ["KINFER_REPLAY_LOG"]
infill = handlers.Handlers.inference_infill


def record(entry):
    with open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")


async def recorded(self, ctx, /, **p):
    t0 = time.monotonic()
    before = len(p["prefix"]) + len(p.get("middle") or "")  # the characters before the cursor
    try:
        result = await infill(self, ctx, **p)
    except anyio.get_cancelled_exc_class():
        record({"prefixChars": before, "cancelled": True, "s": time.monotonic() - t0})
        raise
    record({"prefixChars": before, "usage": result["usage"], "timings": result.get("timings"),
            "text": result["text"], "s": time.monotonic() - t0})
    return result


handlers.Handlers.inference_infill = recorded
sys.exit(server.main(sys.argv[1:]))
"""


def utf16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


class Lsp:
    """A minimal LSP client over the server's stdio: Content-Length frames, ids, futures."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.ids = 0
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        while True:
            header = await out.readuntil(b"\r\n\r\n")
            n = int(re.search(rb"Content-Length: (\d+)", header).group(1))  # type: ignore[union-attr]
            message = json.loads(await out.readexactly(n))
            fut = self.waiting.pop(message.get("id"), None) if "method" not in message else None
            if fut is not None and not fut.done():
                fut.set_result(message)

    def _send(self, message: dict[str, Any]) -> None:
        body = json.dumps({"jsonrpc": "2.0", **message}).encode()
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def request(self, method: str, params: Any) -> asyncio.Future[dict[str, Any]]:
        self.ids += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[self.ids] = fut
        self._send({"id": self.ids, "method": method, "params": params})
        return fut

    def notify(self, method: str, params: Any) -> None:
        self._send({"method": method, "params": params})


def take_function(path: Path, name: str, lines: int) -> tuple[str, str, int]:
    """The file without the function's first `lines` lines, those lines, and the line they start at."""
    source = path.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(source) if re.match(rf"\s*(async\s+)?def {re.escape(name)}\b", line))
    typed = source[start : start + lines]
    rest = source[:start] + source[start + lines :]
    return "".join(rest), "".join(typed), start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def replay(args: argparse.Namespace, load_options: dict[str, Any], case: str, keys: int | None) -> dict[str, Any]:
    log = Path(tempfile.mkdtemp(prefix="lsp-replay-")) / "infill.jsonl"
    env = {**os.environ, "KINFER_REPLAY_LOG": str(log)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SERVER,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=None,
        env=env,
        limit=1 << 24,
    )
    lsp = Lsp(proc)
    path = (ROOT / args.file).resolve()
    uri = path.as_uri()
    document, typed, line = take_function(path, args.function, args.lines)
    typed = typed[:keys] if keys else typed
    settings = {
        "model": args.model,
        "loadOptions": load_options or None,
        "maxTokens": args.max_tokens,
        "stopAtLine": True,
        "temperature": 0,
    }
    if args.spm:
        settings["spm"] = True
    if args.cache_reuse:
        settings["cacheReuse"] = args.cache_reuse
    init = await lsp.request(
        "initialize",
        {"processId": os.getpid(), "capabilities": {}, "initializationOptions": {"completion": settings}},
    )
    assert "result" in init, init
    lsp.notify("initialized", {})
    lsp.notify(
        "textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": document}}
    )

    def at(line: int, character: int) -> dict[str, Any]:
        return {"textDocument": {"uri": uri}, "position": {"line": line, "character": character}}

    # Loads the model and fills the pool with the file as opened: not counted.
    warm = await lsp.request("textDocument/completion", at(line, 0))
    assert "result" in warm, warm
    skip = len(log.read_text().splitlines()) if log.exists() else 0

    version, col = 1, 0
    offset = sum(len(s) for s in document.splitlines(keepends=True)[:line])
    sent: dict[int, float] = {}  # prefix length -> when its request went
    answered_at: dict[int, float] = {}
    pending: list[asyncio.Future[dict[str, Any]]] = []
    t_start = time.perf_counter()
    for n, ch in enumerate(typed):
        if n and n % 50 == 0:
            print(f"{case}: {n}/{len(typed)} keystrokes, {time.perf_counter() - t_start:.1f} s", file=sys.stderr)
        version += 1
        here = {"line": line, "character": col}
        lsp.notify(
            "textDocument/didChange",
            {
                "textDocument": {"uri": uri, "version": version},
                "contentChanges": [{"range": {"start": here, "end": here}, "text": ch}],
            },
        )
        offset += len(ch)
        if ch == "\n":
            line, col = line + 1, 0
        else:
            col += utf16(ch)
        key = offset
        sent[key] = time.perf_counter()
        fut = lsp.request("textDocument/completion", at(line, col))
        fut.add_done_callback(lambda f, k=key: answered_at.__setitem__(k, time.perf_counter()))
        pending.append(fut)
        if args.interval_ms > 0:
            await asyncio.sleep(args.interval_ms / 1000)
        else:
            await fut
    responses = await asyncio.gather(*pending)
    wall = time.perf_counter() - t_start
    await lsp.request("shutdown", None)
    lsp.notify("exit", None)
    await proc.wait()
    lsp.reader.cancel()
    assert all("result" in r for r in responses), [r for r in responses if "result" not in r][:1]

    calls = [json.loads(x) for x in log.read_text().splitlines()[skip:]]
    done = {c["prefixChars"]: c for c in calls if not c.get("cancelled")}
    cancelled = sum(1 for c in calls if c.get("cancelled"))
    answered = [k for k in sent if k in done]
    ttc = [(answered_at[k] - sent[k]) * 1000 for k in answered]
    read = [done[k]["usage"]["promptTokens"] - done[k]["usage"]["cachedTokens"] for k in answered]
    prompt = [done[k]["usage"]["promptTokens"] for k in answered]
    prompt_ms = [done[k]["timings"]["promptMs"] for k in answered if done[k].get("timings")]
    generate_ms = [done[k]["timings"]["generateMs"] for k in answered if done[k].get("timings")]
    return {
        "loadOptions": load_options,
        "interval_ms": args.interval_ms,
        "cacheReuse": args.cache_reuse,
        "keystrokes": len(typed),
        "answered": len(answered),
        "stale": len(typed) - len(answered),
        "cancelled_calls": cancelled,
        "ttc_p50_ms": round(pct(ttc, 0.5), 1),
        "ttc_p95_ms": round(pct(ttc, 0.95), 1),
        "read_p50": pct(read, 0.5),
        "read_p95": pct(read, 0.95),
        "read_mean": round(statistics.fmean(read), 1) if read else None,
        "prompt_p50": pct(prompt, 0.5),
        "prompt_ms_p50": round(pct(prompt_ms, 0.5), 1),
        "generate_ms_p50": round(pct(generate_ms, 0.5), 1),
        "wall_s": round(wall, 2),
        "with_text": sum(1 for k in answered if done[k]["text"].strip()),
    }


def keystrokes(args: argparse.Namespace, keys: int | None) -> tuple[str, list[tuple[str, str]]]:
    """The document as opened, and for each keystroke the text before the cursor and after it."""
    path = (ROOT / args.file).resolve()
    document, typed, line = take_function(path, args.function, args.lines)
    typed = typed[:keys] if keys else typed
    at = sum(len(s) for s in document.splitlines(keepends=True)[:line])
    return document, [(document[:at] + typed[: n + 1], document[at:]) for n in range(len(typed))]


def replay_llama_server(args: argparse.Namespace, keys: int | None) -> dict[str, Any]:
    """The same keystrokes sent to llama.cpp's server `/infill` as llama.vim sends them: the text
    before the cursor's line as `input_prefix`, that line before the cursor as `prompt`, the rest
    as `input_suffix`, `cache_prompt` on, the server started with `--cache-reuse`. Tokens read are
    its `timings.prompt_n`; the time is the request's, from send to answer."""
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model = str(Path(args.model).resolve())
    cmd = [args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "4096", "-np", "1"]
    cmd += ["-b", "2048", "-ub", "512", "-fa", "on", "--cache-reuse", "256"]
    # kinfer's KV cells: q8_0 on the CPU, f16 with every layer on a GPU
    cmd += ["-ngl", str(args.gpu_layers)] if args.gpu_layers else ["-ctk", "q8_0", "-ctv", "q8_0"]
    if args.threads:
        cmd += ["-t", str(args.threads), "-tb", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def post(body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            url + "/infill", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def body(before: str, after: str) -> dict[str, Any]:
        cut = max(before.rfind("\n"), before.rfind("\r")) + 1
        return {
            "input_prefix": before[:cut],
            "prompt": before[cut:],
            "input_suffix": after,
            "input_extra": [],
            "n_predict": args.max_tokens,
            "temperature": 0,
            "cache_prompt": True,
            "stream": False,
        }

    try:
        for _ in range(600):  # the model loads
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.5)
        document, strokes = keystrokes(args, keys)
        cut = strokes[0][0][:-1]
        post(body(cut, strokes[0][1]))  # fills the cache with the file as opened: not counted
        ttc, read, prompt_ms, predicted, cached = [], [], [], [], []
        t_start = time.perf_counter()
        for n, (before, after) in enumerate(strokes):
            if n and n % 50 == 0:
                print(f"llama-server: {n}/{len(strokes)} keystrokes", file=sys.stderr)
            t0 = time.perf_counter()
            r = post(body(before, after))
            ttc.append((time.perf_counter() - t0) * 1000)
            t = r["timings"]
            read.append(t["prompt_n"])
            prompt_ms.append(t["prompt_ms"])
            predicted.append(t["predicted_n"])
            cached.append(r.get("tokens_cached", 0))
        wall = time.perf_counter() - t_start
    finally:
        proc.terminate()
        proc.wait()
    return {
        "server": "llama-server --cache-reuse 256",
        "keystrokes": len(strokes),
        "ttc_p50_ms": round(pct(ttc, 0.5), 1),
        "ttc_p95_ms": round(pct(ttc, 0.95), 1),
        "read_p50": pct(read, 0.5),
        "read_p95": pct(read, 0.95),
        "read_mean": round(statistics.fmean(read), 1),
        "prompt_ms_p50": round(pct(prompt_ms, 0.5), 1),
        "predicted_mean": round(statistics.fmean(predicted), 1),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", required=True, help="a model with fill-in-the-middle tokens (name or GGUF path)")
    ap.add_argument(
        "--file", default="bench/replay/options.py", help="the source file typed into (a fixed copy of real code)"
    )
    ap.add_argument("--function", default="generate_options", help="the function whose lines are typed")
    ap.add_argument("--lines", type=int, default=30)
    ap.add_argument("--interval-ms", type=float, default=0.0, help="0: await each completion before the next key")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gpu-layers", type=int, default=None, help="layers on the GPU (load option gpuLayers; -ngl)")
    ap.add_argument(
        "--no-pool-keys",
        type=int,
        default=20,
        help="keystrokes typed without the pool (each reads the whole prompt; 0: all of them)",
    )
    ap.add_argument("--keys", type=int, default=0, help="type only this many keystrokes with the pool (0: all)")
    ap.add_argument("--spm", action="store_true", help="infill option spm: the suffix before the prefix")
    ap.add_argument(
        "--cache-reuse", type=int, default=0, help="infill option cacheReuse: move cached chunks that moved (0: off)"
    )
    ap.add_argument("--only", choices=("pool", "no_pool"), default=None)
    ap.add_argument(
        "--llama-server",
        default=None,
        help="a llama-server binary: replay against its /infill (llama.vim's request, --cache-reuse 256) instead",
    )
    args = ap.parse_args()
    if args.llama_server:
        emit("llama_server", replay_llama_server(args, args.keys or None))
        return
    base: dict[str, Any] = {"threads": args.threads} if args.threads else {}
    if args.gpu_layers is not None:
        base["gpuLayers"] = args.gpu_layers
    cases = [("pool", base, args.keys or None), ("no_pool", {**base, "prefix": -1}, args.no_pool_keys or None)]
    for case, options, keys in cases:
        if args.only in (None, case):
            emit(case, asyncio.run(replay(args, options, case, keys)))


if __name__ == "__main__":
    main()
