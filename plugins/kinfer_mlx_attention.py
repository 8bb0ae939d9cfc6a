"""Decode attention for the mlx backend on CUDA: one kernel over every row of a pass, each row
reading only its own slot's cells up to its own position.

MLX 0.32's fused attention on CUDA (`sdpa_vector`) takes no array mask: a pass whose rows sit at
different positions (every batched decode pass here) falls back to unfused matrix products over
the whole padded span, with the key and value cells broadcast over each group of query heads
(measured on the H200: 11.7 ms for 32 layers at 128 rows of 100 cells, against 2.6 ms here).
This kernel (mx.fast.cuda_kernel, compiled once by NVRTC and cached by MLX) reads the layer's
whole buffers in place, (slots, kv heads, cells, dim), given the slot and the last cell of every
query token: no mask and no gathered copy of the cells.

Work split (flash-decoding): a thread block per (kv head, query token, row, chunk of CHUNK
cells), NT threads. (A block per query head is an option with the same arithmetic per head,
checked bit for bit at load; it was slower on the H200 at every row count, one row included:
1.02 against 0.87 ms for 32 layers.) A tile of NT cells at a time: each thread scores one cell
against every query head of the kv head's group (16-byte loads; a key row is read once for the
group), the block reduces the tile's maximum and sum in a fixed tree, the probabilities go to shared memory,
and then warp w accumulates the value rows of cells w, w + 4, ... with each lane holding D/32 of
the output dimensions (online softmax, float32); the warps' sums are added in a fixed order at
the end. Each chunk leaves its running maximum, sum and unnormalised output; MLX's operations
combine a row's chunks. A row's chunks depend only on its own position (never on the other rows,
nor on the batch's size), and the combination adds the chunks in a fixed order, where chunks past
the row's end add exact zeros: a row gets the same bits alone or in any batch, in this part of
the pass.
"""

from __future__ import annotations

import mlx.core as mx

NT = 128  # threads a block: one cell each while scoring, one output dimension each after
CHUNK = 512  # cells a block covers (4 tiles of NT)

_SOURCE = """
    const int SPLITS = gridDim.z / cols_shape[0];
    const int hq0 = blockIdx.x * G;  // the block's first query head: G heads a block
    const int hk = hq0 / (queries_shape[1] / keys_shape[1]);  // their kv head
    const int l = blockIdx.y;
    const int b = blockIdx.z / SPLITS;
    const int split = blockIdx.z % SPLITS;
    const int t = threadIdx.x;
    const int lane = t & 31;
    const int warp = t >> 5;
    constexpr int WARPS = NT / 32;
    constexpr int DPL = D / 32;  // output dimensions a lane accumulates
    constexpr int VEC = 16 / sizeof(T);  // elements in one 16-byte load
    const int HQ = queries_shape[1];
    const int L = queries_shape[2];
    const int HKV = keys_shape[1];
    const size_t C = keys_shape[2];
    const int n = cols[b * L + l] + 1;
    const int start = split * CHUNK;
    const int end = min(n, start + CHUNK);
    const size_t part = ((size_t)(b * HQ + hq0) * L + l) * SPLITS + split;  // + g * L * SPLITS
    const float NEG = __int_as_float(0xff800000);
    if (start >= end) {
        for (int g = 0; g < G; ++g) {
            const size_t at = part + (size_t)g * L * SPLITS;
            if (t == 0) {
                row_max[at] = NEG;
                row_sum[at] = 0.0f;
            }
            for (int d = t; d < D; d += NT) {
                partial[at * D + d] = 0.0f;
            }
        }
        return;
    }
    const size_t base = ((size_t)slots[b] * HKV + hk) * C * D;
    const T* kp = keys + base;
    const T* vp = values + base;
    __shared__ float qs[G][D];
    __shared__ float ps[G][NT];
    __shared__ float red[G][WARPS];
    __shared__ float red2[G][WARPS];
    __shared__ float buf[WARPS][D];
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
            const uint4* kr = reinterpret_cast<const uint4*>(kp + (size_t)(t0 + t) * D);
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
            const T* vr = vp + (size_t)(t0 + j) * D + lane * DPL;
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
    // 5. the warps' partial outputs summed in a fixed order
    for (int g = 0; g < G; ++g) {
        for (int x = 0; x < DPL; ++x) {
            buf[warp][lane * DPL + x] = acc[g][x];
        }
        __syncthreads();
        const size_t at = part + (size_t)g * L * SPLITS;
        for (int d = t; d < D; d += NT) {
            float o = buf[0][d];
            for (int w = 1; w < WARPS; ++w) {
                o += buf[w][d];
            }
            partial[at * D + d] = o;
        }
        if (t == 0) {
            row_max[at] = m[g];
            row_sum[at] = lsum[g];
        }
        __syncthreads();
    }
"""

_kernel = None


def available() -> bool:
    """Whether this MLX can run the kernel: a CUDA build, on the GPU."""
    cuda = getattr(mx, "cuda", None)
    return hasattr(mx.fast, "cuda_kernel") and cuda is not None and cuda.is_available() \
        and mx.default_device() == mx.gpu


