"""Mixture-of-experts placement benchmark: experts in host memory, passes of 2048 vs 4096.

    python bench/moe_bench.py MODEL.gguf --prompt 7700 --ntg 64 [--threads 16] [--anchor /tmp/lc]

For each case the built-in placement plans the load from the model's header and the machine
(kinfer_placements, as `model/load` does), kinfer's engine loads it on its worker thread, and one
request with a --prompt-token prompt generates --ntg tokens (greedy). Prompt tok/s is the prompt
over the time to the first token; decode tok/s the tokens after the first over the time after it.
Cases: experts-host at its own pass size (4096), experts-host at 2048 (batch = ubatch = 2048), and
everything on the GPU (placement gpu) for reference. --anchor also runs llama.cpp's llama-bench on
the same file with the same splits (`-ot exps=CPU`) in the same run. Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from harness import emit, greedy, run_one, start_engine

from kinfer_rpc.default_plugins import placements as kinfer_placements
from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.host.runtime import model_facts
from kinfer_rpc.types import LoadOptions

PLACEMENTS = {p.name: p for p in (kinfer_placements.Auto(), kinfer_placements.Gpu(), kinfer_placements.ExpertsHost())}


def run_case(path: str, placement: str, pass_size: int | None, args, seed: int) -> dict:
    ctx = args.prompt + args.ntg + 64
    base = LoadOptions(context_length=ctx, slots=1, threads=args.threads)
    backend = LlamaBackend()
    machine = backend.machine()
    plan = PLACEMENTS[placement].plan(model_facts(path), machine, base)
    batch = pass_size or plan.batch
    ubatch = pass_size or plan.ubatch
    opts = LoadOptions(
        context_length=ctx,
        slots=1,
        threads=args.threads,
        batch=batch,
        ubatch=ubatch,
        gpu_layers=plan.gpu_layers,
        host_tensors=plan.host_tensors,
    )
    t_load = time.perf_counter()
    engine = start_engine(lambda p: backend.load(path, opts, p), what=f"{placement} {pass_size}", batch=batch, prefix=0)
    t_load = time.perf_counter() - t_load
    vocab = engine.model.info.n_vocab

    def one(prompt, ntg):
        run = run_one(engine, prompt, greedy(ntg))
        return run.t0, run.times[0]

    one([(17 * j + seed) % (vocab - 100) + 50 for j in range(64)], 4)  # warm-up
    results = []
    for rep in range(args.reps):
        prompt = [(7 * j * j + 31 * j + seed + 1000 * rep) % (vocab - 100) + 50 for j in range(args.prompt)]
        t0, times = one(prompt, args.ntg)
        results.append(
            {
                "prompt_tps": args.prompt / (times[0] - t0),
                "decode_tps": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0,
            }
        )
    engine.stop()
    best = lambda key: round(max(r[key] for r in results), 2)  # noqa: E731
    return {
        "engine": "kinfer",
        "placement": placement,
        "batch": batch,
        "ubatch": ubatch,
        "gpu_layers": plan.gpu_layers,
        "host_tensors": list(plan.host_tensors),
        "reason": plan.reason,
        "gpu_free_gib": round(machine.gpu_free_bytes / 2**30, 1),
        "load_s": round(t_load, 1),
        "prompt": args.prompt,
        "ntg": args.ntg,
        "prompt_tps": best("prompt_tps"),
        "decode_tps": best("decode_tps"),
        "runs": [{k: round(v, 2) for k, v in r.items()} for r in results],
    }


def anchor(path: str, tools: str, host: bool, pass_size: int, args) -> dict:
    cmd = [
        os.path.join(tools, "llama-bench"),
        "-m",
        path,
        "-ngl",
        "99",
        "-fa",
        "1",
        "-p",
        str(args.prompt),
        "-n",
        str(args.ntg),
        "-b",
        str(pass_size),
        "-ub",
        str(pass_size),
        "-r",
        str(args.anchor_reps),
        "-o",
        "json",
        "-t",
        str(args.threads or os.cpu_count()),
    ]
    if host:
        cmd += ["-ot", kinfer_placements.EXPERTS + "=CPU"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = {"engine": "llama-bench", "experts_host": host, "batch": pass_size, "ubatch": pass_size}
    try:
        for row in json.loads(proc.stdout):
            key = "prompt_tps" if row.get("n_prompt") else "decode_tps"
            out[key] = round(row["avg_ts"], 2)
    except (ValueError, KeyError, TypeError):
        out["error"] = (proc.stderr or proc.stdout)[-600:]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=7700)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--anchor", default=None, help="folder with llama.cpp's llama-bench")
    ap.add_argument("--anchor-reps", type=int, default=1)
    ap.add_argument("--anchor-only", action="store_true", help="only llama-bench, for the same cases")
    ap.add_argument("--cases", default="experts-host:4096,experts-host:2048,gpu:")
    args = ap.parse_args()
    for i, case in enumerate(args.cases.split(",")):
        name, _, size = case.partition(":")
        if not args.anchor_only:
            r = run_case(args.model, name, int(size) if size else None, args, seed=i)
            emit("kinfer", r)
        if args.anchor:
            host = name == "experts-host"
            emit("llama-bench", anchor(args.model, args.anchor, host, int(size) if size else 2048, args))


if __name__ == "__main__":
    main()
