"""Planning a pass: which waiting job takes a free slot, which jobs get rows, and the rows
themselves. Functions of the engine's jobs and limits that return values (a Job, the rows, a
Plan); only reading an image into a job's cells calls the model.

Owners (connections) are served fairly: while several share the passes of a CPU, none gets more
rows a pass than the owner with the fewest jobs, and the owners holding the fewest slots read
their prompts first (fair_rows, favoured).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs

from kinfer_rpc import errors
from kinfer_rpc.engine.drafting import Drafter, draft_count
from kinfer_rpc.engine.job import Job, JobState, Limits
from kinfer_rpc.engine.passes import Shape
from kinfer_rpc.types import LoadedModel, SeqChunk, Vision

log = logging.getLogger(__name__)


@attrs.frozen
class Plan:
    """One pass's rows before it is launched: its chunks, the job of each, its shape."""

    chunks: list[SeqChunk]
    owners: list[Job]
    shape: Shape


def next_waiting(queue: Sequence[Job], active: Sequence[Job], free: int, share: bool) -> Job | None:
    """The waiting job that takes the next free slot (`free`: how many are free), if one may. Owners (connections) take
    turns: the job of the owner holding the fewest slots goes first, in arrival order among
    equals. While `share` is on (more than one connection is open), no owner takes the last
    free slot when every busy slot is its own: a connection flooding the queue leaves one
    for everybody else."""
    if not queue or not free:
        return None
    first = queue[0]
    if not share and all(job.owner == first.owner for job in queue):
        return first  # the usual case: one client, first come first served
    held: dict[int, int] = {}
    for job in active:
        held[job.owner] = held.get(job.owner, 0) + 1
    best: Job | None = None
    for job in queue:
        mine = held.get(job.owner, 0)
        if share and free == 1 and mine > 0 and mine == len(active):
            continue
        if best is None or mine < held.get(best.owner, 0):
            best = job
    return best


def held_by_owner(active: Sequence[Job], share: bool, queued_passes: bool) -> dict[int, int]:
    """Jobs in slots per owner, when owners share the passes (several connections, several
    owners in slots, passes computed in the call as on a CPU); empty otherwise. See
    fair_rows and plan."""
    if not share or queued_passes:
        return {}
    held: dict[int, int] = {}
    for job in active:
        if job.state is not JobState.DONE:
            held[job.owner] = held.get(job.owner, 0) + 1
    return held if len(held) > 1 else {}


def fair_rows(decoding: list[Job], held: dict[int, int], step: int) -> list[Job]:
    """The decoding jobs that get a row in the next pass. While owners share the passes
    (`held`, from held_by_owner), no owner gets more rows a pass than the owner with the fewest jobs
    in slots (reading their prompts or decoding) has: the same service each, whatever the
    number of replies each runs. An owner's jobs beyond that take turns, those that waited
    longest first. On a CPU a pass costs each row about a whole model, so a connection
    running many replies would otherwise slow every other's in proportion; a job left out of
    a pass keeps its cells and its place, so its reply is the same. A device that queues
    passes (decode_async: a GPU) computes more rows at about the same cost: there every job
    gets its row. `step`: the engine's step count, the chosen rows' last_row."""
    if not held or len(decoding) < 2:
        return decoding
    share = min(held.values())
    mine: dict[int, list[Job]] = {}
    for job in decoding:
        mine.setdefault(job.owner, []).append(job)
    kept: set[int] = set()
    for jobs in mine.values():
        kept.update(id(j) for j in sorted(jobs, key=lambda j: j.last_row)[:share])
    chosen = [job for job in decoding if id(job) in kept]
    for job in chosen:
        job.last_row = step
    return chosen


def favoured(decoding: list[Job], active: Sequence[Job], held: dict[int, int]) -> tuple[list[Job], list[Job]]:
    """The decoding rows and the jobs whose prompts are read in the next pass. While owners
    share the passes (`held`), the owners holding the fewest slots read their prompts alone:
    the others' rows and prompts wait that pass (on a CPU a prompt pass beside other rows
    costs each row about a whole model again: an editor's completion would wait on a
    flood's rows). Nobody waits long: a prompt takes a pass or a few, and a job left out of
    a pass keeps its cells and its place, so its reply is the same."""
    reading = [job for job in active if len(job.prompt) > job.n_past]
    if not held or not reading:
        return decoding, reading
    fewest = min(held.values())
    favoured = {owner for owner, n in held.items() if n == fewest}
    first = [job for job in reading if job.owner in favoured]
    if not first or len(favoured) == len(held):
        return decoding, reading
    return [job for job in decoding if job.owner in favoured], first


