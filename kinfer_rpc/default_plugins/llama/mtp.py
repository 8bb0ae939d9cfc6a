"""The `llama` backend's multi-token-prediction context (LoadOptions.mtp; the `mtp` draft policy
in backend.py drafts from it): the target model's NextN layers in a llama.cpp context of their
own, whose memory mirrors the target's."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kinfer_rpc.default_plugins.llama.batch import Batch
from kinfer_rpc.types import SeqChunk

if TYPE_CHECKING:
    from kinfer_rpc.types import DraftRequest

log = logging.getLogger("kinfer_rpc.llama")


class MtpTarget(Protocol):
    """What the MTP context reads of the model it drafts for (model.LlamaModel): the library,
    the model and its context (their hidden states), the vocabulary's size."""

    L: Any
    model: Any
    ctx: Any
    n_vocab: int


class MtpBatch(Batch):
    """A Batch that also carries one row of floats per token: llama.cpp's MTP passes take both
    the token and the target's hidden state of the position before (a legacy llama_batch may
    carry both; llama_decode turns it into the MTP graph's inputs)."""

    def __init__(self, L: Any, capacity: int, n_embd: int) -> None:  # L: the llama_cpp module
        super().__init__(L, capacity)
        self.embd = np.zeros((capacity, n_embd), dtype=np.float32)
        self.batch.embd = self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


_INF = 1 << 62


