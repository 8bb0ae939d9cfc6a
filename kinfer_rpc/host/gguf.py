"""What a GGUF file says about itself, read from its header without loading any weights.

A GGUF file is: magic `GGUF`, a version, the tensor and key-value counts, the key-value pairs
(typed values, arrays included), the tensor infos (name, shape, type, offset), then the aligned
tensor data. We read the pairs we need, skip the rest (big arrays such as the tokenizer's tokens
by length, never by value), sum the tensor shapes for the parameter count, and check that every
tensor's data lies inside the file: a truncated download is caught here, before a backend sees it.
Anything malformed is a KinferError (LOAD_FAILED), never a crash. Results are cached by
(path, size, mtime). `read_mlx` does the same for an MLX folder (config.json, safetensors headers).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
import threading
from pathlib import Path
from typing import Any, cast

import attrs

from kinfer_rpc import errors

MAGIC = b"GGUF"

# llama.cpp's LLAMA_FTYPE numbering (general.file_type).
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
}

# ggml tensor types: id -> (name, elements per block, bytes per block).
TENSOR_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

# Mixture-of-experts tensors (llama.cpp's LLM_FFN_EXPS_REGEX, what --cpu-moe keeps in host memory).
EXPERT_TENSORS = re.compile(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps")
# Integer hyperparameters kept for placements, after the architecture's prefix.
_HPARAMS = (
    "block_count",
    "embedding_length",
    "feed_forward_length",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "vocab_size",
)

# GGUF value types: id -> struct format of a scalar (8 string, 9 array are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@attrs.frozen
class GGUFInfo:
    version: int
    architecture: str | None
    name: str | None
    context_length: int | None
    file_type: int | None
    quantization: str | None
    parameters: int
    tensor_count: int
    chat_template: str | None
    n_vocab: int | None
    data_end: int  # the least file size that holds every tensor
    # What a placement needs (kinfer_rpc.types.ModelFacts): the architecture's numbers, and the
    # bytes of all tensors, of the expert tensors, and of those outside the repeating layers.
    hparams: dict[str, int] = attrs.field(factory=dict)
    weight_bytes: int = 0
    expert_bytes: int = 0
    outside_bytes: int = 0


class _Corrupt(Exception):
    pass


class _Reader:
    def __init__(self, buf: bytes | mmap.mmap, size: int):
        self.buf = buf
        self.size = size
        self.pos = 0
        self.width = "Q"  # counts and string lengths: uint64 since GGUF v2, uint32 in v1

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise _Corrupt(f"the file ends at byte {self.size}, inside its header (truncated?)")
        self.pos = start + n
        return start

    def unpack(self, fmt: str) -> Any:
        fmt = "<" + fmt
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def count(self) -> int:
        return cast(int, self.unpack(self.width))

    def string(self) -> str:
        n = self.count()
        start = self.take(n)
        return bytes(self.buf[start : start + n]).decode("utf-8", "replace")

    def skip_string(self) -> None:
        self.take(self.count())

    def value(self, vtype: int, keep: bool) -> Any:
        """A value, or (for arrays) its element type and length; `keep` False skips strings."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if vtype == _ARRAY:
            etype, n = self.unpack("I"), self.count()
            if etype in _SCALARS:
                self.take(n * struct.calcsize(_SCALARS[etype]))
            elif etype == _STRING:
                for _ in range(n):
                    self.skip_string()
            else:
                raise _Corrupt(f"an array of unknown value type {etype}")
            return ("array", etype, n)
        raise _Corrupt(f"unknown value type {vtype}")


