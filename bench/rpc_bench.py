"""What serving a model over llama.cpp RPC servers costs, through `kinfer-rpc` as a client runs it.

    LLAMA_CPP_LIB_PATH=.llama/lib python bench/rpc_bench.py [MODEL.gguf] [--servers HOST:PORT,...]
        [--start 2] [--device DEV] [--threads 1] [--gpu-layers -1] [--tensor-split 0,1] [--npl 1,8]
        [--npp 128] [--ntg 32] [--kv-type q8_0]

The same model is loaded twice in one `kinfer-rpc`: here (no rpcServers) and spread over RPC
servers (`rpcServers`, every layer off this host's CPU unless `--gpu-layers` says otherwise).
`--start N` starts N `kinfer rpc-server` processes on 127.0.0.1 (ended by pid at the end);
`--servers` names running ones instead (another host's, say). `--device` picks the devices the
started servers serve (e.g. CUDA0); `--tensor-split` is the RPC load's `tensorSplit` (this host's
GPUs come first in the device list, then the servers': `0,1` on a one-GPU host puts every layer on
the server). For each load it measures:

- `prompt_tps`: one request of `--npp` prompt tokens, its prompt time (timings.promptMs);
- `decode_tps` at each `--npl`: that many requests of `--npp` distinct prompt tokens at once,
  `--ntg` tokens each (greedy, end of generation ignored); generated tokens over the wall time
  from the last first token to the last reply (the decode part only).

One JSON line a case (bench/harness.py's format) with `load` ("local" or "rpc") and `npl`, then a
`ratio` line per case: rpc over local. A model's default is the embedded one.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from harness import emit

from kinfer_rpc.client import Client
from kinfer_rpc.default_plugins.llama import rpc as llama_rpc

KINFER = os.environ.get("KINFER") or os.path.join(os.path.dirname(sys.executable), "kinfer")


def start_servers(n: int, threads: int, device: str | None = None) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    procs, endpoints = [], []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = [KINFER, "rpc-server", "--port", str(port), "--threads", str(threads)]
        if device:
            argv += ["--device", device]
        quiet = subprocess.DEVNULL
        procs.append(subprocess.Popen(argv, stdout=quiet, stderr=quiet, start_new_session=True))
        endpoint = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                llama_rpc.probe(endpoint, timeout=1)
                break
            except ConnectionError:
                if procs[-1].poll() is not None:
                    why = "kinfer rpc-server exited: is LLAMA_CPP_LIB_PATH kinfer's llama.cpp build?"
                    raise SystemExit(why) from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        endpoints.append(endpoint)
    return procs, endpoints


def measure(c: Client, model: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(1)

    def prompt() -> list[int]:  # ids every vocabulary has
        return [rng.randrange(100, 1000) for _ in range(args.npp)]

    greedy = {"temperature": 0, "ignoreEos": True}

    def generate(max_tokens: int) -> dict[str, Any]:
        params = {"model": model, "tokens": prompt(), "options": {**greedy, "maxTokens": max_tokens}}
        result: dict[str, Any] = c.request("inference/generate", params)
        return result

    generate(2)  # warm
    r = generate(1)
    out: dict[str, Any] = {"prompt_tps": round(args.npp / (r["timings"]["promptMs"] / 1000), 1)}
    for n in args.npl:
        with ThreadPoolExecutor(n) as pool:
            t0 = time.perf_counter()
            results = list(pool.map(lambda _: generate(args.ntg), range(n)))
            wall = time.perf_counter() - t0
        first = max((res["timings"]["queueMs"] + res["timings"]["promptMs"]) / 1000 for res in results)
        tokens = sum(res["usage"]["completionTokens"] - 1 for res in results)  # after each first token
        out[f"decode_tps_{n}"] = round(tokens / max(1e-9, wall - first), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--servers", default="", help="running RPC servers, comma-separated host:port")
    ap.add_argument("--start", type=int, default=2, help="start this many local servers (without --servers)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads: kinfer's and each started server's")
    ap.add_argument("--device", default=None, help="devices the started servers serve (default: all)")
    ap.add_argument("--gpu-layers", type=int, default=-1)
    ap.add_argument("--tensor-split", type=lambda s: [float(x) for x in s.split(",")], default=None)
    ap.add_argument("--npl", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=32)
    ap.add_argument("--kv-type", default="q8_0")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    procs: list[subprocess.Popen[bytes]] = []
    if args.servers:
        endpoints = args.servers.split(",")
    else:
        procs, endpoints = start_servers(args.start, args.threads, args.device)
    try:
        with Client() as c:
            base = {
                "contextLength": args.context,
                "slots": max(args.npl),
                "threads": args.threads,
                "kvType": args.kv_type,
                "batch": 512,
            }
            records = {}
            remote: dict[str, Any] = {"rpcServers": endpoints, "gpuLayers": args.gpu_layers}
            if args.tensor_split:
                remote["tensorSplit"] = args.tensor_split
            for load, extra in (("local", {}), ("rpc", remote)):
                params: dict[str, Any] = {"options": {**base, **extra}}
                if args.model:
                    params["model"] = args.model
                described = c.request("model/load", params)
                records[load] = measure(c, described["model"], args)
                where = [(d.get("device"), d.get("layers")) for d in described.get("devices", [])]
                servers = endpoints if load == "rpc" else []
                emit(load, {"load": load, "servers": servers, "devices": where, **records[load]})
                c.request("model/unload", {"model": described["model"]})
            ratio = {k: round(records["rpc"][k] / records["local"][k], 3) for k in records["local"]}
            emit("ratio", {"load": "rpc/local", **ratio})
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


if __name__ == "__main__":
    main()
