"""Reliability: cancels. The cancel storm (requests cancelled at random moments, every reply checked
against the same request alone) and a cancel at each moment of a request's life; the long storm is
in tests/soak/ (marked slow).

Each test drives a real `kinfer-rpc` process through tests/rpcclient.py (which checks that stdout
carries nothing but frames and that every message matches spec/metaModel.json); docs/reliability.md
describes each test and the figures measured. Shared helpers: reliability_helpers.py, conftest.py.
"""

from __future__ import annotations

import json
import time

import pytest
from protocol_fixtures import spawn  # noqa: F401  (fixture)
from reliability_helpers import (
    GREEDY,
    LONG,
    REQUEST_CANCELLED,
    STORM_LOAD,
    STORM_REQUESTS,
    check_storm,
    held_by_requests,
    no_traceback,
    outcome,
    replies_alone,
    run_storm,
    storm_pool,
    tokens_of,
)
from rpcclient import DEFAULT_MODEL, error_of, responses_by_id, result_of

pytestmark = pytest.mark.model  # every test here loads a real model


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
