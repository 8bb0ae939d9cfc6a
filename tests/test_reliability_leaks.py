"""Reliability: load, generate, cancel and unload cycles leak no threads, files or memory.

Each test drives a real `kinfer-rpc` process through tests/rpcclient.py (which checks that stdout
carries nothing but frames and that every message matches spec/metaModel.json); docs/reliability.md
describes each test and the figures measured. Shared helpers: reliability_helpers.py, conftest.py.
"""

from __future__ import annotations

import time

import pytest
from protocol_fixtures import spawn  # noqa: F401  (fixture)
from reliability_helpers import (
    GREEDY,
    INTERNAL_ERROR,
    REQUEST_CANCELLED,
    no_traceback,
    proc_status,
    threads_and_fds,
)
from rpcclient import DEFAULT_MODEL, error_of, result_of

pytestmark = pytest.mark.model  # every test here loads a real model


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
