"""A llama_batch filled from numpy arrays: one assignment per array for a whole pass."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from kinfer_rpc.types import SeqChunk


class Batch:
    """A llama_batch whose arrays are numpy buffers we own, so filling it is vectorised."""

    def __init__(self, L: ModuleType, capacity: int) -> None:
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        ptr_t = ctypes.POINTER(ctypes.c_int32)
        self.seq_ptrs = (ptr_t * capacity)()
        base = self.seq.ctypes.data
        for i in range(capacity):
            self.seq_ptrs[i] = ctypes.cast(base + 4 * i, ptr_t)
        self.batch = L.llama_batch()
        self.batch.token = self.token.ctypes.data_as(ctypes.POINTER(L.llama_token))
        self.batch.embd = None
        self.batch.pos = self.pos.ctypes.data_as(ctypes.POINTER(L.llama_pos))
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(ptr_t)
        self.batch.seq_id = ctypes.cast(self.seq_ptrs, ctypes.POINTER(ptr_t))
        self.batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, chunks: Sequence[SeqChunk]) -> int:
        # One numpy assignment per array for the whole pass: per-chunk slicing costs more than
        # the pass itself when 128 sequences each bring one token.
        tokens: list[int] = []
        pos: list[int] = []
        seq: list[int] = []
        out: list[int] = []
        for c in chunks:
            k = len(c.tokens)
            tokens.extend(c.tokens)
            if k == 1:
                pos.append(c.pos)
                seq.append(c.seq)
                out.append(1 if c.outputs else 0)
            else:
                pos.extend(range(c.pos, c.pos + k))
                seq.extend([c.seq] * k)
                out.extend([0] * (k - c.outputs) + [1] * c.outputs)
        n = len(tokens)
        self.token[:n] = tokens
        self.pos[:n] = pos
        self.seq[:n] = seq
        self.logits[:n] = out
        self.batch.n_tokens = n
        return sum(out)
