"""Where a round's time went, from a kinfer-rpc trace (KINFER_TRACE, kinfer_rpc/engine/trace.py):

    python bench/trace_summary.py TRACE.jsonl [T0 T1]

Only what happened between T0 and T1 (perf_counter seconds, which every process of the machine
shares) counts; without them, the whole file. Prints one JSON object:

- `requests`: time to first token (arrival at the server to the first token), the host's work
  before the engine got a request (arrival to submit: parsing, tokenizing, compiling a grammar)
  and after it ended (the end to the answer sent), p50/p95/max in ms;
- `jobs`: time queued for a slot (submit to start), the prompt (start to first token), the reply
  (first token to end), p50/p95/max in ms;
- `passes`: how many, how many held prompt chunks and how many prompt tokens; the device's time
  (launch to logits back) and the host's time between passes (one pass's logits back to the next
  one's launch; a pass started ahead counts 0), in ms in all and a pass;
- `wall_ms`: T1 - T0, to set the sums against.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _q(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    return {
        "p50": round(v[len(v) // 2] * 1000, 2),
        "p95": round(v[min(len(v) - 1, int(len(v) * 0.95))] * 1000, 2),
        "max": round(v[-1] * 1000, 2),
    }


def summarize(path: str, t0: float | None = None, t1: float | None = None) -> dict[str, Any]:
    passes: list[dict[str, Any]] = []
    jobs: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    lo = t0 if t0 is not None else float("-inf")
    hi = t1 if t1 is not None else float("inf")
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by the process's end
            kind = rec.get("kind")
            if kind == "pass" and lo <= rec["launch"] <= hi:
                passes.append(rec)
            elif kind == "job" and lo <= rec["submit"] <= hi:
                jobs.append(rec)
            elif kind == "request" and lo <= rec["received"] <= hi:
                requests.append(rec)
    passes.sort(key=lambda p: p["launch"])
    jobs.sort(key=lambda j: j["submit"])
    requests.sort(key=lambda r: r["received"])
    device = [p["done"] - p["launch"] for p in passes]
    between = [max(0.0, b["launch"] - a["done"]) for a, b in zip(passes, passes[1:])]
    out: dict[str, Any] = {"wall_ms": round((t1 - t0) * 1000, 1) if t0 is not None and t1 is not None else None}
    out["passes"] = {
        "count": len(passes),
        "with_prompt": sum(1 for p in passes if p["promptChunks"]),
        "prompt_tokens": sum(p["promptTokens"] for p in passes),
        "rows_max": max((p["rows"] for p in passes), default=0),
        "device_ms": round(sum(device) * 1000, 1),
        "device_ms_a_pass": _q(device),
        "host_between_ms": round(sum(between) * 1000, 1),
        "host_between_a_pass": _q(between),
        "first_launch_ms": round((passes[0]["launch"] - t0) * 1000, 1) if passes and t0 is not None else None,
    }
    out["jobs"] = {
        "count": len(jobs),
        "queued": _q([j["start"] - j["submit"] for j in jobs]),
        "prompt": _q([j["first"] - j["start"] for j in jobs if j["first"]]),
        "reply": _q([j["end"] - j["first"] for j in jobs if j["first"]]),
    }
    # A request's job: the one submitted when the request line says.
    by_submit = {j["submit"]: j for j in jobs}
    pairs = [(r, by_submit[r["submit"]]) for r in requests if r.get("submit") in by_submit]
    out["requests"] = {
        "count": len(requests),
        "before_engine": _q([j["submit"] - r["received"] for r, j in pairs]),
        "ttft": _q([j["first"] - r["received"] for r, j in pairs if j["first"]]),
        "after_engine": _q([r["answered"] - j["end"] for r, j in pairs]),
        "first_arrival_ms": round((requests[0]["received"] - t0) * 1000, 1) if requests and t0 is not None else None,
        "last_answer_ms": round((requests[-1]["answered"] - t0) * 1000, 1) if requests and t0 is not None else None,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="where a round's time went, from a kinfer-rpc trace")
    ap.add_argument("trace")
    ap.add_argument("t0", nargs="?", type=float)
    ap.add_argument("t1", nargs="?", type=float)
    args = ap.parse_args()
    print(json.dumps(summarize(args.trace, args.t0, args.t1), indent=1))


if __name__ == "__main__":
    main()