def plan(
    model: LoadedModel,
    active: list[Job],
    *,
    batch: int,
    held: dict[int, int],
    step: int,
    ahead: bool,
    drafter: Drafter,
) -> Plan:
    """The next pass of the `active` jobs (in admission order): every running reply's last token
    (and its drafts), then prompt chunks, at most `batch` tokens. `held`: from held_by_owner;
    `step`: the engine's step count; `ahead`: whether passes may start ahead (Shape.of)."""
    budget = batch
    context = model.info.context_length
    decoding = fair_rows([job for job in active if job.state is JobState.GENERATING], held, step)
    decoding, reading = favoured(decoding, active, held)
    drafting = any(job.drafting for job in decoding)
    if drafting:
        # Room for drafts: every decoding job's own token first, then drafts in admission order.
        room = budget - len(decoding)
        wanted: list[int] = []
        for job in decoding:
            k = draft_count(job, min(room, context - job.n_past - 2))
            room -= k
            wanted.append(k)
        drafter.propose(decoding, wanted, model.info.n_vocab)
        chunks: list[SeqChunk] = []
        for job in decoding:  # decoding: feed the last sampled token and its drafts
            tokens = (job.generated[-1], *job.drafts)
            device = job.device_drafts if job.drafts else None
            chunks.append(SeqChunk(job.slot, job.n_past, tokens, len(tokens), device_tokens=device))
            budget -= 1 + len(job.drafts)
    else:  # the usual step, on the device's critical path: one token a job
        chunks = [SeqChunk(job.slot, job.n_past, (job.generated[-1],), 1) for job in decoding]
        budget -= len(decoding)
    # Every job decoding one greedy token: the next pass can start before this one's
    # bookkeeping (Engine._start_next); a pass chained on the device feeds the device's argmax,
    # so only unconstrained rows chain.
    shape = Shape.of(ahead, drafting, decoding, active)
    owners = decoding[:]
    for job in reading:
        if budget > 0 and job.media and not read_media(model, job):
            continue
        left = len(job.prompt) - job.n_past
        if budget > 0:
            take = min(left, budget, to_media(job))
            ends = take == left
            chunks.append(SeqChunk(job.slot, job.n_past, job.prompt[job.n_past : job.n_past + take], int(ends)))
            owners.append(job)
            budget -= take
    # In slot order: with one KV stream per slot llama.cpp puts sequences in one pass only
    # while their ids rise by one in batch order (llama_batch_allocr::split_equal); a job
    # that took a freed low slot, or was moved there by compaction, would otherwise split
    # the step into several passes (and make llama.cpp reorder the logits rows).
    if any(a.seq > b.seq for a, b in zip(chunks, chunks[1:])):
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].seq)
        chunks, owners = [chunks[i] for i in order], [owners[i] for i in order]
    return Plan(chunks, owners, shape)


def read_media(model: LoadedModel, job: Job) -> bool:
    """Put the images that come next in the job's prompt into its cells: each in passes of
    its own, on this thread, before the step's pass is planned (the text between them goes
    in the step's passes as any prompt's does). False if one failed: the job ends with the error."""
    for media in job.media:
        if media.start == job.n_past:
            assert isinstance(model, Vision) and model.vision, "images go only to a model that reads them"
            try:
                model.eval_media(job.slot, media, job.n_past)
            except Exception as exc:  # one request's image must not stop the engine
                log.exception("reading an image failed")
                job.error = errors.KinferError(errors.INVALID_PARAMS, f"the model could not read an image: {exc}")
                job.cancelled = True  # it leaves at the next step; job.error answers it
                return False
            job.n_past += media.length
    return True


def to_media(job: Job) -> int:
    """How many of the job's prompt tokens from n_past come before its next image."""
    for media in job.media:
        if media.start >= job.n_past:
            return media.start - job.n_past
    return len(job.prompt) - job.n_past


def steps_on(chunks: list[SeqChunk], owners: list[Job], best: list[int], limits: Limits) -> bool:
    """Whether each of these one-token rows goes on one token further, fed its `best`: none
    ends there (end-of-generation, max_tokens, the context), none cancelled or stopped, no
    grammar failed or complete, no reasoning block changing."""
    for chunk, job, token in zip(chunks, owners, best):
        # The token would be fed at chunk.pos + 1, as the job's len(generated) + 1st.
        if (
            job.cancelled
            or job.stop_reason is not None
            or token < 0  # a grammar failed on this row
            or (job.constraint is not None and job.constraint.is_stopped())  # its grammar is complete
            or (job.thinking is not None and not job.thinking.steady(token))  # its reasoning block changes
            or limits.ends(job, token)
            or limits.full(job, len(job.generated) + 1, chunk.pos + 1)
        ):
            return False
    return True
