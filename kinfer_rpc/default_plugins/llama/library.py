"""The llama.cpp library as this process holds it: loaded once (through `native`), its log sent
to Python's, the bindings llama-cpp-python lacks added, and the CUDA kernels' switch, which
ggml-cuda reads once per process."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kinfer_rpc.default_plugins.llama import buft, native, rpc

log = logging.getLogger("kinfer_rpc.llama")
_init_lock = threading.Lock()
_initialised = False
_log_callback: object = None  # kept alive: llama.cpp holds the pointer
_cuda_lock = threading.Lock()
_cuda_invariant: bool | None = None  # the switch as this process's first GPU load found or set it


def load() -> ModuleType:
    """llama_cpp, imported lazily and once: it loads a native library and may print. Through
    `native`, which refuses a library that would crash this process."""
    global _initialised, _log_callback
    L = native.load()

    with _init_lock:
        if not _initialised:

            def forward(level: int, text: bytes, _user: Any) -> None:
                # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation. Loads log a lot:
                # keep info at debug so a user sees only what needs them.
                msg = text.decode("utf-8", "replace").rstrip()
                rpc.capture_line(msg)
                if msg:
                    log.log({3: logging.WARNING, 4: logging.ERROR}.get(level, logging.DEBUG), "%s", msg)

            _log_callback = L.llama_log_callback(forward)
            L.llama_log_set(_log_callback, ctypes.c_void_p(0))
            L.llama_backend_init()
            # llama-cpp-python 0.3.36 leaves tensor_buft_overrides unbound (patches/README.md).
            buft.apply(L)
            global _output_argmax
            _output_argmax = _bind_output_argmax()
            _initialised = True
    return L


def _bind_output_argmax() -> tuple[Callable[[Any, int], None] | None, Callable[[Any], Any] | None]:
    """llama_set_output_argmax / llama_get_output_argmax where the loaded libllama has them
    (patches/llama-output-argmax.patch), else None."""
    import llama_cpp.llama_cpp as raw

    lib = raw._lib
    try:
        set_fn, get_fn = lib.llama_set_output_argmax, lib.llama_get_output_argmax
    except AttributeError:
        return None, None
    set_fn.argtypes, set_fn.restype = [ctypes.c_void_p, ctypes.c_int32], None
    get_fn.argtypes, get_fn.restype = [ctypes.c_void_p], ctypes.POINTER(ctypes.c_int32)
    return set_fn, get_fn


# (ctx, mode) and (ctx) -> the rows' int32 token ids; None without the patch
_output_argmax: tuple[Callable[[Any, int], None] | None, Callable[[Any], Any] | None] = (None, None)


def output_argmax() -> tuple[Callable[[Any, int], None] | None, Callable[[Any], Any] | None]:
    """llama_set_output_argmax and llama_get_output_argmax of the loaded library (after `load`),
    or None each without patches/llama-output-argmax.patch."""
    return _output_argmax


def cuda_kernels(reproducible: bool | None) -> tuple[bool, str]:
    """Before a load with every layer on the GPU: whether its kernels will be batch-invariant,
    and why. ggml-cuda reads its switch once per process, at its first pass; a load asking for
    speed (reproducible false) turns it off when it is the first and the environment says
    nothing. Later loads get what the first one set."""
    global _cuda_invariant
    if not native.cuda_batch_invariant():
        return False, (
            "this llama.cpp's GPU kernels are chosen by the shape of each pass, so a reply depends on what "
            "else runs (kinfer's llama.cpp has batch-invariant CUDA kernels: `kinfer setup --cuda` builds it)"
        )
    switch = native.CUDA_SWITCH
    with _cuda_lock:
        if _cuda_invariant is None:
            if reproducible is False and switch not in os.environ:
                os.environ[switch] = "0"
            value = os.environ.get(switch)
            _cuda_invariant = value is None or leading_int(value) != 0
        on = _cuda_invariant
    if on:
        return True, "CUDA with kinfer's batch-invariant kernels, every layer on the GPU, flash attention, f16 KV cells"
    return False, (
        f"CUDA with llama.cpp's own kernels ({switch}=0, set for this process by its first GPU load or its "
        "environment), which are chosen by the shape of each pass"
    )


def leading_int(text: str) -> int:
    """C's atoi, as ggml-cuda reads its switch."""
    digits = text.strip()
    sign = -1 if digits[:1] == "-" else 1
    digits = digits.lstrip("+-")
    n = len(digits) - len(digits.lstrip("0123456789"))
    return sign * int(digits[:n]) if n else 0
