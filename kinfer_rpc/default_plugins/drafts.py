"""Built-in draft policies for speculative decoding.

`ngram` is prompt lookup: the tokens that followed the last earlier occurrence of the request's
latest n-gram (n from 4 down to 1) in its own prompt and reply. Editors and agents rewrite text
they were given, so the reply keeps running into its own prompt; no extra weights are needed.

`draft-model` runs a smaller model with the same vocabulary (model/load's `draftModel`) in a
context of its own on the same backend. The `mtp` policy lives in the llama plugin: it needs
llama.cpp's own multi-token-prediction API.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
import numpy as np

import kinfer_rpc
from kinfer_rpc.types import common_prefix

if TYPE_CHECKING:
    from kinfer_rpc.types import (
        Backend,
        DecodeChained,
        DeviceGreedy,
        DeviceTokens,
        DraftPolicy,
        DraftRequest,
        LoadedModel,
        LoadOptions,
    )


class NgramPolicy:
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        n_hist = len(history)
        if k <= 0 or n_hist < 2:
            return []
        h = np.asarray(history, dtype=np.int64)
        for n in range(min(self.max_n, n_hist - 1), self.min_n - 1, -1):
            tail = h[n_hist - n :]
            # Earlier windows h[i:i+n] (i + n < n_hist) equal to the tail; take the latest one.
            span = n_hist - n
            match = np.ones(span, dtype=bool)
            for j in range(n):
                match &= h[j : j + span] == tail[j]
            hits = np.flatnonzero(match)
            if hits.size:
                start = int(hits[-1]) + n
                drafts: list[int] = h[start : start + k].tolist()
                return drafts
        return []


class DraftModelPolicy:
    """`draft-model`: a smaller GGUF with the same vocabulary, run by the target's backend in a
    context of its own (`options.draftModel` of model/load), drafting greedily.

    One session per load keeps one draft sequence per slot and what it holds; each step it
    catches every drafting sequence up with its request's history (recomputing only what its
    cache does not already hold) and then decodes k tokens, every round one pass over all the
    step's drafting requests. On a backend that feeds a pass with the one before's argmax on the
    device (DecodeChained: the mlx backend) the rounds are chained to the catch-up pass, and the
    step's drafting waits for the device once; with a target that takes tokens on the device
    (DeviceTokens) not even that: the drafts feed the verify pass and are read after its wait
    (propose_on_device)."""

    name = "draft-model"

    def session(self, target: LoadedModel, backend: Backend, options: LoadOptions) -> DraftModelSession:
        return DraftModelSession(target, backend, options)


@attrs.frozen
class _Pass:
    """A launched pass of the draft model: its wait, the request each output row belongs to, and
    whether it fed each request's last draft."""

    wait: Callable[[], np.ndarray]
    rows: list[int]
    fed: bool


@attrs.define(eq=False)
class _Launched:
    """A step's drafts (PendingDrafts): read already (`passes` empty), or launched on the device
    and read by resolve() once the target's pass they feed is done."""

    session: DraftModelSession
    requests: Sequence[DraftRequest]
    out: list[list[int]]
    passes: list[_Pass] = attrs.field(factory=list)
    handles: list[tuple[list[Any], int]] | None = None

    def resolve(self) -> list[list[int]]:
        s, passes, self.passes = self.session, self.passes, []
        if s._unread is self:
            s._unread = None
        for p in passes:  # evaluated with the target's pass: no wait here
            s._take(p, self.requests, self.out)
        return [o[: r.k] for o, r in zip(self.out, self.requests)]


