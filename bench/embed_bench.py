"""Embedding throughput: kinfer-rpc's inference/embed beside llama.cpp's own embedding path
(llama-cpp-python's `Llama(embedding=True).embed`) on the same GGUF and the same threads.

    python bench/embed_bench.py MODEL.gguf [--inputs 256] [--threads 2] [--repeat 3]

Rows: llama-cpp-python embedding every input in one call (it packs inputs into passes of up to
n_batch tokens), llama-cpp-python one input a call (one pass an input, as kinfer runs them), and
kinfer-rpc through its protocol: one request with every input, and the same inputs as 4 requests
sent at once. The inputs are sentences of 5 to 40 words, the same every run. Best of `repeat`.
"""

from __future__ import annotations

import argparse
import os
import random
import time

WORDS = (
    "the a cat dog house river tree city light night morning quickly slowly red blue green "
    "runs sleeps reads writes under over near beside because while after before people music"
).split()


def inputs(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + "." for _ in range(n)]


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    texts = inputs(args.inputs)

    from llama_cpp import Llama

    ref = Llama(args.model, embedding=True, n_threads=args.threads, n_ctx=512, n_batch=512, verbose=False)
    tokens = sum(len(ref.tokenize(t.encode())) for t in texts)
    rows = [
        ("llama-cpp-python, every input in one call", best(lambda: ref.embed(texts), args.repeat)),
        ("llama-cpp-python, one input a call", best(lambda: [ref.embed(t) for t in texts], args.repeat)),
    ]
    ref.close()

    import anyio

    from kinfer_rpc.client import AsyncClient, Client

    with Client() as kinfer:
        kinfer.load(args.model, threads=args.threads)
        one = best(lambda: kinfer.embed(texts, args.model), args.repeat)
        rows.append(("kinfer-rpc inference/embed, one request", one))

    async def four() -> None:
        async with AsyncClient() as k:
            await k.load(args.model, threads=args.threads)
            quarter = len(texts) // 4

            async def once() -> None:
                async with anyio.create_task_group() as tg:
                    for i in range(4):
                        tg.start_soon(k.embed, texts[i * quarter : (i + 1) * quarter], args.model)

            times = []
            for _ in range(args.repeat):
                t = time.perf_counter()
                await once()
                times.append(time.perf_counter() - t)
            rows.append(("kinfer-rpc inference/embed, 4 requests at once", min(times)))

    anyio.run(four)
    print(f"{args.inputs} inputs, {tokens} tokens, {args.threads} threads")
    print("| path | seconds | inputs/s | tokens/s |")
    print("|---|---:|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {args.inputs / seconds:.0f} | {tokens / seconds:.0f} |")


if __name__ == "__main__":
    main()
