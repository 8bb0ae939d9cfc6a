"""The mlx backend's CUDA kernels (default_plugins/mlx/attention.py's decode attention and
matmul.py's row-invariant matrix products) compile.

The kernels run only on a GPU (MLX's CUDA build compiles them with NVRTC at first use). Here the
same source, wrapped the way MLX's `mx.fast.cuda_kernel` wraps it (a `__global__` function whose
parameters are the inputs with their shapes, then the outputs, and `constexpr` template values),
is compiled with NVRTC to sm_90 machine code (the H200; inline PTX is assembled too) against
CUDA's own headers, for each element type and head shape (or weight form) the backend can pass.
A syntax or type error in the source fails here, not on a user's GPU at load. What the kernels
compute is checked on the GPU, at every load (self_check).
"""

from __future__ import annotations

import ctypes
import glob
import os

import pytest

from kinfer_rpc.default_plugins.mlx import attention as att
from kinfer_rpc.default_plugins.mlx import matmul as mm

nvidia = pytest.importorskip(
    "nvidia", reason="the NVRTC wheels: pip install -e '.[test,nvrtc]' (Linux x86-64 only; CI installs them)"
)
ROOT = list(nvidia.__path__)[0]
LIB = (glob.glob(os.path.join(ROOT, "cuda_nvrtc", "lib", "libnvrtc.so*")) or [None])[0]

SHIM = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
typedef int int32_t;
typedef unsigned int uint32_t;
namespace mlx { namespace core { namespace cu {
struct Shape { int d[8]; __device__ int operator[](int i) const { return d[i]; } };
"""


def source(dtype: str, D: int, G: int) -> str:
    inputs = [
        ("queries", dtype),
        ("new_keys", dtype),
        ("new_values", dtype),
        ("keys", dtype),
        ("values", dtype),
        ("slots", "int32_t"),
        ("cols", "int32_t"),
        ("scale", "float"),
        ("counter", "int32_t"),
    ]
    params = []
    for name, t in inputs:
        params.append(f"const {t}* {name}")
        if f"{name}_shape" in att._SOURCE:
            params.append(f"const __grid_constant__ Shape {name}_shape")
    params += [f"{dtype}* out", "float* partial", "float* row_max", "float* row_sum"]
    consts = "".join(
        f"  constexpr int {k} = {v};\n" for k, v in (("D", D), ("G", G), ("NT", att.NT), ("CHUNK", att.CHUNK))
    )
    return (
        SHIM
        + "__global__ void custom_kernel_kinfer_decode_attention("
        + ",\n".join(params)
        + ") {\n"
        + f"  using T = {dtype};\n"
        + consts
        + att._SOURCE
        + "\n}\n}}}\n"
    )


def compile_sm90(code: str) -> None:
    """NVRTC compiles `code` for sm_90, or the assertion carries its log."""
    if LIB is None:
        pytest.skip("libnvrtc is not installed: pip install -e '.[test,nvrtc]'")
    lib = ctypes.CDLL(LIB)
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"kernel.cu", 0, None, None) == 0
    includes = [os.path.join(ROOT, "cuda_runtime", "include"), os.path.join(ROOT, "cuda_cccl", "include")]
    # to sm_90 machine code, so that inline PTX is assembled too
    opts = [b"--gpu-architecture=sm_90", b"-std=c++17"] + [f"-I{p}".encode() for p in includes]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, log.value.decode(errors="replace")


@pytest.mark.parametrize(
    "dtype,D,G",
    [("__half", 128, 4), ("__half", 128, 1), ("__nv_bfloat16", 64, 8), ("float", 128, 4), ("__half", 256, 2)],
)
def test_kernel_source_compiles_for_sm90(dtype, D, G):
    compile_sm90(source(dtype, D, G))


def matmul_source(dtype: str, kind: str, bits: int, group: int) -> str:
    """matmul.py's kernel as MLX wraps it: inputs x, w (uint32 words or dense), scales, biases."""
    sources = {"quantized": mm.QUANTIZED_SOURCE, "dense": mm.DENSE_SOURCE, "mma": mm.MMA_SOURCE}
    body = sources[kind]
    inputs = [("x", dtype), ("w", "uint32_t" if bits < 16 else dtype)]
    inputs += [("scales", dtype), ("biases", dtype)] if kind != "dense" else []
    params = []
    for name, t in inputs:
        params.append(f"const {t}* {name}")
        if f"{name}_shape" in body:
            params.append(f"const __grid_constant__ Shape {name}_shape")
    params.append(f"{dtype}* y")
    types = f"  using T = {dtype};\n" + (f"  using W = {dtype};\n" if kind == "dense" else "")
    ints: tuple[tuple[str, int], ...] = (("BITS", bits), ("GS", group)) if kind != "dense" else ()
    if kind == "mma":
        ints += (("BF", int(dtype == "__nv_bfloat16")), ("NW", mm.NW), ("TT", mm.TT), ("PD", mm.PREFETCH))
    else:
        ints += (("TM", mm.TM), ("NT", mm.NT))
    consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in ints)
    name = f"custom_kernel_kinfer_rows_matmul_{kind}"
    return SHIM + f"__global__ void {name}(" + ",\n".join(params) + ") {\n" + types + consts + body + "\n}\n}}}\n"


@pytest.mark.parametrize(
    "dtype,kind,bits,group",
    [
        ("__half", "quantized", 4, 64),
        ("__half", "quantized", 8, 32),
        ("__nv_bfloat16", "quantized", 4, 128),
        ("float", "quantized", 8, 64),
        ("__half", "dense", 16, 0),
        ("__nv_bfloat16", "dense", 16, 0),
        ("float", "dense", 32, 0),
        ("__half", "mma", 4, 64),
        ("__half", "mma", 8, 32),
        ("__nv_bfloat16", "mma", 4, 128),
        ("__half", "mma", 16, 32),
        ("__nv_bfloat16", "mma", 16, 32),
    ],
)
def test_matmul_source_compiles_for_sm90(dtype, kind, bits, group):
    compile_sm90(matmul_source(dtype, kind, bits, group))


def test_a_broken_source_fails_to_compile(monkeypatch):
    """The check can fail: the same source with an undefined name does not compile."""
    if LIB is None:
        pytest.skip("libnvrtc is not installed: pip install -e '.[test,nvrtc]'")
    monkeypatch.setattr(
        att, "_SOURCE", att._SOURCE.replace("const float NEG =", "const float NEG = inf_undefined +", 1)
    )
    with pytest.raises(AssertionError, match="inf_undefined"):
        test_kernel_source_compiles_for_sm90("__half", 128, 4)
