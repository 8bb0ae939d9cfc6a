"""Speculative decoding never changes a reply: drafts on vs off, any policy, any draft count,
alone or batched, greedy or seeded — the same tokens, on the real model (CPU)."""

from __future__ import annotations

import hashlib

import attrs
import pytest
from engine_helpers import CTX, WORDS, RepeatLast, _options, alone, run_until_done, tokenize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer_rpc.default_plugins.drafts import NgramPolicy
from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.engine.job import Job, Outcome
from kinfer_rpc.engine.scheduler import Engine
from kinfer_rpc.host.store import embedded_default_path
from kinfer_rpc.types import LoadOptions

MAX_DRAFTS = 8


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
    opts = LoadOptions(
        context_length=CTX, slots=slots, batch=batch, ubatch=min(batch, 512), threads=2, drafts=MAX_DRAFTS
    )
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


@pytest.mark.model
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
        assert_drafted_replies(engine, requests, wants, drafts, chosen)
    finally:
        engine.model.close()


def assert_drafted_replies(engine, requests, wants, drafts, policy):
    """Run the requests together with drafting on; each reply must be its reply alone."""
    jobs = [
        Job(list(tokenize(text)), attrs.evolve(_options(n, t, seed, stop), drafts=drafts, draft_policy=policy))
        for text, n, t, seed, stop in requests
    ]
    run_until_done(engine, jobs)
    for job, want in zip(jobs, wants):
        assert (tuple(job.generated), job.text, job.stop_reason) == want


REPEATING = "red green blue yellow, red green blue yellow, red green blue yellow, red green blue yellow, red"


@pytest.mark.model
def test_ngram_drafts_are_accepted_when_text_repeats():
    prompt = tokenize(REPEATING)
    want = alone(prompt, 40, 0.0, 0)
    engine = make_engine(1)
    try:
        job = Job(list(prompt), attrs.evolve(_options(40, 0.0, 0), drafts=4, draft_policy=NgramPolicy()))
        run_until_done(engine, [job])
        assert (tuple(job.generated), job.text, job.stop_reason) == want
        usage = reply_json(reply_of(Outcome.of(job)))["usage"]
        assert usage["draftTokens"] > 0 and usage["draftAccepted"] > usage["draftTokens"] // 2
        assert engine.steps < len(job.generated)  # fewer passes than tokens: drafts paid off
        status = engine_status(engine.stats())
        assert status["draftTokens"] > 0 and status["draftAcceptance"] > 0.5
    finally:
        engine.model.close()


def test_ngram_policy_looks_up_the_latest_match():
    p = NgramPolicy()
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3) == [7, 8, 1]
    assert p.propose([5, 6], 2) == []
    assert p.propose([4, 4, 4], 2) == [4]


# -- draft-model: a second model drafts, through a session per load --------------------------------
import functools  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from kinfer_rpc.default_plugins.drafts import DraftModelPolicy  # noqa: E402
from kinfer_rpc.host.requests import reply_of  # noqa: E402
from kinfer_rpc.protocol.results import engine_status, reply_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=1)
def synthetic_draft() -> str:
    """A 2-layer random model with SmolLM2's vocabulary (tests/modelgen/make_draft_model.py)."""
    path = os.path.join(tempfile.mkdtemp(prefix="kinfer-draft-"), "draft.gguf")
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "modelgen", "make_draft_model.py"), embedded_default_path(), path],
        check=True,
    )
    return path


def make_drafting_engine(slots, draft_path, batch=512):
    path = embedded_default_path()
    opts = LoadOptions(
        context_length=CTX,
        slots=slots,
        batch=batch,
        ubatch=min(batch, 512),
        threads=2,
        drafts=MAX_DRAFTS,
        draft_model=draft_path,
    )
    backend = LlamaBackend()
    policy = DraftModelPolicy()
    engine = Engine(
        lambda progress: backend.load(path, opts, progress),
        lambda fn: fn(),
        batch=batch,
        draft_session=lambda p, model: p.session(model, backend, opts),
        draft_policy=policy,
    )
    engine.load_model()
    return engine, policy


def close(engine):
    engine.drafter.sessions.pop("draft-model").close()
    engine.model.close()


@pytest.mark.model
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    requests=st.lists(request, min_size=1, max_size=3),
    draft=st.sampled_from(["self", "synthetic"]),
    drafts=st.integers(1, MAX_DRAFTS),
    slots=st.sampled_from([1, 3]),
)
def test_a_draft_model_never_changes_a_reply(requests, draft, drafts, slots):
    wants = [alone(tokenize(text), n, t, seed, stop) for text, n, t, seed, stop in requests]
    engine, policy = make_drafting_engine(slots, embedded_default_path() if draft == "self" else synthetic_draft())
    try:
        assert_drafted_replies(engine, requests, wants, drafts, policy)
    finally:
        close(engine)


@pytest.mark.model
def test_the_model_drafting_for_itself_is_always_right():
    """Greedy drafts from the same weights equal the target's own choices (bit-identical logits
    in every pass shape, tests/test_invariance.py), so every draft is accepted; a second request
    in the same slot afterwards reuses the draft cache's common prefix and is still right."""
    engine, policy = make_drafting_engine(2, embedded_default_path())
    try:
        for text in (EDIT, EDIT + "def mul(a, b):\n"):
            prompt = tokenize(text)
            want = alone(prompt, 24, 0.0, 0)
            job = Job(list(prompt), attrs.evolve(_options(24, 0.0, 0), drafts=4, draft_policy=policy))
            run_until_done(engine, [job])
            assert (tuple(job.generated), job.text, job.stop_reason) == want
            usage = reply_json(reply_of(Outcome.of(job)))["usage"]
            assert usage["draftTokens"] > 0 and usage["draftAccepted"] == usage["draftTokens"]
            assert engine.steps and engine_status(engine.stats())["draftAcceptance"] == 1.0
    finally:
        close(engine)


@pytest.mark.model
def test_a_draft_model_with_another_vocabulary_is_refused(tmp_path):
    import pytest

    other = tmp_path / "other.gguf"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "modelgen", "make_model.py"), str(other), "--shape", "tiny"],
        check=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    with pytest.raises(ValueError, match="same vocabulary"):
        make_drafting_engine(1, str(other))


@pytest.mark.model
def test_draft_model_through_the_server():
    from rpcclient import RpcClient, error_of

    with RpcClient.spawn() as c:
        assert "draft-model" in c.initialize()["capabilities"]["draftPolicies"]
        e = error_of(c.request("model/load", {"options": {"draftPolicy": "draft-model"}}))
        assert e["code"] == -32602 and "draftModel" in e["message"]
        e = error_of(c.request("model/load", {"options": {"draftModel": synthetic_draft()}}))
        assert e["code"] == -32602 and "draft-model" in e["message"]
        plain = c.load_model(contextLength=512)
        msgs = [{"role": "user", "content": "Say hello."}]
        e = error_of(c.request("inference/chat", {"messages": msgs, "options": {"draftPolicy": "draft-model"}}))
        assert e["code"] == -32602 and "load the model with draftPolicy" in e["message"]
        want = c.call("inference/chat", {"messages": msgs, "options": {"maxTokens": 12, "temperature": 0}})
        c.call("model/unload", {"model": plain["model"]})
        r = c.load_model(contextLength=512, draftPolicy="draft-model", draftModel=synthetic_draft())
        assert r["draftPolicy"] == "draft-model"
        got = c.call("inference/chat", {"messages": msgs, "options": {"maxTokens": 12, "temperature": 0}})
        assert got["tokens"] == want["tokens"] and got["usage"]["draftTokens"] > 0
        c.assert_clean()
