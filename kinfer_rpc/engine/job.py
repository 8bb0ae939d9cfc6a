"""One request in the engine, from the queue to its last token: what it asks (GenerateOptions),
where it is (JobState), what the worker writes into it as it runs (Job) and what the host gets
once it is done (Outcome). Only the engine's worker writes a Job's fields; the host is handed a
frozen Outcome of it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from kinfer_rpc.engine.reasoning import Reasoning, Thinking
from kinfer_rpc.engine.sampling import SamplingOptions, TokenLogprob
from kinfer_rpc.engine.text import TextStream
from kinfer_rpc.types import DraftPolicy, Media


@attrs.frozen
class GenerateOptions:
    """What one inference request asks of the engine (validated at the protocol edge)."""

    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    # Tokens that end a reply as end of generation does, whatever ignore_eos says (an infill's
    # fill-in-the-middle pad and file separators)
    stop_tokens: tuple[int, ...] = ()
    # End the reply at the first line break after non-blank text (a line completion); the break
    # is not part of the reply, as a stop string is not
    stop_at_line: bool = False
    ignore_eos: bool = False  # benchmarks: keep generating through end-of-generation tokens
    # draft tokens checked per step (0: no speculative decoding; None: as many as the load's, which
    # the host settles before the job reaches the engine)
    drafts: int | None = 0
    # The policy's name as a request gives it; the host puts the DraftPolicy itself in its place
    # before the job reaches the engine.
    draft_policy: str | DraftPolicy | None = None
    sampling: SamplingOptions = SamplingOptions()
    # Each reply token's logprob and this many alternatives (None: not asked; costs nothing then).
    logprobs: int | None = None
    # ("format" | "grammar" | "regex" | "tools", source): what the host compiles into the job's
    # constraint ("tools": the Lark grammar of a reply made of tool calls)
    constraint: tuple[str, str] | None = None
    # The reply begins inside the model's reasoning block (kinfer_rpc.engine.reasoning): the
    # constraint holds only what follows the block; None: no reasoning block
    reasoning: Reasoning | None = None
    # Reuse chunks of at least this many cached tokens that moved, by shifting their cells (0:
    # never; the prefix pool's Slots.take): the reply then depends on what was cached before
    cache_reuse: int = 0


@attrs.frozen
class Limits:
    """Where replies end, for a loaded model: its end-of-generation tokens, its context per slot."""

    eog: frozenset[int]
    context: int

    def ends(self, job: Job, token: int) -> bool:
        """Whether `token` ends the job's reply (end of generation, or one of its stop tokens)."""
        return (token in self.eog and not job.options.ignore_eos) or token in job.options.stop_tokens

    def full(self, job: Job, generated: int, next_pos: int) -> bool:
        """Whether a job with `generated` tokens, the last to be fed at `next_pos`, has reached
        its max_tokens or the context."""
        limit = job.options.max_tokens
        return (limit is not None and generated >= limit) or next_pos + 1 >= self.context


class JobState(enum.Enum):
    """Where a job is. WAITING in the queue; PROMPT in a slot, its prompt being read into the
    slot's cells; GENERATING once the whole prompt is in (every step then feeds its last token);
    DONE with a stop reason (its slot is given back once no pass in flight holds its row)."""

    WAITING = "waiting"
    PROMPT = "prompt"
    GENERATING = "generating"
    DONE = "done"


_MOVES = {
    JobState.WAITING: {JobState.PROMPT, JobState.DONE},
    JobState.PROMPT: {JobState.GENERATING, JobState.DONE},
    JobState.GENERATING: {JobState.DONE},
    JobState.DONE: set(),
}


