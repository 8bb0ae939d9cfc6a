"""Matrix products for the mlx backend's decode passes on CUDA whose rows do not depend on each
other: a row gets the same bits alone, in a pass of 8 rows or of 640.

MLX's CUDA build picks its matrix kernel by the number of rows in a pass (a matrix-vector kernel
up to 7 rows, a tiled matrix kernel from 8, and cuBLAS's choice of algorithm for dense weights),
and each sums a row's products in its own order: a token checked with drafts (a pass of k + 1
rows), or decoded beside other requests, gets slightly different logits from the same token
decoded alone, and a near tie can flip. These kernels (mx.fast.cuda_kernel, compiled once by
NVRTC and cached by MLX) fix the order: y = x w^T for x (M, K), w (N, K), dense or in MLX's affine
quantization (BITS-bit values packed into uint32 words from the low bits, a scale and a bias per
GS values of a row, w = scale * q + bias). Two forms, each checked at load against MLX's products
and for rows that do not depend on each other (self_check):

- `mma` (float16 and bfloat16, the default): tensor cores, MMA_SOURCE below. On the H100 a 7.4B
  4-bit model decodes several times faster through it at 8 to 128 rows than through MLX's
  quantized matmul (docs/performance.md).
- `simt` (any float type): a warp per output column and a tile of TM rows; lane l takes the
  16-byte words l, l + 32, ... of w's row n, turns them into floats once, and for each row of
  the tile adds their products with the row's x (one fma chain a word, in order) to the row's
  float sum; the lanes' sums are added in a fixed butterfly.

In both, which products a row's sum takes, in which order, and every rounding depend only on K:
never on M, on the tile, nor on the other rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.quantized import QuantizedEmbedding, QuantizedLinear

from kinfer_rpc.default_plugins.mlx import cuda_kernel
from kinfer_rpc.default_plugins.mlx.cuda_kernel import available as available

log = logging.getLogger("kinfer_rpc.mlx")

NT = 128  # threads a block: NT / 32 output columns
TM = 16  # rows a tile: the weights are read once for each

# The part that turns lane's word j of w's row n into VALS floats wv[] (with k0, its first column).
_QUANTIZED = """
    constexpr int PER = 32 / BITS;  // values a 32-bit word holds
    constexpr int VALS = 4 * PER;  // values one 16-byte word holds
    const int groups = K / GS;
    #define KINFER_DEQUANT(raw, j, wv)                                                          \\
        {                                                                                      \\
            const uint32_t* words = reinterpret_cast<const uint32_t*>(&raw);                   \\
            const size_t g = (size_t)n * groups + (size_t)(j) * VALS / GS;                     \\
            const float s = static_cast<float>(scales[g]);                                     \\
            const float b = static_cast<float>(biases[g]);                                     \\
            _Pragma("unroll") for (int i = 0; i < VALS; ++i) {                                 \\
                const uint32_t q = (words[i / PER] >> (BITS * (i % PER))) & ((1u << BITS) - 1u); \\
                wv[i] = fmaf(s, static_cast<float>(q), b);                                     \\
            }                                                                                  \\
        }
"""
_DENSE = """
    constexpr int VALS = 16 / sizeof(W);  // values one 16-byte word holds
    #define KINFER_DEQUANT(raw, j, wv)                                                          \\
        {                                                                                      \\
            const W* e = reinterpret_cast<const W*>(&raw);                                     \\
            _Pragma("unroll") for (int i = 0; i < VALS; ++i) wv[i] = static_cast<float>(e[i]); \\
        }
"""
_BODY = """
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    constexpr int VEC = 16 / sizeof(T);  // x values one 16-byte load holds
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * (NT / 32) + (threadIdx.x >> 5);  // this warp's output column
    if (n >= N) return;
    const int m0 = blockIdx.y * TM;
    const int rows = min(TM, M - m0);
