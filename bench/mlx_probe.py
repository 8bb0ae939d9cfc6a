"""Where the mlx backend's decode step spends its time, beside mlx-lm's plain forward, per batch.

    python bench/mlx_probe.py MODEL [--rows 1,32,128] [--npp 64] [--steps 20] [--weights dense]

For each row count B: B sequences hold --npp tokens each, then --steps decode passes of one token
a sequence are timed (ms a pass, each pass evaluated before the next unless said):

- `mlx-lm`: the model called on (B, 1) tokens with mlx-lm's own KVCache (every row at the same
  offset, no mask): the step mlx-lm's generators build, less their bookkeeping.
- `kinfer step`: MlxModel.decode over the B rows, logits of every row read (host argmax).
- `kinfer greedy`: every row greedy (device argmax), the next pass chained on the device, as the
  engine runs.
- `... first`: the first pass at that shape (the compile and, on CUDA, kernel JIT cost).
- variants of the compiled pass with parts taken out, to see what each costs: `no kv write`,
  `uncompiled`.

`--graph` instead prints the primitives of one decode pass of one row, kinfer's compiled pass
beside mlx-lm's forward, per layer (each primitive is at most one kernel launch: on CUDA the host
time of a pass grows with their number).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx
import numpy as np
from harness import distinct_prompts as prompts_for
from harness import emit

from kinfer_rpc.default_plugins import mlx as kinfer_mlx
from kinfer_rpc.default_plugins.mlx import cells as mlx_cells
from kinfer_rpc.types import LoadOptions, SeqChunk


def timed(fn, steps: int) -> tuple[float, float]:
    t = time.perf_counter()
    fn(0)
    first = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(1, steps + 1):
        fn(i)
    return first * 1000, (time.perf_counter() - t) * 1000 / steps


def prompts(B: int, npp: int) -> list[list[int]]:
    return prompts_for(B, npp, 40200)  # ids 100..40099: within every vocabulary the bench uses


def mlx_lm_rows(model, B: int, npp: int, steps: int) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompts(B, npp)), cache=cache))
    tok = mx.ones((B, 1), dtype=mx.int32)
    out = {}

    def sync(i):
        nonlocal tok
        tok = mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)[:, None].astype(mx.int32)
        mx.eval(tok)

    out["mlx-lm first"], out["mlx-lm"] = timed(sync, steps)
    # generate_step's pipelining: the next pass queued before the last one's tokens are read.
    nxt = mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)[:, None].astype(mx.int32)
    mx.async_eval(nxt)

    def piped(i):
        nonlocal nxt
        cur = nxt
        nxt = mx.argmax(model(cur, cache=cache)[:, -1], axis=-1)[:, None].astype(mx.int32)
        mx.async_eval(nxt)
        np.asarray(cur)

    out["mlx-lm piped first"], out["mlx-lm piped"] = timed(piped, steps)
    mx.eval(nxt)
    mx.clear_cache()
    return out


def kinfer_rows(m: kinfer_mlx.MlxModel, B: int, npp: int, steps: int, label: str = "kinfer") -> dict:
    for b in range(B):
        m.seq_remove(b)
    m.decode([SeqChunk(b, 0, p, 1) for b, p in enumerate(prompts(B, npp))])()
    out = {}
    pos = [npp] * B

    def host(i):
        chunks = [SeqChunk(b, pos[b], [1], 1) for b in range(B)]
        logits = m.decode(chunks)()
        np.argmax(logits, axis=1)
        for b in range(B):
            pos[b] += 1

    out[f"{label} step first"], out[f"{label} step"] = timed(host, steps)
    for b in range(B):
        m.set_device_greedy(b, True)
    tokens = [1] * B

    split = {"call": 0.0, "wait": 0.0, "chained": 0}
    chained = None  # the pass chained to the one running, as the engine's _chain makes

    def greedy(i):
        nonlocal tokens, chained
        t = time.perf_counter()
        if chained is None:
            wait = m.decode([SeqChunk(b, pos[b], [tokens[b]], 1) for b in range(B)])
        else:
            wait = chained
        try:
            chained = m.decode_chained()
            split["chained"] += 1
        except ValueError:
            chained = None
        t1 = time.perf_counter()
        wait()
        tokens = m.sampled_tokens()
        split["wait"] += time.perf_counter() - t1
        split["call"] += t1 - t
        for b in range(B):
            pos[b] += 1

    out[f"{label} greedy first"], out[f"{label} greedy"] = timed(greedy, steps)
    if chained is not None:  # the last chained pass, not used: its cells go
        chained()
        for b in range(B):
            m.seq_remove(b, pos[b], -1)
    # host time launching passes vs waiting, and passes chained on the device (the engine's
    # steady state) out of steps + 1
    out[f"{label} greedy: ms launching"] = split["call"] * 1000 / (steps + 1)
    out[f"{label} greedy: ms waiting"] = split["wait"] * 1000 / (steps + 1)
    out[f"{label} greedy: passes chained"] = split["chained"]
    for b in range(B):
        m.set_device_greedy(b, False)
    return out


def ablate(m: kinfer_mlx.MlxModel, B: int, npp: int, steps: int) -> dict:
    """The decode pass (uncompiled, every row greedy on the device, no pass chained) with
    parts of the attention swapped for mlx-lm's, to see which part costs what at B rows."""
    if m.kernel:
        raise SystemExit(
            "--ablate swaps the decode pass's KV writes, which the attention kernel makes: run it with"
            " KINFER_MLX_ATTENTION=0"
        )
    T = mlx_cells._Traced
    init, upd, mask = T.__init__, T.update_and_fetch, T.make_mask
    compile_, chain = kinfer_mlx.mx.compile, kinfer_mlx.MlxModel.decode_chained
    kinfer_mlx.mx.compile = lambda f, **k: f

    def unchained(self):
        raise ValueError("no pass chained")

    kinfer_mlx.MlxModel.decode_chained = unchained

    def int_offset(self, *a):  # rope at one int offset for every row (mlx-lm's KVCache)
        init(self, *a)
        if self.slots.shape[0] > 1:
            self.offset = npp

    def no_write(self, k, v):
        K, V = self.keys[self.layer], self.values[self.layer]
        return K[: k.shape[0], :, : self.span], V[: k.shape[0], :, : self.span]

    def exact(self, k, v):  # write, then read only the cells written so far (no mask needed)
        K, V = upd(self, k, v)
        return K[:, :, : npp + 1], V[:, :, : npp + 1]

    variants = {
        "base": {},
        "mask None": {"make_mask": lambda self, *a, **k: None},
        "int offset": {"__init__": int_offset},
        "no kv write": {"update_and_fetch": no_write},
        "exact span, mask None": {"update_and_fetch": exact, "make_mask": lambda self, *a, **k: None},
        "int offset, mask None, no write": {
            "__init__": int_offset,
            "update_and_fetch": no_write,
            "make_mask": lambda self, *a, **k: None,
        },
    }
    out = {}
    try:
        for name, patch in variants.items():
            for k, v in patch.items():
                setattr(T, k, v)
            m._compiled.clear()
            r = kinfer_rows(m, B, npp, steps, name)
            out[name] = r[f"{name} greedy"]
            T.__init__, T.update_and_fetch, T.make_mask = init, upd, mask
    finally:
        T.__init__, T.update_and_fetch, T.make_mask = init, upd, mask
        kinfer_mlx.mx.compile, kinfer_mlx.MlxModel.decode_chained = compile_, chain
        m._compiled.clear()
    return out


