"""The mlx backend beside mlx-lm's own generation, same model, same device, one run.

    python bench/mlx_bench.py MODEL --out results.json [--npl 1,8,32,128] [--npp 64] [--ntg 128] [--weights dense]
    python bench/mlx_bench.py MODEL --out curve.json --mode curve [--kmax 16]
    python bench/mlx_bench.py MODEL --out inv.json --mode invariance [--npl 8,32]

MODEL is an MLX folder (tests/modelgen/make_mlx_model.py writes one) or a GGUF file.

`compare`: for each N in --npl, N requests with distinct --npp-token prompts generate --ntg tokens
each (greedy, end-of-generation ignored). kinfer: the engine on its worker thread with the mlx
backend, exactly as the server runs it (no RPC). mlx-lm: N=1 is `generate_step` (what mlx_lm.generate
runs), N>1 its `BatchGenerator` (completion batch N). Decode tok/s counts the tokens made after every
request has its first token, over that time (llama-batched-bench's T_TG); total tok/s is every
generated token over the whole run. Ratios are kinfer / mlx-lm. With `--rounds R` each side runs
R times, alternating (the GPU machine's host speed drifts between runs, and a one-row pass is
bound by it on both sides); the run of median decode tok/s is reported.
`curve`: seconds of one pass over one sequence's k+1 positions, k = 0..kmax, and the draft count
kinfer_mlx.pick_drafts takes from it (for the per-device table DEFAULT_DRAFTS).
`invariance`: N requests together vs each alone (greedy): the share of replies that differ, and the
first position where they do.

`--weights quantized|dense` sets LoadOptions.weights and gives mlx-lm the same form (dense: mlx-lm's
dequantize_model); by default both take the form the backend chooses. `--mlx-lm-as-stored` runs
mlx-lm on the model as stored instead (each side with its own defaults, in one run).
On the CPU both sides run the model in float32 (MLX's float16 CPU kernels are emulated and 40x
slower); on a GPU both keep the folder's types. Results: one JSON file (--out) and a markdown
table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import mlx.core as mx
from harness import PhaseTimer, Run, distinct_prompts, emit, greedy, timing
from harness import start_engine as start

from kinfer_rpc.default_plugins import mlx as kinfer_mlx
from kinfer_rpc.default_plugins.mlx import loading as mlx_loading
from kinfer_rpc.engine.scheduler import Engine
from kinfer_rpc.types import LoadOptions

prompts_for = distinct_prompts


WEIGHTS = None  # --weights: None (the backend's choice), "quantized" or "dense"
PHASES = False  # --phases: also where kinfer's steps go (harness.PhaseTimer)
TRACE = False  # --trace: also every step of kinfer's last measured run (harness.PhaseTimer.trace)
MLX_LM_AS_STORED = False  # --mlx-lm-as-stored: mlx-lm runs the model as stored, whatever kinfer chose


def start_engine(model: str, slots: int, ctx: int, drafts: int = 0) -> Engine:
    opts = LoadOptions(context_length=ctx, slots=slots, batch=max(512, slots), drafts=drafts, weights=WEIGHTS)
    return start(
        lambda p: kinfer_mlx.MlxBackend().load(model, opts, p),
        what="the model on the mlx backend",
        batch=opts.batch,
        prefix=-1,
    )


def run_jobs(engine: Engine, prompts, ntg: int) -> tuple[dict, list]:
    run = Run(engine, prompts, greedy(ntg))
    return run.timing(), run.replies


def kinfer_case(model: str, n: int, npp: int, ntg: int, rounds: int = 1, between=None) -> list[dict]:
    """`rounds` measured runs of N requests on one engine; `between(i)` runs after run i (the
    other side's run i, so that both sides alternate through one stretch of time)."""
    engine = start_engine(model, n, npp + ntg + 8)
    try:
        vocab = engine.model.info.n_vocab
        # Warm up with the measured run itself: the compiled step is traced, and on CUDA its
        # kernels built, once per shape (rows in the pass), and the run's passes take every
        # row count on the way as requests start and finish (a shorter warm-up at 128 rows
        # left 32 of the run's 41 pass shapes to the measured run); llama-batched-bench warms
        # up too.
        rows: set[int] = set()  # the row counts of the compiled decode passes
        step = engine.model._compiled_step
        engine.model._compiled_step = lambda seqs, last: rows.add(len(seqs)) or step(seqs, last)
        cold, _ = run_jobs(engine, prompts_for(n, npp, vocab), ntg)
        compiled = len(rows)
        timer = PhaseTimer(engine) if PHASES else None
        out = []
        for i in range(rounds):
            t = time.perf_counter()
            result, _ = run_jobs(engine, prompts_for(n, npp, vocab), ntg)
            if timer:  # every step of the run, the prompt's included
                result.update(timer.summary(after=t))
                if TRACE:
                    result["steps"] = timer.trace(after=t)
            # the warm-up as a user's first run meets it (every pass shape new), and the
            # decode pass shapes it compiled
            result["cold"] = {k: cold[k] for k in ("prompt_s", "decode_tps", "total_tps")}
            result["cold"]["row_counts"] = compiled
            result["device"] = engine.model.memory()["device"]
            result["weights"] = engine.model.info.weights
            out.append(result)
            if between:
                between(i)
        return out
    finally:
        engine.stop(timeout=None)  # the worker must leave MLX before the interpreter exits


def median_run(runs: list[dict]) -> dict:
    """The run of median decode tok/s, with every run's decode tok/s beside it."""
    ranked = sorted(runs, key=lambda r: r["decode_tps"])
    return {**ranked[(len(ranked) - 1) // 2], "decode_tps_runs": [r["decode_tps"] for r in runs]}


def mlx_lm_model(model: str):
    from mlx_lm.utils import load_model

    if not os.path.isdir(model):
        m = mlx_loading._load_gguf(model)[0]
    else:
        m = load_model(__import__("pathlib").Path(model))[0]
    on_gpu = mx.default_device() == mx.gpu
    if not on_gpu:
        mlx_loading._float_type(m, mx.float32)
    # mlx-lm gets the weights in the form the kinfer load chose (its default decides for both).
    form, _ = mlx_loading._weights_form(m, WEIGHTS, on_gpu)
    if MLX_LM_AS_STORED:
        form = "quantized" if mlx_loading._quantized(m) else "dense"
    elif form == "dense" and mlx_loading._quantized(m):
        from mlx_lm.utils import dequantize_model

        m = dequantize_model(m)
        mlx_loading._float_type(m, mx.float16 if on_gpu else mx.float32)
    print(f"weights: {form}", file=sys.stderr, flush=True)
    return m


def mlx_lm_case(m, n: int, npp: int, ntg: int) -> dict:
    from mlx_lm.generate import BatchGenerator, generate_step

    vocab = m.args.vocab_size
    prompts = prompts_for(n, npp, vocab)
    times: list[list[float]] = [[] for _ in prompts]
    if n == 1:
        for _ in generate_step(mx.array(prompts_for(1, 8, vocab)[0]), m, max_tokens=4):
            pass
        t0 = time.perf_counter()
        for token, _ in generate_step(mx.array(prompts[0]), m, max_tokens=ntg):
            int(token)
            times[0].append(time.perf_counter())
        return timing(t0, time.perf_counter(), times)
    gen = BatchGenerator(
        m, max_tokens=ntg, stop_tokens=[], completion_batch_size=max(32, n), prefill_batch_size=min(n, 8)
    )
    try:
        gen.insert(prompts, max_tokens=[8] * n)  # warm up at the measured shape, as kinfer does
        while gen.next_generated() or gen._unprocessed_sequences or len(gen._prompt_batch):
            pass
        t0 = time.perf_counter()
        uids = gen.insert(prompts, max_tokens=[ntg] * n)
        index = {u: i for i, u in enumerate(uids)}
        left = n
        while left:
            for r in gen.next_generated():
                now = time.perf_counter()
                times[index[r.uid]].append(now)
                if r.finish_reason is not None:
                    left -= 1
        return timing(t0, time.perf_counter(), times)
    finally:
        gen.close()


def compare(a) -> dict:
    rows = []
    m = mlx_lm_model(a.model)
    for n in a.npl:
        theirs_runs: list[dict] = []
        ours = median_run(
            kinfer_case(
                a.model, n, a.npp, a.ntg, a.rounds, lambda i: theirs_runs.append(mlx_lm_case(m, n, a.npp, a.ntg))
            )
        )
        theirs = median_run(theirs_runs)
        rows.append(
            {
                "npl": n,
                "kinfer": ours,
                "mlx_lm": theirs,
                "decode_ratio": round(ours["decode_tps"] / theirs["decode_tps"], 3) if theirs["decode_tps"] else None,
                "total_ratio": round(ours["total_tps"] / theirs["total_tps"], 3) if theirs["total_tps"] else None,
            }
        )
        emit("compare", rows[-1])
    print(
        "| at once | kinfer decode tok/s | mlx-lm decode tok/s | ratio "
        "| kinfer total tok/s | mlx-lm total tok/s | ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        k, m_ = r["kinfer"], r["mlx_lm"]
        print(
            f"| {r['npl']} | {k['decode_tps']} | {m_['decode_tps']} | {r['decode_ratio']} | {k['total_tps']} |"
            f" {m_['total_tps']} | {r['total_ratio']} |"
        )
    return {"rows": rows}


def curve(a) -> dict:
    model = kinfer_mlx.MlxBackend().load(
        a.model,
        LoadOptions(context_length=a.npp + a.kmax + 64, slots=1, drafts=a.kmax, weights=WEIGHTS),
        lambda f: None,
    )
    costs = kinfer_mlx.step_cost_curve(model, a.kmax, repeats=a.repeats, context=a.npp)
    pick = kinfer_mlx.pick_drafts(costs)
    print("| k (drafts) | rows | ms | x one row |")
    print("|---:|---:|---:|---:|")
    for k, c in enumerate(costs):
        print(f"| {k} | {k + 1} | {c * 1000:.2f} | {c / costs[0]:.2f} |")
    print(f"\npick_drafts (acceptance 0.7): {pick}")
    return {
        "costs_s": costs,
        "relative": [c / costs[0] for c in costs],
        "pick_drafts": pick,
        "device": model.memory()["device"],
    }


def invariance(a) -> dict:
    out = []
    for n in a.npl:
        solo_engine = start_engine(a.model, 1, a.npp + a.ntg + 8)
        vocab = solo_engine.model.info.n_vocab
        prompts = prompts_for(n, a.npp, vocab)
        alone = [run_jobs(solo_engine, [p], a.ntg)[1][0] for p in prompts]
        solo_engine.stop(timeout=None)
        engine = start_engine(a.model, n, a.npp + a.ntg + 8)
        _, together = run_jobs(engine, prompts, a.ntg)
        engine.stop(timeout=None)  # the worker must leave MLX before the interpreter exits
        first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(alone, together)]
        differ = [f for f in first if f is not None]
        out.append(
            {
                "npl": n,
                "replies": n,
                "differ": len(differ),
                "rate": round(len(differ) / n, 4),
                "first_divergence": sorted(differ),
                "tokens_each": a.ntg,
            }
        )
        emit("invariance", out[-1])
    return {"rows": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--mode", choices=["compare", "curve", "invariance"], default="compare")
    ap.add_argument("--npl", default="1,8,32,128")
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--kmax", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="compare: runs of each side, alternating (kinfer, mlx-lm, kinfer, ...); the median run of"
        " each is reported, with every run's decode tok/s",
    )
    ap.add_argument(
        "--weights",
        choices=["default", "quantized", "dense"],
        default="default",
        help="LoadOptions.weights for kinfer, and the same form for mlx-lm (default: the backend's choice)",
    )
    ap.add_argument(
        "--mlx-lm-as-stored",
        action="store_true",
        help="mlx-lm runs the model as stored (its own default) while kinfer takes --weights: each "
        "side's defaults in one run",
    )
    ap.add_argument("--phases", action="store_true", help="also where kinfer's decode steps go (harness.PhaseTimer)")
    ap.add_argument(
        "--trace", action="store_true", help="every step of kinfer's runs in the JSON (with --phases' figures)"
    )
    a = ap.parse_args()
    global WEIGHTS, MLX_LM_AS_STORED, PHASES, TRACE
    MLX_LM_AS_STORED, PHASES, TRACE = a.mlx_lm_as_stored, a.phases or a.trace, a.trace
    WEIGHTS = None if a.weights == "default" else a.weights
    a.npl = [int(x) for x in a.npl.split(",") if x]
    t = time.perf_counter()
    result = {"compare": compare, "curve": curve, "invariance": invariance}[a.mode](a)
    import mlx_lm

    result.update(
        mode=a.mode,
        model=a.model,
        weights=a.weights,
        mlx_lm_as_stored=a.mlx_lm_as_stored,
        npp=a.npp,
        ntg=a.ntg,
        mlx=mx.__version__,
        mlx_lm=mlx_lm.__version__,
        device=str(mx.default_device()),
        seconds=round(time.perf_counter() - t, 1),
    )
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
