"""What a GGUF file says about itself, read from its header without loading any weights.

A GGUF file is: magic `GGUF`, a version, the tensor and key-value counts, the key-value pairs
(typed values, arrays included), the tensor infos (name, shape, type, offset), then the aligned
tensor data. We read the pairs we need, skip the rest (big arrays such as the tokenizer's tokens
by length, never by value), sum the tensor shapes for the parameter count, and check that every
tensor's data lies inside the file: a truncated download is caught here, before a backend sees it.
Anything malformed is a KinferError (LOAD_FAILED), never a crash. Results are cached by
(path, size, mtime). `read_mlx` does the same for an MLX folder (config.json, safetensors headers).

`check_llama` goes further for a file llama.cpp is about to load: llama.cpp asserts on some
hyperparameters (GGML_ASSERT aborts the whole process, every model and request with it) or divides
by them, and some only fail at the first decode (a NaN norm epsilon). It refuses, with what is
wrong, the values that do: layer and expert counts out of range or without their partner, norm
epsilons that are not finite and positive, head counts that do not divide, the main tensors'
shapes against the hyperparameters, and the tensor table's offsets and block sizes.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
import threading
from pathlib import Path
from typing import Any, NamedTuple, cast

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


class Tensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # ggml's order: ne[0] (the row's length) first
    type: int
    offset: int  # from the start of the tensor data


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
    # Every key's value: scalars as they are, strings only for the keys read above (else None),
    # arrays as ("array", element type, length). The tensor table, and the data's alignment.
    metadata: dict[str, Any] = attrs.field(factory=dict)
    tensors: tuple[Tensor, ...] = ()
    alignment: int = 32
    license: str | None = None  # general.license: an SPDX id or the license's text


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
        "general.license",
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
    tensors: list[Tensor] = []
    for _ in range(n_tensors):
        tname = r.string()
        n_dims = r.unpack("I")
        if n_dims > 8:
            raise _Corrupt(f"a tensor with {n_dims} dimensions")
        shape = tuple(r.count() for _ in range(n_dims))
        elements = math.prod(shape)
        ttype, offset = r.unpack("I"), r.count()
        tensors.append(Tensor(tname, shape, ttype, offset))
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
        metadata=kv,
        tensors=tuple(tensors),
        alignment=alignment,
        license=kv["general.license"] if isinstance(kv.get("general.license"), str) else None,
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


# What check_llama accepts. llama.cpp keeps per-layer values in arrays of LLAMA_MAX_LAYERS entries
# and asserts the expert count against LLAMA_MAX_EXPERTS; the other bounds are far above any real
# model and only keep the sizes computed from them sane.
MAX_LAYERS = 512
MAX_EXPERTS = 512
MAX_EMBEDDING = 1 << 20
MAX_FEED_FORWARD = 1 << 24
MAX_HEADS = 1 << 14
MAX_HEAD_SIZE = 1 << 16
MAX_CONTEXT = 1 << 28
# Architectures whose head count may be 0: layers without attention (recurrent ones), or no heads at all.
_NO_ATTENTION = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "wavtokenizer-dec"})
# Architectures whose layers are llama's (attn_q/k/v/output, ffn_gate/up/down): their main tensors
# are checked one by one against the hyperparameters.
_LLAMA_LAYOUT = frozenset({"llama", "qwen2", "qwen3"})
# Layer tensors are blk.N.* (enc.blk.N.* and dec.blk.N.* in encoder-decoder models).
_LAYER = re.compile(r"(?:^|\.)blk\.(\d+)\.")
_EPSILONS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon", "attention.group_norm_epsilon")


def check_llama(path: str | os.PathLike[str]) -> None:
    """Refuse (LOAD_FAILED, saying what is wrong) a GGUF whose hyperparameters or tensor table
    llama.cpp would assert on, divide by or compute garbage from; the header must read (see read)."""
    path = os.fspath(path)
    problems = llama_problems(read(path))
    if problems:
        shown = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        raise errors.KinferError(errors.LOAD_FAILED, f"{path} cannot be loaded safely: {shown}", {"path": path})


def llama_problems(info: GGUFInfo) -> list[str]:
    """What is wrong with a GGUF for llama.cpp, in words; empty when nothing is."""
    meta, arch = info.metadata, info.architecture
    if arch is None:
        return ["it names no general.architecture"]
    problems: list[str] = []

    def number(key: str, low: int, high: int, required: bool = False) -> int | None:
        """The integer value of `{arch}.key` if it lies in low..high; None (a problem noted
        when it is not) otherwise, or when it is missing or an array (per-layer values)."""
        full = f"{arch}.{key}"
        v = meta.get(full)
        if v is None:
            if full in meta:  # a string (left unread)
                problems.append(f"{full} is a string, not an integer")
            elif required:
                problems.append(f"it has no {full}")
            return None
        if isinstance(v, tuple):
            return None
        if not isinstance(v, int) or isinstance(v, bool):
            problems.append(f"{full} is {v!r}, not an integer")
            return None
        if not low <= v <= high:
            problems.append(f"{full} is {v} (must be {low} to {high})")
            return None
        return v

    for key, v in meta.items():
        if key.startswith(f"{arch}.") and isinstance(v, float) and not math.isfinite(v):
            problems.append(f"{key} is {v} (must be a finite number)")
    for key in (*_EPSILONS, "rope.freq_base"):
        full = f"{arch}.{key}"
        v = meta.get(full)
        if full not in meta or isinstance(v, float) and (v > 0 or not math.isfinite(v)):
            continue  # missing, fine, or not finite (said above)
        shown = f"{v:.6g}" if isinstance(v, float) else "a string" if v is None else repr(v)
        problems.append(f"{full} is {shown} (must be a number above 0)")

    layers = number("block_count", 1, MAX_LAYERS, required=True)
    embd = number("embedding_length", 1, MAX_EMBEDDING, required=True)
    number("context_length", 1, MAX_CONTEXT, required=True)
    n_ff = number("feed_forward_length", 0, MAX_FEED_FORWARD)
    attention = arch not in _NO_ATTENTION
    heads = number("attention.head_count", 1 if attention else 0, MAX_HEADS)
    if attention and f"{arch}.attention.head_count" not in meta:
        problems.append(f"it has no {arch}.attention.head_count")
    heads_kv = number("attention.head_count_kv", 1 if attention else 0, MAX_HEADS)
    if heads and heads_kv and (heads_kv > heads or heads % heads_kv):
        problems.append(
            f"{arch}.attention.head_count_kv is {heads_kv}, which does not divide {arch}.attention.head_count {heads}"
        )
    key_len = number("attention.key_length", 1 if attention else 0, MAX_HEAD_SIZE)
    value_len = number("attention.value_length", 1 if attention else 0, MAX_HEAD_SIZE)

    n_problems = len(problems)
    experts = number("expert_count", 0, MAX_EXPERTS) or 0
    used = number("expert_used_count", 0, MAX_EXPERTS) or 0
    groups = number("expert_group_count", 0, MAX_EXPERTS) or 0
    groups_used = number("expert_group_used_count", 0, MAX_EXPERTS) or 0
    if arch in ("hunyuan-dense", "hunyuan-vl") and experts <= 1:
        experts = used = 0  # llama.cpp reads these as dense
    if len(problems) > n_problems:
        pass  # a count out of range or of the wrong type: said already
    elif used > experts:
        problems.append(
            f"{arch}.expert_used_count is {used} but {arch}.expert_count is {experts}"
            + ("" if experts else " (missing or 0): an expert count goes with its partner key")
        )
    elif experts and not used:
        problems.append(f"{arch}.expert_count is {experts} without {arch}.expert_used_count (or it is 0)")
    if experts and groups >= experts:
        problems.append(f"{arch}.expert_group_count {groups} is not below {arch}.expert_count {experts}")
    elif experts and groups > 1 and (experts % groups or not 0 < groups_used < groups):
        problems.append(
            f"{arch}.expert_group_count {groups} must divide {arch}.expert_count {experts} and "
            f"{arch}.expert_group_used_count ({groups_used}) must be 1 to {groups - 1}"
        )
    elif not experts and groups:
        problems.append(f"{arch}.expert_group_count is {groups} in a model without experts")

    problems += _table_problems(info)
    if layers is not None and arch != "wavtokenizer-dec":
        seen = {int(m.group(1)) for t in info.tensors if (m := _LAYER.search(t.name))}
        missing = [n for n in range(layers) if n not in seen]
        if missing:
            problems.append(
                f"{arch}.block_count is {layers} but the tensor table has no tensors of "
                f"{len(missing)} of those layers (first blk.{missing[0]})"
            )
    if embd is None:
        return problems
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = tokens[2] if isinstance(tokens, tuple) else number("vocab_size", 1, 1 << 31)
    shapes: dict[str, tuple[tuple[int | None, ...], str]] = {}
    required: list[str] = []
    if arch != "wavtokenizer-dec":
        shapes["token_embd.weight"] = ((embd, vocab), "embedding_length x the vocabulary's size")
    if arch in _LLAMA_LAYOUT and layers is not None and heads:
        k = key_len or embd // heads
        v = value_len or k
        kv = heads_kv or heads
        shapes["output_norm.weight"] = ((embd,), "embedding_length")
        shapes["output.weight"] = ((embd, vocab), "embedding_length x the vocabulary's size")
        for i in range(layers):
            b = f"blk.{i}."
            shapes[b + "attn_norm.weight"] = ((embd,), "embedding_length")
            shapes[b + "ffn_norm.weight"] = ((embd,), "embedding_length")
            shapes[b + "attn_q.weight"] = ((embd, k * heads), "embedding_length x key_length * head_count")
            shapes[b + "attn_k.weight"] = ((embd, k * kv), "embedding_length x key_length * head_count_kv")
            shapes[b + "attn_v.weight"] = ((embd, v * kv), "embedding_length x value_length * head_count_kv")
            shapes[b + "attn_output.weight"] = ((k * heads, embd), "key_length * head_count x embedding_length")
            if n_ff and not experts:  # a dense FFN (a mixture of experts has ffn_*_exps instead)
                shapes[b + "ffn_gate.weight"] = ((embd, n_ff), "embedding_length x feed_forward_length")
                shapes[b + "ffn_up.weight"] = ((embd, n_ff), "embedding_length x feed_forward_length")
                shapes[b + "ffn_down.weight"] = ((n_ff, embd), "feed_forward_length x embedding_length")
        required = [name for name in shapes if name != "output.weight"]  # no output: tied to token_embd
    names = {t.name for t in info.tensors}
    absent = [name for name in required if name not in names]
    if absent:
        problems.append(
            f"the tensor table lacks {len(absent)} tensor(s) the {arch} architecture needs (first {absent[0]})"
        )
    for t in info.tensors:
        want = shapes.get(t.name)
        if want is None:
            continue
        expected, meaning = want
        if len(t.shape) != len(expected) or any(w is not None and w != d for w, d in zip(expected, t.shape)):
            problems.append(
                f"tensor {t.name} is {_dims(t.shape)}, but the hyperparameters make it {_dims(expected)} ({meaning})"
            )
    return problems


def _table_problems(info: GGUFInfo) -> list[str]:
    """The tensor table's own faults: names twice, misaligned data, rows not whole blocks."""
    problems: list[str] = []
    names: set[str] = set()
    for t in info.tensors:
        if t.name in names:
            problems.append(f"tensor {t.name} is in the tensor table twice")
        names.add(t.name)
        if t.offset % info.alignment:
            problems.append(f"tensor {t.name}'s data offset {t.offset} is not a multiple of {info.alignment}")
        block = TENSOR_TYPES.get(t.type)
        if block is not None and t.shape and t.shape[0] % block[1]:
            problems.append(f"tensor {t.name}'s rows of {t.shape[0]} are not whole {block[0]} blocks of {block[1]}")
    return problems


def _dims(shape: tuple[int | None, ...]) -> str:
    return " x ".join("?" if d is None else str(d) for d in shape) or "a scalar"


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