def batch_kv(model, B: int, npp: int, steps: int) -> dict:
    """mlx-lm's BatchKVCache (per-row offsets as an array, an array mask), no left padding."""
    from mlx_lm.models.cache import BatchKVCache

    cache = [BatchKVCache([0] * B) for _ in model.layers]
    mx.eval(model(mx.array(prompts(B, npp)), cache=cache))
    tok = mx.ones((B, 1), dtype=mx.int32)

    def sync(i):
        nonlocal tok
        tok = mx.argmax(model(tok, cache=cache)[:, -1], axis=-1)[:, None].astype(mx.int32)
        mx.eval(tok)

    first, each = timed(sync, steps)
    mx.clear_cache()
    return {"mlx-lm BatchKVCache": each}


def graph(m: kinfer_mlx.MlxModel, npp: int) -> dict:
    """Primitive counts (per layer) of one decode pass of one row, kinfer's vs mlx-lm's."""
    import collections
    import re
    import tempfile

    from mlx_lm.models.cache import make_prompt_cache

    def count(*arrays) -> dict:
        with tempfile.NamedTemporaryFile("r", suffix=".dot") as fh:
            mx.export_to_dot(fh.name, *arrays)
            names = re.findall(r'label\s*=\s*"([A-Za-z]+)', fh.read())
        return {k: round(v / m.layers, 2) for k, v in collections.Counter(names).most_common()}

    m.seq_remove(0)
    m.decode([SeqChunk(0, 0, prompts(1, npp)[0], 1)])()
    cells = m.cells
    cells.reserve(npp + 2)
    fn = m._compiled_step([0], npp)
    i32 = mx.int32
    out, keys, values = fn(
        mx.array([[1]], dtype=i32),
        mx.array([0], dtype=i32),
        mx.array([[npp]], dtype=i32),
        mx.array([npp], dtype=i32),
        mx.array([0], dtype=i32),
        cells.keys,
        cells.values,
    )
    ours = count(out, *keys, *values)
    mx.eval(out)
    cache = make_prompt_cache(m.model)
    mx.eval(m.model(mx.array(prompts(1, npp)), cache=cache))
    o = m.model(mx.ones((1, 1), dtype=i32), cache=cache)
    theirs = count(o, *[c.keys for c in cache], *[c.values for c in cache])
    mx.eval(o)
    return {
        "kinfer": ours,
        "mlx-lm": theirs,
        "kinfer total": round(sum(ours.values()), 1),
        "mlx-lm total": round(sum(theirs.values()), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", default="1,32,128")
    ap.add_argument("--npp", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--weights", default="dense")
    ap.add_argument("--out")
    ap.add_argument("--skip", default="", help="comma list of: mlx-lm, kinfer, nokv, uncompiled")
    ap.add_argument("--ablate", action="store_true", help="only the ablations (uncompiled) and mlx-lm's caches")
    ap.add_argument("--graph", action="store_true", help="only the primitives of a one-row pass, per layer")
    a = ap.parse_args()
    rows = [int(x) for x in a.rows.split(",")]
    skip = set(a.skip.split(","))
    ctx = a.npp + 3 * a.steps + 16
    opts = LoadOptions(context_length=ctx, slots=max(rows), batch=4096, weights=a.weights)
    t = time.perf_counter()
    m = kinfer_mlx.MlxBackend().load(a.model, opts, lambda p: None)
    print(f"load {time.perf_counter() - t:.1f} s, weights {m.weights}, device {m.device}", file=sys.stderr, flush=True)
    if a.graph:
        emit("graph", graph(m, a.npp))
        return
    results = {}
    for B in rows:
        r = {}
        if a.ablate:
            r.update(ablate(m, B, a.npp, a.steps))
            r.update({k: v for k, v in mlx_lm_rows(m.model, B, a.npp, a.steps).items() if "first" not in k})
            r.update(batch_kv(m.model, B, a.npp, a.steps))
            results[B] = {k: round(v, 2) for k, v in r.items()}
            emit("pass", {"rows": B, **results[B]})
            continue
        if "kinfer" not in skip:
            r.update(kinfer_rows(m, B, a.npp, a.steps))
        if "nokv" not in skip and not m.kernel:  # (with the kernel, the writes are part of its launch)
            orig = mlx_cells._Traced.update_and_fetch

            def no_write(self, k, v):  # read the cells but write nothing (what the scatter costs)
                K, V = self.keys[self.layer], self.values[self.layer]
                if self.first is not None:
                    return (
                        mx.slice(K, self.first, (0,), (k.shape[0], K.shape[1], self.span, K.shape[3])),
                        mx.slice(V, self.first, (0,), (k.shape[0], V.shape[1], self.span, V.shape[3])),
                    )
                return K[self.slots, :, : self.span], V[self.slots, :, : self.span]

            mlx_cells._Traced.update_and_fetch = no_write
            m._compiled.clear()
            r.update({k: v for k, v in kinfer_rows(m, B, a.npp, a.steps, "no kv write").items() if "greedy" not in k})
            mlx_cells._Traced.update_and_fetch = orig
            m._compiled.clear()
        if "uncompiled" not in skip:
            compile_ = kinfer_mlx.mx.compile
            kinfer_mlx.mx.compile = lambda f, **k: f
            m._compiled.clear()
            r.update({k: v for k, v in kinfer_rows(m, B, a.npp, a.steps, "uncompiled").items() if "greedy" not in k})
            kinfer_mlx.mx.compile = compile_
            m._compiled.clear()
        if "mlx-lm" not in skip:
            r.update(mlx_lm_rows(m.model, B, a.npp, a.steps))
        results[B] = {k: round(v, 2) for k, v in r.items()}
        emit("pass", {"rows": B, **results[B]})
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1)
    names = list(next(iter(results.values())))
    print("| ms a pass | " + " | ".join(f"{B} rows" for B in results) + " |")
    print("|---|" + "---:|" * len(results))
    for n in names:
        print(f"| {n} | " + " | ".join(f"{results[B].get(n, '')}" for B in results) + " |")


if __name__ == "__main__":
    main()