def _parse(buf: bytes | mmap.mmap, size: int) -> GGUFInfo:
    r = _Reader(buf, size)
    if bytes(buf[r.take(4) : 4]) != MAGIC:
        raise _Corrupt("not a GGUF file (bad magic)")
    version = r.unpack("I")
    if version not in (1, 2, 3):
        raise _Corrupt(f"unsupported GGUF version {version}")
    if version == 1:
        r.width = "I"
    n_tensors, n_kv = r.count(), r.count()
    if n_tensors > size or n_kv > size:
        raise _Corrupt("impossible tensor or key counts")
    wanted = {
        "general.architecture",
        "general.name",
        "general.file_type",
        "general.alignment",
        "tokenizer.chat_template",
    }
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        vtype = r.unpack("I")
        value = r.value(vtype, key in wanted or key.endswith(".context_length"))
        kv[key] = value
    hparams: dict[str, int] = {}
    arch_name = kv.get("general.architecture")
    if isinstance(arch_name, str):
        for k in _HPARAMS:
            v = kv.get(f"{arch_name}.{k}")
            if isinstance(v, int) and not isinstance(v, bool):
                hparams[k] = v
    arch = kv.get("general.architecture") if isinstance(kv.get("general.architecture"), str) else None
    ctx = kv.get(f"{arch}.context_length") if arch else None
    tokens = kv.get("tokenizer.ggml.tokens")
    alignment = kv.get("general.alignment", 32)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
        raise _Corrupt(f"bad general.alignment {alignment!r}")
    by_type: dict[int, int]  # elements of each tensor type
    params, by_type, ends = 0, {}, 0
    weight_bytes = expert_bytes = outside_bytes = 0
    for _ in range(n_tensors):
        tname = r.string()
        n_dims = r.unpack("I")
        if n_dims > 8:
            raise _Corrupt(f"a tensor with {n_dims} dimensions")
        elements = 1
        for _ in range(n_dims):
            elements *= r.count()
        ttype, offset = r.unpack("I"), r.count()
        params += elements
        by_type[ttype] = by_type.get(ttype, 0) + elements
        block = TENSOR_TYPES.get(ttype)
        nbytes = (elements + block[1] - 1) // block[1] * block[2] if block else 0
        ends = max(ends, offset + nbytes)
        weight_bytes += nbytes
        if EXPERT_TENSORS.search(tname):
            expert_bytes += nbytes
        elif not tname.startswith("blk."):
            outside_bytes += nbytes
    data_start = (r.pos + alignment - 1) // alignment * alignment
    data_end = data_start + ends if n_tensors else r.pos
    if data_end > size:
        raise _Corrupt(f"the tensor data needs {data_end} bytes but the file has {size} (truncated?)")
    file_type = kv.get("general.file_type")
    file_type = file_type if isinstance(file_type, int) and not isinstance(file_type, bool) else None
    if file_type is not None:
        quant = FILE_TYPES.get(file_type & 0x3FF, f"ftype {file_type}")  # 1024 is LLAMA_FTYPE_GUESSED
    elif by_type:
        top = max(by_type, key=by_type.__getitem__)  # the type most weights have
        quant = TENSOR_TYPES.get(top, (f"type {top}",))[0]
    else:
        quant = None
    template = kv.get("tokenizer.chat_template")
    return GGUFInfo(
        version=version,
        architecture=arch,
        name=kv.get("general.name") if isinstance(kv.get("general.name"), str) else None,
        context_length=ctx if isinstance(ctx, int) and not isinstance(ctx, bool) else None,
        file_type=file_type,
        quantization=quant,
        parameters=params,
        tensor_count=n_tensors,
        chat_template=template if isinstance(template, str) else None,
        n_vocab=tokens[2] if isinstance(tokens, tuple) else None,
        data_end=data_end,
        hparams=hparams,
        weight_bytes=weight_bytes,
        expert_bytes=expert_bytes,
        outside_bytes=outside_bytes,
    )


_cache: dict[tuple[str, int, int], GGUFInfo] = {}
_lock = threading.Lock()


def read(path: str | os.PathLike[str]) -> GGUFInfo:
    """The GGUF metadata of `path`; LOAD_FAILED naming the file if it is not a sound GGUF."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise errors.KinferError(errors.LOAD_FAILED, f"cannot read {path}: {exc.strerror}") from exc
    key = (path, st.st_size, st.st_mtime_ns)
    with _lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    try:
        with open(path, "rb") as fh:
            if st.st_size < 24:
                raise _Corrupt(f"only {st.st_size} bytes: too short for a GGUF header")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                info = _parse(buf, len(buf))
    except _Corrupt as exc:
        raise errors.KinferError(
            errors.LOAD_FAILED, f"{path} is not a usable GGUF file: {exc}", {"path": path}
        ) from None
    except (OSError, ValueError, struct.error, OverflowError, MemoryError) as exc:
        raise errors.KinferError(
            errors.LOAD_FAILED, f"cannot read the GGUF header of {path}: {exc}", {"path": path}
        ) from exc
    with _lock:
        _cache[key] = info
    return info


def read_mlx(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Architecture, context, quantization and parameter count of an MLX (safetensors) folder."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise errors.KinferError(errors.LOAD_FAILED, f"cannot read {folder / 'config.json'}: {exc}") from exc
    if not isinstance(config, dict):
        config = {}

    def number(v: object) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    quant = config.get("quantization")
    bits = number(quant.get("bits")) if isinstance(quant, dict) else None
    params = 0
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with open(file, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(min(n, 100 << 20)))
            for tname, t in header.items():
                if tname == "__metadata__" or tname.endswith((".scales", ".biases")):
                    continue
                count = 1
                for d in t["shape"]:
                    count *= int(d)
                if bits and f"{tname.rsplit('.', 1)[0]}.scales" in header:
                    count = count * 32 // bits  # packed into uint32
                params += count
        except (OSError, ValueError, struct.error, TypeError, KeyError, AttributeError):
            continue  # an unreadable shard only leaves the count short
    arch, dtype = config.get("model_type"), config.get("torch_dtype")
    return {
        "architecture": arch if isinstance(arch, str) else None,
        "parameters": params or None,
        "quantization": f"{bits}bit" if bits else dtype if isinstance(dtype, str) else None,
        "contextLength": number(config.get("max_position_embeddings")),
    }
