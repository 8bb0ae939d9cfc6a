"""The little of a GGUF header the mlx backend checks before `mx.load` reads the weights: the
architecture and each tensor's name and type (mx.load fails on a type it cannot read without
naming the tensor). GGUF v2/v3 layout: magic, version, tensor count, key/value count, the
key/values, then each tensor's name, dimensions, type and offset."""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

# ggml tensor type ids -> names, for messages
TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read(path: str | os.PathLike[str]) -> tuple[str | None, list[tuple[str, int]]]:
    """(general.architecture, [(tensor name, ggml type id), ...]); ValueError if it is not a GGUF
    file this can read."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        try:
            return _parse(m)
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise ValueError(f"{os.fspath(path)} is not a GGUF file the mlx backend can read: {exc}") from None


def _parse(m: Any) -> tuple[str | None, list[tuple[str, int]]]:
    if m[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    pos = 8  # magic, version

    def unpack(fmt: str) -> Any:
        nonlocal pos
        (v,) = struct.unpack_from("<" + fmt, m, pos)
        pos += struct.calcsize("<" + fmt)
        return v

    def string() -> str:
        nonlocal pos
        n = unpack("Q")
        if n > len(m) - pos:
            raise IndexError("a string past the end of the file")
        s = bytes(m[pos : pos + n]).decode("utf-8")
        pos += n
        return s

    def value(kind: int) -> Any:
        if kind == 8:
            return string()
        if kind == 9:
            item, n = unpack("I"), unpack("Q")
            if item in _SCALARS:  # skipped whole: token lists are long
                nonlocal pos
                pos += n * struct.calcsize("<" + _SCALARS[item])
                return None
            for _ in range(n):
                value(item)
            return None
        if kind not in _SCALARS:
            raise IndexError(f"an unknown value type {kind}")
        return unpack(_SCALARS[kind])

    n_tensors, n_kv = unpack("Q"), unpack("Q")
    arch = None
    for _ in range(n_kv):
        key = string()
        v = value(unpack("I"))
        if key == "general.architecture" and isinstance(v, str):
            arch = v
    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = unpack("I")
        pos += 8 * dims
        tensors.append((name, unpack("I")))
        pos += 8  # offset
    return arch, tensors
