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

from harness import PhaseTimer, Run, distinct_prompts, emit, greedy, start_engine

from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.engine import scheduler as engine_module
from kinfer_rpc.types import LoadOptions


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

    def load(progress):
        loaded = LlamaBackend().load(model, opts, progress)
        if args.device_argmax == "off":  # every row's logits come back; the engine takes the argmax
            loaded.device_greedy = False
        return loaded

    engine = start_engine(
        load,
        batch=args.batch,
        prefix=args.prefix,
        start_ahead=False if args.start_ahead == "off" else None,
    )
    # Distinct prompts (so nothing could be shared), the same length for every request.
    prompts = distinct_prompts(npl, npp, engine.model.info.n_vocab)
    Run(engine, [prompts[0][:8]], greedy(4))  # warm-up
    phases = PhaseTimer(engine) if args.phases else None
    run = Run(engine, prompts, greedy(ntg))
    device_argmax = bool(getattr(engine.model, "device_greedy", False))
    engine.stop()
    return {
        **(phases.summary(run.t_all_in) if phases else {}),
        "engine": "kinfer",
        "npl": npl,
        "npp": npp,
        "ntg": ntg,
        "kvu": args.kvu,
        "prefix": args.prefix,
        **run.timing(prompt_tokens=npl * npp),
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
        emit("tg", run(args.model, 1, 1, args.ntg, args))
    for n in [int(x) for x in args.npl.split(",") if x]:
        emit("batched", run(args.model, n, args.npp, args.ntg, args))


if __name__ == "__main__":
    main()