class Mtp:
    """The target's multi-token-prediction (NextN) layers in a context of their own.

    Its memory mirrors the target's: after every target pass the same tokens go through it at
    the same positions, token p paired with the target's hidden state at p - 1 (llama.cpp's
    `embeddings_nextn`: the state before the output norm, one row per batch token). Cell
    removals and copies on the target are applied here too. Drafting feeds the last token with
    the hidden state of the position before, then chains each draft with the MTP head's own
    hidden state, and removes the draft cells afterwards (common/speculative.cpp's MTP flow).

    Per sequence it keeps the tokens its cells hold (so a drafter can check them against a
    request's history) and the hidden rows of the latest pass's last positions (at most
    `KEPT_ROWS`), which is all a rollback of rejected drafts can need. A hidden state it does
    not know (a prefix-pool hit that ends inside an earlier pass) is zeros: the MTP cell is
    then a little off and drafts are accepted less often; replies never change, since the
    target verifies every draft.
    """

    KEPT_ROWS = 64

    def __init__(self, target: MtpTarget, cparams: Any, capacity: int, unified: bool) -> None:
        from llama_cpp import llama_cpp_ext as LX

        L = self.L = target.L
        self.LX = LX
        self.target = target
        self.unified = unified
        n_out = int(L.llama_model_n_embd_out(target.model))
        n_inp = int(L.llama_model_n_embd_inp(target.model))
        if n_out != n_inp:
            raise ValueError(
                f"this model's hidden state has {n_out} values and its MTP input {n_inp}: "
                "draftPolicy mtp supports MTP heads that take the hidden state as it is"
            )
        self.n_embd = n_out
        cparams.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        cparams.n_outputs_max_per_seq = 1  # a draft pass asks one row of each sequence
        self.ctx = L.llama_init_from_model(target.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the multi-token-prediction context")
        self.mem = L.llama_get_memory(self.ctx)
        # Target: a hidden row for every token of a pass, in batch order (not only rows that
        # ask for logits). MTP context: rows only for the tokens that ask for logits.
        LX.llama_set_embeddings_nextn(target.ctx, True, False)
        LX.llama_set_embeddings_nextn(self.ctx, True, True)
        self.batch = MtpBatch(L, capacity, self.n_embd)
        self.zeros = np.zeros(self.n_embd, dtype=np.float32)
        self.tokens: dict[int, list[int] | None] = {}  # seq -> tokens of its cells (None: unknown)
        self.hidden: dict[int, tuple[int, np.ndarray]] = {}  # seq -> (position of rows[0], rows)
        self.passes = 0  # MTP passes run (catch-up and draft), for tests and figures

    # -- the mirror ---------------------------------------------------------------------------
    def row(self, seq: int, pos: int) -> np.ndarray:
        """The target's hidden state at `pos` of `seq`, or zeros if it is not known."""
        kept = self.hidden.get(seq)
        if kept is not None and pos >= 0:
            p0, rows = kept
            if p0 <= pos < p0 + len(rows):
                row: np.ndarray = rows[pos - p0]
                return row
        return self.zeros

    def follow(self, chunks: Sequence[SeqChunk], total: int) -> None:
        """Run the target pass just done (`chunks`, `total` tokens) through the MTP layers."""
        L, b = self.L, self.batch
        ptr = self.LX.llama_get_embeddings_nextn(self.target.ctx)
        if not ptr:
            raise RuntimeError("llama.cpp returned no hidden states for the multi-token-prediction head")
        H = np.ctypeslib.as_array(ptr, shape=(total, self.n_embd))
        b.fill(chunks)
        b.logits[:total] = 0
        b.embd[1:total] = H[: total - 1]
        a = 0
        for c in chunks:  # each chunk's first token takes the state its sequence left before it
            b.embd[a] = self.row(c.seq, c.pos - 1)
            a += len(c.tokens)
        rc = L.llama_decode(self.ctx, b.batch)
        self.passes += 1
        a = 0
        for c in chunks:
            n = len(c.tokens)
            if rc != 0:
                # The target's pass went through: only drafting for these sequences stops.
                L.llama_memory_seq_rm(self.mem, c.seq, c.pos, -1)
                self.tokens[c.seq] = None
                self.hidden.pop(c.seq, None)
                continue
            have = self.tokens.get(c.seq, [])
            if have is not None and len(have) == c.pos:
                have.extend(c.tokens)
                self.tokens[c.seq] = have
            else:
                self.tokens[c.seq] = list(c.tokens) if c.pos == 0 else None
            keep = min(n, self.KEPT_ROWS)
            self.hidden[c.seq] = (c.pos + n - keep, H[a + n - keep : a + n].copy())
            a += n
        if rc != 0:
            log.error("the multi-token-prediction pass failed (llama_decode %d): those sequences draft nothing", rc)

    def seq_remove(self, seq: int, start: int, end: int) -> None:
        self.L.llama_memory_seq_rm(self.mem, seq, start, end)
        start = max(0, start)
        end = _INF if end < 0 else end
        for s in list(self.tokens) if seq < 0 else [seq]:
            have = self.tokens.get(s)
            if start == 0 and end == _INF:
                self.tokens[s] = []
            elif have is not None and start < len(have):
                if end >= len(have):
                    del have[start:]
                else:
                    self.tokens[s] = None  # a hole: the cells no longer hold a prefix
            kept = self.hidden.get(s)
            if kept is not None:
                p0, rows = kept
                p1 = p0 + len(rows)
                if end <= p0 or start >= p1:
                    continue
                if start > p0:
                    self.hidden[s] = (p0, rows[: start - p0])
                elif end < p1:
                    self.hidden[s] = (end, rows[end - p0 :])
                else:
                    del self.hidden[s]

    def seq_copy(self, src: int, dst: int, start: int, end: int) -> None:
        self.L.llama_memory_seq_cp(self.mem, src, dst, start, end)
        if src == dst:
            return
        start = max(0, start)
        end = _INF if end < 0 else end
        have = self.tokens.get(src, [])
        if start > 0 or have is None or (self.unified and self.tokens.get(dst)):
            self.tokens[dst] = None  # not a plain prefix copy into empty cells
        else:
            self.tokens[dst] = list(have[:end])
        kept = self.hidden.get(src)
        self.hidden.pop(dst, None)
        if kept is not None:
            p0, rows = kept
            lo, hi = max(p0, start), min(p0 + len(rows), end)
            if lo < hi:
                self.hidden[dst] = (lo, rows[lo - p0 : hi - p0])

    # -- drafting -----------------------------------------------------------------------------
    def propose_many(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Greedy drafts from the MTP head: round j is one pass over every request still drafting."""
        L, b = self.L, self.batch
        out: list[list[int]] = [[] for _ in requests]
        live: list[tuple[int, int, int]] = []  # (request index, seq, position of the next input)
        for i, r in enumerate(requests):
            n = len(r.history) - 1
            have = self.tokens.get(r.seq)
            # The cells must hold exactly this request's history but its last token; anything
            # else (a state this mirror lost track of) drafts nothing rather than guessing.
            if r.k <= 0 or n < 0 or have is None or len(have) != n or have != list(r.history[:n]):
                continue
            if len(live) >= b.capacity:
                break
            b.embd[len(live)] = self.row(r.seq, n - 1)
            live.append((i, r.seq, n))
        seqs = [(seq, n) for _, seq, n in live]
        token = [requests[i].history[-1] for i, _, _ in live]
        try:
            step = 0
            while live:
                m = len(live)
                b.token[:m] = token
                b.pos[:m] = [n + step for _, _, n in live]
                b.seq[:m] = [seq for _, seq, _ in live]
                b.logits[:m] = 1
                b.batch.n_tokens = m
                rc = L.llama_decode(self.ctx, b.batch)
                self.passes += 1
                if rc != 0:
                    raise RuntimeError(f"the multi-token-prediction draft pass failed (llama_decode {rc})")
                logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(m, self.target.n_vocab))
                best = logits.argmax(axis=1).tolist()
                hidden = np.ctypeslib.as_array(self.LX.llama_get_embeddings_nextn(self.ctx), shape=(m, self.n_embd))
                step += 1
                nxt: list[tuple[int, int, int]] = []
                token = []
                for row, (i, seq, n) in enumerate(live):
                    out[i].append(int(best[row]))
                    if len(out[i]) < requests[i].k:
                        b.embd[len(nxt)] = hidden[row]
                        nxt.append((i, seq, n))
                        token.append(int(best[row]))
                live = nxt
        finally:
            # The draft cells leave: the target's verifying pass brings in what it keeps.
            for seq, n in seqs:
                L.llama_memory_seq_rm(self.mem, seq, n, -1)
        return out

    def close(self) -> None:
        if self.ctx:
            self.L.llama_free(self.ctx)
            self.ctx = None
