"""The benchmarks in bench/ keep working: each script starts, and one really runs and prints the
shared result format (bench/harness.py)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
from paths import ROOT

from kinfer_rpc.host.store import embedded_default_path

SCRIPTS = sorted(p for p in glob.glob(os.path.join(ROOT, "bench", "*.py")) if not p.endswith("harness.py"))

# Runs every script's --help in one interpreter, each as its own __main__, as `python bench/X.py`
# would (its folder first on the path): an import that broke, or an argument parser that did,
# shows here. Scripts for a backend whose library this machine lacks (mlx) are reported apart.
_HELP_ALL = """
import runpy, sys, json
bad, skipped = {}, []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path[0] = path.rsplit("/", 1)[0]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            bad[path] = f"exit {e.code}"
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("mlx", "mlx_lm"):
            skipped.append(path)
        else:
            bad[path] = repr(e)
    except Exception as e:
        bad[path] = repr(e)
print(json.dumps({"bad": bad, "skipped": skipped}))
"""


def test_every_bench_script_starts():
    assert len(SCRIPTS) >= 10
    out = subprocess.run(
        [sys.executable, "-c", _HELP_ALL, *SCRIPTS], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["bad"] == {}


@pytest.mark.model
def test_engine_bench_prints_the_result_format():
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "engine_bench.py"),
            embedded_default_path(),
            "--npp",
            "16",
            "--ntg",
            "8",
            "--npl",
            "1,3",
            "--threads",
            "1",
            "--phases",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["bench"], r["case"], r["npl"]) for r in records] == [
        ("engine_bench", "batched", 1),
        ("engine_bench", "batched", 3),
    ]
    for r in records:
        assert r["tokens"] == 8 * r["npl"]
        assert r["decode_tps"] > 0 and r["prompt_tps"] > 0
        assert r["ms_step"] > 0 and r["phase_steps"] > 0
