"""Long runs, marked slow (pytest.ini's addopts skips them: run with `pytest -m slow tests/soak`).

- test_soak_64_streams: tests/soak/soak.py for KINFER_SOAK_SECONDS (default 600) with 64 concurrent streams
  (KINFER_SOAK_STREAMS): nothing lost or duplicated, replies identical per request, memory flat after
  the warm-up, throughput steady minute to minute. The JSON summary goes to KINFER_SOAK_OUT (default
  the temporary folder's kinfer-soak.json).
- test_long_cancel_storm: the cancel storm of tests/test_reliability_cancel.py with KINFER_LONG_STORM_REQUESTS
  (default 5000) requests.

Both run on the embedded model unless KINFER_SOAK_MODEL names another (a GGUF path), with
KINFER_SOAK_GPU_LAYERS as its load's gpuLayers (bench/gpu_reliability.sh runs them on a GPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import tempfile

import pytest
import reliability_helpers as rel
from protocol_fixtures import spawn  # noqa: F401  (fixture)
from rpcclient import DEFAULT_MODEL

pytestmark = pytest.mark.model  # every test here loads a real model

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.environ.get("KINFER_SOAK_MODEL") or DEFAULT_MODEL
GPU = {"gpuLayers": int(os.environ["KINFER_SOAK_GPU_LAYERS"])} if os.environ.get("KINFER_SOAK_GPU_LAYERS") else {}


def _soak_module():
    spec = importlib.util.spec_from_file_location(
        "kinfer_bench_soak", os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_soak_64_streams():
    seconds = float(os.environ.get("KINFER_SOAK_SECONDS", "600"))
    streams = int(os.environ.get("KINFER_SOAK_STREAMS", "64"))
    threads = int(os.environ["KINFER_SOAK_THREADS"]) if os.environ.get("KINFER_SOAK_THREADS") else None
    out = os.environ.get("KINFER_SOAK_OUT", os.path.join(tempfile.gettempdir(), "kinfer-soak.json"))
    summary = _soak_module().run(seconds, streams, threads=threads, model=MODEL, gpu_layers=GPU.get("gpuLayers"))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}))
    assert summary["problems"] == []
    assert summary["results"] > 0 and summary["requests"] == summary["results"] + summary["cancelledAnswered"]
    # memory flat: after the first sample (warm-up), RSS grows less than 64 MiB over the run
    assert summary["rssGrowthAfterWarmupKiB"] < 64 * 1024, summary["rssKiB"]
    assert max(summary["threads"]) - min(summary["threads"][1:] or summary["threads"]) <= 2, summary["threads"]
    assert len(set(summary["fds"][1:])) == 1, summary["fds"]
    device = [mib for _, mib in summary["deviceMiB"][1:] if mib is not None]
    if device:  # on a GPU: the device memory the server holds stays flat after the warm-up
        assert max(device) - min(device) < 256, summary["deviceMiB"]
    # throughput steady: after the first minute (every stream's first prompt), no full minute under half the
    # median minute
    per_minute = summary["tokensPerSecondPerMinute"][1:]
    if len(per_minute) >= 2:
        assert min(per_minute) >= 0.5 * statistics.median(per_minute), summary["tokensPerSecondPerMinute"]


@pytest.mark.slow
def test_long_cancel_storm(spawn):
    n = int(os.environ.get("KINFER_LONG_STORM_REQUESTS", "5000"))
    ref, c = spawn(), spawn()
    for server in (ref, c):
        server.initialize()
        server.call("model/load", {"model": MODEL, "options": {**rel.STORM_LOAD, **GPU}}, timeout=60)
    requests = rel.storm_pool()
    alone = rel.replies_alone(ref, requests)
    ref.close()
    storm = rel.run_storm(c, n, seed=1, time_limit=3600)
    counts = rel.check_storm(c, storm, alone)
    status = c.call("model/status")["models"][0]
    assert (status["slotsBusy"], status["queueLength"], rel.held_by_requests(status)) == (0, 0, 0), status
    print(
        "long cancel storm:",
        json.dumps(
            {
                "requests": n,
                "seconds": round(storm["seconds"], 1),
                "outcomes": {f"{a}: {b}": v for (a, b), v in sorted(counts.items())},
            }
        ),
    )
    c.assert_clean()