@DEQUANT@
    static_assert(VALS % VEC == 0, "a word of w covers whole 16-byte loads of x");
    const int words = K / VALS;  // 16-byte words in a row of w
    const uint4* wr = reinterpret_cast<const uint4*>(w) + (size_t)n * words;
    // 16-byte loads of x when its rows allow them (the same sums either way)
    const bool vec = (reinterpret_cast<size_t>(x) % 16) == 0 && (K * sizeof(T)) % 16 == 0;
    float acc[TM];
    #pragma unroll
    for (int r = 0; r < TM; ++r) acc[r] = 0.0f;
    for (int j = lane; j < words; j += 32) {
        const uint4 raw = wr[j];
        float wv[VALS];
        KINFER_DEQUANT(raw, j, wv)
        const size_t k0 = (size_t)j * VALS;
        #pragma unroll
        for (int r = 0; r < TM; ++r) {
            if (r < rows) {
                const T* xr = x + (size_t)(m0 + r) * K + k0;
                float a = 0.0f;
                if (vec) {
                    #pragma unroll
                    for (int v = 0; v < VALS / VEC; ++v) {
                        const uint4 xraw = reinterpret_cast<const uint4*>(xr)[v];
                        const T* e = reinterpret_cast<const T*>(&xraw);
                        #pragma unroll
                        for (int i = 0; i < VEC; ++i) a = fmaf(wv[v * VEC + i], static_cast<float>(e[i]), a);
                    }
                } else {
                    #pragma unroll
                    for (int i = 0; i < VALS; ++i) a = fmaf(wv[i], static_cast<float>(xr[i]), a);
                }
                acc[r] += a;
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < TM; ++r) {
        float v = acc[r];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
        if (lane == r && r < rows) y[(size_t)(m0 + r) * N + n] = static_cast<T>(v);
    }
    #undef KINFER_DEQUANT
"""
QUANTIZED_SOURCE = _BODY.replace("@DEQUANT@", _QUANTIZED)
DENSE_SOURCE = _BODY.replace("@DEQUANT@", _DENSE)

# The tensor-core form (float16 and bfloat16 x): a block per 16 output columns and 8 * TT rows,
# NW warps splitting K in fixed chunks of 64 (warp w takes chunks w, w + NW, ...), each warp's
# part a sum of mma.sync m16n8k16 products (w's 16 columns as A, turned into the model's float
# type in registers; 8 rows of x as B; float accumulators), in chunk order; the warps' parts are
# then added in warp order. Lane t of a quad takes the 16 values k0 + 16t .. k0 + 16t + 15 of a
# chunk (one load, no lane reading another's), and gives the mma's k slots 2t, 2t + 1, 2t + 8,
# 2t + 9 of step s its values 4s .. 4s + 3, the same for A and B: each step sums 16 of the
# chunk's products, and the four steps all 64. A row's result depends on K, its own x and w:
# not on M, on where in its tile of 8 the row sits, nor on the other rows (each column of an
# mma is its own sum).
MMA_SOURCE = """
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;  // A's rows g and g + 8; B's column (a row of x) g
    const int t = lane & 3;  // the quad's lane: values 16t .. 16t + 15 of a chunk
    const int n0 = blockIdx.x * 16;
    const int m0 = blockIdx.y * (8 * TT);
    const int chunks = K / 64;
    const int na = min(n0 + g, N - 1);  // a row past N is computed on row N - 1 and never written
    const int nb = min(n0 + g + 8, N - 1);
    constexpr bool QUANT = BITS < 16;
    constexpr int WL = BITS / 2;  // 32-bit words holding a lane's 16 values of a row: 2, 4 or 8
    constexpr int PER = 32 / BITS;  // values a 32-bit word holds
    const bool x16 = (reinterpret_cast<size_t>(x) % 16) == 0;  // x's rows in 16-byte loads
    float c[TT][4];
    #pragma unroll
    for (int i = 0; i < TT; ++i) { c[i][0] = 0.0f; c[i][1] = 0.0f; c[i][2] = 0.0f; c[i][3] = 0.0f; }
    // a chunk's raw A for this lane: its words of rows na and nb, and their scale and bias
    auto load = [&](int ch, uint32_t* pa, uint32_t* pb, float& s_a, float& b_a, float& s_b, float& b_b) {
        const size_t row = (size_t)K * BITS / 32;  // 32-bit words a row
        const size_t at = ((size_t)ch * 64 + 16 * t) * BITS / 32;
        const uint32_t* wa = reinterpret_cast<const uint32_t*>(w) + (size_t)na * row + at;
        const uint32_t* wb = reinterpret_cast<const uint32_t*>(w) + (size_t)nb * row + at;
        if (WL == 2) {
            const uint2 u = *reinterpret_cast<const uint2*>(wa);
            const uint2 v = *reinterpret_cast<const uint2*>(wb);
            pa[0] = u.x; pa[1] = u.y; pb[0] = v.x; pb[1] = v.y;
        } else {
            #pragma unroll
            for (int i = 0; i < WL / 4; ++i) {
                const uint4 u = reinterpret_cast<const uint4*>(wa)[i];
                const uint4 v = reinterpret_cast<const uint4*>(wb)[i];
                pa[4 * i] = u.x; pa[4 * i + 1] = u.y; pa[4 * i + 2] = u.z; pa[4 * i + 3] = u.w;
                pb[4 * i] = v.x; pb[4 * i + 1] = v.y; pb[4 * i + 2] = v.z; pb[4 * i + 3] = v.w;
            }
        }
        if (QUANT) {
            const int groups = K / GS;
            const int gi = (ch * 64 + 16 * t) / GS;
            s_a = static_cast<float>(scales[(size_t)na * groups + gi]);
            b_a = static_cast<float>(biases[(size_t)na * groups + gi]);
            s_b = static_cast<float>(scales[(size_t)nb * groups + gi]);
            b_b = static_cast<float>(biases[(size_t)nb * groups + gi]);
        }
    };
    // values v, v + 1 of a lane's 16 of a row as one A register (v even, known when unrolled)
    auto pair = [&](const uint32_t* r, float s, float b, int v) -> uint32_t {
        if (!QUANT) return r[v / 2];  // dense: the pair as stored
        const uint32_t word = r[v / PER];
        const int sh = BITS * (v % PER);
        const uint32_t mask = (1u << (QUANT ? BITS : 1)) - 1u;
        const float v0 = fmaf(s, static_cast<float>((word >> sh) & mask), b);
        const float v1 = fmaf(s, static_cast<float>((word >> (sh + (QUANT ? BITS : 0))) & mask), b);
        if (BF) {
            const __nv_bfloat162 h = __floats2bfloat162_rn(v0, v1);
            return *reinterpret_cast<const uint32_t*>(&h);
        }
        const __half2 h = __floats2half2_rn(v0, v1);
        return *reinterpret_cast<const uint32_t*>(&h);
    };
    // one chunk's products into c (ra, rb, sa, ba, sb, bb: its raw A, as load left them)
    auto step = [&](int ch, const uint32_t* ra, const uint32_t* rb, float sa, float ba, float sb, float bb) {
        uint32_t a[4][4];
        #pragma unroll
        for (int s = 0; s < 4; ++s) {
            a[s][0] = pair(ra, sa, ba, 4 * s);
            a[s][1] = pair(rb, sb, bb, 4 * s);
            a[s][2] = pair(ra, sa, ba, 4 * s + 2);
            a[s][3] = pair(rb, sb, bb, 4 * s + 2);
        }
        const size_t k0 = (size_t)ch * 64 + 16 * t;
        #pragma unroll
        for (int i = 0; i < TT; ++i) {
            if (m0 + 8 * i < M) {  // the same for the whole warp
                const int m = m0 + 8 * i + g;
                uint32_t xw[8];
                #pragma unroll
                for (int j = 0; j < 8; ++j) xw[j] = 0u;
                if (m < M) {
                    const T* xr = x + (size_t)m * K + k0;
                    if (x16) {
                        const uint4 u0 = reinterpret_cast<const uint4*>(xr)[0];
                        const uint4 u1 = reinterpret_cast<const uint4*>(xr)[1];
                        xw[0] = u0.x; xw[1] = u0.y; xw[2] = u0.z; xw[3] = u0.w;
                        xw[4] = u1.x; xw[5] = u1.y; xw[6] = u1.z; xw[7] = u1.w;
                    } else {  // the same values, a half at a time
                        const unsigned short* h = reinterpret_cast<const unsigned short*>(xr);
                        #pragma unroll
                        for (int j = 0; j < 8; ++j) xw[j] = (uint32_t)h[2 * j] | ((uint32_t)h[2 * j + 1] << 16);
                    }
                }
                #pragma unroll
                for (int s = 0; s < 4; ++s) {
                    const uint32_t b0 = xw[2 * s];
                    const uint32_t b1 = xw[2 * s + 1];
                    if (BF) {
                        asm volatile(
                            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                            : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])
                            : "r"(a[s][0]), "r"(a[s][1]), "r"(a[s][2]), "r"(a[s][3]), "r"(b0), "r"(b1));
                    } else {
                        asm volatile(
                            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                            : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])
                            : "r"(a[s][0]), "r"(a[s][1]), "r"(a[s][2]), "r"(a[s][3]), "r"(b0), "r"(b1));
                    }
                }
            }
        }
    };
    // a warp's chunks in order, PD of them loaded at once (their loads in flight together)
    for (int ch0 = warp; ch0 < chunks; ch0 += NW * PD) {
        uint32_t ra[PD][WL], rb[PD][WL];
        float sa[PD], ba[PD], sb[PD], bb[PD];
        #pragma unroll
        for (int p = 0; p < PD; ++p) {
            sa[p] = 0.0f; ba[p] = 0.0f; sb[p] = 0.0f; bb[p] = 0.0f;
            if (ch0 + p * NW < chunks) load(ch0 + p * NW, ra[p], rb[p], sa[p], ba[p], sb[p], bb[p]);
        }
        #pragma unroll
        for (int p = 0; p < PD; ++p) {
            if (ch0 + p * NW < chunks) step(ch0 + p * NW, ra[p], rb[p], sa[p], ba[p], sb[p], bb[p]);  // warp-uniform
        }
    }
    // the warps' parts, added in warp order
    __shared__ float part[NW][16][8 * TT];
    #pragma unroll
    for (int i = 0; i < TT; ++i) {
        part[warp][g][8 * i + 2 * t] = c[i][0];
        part[warp][g][8 * i + 2 * t + 1] = c[i][1];
        part[warp][g + 8][8 * i + 2 * t] = c[i][2];
        part[warp][g + 8][8 * i + 2 * t + 1] = c[i][3];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * 8 * TT; e += NW * 32) {
        const int nl = e / (8 * TT);
        const int r = e % (8 * TT);
        if (n0 + nl < N && m0 + r < M) {
            float v = part[0][nl][r];
            #pragma unroll
            for (int q = 1; q < NW; ++q) v += part[q][nl][r];
            y[(size_t)(m0 + r) * N + n0 + nl] = static_cast<T>(v);
        }
    }
