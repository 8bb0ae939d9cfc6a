"""Single-stream decode on the CPU while another process keeps one core busy, against the same
idle, for kinfer (its default threads: the cores other processes leave free; and a fixed thread
count, as it was) and for llama.cpp's own defaults (llama-bench tg), in one run.

    python bench/busy_bench.py [MODEL.gguf] --tools DIR [--tokens 128] [--rounds 3]

`--tools` is a llama.cpp build folder with llama-bench (the same llama.cpp). The busy process is
a Python loop that never sleeps. Each case is run --rounds times, alternating idle and busy; the
medians are printed, one JSON line a case, and the busy/idle ratio of each side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from harness import distinct_prompts, emit, greedy, run_one, start_engine

from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.host.store import embedded_default_path
from kinfer_rpc.types import LoadOptions


def kinfer_tps(model: str, tokens: int, threads: int | None) -> float:
    opts = LoadOptions(context_length=tokens + 64, slots=1, threads=threads)
    engine = start_engine(lambda progress: LlamaBackend().load(model, opts, progress), batch=512)
    prompt = distinct_prompts(1, 16, engine.model.info.n_vocab)[0]
    run_one(engine, prompt[:4], greedy(8))  # warm-up (and the first look at the machine)
    time.sleep(0.6)
    run = run_one(engine, prompt, greedy(tokens))
    engine.stop()
    times = run.times[0]
    return (len(times) - 1) / (times[-1] - times[0])


def llama_bench_tps(tools: str, model: str, tokens: int) -> float:
    out = subprocess.run(
        [os.path.join(tools, "llama-bench"), "-m", model, "-p", "0", "-n", str(tokens), "-r", "1", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(out.stdout)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--tools", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = args.model or str(embedded_default_path())
    cpus = len(os.sched_getaffinity(0))
    sides = {
        "kinfer (threads: the free cores)": lambda: kinfer_tps(model, args.tokens, None),
        f"kinfer (threads: {cpus}, fixed)": lambda: kinfer_tps(model, args.tokens, cpus),
        "llama-bench (its defaults)": lambda: llama_bench_tps(args.tools, model, args.tokens),
    }
    figures: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for load in ("idle", "busy"):
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
            try:
                time.sleep(0.5)
                for side, measure in sides.items():
                    figures.setdefault((side, load), []).append(measure())
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    for side in sides:
        idle = statistics.median(figures[(side, "idle")])
        busy_tps = statistics.median(figures[(side, "busy")])
        emit(
            side,
            {
                "idle_tps": round(idle, 1),
                "busy_tps": round(busy_tps, 1),
                "busy_over_idle": round(busy_tps / idle, 3),
                "cpus": cpus,
                "tokens": args.tokens,
                "rounds": args.rounds,
            },
        )


if __name__ == "__main__":
    main()
