"""The agent case for the prefix pool: N conversations sharing a long system prompt.

    python bench/prefix_bench.py MODEL.gguf --system 4000 --n 32 [--gpu-layers 99]

One conversation with the system prompt runs first and finishes (its cells stay in the pool);
then N conversations, each the system prompt plus a short message of its own, arrive together.
Reports time to first token (mean, max) with the pool and with `prefix -1` (no pool), and
checks the replies are the same both ways.
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


from kinfer_rpc.default_plugins.llama import LlamaBackend  # noqa: E402
from kinfer_rpc.engine.sampling import SamplingOptions  # noqa: E402
from kinfer_rpc.engine.scheduler import Engine, GenerateOptions, Job  # noqa: E402
from kinfer_rpc.types import LoadOptions  # noqa: E402


def run(args, prefix: int) -> dict:
    opts = LoadOptions(
        context_length=args.system + 256,
        slots=args.n,
        batch=args.batch,
        ubatch=512,
        threads=args.threads,
        gpu_layers=args.gpu_layers,
    )
    ready = threading.Event()
    engine = Engine(
        lambda p: LlamaBackend().load(args.model, opts, p),
        lambda fn: fn(),
        batch=args.batch,
        on_ready=lambda e: ready.set(),
        prefix=prefix,
    )
    engine.start()
    ready.wait()
    vocab = engine.model.info.n_vocab
    system = [(31 * i) % (vocab - 200) + 100 for i in range(args.system)]
    options = GenerateOptions(max_tokens=args.ntg, ignore_eos=True, sampling=SamplingOptions(temperature=0.0))

    def go(prompts):
        done = threading.Semaphore(0)
        jobs = [Job(p, options, on_done=lambda j: done.release()) for p in prompts]
        t0 = time.perf_counter()
        for job in jobs:
            engine.submit(job)
        for _ in jobs:
            done.acquire()
        return jobs, t0

    go([system + [7, 8, 9]])  # the first conversation: computes the system prompt, then finishes
    jobs, t0 = go([system + [(13 * i + k) % vocab for k in range(12)] for i in range(args.n)])
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
    print(
        json.dumps(
            {
                "case": "agent",
                "pool": pool,
                "no_pool": plain,
                "same_replies": same,
                "ttft_speedup": round(plain["ttft_mean_s"] / pool["ttft_mean_s"], 2),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
