"""What splitting a model over the GPUs of one host costs or gains, through `kinfer-rpc` as a client
runs it.

    LLAMA_CPP_LIB_PATH=... python bench/split_bench.py [MODEL.gguf] [--splits none,layer,row,tensor]
        [--npl 1,32,128] [--npp 128] [--ntg 64] [--context 512] [--kv-type f16] [--threads N]

One `kinfer-rpc`; the same model is loaded once per split mode (`splitMode`, the placement `auto`
deciding the rest: every layer on the GPUs for a model that fits them), measured, and unloaded.
`none` is the model on one GPU (the placement's pick, the one with the most free memory). For each
load it measures, as bench/rpc_bench.py does:

- `prompt_tps`: one request of `--npp` prompt tokens, its prompt time (timings.promptMs);
- `decode_tps_N` at each `--npl` N: N requests of `--npp` distinct prompt tokens at once, `--ntg`
  tokens each (greedy, end of generation ignored); generated tokens over the wall time from the
  last first token to the last reply.

One JSON line a split (bench/harness.py's format) with what the load reports (`splitMode`,
`tensorSplit`, `mainGpu`, `devices`, `reproducible`), or `error` when the load failed (llama.cpp
refuses `row` on CUDA), then a `ratio` line per split over `none`. A model's default is the
embedded one.
"""

from __future__ import annotations

import argparse
from typing import Any

from harness import emit
from rpc_bench import measure

from kinfer_rpc.client import Client, RpcError


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--splits", type=lambda s: s.split(","), default=["none", "layer", "row", "tensor"])
    ap.add_argument("--npl", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128])
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="one slot's context (prompt + reply fit in it)")
    ap.add_argument("--kv-type", default="f16")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    with Client() as c:
        base: dict[str, Any] = {"contextLength": args.context, "slots": max(args.npl), "kvType": args.kv_type}
        if args.threads:
            base["threads"] = args.threads
        records: dict[str, dict[str, Any]] = {}
        for split in args.splits:
            params: dict[str, Any] = {"options": {**base, "splitMode": split}}
            if args.model:
                params["model"] = args.model
            try:
                loaded = c.request("model/load", params)
            except RpcError as exc:
                emit(split, {"splitMode": split, "error": f"{exc.code}: {exc.message}"})
                continue
            try:
                records[split] = measure(c, loaded["model"], args)
            finally:
                c.request("model/unload", {"model": loaded["model"]})
            where = [(d.get("device"), d.get("layers")) for d in loaded.get("devices", [])]
            said = {k: loaded.get(k) for k in ("splitMode", "tensorSplit", "mainGpu", "gpuLayers")}
            emit(split, {**said, "devices": where, "reproducible": loaded["reproducible"], **records[split]})
        one = records.get("none")
        for split, record in records.items():
            if one is not None and split != "none":
                emit("ratio", {"splitMode": f"{split}/none", **{k: round(record[k] / one[k], 3) for k in one}})


if __name__ == "__main__":
    main()
