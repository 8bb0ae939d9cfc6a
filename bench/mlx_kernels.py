"""Checks and times the pieces of the mlx backend's decode pass on a GPU (MLX's CUDA build).

    python bench/mlx_kernels.py [--out r.json]

- `attention`: default_plugins/mlx/attention.py's kernel against MLX's own masked attention over
  gathered cells (max abs difference, random data, rows at random positions, 1 and 4 tokens a
  row), then ms for 64 calls (a 32-layer pass reads keys and values 64 times... once per layer
  here, 32 calls) against the masked fallback and against MLX's fused attention without a mask.
- `writes`: ms a pass for the KV writes of 32 layers (64 buffers of (slots, 8, cells, 128)) in
  each form the backend can use (static slice update, slice_update at a device-side start,
  scatter), evaluated each step, with the buffers also given to eval, and pipelined
  (async_eval, a pass queued before the last one is read), against copying every buffer: a
  write that costs a copy is not done in place.
- `matmul`: default_plugins/mlx/matmul.py's row-invariant products: the load check in each form,
  then on the 7.4B shape's matrices (4-bit groups of 64, and float16): whether a row gets the same
  bits alone and in a pass of 128 rows, the largest difference from MLX's own product, and ms a
  call (32 calls a graph) at 1 to 640 rows against MLX's (mx.quantized_matmul, x @ w.T), for
  both of its forms (tensor cores, mma; a float fma chain, simt: up to 32 rows), and the
  tensor-core form with 1, 2 and 4 chunks a warp loads at once.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np
from harness import emit

from kinfer_rpc.default_plugins.mlx import attention as att
from kinfer_rpc.default_plugins.mlx import matmul as mm


def check_attention() -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for B, L, HQ, HKV, D, S, C in (
        (1, 1, 32, 8, 128, 4, 768),
        (8, 1, 32, 8, 128, 8, 768),
        (128, 1, 32, 8, 128, 128, 512),
        (8, 4, 32, 8, 128, 16, 768),
        (5, 1, 9, 3, 64, 7, 300),
    ):

        def buffers():
            return (mx.array(rng.standard_normal((S, HKV, C, D)).astype(np.float16)) for _ in range(2))

        q = mx.array(rng.standard_normal((B, HQ, L, D)).astype(np.float16))
        nk = mx.array(rng.standard_normal((B, HKV, L, D)).astype(np.float16))
        nv = mx.array(rng.standard_normal((B, HKV, L, D)).astype(np.float16))
        k, v = buffers()
        kr, vr = mx.array(np.array(k)), mx.array(np.array(v))  # the same cells, written by MLX's operations
        counter = mx.zeros((B * HQ * L,), dtype=mx.int32)
        slots = mx.array(rng.permutation(S)[:B].astype(np.int32))
        start = rng.integers(0, C - L, size=B)
        cols = mx.array((start[:, None] + np.arange(L)[None]).astype(np.int32))
        scale = D**-0.5
        got = att.attention(q, nk, nv, k, v, slots, cols, scale, counter)
        mx.eval(got)
        want = att.reference(q, nk, nv, kr, vr, slots, cols, scale)
        diff = float(mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32))).item())
        writes = bool(mx.array_equal(k, kr).item() and mx.array_equal(v, vr).item())
        # a row alone gives the same bits as among the others (batch invariance of this part)
        alone = att.attention(q[:1], nk[:1], nv[:1], k, v, slots[:1], cols[:1], scale, counter)
        same = bool(mx.array_equal(alone, got[:1]).item())
        one = att.attention(q, nk, nv, k, v, slots, cols, scale, counter, heads=1)
        mx.eval(one)
        shapes = bool(
            mx.array_equal(one, att.attention(q, nk, nv, k, v, slots, cols, scale, counter, heads=HQ // HKV)).item()
        )
        out.append(
            {
                "B": B,
                "L": L,
                "HQ": HQ,
                "HKV": HKV,
                "D": D,
                "cells": C,
                "max_abs_diff": diff,
                "writes_equal": writes,
                "alone_equal": same,
                "block_shapes_equal": shapes,
                "counter_zero": not mx.any(counter).item(),
            }
        )
        emit("attention", out[-1])
    return out


def time_attention() -> list[dict]:
    rng = np.random.default_rng(1)
    out = []
    for B, C, n in ((1, 256, 100), (32, 256, 100), (128, 256, 100), (32, 2048, 1500), (128, 1024, 700)):
        HQ, HKV, D = 32, 8, 128
        q = mx.array(rng.standard_normal((B, HQ, 1, D)).astype(np.float16))
        nk = mx.array(rng.standard_normal((B, HKV, 1, D)).astype(np.float16))
        nv = mx.array(rng.standard_normal((B, HKV, 1, D)).astype(np.float16))
        k = mx.array(rng.standard_normal((B, HKV, C, D)).astype(np.float16))
        v = mx.array(rng.standard_normal((B, HKV, C, D)).astype(np.float16))
        counter = mx.zeros((B * HQ,), dtype=mx.int32)
        slots = mx.arange(B, dtype=mx.int32)
        cols = mx.array(np.full((B, 1), n - 1, dtype=np.int32) - rng.integers(0, n // 2, size=(B, 1)).astype(np.int32))
        span = -(-n // 256) * 256
        mask = (mx.arange(span)[None, None] <= cols[:, :, None])[:, None]
        cases = {
            "kernel (with the writes)": lambda: att.attention(q, nk, nv, k, v, slots, cols, 0.088, counter),
            "kernel, 8 blocks a row (a 4,096 context)": lambda: att.attention(
                q, nk, nv, k, v, slots, cols, 0.088, counter, splits=8
            ),
            "kernel, a block per query head": lambda: att.attention(
                q, nk, nv, k, v, slots, cols, 0.088, counter, heads=1
            ),
            "masked (fallback)": lambda: mx.fast.scaled_dot_product_attention(
                q, k[:, :, :span], v[:, :, :span], scale=0.088, mask=mask
            ),
            "fused, no mask": lambda: mx.fast.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=0.088),
        }
        row = {"B": B, "cells": C, "attended": n}
        for name, fn in cases.items():
            mx.eval(fn())
            t = time.perf_counter()
            for _ in range(5):
                mx.eval([fn() for _ in range(32)])
            row[name] = round((time.perf_counter() - t) * 1000 / 5, 3)
        out.append(row)
        emit("attention_time", row)
    return out


def time_writes(slots: int = 128, cells: int = 256, B: int = 32) -> list[dict]:
    shape = (slots, 8, cells, 128)
    upd = mx.ones((B, 1, 8, 128), dtype=mx.float16)
    upd1 = mx.ones((1, 8, 1, 128), dtype=mx.float16)
    rows = mx.arange(B, dtype=mx.int32)[:, None]
    out = []

    def fresh():
        bufs = [mx.zeros(shape, dtype=mx.float16) for _ in range(64)]
        mx.eval(bufs)
        return bufs

    def scatter_all(bufs, col):
        bufs = list(bufs)
        for i in range(len(bufs)):
            bufs[i][rows, :, col] = upd
        return bufs

    compiled = mx.compile(scatter_all)

    def write(bufs, kind, p):
        if kind == "scatter, compiled":
            bufs[:] = compiled(bufs, mx.full((B, 1), p, dtype=mx.int32))
        for i in range(len(bufs) if kind != "scatter, compiled" else 0):
            if kind == "static slice":
                bufs[i][:B, :, p : p + 1, :] = upd.transpose(0, 2, 1, 3)
            elif kind == "slice_update, device start":
                bufs[i] = mx.slice_update(bufs[i], upd1, mx.array([3, 0, p, 0], dtype=mx.int32), (0, 1, 2, 3))
            elif kind == "scatter":
                bufs[i][rows, :, mx.full((B, 1), p, dtype=mx.int32)] = upd
            elif kind == "copy (reference)":
                bufs[i] = bufs[i] + 0
        return mx.sum(mx.stack([b[0, 0, p, :4] for b in bufs]))

    for kind in ("static slice", "slice_update, device start", "scatter", "scatter, compiled", "copy (reference)"):
        row = {"write": kind, "slots": slots, "cells": cells}
        for mode in ("eval", "eval with buffers", "pipelined"):
            bufs = fresh()
            steps = 20
            t = None
            prev = None
            for p in range(steps + 2):
                if p == 2:
                    mx.synchronize()
                    t = time.perf_counter()
                s = write(bufs, kind, p)
                if mode == "eval":
                    mx.eval(s)
                elif mode == "eval with buffers":
                    mx.eval(s, *bufs)
                else:
                    mx.async_eval(s, *bufs)
                    if prev is not None:
                        prev.item()
                    prev = s
            mx.synchronize()
            row[mode] = round((time.perf_counter() - t) * 1000 / steps, 3)
            del bufs
            mx.clear_cache()
        out.append(row)
        emit("cell_writes", row)
    return out


def matmul(rows: list[int]) -> list[dict]:
    out = []
    for form in mm.FORMS:
        for dtype, group, bits in ((mx.float16, 64, 4), (mx.float16, 32, 8), (mx.bfloat16, 128, 4)):
            worst, same = mm.self_check(dtype, group, bits, form)
            row = {"check": f"{form} {dtype} {bits}-bit groups of {group}", "relative diff": worst, "same": same}
            out.append(row)
            emit("matmul_check", row)
    rng = np.random.default_rng(2)
    shapes = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096))
    for weights in ("quantized", "dense"):
        for N, K in shapes:
            if weights == "dense" and N > 20000:
                continue
            w = mx.array((rng.standard_normal((N, K)) * 0.02).astype(np.float16))
            fns = {}
            if weights == "quantized":
                wq, sc, bi = mx.quantize(w, group_size=64, bits=4)
                sc, bi = sc.astype(mx.float16), bi.astype(mx.float16)
                for form in mm.FORMS:
                    fns[form] = lambda x, f=form, wq=wq, sc=sc, bi=bi: mm.quantized(x, wq, sc, bi, 64, 4, f)
                fns["mlx"] = lambda x, wq=wq, sc=sc, bi=bi: mx.quantized_matmul(
                    x, wq, sc, bi, transpose=True, group_size=64, bits=4
                )
            else:
                for form in mm.FORMS:
                    fns[form] = lambda x, f=form, w=w: mm.dense(x, w, f)
                fns["mlx"] = lambda x, w=w: x @ w.T
            xs = mx.array(rng.standard_normal((max(rows), K)).astype(np.float16))
            ref = fns["mlx"](xs[:128]).astype(mx.float32)
            row = {"weights": weights, "N": N, "K": K}
            for form in mm.FORMS:
                big = fns[form](xs[:128])
                alone = mx.concatenate([fns[form](xs[i : i + 1]) for i in range(0, 128, 9)])
                mx.eval(big, alone, ref)
                row[f"{form} same"] = bool(mx.array_equal(alone, big[::9]).item())
                diff = mx.max(mx.abs(big.astype(mx.float32) - ref)) / mx.max(mx.abs(ref))
                row[f"{form} diff"] = round(float(diff.item()), 5)
            for M in rows:
                x = xs[:M]
                for name, fn in fns.items():
                    if name == "simt" and M > 32:
                        continue
                    mx.eval(fn(x))
                    t = time.perf_counter()
                    for _ in range(3):
                        mx.eval([fn(x) for _ in range(32)])
                    row[f"{name} {M}"] = round((time.perf_counter() - t) * 1000 / 96, 4)
            if N <= 14336 and K == 4096:  # the tensor-core form with each prefetch depth (chunks loaded at once)
                keep = mm.PREFETCH
                for pd in (1, 2, 4):
                    mm.PREFETCH = pd
                    for M in (1, 32):
                        x = xs[:M]
                        mx.eval(fns["mma"](x))
                        t = time.perf_counter()
                        for _ in range(3):
                            mx.eval([fns["mma"](x) for _ in range(32)])
                        row[f"mma PD{pd} {M}"] = round((time.perf_counter() - t) * 1000 / 96, 4)
                mm.PREFETCH = keep
            out.append(row)
            emit("matmul", row)
            del w
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--parts", default="attention,writes,matmul")
    ap.add_argument("--rows", default="1,2,4,5,8,14,16,32,64,128,640", help="matmul: rows a call")
    a = ap.parse_args()
    parts = a.parts.split(",")
    result: dict = {"device": str(mx.default_device()), "mlx": mx.__version__}
    if "matmul" in parts:
        result["matmul"] = matmul([int(r) for r in a.rows.split(",")])
    if "attention" in parts:
        result["attention_check"] = check_attention()
        result["attention_ms_32_calls"] = time_attention()
    if "writes" in parts:
        result["writes_ms_a_pass"] = time_writes()
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