class DraftModelSession:
    def __init__(self, target: LoadedModel, backend: Backend, options: LoadOptions) -> None:
        from kinfer_rpc.types import LoadOptions

        if not options.draft_model:
            raise ValueError("draftPolicy draft-model needs options.draftModel")
        info = target.info
        self.draft = backend.load(
            options.draft_model,
            LoadOptions(
                context_length=info.context_length,
                slots=info.slots,
                batch=options.batch,
                ubatch=options.ubatch,
                threads=options.threads,
                gpu_layers=options.gpu_layers,
                flash_attention=options.flash_attention,
                drafts=0,
                kv_type=options.kv_type,
            ),
            lambda fraction: None,
        )
        try:
            self._check_vocabulary(target)
        except BaseException:
            self.draft.close()
            raise
        self.capacity = options.batch
        self.cached: dict[int, list[int]] = {}
        self._unread: _Launched | None = None  # drafts on the device whose pass was not read yet
        # A draft model whose greedy argmax stays on the device and whose next pass can be fed
        # with it (the mlx backend): a step's draft rounds are chained, one wait for them all.
        from kinfer_rpc.types import DecodeChained, DeviceGreedy

        d = self.draft
        self.chained = (
            isinstance(d, DecodeChained)
            and isinstance(d, DeviceGreedy)
            and d.device_greedy
            and all(d.set_device_greedy(seq, True) for seq in range(info.slots))
        )

    def _check_vocabulary(self, target: LoadedModel) -> None:
        n = target.info.n_vocab
        if self.draft.info.n_vocab != n:
            raise ValueError(
                f"the draft model has {self.draft.info.n_vocab} tokens and the model {n}: "
                "a draft model needs the same vocabulary"
            )
        probe = sorted(set(range(0, n, max(1, n // 997))) | {n - 1} | set(target.eog_tokens()))
        for t in probe:
            if self.draft.token_bytes(t) != target.token_bytes(t):
                raise ValueError(
                    f"token {t} is {target.token_bytes(t)!r} in the model and "
                    f"{self.draft.token_bytes(t)!r} in the draft model: a draft model needs the same vocabulary"
                )

    def propose_many(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return self._launch(requests, on_device=False).resolve()

    def propose_on_device(self, requests: Sequence[DraftRequest]) -> _Launched | None:
        """The drafts left on the device (DeviceDraftSession): the catch-up pass and the chained
        rounds launched, not waited for; None when the draft model cannot chain."""
        if not (self.chained and getattr(self.draft, "feeds_device_tokens", False)):
            return None
        return self._launch(requests, on_device=True)

    def _launch(self, requests: Sequence[DraftRequest], on_device: bool) -> _Launched:
        from kinfer_rpc.types import SeqChunk

        if self._unread is not None:  # drafts launched and never read: settle them first
            self._unread.resolve()
        out: list[list[int]] = [[] for _ in requests]
        # Catch up: each sequence's cells must hold its history; the last token asks for logits.
        todo: list[list[Any]] = []  # (request index, seq, position, tokens still to feed)
        for i, r in enumerate(requests):
            h = list(r.history)
            have = self.cached.get(r.seq, [])
            p = min(common_prefix(have, h), len(h) - 1)
            if p < len(have):
                self.draft.seq_remove(r.seq, p, -1)
            self.cached[r.seq] = h[:p]
            todo.append([i, r.seq, p, h[p:]])
        pending: _Pass | None = None  # the last pass launched, not yet taken
        while any(t[3] for t in todo):
            if pending is not None:
                self._take(pending, requests, out)
            chunks: list[SeqChunk] = []
            rows: list[int] = []
            room = self.capacity
            for t in todo:
                if not t[3] or room <= 0:
                    continue
                take = t[3][:room]
                ends = len(take) == len(t[3])
                chunks.append(SeqChunk(t[1], t[2], take, int(ends)))
                if ends:
                    rows.append(t[0])
                self.cached[t[1]].extend(take)
                t[2] += len(take)
                t[3] = t[3][len(take) :]
                room -= len(take)
            pending = _Pass(self.draft.decode(chunks), rows, fed=False)
        assert pending is not None  # every request feeds at least its last token
        k_max = max(r.k for r in requests)
        launched = _Launched(self, requests, out)
        if self.chained and len(pending.rows) == len(requests):
            # Draft round j feeds every request's draft j, chained on the device to the pass
            # before it (the draft model's argmax, never read by the host): one wait for all.
            passes = [pending]
            draft = cast("DecodeChained", self.draft)
            tokens = [cast("DeviceTokens", draft).launched_tokens()] if on_device else []
            for _ in range(k_max - 1):
                try:
                    passes.append(_Pass(draft.decode_chained(), pending.rows, fed=True))
                except ValueError:  # no room to chain (the context's end): round by round from here
                    break
                if on_device:
                    tokens.append(cast("DeviceTokens", draft).launched_tokens())
            if on_device and len(passes) == k_max:
                # Read after the target's pass that they feed: the session waits for nothing.
                launched.passes = passes
                launched.handles = [(tokens, row) for row in range(len(requests))]
                self._unread = launched
                return launched
            passes[-1].wait()  # every pass before it is upstream of it
            for launched_pass in passes:
                self._take(launched_pass, requests, out)
        else:
            self._take(pending, requests, out)
        # Round by round (a backend without chained passes, or the rest of a broken chain): round j
        # feeds every request's draft j and reads draft j + 1.
        live = [i for i, r in enumerate(requests) if len(out[i]) < r.k]
        while live:
            chunks = [
                SeqChunk(requests[i].seq, len(requests[i].history) + len(out[i]) - 1, (out[i][-1],), 1) for i in live
            ]
            self._take(_Pass(self.draft.decode(chunks), live, fed=True), requests, out)
            live = [i for i in live if len(out[i]) < requests[i].k]
        return launched

    def _take(self, p: _Pass, requests: Sequence[DraftRequest], out: list[list[int]]) -> None:
        """A pass's tokens, one per row, onto its requests' drafts (`fed`: the pass fed each
        request's last draft, which its sequence's cells now hold)."""
        logits = p.wait()
        tokens = cast("DeviceGreedy", self.draft).sampled_tokens() if self.chained else [-1] * len(p.rows)
        for row, i in enumerate(p.rows):
            if p.fed:
                self.cached[requests[i].seq].append(out[i][-1])
            out[i].append(tokens[row] if tokens[row] >= 0 else int(np.argmax(logits[row])))

    def close(self) -> None:
        self.draft.close()


@kinfer_rpc.hookimpl
def register_draft_policies(register: Callable[[DraftPolicy], None]) -> None:
    register(NgramPolicy())
    register(DraftModelPolicy())
