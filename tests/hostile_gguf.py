"""A corpus of hostile GGUF files: the embedded model with one thing wrong in its metadata or its
tensor table, each a value llama.cpp asserts on, divides by or computes garbage from.

`Gguf.read(src)` splits a GGUF v3 file into its key-value pairs (raw bytes, so every value the
test does not touch is copied as it is), its tensor table and where its tensor data starts;
`write(dst)` writes it back, header first, then the data. Tensor offsets count from the data's
start, so a changed header only moves the data. `data="sparse"` leaves the data a hole of the
same length (no disk space, no time): kinfer refuses these files from their header alone, and a
file it let through would still meet llama.cpp with a full-length tensor table. `data="copy"`
copies the weights (about 100 MB for the embedded model).

`CORPUS` names each mutation, what it does, and a piece of the message the refusal must carry;
`build_corpus(folder)` writes them all.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

U32, I32, F32, STRING, ARRAY = 4, 5, 6, 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass
class TensorInfo:
    name: str
    shape: list[int]  # ne[0] first
    type: int
    offset: int


@dataclass
class Gguf:
    src: str
    kvs: list[tuple[str, int, bytes]]  # key, value type, the value's raw bytes
    tensors: list[TensorInfo]
    data_start: int  # in src
    alignment: int = 32
    size: int = 0  # of src
    changes: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, src: str) -> Gguf:
        with open(src, "rb") as f:
            magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
            assert magic == b"GGUF" and version == 3, (magic, version)
            kvs, alignment = [], 32
            for _ in range(n_kv):
                (klen,) = struct.unpack("<Q", f.read(8))
                key = f.read(klen).decode()
                (vtype,) = struct.unpack("<I", f.read(4))
                start = f.tell()
                _skip(f, vtype)
                end = f.tell()
                f.seek(start)
                raw = f.read(end - start)
                if key == "general.alignment":
                    (alignment,) = struct.unpack("<I", raw)
                kvs.append((key, vtype, raw))
            tensors = []
            for _ in range(n_tensors):
                (nlen,) = struct.unpack("<Q", f.read(8))
                name = f.read(nlen).decode()
                (ndim,) = struct.unpack("<I", f.read(4))
                shape = list(struct.unpack(f"<{ndim}Q", f.read(8 * ndim)))
                ttype, offset = struct.unpack("<IQ", f.read(12))
                tensors.append(TensorInfo(name, shape, ttype, offset))
            data_start = -(-f.tell() // alignment) * alignment
            size = os.fstat(f.fileno()).st_size
        return cls(src, kvs, tensors, data_start, alignment, size)

    # -- metadata ---------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return self.get("general.architecture")

    def get(self, key: str):
        for k, vtype, raw in self.kvs:
            if k == key:
                if vtype == STRING:
                    return raw[8:].decode()
                return struct.unpack("<" + _SCALARS[vtype], raw)[0]
        raise KeyError(key)

    def set(self, key: str, value: float, vtype: int | None = None) -> Gguf:
        """Set a scalar key (added if missing), keeping its type unless `vtype` names one."""
        key = key.replace("{arch}", self.arch)
        old = next((t for k, t, _ in self.kvs if k == key), None)
        vtype = vtype if vtype is not None else old if old is not None else (F32 if isinstance(value, float) else U32)
        raw = struct.pack("<" + _SCALARS[vtype], value)
        if old is None:
            self.kvs.append((key, vtype, raw))
        else:
            self.kvs = [(k, vtype, raw) if k == key else (k, t, r) for k, t, r in self.kvs]
        return self

    def drop(self, key: str) -> Gguf:
        key = key.replace("{arch}", self.arch)
        self.kvs = [kv for kv in self.kvs if kv[0] != key]
        return self

    # -- the tensor table -------------------------------------------------------------------
    def tensor(self, name: str) -> TensorInfo:
        return next(t for t in self.tensors if t.name == name)

    def drop_tensors(self, prefix: str) -> Gguf:
        self.tensors = [t for t in self.tensors if not t.name.startswith(prefix)]
        return self

    @property
    def data_size(self) -> int:
        return self.size - self.data_start

    # -- writing ----------------------------------------------------------------------------
    def write(self, dst: str, data: str = "sparse") -> str:
        parts = [struct.pack("<4sIQQ", b"GGUF", 3, len(self.tensors), len(self.kvs))]
        for key, vtype, raw in self.kvs:
            kb = key.encode()
            parts += [struct.pack("<Q", len(kb)), kb, struct.pack("<I", vtype), raw]
        for t in self.tensors:
            nb = t.name.encode()
            parts += [struct.pack("<Q", len(nb)), nb, struct.pack(f"<I{len(t.shape)}Q", len(t.shape), *t.shape)]
            parts.append(struct.pack("<IQ", t.type, t.offset))
        head = b"".join(parts)
        head += b"\0" * (-len(head) % self.alignment)
        with open(dst, "wb") as out:
            out.write(head)
            if data == "copy":
                with open(self.src, "rb") as f:
                    f.seek(self.data_start)
                    shutil.copyfileobj(f, out, 1 << 22)
            else:
                out.truncate(len(head) + self.data_size)
        return dst


def _skip(f, vtype: int) -> None:
    if vtype in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[vtype]), 1)
    elif vtype == STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif vtype == ARRAY:
        etype, n = struct.unpack("<IQ", f.read(12))
        if etype in _SCALARS:
            f.seek(n * struct.calcsize(_SCALARS[etype]), 1)
        else:
            for _ in range(n):
                _skip(f, etype)
    else:
        raise ValueError(f"GGUF value type {vtype}")


def _shape(name: str, index: int, value: int) -> Callable[[Gguf], object]:
    def mutate(g: Gguf) -> None:
        g.tensor(name).shape[index] = value

    return mutate


def _offset(name: str, offset: Callable[[Gguf], int]) -> Callable[[Gguf], object]:
    def mutate(g: Gguf) -> None:
        g.tensor(name).offset = offset(g)

    return mutate


def _rename(old: str, new: str) -> Callable[[Gguf], object]:
    def mutate(g: Gguf) -> None:
        g.tensor(old).name = new

    return mutate


# name -> (the mutation, a piece of the refusal's message). The embedded model (SmolLM2-135M,
# arch llama): 30 layers, embedding 576, 9 heads, 3 KV heads, feed-forward 1536, 49152 tokens.
CORPUS: dict[str, tuple[Callable[[Gguf], object], str]] = {
    # metadata
    "block-count-0": (lambda g: g.set("{arch}.block_count", 0), "llama.block_count is 0"),
    "block-count-100000": (lambda g: g.set("{arch}.block_count", 100000), "llama.block_count is 100000"),
    "block-count-missing": (lambda g: g.drop("{arch}.block_count"), "no llama.block_count"),
    "block-count-31": (lambda g: g.set("{arch}.block_count", 31), "no tensors of 1 of those layers (first blk.30)"),
    "expert-count-alone": (lambda g: g.set("{arch}.expert_count", 8), "expert_count is 8 without"),
    "expert-used-alone": (lambda g: g.set("{arch}.expert_used_count", 2), "expert_used_count is 2 but"),
    "expert-used-over-count": (
        lambda g: g.set("{arch}.expert_count", 2).set("{arch}.expert_used_count", 4),
        "expert_used_count is 4 but llama.expert_count is 2",
    ),
    "expert-count-1000": (
        lambda g: g.set("{arch}.expert_count", 1000).set("{arch}.expert_used_count", 2),
        "expert_count is 1000",
    ),
    "rms-epsilon-nan": (
        lambda g: g.set("{arch}.attention.layer_norm_rms_epsilon", math.nan),
        "layer_norm_rms_epsilon is nan (must be a finite number)",
    ),
    "rms-epsilon-inf": (
        lambda g: g.set("{arch}.attention.layer_norm_rms_epsilon", math.inf),
        "layer_norm_rms_epsilon is inf (must be a finite number)",
    ),
    "rms-epsilon-negative": (
        lambda g: g.set("{arch}.attention.layer_norm_rms_epsilon", -1e-5),
        "layer_norm_rms_epsilon is -1e-05",
    ),
    "rms-epsilon-zero": (
        lambda g: g.set("{arch}.attention.layer_norm_rms_epsilon", 0.0),
        "layer_norm_rms_epsilon is 0 (must be a number above 0)",
    ),
    "norm-epsilon-nan": (lambda g: g.set("{arch}.attention.layer_norm_epsilon", math.nan), "layer_norm_epsilon is nan"),
    "rope-freq-base-nan": (lambda g: g.set("{arch}.rope.freq_base", math.nan), "rope.freq_base is nan"),
    "head-count-0": (lambda g: g.set("{arch}.attention.head_count", 0), "attention.head_count is 0"),
    "head-count-missing": (lambda g: g.drop("{arch}.attention.head_count"), "no llama.attention.head_count"),
    "head-count-kv-4": (lambda g: g.set("{arch}.attention.head_count_kv", 4), "does not divide"),
    "head-count-kv-0": (lambda g: g.set("{arch}.attention.head_count_kv", 0), "head_count_kv is 0"),
    "head-count-kv-18": (lambda g: g.set("{arch}.attention.head_count_kv", 18), "does not divide"),
    "embedding-length-512": (
        lambda g: g.set("{arch}.embedding_length", 512),
        "token_embd.weight is 576 x 49152, but the hyperparameters make it 512 x 49152",
    ),
    "embedding-length-0": (lambda g: g.set("{arch}.embedding_length", 0), "embedding_length is 0"),
    "feed-forward-1024": (lambda g: g.set("{arch}.feed_forward_length", 1024), "feed_forward_length"),
    "context-length-0": (lambda g: g.set("{arch}.context_length", 0), "context_length is 0"),
    "block-count-a-string": (
        lambda g: g.drop("{arch}.block_count").kvs.append(("llama.block_count", STRING, struct.pack("<Q", 2) + b"30")),
        "llama.block_count is a string, not an integer",
    ),
    # the tensor table
    "layer-missing": (lambda g: g.drop_tensors("blk.17."), "first blk.17"),
    "tensor-missing": (lambda g: g.drop_tensors("blk.5.attn_q.weight"), "blk.5.attn_q.weight"),
    "offset-past-end": (
        _offset("blk.10.ffn_up.weight", lambda g: -(-g.data_size // 32) * 32 + 4096),
        "(truncated?)",
    ),
    "offset-2**63": (_offset("blk.10.ffn_up.weight", lambda g: 1 << 63), "(truncated?)"),
    "offset-misaligned": (
        _offset("blk.10.ffn_up.weight", lambda g: g.tensor("blk.10.ffn_up.weight").offset + 4),
        "not a multiple of 32",
    ),
    "shape-ffn-down": (
        _shape("blk.3.ffn_down.weight", 1, 512),
        "blk.3.ffn_down.weight is 1536 x 512, but the hyperparameters make it 1536 x 576",
    ),
    "shape-token-embd-vocab": (_shape("token_embd.weight", 1, 40000), "token_embd.weight is 576 x 40000"),
    "shape-rows-not-blocks": (_shape("blk.0.attn_q.weight", 0, 570), "not whole Q4_1 blocks of 32"),
    "tensor-twice": (
        _rename("blk.1.attn_q.weight", "blk.0.attn_q.weight"),
        "blk.0.attn_q.weight is in the tensor table twice",
    ),
}


def mutated(source: str | Gguf, name: str) -> Gguf:
    """A copy of `source` (a path or a file already read) with the mutation `name` applied."""
    g = copy.deepcopy(source) if isinstance(source, Gguf) else Gguf.read(source)
    CORPUS[name][0](g)
    return g


def build_corpus(src: str, folder: str | os.PathLike[str], data: str = "sparse") -> dict[str, tuple[str, str]]:
    """Write every mutation of `src` into `folder`: name -> (path, a piece of the expected message)."""
    original = Gguf.read(src)
    out = {}
    for name, (_, expected) in CORPUS.items():
        path = os.path.join(folder, f"{name}.gguf")
        mutated(original, name).write(path, data)
        out[name] = (path, expected)
    return out
