"""An editor's completions on a shared daemon while another client floods it: latency per
completion, idle and under the flood, in one run.

    python bench/fair_bench.py [--completions 20] [--flood 64] [--flood-tokens 256]

Starts `kinfer serve` on a socket of its own (KINFER_HOME in a temporary folder), loads a copy of
the embedded SmolLM2 with fill-in-the-middle tokens (tests/modelgen/make_fim_model.py) and sends,
through `kinfer-rpc --attach` as an editor does, --completions `inference/infill` requests one
after the other (each awaited, 16 tokens at most, a line), first with nothing else running, then
while a second connection streams --flood long replies (--flood-tokens each, end of generation
ignored) on the same model. Prints one JSON line per phase (p50, p95, max in ms) and the ratio of
the flooded p95 to the idle one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "modelgen"))

from make_fim_model import make_fim_model  # noqa: E402

from kinfer_rpc.client import AsyncClient  # noqa: E402

BIN = Path(sys.executable).parent
PREFIX = "def fibonacci(n):\n    if n < 2:\n        return n\n    return "
SUFFIX = "\n\n\ndef main():\n    print(fibonacci(10))\n"


def q(values: list[float], p: float) -> float:
    v = sorted(values)
    return round(v[min(len(v) - 1, int(len(v) * p))] * 1000, 1)


async def completions(client: AsyncClient, model: str, n: int) -> list[float]:
    times = []
    for i in range(n):
        t = time.perf_counter()
        await client.infill(PREFIX + " " * (i % 3), SUFFIX, model, maxTokens=16, stopAtLine=True, temperature=0)
        times.append(time.perf_counter() - t)
    return times


async def main_async(args: argparse.Namespace, sock: Path, env: dict[str, str], model: str) -> None:
    attach = [str(BIN / "kinfer-rpc"), "--attach", "--socket", str(sock)]
    async with AsyncClient(attach, env=env) as editor:
        extra = {"threads": args.threads} if args.threads else {}
        loaded = await editor.load(model, slots=args.slots, **extra)
        await completions(editor, loaded.model, 2)  # warm-up
        idle = await completions(editor, loaded.model, args.completions)
        async with AsyncClient(attach, env=env) as agent:
            await agent.load(loaded.model)
            started = anyio.Event()
            flooded: list[float] = []

            async def flood() -> None:
                async with anyio.create_task_group() as tg:
                    for i in range(args.flood):

                        async def one(i: int = i) -> None:
                            async for _ in agent.stream_generate(
                                f"Story {i}: once upon a time",
                                loaded.model,
                                maxTokens=args.flood_tokens,
                                ignoreEos=True,
                                temperature=0.8,
                                seed=i,
                            ):
                                started.set()

                        tg.start_soon(one)

            async with anyio.create_task_group() as tg:
                tg.start_soon(flood)
                await started.wait()
                await anyio.sleep(1.0)  # every slot the flood may take is taken
                flooded = await completions(editor, loaded.model, args.completions)
                tg.cancel_scope.cancel()
    for phase, times in (("idle", idle), ("flooded", flooded)):
        print(
            json.dumps(
                {
                    "bench": "fair_bench",
                    "case": phase,
                    "n": len(times),
                    "p50_ms": q(times, 0.5),
                    "p95_ms": q(times, 0.95),
                    "max_ms": q(times, 1.0),
                    "slots": args.slots,
                    "flood": args.flood if phase == "flooded" else 0,
                }
            ),
            flush=True,
        )
    print(
        json.dumps(
            {
                "bench": "fair_bench",
                "case": "ratio",
                "p50": round(q(flooded, 0.5) / q(idle, 0.5), 2),
                "p95": round(q(flooded, 0.95) / q(idle, 0.95), 2),
            }
        ),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--completions", type=int, default=20)
    ap.add_argument("--flood", type=int, default=64)
    ap.add_argument("--flood-tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="the load's threads (default: kinfer's choice)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kinfer-fair-") as tmp:
        home = Path(tmp)
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        env["KINFER_HOME"] = str(home)
        sock = home / "kinfer.sock"
        model = str(make_fim_model(home / "fim.gguf"))
        daemon = subprocess.Popen([str(BIN / "kinfer"), "serve", "--socket", str(sock)], env=env)
        try:
            while not sock.exists():
                time.sleep(0.05)
            anyio.run(main_async, args, sock, env, model)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)


if __name__ == "__main__":
    main()
