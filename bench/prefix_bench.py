"""The agent case for the prefix pool: N conversations sharing a long system prompt.

    python bench/prefix_bench.py MODEL.gguf --system 4000 --n 32 [--gpu-layers 99]

One conversation with the system prompt runs first and finishes (its cells stay in the pool);
then N conversations, each the system prompt plus a short message of its own, arrive together.
Reports time to first token (mean, max) with the pool and with `prefix -1` (no pool), and
checks the replies are the same both ways.
"""

from __future__ import annotations

import argparse

from harness import Run, emit, greedy, start_engine

from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.types import LoadOptions


def run(args, prefix: int) -> dict:
    opts = LoadOptions(
        context_length=args.system + 256,
        slots=args.n,
        batch=args.batch,
        ubatch=512,
        threads=args.threads,
        gpu_layers=args.gpu_layers,
    )
    engine = start_engine(lambda p: LlamaBackend().load(args.model, opts, p), batch=args.batch, prefix=prefix)
    vocab = engine.model.info.n_vocab
    system = [(31 * i) % (vocab - 200) + 100 for i in range(args.system)]
    Run(engine, [system + [7, 8, 9]], greedy(args.ntg))  # the first conversation computes the system prompt
    run = Run(engine, [system + [(13 * i + k) % vocab for k in range(12)] for i in range(args.n)], greedy(args.ntg))
    jobs, t0 = run.jobs, run.t0
    ttft = sorted(j.t_first - t0 for j in jobs)
    out = {
        "prefix": prefix,
        "n": args.n,
        "system": args.system,
        "ttft_mean_s": round(sum(ttft) / len(ttft), 4),
        "ttft_max_s": round(ttft[-1], 4),
        "cached_tokens": sum(j.cached for j in jobs),
        "replies": [j.generated for j in jobs],
    }
    engine.stop()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--system", type=int, default=4000)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--ntg", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gpu-layers", type=int, default=-1)
    args = ap.parse_args()
    pool = run(args, 1 << 30)
    plain = run(args, -1)
    same = pool.pop("replies") == plain.pop("replies")
    emit(
        "agent",
        {
            "pool": pool,
            "no_pool": plain,
            "same_replies": same,
            "ttft_speedup": round(plain["ttft_mean_s"] / pool["ttft_mean_s"], 2),
        },
    )


if __name__ == "__main__":
    main()
