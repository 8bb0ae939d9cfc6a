"""Decode attention for the mlx backend on CUDA: one kernel over every row of a pass, each row
reading only its own slot's cells up to its own position.

MLX 0.32's fused attention on CUDA (`sdpa_vector`) takes no array mask: a pass whose rows sit at
different positions (every batched decode pass here) falls back to unfused matrix products over
the whole padded span, with the key and value cells broadcast over each group of query heads
(measured on the H200: 11.7 ms for 32 layers at 128 rows of 100 cells, against 2.6 ms here).
This kernel (mx.fast.cuda_kernel, compiled once by NVRTC and cached by MLX) reads the layer's
whole buffers in place, (slots, kv heads, cells, dim), given the slot and the position of every
query token: no mask and no gathered copy of the cells. It also writes the pass's own cells into
those buffers, in place, and reads them from its inputs: a decode layer's KV writes (two scatters,
and the index arrays MLX builds for them) and the attention are one launch. On a one-row pass,
where MLX's CUDA backend is bound by the host's cost per operation (bench/mlx_probe.py --graph
counts them), that is what matters.

Work split (flash-decoding): a thread block per (kv head, query token, row, chunk of CHUNK
cells), NT threads. (A block per query head is an option with the same arithmetic per head,
checked bit for bit at load; it was slower on the H200 at every row count, one row included:
1.02 against 0.87 ms for 32 layers.) A tile of NT cells at a time: each thread scores one cell
against every query head of the kv head's group (16-byte loads; a key row is read once for the
group), the block reduces the tile's maximum and sum in a fixed tree, the probabilities go to
shared memory, and then warp w accumulates the value rows of cells w, w + 4, ... with each lane
holding D/32 of the output dimensions (online softmax, float32); the warps' sums are added in a
fixed order at the end. A row that fits one chunk is normalised and written by that block. Over
several chunks, each leaves its running maximum, sum and unnormalised output, and the last of
them to finish (an atomic count a row, left at zero for the next launch) combines them in chunk
order. A row's chunks depend only on its own position (never on the other rows, nor on the
batch's size or the buffers' size): a row gets the same bits alone or in any batch, in this
part of the pass.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from kinfer_rpc.default_plugins.mlx import cuda_kernel
from kinfer_rpc.default_plugins.mlx.cuda_kernel import available as available

NT = 128  # threads a block: one cell each while scoring, one output dimension each after
CHUNK = 512  # cells a block covers (4 tiles of NT)

_SOURCE = """
    const int HQ = queries_shape[1];
    const int L = queries_shape[2];
    const int HKV = keys_shape[1];
    const int C = keys_shape[2];
    const int SPLITS = gridDim.z / cols_shape[0];
    const int hq0 = blockIdx.x * G;  // the block's first query head: G heads a block
    const int group = HQ / HKV;
    const int hk = hq0 / group;  // their kv head
    const int l = blockIdx.y;
    const int b = blockIdx.z / SPLITS;
    const int split = blockIdx.z % SPLITS;
    const int t = threadIdx.x;
    const int lane = t & 31;
    const int warp = t >> 5;
    constexpr int WARPS = NT / 32;
    constexpr int DPL = D / 32;  // output dimensions a lane accumulates
    constexpr int VEC = 16 / sizeof(T);  // elements in one 16-byte load
    const int p0 = cols[b * L];  // the row's first token of this pass: cells from p0 on are the pass's own
    const int col = cols[b * L + l];
    const int n = min(col + 1, C);  // cells this token attends to
    const size_t base = ((size_t)slots[b] * HKV + hk) * C * D;
    const size_t fresh = ((size_t)b * HKV + hk) * L * D;  // the row's new cells in new_keys / new_values
    // 0. This token's new cell into the layer's buffers, in place (once a kv head). No block of
    //    this launch reads the buffers at cells >= p0: they come from new_keys / new_values.
    if (split == 0 && hq0 % group == 0 && col < C) {
        T* kw = const_cast<T*>(keys) + base + (size_t)col * D;
        T* vw = const_cast<T*>(values) + base + (size_t)col * D;
        for (int d = t; d < D; d += NT) {
            kw[d] = new_keys[fresh + (size_t)l * D + d];
            vw[d] = new_values[fresh + (size_t)l * D + d];
        }
    }
    const int start = split * CHUNK;
    const int end = min(n, start + CHUNK);
    if (start >= end) {
        return;
    }
    const int chunks = (n + CHUNK - 1) / CHUNK;  // the row's chunks: its own length decides them
    const size_t part = ((size_t)(b * HQ + hq0) * L + l) * SPLITS;  // + g * L * SPLITS + chunk
    const float NEG = __int_as_float(0xff800000);
    const T* kp = keys + base;
    const T* vp = values + base;
    const T* kn = new_keys + fresh;  // kn + (c - p0) * D: the pass's own cell c (c >= p0)
    const T* vn = new_values + fresh;
    __shared__ float qs[G][D];
    __shared__ float ps[G][NT];
    __shared__ float red[G][WARPS];
    __shared__ float red2[G][WARPS];
    __shared__ float buf[WARPS][D];
    __shared__ int last;
    const float s = scale[0];
    for (int i = t; i < G * D; i += NT) {
        const int g = i / D;
        const int d = i % D;
        qs[g][d] = static_cast<float>(queries[(((size_t)b * HQ + hq0 + g) * L + l) * D + d]) * s;
    }
    float m[G];
    float lsum[G];
    float acc[G][DPL];
    for (int g = 0; g < G; ++g) {
        m[g] = NEG;
        lsum[g] = 0.0f;
        for (int x = 0; x < DPL; ++x) {
            acc[g][x] = 0.0f;
        }
    }
    __syncthreads();
    for (int t0 = start; t0 < end; t0 += NT) {
        const int tn = min(NT, end - t0);
        // 1. this thread's cell: its score against every query head of the group
        float sc[G];
        for (int g = 0; g < G; ++g) {
            sc[g] = t < tn ? 0.0f : NEG;
        }
        if (t < tn) {
            const int c = t0 + t;
            const uint4* kr = reinterpret_cast<const uint4*>(c >= p0 ? kn + (size_t)(c - p0) * D : kp + (size_t)c * D);
            #pragma unroll 4
            for (int i = 0; i < D / VEC; ++i) {
                const uint4 raw = kr[i];
                const T* e = reinterpret_cast<const T*>(&raw);
                #pragma unroll
                for (int x = 0; x < VEC; ++x) {
                    const float kv = static_cast<float>(e[x]);
                    for (int g = 0; g < G; ++g) {
                        sc[g] += qs[g][i * VEC + x] * kv;
                    }
                }
            }
        }
        // 2. the tile's maximum per head
        for (int g = 0; g < G; ++g) {
            float v = sc[g];
            for (int o = 16; o > 0; o >>= 1) {
                v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
            }
            if (lane == 0) {
                red[g][warp] = v;
            }
        }
        __syncthreads();
        // 3. probabilities, and their sum per head (a fixed reduction order)
        float corr[G];
        for (int g = 0; g < G; ++g) {
            float tmax = red[g][0];
            for (int w = 1; w < WARPS; ++w) {
                tmax = fmaxf(tmax, red[g][w]);
            }
            const float mnew = fmaxf(m[g], tmax);
            corr[g] = expf(m[g] - mnew);
            m[g] = mnew;
            const float p = t < tn ? expf(sc[g] - mnew) : 0.0f;
            ps[g][t] = p;
            float v = p;
            for (int o = 16; o > 0; o >>= 1) {
                v += __shfl_xor_sync(0xffffffff, v, o);
            }
            if (lane == 0) {
                red2[g][warp] = v;
            }
        }
        __syncthreads();
        // 4. values: warp w takes the tile's cells w, w + WARPS, ...; a lane DPL dimensions
        for (int g = 0; g < G; ++g) {
            float tsum = red2[g][0];
            for (int w = 1; w < WARPS; ++w) {
                tsum += red2[g][w];
            }
            lsum[g] = lsum[g] * corr[g] + tsum;
            for (int x = 0; x < DPL; ++x) {
                acc[g][x] *= corr[g];
            }
        }
        for (int j = warp; j < tn; j += WARPS) {
            const int c = t0 + j;
            const T* vr = (c >= p0 ? vn + (size_t)(c - p0) * D : vp + (size_t)c * D) + lane * DPL;
            float vv[DPL];
            #pragma unroll
            for (int x = 0; x < DPL; ++x) {
                vv[x] = static_cast<float>(vr[x]);
            }
            for (int g = 0; g < G; ++g) {
                const float p = ps[g][j];
                #pragma unroll
                for (int x = 0; x < DPL; ++x) {
                    acc[g][x] += p * vv[x];
                }
            }
        }
        __syncthreads();
    }
    // 5. the warps' partial outputs summed in a fixed order: the output itself when the row is
    //    one chunk, else the chunk's part (its maximum, sum and unnormalised output)
    for (int g = 0; g < G; ++g) {
        for (int x = 0; x < DPL; ++x) {
            buf[warp][lane * DPL + x] = acc[g][x];
        }
        __syncthreads();
        const size_t at = part + (size_t)g * L * SPLITS + split;
        const size_t o_at = (((size_t)b * HQ + hq0 + g) * L + l) * D;
        for (int d = t; d < D; d += NT) {
            float o = buf[0][d];
            for (int w = 1; w < WARPS; ++w) {
                o += buf[w][d];
            }
            if (chunks == 1) {
                out[o_at + d] = static_cast<T>(o / lsum[g]);
            } else {
                partial[at * D + d] = o;
            }
        }
        if (t == 0 && chunks > 1) {
            row_max[at] = m[g];
            row_sum[at] = lsum[g];
        }
        __syncthreads();
    }
    if (chunks == 1) {
        return;
    }
    // 6. the last of the row's chunks to finish combines them, in chunk order
    __threadfence();
    __syncthreads();
    if (t == 0) {
        int* count = const_cast<int*>(counter) + ((size_t)b * gridDim.x + blockIdx.x) * L + l;
        last = atomicAdd(count, 1) == chunks - 1;
        if (last) {
            *count = 0;  // every chunk of the row has counted: ready for the next launch
        }
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    for (int g = 0; g < G; ++g) {
        const size_t at = part + (size_t)g * L * SPLITS;
        const size_t o_at = (((size_t)b * HQ + hq0 + g) * L + l) * D;
        float top = NEG;
        for (int c = 0; c < chunks; ++c) {
            top = fmaxf(top, __ldcg(row_max + at + c));
        }
        float den = 0.0f;
        for (int c = 0; c < chunks; ++c) {
            den += __ldcg(row_sum + at + c) * expf(__ldcg(row_max + at + c) - top);
        }
        for (int d = t; d < D; d += NT) {
            float o = 0.0f;
            for (int c = 0; c < chunks; ++c) {
                o += __ldcg(partial + (at + c) * D + d) * expf(__ldcg(row_max + at + c) - top);
            }
            out[o_at + d] = static_cast<T>(o / den);
        }
    }
"""

_kernel: Callable[..., list[mx.array]] | None = None  # the compiled kernel: its outputs, by output_names


def attention(
    queries: mx.array,
    new_keys: mx.array,
    new_values: mx.array,
    keys: mx.array,
    values: mx.array,
    slots: mx.array,
    cols: mx.array,
    scale: float,
    counter: mx.array,
    heads: int | None = None,
    splits: int | None = None,
) -> mx.array:
    """One decode pass's attention for one layer, and its KV writes.

    queries (B, Hq, L, D); new_keys and new_values (B, Hkv, L, D): the pass's own cells, row b's
    token l at position cols[b, l] (cols (B, L) int32, consecutive along a row); keys and values
    (slots, Hkv, cells, D): the layer's whole buffers, into which the kernel writes the new cells
    IN PLACE (MLX does not see that write: the caller orders later reads after this pass, see
    kinfer_mlx's _step_fn); slots (B,) int32: the slot of each row; counter: int32 zeros of at
    least B * (Hq / heads) * L, the kernel's own (it leaves them zero). Token l of row b attends
    to its slot's cells 0..cols[b, l]. Returns (B, Hq, L, D) in the queries' type.
    `heads`: query heads a thread block (default: the kv head's whole group).
    `splits`: thread blocks a row (chunks of CHUNK cells), at least enough for the buffers; the
    backend fixes it per load from its context length."""
    global _kernel
    if _kernel is None:
        _kernel = cuda_kernel.make(
            "kinfer_decode_attention",
            _SOURCE,
            ["queries", "new_keys", "new_values", "keys", "values", "slots", "cols", "scale", "counter"],
            ["out", "partial", "row_max", "row_sum"],
        )
    B, HQ, L, D = queries.shape
    S, HKV, C, Dk = keys.shape
    if (
        D != Dk
        or values.shape[-1] != D
        or HQ % HKV
        or new_keys.shape != (B, HKV, L, D)
        or new_values.shape != (B, HKV, L, D)
    ):
        raise ValueError(
            f"the decode attention kernel needs equal key/value/query dims and whole head groups"
            f" (queries {queries.shape}, new keys {new_keys.shape}, keys {keys.shape})"
        )
    if not queries.dtype == new_keys.dtype == new_values.dtype == keys.dtype == values.dtype:
        raise ValueError("the decode attention kernel needs one float type for queries, keys and values")
    group = HQ // HKV
    splits = max(splits or 0, -(-C // CHUNK))
    if B * splits > 65535:  # CUDA's grid limit in z
        raise ValueError(
            f"{B} rows over {C} cells exceed the decode attention kernel's grid; use fewer slots or a shorter context"
        )
    if heads is None:
        # A block per kv head: its group's query heads together, a key row read once for them.
        # (A block per query head gives more blocks for one row, but each reads every key row
        # again: slower on the H200 at 1, 32 and 128 rows, bench/mlx_kernels.py.)
        heads = group
    if group % heads:
        raise ValueError(f"{heads} heads a block do not divide the group of {group}")
    if counter.dtype != mx.int32 or counter.size < B * (HQ // heads) * L:
        raise ValueError(f"the decode attention kernel's counter needs {B * (HQ // heads) * L} int32 zeros")
    # Scratch for rows over several chunks (none can be when the buffers fit one chunk).
    part = (B, HQ, L, splits) if splits > 1 else (1,)
    out, _, _, _ = _kernel(
        inputs=[queries, new_keys, new_values, keys, values, slots, cols, mx.array([scale], dtype=mx.float32), counter],
        template=[("T", queries.dtype), ("D", D), ("G", heads), ("NT", NT), ("CHUNK", CHUNK)],
        grid=(HQ // heads * NT, L, B * splits),
        threadgroup=(NT, 1, 1),
        output_shapes=[(B, HQ, L, D), (*part, D) if splits > 1 else (1,), part, part],
        output_dtypes=[queries.dtype, mx.float32, mx.float32, mx.float32],
    )
    return out


def write(
    keys: mx.array, values: mx.array, new_keys: mx.array, new_values: mx.array, slots: mx.array, cols: mx.array
) -> None:
    """The kernel's KV writes by MLX's operations: each row's new cells into its slot's cells at
    cols (the arrays `keys` and `values` are updated, as `a[i] = x` updates an MLX array)."""
    keys[slots[:, None], :, cols] = new_keys.transpose(0, 2, 1, 3)
    values[slots[:, None], :, cols] = new_values.transpose(0, 2, 1, 3)


def reference(
    queries: mx.array,
    new_keys: mx.array,
    new_values: mx.array,
    keys: mx.array,
    values: mx.array,
    slots: mx.array,
    cols: mx.array,
    scale: float,
) -> mx.array:
    """What `attention` does, by MLX's own operations (a write, then a mask over the gathered
    cells): what the kernel is checked against."""
    write(keys, values, new_keys, new_values, slots, cols)
    mask = (mx.arange(keys.shape[2])[None, None] <= cols[:, :, None])[:, None]  # no host read: it traces
    return mx.fast.scaled_dot_product_attention(queries, keys[slots], values[slots], scale=scale, mask=mask)


def self_check(dtype: mx.Dtype = mx.float16, head_dim: int = 128, group: int = 4) -> float:
    """The kernel against plain MLX operations (matrix products and a softmax over the row's
    cells, no fused attention, no host read) on fixed pseudo-random cells, rows at several
    positions, one over several chunks, rows of three tokens (drafts), both block shapes; returns
    the largest absolute difference, or inf when the block shapes disagree, the buffers differ
    from MLX's writes of the same cells anywhere, or the counter is not left at zero. The backend
    runs this once per load and keeps MLX's own attention when it fails or differs."""
    HKV, C, D = 2, 2 * CHUNK + 64, head_dim
    HQ = HKV * group
    order = [5, 0, 3, 1, 2]  # the slot of each row; rows of 1, 2 and 5 cells catch an off-by-one
    ends = [1, 2, 5, CHUNK + 18, C]
    B = len(order)

    def data(shape: tuple[int, ...], seed: int) -> mx.array:
        n = 1
        for x in shape:
            n *= x
        return mx.sin(mx.arange(n, dtype=mx.float32) * (0.7 + seed) + seed).reshape(shape).astype(dtype)

    # k, v: the kernel's buffers (written in place); kr, vr: the same cells written by MLX
    k, v, kr, vr = (data((B + 1, HKV, C, D), s) for s in (2, 3, 2, 3))
    q, nk, nv = data((B, HQ, 1, D), 1), data((B, HKV, 1, D), 5), data((B, HKV, 1, D), 6)
    counter = mx.zeros((B * HQ * 3,), dtype=mx.int32)
    mx.eval(k, v, kr, vr, counter)
    slots = mx.array(order, dtype=mx.int32)
    cols = mx.array([[e - 1] for e in ends], dtype=mx.int32)
    scale = D**-0.5
    got = attention(q, nk, nv, k, v, slots, cols, scale, counter, heads=group).astype(mx.float32)
    mx.eval(got)
    alone = attention(q, nk, nv, k, v, slots, cols, scale, counter, heads=1).astype(mx.float32)
    mx.eval(alone)
    if not mx.array_equal(got, alone).item():  # the block shapes must agree to the bit
        return float("inf")
    write(kr, vr, nk, nv, slots, cols)

    def plain(slot: int, n: int, query: mx.array) -> mx.array:  # softmax over the row's first n cells, every query head
        kk = mx.repeat(kr[slot, :, :n].astype(mx.float32), group, axis=0)  # (HQ, n, D)
        vv = mx.repeat(vr[slot, :, :n].astype(mx.float32), group, axis=0)
        s = (query.astype(mx.float32)[:, None] * scale * kk).sum(-1)  # (HQ, n)
        return (mx.softmax(s, axis=-1)[..., None] * vv).sum(1)  # (HQ, D)

    worst = mx.array(0.0)
    for b, (slot, n) in enumerate(zip(order, ends)):
        worst = mx.maximum(worst, mx.max(mx.abs(got[b, :, 0] - plain(slot, n, q[b, :, 0]))))
    mx.eval(worst)
    # rows of several tokens (a pass checking drafts): token i of a row sees one cell more than i - 1
    q3, nk3, nv3 = data((2, HQ, 3, D), 4), data((2, HKV, 3, D), 7), data((2, HKV, 3, D), 8)
    rows3 = [(1, 4), (4, CHUNK + 6)]  # (slot, cells the first token sees)
    slots3 = mx.array([r[0] for r in rows3], dtype=mx.int32)
    cols3 = mx.array([[n - 1 + i for i in range(3)] for _, n in rows3], dtype=mx.int32)
    got3 = attention(q3, nk3, nv3, k, v, slots3, cols3, scale, counter, splits=-(-C // CHUNK) + 1).astype(mx.float32)
    mx.eval(got3)
    write(kr, vr, nk3, nv3, slots3, cols3)
    for b, (slot, n) in enumerate(rows3):
        for i in range(3):
            worst = mx.maximum(worst, mx.max(mx.abs(got3[b, :, i] - plain(slot, n + i, q3[b, :, i]))))
    if not (mx.array_equal(k, kr).item() and mx.array_equal(v, vr).item() and not mx.any(counter).item()):
        return float("inf")
    value = worst.item()
    assert isinstance(value, (int, float))  # a float32 scalar's item
    return float(value)
