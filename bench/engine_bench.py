"""Decode throughput of kinfer's engine, shaped like llama.cpp's own benchmarks.

    python bench/engine_bench.py MODEL.gguf --npp 128 --ntg 128 --npl 1,8,32,128

For each N in --npl: N requests with an --npp-token prompt each generate --ntg tokens (greedy,
ignoring end-of-generation, as llama-batched-bench does). Prompt time (all prompts in) and decode
time (from the first step after every prompt is in to the last token) are measured like
llama-batched-bench's T_PP and T_TG. `--tg` also runs the single-stream case shaped like
llama-bench's tg (a 1-token prompt, then --ntg tokens). Prints one JSON object per line.

The engine runs on its worker thread exactly as the server runs it; only the RPC layer is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]


from phases import PhaseTimer  # noqa: E402

from kinfer_rpc.default_plugins.llama import LlamaBackend  # noqa: E402
from kinfer_rpc.engine import scheduler as engine_module  # noqa: E402
from kinfer_rpc.engine.sampling import SamplingOptions  # noqa: E402
from kinfer_rpc.engine.scheduler import Engine, GenerateOptions, Job  # noqa: E402
from kinfer_rpc.types import LoadOptions  # noqa: E402


def run(model: str, npl: int, npp: int, ntg: int, args) -> dict:
    opts = LoadOptions(
        context_length=npp + ntg + 8,
        slots=npl,
        batch=args.batch,
        ubatch=args.ubatch,
        threads=args.threads,
        gpu_layers=args.gpu_layers,
        flash_attention=True,
        kv_unified=args.kvu,
        kv_type=args.kv_type,
    )
    ready = threading.Event()

    def load(progress):
        loaded = LlamaBackend().load(model, opts, progress)
        if args.device_argmax == "off":  # every row's logits come back; the engine takes the argmax
            loaded.device_greedy = False
        return loaded

    engine = Engine(
        load,
        lambda fn: fn(),
        batch=args.batch,
        on_ready=lambda exc: ready.set(),
        prefix=args.prefix,
        start_ahead=False if args.start_ahead == "off" else None,
    )
    engine.start()
    ready.wait()
    if engine.model is None:
        raise SystemExit("load failed")
    vocab = engine.model.info.n_vocab
    # Distinct prompts (so nothing could be shared), the same length for every request.
    prompts = [[(7 + 13 * i + 31 * j) % (vocab - 100) + 50 for j in range(npp)] for i in range(npl)]
    options = GenerateOptions(max_tokens=ntg, ignore_eos=True, sampling=SamplingOptions(temperature=0.0))
    warm = Job(
        prompts[0][:8], GenerateOptions(max_tokens=4, ignore_eos=True, sampling=SamplingOptions(temperature=0.0))
    )
    done = threading.Event()
    warm.on_done = lambda j: done.set()
    engine.submit(warm)
    done.wait()

    phases = PhaseTimer(engine) if args.phases else None
    finished = threading.Semaphore(0)
    times: list[list[float]] = [[] for _ in prompts]
    jobs = [
        Job(
            p,
            options,
            on_done=lambda j: finished.release(),
            on_piece=lambda text, toks, t=times[i]: t.extend([time.perf_counter()] * len(toks)),
        )
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    for job in jobs:
        engine.submit(job)
    for _ in jobs:
        finished.acquire()
    t_end = time.perf_counter()
    # Like llama-batched-bench: prompt phase until every request has its first token, then the
    # decode phase with all of them running.
    t_all_in = max(t[0] for t in times)
    decode_tokens = sum(1 for t in times for x in t if x > t_all_in)
    t_decode = t_end - t_all_in
    t_prompt = t_all_in - t0
    device_argmax = bool(getattr(engine.model, "device_greedy", False))
    engine.stop()
    extra = phases.summary(t_all_in) if phases else {}
    return {
        **extra,
        "engine": "kinfer",
        "npl": npl,
        "npp": npp,
        "ntg": ntg,
        "kvu": args.kvu,
        "prefix": args.prefix,
        "prompt_s": round(t_prompt, 4),
        "prompt_tps": round(npl * npp / t_prompt, 2),
        "decode_s": round(t_decode, 4),
        "decode_tps": round(decode_tokens / t_decode, 2) if t_decode > 0 else 0.0,
        "total_tps": round(sum(len(j.generated) for j in jobs) / (t_end - t0), 2),
        "steps": engine.steps,
        "started_ahead": engine.started_ahead,
        "device_argmax": device_argmax,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--npl", default="1,8,32,128")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gpu-layers", type=int, default=-1)
    ap.add_argument("--kvu", action="store_true", help="one unified KV buffer (llama-batched-bench -kvu)")
    ap.add_argument("--kv-type", default=None, choices=["f16", "q8_0"])
    ap.add_argument("--prefix", type=int, default=-1, help="the prefix pool's token budget (-1: off, compaction)")
    ap.add_argument("--tg", action="store_true", help="also the single-stream case shaped like llama-bench tg")
    ap.add_argument("--phases", action="store_true", help="also split each decode step's time (see PhaseTimer)")
    ap.add_argument(
        "--start-ahead",
        choices=["auto", "off"],
        default="auto",
        help="off: never start a pass before the last one's tokens are taken (Engine._start_next), to compare",
    )
    ap.add_argument(
        "--device-argmax",
        choices=["auto", "off"],
        default="auto",
        help="greedy rows' argmax in llama.cpp's pass where its library has the patch (auto), or on the host (off)",
    )
    ap.add_argument("--argmax-parts", type=int, default=None, help="the argmax's most threads (engine._ARGMAX_PARTS)")
    args = ap.parse_args()
    if args.argmax_parts:
        engine_module._ARGMAX_PARTS = args.argmax_parts
    if args.tg:
        r = run(args.model, 1, 1, args.ntg, args)
        r["case"] = "tg"
        print(json.dumps(r), flush=True)
    for n in [int(x) for x in args.npl.split(",") if x]:
        r = run(args.model, n, args.npp, args.ntg, args)
        r["case"] = "batched"
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
