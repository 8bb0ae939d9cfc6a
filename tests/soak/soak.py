"""Soak: many concurrent streams against ONE `kinfer-rpc` for a long time.

    python tests/soak/soak.py --seconds 600 --streams 64 --out /tmp/soak.json [--model GGUF --gpu-layers N]

Each of --streams clients sends a request, waits for its response, sends the next, for --seconds.
Requests come from a pool of distinct ones (generate from text or tokens, chat; greedy and seeded
sampling; 8 to 48 tokens), so every reply of one pool entry must be the same, however crowded the
server was. Some are cancelled (after a random delay, or after their response: a no-op), and some
stream partial results. Every 10 s the server's RSS, threads, open files and model/status are
sampled, and on an NVIDIA GPU the device memory the server holds (nvidia-smi). At the end: every
id answered exactly once, replies identical per pool entry, slots and queue empty, nothing but
valid frames on stdout (tests/rpcclient.py checks every message against spec/metaModel.json).

Prints a JSON summary (also written to --out): RSS over time, tokens per second per minute, counts
of requests, results, cancels and errors, and the problems found (empty when all is well). Exit code
1 when there are problems. tests/soak/test_soak.py runs it (marked slow, not in CI).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import time

# The test helpers beside this folder (tests/rpcclient.py), when run as a script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rpcclient import DEFAULT_MODEL, RpcClient, send_together

SAMPLE_EVERY = 10.0
TEXT = (
    "Editors spawn the runtime and talk to it for hours: completions, chats, edits, cancelled "
    "the moment the user types again. Nothing may be lost, nothing may crash, memory must stay flat. "
)


def pool() -> list[tuple[str, dict]]:
    """The distinct requests: a seed each, so equal requests must give equal replies."""
    out = []
    rng = random.Random(1234)
    words = TEXT.split()
    for i in range(24):
        n = rng.choice([8, 16, 24, 32, 48])
        sampling = {"temperature": 0} if i % 3 else {"temperature": 0.8, "topK": 40, "topP": 0.95}
        options = {"maxTokens": n, "seed": i, **sampling}
        if i % 4 == 0:
            options["ignoreEos"] = True
        prompt = " ".join(words[rng.randrange(len(words)) :][: rng.randrange(1, 40)]) or "Hello"
        if i % 6 == 5:
            out.append(("inference/chat", {"messages": [{"role": "user", "content": prompt}], "options": options}))
        elif i % 6 == 4:
            out.append(
                (
                    "inference/generate",
                    {"tokens": [rng.randrange(100, 30000) for _ in range(rng.randrange(1, 30))], "options": options},
                )
            )
        else:
            out.append(("inference/generate", {"prompt": prompt, "options": options}))
    return out


def proc_sample(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                out[key] = int(value.split()[0])
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


def device_mib(pid: int) -> int | None:
    """The GPU memory `pid` holds, in MiB (nvidia-smi), or None without an NVIDIA GPU."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    return sum(int(mib) for p, mib in rows if int(p) == pid) if rows else None


def outcome(r: dict) -> tuple:
    return (r["text"], tuple(r["tokens"]), r["stopReason"], r["usage"]["promptTokens"], r["seed"])


