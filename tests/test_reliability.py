"""Reliability and security: bad input, dying clients, cancel storms, hostile model files.

A runtime that editors spawn lives for hours and sees every kind of broken client. Each test here
drives a real `kinfer-rpc` process through tests/rpcclient.py (which checks that stdout carries
nothing but frames and that every message matches spec/metaModel.json). docs/reliability.md
describes each test and the figures measured; the long runs are in tests/soak/ (marked slow).

What test_fuzz.py and test_protocol.py already cover (framing fuzz, params fuzz, most error paths)
is not repeated: here are the boundaries they do not pin down (prompts of 0 tokens and of the
whole context through each inference method, the largest accepted and smallest refused numbers),
the cancel storm, dying clients, leaks, chat templates that attack the sandbox, model paths that
try to reach other files, and network listeners.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

import pytest
from protocol_fixtures import spawn  # noqa: F401  (fixture)
from rpcclient import DEFAULT_MODEL, KINFER_RPC, RpcClient, error_of, responses_by_id, result_of, send_together

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


# ================================================================================================
# Bad input: the boundaries the fuzzers do not pin down
# ================================================================================================


@pytest.fixture(scope="module")
def small():
    """One server with the embedded model loaded small: two slots of 256 cells."""
    c = RpcClient.spawn()
    try:
        c.initialize()
        info = c.load_model(contextLength=256, slots=2)
        c.context = info["contextLength"]
        yield c
    finally:
        c.close(timeout=5, check=False)
    c.assert_clean()
    no_traceback(c)


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """One initialized server that never loads a model, with empty model stores."""
    root = tmp_path_factory.mktemp("bare")
    env = {
        "KINFER_MODELS": str(root / "kinfer"),
        "OLLAMA_MODELS": str(root / "ollama"),
        "KINFER_HOME": str(root / "home"),
    }
    c = RpcClient.spawn(env=env)
    try:
        c.initialize()
        yield c
    finally:
        c.close(timeout=5, check=False)
    c.assert_clean()
    no_traceback(c)


def chat(content: str, **options) -> dict:
    return {"messages": [{"role": "user", "content": content}], "options": {"maxTokens": 2, **GREEDY, **options}}


def tokens_of(c: RpcClient, text: str, **kw) -> list[int]:
    return c.call("inference/tokenize", {"text": text, **kw})["tokens"]


def test_zero_token_prompts_are_32602_through_every_inference_method(small):
    c = small
    assert c.call("inference/tokenize", {"text": ""}) == {"tokens": [], "pieces": []}
    for params in (
        {"prompt": ""},
        {"prompt": "", "addSpecial": False},
        {"tokens": []},
        {"tokens": [], "addSpecial": True},
    ):
        err = error_of(c.request("inference/generate", {**params, "options": {"maxTokens": 2}}))
        assert err["code"] == INVALID_PARAMS, (params, err)
    assert (
        error_of(c.request("inference/chat", {"messages": [], "options": {"maxTokens": 2}}))["code"] == INVALID_PARAMS
    )
    # A chat whose messages are all empty still has the template's tokens: it is answered.
    r = result_of(c.request("inference/chat", chat("")))
    assert r["usage"]["promptTokens"] > 0
    # The server goes on serving.
    assert result_of(c.request("inference/generate", {"prompt": "Hi", "options": {"maxTokens": 2}}))


def test_prompts_of_the_whole_context_are_31002_through_every_inference_method(small):
    c = small
    ctx = c.context
    # tokens: ctx - 1 fits (one cell left for the reply), ctx does not
    fits = [504] * (ctx - 1)
    r = result_of(c.request("inference/generate", {"tokens": fits, "options": {"maxTokens": 5, **GREEDY}}))
    assert r["usage"]["promptTokens"] == ctx - 1
    assert len(r["tokens"]) == 1 and r["stopReason"] in ("length", "stop")  # the slot is full after one
    for n in (ctx, ctx + 1, 10 * ctx):
        err = error_of(c.request("inference/generate", {"tokens": [504] * n, "options": {"maxTokens": 2}}))
        assert err["code"] == CONTEXT_OVERFLOW and err["data"] == {"promptTokens": n, "contextLength": ctx}, err
    # prompt text
    text = "hello " * (ctx + 10)
    n = len(tokens_of(c, text))
    assert n >= ctx
    err = error_of(c.request("inference/generate", {"prompt": text, "options": {"maxTokens": 2}}))
    assert err["code"] == CONTEXT_OVERFLOW and err["data"] == {"promptTokens": n, "contextLength": ctx}
    # chat: the rendered template counts
    err = error_of(c.request("inference/chat", chat("hello " * ctx)))
    assert err["code"] == CONTEXT_OVERFLOW
    assert err["data"]["contextLength"] == ctx and err["data"]["promptTokens"] > ctx
    # a chat a little under the context is answered
    r = result_of(c.request("inference/chat", chat("hello " * (ctx // 2))))
    assert ctx // 2 < r["usage"]["promptTokens"] < ctx


def test_a_huge_prompt_is_refused_quickly_and_the_server_goes_on(small):
    c = small
    t = time.monotonic()
    err = error_of(
        c.request("inference/generate", {"prompt": "lorem ipsum " * 200_000, "options": {"maxTokens": 1}}, timeout=60)
    )  # 2.4 MB of text, ~400k tokens
    assert err["code"] == CONTEXT_OVERFLOW and err["data"]["promptTokens"] > 100_000
    err = error_of(
        c.request("inference/generate", {"tokens": [504] * 300_000, "options": {"maxTokens": 1}}, timeout=60)
    )
    assert err["code"] == CONTEXT_OVERFLOW and err["data"]["promptTokens"] == 300_000
    err = error_of(c.request("inference/chat", chat("lorem ipsum " * 100_000), timeout=60))
    assert err["code"] == CONTEXT_OVERFLOW
    assert time.monotonic() - t < 30
    assert result_of(c.request("inference/generate", {"prompt": "Hi", "options": {"maxTokens": 2}}))


INT31 = 2**31 - 1
INT63 = 2**63 - 1


@pytest.mark.parametrize("method", ["inference/generate", "inference/chat"])
@pytest.mark.parametrize(
    "option, value",
    [
        ("maxTokens", -1),
        ("maxTokens", -(2**63)),
        ("maxTokens", INT31 + 1),
        ("maxTokens", 10**30),
        ("maxTokens", 1e300),
        ("temperature", -0.0001),
        ("temperature", 100.0001),
        ("temperature", 1e308),
        ("temperature", -1e308),
        ("topK", -1),
        ("topK", INT31 + 1),
        ("topK", 10**100),
        ("topP", -1e-9),
        ("topP", 1.0000001),
        ("minP", 1e30),
        ("repeatPenalty", -1),
        ("repeatPenalty", 1e300),
        ("repeatLastN", -2),
        ("repeatLastN", INT31 + 1),
        ("seed", -1),
        ("seed", INT63 + 1),
        ("seed", 2**64),
        ("seed", 10**40),
        ("drafts", -1),
        ("drafts", 65),
        ("drafts", 2**70),
    ],
)
def test_out_of_range_numbers_are_32602_naming_the_field(small, method, option, value):
    base = {"prompt": "Hi"} if method == "inference/generate" else {"messages": [{"role": "user", "content": "Hi"}]}
    err = error_of(small.request(method, {**base, "options": {"maxTokens": 2, option: value}}))
    assert err["code"] == INVALID_PARAMS, err
    assert err["data"] == {"field": f"options.{option}"}, err


@pytest.mark.parametrize(
    "options",
    [
        {"maxTokens": INT31, "stop": "."},  # the largest maxTokens: ends at the slot's end or a stop
        {"seed": INT63, "temperature": 0.7},
        {"seed": 0, "temperature": 100},
        {"topK": INT31, "temperature": 0.5, "seed": 1},
        {"repeatLastN": INT31, "repeatPenalty": 100, "seed": 2},
        {"repeatLastN": -1, "repeatPenalty": 0.01, "seed": 3},
        {"topP": 0, "minP": 1, "temperature": 1, "seed": 4},
        {"temperature": 1e-300, "seed": 5},
    ],
)
def test_extreme_but_valid_numbers_are_served(small, options):
    c = small
    prompt = [504] * (c.context - 40)  # the slot holds 40 more tokens, so maxTokens 2^31-1 ends soon
    r = result_of(
        c.request("inference/generate", {"tokens": prompt, "options": {"maxTokens": 6, **options}}, timeout=60)
    )
    assert r["usage"]["completionTokens"] == len(r["tokens"]) <= 40
    if "seed" in options:
        assert r["seed"] == options["seed"]
    # ... and the model still serves the next request
    assert result_of(c.request("inference/generate", {"prompt": "Hi", "options": {"maxTokens": 2, **GREEDY}}))


@pytest.mark.parametrize(
    "options, field",
    [
        ({"contextLength": 15}, "options.contextLength"),
        ({"contextLength": 2**24 + 1}, "options.contextLength"),
        ({"contextLength": 2**64}, "options.contextLength"),
        ({"slots": 1025}, "options.slots"),
        ({"batch": 2**20 + 1}, "options.batch"),
        ({"ubatch": 0}, "options.ubatch"),
        ({"threads": 0}, "options.threads"),
        ({"threads": 10**9}, "options.threads"),
        ({"gpuLayers": -2}, "options.gpuLayers"),
        ({"maxQueue": 0}, "options.maxQueue"),
        ({"drafts": 65}, "options.drafts"),
    ],
)
def test_out_of_range_load_options_are_32602(bare, options, field):
    # The model is not loaded, so the options are really checked (and nothing is allocated).
    err = error_of(bare.request("model/load", {"model": DEFAULT_MODEL, "options": options}))
    assert err["code"] == INVALID_PARAMS and err["data"] == {"field": field}, err
    assert bare.call("model/status") == {"models": []}


@pytest.mark.parametrize("ids", [[-1], [2**31], [2**63], [10**30], [0, 504, -5]])
def test_token_ids_outside_the_vocabulary_are_32602(small, ids):
    err = error_of(small.request("inference/generate", {"tokens": ids, "options": {"maxTokens": 1}}))
    assert err["code"] == INVALID_PARAMS


# ================================================================================================
# Cancel storm
# ================================================================================================

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
        t([42], 2, temperature=0.6, seed=INT63),
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


def test_cancel_storm(spawn):
    ref = spawn()  # each distinct request alone, one at a time, on a server of its own
    c = spawn()
    for server in (ref, c):
        server.initialize()
        server.call("model/load", {"model": DEFAULT_MODEL, "options": STORM_LOAD}, timeout=60)
    requests = storm_pool()
    alone = replies_alone(ref, requests)
    ref.close()
    storm = run_storm(c, STORM_REQUESTS)
    counts = check_storm(c, storm, alone)
    time.sleep(0.5)  # a second response to a cancelled-after-finish request would come now
    assert (
        sum(len(v) for k, v in responses_by_id(c).items() if isinstance(k, str) and k.startswith("s")) == STORM_REQUESTS
    )
    status = c.call("model/status")["models"][0]
    assert (status["slotsBusy"], status["queueLength"], held_by_requests(status)) == (0, 0, 0), status
    # The slots still give every reply exactly: all distinct requests at once, then each alone again.
    rids = [c.request_async(m, p) for m, p in requests]
    assert [outcome(result_of(c.response(r, timeout=120))) for r in rids] == alone
    summary = {
        "requests": STORM_REQUESTS,
        "seconds": round(storm["seconds"], 1),
        "outcomes": {f"{a}: {b}": v for (a, b), v in sorted(counts.items())},
        "status": status,
    }
    print("cancel storm:", json.dumps(summary))
    c.assert_clean()
    no_traceback(c)


def test_cancel_before_start_mid_prefill_mid_decode_and_after_finish_frees_everything(spawn):
    """Each moment of a cancel, made certain by watching model/status: one slot, prompts that take many passes."""
    load = {"contextLength": 512, "slots": 1, "batch": 4}
    ref, c = spawn(), spawn()
    for server in (ref, c):
        server.initialize()
        server.call("model/load", {"model": DEFAULT_MODEL, "options": load}, timeout=60)
    text = tokens_of(c, LONG * 20, addSpecial=False)
    prompt = text[:300]  # 75 passes of 4 tokens
    req = {"tokens": prompt, "options": {"maxTokens": 4, **GREEDY}}
    alone = outcome(result_of(ref.request("inference/generate", req, timeout=120)))
    ref.close()

    def status():
        return c.call("model/status")["models"][0]

    def wait_until(pred, what, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            s = status()
            if pred(s):
                return s
            assert time.monotonic() < deadline, f"never {what}: {s}"
            time.sleep(0.01)

    # mid-prefill: some but not all of the prompt's cells are in
    a = c.request_async("inference/generate", req)
    wait_until(lambda s: s["slotsBusy"] == 1 and 0 < held_by_requests(s) < len(prompt) // 2, "mid-prefill")
    # before start: b waits for the only slot
    b = c.request_async("inference/generate", {"prompt": "Hi", "options": {"maxTokens": 3, **GREEDY}})
    wait_until(lambda s: s["queueLength"] == 1, "b queued")
    c.cancel(b)
    err_b = error_of(c.response(b, timeout=10))
    assert (
        err_b["code"] == REQUEST_CANCELLED
        and err_b["data"]["tokens"] == []
        and err_b["data"]["stopReason"] == "cancelled"
    )
    # the engine drops a cancelled job from its queue at its next pass (a few ms later)
    wait_until(lambda s: s["queueLength"] == 0, "b dropped from the queue", timeout=2)
    assert status()["slotsBusy"] == 1  # a is still prefilling
    c.cancel(a)
    err_a = error_of(c.response(a, timeout=10))
    assert err_a["code"] == REQUEST_CANCELLED and err_a["data"]["tokens"] == [], err_a
    assert err_a["data"]["usage"]["promptTokens"] == len(prompt)
    s = wait_until(lambda s: s["slotsBusy"] == 0, "the slot freed", timeout=2)
    assert (s["queueLength"], held_by_requests(s)) == (0, 0), s
    # mid-decode: a long reply, cancelled after some tokens
    d = c.request_async(
        "inference/generate",
        {"prompt": "Once", "partialResultToken": "d", "options": {"maxTokens": 400, "ignoreEos": True, **GREEDY}},
    )
    c.wait_for(lambda m: len(c.progress("d")) >= 2, timeout=60)
    c.cancel(d)
    err_d = error_of(c.response(d, timeout=10))
    assert err_d["code"] == REQUEST_CANCELLED and 2 <= len(err_d["data"]["tokens"]) < 400
    # the prompt whose prefill was cancelled, in full now: the same reply as on a fresh server
    e = c.request_async("inference/generate", req)
    assert outcome(result_of(c.response(e, timeout=120))) == alone
    # after finish: nothing happens, no second response
    c.cancel(e)
    time.sleep(0.3)
    for rid in (a, b, d, e):
        assert len(responses_by_id(c)[rid]) == 1
    s = status()
    assert (s["slotsBusy"], s["queueLength"], held_by_requests(s)) == (0, 0, 0), s
    c.assert_clean()
    no_traceback(c)


def test_load_generate_cancel_unload_cycles_leak_no_threads_or_files(spawn):
    c = spawn()
    c.initialize()
    pid = c.proc.pid
    after_unload = []
    for cycle in range(6):
        c.load_model(slots=2)
        a = c.request_async(
            "inference/generate",
            {"prompt": "Once", "partialResultToken": f"p{cycle}", "options": {"maxTokens": 200, "ignoreEos": True}},
        )
        b = c.request_async("inference/generate", {"prompt": "Hi", "options": {"maxTokens": 3, **GREEDY}})
        c.wait_for(lambda m, t=f"p{cycle}": m.get("method") == "$/progress" and m["params"]["token"] == t, timeout=30)
        c.cancel(a)
        assert error_of(c.response(a))["code"] == REQUEST_CANCELLED
        result_of(c.response(b, timeout=30))
        # unload while a request runs: it answers -32603, the worker thread ends
        z = c.request_async(
            "inference/generate",
            {"prompt": "Once", "partialResultToken": f"z{cycle}", "options": {"maxTokens": 200, "ignoreEos": True}},
        )
        c.wait_for(lambda m, t=f"z{cycle}": m.get("method") == "$/progress" and m["params"]["token"] == t, timeout=30)
        assert c.call("model/unload", {"model": DEFAULT_MODEL}) is None
        assert error_of(c.response(z, timeout=10))["code"] == INTERNAL_ERROR
        time.sleep(0.2)
        after_unload.append((*threads_and_fds(pid), proc_status(pid, "VmRSS")))
    print("threads, fds, RSS KiB after each unload:", after_unload)
    threads = [t for t, _, _ in after_unload]
    fds = [f for _, f, _ in after_unload]
    # anyio keeps a few idle worker threads; a leaked engine thread per cycle would add 5 by the end
    assert max(threads) <= threads[0] + 2, after_unload
    assert fds == [fds[0]] * len(fds), after_unload
    rss = [r for _, _, r in after_unload]
    assert rss[-1] - rss[1] < 32 * 1024, after_unload  # under 32 MiB over 4 cycles after the first
    no_traceback(c)


# ================================================================================================
# Dying clients
# ================================================================================================


def _isolated_env(tmp_path) -> tuple[dict, str, str]:
    tmp = tmp_path / "server-tmp"
    home = tmp_path / "kinfer-home"
    tmp.mkdir()
    home.mkdir()
    return {"TMPDIR": str(tmp), "KINFER_HOME": str(home)}, str(tmp), str(home)


def _start_long_generations(c: RpcClient, n: int, slots: int) -> list:
    c.call("model/load", {"model": DEFAULT_MODEL, "options": {"contextLength": 2048, "slots": slots}}, timeout=60)
    rids = [
        c.request_async(
            "inference/generate",
            {
                "prompt": f"Story {i}:",
                "partialResultToken": f"long{i}",
                "options": {"maxTokens": 2000, "ignoreEos": True},
            },
        )
        for i in range(n)
    ]
    for i in range(min(n, slots)):
        c.wait_for(lambda m, t=f"long{i}": m.get("method") == "$/progress" and m["params"]["token"] == t, timeout=60)
    return rids


def _deleted_or_tmp_files(pid: int, tmp: str) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(tmp):
            out.append(target)
    return out


def test_stdin_closed_mid_generation_exits_within_2_seconds_leaving_nothing(spawn, tmp_path):
    env, tmp, home = _isolated_env(tmp_path)
    c = spawn(env=env)
    c.initialize()
    rids = _start_long_generations(c, 6, slots=4)  # 4 decoding, 2 queued
    pid = c.proc.pid
    assert children_of(pid) == []
    assert _deleted_or_tmp_files(pid, tmp) == []
    threads, _ = threads_and_fds(pid)
    t = time.monotonic()
    code = c.close(timeout=10)
    elapsed = time.monotonic() - t
    print(f"stdin closed with 4 decoding + 2 queued ({threads} threads): exit {code} after {elapsed:.3f} s")
    assert code == 1
    assert elapsed < 2.0
    assert not os.path.exists(f"/proc/{pid}")  # reaped: no zombie
    assert os.listdir(tmp) == [] and os.listdir(home) == []
    # nothing is answered twice; what is answered before the exit is a whole frame (assert_clean)
    for rid in rids:
        assert len(responses_by_id(c).get(rid, [])) <= 1
    c.assert_clean()
    no_traceback(c)


def test_exit_notification_mid_generation_exits_promptly(spawn, tmp_path):
    env, tmp, home = _isolated_env(tmp_path)
    c = spawn(env=env)
    c.initialize()
    _start_long_generations(c, 3, slots=2)
    t = time.monotonic()
    c.notify("exit")
    code = c.wait_exit(10)
    elapsed = time.monotonic() - t
    print(f"exit notification with 2 decoding + 1 queued: exit {code} after {elapsed:.3f} s")
    assert code == 1 and elapsed < 2.0
    assert os.listdir(tmp) == [] and os.listdir(home) == []


def test_stdout_closed_mid_generation_exits_promptly(tmp_path):
    """A client that stops reading (closes its end of the server's stdout) while tokens stream: the next
    write fails (EPIPE) and the server exits instead of generating for nobody."""
    env, tmp, home = _isolated_env(tmp_path)
    stderr_file = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [KINFER_RPC],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr_file,
        env={**os.environ, **env},
        bufsize=0,
    )
    try:

        def send(message):
            body = json.dumps(message).encode()
            proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

        send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"processId": None}})
        send(
            {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "model/load",
                "params": {"model": DEFAULT_MODEL, "options": {"contextLength": 2048, "slots": 2}},
            }
        )
        for i in range(3):
            send(
                {
                    "jsonrpc": "2.0",
                    "id": 10 + i,
                    "method": "inference/generate",
                    "params": {
                        "prompt": "Story:",
                        "partialResultToken": i,
                        "options": {"maxTokens": 2000, "ignoreEos": True},
                    },
                }
            )
        seen = b""
        deadline = time.monotonic() + 60
        while seen.count(b'"$/progress"') < 4:  # the generations are streaming
            assert time.monotonic() < deadline, seen[-2000:]
            seen += os.read(proc.stdout.fileno(), 65536)
        t = time.monotonic()
        proc.stdout.close()
        code = proc.wait(10)
        elapsed = time.monotonic() - t
        print(f"stdout closed with 2 decoding + 1 queued: exit {code} after {elapsed:.3f} s")
        assert code == 1 and elapsed < 2.0
        assert os.listdir(tmp) == [] and os.listdir(home) == []
        stderr_file.seek(0)
        err = stderr_file.read().decode("utf-8", "replace")
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


class Adopted:
    """A Popen-like handle on a process that is not our child until its parent dies: we are its subreaper."""

    def __init__(self, pid: int, stdin_fd: int, stdout_fd: int):
        self.pid = pid
        self.stdin = os.fdopen(stdin_fd, "wb", buffering=0)
        self.stdout = os.fdopen(stdout_fd, "rb", buffering=0)
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not adopted yet
                return None
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.005)
        return self.returncode

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


PR_SET_CHILD_SUBREAPER = 36

# The editor stand-in: starts kinfer-rpc on the pipes it is given, prints the server's pid, waits to be killed.
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
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) is not available")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


@pytest.mark.parametrize("how", ["processId", "--clientProcessId"])
def test_parent_death_exits_within_3_seconds(subreaper, tmp_path, how):
    """The editor dies but the server's stdin stays open (someone else holds the pipe): only the
    process watch can notice. The server must exit within about a second and a half (it checks once a
    second), with code 1, leaving nothing behind."""
    env, tmp, home = _isolated_env(tmp_path)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    stderr_file = tempfile.TemporaryFile()
    extra = ["--clientProcessId", "PARENT_PID"] if how == "--clientProcessId" else []
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(in_r), str(out_w), KINFER_RPC, *extra],
        pass_fds=(in_r, out_w),
        stdout=subprocess.PIPE,
        stderr=stderr_file,
        env={**os.environ, **env},
    )
    os.close(in_r)
    os.close(out_w)
    server_pid = int(parent.stdout.readline())
    proc = Adopted(server_pid, in_w, out_r)
    c = RpcClient(proc, stderr_file, time.monotonic())
    try:
        c.initialize({"processId": parent.pid} if how == "processId" else None)
        _start_long_generations(c, 3, slots=2)
        parent.kill()
        parent.wait()
        t = time.monotonic()
        code = proc.wait(10)
        elapsed = time.monotonic() - t
        print(f"parent killed ({how}) with 2 decoding + 1 queued: exit {code} after {elapsed:.3f} s")
        assert code == 1
        assert elapsed < 3.0
        assert not os.path.exists(f"/proc/{server_pid}")
        assert os.listdir(tmp) == [] and os.listdir(home) == []
        c._reader.join(5)
        assert c.eof  # its stdout closed with it
        c.assert_clean()
        no_traceback(c)
    finally:
        proc.kill()
        parent.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        proc.stdin.close()


# ================================================================================================
# Security: hostile chat templates, model paths, network listeners
# ================================================================================================

_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _skip_gguf_value(f, vtype: int) -> None:
    if vtype in _GGUF_SCALARS:
        f.seek(_GGUF_SCALARS[vtype], 1)
    elif vtype == _GGUF_STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif vtype == _GGUF_ARRAY:
        etype, n = struct.unpack("<IQ", f.read(12))
        if etype in _GGUF_SCALARS:
            f.seek(n * _GGUF_SCALARS[etype], 1)
        else:
            for _ in range(n):
                _skip_gguf_value(f, etype)
    else:
        raise ValueError(f"GGUF value type {vtype}")


def gguf_with_string(src: str, dst: str, key: str, value: str) -> None:
    """Copy the GGUF v3 file `src` to `dst` with the string key `key` set to `value`.

    GGUF v3: magic, version u32, tensor count u64, KV count u64, the KVs (key: u64 length + bytes,
    type u32, value), the tensor infos, padding to general.alignment (default 32), the tensor data.
    Tensor offsets are relative to the data's start, so only the header changes (and its padding)."""
    with open(src, "rb") as f:
        magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
        assert magic == b"GGUF" and version == 3, (magic, version)
        kvs, alignment = [], 32
        for _ in range(n_kv):
            (klen,) = struct.unpack("<Q", f.read(8))
            k = f.read(klen)
            (vtype,) = struct.unpack("<I", f.read(4))
            start = f.tell()
            _skip_gguf_value(f, vtype)
            end = f.tell()
            f.seek(start)
            raw = f.read(end - start)
            if k == b"general.alignment":
                (alignment,) = struct.unpack("<I", raw)
            kvs.append((k, vtype, raw))
        infos_start = f.tell()
        for _ in range(n_tensors):
            (nlen,) = struct.unpack("<Q", f.read(8))
            f.seek(nlen, 1)
            (ndim,) = struct.unpack("<I", f.read(4))
            f.seek(8 * ndim + 4 + 8, 1)
        infos_end = f.tell()
        f.seek(infos_start)
        infos = f.read(infos_end - infos_start)
        data_start = -(-infos_end // alignment) * alignment
        kb, vb = key.encode(), value.encode()
        new = [(k, t, r) for k, t, r in kvs if k != kb] + [(kb, _GGUF_STRING, struct.pack("<Q", len(vb)) + vb)]
        head = struct.pack("<4sIQQ", b"GGUF", 3, n_tensors, len(new))
        head += b"".join(struct.pack("<Q", len(k)) + k + struct.pack("<I", t) + r for k, t, r in new) + infos
        head += b"\0" * (-len(head) % alignment)
        with open(dst, "wb") as out:
            out.write(head)
            f.seek(data_start)
            shutil.copyfileobj(f, out, 1 << 22)


def embedded_gguf() -> str:
    from kinfer_rpc.host.store import embedded_default_path

    return embedded_default_path()


# Each probe is one branch of ONE hostile template (chosen by the last message's content), followed by
# the same plain ChatML turn: a probe that renders harmlessly adds nothing to the prompt.
TAIL = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
MARKER = "MARKER_PATH"
PROBES = {
    # reach Python internals
    "mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals-os": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "lipsum": "{{ lipsum.__globals__['os'].system('touch MARKER_PATH') }}",
    "joiner": "{{ joiner.__init__.__globals__.os.system('touch MARKER_PATH') }}",
    "namespace": "{{ namespace.__init__.__globals__['__builtins__']['open']('MARKER_PATH', 'w') }}",
    "self-builtins": "{{ self.__init__.__globals__.__builtins__.open('MARKER_PATH', 'w').write('x') }}",
    "raise-globals": "{{ raise_exception.__globals__['jinja2'] }}",
    "strftime-globals": "{{ strftime_now.__globals__['datetime'].datetime }}",
    "format": "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "format-globals": "{{ '{0.__init__.__globals__}'.format(cycler) }}",
    "mutate-list": "{{ messages.append({'role': 'system', 'content': 'pwned'}) }}",
    "mutate-dict": "{% set x = messages[0].update({'content': 'pwned'}) %}",
    "loop-class": "{% for m in messages %}{{ loop.__class__.__init__.__globals__ }}{% endfor %}",
    # render to nothing: the sandbox turns unsafe attributes into undefined values
    "template-context": "{{ self._TemplateReference__context }}",
    "attr-filter": "{{ (messages|attr('__class__')) }}",
    "gi-frame": "{{ (messages|map('string')).gi_frame }}",
    "item-class": "{{ ''['__class__'] }}",
    # the file system: there is no loader, nothing can be read
    "include": "{% include '/etc/passwd' %}",
    "import": "{% import '/etc/passwd' as p %}{{ p }}",
    "extends": "{% extends '/etc/passwd' %}",
    "from-import": "{% from '/etc/passwd' import root %}{{ root }}",
    # resource limits the sandbox has
    "huge-range": "{% for i in range(10**9) %}{% endfor %}",
    "huge-string": "{{ 'a' * 4611686018427387904 }}",  # 2^62 bytes: no allocator gives that, whatever overcommit
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
}
BLOCKED = [
    "mro",
    "globals-os",
    "lipsum",
    "joiner",
    "namespace",
    "self-builtins",
    "raise-globals",
    "strftime-globals",
    "format",
    "format-globals",
    "mutate-list",
    "mutate-dict",
    "loop-class",
]
HARMLESS = ["template-context", "attr-filter", "gi-frame", "item-class"]
_BUG_TEMPLATE_ERRORS = (
    "bug: chat.py render() catches only jinja2.TemplateError and SecurityError; a template that fails with "
    "another exception ({}) is answered -32603 Internal error, where the spec says -32602 (the chat template "
    "fails on the messages). Reproduce: a GGUF whose tokenizer.chat_template is {!r}, then inference/chat"
)
FAILING = {  # probe -> the exception it raises inside render()
    "include": "TypeError: no loader for this environment specified",
    "import": "TypeError: no loader for this environment specified",
    "extends": "TypeError: no loader for this environment specified",
    "from-import": "TypeError: no loader for this environment specified",
    "huge-range": "OverflowError: Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000)",
    "huge-string": "MemoryError",
    "recursion": "RecursionError: maximum recursion depth exceeded",
}


def hostile_template(marker: str, probes: dict = PROBES) -> str:
    out = ""
    for i, (name, src) in enumerate(probes.items()):
        keyword = "if" if i == 0 else "elif"
        out += f"{{% {keyword} messages[-1]['content'] == '{name}' %}}{src.replace(MARKER, marker)}"
    return out + "{% endif %}{{ '" + TAIL.replace("\n", "\\n") + "' }}"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A server and a copy of the embedded model whose chat template is hostile."""
    folder = tmp_path_factory.mktemp("hostile")
    marker = str(folder / "pwned")
    path = str(folder / "hostile.gguf")
    gguf_with_string(embedded_gguf(), path, "tokenizer.chat_template", hostile_template(marker))
    c = RpcClient.spawn(env={"TMPDIR": str(folder)})
    try:
        c.initialize()
        info = c.call("model/load", {"model": path, "options": {"contextLength": 256, "slots": 1}}, timeout=60)
        assert info["source"] == "path" and info["model"] == path
        c.path, c.marker = path, marker
        baseline = c.call("inference/chat", _probe_params(path, "benign"))
        c.baseline_tokens = baseline["usage"]["promptTokens"]
        yield c
    finally:
        c.close(timeout=5, check=False)
    c.assert_clean()
    assert not os.path.exists(marker)


def _probe_params(path: str, probe: str) -> dict:
    return {"model": path, "messages": [{"role": "user", "content": probe}], "options": {"maxTokens": 1, **GREEDY}}


def _assert_nothing_leaked(c: RpcClient, response: dict) -> None:
    text = json.dumps(response)
    for secret in ("root:x:", "uid=", "/bin/bash", "<module", "<class", "__builtins__"):
        assert secret not in text, response
    assert not os.path.exists(c.marker), "the template wrote a file"
    assert c.proc.poll() is None, "the server died"


@pytest.mark.parametrize("probe", BLOCKED)
def test_hostile_chat_template_is_refused_by_the_sandbox_with_31006(hostile, probe):
    c = hostile
    r = c.request("inference/chat", _probe_params(c.path, probe), timeout=30)
    _assert_nothing_leaked(c, r)
    err = error_of(r)
    assert err["code"] == NOT_SUPPORTED, err
    assert "unsafe" in err["message"]
    assert result_of(c.request("inference/chat", _probe_params(c.path, "benign")))  # it keeps serving


@pytest.mark.parametrize("probe", HARMLESS)
def test_hostile_chat_template_renders_harmlessly(hostile, probe):
    c = hostile
    r = c.request("inference/chat", _probe_params(c.path, probe), timeout=30)
    _assert_nothing_leaked(c, r)
    # the probe rendered to nothing: the prompt is the plain turn's
    assert result_of(r)["usage"]["promptTokens"] == c.baseline_tokens


@pytest.mark.parametrize("probe", list(FAILING))
def test_hostile_chat_template_that_fails_is_32602_and_reads_nothing(hostile, probe):
    c = hostile
    r = c.request("inference/chat", _probe_params(c.path, probe), timeout=30)
    _assert_nothing_leaked(c, r)
    assert result_of(c.request("inference/chat", _probe_params(c.path, "benign")))  # it keeps serving
    assert error_of(r)["code"] in (INVALID_PARAMS, NOT_SUPPORTED), r


def test_a_template_that_loops_forever_does_not_stop_the_server(spawn, tmp_path):
    path = str(tmp_path / "slow.gguf")
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    gguf_with_string(embedded_gguf(), path, "tokenizer.chat_template", hostile_template("", {"loop": loop}))
    c = spawn()
    c.initialize()
    c.call("model/load", {"model": path, "options": {"contextLength": 256, "slots": 1}}, timeout=60)
    rid = c.request_async("inference/chat", _probe_params(path, "loop"))
    time.sleep(0.2)
    try:
        assert "result" in c.request("model/status", timeout=3)
        c.cancel(rid)
        # Cancelled, or refused first by the sandbox's loop budget (10^6 range items a render).
        assert error_of(c.response(rid, timeout=5))["code"] in (REQUEST_CANCELLED, NOT_SUPPORTED)
    finally:
        c.kill()


@pytest.fixture
def store(tmp_path):
    """Empty stores: KINFER_MODELS and OLLAMA_MODELS in a temporary folder."""
    kinfer = tmp_path / "kinfer-models"
    ollama = tmp_path / "ollama-models"
    kinfer.mkdir()
    ollama.mkdir()
    return {"KINFER_MODELS": str(kinfer), "OLLAMA_MODELS": str(ollama), "KINFER_HOME": str(tmp_path / "home")}


@pytest.mark.parametrize(
    "name",
    [
        "../../etc/passwd",
        "../../../../../../etc/passwd",
        "/etc/passwd",
        "/etc/shadow",
        "~/../../etc/passwd",
        "/proc/self/environ",
        "/proc/self/mem",
        "/dev/zero",
        "/dev/urandom",
        "/etc",
        "/",
        "./",
        "../",
        "/etc/passwd.gguf",
        "x\u0000.gguf",
        "/etc/passwd\u0000.gguf",
        "smollm2-135m-instruct/../../../etc/passwd",
        "etc/passwd",
        "..",
        "...",
        "%2e%2e/%2e%2e/etc/passwd",
        "file:///etc/passwd",
        "http://127.0.0.1:1/x.gguf",
    ],
)
def test_model_names_never_open_files_the_user_did_not_name_as_models(bare, name):
    c = bare
    for method in ("model/load", "inference/generate"):
        params = (
            {"model": name} if method == "model/load" else {"model": name, "prompt": "x", "options": {"maxTokens": 1}}
        )
        r = c.request(method, params, timeout=10)
        err = error_of(r)
        assert err["code"] in (MODEL_NOT_FOUND, LOAD_FAILED), r
        assert "root:" not in json.dumps(r)
    assert c.call("model/status") == {"models": []}


def test_store_links_to_files_that_are_not_models_are_refused(spawn, store, tmp_path):
    folder = store["KINFER_MODELS"]
    os.symlink("/etc/passwd", os.path.join(folder, "passwd.gguf"))  # looks like a model by its name
    os.symlink("/etc/hostname", os.path.join(folder, "hostname"))  # no .gguf, no GGUF magic: not a model
    os.symlink("loop.gguf", os.path.join(folder, "loop.gguf"))  # a symlink loop
    os.symlink("/nonexistent/x.gguf", os.path.join(folder, "dangling.gguf"))
    os.mkfifo(os.path.join(folder, "fifo.gguf"))  # opening it would block forever
    os.mkdir(os.path.join(folder, "dir.gguf"))
    with open(os.path.join(folder, "fake.gguf"), "wb") as f:
        f.write(b"root:x:0:0:root:/root:/bin/bash\n" * 4)
    c = spawn(env=store)
    c.initialize()
    listed = {m["name"]: m for m in c.call("model/list", timeout=10)["models"]}
    assert set(listed) == {DEFAULT_MODEL, "passwd", "fake"}, listed
    for name in ("passwd", "fake"):
        assert listed[name]["architecture"] is None and "error" in listed[name]
        err = error_of(c.request("model/load", {"model": name}, timeout=10))
        assert err["code"] == LOAD_FAILED, err
        assert "root:" not in json.dumps(err)
    for name in ("hostname", "loop", "dangling", "fifo", "dir"):
        assert error_of(c.request("model/load", {"model": name}, timeout=10))["code"] == MODEL_NOT_FOUND
    for name in ("fifo.gguf", "loop.gguf", "dangling.gguf", "dir.gguf"):  # the same files named by path
        assert (
            error_of(c.request("model/load", {"model": os.path.join(folder, name)}, timeout=10))["code"]
            == MODEL_NOT_FOUND
        )
    assert c.call("model/status") == {"models": []}


def test_ollama_manifests_cannot_point_outside_the_blob_folder(spawn, store):
    root = store["OLLAMA_MODELS"]
    manifest_dir = os.path.join(root, "manifests", "registry.ollama.ai", "library", "evil")
    os.makedirs(manifest_dir)
    os.makedirs(os.path.join(root, "blobs"))
    layers = [
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:../../../../../../etc/passwd", "size": 1},
        {"mediaType": "application/vnd.ollama.image.system", "digest": "sha256:/etc/passwd", "size": 1},
        {"mediaType": "application/vnd.ollama.image.params", "digest": "..", "size": 1},
    ]
    with open(os.path.join(manifest_dir, "latest"), "w") as f:
        json.dump({"schemaVersion": 2, "layers": layers}, f)
    c = spawn(env=store)
    c.initialize()
    listed = {m["name"]: m for m in c.call("model/list", timeout=10)["models"]}
    evil = listed["evil:latest"]
    blobs = os.path.realpath(os.path.join(root, "blobs"))
    assert os.path.realpath(evil["path"]).startswith(blobs + os.sep), evil
    err = error_of(c.request("model/load", {"model": "evil"}, timeout=10))
    assert err["code"] == LOAD_FAILED and "root:" not in json.dumps(err)
    err = error_of(c.request("inference/chat", {"model": "evil", **chat("hi")}, timeout=10))
    assert err["code"] == LOAD_FAILED


def _sockets(pid: int) -> dict[int, tuple[str, list[str]]]:
    """The process's socket inodes -> (the /proc/net table it appears in, its columns there)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    inode_column = {
        "unix": 6,
        "tcp": 9,
        "tcp6": 9,
        "udp": 9,
        "udp6": 9,
        "raw": 9,
        "raw6": 9,
        "udplite": 9,
        "udplite6": 9,
        "packet": -1,
        "netlink": -1,
    }
    found: dict[int, tuple[str, list[str]]] = {}
    for table, col in inode_column.items():
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = [line.split() for line in f.read().splitlines()[1:]]
        except OSError:
            continue
        for cols in rows:
            if len(cols) > abs(col) and cols[col].isdigit() and int(cols[col]) in inodes:
                found[int(cols[col])] = (table, cols)
    for inode in inodes - set(found):
        found[inode] = ("unknown", [])
    return found


def test_no_network_listener_exists(spawn):
    c = spawn()
    c.initialize({"initializationOptions": {"logLevel": "debug"}})
    c.load_model(slots=2)
    rid = c.request_async(
        "inference/generate",
        {"prompt": "Once", "partialResultToken": "n", "options": {"maxTokens": 50, "ignoreEos": True}},
    )
    c.wait_for(lambda m: m.get("method") == "$/progress", timeout=30)
    pids = [c.proc.pid, *children_of(c.proc.pid)]
    assert pids == [c.proc.pid], "the server started processes"
    sockets = _sockets(c.proc.pid)
    print("sockets of the server:", sockets)
    for _inode, (table, cols) in sockets.items():
        # asyncio's self-pipe is a connected, unnamed AF_UNIX socket pair; nothing else is allowed
        assert table == "unix", (table, cols)
        flags, state, path = int(cols[3], 16), cols[5], cols[7:]
        assert flags & 0x10000 == 0, f"a listening unix socket: {cols}"  # __SO_ACCEPTCON
        assert state == "03" and path == [], cols  # connected, unbound
    result_of(c.response(rid, timeout=60))