def attention(queries, keys, values, slots, cols, scale: float, heads: int | None = None,
              splits: int | None = None):
    """queries (B, Hq, L, D); keys and values (slots, Hkv, cells, D), a layer's whole buffers;
    slots (B,) int32: the slot of each row; cols (B, L) int32: the position of each query token
    (it attends to its slot's cells 0..cols). Returns (B, Hq, L, D) in the queries' type.
    `heads`: query heads a thread block (default: the kv head's whole group).
    `splits`: chunks of CHUNK cells a row is split into, fixed per load by the backend (from its
    context length) so that neither the arithmetic nor the combination's length depends on how
    far the buffers have grown; default: enough for the buffers."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="kinfer_decode_attention",
            input_names=["queries", "keys", "values", "slots", "cols", "scale"],
            output_names=["partial", "row_max", "row_sum"],
            source=_SOURCE,
        )
    B, HQ, L, D = queries.shape
    S, HKV, C, Dk = keys.shape
    if D != Dk or values.shape[-1] != D or HQ % HKV:
        raise ValueError(f"the decode attention kernel needs equal key/value/query dims and whole head groups"
                         f" (queries {queries.shape}, keys {keys.shape})")
    group = HQ // HKV
    splits = max(splits or 0, -(-C // CHUNK))
    if B * splits > 65535:  # CUDA's grid limit in z
        raise ValueError(f"{B} rows over {C} cells exceed the decode attention kernel's grid; use fewer slots"
                         " or a shorter context")
    if heads is None:
        # A block per kv head: its group's query heads together, a key row read once for them.
        # (A block per query head gives more blocks for one row, but each reads every key row
        # again: slower on the H200 at 1, 32 and 128 rows, bench/mlx_kernels.py.)
        heads = group
    if group % heads:
        raise ValueError(f"{heads} heads a block do not divide the group of {group}")
    partial, row_max, row_sum = _kernel(
        inputs=[queries, keys, values, slots, cols, mx.array([scale], dtype=mx.float32)],
        template=[("T", queries.dtype), ("D", D), ("G", heads), ("NT", NT), ("CHUNK", CHUNK)],
        grid=(HQ // heads * NT, L, B * splits),
        threadgroup=(NT, 1, 1),
        output_shapes=[(B, HQ, L, splits, D), (B, HQ, L, splits), (B, HQ, L, splits)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    if splits == 1:
        return (partial[..., 0, :] / row_sum[..., :1]).astype(queries.dtype)
    top = mx.max(row_max, axis=-1, keepdims=True)
    w = mx.exp(row_max - top)  # chunks past a row's end: exp(-inf) = 0
    out = mx.sum(partial * w[..., None], axis=-2) / mx.sum(row_sum * w, axis=-1)[..., None]
    return out.astype(queries.dtype)


def reference(queries, keys, values, slots, cols, scale: float):
    """The same attention by MLX's own operations (a mask over the gathered cells): what the
    kernel is checked against."""
    span = int(mx.max(cols).item()) + 1
    k = keys[slots, :, :span]
    v = values[slots, :, :span]
    mask = (mx.arange(span)[None, None] <= cols[:, :, None])[:, None]
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def self_check(dtype=mx.float16, head_dim: int = 128, group: int = 4) -> float:
    """The kernel against plain MLX operations (matrix products and a softmax over the row's
    cells, no fused attention, no host read) on fixed pseudo-random cells, rows at several
    positions, one over several chunks, rows of three tokens (drafts), both block shapes; returns
    the largest absolute difference (inf when the block shapes disagree). The backend runs
    this once per load and keeps MLX's own attention when it fails or differs."""
    HKV, C, D = 2, 2 * CHUNK + 64, head_dim
    HQ = HKV * group
    order = [5, 0, 3, 1, 2]  # the slot of each row; rows of 1, 2 and 5 cells catch an off-by-one
    ends = [1, 2, 5, CHUNK + 18, C]
    B = len(order)

    def data(shape, seed):
        n = 1
        for x in shape:
            n *= x
        return mx.sin(mx.arange(n, dtype=mx.float32) * (0.7 + seed) + seed).reshape(shape).astype(dtype)

    q, k, v = data((B, HQ, 1, D), 1), data((B + 1, HKV, C, D), 2), data((B + 1, HKV, C, D), 3)
    slots = mx.array(order, dtype=mx.int32)
    cols = mx.array([[e - 1] for e in ends], dtype=mx.int32)
    scale = D ** -0.5
    got = attention(q, k, v, slots, cols, scale, heads=group).astype(mx.float32)
    alone = attention(q, k, v, slots, cols, scale, heads=1).astype(mx.float32)
    if not mx.array_equal(got, alone).item():  # the block shapes must agree to the bit
        return float("inf")

    def plain(slot, n, query):  # softmax over the row's first n cells, every query head
        kk = mx.repeat(k[slot, :, :n].astype(mx.float32), group, axis=0)  # (HQ, n, D)
        vv = mx.repeat(v[slot, :, :n].astype(mx.float32), group, axis=0)
        s = (query.astype(mx.float32)[:, None] * scale * kk).sum(-1)  # (HQ, n)
        return (mx.softmax(s, axis=-1)[..., None] * vv).sum(1)  # (HQ, D)

    worst = mx.array(0.0)
    for b, (slot, n) in enumerate(zip(order, ends)):
        worst = mx.maximum(worst, mx.max(mx.abs(got[b, :, 0] - plain(slot, n, q[b, :, 0]))))
    # rows of several tokens (a pass checking drafts): token i of a row sees one cell more than i - 1
    q3 = data((2, HQ, 3, D), 4)
    rows3 = [(1, 4), (4, CHUNK + 6)]  # (slot, cells the first token sees)
    cols3 = mx.array([[n - 1 + i for i in range(3)] for _, n in rows3], dtype=mx.int32)
    got3 = attention(q3, k, v, mx.array([r[0] for r in rows3], dtype=mx.int32), cols3, scale,
                     splits=-(-C // CHUNK) + 1).astype(mx.float32)
    for b, (slot, n) in enumerate(rows3):
        for i in range(3):
            worst = mx.maximum(worst, mx.max(mx.abs(got3[b, :, i] - plain(slot, n + i, q3[b, :, i]))))
    return float(worst.item())