def run(
    seconds: float,
    streams: int = 64,
    *,
    context: int = 512,
    threads: int | None = None,
    cancel_share: float = 0.1,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
    gpu_layers: int | None = None,
    log=print,
) -> dict:
    rng = random.Random(seed)
    requests = pool()
    c = RpcClient.spawn()
    problems: list[str] = []
    try:
        c.initialize()
        options = {"contextLength": context, "slots": streams, "batch": max(512, streams)}
        if threads:
            options["threads"] = threads
        if gpu_layers is not None:
            options["gpuLayers"] = gpu_layers
        loaded = c.call("model/load", {"model": model, "options": options}, timeout=120)
        pid = c.proc.pid
        t0 = time.monotonic()
        samples = [{"t": 0.0, **proc_sample(pid), "deviceMiB": device_mib(pid), "completed": 0, "tokens": 0}]
        next_sample = t0 + SAMPLE_EVERY
        sent: dict[str, int] = {}  # id -> pool index
        planned_cancel: dict[str, float] = {}  # id -> when
        after_response: set[str] = set()
        cancelled: set[str] = set()
        outstanding: set[str] = set()
        answered: collections.Counter = collections.Counter()
        replies: dict[int, tuple] = {}  # pool index -> the first reply
        completions = []  # (time since t0, completion tokens)
        errors: collections.Counter = collections.Counter()
        results = 0
        cancelled_answers = 0
        seen = 0
        counter = 0
        stopping = False
        while True:
            now = time.monotonic()
            if not stopping and now - t0 >= seconds:
                stopping = True
            if stopping and not outstanding:
                break
            batch = []
            while not stopping and len(outstanding) < streams:
                counter += 1
                rid = f"k{counter}"
                k = rng.randrange(len(requests))
                method, params = requests[k]
                params = dict(params)
                if rng.random() < 0.3:
                    params["partialResultToken"] = rid
                batch.append({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
                sent[rid] = k
                outstanding.add(rid)
                r = rng.random()
                if r < cancel_share:
                    planned_cancel[rid] = now + rng.uniform(0.0, 3.0)
                elif r < cancel_share * 1.5:
                    after_response.add(rid)
            if batch:
                send_together(c, batch)
            cancels = [rid for rid, when in planned_cancel.items() if when <= now]
            for rid in cancels:
                del planned_cancel[rid]
                cancelled.add(rid)
            with c._cond:
                if len(c.messages) == seen and not cancels:
                    c._cond.wait(0.02)
                new = c.messages[seen:]
                seen += len(new)
            for m in new:
                if "method" in m or m.get("id") not in sent:
                    rid = m.get("id")
                    if "method" not in m and not (isinstance(rid, str) and rid.startswith("t")):  # t*: call()'s
                        problems.append(f"a response to an id never sent: {json.dumps(m)[:300]}")
                    continue
                rid = m["id"]
                answered[rid] += 1
                if answered[rid] > 1:
                    problems.append(f"{rid}: a second response {json.dumps(m)[:300]}")
                    continue
                outstanding.discard(rid)
                planned_cancel.pop(rid, None)
                if rid in after_response:
                    cancels.append(rid)
                k = sent[rid]
                if "result" in m:
                    results += 1
                    res = m["result"]
                    completions.append((time.monotonic() - t0, res["usage"]["completionTokens"]))
                    first = replies.setdefault(k, outcome(res))
                    if outcome(res) != first:
                        problems.append(f"{rid} (pool {k}): {outcome(res)} differs from an earlier reply {first}")
                else:
                    code = m["error"]["code"]
                    errors[code] += 1
                    if code == -32800 and rid in cancelled:
                        cancelled_answers += 1
                        data = m["error"].get("data")
                        if data:
                            completions.append((time.monotonic() - t0, data["usage"]["completionTokens"]))
                    else:
                        problems.append(f"{rid}: unexpected error {m['error']}")
            if cancels:
                send_together(
                    c, [{"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": r}} for r in cancels]
                )
            if time.monotonic() >= next_sample:
                next_sample += SAMPLE_EVERY
                t = time.monotonic() - t0
                status = c.call("model/status", timeout=60)["models"][0]
                sample = {
                    "t": round(t, 1),
                    **proc_sample(pid),
                    "deviceMiB": device_mib(pid),
                    "completed": results + cancelled_answers,
                    "tokens": sum(n for _, n in completions),
                    "cellsUsed": status["cellsUsed"],
                    "slotsBusy": status["slotsBusy"],
                    "queueLength": status["queueLength"],
                    "tokensPerSecond": status["tokensPerSecond"],
                }
                samples.append(sample)
                log(json.dumps(sample))
            if time.monotonic() - t0 > seconds + 300:
                problems.append(f"{len(outstanding)} requests still unanswered 300 s after the end")
                break
        elapsed = time.monotonic() - t0
        time.sleep(0.5)  # a late duplicate would come now
        with c._cond:
            late = [m for m in c.messages[seen:] if "method" not in m and m.get("id") in sent]
        if late:
            problems.append(f"{len(late)} responses after every request was answered, e.g. {late[0]}")
        lost = [rid for rid in sent if answered[rid] == 0]
        if lost:
            problems.append(f"{len(lost)} requests never answered, e.g. {lost[:5]}")
        status = c.call("model/status")["models"][0]
        held = status["cellsUsed"] - status.get("cachedTokens", 0)
        if (status["slotsBusy"], status["queueLength"], held) != (0, 0, 0):
            problems.append(f"not idle at the end: {status}")
        final = {**proc_sample(pid), "deviceMiB": device_mib(pid)}
    finally:
        code = c.close(timeout=10, check=False)
    if code != 1:
        problems.append(f"exit code {code} (expected 1: stdin closed without shutdown)")
    problems += c.failures[:20]
    if "Traceback" in c.stderr_tail(1_000_000):
        problems.append("a traceback on stderr: " + c.stderr_tail(2000))

    per_minute = collections.defaultdict(int)
    for t, n in completions:
        per_minute[int(t // 60)] += n
    full_minutes = int(elapsed // 60)
    tps_minutes = [round(per_minute[m] / 60, 2) for m in range(full_minutes)]
    warm = samples[1] if len(samples) > 1 else samples[0]
    return {
        "seconds": round(elapsed, 1),
        "streams": streams,
        "model": model,
        "load": {k: loaded[k] for k in ("contextLength", "slots", "batch")}
        | ({"threads": threads} if threads else {})
        | ({"gpuLayers": gpu_layers} if gpu_layers is not None else {}),
        "requests": len(sent),
        "results": results,
        "cancelled": len(cancelled),
        "cancelledAnswered": cancelled_answers,
        "cancelAfterResponse": len(after_response),
        "errors": {str(k): v for k, v in sorted(errors.items())},
        "tokens": sum(n for _, n in completions),
        "tokensPerSecond": round(sum(n for _, n in completions) / elapsed, 2),
        "tokensPerSecondPerMinute": tps_minutes,
        "rssKiB": [(s["t"], s["VmRSS"]) for s in samples] + [(round(elapsed, 1), final["VmRSS"])],
        "rssGrowthAfterWarmupKiB": final["VmRSS"] - warm["VmRSS"],
        "peakRssKiB": final["VmHWM"],
        "deviceMiB": [(s["t"], s["deviceMiB"]) for s in samples] + [(round(elapsed, 1), final["deviceMiB"])],
        "threads": [s["Threads"] for s in samples] + [final["Threads"]],
        "fds": [s["fds"] for s in samples] + [final["fds"]],
        "samples": samples,
        "distinctReplies": len(replies),
        "problems": problems,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="contextLength of each slot")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the server's)")
    ap.add_argument("--cancel-share", type=float, default=0.1)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a model name or GGUF path (default: the embedded one)")
    ap.add_argument("--gpu-layers", type=int, default=None, help="load option gpuLayers")
    ap.add_argument("--out", default=None, help="also write the JSON summary here")
    args = ap.parse_args()
    summary = run(
        args.seconds,
        args.streams,
        context=args.context,
        threads=args.threads,
        cancel_share=args.cancel_share,
        model=args.model,
        gpu_layers=args.gpu_layers,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    text = json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