"""
NW = 8  # warps a block of the tensor-core form (K split among them)
# chunks a warp of the tensor-core form loads at once: on the H200, 2 or 4 were no faster than 1
# alone and slower at 32 rows, in every weight form (bench/mlx_kernels.py times each)
PREFETCH = 1
TT = 4  # tiles of 8 rows a block of the tensor-core form

_kernels: dict[str, Callable[..., list[mx.array]]] = {}


def _kernel(kind: str) -> Callable[..., list[mx.array]]:
    kernel = _kernels.get(kind)
    if kernel is None:
        names = ["x", "w"] if kind == "dense" else ["x", "w", "scales", "biases"]
        sources = {"quantized": QUANTIZED_SOURCE, "dense": DENSE_SOURCE, "mma": MMA_SOURCE}
        # every input's type is T or fixed by the template values
        kernel = _kernels[kind] = cuda_kernel.make(f"kinfer_rows_matmul_{kind}", sources[kind], names, ["y"])
    return kernel


def _launch(kind: str, x: mx.array, inputs: list[mx.array], n: int, template: list[tuple[str, Any]]) -> mx.array:
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if kind == "mma":
        rows, threads, cols = 8 * TT, NW * 32, 16
        template = [*template, ("BF", int(x.dtype == mx.bfloat16)), ("NW", NW), ("TT", TT), ("PD", PREFETCH)]
    else:
        rows, threads, cols = TM, NT, NT // 32
        template = [*template, ("TM", TM), ("NT", NT)]
    (y,) = _kernel(kind)(
        inputs=[x2, *inputs],
        template=[("T", x.dtype), *template],
        grid=(-(-n // cols) * threads, max(1, -(-M // rows)), 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(M, n)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], n)


FORMS = ("mma", "simt")  # tensor cores (float16 and bfloat16), or a float fma chain (any float type)


def _takes(form: str, x: mx.Dtype, k: int) -> bool:
    return form == "simt" or (x in (mx.float16, mx.bfloat16) and k % 64 == 0)


def quantized(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int, form: str = "mma"
) -> mx.array:
    """x (..., K) times w^T, w (N, K) in MLX's affine quantization (mx.quantize's outputs):
    what mx.quantized_matmul(x, w, scales, biases, transpose=True) computes, with rows that do
    not depend on each other. A layer the tensor-core form does not take (K not a multiple of 64)
    always runs the fma-chain form."""
    K = x.shape[-1]
    form = form if _takes(form, x.dtype, K) else "simt"
    if not quantizable(w.shape[0], K, group_size, bits) or scales.dtype != biases.dtype:
        raise ValueError(
            f"the row-invariant matmul ({form}) takes 4- or 8-bit groups of 32, 64 or 128 (got {bits}, {group_size})"
        )
    if w.shape[1] * 32 != K * bits or scales.shape != (w.shape[0], K // group_size):
        raise ValueError(f"x's rows of {K} do not match quantized weights {w.shape} and scales {scales.shape}")
    if scales.dtype != x.dtype:  # (the kernels read them as T)
        scales, biases = scales.astype(x.dtype), biases.astype(x.dtype)
    return _launch(
        "mma" if form == "mma" else "quantized",
        x,
        [w, scales, biases],
        w.shape[0],
        [("BITS", bits), ("GS", group_size)],
    )


_none: dict[mx.Dtype, mx.array] = {}  # the dense mma's stand-in scales and biases


def dense(x: mx.array, w: mx.array, form: str = "mma") -> mx.array:
    """x (..., K) times w^T for w (N, K) in x's float type, with rows that do not depend on each other
    (the fma-chain form where the tensor-core form does not take K)."""
    K = x.shape[-1]
    form = form if _takes(form, x.dtype, K) else "simt"
    if w.dtype != x.dtype or K % (16 // x.dtype.size) or w.shape[1] != K:
        raise ValueError(
            f"the row-invariant matmul ({form}) takes weights of x's rows and type, in whole 16-byte words"
        )
    if form == "mma":
        none = _none.get(x.dtype)
        if none is None:
            none = _none[x.dtype] = mx.zeros((1,), dtype=x.dtype)
        return _launch("mma", x, [w, none, none], w.shape[0], [("BITS", 16), ("GS", 32)])
    return _launch("dense", x, [w], w.shape[0], [("W", w.dtype)])


def quantizable(n: int, k: int, group_size: int, bits: int) -> bool:
    """Whether the kernel takes a quantized weight of shape (n, k) in this form."""
    return bits in (4, 8) and group_size in (32, 64, 128) and k % group_size == 0 and k % 32 == 0


# -- routing: the decode passes of a model call the kernel --------------------------------------

_route = [False]  # whether the layers being traced call the kernel


@contextmanager
def routed(on: bool = True) -> Any:
    """Layers swapped by `route` call the kernel inside this block (while a pass is traced)."""
    before = _route[0]
    _route[0] = on
    try:
        yield
    finally:
        _route[0] = before


class _QuantizedLinear(QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        if not _route[0]:
            return cast("mx.array", cast(Any, super()).__call__(x))
        y = quantized(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits, self.kinfer_form)
        return y + self["bias"] if "bias" in self else y


class _Linear(Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if not _route[0] or x.dtype != self["weight"].dtype:  # (MLX promotes: a float32 gate, say)
            return cast("mx.array", cast(Any, super()).__call__(x))
        y = dense(x, self["weight"], self.kinfer_form)
        return y + self["bias"] if "bias" in self else y


class _QuantizedEmbedding(QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        if not _route[0]:
            return cast("mx.array", cast(Any, super()).as_linear(x))
        return quantized(
            x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits, self.kinfer_form
        )


class _Embedding(Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        if not _route[0] or x.dtype != self["weight"].dtype:
            return cast("mx.array", cast(Any, super()).as_linear(x))
        return dense(x, self["weight"], self.kinfer_form)


def _swap(module: Module) -> type | None:
    """The routed class for `module`, or None when the kernel cannot take its weight."""
    w = module.get("weight") if isinstance(module, dict) else None
    if not isinstance(w, mx.array) or w.ndim != 2:
        return None
    if type(module) in (QuantizedLinear, QuantizedEmbedding):
        mode = getattr(module, "mode", "affine")
        scales, biases = module.get("scales"), module.get("biases")
        k = w.shape[1] * 32 // module.bits
        if mode != "affine" or scales is None or biases is None or scales.dtype != biases.dtype:
            return None
        if not quantizable(w.shape[0], k, module.group_size, module.bits):
            return None
        return _QuantizedLinear if type(module) is QuantizedLinear else _QuantizedEmbedding
    if type(module) in (Linear, Embedding):
        if w.dtype not in (mx.float16, mx.bfloat16, mx.float32) or w.shape[1] % 32:
            return None
        return _Linear if type(module) is Linear else _Embedding
    return None


def route(model: Any, form: str = "mma") -> tuple[int, list[str]]:
    """Swap the class of every linear layer (and embedding used as the output head) of `model`
    whose weights the kernel takes, so that inside `routed()` it calls the kernel in `form`;
    returns how many were swapped and the names of the matrix layers left to MLX (whose rows
    then depend on the pass: experts' gathered products, 2-, 3-, 5- or 6-bit groups, ...)."""
    swapped, left = 0, []
    for name, module in model.named_modules():
        new = _swap(module)
        if new is not None:
            module.__class__ = new
            module.kinfer_form = form  # a plain attribute (not a parameter): the kernel it calls
            swapped += 1
        elif type(module).__name__ in ("Linear", "QuantizedLinear", "SwitchLinear", "QuantizedSwitchLinear"):
            left.append(name)
    return swapped, left


def unroute(model: Any) -> None:  # an mlx-lm model
    """Give every swapped layer its MLX class back."""
    back: dict[type, type] = {_QuantizedLinear: QuantizedLinear, _Linear: Linear}
    back.update({_QuantizedEmbedding: QuantizedEmbedding, _Embedding: Embedding})
    for _, module in model.named_modules():
        old = back.get(type(module))
        if old is not None:
            module.__class__ = old


# -- the check a load runs -------------------------------------------------------------------


def _number(a: mx.array) -> float:
    value = a.item()
    assert isinstance(value, (int, float))  # a real scalar's item
    return float(value)


def self_check(
    dtype: mx.Dtype = mx.float16, group_size: int = 64, bits: int = 4, form: str = "mma"
) -> tuple[float, bool]:
    """The kernel against MLX's own products on pseudo-random data (passes of 1, 3, 16, 17 and
    40 rows, a row alone at another index, the rows shuffled; a quantized weight in the given
    form and a dense one; an x that starts 2 bytes past a 16-byte boundary): the largest
    difference relative to the largest value, and whether every row came out with the same bits
    in every pass it was in, wherever it sat."""
    K, N = 512, 200  # N: not a whole number of blocks; K: whole groups of every size taken

    def data(shape: tuple[int, ...], seed: int) -> mx.array:
        n = int(np.prod(shape))
        return mx.sin(mx.arange(n, dtype=mx.float32) * (0.37 + seed) + seed).reshape(shape)

    w = data((N, K), 1) * 0.05
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    wd = w.astype(dtype)
    x = data((41, K), 2).astype(dtype)
    odd = x.reshape(-1)[1 : 1 + 3 * K].reshape(3, K)  # a view one element in: not 16-byte aligned
    odd_copy = mx.array(np.array(odd.astype(mx.float32))).astype(dtype)
    worst, same = 0.0, True
    for kind in ("quantized", "dense"):

        def ours(a: mx.array, kind: str = kind) -> mx.array:
            if kind == "quantized":
                return quantized(a, wq, scales, biases, group_size, bits, form)
            return dense(a, wd, form)

        def theirs(a: mx.array, kind: str = kind) -> mx.array:
            if kind == "quantized":
                return mx.quantized_matmul(a, wq, scales, biases, transpose=True, group_size=group_size, bits=bits)
            return a @ wd.T

        rows = {M: ours(x[:M]) for M in (1, 3, 16, 17, 40)}
        shifted, copied = ours(odd), ours(odd_copy)
        order = [(7 * i + 3) % 40 for i in range(40)]  # every row once, each at another index
        lone, shuffled = ours(x[5:6]), ours(x[mx.array(order)])
        mx.eval(list(rows.values()), shifted, copied, lone, shuffled)
        ref = theirs(x[:40]).astype(mx.float32)
        scale = max(_number(mx.max(mx.abs(ref))), 1e-6)
        worst = max(worst, _number(mx.max(mx.abs(rows[40].astype(mx.float32) - ref))) / scale)
        for M, got in rows.items():
            same = same and bool(mx.array_equal(got, rows[40][:M]).item())
        same = same and bool(mx.array_equal(shifted, copied).item())
        same = same and bool(mx.array_equal(lone, rows[40][5:6]).item())
        same = same and bool(mx.array_equal(shuffled, rows[40][mx.array(order)]).item())
    return worst, same


def prepare(model: Any) -> tuple[bool, str]:
    """Check the kernel here in every form `model`'s matrix layers take (once per load), then
    route them (`route`). (False, why) when the kernel cannot run here, differs from MLX's
    products, or lets a row depend on the others: the model keeps MLX's products."""
    forms: set[tuple[mx.Dtype, int, int]] = set()
    odd = False  # a layer the tensor-core form gives to the fma chain (K not a multiple of 64)
    for _, module in model.named_modules():
        if _swap(module) is None:
            continue
        w = module["weight"]
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            forms.add((module["scales"].dtype, module.group_size, module.bits))
            odd = odd or (w.shape[1] * 32 // module.bits) % 64 != 0
        else:
            forms.add((w.dtype, 64, 4))  # the check runs the dense kernel in every form
            odd = odd or w.shape[1] % 64 != 0
    if not forms:
        return False, "no matrix layer of this model is in a form the row-invariant matmul takes"
    why = ""
    for form in FORMS:  # the tensor-core form where it runs and passes, else the fma chain
        why = _check(form, forms, odd)
        if not why:
            swapped, left = route(model, form)
            if left:  # a row would still depend on the pass there: the kernel would buy nothing
                unroute(model)
                some = ", ".join(left[:3]) + (", ..." if len(left) > 3 else "")
                return False, f"matrix layers the row-invariant matmul does not take: {some}"
            return True, f"{swapped} matrix layers routed ({form})"
        log.info("mlx: %s", why)
    return False, why


def _check(form: str, forms: set[tuple[mx.Dtype, int, int]], odd: bool = False) -> str:
    """Why the kernel in `form` cannot serve these (float type, group size, bits), or "". A float
    type the form does not take, and with `odd` every type, is checked in the fma-chain form too
    (what such layers run)."""
    for dtype, group_size, bits in sorted(forms, key=str):
        checks = [form if _takes(form, dtype, 64) else "simt"]
        checks += ["simt"] if odd and checks[0] != "simt" else []
        for each in checks:
            try:
                worst, same = self_check(dtype, group_size, bits, each)
            except Exception as exc:  # noqa: BLE001 - a CUDA build without NVRTC headers, say
                return f"the row-invariant matmul ({each}) did not run ({exc})"
            if not same:
                return f"the row-invariant matmul ({each}) gave a row different bits in different passes"
            if not worst < (0.02 if dtype == mx.bfloat16 else 0.005):
                return f"the row-invariant matmul ({each}) differs from MLX's by {worst:.3g} of the largest value"
    return ""
