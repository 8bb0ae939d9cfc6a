"""What any loop that samples its tokens can reach through llama.cpp: kinfer's llama backend
driven alone (no engine, no requests), in passes shaped like llama-batched-bench's.

    python bench/loop_bench.py MODEL.gguf --npl 32,64,128 --gpu-layers 99

For each N in --npl: N sequences (one KV stream each, as `prefix -1`), an --npp-token prompt
each, then --ntg passes of one token per sequence, every row asking for its logits. Two loops
over the same passes:

- blind: each pass feeds a token nobody reads the logits for, as llama-batched-bench does. On a
  GPU llama_decode returns once the pass is queued, so the next call prepares its pass (batch,
  KV cells, inputs) while the GPU still runs this one.
- wait: each pass waits for the one before (its logits are ready to read), then feeds a token
  without reading them: what waiting for a pass costs, the argmax left out.
- greedy: each pass feeds the argmax of the one before, as a server must. The loop waits for
  the pass, takes the argmax with the engine's own code (Chooser.argmax) and only then calls
  llama_decode for the next.
- device (only with llama.cpp patched, patches/llama-output-argmax.patch): as greedy, but the
  pass takes the argmax in its graph and copies back token ids, no logits.
- next: as device, but each pass after the first is the last one a token further
  (decode_next), as the engine's steady step.
- busy: as next, with host work of about --busy-ms between starting a pass and waiting for it
  (Python objects built and dropped, dicts and lists walked), as the engine's bookkeeping and
  text work: whether work done while a pass runs makes the next llama_decode call slower.

Prints one JSON object per line: decode tok/s of each loop and the time of its llama_decode call.
"""

from __future__ import annotations

import argparse
import threading
import time

from harness import emit

from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.engine.choosing import Chooser
from kinfer_rpc.types import LoadOptions, SeqChunk

# An engine never started, for its argmax over a pass's rows (split over threads as it splits it).
argmax = Chooser(lambda job, token: False).argmax
# The loops whose passes take the argmax in their graph (patched llama.cpp).
DEVICE_MODES = ("device", "next", "busy")


def busy(ms: float) -> None:
    """About `ms` of host work of the engine's kind: small objects built, walked and dropped."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        rows = [{"seq": i, "text": str(i) * 3, "tokens": [i, i + 1]} for i in range(64)]
        sum(len(r["text"]) + len(r["tokens"]) for r in rows)


def run(path: str, npl: int, args) -> dict:
    opts = LoadOptions(
        context_length=args.npp + args.ntg + 8,
        slots=npl,
        batch=2048,
        ubatch=512,
        threads=args.threads,
        gpu_layers=args.gpu_layers,
        flash_attention=True,
        kv_type="f16",
    )
    model = LlamaBackend().load(path, opts, lambda f: None)
    vocab = model.info.n_vocab
    out = {"engine": "loop", "npl": npl, "npp": args.npp, "ntg": args.ntg}
    try:
        modes = ("blind", "wait", "greedy") + (DEVICE_MODES if model.device_greedy else ())
        modes = tuple(m for m in modes if m in args.modes.split(","))
        for mode in modes * 2:  # each twice, alternating; the best kept
            for s in range(npl):
                model.seq_remove(s)
                if model.device_greedy:
                    model.set_device_greedy(s, mode in DEVICE_MODES)
            prompts = [
                SeqChunk(s, 0, tuple((7 + 13 * s + 31 * j) % (vocab - 100) + 50 for j in range(args.npp)), 1)
                for s in range(npl)
            ]
            for i in range(0, npl, max(1, 2048 // args.npp)):
                model.decode(prompts[i : i + max(1, 2048 // args.npp)])()
            tokens = [100] * npl
            calls = 0.0
            t0 = time.perf_counter()
            wait = None
            for step in range(args.ntg):
                if mode == "greedy" and wait is not None:
                    tokens = argmax(wait())
                elif mode in DEVICE_MODES and wait is not None:
                    if mode == "busy":
                        busy(args.busy_ms)
                    wait()
                    tokens = model.sampled_tokens()
                elif mode == "wait" and wait is not None:
                    wait()
                if mode in ("next", "busy") and step:
                    launch, arg = model.decode_next, tokens
                else:
                    launch, arg = model.decode, [SeqChunk(s, args.npp + step, (tokens[s],), 1) for s in range(npl)]
                c0 = time.perf_counter()
                wait = launch(arg)
                calls += time.perf_counter() - c0
            wait()
            dt = time.perf_counter() - t0
            tps = npl * args.ntg / dt
            if tps > out.get(f"{mode}_tps", 0):
                out[f"{mode}_tps"] = round(tps, 1)
                out[f"{mode}_ms_step"] = round(1000 * dt / args.ntg, 3)
                out[f"{mode}_ms_decode_call"] = round(1000 * calls / args.ntg, 3)
        if "blind" in modes:
            for mode in modes[1:]:
                out[f"{mode}_over_blind"] = round(out[f"{mode}_tps"] / out["blind_tps"], 3)
    finally:
        model.close()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--npl", default="32,64,128")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gpu-layers", type=int, default=-1)
    ap.add_argument(
        "--modes",
        default="blind,wait,greedy,device",
        help="which loops to run (device, next, busy: patched llama.cpp only)",
    )
    ap.add_argument(
        "--thread-stack-mb",
        type=int,
        default=None,
        help="run each loop on a thread of its own with this stack (0: the default stack)",
    )
    ap.add_argument("--busy-ms", type=float, default=0.4, help="the busy loop's host work while a pass runs")
    args = ap.parse_args()
    for n in [int(x) for x in args.npl.split(",")]:
        if args.thread_stack_mb is None:
            out = run(args.model, n, args)
        else:  # on a thread of its own, as the engine's worker (whose stack is 64 MB)
            result = {}
            if args.thread_stack_mb:
                threading.stack_size(args.thread_stack_mb << 20)
            worker = threading.Thread(target=lambda: result.update(run(args.model, n, args)))
            worker.start()
            worker.join()
            out = {**result, "thread_stack_mb": args.thread_stack_mb}
        emit("loop", out)


if __name__ == "__main__":
    main()
