"""What a step hands the host: a job's text as it grows (on_piece) and its end (on_done, with a
frozen Outcome). A step collects its events in a list, turns the jobs' tokens into text into it
(push_text), ends jobs into it (close), and posts them all in one callback (delivery)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kinfer_rpc.engine import trace as tracing
from kinfer_rpc.engine.job import Job, JobState, Outcome

log = logging.getLogger(__name__)

# on_piece with its text and tokens, or on_done with its job (handed on as an Outcome: delivery)
Event = tuple[Callable[[str, list[int]], None], str, list[int]] | tuple[Callable[[Outcome], None], Job]


def push_text(job: Job, token_bytes: Callable[[int], bytes], events: list[Event]) -> bool:
    """Push the job's tokens not yet turned into text; True if a stop string ended it."""
    while job.n_text < len(job.generated):
        token = job.generated[job.n_text]
        job.n_text += 1
        piece = job.stream.push(token_bytes(token))
        if piece:
            job.text += piece
        if (thinking := job.thinking) is not None and thinking.closed_at == job.n_text:
            end = b"".join(token_bytes(t) for t in thinking.options.end).decode("utf-8", "replace")
            thinking.mark_text(job.n_text, len(job.stream.text), len(end))
        if job.on_piece:
            events.append((job.on_piece, piece, [token]))
        if job.stream.stopped:
            # Tokens after the one that completed the stop string are not part of the reply.
            del job.generated[job.n_text :]
            del job.logprobs[job.n_text :]
            return True
    return False


def close(job: Job, reason: str | None, events: list[Event], trace: tracing.Trace | None) -> None:
    """End the job (DONE) for `reason`; None: for job.error. The rest of its text and its
    on_done go into `events`."""
    job.move(JobState.DONE)
    if reason is None and job.stop_reason is None:
        job.stop_reason = "error"  # job.error says what; nothing more is done for it
    if reason is not None:
        job.stop_reason = reason
        if reason != "cancelled":
            rest = job.stream.finish()
            if rest:
                job.text += rest
                if job.on_piece:
                    events.append((job.on_piece, rest, []))
    job.t_end = time.perf_counter()
    if trace is not None:
        trace.write(
            "job",
            submit=job.t_submit,
            start=job.t_start,
            first=job.t_first,
            end=job.t_end,
            prompt=len(job.prompt),
            cached=job.cached,
            generated=len(job.generated),
            reason=job.stop_reason,
        )
    if job.on_done:
        events.append((job.on_done, job))


def delivery(events: list[Event]) -> Callable[[], None]:
    """The host-loop callback that runs a step's events in order. Made on the worker once the
    step is over: each ended job's Outcome is taken now, with everything the step wrote into it
    (its drafts' counts are settled after the token that ended it)."""
    calls: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
        (fn, (Outcome.of(args[0]),) if isinstance(args[0], Job) else tuple(args)) for fn, *args in events
    ]

    def deliver() -> None:
        for fn, args in calls:
            try:
                fn(*args)
            except Exception:
                log.exception("event callback failed")

    return deliver
