"""The product on a GPU, as a client meets it: spawn `kinfer-rpc`, load a model with every layer on
the GPU, stream replies for 1, 32 and 128 requests at once, cancel some, unload, shut down.

    python bench/gpu_e2e.py MODEL.gguf [--at-once 1,32,128] [--max-tokens 64] [--json]
        [--load-options '{"splitMode": "layer"}']

The server is found as every client finds it (`$KINFER_RPC`, the `kinfer-rpc` beside this Python,
on PATH, else `python -m kinfer_rpc`). Exits 0 only when every check held: the load put every layer
on the GPU, each streamed reply equals its result, each request ran to its length or was cancelled
with its partial reply, the server unloaded, shut down and exited with code 0. Its stderr is kept
in --server-log. Prints one line per round (tok/s through the protocol) and the checks it made.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import anyio

from kinfer_rpc.client import AsyncClient


class Failed(Exception):
    pass


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Failed(what)


async def one_round(kinfer: AsyncClient, model: str, n: int, max_tokens: int, cancel_every: int) -> dict:
    """n streamed requests at once; every `cancel_every`-th is cancelled after its first piece."""
    done: dict[int, dict] = {}
    failures: list[str] = []

    async def ask(i: int) -> None:
        try:
            await _ask(i)
        except Exception as exc:  # every request's failure is reported, not only the first
            failures.append(str(exc) if isinstance(exc, Failed) else f"request {i}: {type(exc).__name__}: {exc}")

    async def _ask(i: int) -> None:
        prompt = f"Request {i} of {n}: " + "the quick brown fox " * (1 + i % 7)
        stream = kinfer.stream_generate(
            prompt, model, maxTokens=max_tokens, temperature=0 if i % 2 else 0.8, seed=1000 + i, ignoreEos=True
        )
        cancel = cancel_every > 0 and i % cancel_every == cancel_every - 1
        pieces = []
        async for piece in stream:
            pieces.append(piece)
            if cancel:
                break  # as a user stops reading: the client sends $/cancelRequest
        if cancel:
            stream.cancel()
            with anyio.fail_after(30):  # the server's answer to the cancelled request
                while stream.response is None:
                    await anyio.sleep(0.01)
            error = stream.response.get("error") or {}
            partial = error.get("data") or {}
            check(error.get("code") == -32800, f"request {i}: cancelled, yet answered {str(stream.response)[:200]}")
            check(
                partial.get("usage", {}).get("completionTokens", max_tokens) < max_tokens,
                f"request {i}: the cancellation carried no partial reply shorter than the whole",
            )
            done[i] = {"tokens": partial["usage"]["completionTokens"], "cancelled": True}
            return
        result = stream.result
        check(
            result.stop_reason == "length" and result.usage.completion_tokens == max_tokens,
            f"request {i}: stopped with {result.stop_reason} after {result.usage.completion_tokens} tokens",
        )
        check("".join(pieces) == result.text, f"request {i}: the streamed pieces differ from the result's text")
        done[i] = {"tokens": result.usage.completion_tokens, "cancelled": False}

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(ask, i)
    wall = time.perf_counter() - t0
    check(not failures, f"{len(failures)} of {n} requests failed: " + "; ".join(failures[:5]))
    check(len(done) == n, f"{n - len(done)} of {n} requests got no answer")
    tokens = sum(d["tokens"] for d in done.values())
    return {
        "atOnce": n,
        "cancelled": sum(d["cancelled"] for d in done.values()),
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokPerSecond": round(tokens / wall, 1),
    }


async def probe(kinfer: AsyncClient, model: str, n: int, others: int, max_tokens: int) -> dict:
    """n probe requests each alone, then all of them shuffled among `others` other requests at
    once: how many replies come out identical, greedy and seeded (a figure, not a check)."""
    rng = random.Random(0)
    words = lambda k: " ".join(f"w{rng.randrange(10000)}" for _ in range(k))  # noqa: E731
    probes = [words(rng.randrange(3, 40)) for _ in range(n)]
    out: dict = {}
    for mode, temperature in (("greedy", 0.0), ("seeded", 0.8)):
        opts = lambda i: dict(maxTokens=max_tokens, temperature=temperature, seed=42 + i, ignoreEos=True)  # noqa: E731
        alone = [(await kinfer.generate(p, model, **opts(i))).tokens for i, p in enumerate(probes)]
        mixed: dict[int, list] = {}
        jobs = [(i, p) for i, p in enumerate(probes)] + [(None, words(rng.randrange(3, 40))) for _ in range(others)]
        rng.shuffle(jobs)

        async def run(i, prompt, delay):
            await anyio.sleep(delay)
            r = await kinfer.generate(prompt, model, **opts(i if i is not None else 1000 + rng.randrange(1000)))
            if i is not None:
                mixed[i] = r.tokens

        async with anyio.create_task_group() as tg:
            for k, (i, prompt) in enumerate(jobs):
                tg.start_soon(run, i, prompt, 0.002 * k)
        diverge = [next((t for t, (a, b) in enumerate(zip(alone[i], mixed[i])) if a != b), None) for i in range(n)]
        out[mode] = {"identical": sum(d is None for d in diverge), "of": n, "firstDivergence": diverge}
    return out


async def main_async(args) -> int:
    report: dict = {"model": args.model, "rounds": [], "checks": []}
    rc = 1
    log = open(args.server_log, "wb")
    kinfer = AsyncClient(stderr=log)
    try:
        async with kinfer:
            t0 = time.perf_counter()
            extra = {} if args.reproducible is None else {"reproducible": args.reproducible == "true"}
            extra.update(args.load_options)
            loaded = await kinfer.load(
                args.model, gpuLayers=args.gpu_layers, slots=max(args.at_once), contextLength=args.context, **extra
            )
            report["loadSeconds"] = round(time.perf_counter() - t0, 2)
            status = (await kinfer.request("model/status", {"model": loaded.model}))["models"][0]
            report["load"] = {
                "gpuLayers": loaded.gpu_layers,
                "placement": status.get("placement"),
                "memory": status.get("memory"),
                "reproducible": status.get("reproducible"),
                **{k: v for k, v in (("splitMode", loaded.split_mode), ("mainGpu", loaded.main_gpu)) if v is not None},
                **({"devices": [(d.device, d.layers) for d in loaded.devices]} if loaded.devices else {}),
            }
            check(loaded.gpu_layers >= args.gpu_layers, f"the load kept {loaded.gpu_layers} layers on the GPU, not all")
            where = "cpu" if args.gpu_layers == 0 else "gpu"  # --gpu-layers 0 checks this script on a CPU
            check((status.get("memory") or {}).get("device") == where, f"the model is not on the {where}: {status}")
            report["checks"].append(f"loaded, every layer on the {where}")
            for n in args.at_once:
                r = await one_round(kinfer, loaded.model, n, args.max_tokens, args.cancel_every if n > 1 else 0)
                report["rounds"].append(r)
                print(json.dumps(r), flush=True)
            report["checks"].append("every request streamed its reply or was cancelled with its partial one")
            if args.probe:
                report["probe"] = await probe(kinfer, loaded.model, args.probe, args.probe_others, args.probe_tokens)
                print(json.dumps({"probe": report["probe"]}), flush=True)
            await kinfer.unload(loaded.model)
            left = (await kinfer.request("model/status", {}))["models"]
            check(left == [], f"after unload the server still holds {left}")
            report["checks"].append("unloaded")
        code = kinfer.returncode
        check(code == 0, f"kinfer-rpc exited with {code} after shutdown/exit")
        report["checks"].append("shut down, exit code 0")
        rc = 0
    except Exception as exc:  # a check, or the server died: report it as a failure
        while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]  # raised inside the client's task group
        report["failed"] = str(exc) if isinstance(exc, Failed) else f"{type(exc).__name__}: {exc}"
    finally:
        log.close()
    report["exitCode"] = kinfer.returncode
    print(json.dumps(report) if args.json else _markdown(report), flush=True)
    return rc


def _markdown(report: dict) -> str:
    lines = [f"## kinfer-rpc end to end: {report['model']}", ""]
    if "load" in report:
        lines.append(f"load: {report.get('loadSeconds')} s, {json.dumps(report['load'])}")
        lines.append("")
    if report["rounds"]:
        lines += ["| at once | cancelled | tokens | seconds | tok/s |", "|---:|---:|---:|---:|---:|"]
        lines += [
            f"| {r['atOnce']} | {r['cancelled']} | {r['tokens']} | {r['seconds']} | {r['tokPerSecond']} |"
            for r in report["rounds"]
        ]
        lines.append("")
    for mode, p in (report.get("probe") or {}).items():
        lines.append(
            f"reproducibility probe, {mode}: {p['identical']} of {p['of']} identical alone and among others "
            f"(first divergence at tokens {p['firstDivergence']})"
        )
    lines += [f"- {c}" for c in report["checks"]]
    lines.append(f"**FAILED**: {report['failed']}" if "failed" in report else "**passed**")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--at-once", default="1,32,128", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--cancel-every", type=int, default=4, help="cancel every Nth request of a round (0: none)")
    p.add_argument("--gpu-layers", type=int, default=999)
    p.add_argument("--context", type=int, default=1024, help="one slot's context")
    p.add_argument("--server-log", default="kinfer-rpc.log")
    p.add_argument("--probe", type=int, default=0, help="reproducibility probe: this many requests alone vs mixed")
    p.add_argument("--probe-others", type=int, default=24)
    p.add_argument("--probe-tokens", type=int, default=128)
    p.add_argument(
        "--reproducible",
        choices=["true", "false"],
        default=None,
        help="the load's reproducible option (false: llama.cpp's stock CUDA kernels: what the promise costs)",
    )
    p.add_argument(
        "--load-options",
        type=json.loads,
        default={},
        help='more model/load options, a JSON object (e.g. \'{"splitMode": "layer"}\' on several GPUs)',
    )
    p.add_argument("--json", action="store_true")
    return anyio.run(main_async, p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
