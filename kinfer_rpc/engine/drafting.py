"""Drafting: how many drafts each job checks in a pass, the drafts themselves, and what
verifying them settled.

The engine asks a `Drafter` for the drafts of a pass's decoding jobs (propose), for the drafts
that the device fed to the pass once it is done (read), and hands it back how many tokens a
job's verification took (settle), which returns where the job's cells end. Policies with a
session (a draft model, an MTP head) draft for all their jobs at once; the Drafter keeps one
session a policy for the life of the load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import cast

from kinfer_rpc.engine.job import Job
from kinfer_rpc.types import (
    DeviceDraftSession,
    DraftRequest,
    DraftSession,
    LoadedModel,
    PendingDrafts,
    Proposes,
    SessionPolicy,
)

log = logging.getLogger(__name__)


def draft_count(job: Job, room: int) -> int:
    """How many drafts this job checks this step (0: none); a paused job's pause counts down."""
    opts = job.options
    if not job.drafting or room <= 0 or (job.thinking is not None and job.thinking.next_forced() is not None):
        return 0
    if job.draft_pause:
        job.draft_pause -= 1
        return 0
    if opts.max_tokens is not None:
        room = min(room, opts.max_tokens - len(job.generated) - 1)
    return max(0, min(opts.drafts or 0, room))  # drafting: a count was settled


def clean(drafts: Iterable[int], k: int, vocab: int) -> list[int]:
    """At most k drafts, those outside the vocabulary left out."""
    return [int(t) for t in list(drafts)[:k] if 0 <= int(t) < vocab]


def pause_if_unlucky(job: Job) -> None:
    """The fallback when drafts keep missing (a chat, not an edit): once 16 drafted tokens have
    been checked with fewer than half accepted, draft nothing for a while, then try again; each
    losing window doubles the pause (32, 64, ... 1024 steps) and a winning one resets it, so a
    reply where drafting never pays spends a few percent of its steps finding that out. A pass
    checking k drafts costs up to 2x a plain step on a GPU and more on a CPU
    (docs/performance.md), so below about half accepted drafting loses. The rule reads this
    job's own history only."""
    drafted, accepted = job.window
    if drafted >= 16:
        if accepted * 2 < drafted:
            job.draft_pause = job.draft_backoff
            job.draft_backoff = min(job.draft_backoff * 2, 1024)
        else:
            job.draft_backoff = 32
        job.window = [0, 0]


class Drafter:
    """The drafts of a load's jobs. `make_session(policy, model)` makes a SessionPolicy's session
    (on the worker thread); None: this engine makes none."""

    def __init__(self, make_session: Callable[[SessionPolicy, LoadedModel], DraftSession] | None) -> None:
        self._make_session = make_session
        self.sessions: dict[str, DraftSession] = {}
        self.model: LoadedModel | None = None
        self.feeds_device = False  # whether passes can be fed drafts on the device
        # drafts fed to the pass in flight on the device, read after its wait (read)
        self.on_device: list[tuple[PendingDrafts, list[tuple[Job, int]]]] = []
        self.total = [0, 0]  # drafted, accepted over the life of the load

    def load(self, model: LoadedModel, feeds_device: bool) -> None:
        self.model = model
        self.feeds_device = feeds_device

    def session(self, policy: SessionPolicy) -> DraftSession:
        session = self.sessions.get(policy.name)
        if session is None:
            if self._make_session is None:
                raise RuntimeError(f"draft policy {policy.name} needs a session and this engine makes none")
            assert self.model is not None, "sessions are made while the model is loaded"
            session = self.sessions[policy.name] = self._make_session(policy, self.model)
        return session

    def close(self) -> None:
        for session in self.sessions.values():
            try:
                session.close()
            except Exception:
                log.exception("closing a draft session failed")
        self.sessions.clear()

    def propose(self, jobs: list[Job], counts: list[int], vocab: int) -> None:
        """Drafts for this step into each job's `drafts`, each only from its job's own history,
        so replies never depend on neighbours (and verification makes them not depend on the
        drafts either). Policies with a session draft for all their jobs at once."""
        grouped: dict[str, list[tuple[Job, int]]] = {}
        for job, k in zip(jobs, counts):
            job.drafts, job.device_drafts = [], None
            if k <= 0:
                continue
            policy = job.options.draft_policy
            if isinstance(policy, SessionPolicy):
                grouped.setdefault(policy.name, []).append((job, k))
            else:
                assert isinstance(policy, Proposes), "the host settles a job's draft policy"
                job.drafts = clean(policy.propose(job.prompt + job.generated, k), k, vocab)
        for name, items in grouped.items():
            try:
                # (grouped: only jobs whose policy is a SessionPolicy)
                session = self.session(cast(SessionPolicy, items[0][0].options.draft_policy))
                requests = [DraftRequest(job.slot, job.prompt + job.generated, k) for job, k in items]
                pending = None
                if (
                    self.feeds_device
                    and isinstance(session, DeviceDraftSession)
                    and all(job.constraint is None for job, _ in items)  # (a grammar checks drafts first)
                ):
                    pending = session.propose_on_device(requests)
                if pending is not None and pending.handles is not None:
                    # Fed to the pass on the device and read after its wait (read).
                    for (job, k), handle in zip(items, pending.handles):
                        job.drafts, job.device_drafts = [-1] * k, handle
                    self.on_device.append((pending, items))
                    continue
                proposals = pending.resolve() if pending is not None else session.propose_many(requests)
            except Exception:
                # A drafter's failure costs speed, never a reply: this step goes undrafted.
                log.exception("draft policy %s failed", name)
                continue
            for (job, k), drafts in zip(items, proposals):
                job.drafts = clean(drafts, k, vocab)
        for job in jobs:
            if job.drafts and job.constraint is not None:
                # A draft the grammar rejects would be rejected by verification anyway: the
                # tokens checked are only those the grammar allows, so the reply is the same.
                job.drafts = job.drafts[: job.constraint.validate_tokens(job.drafts)]

    def read(self, vocab: int) -> None:
        """After the wait of a pass fed with drafts on the device: the drafts it verified. A
        draft that cannot be read stays -1, which no sampled token equals: it is rejected, and
        its cell removed, as any rejected draft."""
        if not self.on_device:  # (every step: the usual case)
            return
        pending, self.on_device = self.on_device, []
        for drafts, items in pending:
            try:
                read = drafts.resolve()
            except Exception:
                log.exception("reading drafts from the device failed")
                read = [[] for _ in items]
            for (job, k), got in zip(items, read):
                cleaned = [t if 0 <= t < vocab else -1 for t in (int(t) for t in list(got)[:k])]
                job.drafts = cleaned + [-1] * (k - len(cleaned))
                job.device_drafts = None

    def settle(self, job: Job, base: int, taken: int) -> int | None:
        """After verifying a job's drafts: count them and back off if they keep losing. Returns
        where the job's cells now end (the chunk's first token and the accepted drafts, from
        position `base`): the cells of the rejected ones from there are to be removed; None
        when the job has ended (its cells go with its slot)."""
        accepted = max(0, taken - 1)  # every token taken before the last matched its draft
        job.drafted += len(job.drafts)
        job.accepted += accepted
        job.window[0] += len(job.drafts)
        job.window[1] += accepted
        self.total[0] += len(job.drafts)
        self.total[1] += accepted
        pause_if_unlucky(job)
        job.drafts = []
        if job.stop_reason is not None:
            return None
        job.n_past = base + taken
        return job.n_past
