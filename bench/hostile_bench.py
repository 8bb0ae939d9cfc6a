"""A plain chat's latency while another connection keeps hostile renders and slow compiles in
flight on the same model, against the same chats on an idle daemon, in one run; and how fast a
cancel of a compiling request is answered.

    python bench/hostile_bench.py [--chats 10] [--renders 40] [--compiles 40]

Starts `kinfer serve` on a socket of its own (KINFER_HOME in a temporary folder, render time
limit 60 s) and loads a copy of the embedded SmolLM2 whose chat template hangs on one message
(tests/test_reliability_templates.py's "slow" probe: nested loops that run until the limit) and
renders every other as ChatML. Through `kinfer-rpc --attach`, a plain client sends --chats
chats one after the other (8 tokens, greedy), first on the idle daemon, then while a second
connection has --renders chats with the hanging message and --compiles generates held to a JSON
schema of 9,000 properties (about 8 s to compile on a 2-core CPU) in flight. Then the hostile
connection sends one more such generate and cancels it after 0.5 s. One JSON line a phase (p50,
p95, max in ms), the ratio of the loaded p95 to the idle one, and the cancel's answer time.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from rpcclient import RpcClient  # noqa: E402
from test_reliability_templates import BOUNDED, embedded_gguf, gguf_with_string, hostile_template  # noqa: E402

BIN = Path(sys.executable).parent


def q(values: list[float], p: float) -> float:
    v = sorted(values)
    return round(v[min(len(v) - 1, int(len(v) * p))] * 1000, 1)


def chat(path: str, content: str) -> dict:
    options = {"maxTokens": 8, "temperature": 0}
    return {"model": path, "messages": [{"role": "user", "content": content}], "options": options}


def plain_chats(c: RpcClient, path: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        answer = c.request("inference/chat", chat(path, "benign"), timeout=600)
        assert "result" in answer, answer
        times.append(time.perf_counter() - t)
    return times


def schema() -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(9000)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chats", type=int, default=10)
    ap.add_argument("--renders", type=int, default=40)
    ap.add_argument("--compiles", type=int, default=40)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kinfer-hostile-") as tmp:
        home = Path(tmp)
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        env.update(KINFER_HOME=str(home), KINFER_RENDER_SECONDS="60")
        sock = home / "kinfer.sock"
        path = str(home / "hostile.gguf")
        gguf_with_string(embedded_gguf(), path, "tokenizer.chat_template", hostile_template("", BOUNDED))
        daemon = subprocess.Popen([str(BIN / "kinfer"), "serve", "--socket", str(sock)], env=env)
        attach = ("--attach", "--socket", str(sock))
        try:
            while not sock.exists():
                time.sleep(0.05)
            plain = RpcClient.spawn(*attach, env=env, executable=str(BIN / "kinfer-rpc"))
            hostile = RpcClient.spawn(*attach, env=env, executable=str(BIN / "kinfer-rpc"))
            for c in (plain, hostile):
                c.initialize()
                c.call("model/load", {"model": path, "options": {"contextLength": 512, "slots": 4}}, timeout=120)
            plain_chats(plain, path, 2)  # warm-up
            idle = plain_chats(plain, path, args.chats)
            gen = {"model": path, "prompt": "Say", "options": {"maxTokens": 1, "format": schema()}}
            for _ in range(args.renders):
                hostile.request_async("inference/chat", chat(path, "slow"))
            for _ in range(args.compiles):
                hostile.request_async("inference/generate", gen)
            time.sleep(1.0)  # every worker and compile the hostile connection may take is busy
            loaded = plain_chats(plain, path, args.chats)
            rid = hostile.request_async("inference/generate", gen)
            time.sleep(0.5)
            t = time.perf_counter()
            hostile.cancel(rid)
            cancelled = hostile.response(rid, timeout=600)
            cancel_ms = round((time.perf_counter() - t) * 1000, 1)
            for phase, times in (("idle", idle), ("hostile", loaded)):
                record = {"bench": "hostile_bench", "case": phase, "n": len(times), "p50_ms": q(times, 0.5)}
                record.update(p95_ms=q(times, 0.95), max_ms=q(times, 1.0))
                if phase == "hostile":
                    record.update(renders=args.renders, compiles=args.compiles)
                record["ms"] = [round(t * 1000, 1) for t in times]
                print(json.dumps(record), flush=True)
            ratio = {"p50": round(q(loaded, 0.5) / q(idle, 0.5), 2), "p95": round(q(loaded, 0.95) / q(idle, 0.95), 2)}
            print(json.dumps({"bench": "hostile_bench", "case": "ratio", **ratio}), flush=True)
            code = cancelled.get("error", {}).get("code")
            print(json.dumps({"bench": "hostile_bench", "case": "cancel", "ms": cancel_ms, "code": code}), flush=True)
            plain.kill()
            hostile.kill()
        finally:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()


if __name__ == "__main__":
    main()
