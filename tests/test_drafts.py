"""Speculative decoding never changes a reply: drafts on vs off, any policy, any draft count,
alone or batched, greedy or seeded — the same tokens, on the real model (CPU)."""

from __future__ import annotations

import hashlib

import attrs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer_drafts import NgramPolicy
from kinfer_llama import LlamaBackend
from kinfer_rpc.engine import Engine, Job
from kinfer_rpc.store import embedded_default_path
from kinfer_rpc.types import LoadOptions
from test_engine import CTX, WORDS, _options, alone, run_until_done, tokenize

MAX_DRAFTS = 8


class RepeatLast:
    name = "repeat-last"

    def propose(self, history, k):
        return [history[-1]] * k


class Noise:
    """Drafts that are almost always wrong: a hash of the history."""

    name = "noise"

    def propose(self, history, k):
        digest = hashlib.sha256(repr(list(history[-8:])).encode()).digest()
        return [digest[i] * 97 % 49152 for i in range(k)]


class Oracle:
    """Proposes what the reply alone would say next, so long runs of drafts are accepted."""

    name = "oracle"

    def __init__(self, replies):
        self.replies = replies  # prompt tuple -> reply tokens

    def propose(self, history, k):
        for prompt, reply in self.replies.items():
            n = len(prompt)
            if tuple(history[:n]) == prompt and list(history[n:]) == list(reply[: len(history) - n]):
                done = len(history) - n
                return list(reply[done : done + k])
        return []


def make_engine(slots, batch=512):
    path = embedded_default_path()
    opts = LoadOptions(context_length=CTX, slots=slots, batch=batch, ubatch=min(batch, 512), threads=2, drafts=MAX_DRAFTS)
    engine = Engine(lambda progress: LlamaBackend().load(path, opts, progress), lambda fn: fn(), batch=batch)
    engine.load_model()
    return engine


EDIT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\nRewrite the code above exactly:\n"

request = st.tuples(
    st.one_of(st.just(EDIT), st.lists(st.sampled_from(WORDS), min_size=1, max_size=40).map(" ".join)),
    st.integers(1, 16),
    st.sampled_from([0.0, 0.0, 0.8]),
    st.integers(0, 1000),
    st.sampled_from([None, None, "\n\n", "e"]),
)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    requests=st.lists(request, min_size=1, max_size=4),
    policy=st.sampled_from(["ngram", "repeat-last", "noise", "oracle"]),
    drafts=st.integers(1, MAX_DRAFTS),
    slots=st.sampled_from([1, 4]),
)
def test_drafting_never_changes_a_reply(requests, policy, drafts, slots):
    wants = [alone(tokenize(text), n, t, seed, stop) for text, n, t, seed, stop in requests]
    replies = {tokenize(r[0]): w[0] for r, w in zip(requests, wants)}
    chosen = {"ngram": NgramPolicy(), "repeat-last": RepeatLast(), "noise": Noise(), "oracle": Oracle(replies)}[policy]
    engine = make_engine(slots)
    try:
        jobs = [
            Job(list(tokenize(text)), attrs.evolve(_options(n, t, seed, stop), drafts=drafts, draft_policy=chosen))
            for text, n, t, seed, stop in requests
        ]
        run_until_done(engine, jobs)
        for job, want in zip(jobs, wants):
            assert (tuple(job.generated), job.text, job.stop_reason) == want
    finally:
        engine.model.close()


REPEATING = "red green blue yellow, red green blue yellow, red green blue yellow, red green blue yellow, red"


def test_ngram_drafts_are_accepted_when_text_repeats():
    prompt = tokenize(REPEATING)
    want = alone(prompt, 40, 0.0, 0)
    engine = make_engine(1)
    try:
        job = Job(list(prompt), attrs.evolve(_options(40, 0.0, 0), drafts=4, draft_policy=NgramPolicy()))
        run_until_done(engine, [job])
        assert (tuple(job.generated), job.text, job.stop_reason) == want
        usage = job.result()["usage"]
        assert usage["draftTokens"] > 0 and usage["draftAccepted"] > usage["draftTokens"] // 2
        assert engine.steps < len(job.generated)  # fewer passes than tokens: drafts paid off
        status = engine.status()
        assert status["draftTokens"] > 0 and status["draftAcceptance"] > 0.5
    finally:
        engine.model.close()


def test_ngram_policy_looks_up_the_latest_match():
    p = NgramPolicy()
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert p.propose([5, 6], 2) == []
    assert p.propose([4, 4, 4], 2) == [4]
