"""Helpers of the reliability tests (tests/test_reliability_*.py) and the soak (tests/soak/): error
codes, /proc readers, request builders, and the cancel storm (a storm of requests cancelled at random
moments, and the checks of its replies). Plain functions: the fixtures are in conftest.py.
"""

from __future__ import annotations

import collections
import ctypes
import os
import random
import time

import pytest
from rpcclient import RpcClient, responses_by_id, send_together

INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
REQUEST_CANCELLED = -32800
MODEL_NOT_FOUND = -31001
CONTEXT_OVERFLOW = -31002
LOAD_FAILED = -31003
NOT_SUPPORTED = -31006

GREEDY = {"temperature": 0, "seed": 0}  # a fixed seed: results compare whole


def proc_status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def threads_and_fds(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def no_traceback(c: RpcClient) -> None:
    tail = c.stderr_tail(100_000)
    assert "Traceback" not in tail, tail


def chat(content: str, **options) -> dict:
    return {"messages": [{"role": "user", "content": content}], "options": {"maxTokens": 2, **GREEDY, **options}}


def tokens_of(c: RpcClient, text: str, **kw) -> list[int]:
    return c.call("inference/tokenize", {"text": text, **kw})["tokens"]


INT31 = 2**31 - 1
SEED_MAX = 2**53 - 1  # the largest seed (seeds stay exact in every JSON parser)

STORM_REQUESTS = int(os.environ.get("KINFER_STORM_REQUESTS", "1000"))
# batch 32: longer prompts take several passes in a crowd. threads 1: on a small machine the client, the
# server's event loop and the engine share the cores, and llama.cpp's threads wait for each other at every
# barrier: on 2 cores one thread ran this storm in 54 s, two threads in 87 s.
STORM_LOAD = {"contextLength": 256, "slots": 8, "batch": 32, "threads": 1}
LONG = "The history of computing is the story of people who wanted machines to do their sums. "


def storm_pool() -> list[tuple[str, dict]]:
    """The distinct requests of the storm: small, each method, greedy and seeded sampling."""

    def g(prompt, n, **o):
        return "inference/generate", {"prompt": prompt, "options": {"maxTokens": n, **o}}

    def t(toks, n, **o):
        return "inference/generate", {"tokens": toks, "options": {"maxTokens": n, **o}}

    def ch(text, n, **o):
        return "inference/chat", {"messages": [{"role": "user", "content": text}], "options": {"maxTokens": n, **o}}

    return [
        g("Hello", 1, **GREEDY),
        g("The capital of France is", 4, **GREEDY),
        g("1, 2, 3, 4,", 6, **GREEDY, ignoreEos=True),
        g("def add(a, b):", 5, **GREEDY),
        g("Once upon a time", 6, temperature=0.8, seed=1),
        g("Once upon a time", 6, temperature=0.8, seed=2),
        g("The weather today", 3, temperature=1.2, topK=0, topP=1.0, minP=0.0, seed=99),
        g("Roses are red,", 6, **GREEDY, stop=["\n", "."]),
        g("A B C D E F", 2, temperature=0.5, repeatPenalty=1.3, seed=7),
        g("Lorem ipsum", 1, temperature=0.8, seed=123456789012345),
        g("import numpy as", 6, **GREEDY, ignoreEos=True),
        g("Dear Sir,", 4, **GREEDY),
        g("SELECT * FROM", 3, temperature=0.3, seed=3),
        g(LONG, 3, **GREEDY),  # 18 tokens: one pass or more in a crowd
        t([1, 504, 2798], 3, **GREEDY),
        t(list(range(1000, 1012)), 5, **GREEDY, ignoreEos=True),
        t([42], 2, temperature=0.6, seed=SEED_MAX),
        ch("Hi", 4, temperature=0.9, seed=5),  # the chat template makes this 31 tokens
        t([504, 2798, 6330, 314], 4, temperature=0.9, seed=6),
        g("The end.", 6, **GREEDY, ignoreEos=True),
    ]


def outcome(r: dict) -> tuple:
    """What must be identical between a reply in the storm and the same request alone."""
    return (r["text"], tuple(r["tokens"]), r["stopReason"], r["usage"]["promptTokens"], r["seed"])


def run_storm(
    c: RpcClient, n: int, *, seed: int = 0, window: int = 32, cancel_share: float = 0.5, time_limit: float = 900.0
) -> dict:
    """`n` requests drawn from storm_pool(), at most `window` in flight; `cancel_share` of them cancelled at a
    random moment: in the same write as the request (before it starts), after a random delay (queued,
    mid-prefill or mid-decode), after its first partial result (mid-decode), or after its response (a no-op).
    Returns the plan and what happened; the caller checks."""
    rng = random.Random(seed)
    requests = storm_pool()
    plan = []
    for i in range(n):
        mode = (
            rng.choice(["immediate", "delay", "first-partial", "after-response"])
            if rng.random() < cancel_share
            else None
        )
        plan.append((f"s{i}", rng.randrange(len(requests)), mode, rng.uniform(0.0, 1.0)))
    mode_of = {rid: mode for rid, _, mode, _ in plan}
    todo = collections.deque(plan)
    outstanding: set[str] = set()
    due: dict[str, float] = {}
    partial_seen: set = set()
    cancelled: dict[str, str] = {}  # id -> the moment it was cancelled
    seen = 0
    t0 = time.monotonic()
    while todo or outstanding:
        batch = []
        while todo and len(outstanding) < window:
            rid, k, mode, delay = todo.popleft()
            method, params = requests[k]
            batch.append(
                {"jsonrpc": "2.0", "id": rid, "method": method, "params": {**params, "partialResultToken": rid}}
            )
            if mode == "immediate":
                batch.append({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": rid}})
                cancelled[rid] = "immediate"
            elif mode == "delay":
                due[rid] = time.monotonic() + delay
            outstanding.add(rid)
        if batch:
            send_together(c, batch)
        cancels = []
        now = time.monotonic()
        for rid in [r for r, when in due.items() if when <= now]:
            del due[rid]
            cancels.append(rid)
            cancelled[rid] = "delay"
        with c._cond:
            if len(c.messages) == seen and not cancels:
                c._cond.wait(0.01)
            new = c.messages[seen:]
            seen += len(new)
        for m in new:
            if m.get("method") == "$/progress":
                tok = m["params"]["token"]
                if tok not in partial_seen:
                    partial_seen.add(tok)
                    if mode_of.get(tok) == "first-partial" and tok in outstanding:
                        cancels.append(tok)
                        cancelled[tok] = "first-partial"
            elif "method" not in m and m.get("id") in outstanding:
                rid = m["id"]
                outstanding.discard(rid)
                due.pop(rid, None)
                if mode_of[rid] == "after-response":
                    cancels.append(rid)
                    cancelled[rid] = "after-response"
        if cancels:
            send_together(c, [{"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": r}} for r in cancels])
        if time.monotonic() - t0 > time_limit:
            raise AssertionError(
                f"the storm did not finish in {time_limit} s: {len(outstanding)} requests unanswered, "
                f"{len(todo)} not sent; e.g. {sorted(outstanding)[:10]}; stderr:\n{c.stderr_tail()}"
            )
    return {"plan": plan, "cancelled": cancelled, "seconds": time.monotonic() - t0, "requests": requests}


def check_storm(c: RpcClient, storm: dict, alone: list[tuple]) -> dict:
    """Every id answered exactly once; cancelled ones -32800 (or, when the cancel came too late, the reply);
    every reply identical to its run alone; partial results consistent. Returns counts for the report."""
    by_id = responses_by_id(c)
    ids = {rid for rid, *_ in storm["plan"]}
    progress = collections.defaultdict(list)
    with c._cond:
        for m in c.messages:
            if m.get("method") == "$/progress":
                progress[m["params"]["token"]].append(m["params"]["value"])
    problems = []
    assert None not in by_id, f"responses with id null: {by_id[None][:5]}"
    extra = {k for k in by_id if isinstance(k, str) and k.startswith("s")} - ids
    assert not extra, f"responses to ids never sent: {sorted(extra)[:10]}"
    counts = collections.Counter()
    for rid, k, _mode, _ in storm["plan"]:
        got = by_id.get(rid, [])
        if len(got) != 1:
            problems.append(f"{rid}: {len(got)} responses")
            continue
        r = got[0]
        when = storm["cancelled"].get(rid)
        streamed = progress.get(rid, [])
        s_tokens = [t for v in streamed for t in v["tokens"]]
        if "error" in r:
            err = r["error"]
            if err["code"] != REQUEST_CANCELLED or when is None or when == "after-response":
                problems.append(f"{rid} ({when}): {err}")
                continue
            data = err.get("data")
            phase = "before submit" if data is None else ("after tokens" if data["tokens"] else "before a token")
            counts[(when, "-32800 " + phase)] += 1
            if data is not None:
                if data["stopReason"] != "cancelled":
                    problems.append(f"{rid}: -32800 with stopReason {data['stopReason']}")
                if tuple(data["tokens"]) != alone[k][1][: len(data["tokens"])]:
                    problems.append(f"{rid}: cancelled tokens {data['tokens']} are not a prefix of {alone[k][1]}")
                if data["tokens"][: len(s_tokens)] != s_tokens:
                    problems.append(f"{rid}: streamed {s_tokens}, cancelled data {data['tokens']}")
        else:
            if when == "immediate":
                problems.append(f"{rid}: cancelled in the same write as the request, but answered {r['result']}")
            counts[(when or "not cancelled", "result")] += 1
            res = r["result"]
            if outcome(res) != alone[k]:
                problems.append(f"{rid} (request {k}): {outcome(res)} differs from its run alone {alone[k]}")
            if "".join(v["text"] for v in streamed) != res["text"] or s_tokens != res["tokens"]:
                problems.append(f"{rid}: partial results {streamed} do not add up to {res['text']!r}")
    assert not problems, f"{len(problems)} problems, e.g.:\n" + "\n".join(problems[:20])
    return counts


def replies_alone(c: RpcClient, requests) -> list[tuple]:
    return [outcome(c.call(method, params, timeout=60)) for method, params in requests]


def held_by_requests(status: dict) -> int:
    """KV cells held by running requests: cellsUsed less what a prefix pool keeps of finished ones."""
    return status["cellsUsed"] - status.get("cachedTokens", 0)


# -- a parent process that dies (tests of the server watching its client or parent) ------------

PR_SET_CHILD_SUBREAPER = 36

# The editor stand-in: starts kinfer-rpc on the pipes it is given (PARENT_PID in an argument
# becomes its own pid), prints the server's pid, waits to be killed.
PARENT = r"""
import os, subprocess, sys, time
args = [a.replace("PARENT_PID", str(os.getpid())) for a in sys.argv[3:]]
p = subprocess.Popen(args, stdin=int(sys.argv[1]), stdout=int(sys.argv[2]))
os.close(int(sys.argv[1])); os.close(int(sys.argv[2]))
print(p.pid, flush=True)
time.sleep(3600)
"""


@pytest.fixture
def subreaper():
    """Orphans are re-parented to the test process, which can then reap them and read their exit code."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) is not available")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
