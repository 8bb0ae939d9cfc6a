"""Faults on a GPU, through the real `kinfer-rpc`: what a server does when device memory runs out.

    python bench/gpu_faults.py MODEL.gguf [--out faults.json]

One server, every layer on the GPU. It loads MODEL for ordinary work and keeps a reference reply,
then tries each fault and, after each, checks that the server still answers, that the reference
request still gets the same reply, and how much device memory the server holds (nvidia-smi):

- overcommit-cells: a second model (a link to the same file: a loaded model is shared, so the
  same path with other options would be refused) asking for more KV cells than the device has
  (`--cells`, default 8M in one slot);
- overcommit-batch: the second model with a 64k-token batch (its compute buffers overflow);
- overcommit-slots: the second model with 256 slots (llama.cpp's most) sharing those cells;
- burst: 256 requests at once on a load of 8 slots of 512 cells, prompts and replies that run past
  their slot's cells, a quarter cancelled;
- huge-prompt: one prompt of 200,000 tokens on that load.

A fault passes when it is answered (a result, or an error with a code and a message), the server
keeps serving, the reference reply is unchanged, no request is left unanswered, and after the
failed load the device memory is back within 256 MiB of where it was. Prints one JSON line per
fault and a summary; exit code 1 when something failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path[:0] = [TESTS, os.path.join(TESTS, "soak")]

from rpcclient import RpcClient, RpcError, send_together  # noqa: E402
from soak import device_mib  # noqa: E402  (tests/soak/soak.py)

REFERENCE = {"prompt": "The history of computing is", "options": {"maxTokens": 32, "temperature": 0}}


def attempt(c: RpcClient, method: str, params: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        result = c.call(method, params, timeout=timeout)
        return {"answer": "result", "seconds": round(time.monotonic() - t0, 2), "result": result}
    except RpcError as e:
        return {"answer": "error", "seconds": round(time.monotonic() - t0, 2), "error": e.error}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--gpu-layers", type=int, default=999)
    ap.add_argument("--cells", type=int, default=8_000_000, help="the KV cells the overcommitting loads ask for")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gpu = {"gpuLayers": args.gpu_layers}
    problems: list[str] = []
    report: list[dict[str, Any]] = []
    c = RpcClient.spawn()
    try:
        c.initialize()
        pid = c.proc.pid
        base = c.call(
            "model/load", {"model": args.model, "options": {**gpu, "contextLength": 2048, "slots": 4}}, timeout=300
        )
        handle = args.model
        ref = c.call("inference/generate", {**REFERENCE, "model": handle}, timeout=120)
        idle_mib = device_mib(pid)
        print(
            json.dumps(
                {
                    "fault": "baseline",
                    "deviceMiB": idle_mib,
                    "load": {k: base.get(k) for k in ("memory", "reproducible")},
                }
            ),
            flush=True,
        )

        def still_serving(name: str, before: int | None) -> dict[str, Any]:
            again = attempt(c, "inference/generate", {**REFERENCE, "model": handle}, timeout=120)
            status = attempt(c, "model/status", {}, timeout=60)
            after = device_mib(pid)
            if again["answer"] != "result":
                problems.append(f"{name}: the reference request failed after it: {again}")
            elif again["result"]["tokens"] != ref["tokens"]:
                problems.append(f"{name}: the reference reply changed")
            if status["answer"] != "result":
                problems.append(f"{name}: model/status failed after it: {status}")
            if before is not None and after is not None and after - before > 256:
                problems.append(f"{name}: the server holds {after - before} MiB more device memory after it")
            return {
                "deviceMiBBefore": before,
                "deviceMiBAfter": after,
                "referenceSame": again.get("result", {}).get("tokens") == ref["tokens"],
            }

        other = os.path.join(tempfile.mkdtemp(), "other.gguf")
        try:
            os.link(args.model, other)
        except OSError:
            shutil.copy(args.model, other)
        for name, options in (
            ("overcommit-cells", {"contextLength": args.cells, "slots": 1}),
            ("overcommit-batch", {"contextLength": 65536, "slots": 1, "batch": 65536}),
            ("overcommit-slots", {"contextLength": args.cells // 256, "slots": 256}),
        ):
            before = device_mib(pid)
            got = attempt(c, "model/load", {"model": other, "options": {**gpu, **options}})
            entry: dict[str, Any] = {
                "fault": name,
                "options": options,
                "answer": got["answer"],
                "seconds": got["seconds"],
            }
            if got["answer"] == "error":
                entry["error"] = {k: got["error"].get(k) for k in ("code", "message")}
                if not isinstance(got["error"].get("code"), int) or not got["error"].get("message"):
                    problems.append(f"{name}: an error without a code or message: {got['error']}")
            else:  # it fitted after all: release it again
                entry["loaded"] = {k: got["result"].get(k) for k in ("memory", "contextLength", "slots")}
                attempt(c, "model/unload", {"model": other})
            entry.update(still_serving(name, before))
            report.append(entry)
            print(json.dumps(entry), flush=True)

        # a burst past the KV budget, on a small load of its own (the second model)
        c.call("model/load", {"model": other, "options": {**gpu, "contextLength": 512, "slots": 8}}, timeout=300)
        small_handle = other
        before = device_mib(pid)
        words = ("The history of computing is the story of people who wanted machines to do their sums. " * 40).split()
        messages = []
        for i in range(256):
            n = 40 + (i * 37) % 400  # up to ~440 words: most prompts with their replies run past 512 cells
            opts = {"maxTokens": 64 + (i * 53) % 512, "temperature": 0, "ignoreEos": True}
            messages.append(
                {
                    "jsonrpc": "2.0",
                    "id": f"b{i}",
                    "method": "inference/generate",
                    "params": {"model": small_handle, "prompt": " ".join(words[:n]), "options": opts},
                }
            )
        t0 = time.monotonic()
        send_together(c, messages)
        send_together(
            c, [{"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": f"b{i}"}} for i in range(0, 256, 4)]
        )
        outcomes: dict[str, int] = {}
        for m in messages:
            r = c.response(m["id"], timeout=600)
            key = "result:" + r["result"]["stopReason"] if "result" in r else f"error:{r['error']['code']}"
            outcomes[key] = outcomes.get(key, 0) + 1
        entry = {"fault": "burst", "requests": 256, "seconds": round(time.monotonic() - t0, 1), "outcomes": outcomes}
        status = c.call("model/status", timeout=60)
        busy = [(m.get("slotsBusy"), m.get("queueLength")) for m in status["models"]]
        if any(b != (0, 0) for b in busy):
            problems.append(f"burst: not idle after it: {busy}")
        entry.update(still_serving("burst", before))
        report.append(entry)
        print(json.dumps(entry), flush=True)

        huge = attempt(
            c,
            "inference/generate",
            {"model": small_handle, "tokens": [100 + i % 20000 for i in range(200_000)], "options": {"maxTokens": 4}},
        )
        entry = {"fault": "huge-prompt", "answer": huge["answer"], "seconds": huge["seconds"]}
        if huge["answer"] == "error":
            entry["error"] = {k: huge["error"].get(k) for k in ("code", "message")}
        entry.update(still_serving("huge-prompt", device_mib(pid)))
        report.append(entry)
        print(json.dumps(entry), flush=True)
    finally:
        code = c.close(timeout=30, check=False)
    problems += c.failures[:20]
    if "Traceback" in c.stderr_tail(1_000_000):
        problems.append("a traceback on stderr: " + c.stderr_tail(2000))
    summary = {"faults": report, "exitCode": code, "problems": problems, "stderrTail": c.stderr_tail(3000)}
    print(json.dumps({"problems": problems, "exitCode": code}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
