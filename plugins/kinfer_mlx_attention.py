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
cells). It scores its chunk a tile of 128 cells at a time (a thread per cell, the dot products
of every query head of the kv head's group at once, so a key row is read once for the group),
keeps the tile's probabilities in shared memory, and accumulates the value rows into one output
dimension per thread (online softmax, float32). Each chunk leaves its running maximum, sum and
unnormalised output; MLX's operations then combine the chunks of a row. A row's chunks depend
only on its own position (never on the other rows, nor on the batch's size), and the combination
adds the chunks in a fixed order, where chunks past the row's end add exact zeros: a row gets the
same bits alone or in any batch, in this part of the pass.
"""

from __future__ import annotations

import mlx.core as mx

NT = 128  # threads a block: one cell each while scoring, one output dimension each after
CHUNK = 512  # cells a block covers (4 tiles of NT)

_SOURCE = """
    const int SPLITS = gridDim.z / cols_shape[0];
    const int hk = blockIdx.x;
    const int l = blockIdx.y;
    const int b = blockIdx.z / SPLITS;
    const int split = blockIdx.z % SPLITS;
    const int t = threadIdx.x;
    const int lane = t & 31;
    const int warp = t >> 5;
    constexpr int WARPS = NT / 32;
    constexpr int DPT = (D + NT - 1) / NT;
    const int HQ = queries_shape[1];
    const int L = queries_shape[2];
    const int HKV = keys_shape[1];
    const size_t C = keys_shape[2];
    const int n = cols[b * L + l] + 1;
    const int start = split * CHUNK;
    const int end = min(n, start + CHUNK);
    const size_t part = ((size_t)(b * HQ + hk * G) * L + l) * SPLITS + split;  // + g * L * SPLITS
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
    const float s = scale[0];
    for (int i = t; i < G * D; i += NT) {
        const int g = i / D;
        const int d = i % D;
        qs[g][d] = static_cast<float>(queries[(((size_t)b * HQ + hk * G + g) * L + l) * D + d]) * s;
    }
    float m[G];
    float lsum[G];
    float acc[G][DPT];
    for (int g = 0; g < G; ++g) {
        m[g] = NEG;
        lsum[g] = 0.0f;
        for (int k = 0; k < DPT; ++k) {
            acc[g][k] = 0.0f;
        }
    }
    __syncthreads();
    for (int t0 = start; t0 < end; t0 += NT) {
        const int tn = min(NT, end - t0);
        float sc[G];
        for (int g = 0; g < G; ++g) {
            sc[g] = NEG;
        }
        if (t < tn) {
            const T* kr = kp + (size_t)(t0 + t) * D;
            for (int g = 0; g < G; ++g) {
                sc[g] = 0.0f;
            }
            #pragma unroll 8
            for (int d = 0; d < D; ++d) {
                const float kv = static_cast<float>(kr[d]);
                for (int g = 0; g < G; ++g) {
                    sc[g] += qs[g][d] * kv;
                }
            }
        }
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
        float corr[G];
        for (int g = 0; g < G; ++g) {
            float tmax = red[g][0];
            for (int w = 1; w < WARPS; ++w) {
                tmax = fmaxf(tmax, red[g][w]);
            }
            const float mnew = fmaxf(m[g], tmax);
            corr[g] = expf(m[g] - mnew);
            m[g] = mnew;
            ps[g][t] = t < tn ? expf(sc[g] - mnew) : 0.0f;
        }
        __syncthreads();
        for (int g = 0; g < G; ++g) {
            lsum[g] *= corr[g];
            for (int k = 0; k < DPT; ++k) {
                acc[g][k] *= corr[g];
            }
        }
        for (int j = 0; j < tn; ++j) {
            const T* vr = vp + (size_t)(t0 + j) * D;
            for (int k = 0; k < DPT; ++k) {
                const int d = t + k * NT;
                const float vv = d < D ? static_cast<float>(vr[d]) : 0.0f;
                for (int g = 0; g < G; ++g) {
                    acc[g][k] += ps[g][j] * vv;
                }
            }
            for (int g = 0; g < G; ++g) {
                lsum[g] += ps[g][j];
            }
        }
        __syncthreads();
    }
    for (int g = 0; g < G; ++g) {
        const size_t at = part + (size_t)g * L * SPLITS;
        if (t == 0) {
            row_max[at] = m[g];
            row_sum[at] = lsum[g];
        }
        for (int k = 0; k < DPT; ++k) {
            const int d = t + k * NT;
            if (d < D) {
                partial[at * D + d] = acc[g][k];
            }
        }
    }
"""

_kernel = None


def available() -> bool:
    """Whether this MLX can run the kernel: a CUDA build, on the GPU."""
    cuda = getattr(mx, "cuda", None)
    return hasattr(mx.fast, "cuda_kernel") and cuda is not None and cuda.is_available() \
        and mx.default_device() == mx.gpu


def attention(queries, keys, values, slots, cols, scale: float):
    """queries (B, Hq, L, D); keys and values (slots, Hkv, cells, D), a layer's whole buffers;
    slots (B,) int32: the slot of each row; cols (B, L) int32: the position of each query token
    (it attends to its slot's cells 0..cols). Returns (B, Hq, L, D) in the queries' type."""
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
    G = HQ // HKV
    splits = -(-C // CHUNK)  # from the buffers' size only: the same for every row and batch
    partial, row_max, row_sum = _kernel(
        inputs=[queries, keys, values, slots, cols, mx.array([scale], dtype=mx.float32)],
        template=[("T", queries.dtype), ("D", D), ("G", G), ("NT", NT), ("CHUNK", CHUNK)],
        grid=(HKV * NT, L, B * splits),
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
    positions, one over several chunks; returns the largest absolute difference. The backend runs
    this once per load and keeps MLX's own attention when it fails or differs."""
    B, HKV, C, D = 3, 2, 2 * CHUNK + 64, head_dim
    HQ = HKV * group

    def data(shape, seed):
        n = 1
        for x in shape:
            n *= x
        return mx.sin(mx.arange(n, dtype=mx.float32) * (0.7 + seed) + seed).reshape(shape).astype(dtype)

    q, k, v = data((B, HQ, 1, D), 1), data((B + 1, HKV, C, D), 2), data((B + 1, HKV, C, D), 3)
    slots = mx.array([3, 0, 1], dtype=mx.int32)
    ends = [1, CHUNK + 18, C]
    cols = mx.array([[e - 1] for e in ends], dtype=mx.int32)
    scale = D ** -0.5
    got = attention(q, k, v, slots, cols, scale).astype(mx.float32)
    worst = mx.array(0.0)
    for b, (slot, n) in enumerate(zip([3, 0, 1], ends)):
        kk = mx.repeat(k[slot, :, :n].astype(mx.float32), group, axis=0)  # (HQ, n, D)
        vv = mx.repeat(v[slot, :, :n].astype(mx.float32), group, axis=0)
        s = (q[b, :, 0].astype(mx.float32)[:, None] * scale * kk).sum(-1)  # (HQ, n)
        want = (mx.softmax(s, axis=-1)[..., None] * vv).sum(1)  # (HQ, D)
        worst = mx.maximum(worst, mx.max(mx.abs(got[b, :, 0] - want)))
    return float(worst.item())