@attrs.define(eq=False)
class Job:
    """One request, from the queue to its last token. Fields written by the worker only; `state`
    changes only through move()."""

    prompt: list[int]
    options: GenerateOptions
    on_piece: Callable[[str, list[int]], None] | None = None  # runs on the host loop
    on_done: Callable[[Outcome], None] | None = None  # runs on the host loop
    slot: int = -1
    n_past: int = 0  # tokens of this job already in its slot's KV cache
    generated: list[int] = attrs.field(factory=list)
    n_text: int = 0  # how many of `generated` have been turned into text
    stop_reason: str | None = None
    error: Exception | None = None
    cancelled: bool = False  # set from any thread; seen at the next step
    stream: TextStream = attrs.field(init=False)  # made from the options' stop strings
    text: str = ""
    t_submit: float = attrs.field(factory=time.perf_counter)
    t_start: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    drafts: list[int] = attrs.field(factory=list)  # proposed for the pass in flight
    # the drafts' SeqChunk.device_tokens while they are on the device (-1s in `drafts` until read)
    device_drafts: tuple[Any, int] | None = None
    drafted: int = 0  # draft tokens proposed over the whole reply
    accepted: int = 0  # ... and accepted
    draft_pause: int = 0  # steps left without drafting (the low-acceptance fallback)
    draft_backoff: int = 32  # the next pause's length: doubles after every losing window
    cached: int = 0  # prompt tokens whose cells came from the prefix pool
    window: list[int] = attrs.field(factory=lambda: [0, 0])  # drafted, accepted since the last pause
    owner: int = 0  # the connection that asked for it: slots are shared fairly between owners
    # the prompt's images, in prompt order: their positions hold placeholders in `prompt`, and
    # their embeddings go into the cells through the model's Vision capability
    media: tuple[Media, ...] = ()
    last_row: int = 0  # the engine step of its last row, while rows are shared (planning.fair_rows)
    state: JobState = attrs.field(init=False, default=JobState.WAITING)
    # The reply's grammar (llguidance.LLMatcher: format, grammar or regex), at the state after
    # every token taken so far; None: unconstrained.
    constraint: Any = None
    mask: np.ndarray | None = None  # the constraint's bitmask for the row of the pass in flight
    # the ids that mask allows, when it allows at most half the vocabulary (grammar.sparse_ids)
    mask_ids: np.ndarray | None = None
    logprobs: list[TokenLogprob] = attrs.field(factory=list)  # one per generated token, when asked
    # the token of the pass just taken, chosen before the next pass started (Chooser.hold_rows)
    # and consumed by the constraint (Chooser.consume_held)
    held: int | None = None
    # greedy, no penalty, no logprobs: a row's token is its argmax (under its grammar's mask)
    greedy: bool = attrs.field(init=False, default=False)
    plain: bool = attrs.field(init=False, default=False)  # greedy and unconstrained: a row's argmax
    drafting: bool = attrs.field(init=False, default=False)  # has a draft policy and a count
    # The reasoning block the reply begins in, while and after it runs (None: none); it holds the
    # constraint until the block closes
    thinking: Thinking | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        self.stream = TextStream(self.options.stop, stop_at_line=self.options.stop_at_line)
        if self.options.reasoning is not None:
            self.thinking = Thinking(self.options.reasoning, deferred=self.constraint)
            self.constraint = None
        sampling = self.options.sampling
        self.greedy = sampling.temperature <= 0 and sampling.repeat_penalty == 1.0 and self.options.logprobs is None
        self.plain = self.greedy and self.constraint is None
        self.drafting = bool(self.options.drafts) and self.options.draft_policy is not None

    @property
    def exact(self) -> int:
        """How many of the job's first tokens stand for themselves: those before its prompt's first
        image (all without one)."""
        return self.media[0].start if self.media else 1 << 62

    def reasoned(self) -> None:
        """The reasoning block has closed: the constraint it held applies from the next token."""
        assert self.thinking is not None and not self.thinking.inside
        self.constraint, self.thinking.deferred = self.thinking.deferred, None
        self.plain = self.greedy and self.constraint is None

    def move(self, to: JobState) -> None:
        """The one way a job changes state; anything but the moves of JobState's story is a bug."""
        if to not in _MOVES[self.state]:
            raise RuntimeError(f"a job cannot move from {self.state.value} to {to.value}")
        self.state = to


@attrs.frozen
class Outcome:
    """A job as it ended, taken on the worker at the end of the step that ended it (or as it
    stands, for the reply so far of a request cancelled while it runs): what the host makes the
    reply of. Offsets of a reasoning block are None when the reply began in none, or its block
    has not closed."""

    options: GenerateOptions
    prompt_tokens: int
    generated: tuple[int, ...]
    text: str
    stop_reason: str | None
    error: Exception | None
    cached: int
    drafted: int
    accepted: int
    logprobs: tuple[TokenLogprob, ...]
    t_submit: float
    t_start: float
    t_first: float
    t_end: float
    reasons: bool = False  # the reply began inside a reasoning block
    closed_at: int | None = None  # how many of the reply's tokens the block took
    reasoning_chars: int | None = None
    answer_chars: int | None = None

    @classmethod
    def of(cls, job: Job) -> Outcome:
        thinking = job.thinking
        return cls(
            options=job.options,
            prompt_tokens=len(job.prompt),
            generated=tuple(job.generated),
            text=job.text,
            stop_reason=job.stop_reason,
            error=job.error,
            cached=job.cached,
            drafted=job.drafted,
            accepted=job.accepted,
            logprobs=tuple(job.logprobs),
            t_submit=job.t_submit,
            t_start=job.t_start,
            t_first=job.t_first,
            t_end=job.t_end,
            reasons=thinking is not None,
            closed_at=thinking.closed_at if thinking is not None else None,
            reasoning_chars=thinking.reasoning_chars if thinking is not None else None,
            answer_chars=thinking.answer_chars if thinking is not None else None,
        )
