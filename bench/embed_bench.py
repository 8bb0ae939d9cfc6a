"""Embedding throughput: kinfer-rpc's inference/embed beside llama.cpp's own embedding path
(llama-cpp-python's `Llama(embedding=True).embed`) on the same GGUF and the same threads.

    python bench/embed_bench.py MODEL.gguf [--inputs 256] [--threads 2] [--repeat 3]
        [--llama-server PATH]

Rows: llama-cpp-python embedding every input in one call (it packs inputs into passes of up to
n_batch tokens), llama-cpp-python one input a call (one pass an input, as kinfer runs them), and
kinfer-rpc through its protocol: one request with every input, and the same inputs as 4 requests
sent at once. With --llama-server, also llama.cpp's server (`--embedding`, 4 slots, the same
threads) answering OpenAI's /v1/embeddings with every input in one request, and how close its
vectors are to kinfer's (the lowest cosine over the inputs). The inputs are sentences of 5 to 40
words, the same every run. Best of `repeat`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import time
import urllib.request

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


def llama_server_rows(path: str, model: str, texts: list[str], threads: int, repeat: int) -> tuple[float, list]:
    """llama-server's /v1/embeddings with every input in one request: best seconds, the vectors."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [path, "-m", model, "--embedding", "-t", str(threads), "-np", "4", "-c", "2048", "-b", "512"]
    argv += ["-ub", "512", "--port", str(port), "--host", "127.0.0.1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("llama-server did not start") from None
                time.sleep(0.2)
        body = json.dumps({"input": texts, "model": "m"}).encode()

        def once() -> list:
            req = urllib.request.Request(url + "/v1/embeddings", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                data = json.loads(r.read())["data"]
            return [d["embedding"] for d in sorted(data, key=lambda d: d["index"])]

        vectors = once()  # warm-up
        return best(once, repeat), vectors
    finally:
        proc.terminate()
        proc.wait(30)


def lowest_cosine(a: list, b: list) -> float:
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    y /= np.linalg.norm(y, axis=1, keepdims=True)
    return float((x * y).sum(axis=1).min())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--inputs", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--llama-server", default=None, help="also this llama-server binary (--embedding)")
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
        mine = kinfer.embed(texts, args.model).embeddings

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
    closest = None
    if args.llama_server:
        seconds, theirs = llama_server_rows(args.llama_server, args.model, texts, args.threads, args.repeat)
        rows.append(("llama-server /v1/embeddings, one request (4 slots)", seconds))
        closest = lowest_cosine(mine, theirs)
    print(f"{args.inputs} inputs, {tokens} tokens, {args.threads} threads")
    print("| path | seconds | inputs/s | tokens/s |")
    print("|---|---:|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {args.inputs / seconds:.0f} | {tokens / seconds:.0f} |")
    if closest is not None:
        print(f"kinfer's vectors against llama-server's: lowest cosine {closest:.6f} over {len(texts)} inputs")


if __name__ == "__main__":
    main()
