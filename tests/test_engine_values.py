"""The engine's step as values, without a model: a Pass and its state, the shape of its rows,
token choosing on plain arrays, drafting's counts, planning's fairness, and a job's Outcome."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from kinfer_rpc.engine import planning
from kinfer_rpc.engine.choosing import Chooser, output_rows
from kinfer_rpc.engine.drafting import Drafter, draft_count, pause_if_unlucky
from kinfer_rpc.engine.events import close, delivery
from kinfer_rpc.engine.job import GenerateOptions, Job, JobState, Outcome
from kinfer_rpc.engine.passes import Pass, PassState, Shape
from kinfer_rpc.engine.sampling import SamplingOptions, sample
from kinfer_rpc.types import SeqChunk

GREEDY = SamplingOptions(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
SAMPLED = SamplingOptions(temperature=0.9, seed=7)


def _job(sampling: SamplingOptions = GREEDY, owner: int = 0, **options) -> Job:
    job = Job([1, 2, 3], GenerateOptions(max_tokens=8, sampling=sampling, **options), owner=owner)
    job.generated.append(4)
    return job


def _pass(state: PassState, wait=lambda: np.zeros((1, 4))) -> Pass:
    return Pass([SeqChunk(0, 3, (4,), 1)], [_job()], wait, state)


def test_a_pass_moves_only_along_its_story():
    planned = _pass(PassState.PLANNED)
    assert planned.take().shape == (1, 4) and planned.state is PassState.TAKEN
    with pytest.raises(RuntimeError, match="from taken to dropped"):
        planned.drop()
    chained = _pass(PassState.CHAINED)
    with pytest.raises(RuntimeError, match="from chained to taken"):
        chained.take()  # a chained pass is used only once it is the pass started ahead
    chained.move(PassState.AHEAD)
    chained.take()
    ahead = _pass(PassState.AHEAD)
    ahead.drop()
    assert ahead.state is PassState.DROPPED
    with pytest.raises(RuntimeError, match="from dropped to ahead"):
        ahead.move(PassState.AHEAD)
    with pytest.raises(RuntimeError, match="from planned to ahead"):
        _pass(PassState.PLANNED).move(PassState.AHEAD)


def test_a_pass_that_fails_stays_in_flight_when_taken_and_is_dropped_quietly():
    def failing() -> np.ndarray:
        raise RuntimeError("out of memory")

    failed = _pass(PassState.PLANNED, failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        failed.take()
    assert failed.state is PassState.PLANNED  # still to be waited for before its slots go
    failed.drop()  # logged, not raised: it is dropped because something failed already
    assert failed.state is PassState.DROPPED


def test_the_shape_of_a_pass_follows_its_rows():
    greedy, other = _job(), _job()
    sampled = _job(SAMPLED)
    held = Job([1, 2, 3], GenerateOptions(sampling=GREEDY), constraint=object())  # held to a grammar: not plain
    assert held.greedy and not held.plain
    assert Shape.of(True, False, [greedy, other], [greedy, other]) is Shape.CHAINABLE
    assert Shape.of(True, False, [greedy, held], [greedy, held]) is Shape.STEADY
    assert Shape.of(False, False, [greedy], [greedy]) is Shape.MIXED  # passes never start ahead
    assert Shape.of(True, True, [greedy], [greedy]) is Shape.MIXED  # drafting
    assert Shape.of(True, False, [greedy], [greedy, other]) is Shape.MIXED  # a prompt still read
    assert Shape.of(True, False, [greedy, sampled], [greedy, sampled]) is Shape.MIXED
    assert Shape.CHAINABLE.steady and Shape.STEADY.steady and not Shape.MIXED.steady


def test_the_chooser_takes_argmaxes_on_plain_arrays():
    rng = np.random.default_rng(0)
    chooser = Chooser(lambda job, token: False)
    small = rng.standard_normal((3, 50)).astype(np.float32)
    assert chooser.argmax(small) == small.argmax(axis=1).tolist()
    big = rng.standard_normal((64, 1 << 15)).astype(np.float32)  # split over threads where there are some
    assert chooser.argmax(big) == big.argmax(axis=1).tolist()
    chooser.close()
    chunks = [SeqChunk(0, 3, (4,), 1), SeqChunk(1, 3, (4, 9), 2)]
    sampled, plain = _job(SAMPLED), _job()
    assert chooser.best(small, chunks, [sampled, plain], [False, True]) == small.argmax(axis=1).tolist()
    assert chooser.best(small, chunks, [sampled, sampled], [False, False]) == [-1, -1, -1]  # nobody reads it
    assert output_rows(chunks, [False, True]) == [False, True, True]


def test_the_chooser_samples_the_rows_that_need_only_their_options():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 64)).astype(np.float32)
    chunks = [SeqChunk(i, 3, (4,), 1) for i in range(4)]
    sampled, plain, drafting, ended = _job(SAMPLED), _job(), _job(SAMPLED), _job(SAMPLED)
    drafting.drafts = [5]
    ended.stop_reason = "stop"
    got = Chooser(lambda job, token: False).sample_rows(chunks, [sampled, plain, drafting, ended], logits)
    history = sampled.prompt + sampled.generated
    assert got == {0: sample(logits[0], history, len(history), SAMPLED)}  # the same as one row alone


def test_draft_counts_follow_the_room_and_the_pause():
    job = _job(drafts=4, draft_policy="a policy")
    assert job.drafting
    assert draft_count(job, 10) == 4
    assert draft_count(job, 2) == 2
    assert draft_count(job, 0) == 0
    job.draft_pause = 2
    assert draft_count(job, 10) == 0 and job.draft_pause == 1
    assert draft_count(_job(), 10) == 0  # no policy: never
    job.window = [16, 7]  # fewer than half accepted: a pause, and the next one twice as long
    pause_if_unlucky(job)
    assert (job.draft_pause, job.draft_backoff, job.window) == (32, 64, [0, 0])


def test_settling_drafts_says_where_the_cells_end():
    drafter = Drafter(None)
    job = _job(drafts=3, draft_policy="a policy")
    job.drafts = [5, 6, 7]
    assert drafter.settle(job, 10, 2) == 12 and job.n_past == 12  # the row's token and one draft
    assert (job.drafted, job.accepted, drafter.total, job.drafts) == (3, 1, [3, 1], [])
    job.drafts = [5]
    job.stop_reason = "stop"
    assert drafter.settle(job, 12, 1) is None  # ended: its cells go with its slot
    with pytest.raises(RuntimeError, match="needs a session"):
        drafter.session(type("Policy", (), {"name": "mtp"})())  # type: ignore[arg-type]


def test_owners_share_rows_and_slots_fairly():
    a = [_job(owner=1) for _ in range(3)]
    b = [_job(owner=2)]
    held = planning.held_by_owner(a + b, share=True, queued_passes=False)
    assert held == {1: 3, 2: 1}
    assert planning.held_by_owner(a + b, share=True, queued_passes=True) == {}  # a GPU: every job its row
    chosen = planning.fair_rows(a + b, held, step=5)
    assert chosen == [a[0], b[0]] and a[0].last_row == 5
    assert planning.fair_rows(a + b, held, step=6) == [a[1], b[0]]  # those that waited longest
    waiting = [_job(owner=1), _job(owner=2)]
    assert planning.next_waiting(waiting, a, free=2, share=True) is waiting[1]  # the owner holding fewest
    assert planning.next_waiting(waiting[:1], a, free=1, share=True) is None  # the last slot is left over
    assert planning.next_waiting(waiting[:1], a, free=1, share=False) is waiting[0]


def test_the_host_gets_a_frozen_outcome_taken_once_the_step_is_over():
    got: list[Outcome] = []
    job = _job()
    job.on_done = got.append
    job.move(JobState.PROMPT)
    events: list = []
    close(job, "length", events, None)
    job.drafted = 3  # settled after the token that ended it, in the same step
    deliver = delivery(events)
    job.generated.append(99)  # nothing the worker writes later reaches the host
    deliver()
    (outcome,) = got
    assert outcome.stop_reason == "length" and outcome.generated == (4,) and outcome.drafted == 3
    assert outcome.prompt_tokens == 3 and outcome.t_end >= outcome.t_submit
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        outcome.text = "changed"  # type: ignore[misc]
