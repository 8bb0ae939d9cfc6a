"""The `mtp` draft policy: a model's own multi-token-prediction (NextN) layers draft, through
llama.cpp's MTP context (kinfer_rpc/default_plugins/llama/mtp.py, the policy in
kinfer_rpc/default_plugins/llama/), on the real llama.cpp CPU backend.

The models are tiny glm4moe GGUFs with one NextN block written by tests/modelgen/make_mtp_model.py:
`random` (the MTP head guesses unrelated tokens: drafts are rejected) and `aligned` (target and
MTP head always predict the same token: every draft is accepted). Replies must be the same with
drafting on and off, whatever the batching, slot moves and prefix-pool hits.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from engine_helpers import run_until_done

from kinfer_rpc.default_plugins.llama import LlamaBackend, LlamaModel, MtpPolicy
from kinfer_rpc.engine.job import GenerateOptions, Job, Outcome
from kinfer_rpc.engine.sampling import SamplingOptions
from kinfer_rpc.engine.scheduler import Engine
from kinfer_rpc.host.requests import reply_of
from kinfer_rpc.host.store import embedded_default_path
from kinfer_rpc.protocol.results import engine_status, reply_json
from kinfer_rpc.types import DraftRequest, LoadOptions, SeqChunk

pytestmark = pytest.mark.model  # every test here loads a real model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CTX = 256
BATCH = 128
DRAFTS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp")
    paths = {}
    for name, extra in (("random", []), ("aligned", ["--aligned"])):
        paths[name] = str(folder / f"{name}.gguf")
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "tests", "modelgen", "make_mtp_model.py"), paths[name], *extra],
            check=True,
            capture_output=True,
        )
    return paths


def load_options(slots, mtp=True):
    return LoadOptions(context_length=CTX, slots=slots, batch=BATCH, ubatch=BATCH, threads=2, drafts=DRAFTS, mtp=mtp)


def make_engine(path, slots=1, mtp=True, prefix=-1):
    opts = load_options(slots, mtp)
    backend, policy = LlamaBackend(), MtpPolicy()
    engine = Engine(
        lambda progress: backend.load(path, opts, progress),
        lambda fn: fn(),
        batch=BATCH,
        prefix=prefix,
        draft_session=lambda p, model: p.session(model, backend, opts),
        draft_policy=policy if mtp else None,
    )
    engine.load_model()
    return engine, policy


def options(n, temperature=0.0, seed=0, policy=None):
    return GenerateOptions(
        max_tokens=n,
        ignore_eos=True,
        drafts=DRAFTS if policy else 0,
        draft_policy=policy,
        sampling=SamplingOptions(temperature=temperature, seed=seed),
    )


def reply(job):
    return tuple(job.generated), job.text, job.stop_reason


def prompt(i, length=12):
    rng = np.random.default_rng(i)
    return [1] + rng.integers(3, 512, length - 1).tolist()


PROMPTS = [prompt(i, 6 + 5 * i) for i in range(4)]
# Requests: (prompt, max tokens, temperature, seed); later ones share a start with earlier ones
# (prefix-pool hits) and arrive late (slot moves when the pool is off).
REQUESTS = [
    (PROMPTS[0], 30, 0.0, 0),
    (PROMPTS[1], 12, 0.8, 7),
    (PROMPTS[2], 40, 0.0, 0),
    (PROMPTS[0] + [300, 301, 302], 20, 0.8, 3),
    (PROMPTS[3], 25, 0.0, 0),
]
ARRIVALS = [0, 0, 1, 3, 8]


def plain_replies(path):
    """Every request alone on a load without MTP: what drafting must never change."""
    engine, _ = make_engine(path, slots=1, mtp=False)
    try:
        out = []
        for p, n, t, seed in REQUESTS:
            job = Job(list(p), options(n, t, seed))
            run_until_done(engine, [job])
            out.append(reply(job))
        return out
    finally:
        engine.model.close()


def close(engine):
    for session in engine.drafter.sessions.values():
        session.close()
    engine.model.close()


@pytest.mark.parametrize("model", ["random", "aligned"])
def test_mtp_drafting_never_changes_a_reply(models, model):
    wants = plain_replies(models[model])
    for slots, prefix, batched in ((1, -1, False), (3, -1, True), (3, 4096, True)):
        engine, policy = make_engine(models[model], slots=slots, prefix=prefix)
        try:
            jobs = [Job(list(p), options(n, t, seed, policy)) for p, n, t, seed in REQUESTS]
            if batched:
                run_until_done(engine, jobs, ARRIVALS)
            else:
                for job in jobs:
                    run_until_done(engine, [job])
            for job, want in zip(jobs, wants):
                assert reply(job) == want, (slots, prefix, batched)
            drafted = sum(j.drafted for j in jobs)
            accepted = sum(j.accepted for j in jobs)
            assert drafted > 0
            if model == "aligned":
                assert accepted == drafted  # greedy and seeded alike: the target's choice is certain
            else:
                assert accepted * 4 < drafted
        finally:
            close(engine)


def test_the_aligned_model_accepts_every_draft(models):
    engine, policy = make_engine(models["aligned"], slots=2)
    try:
        jobs = [Job(prompt(10 + i), options(41, policy=policy)) for i in range(2)]
        run_until_done(engine, jobs)
        for job in jobs:
            usage = reply_json(reply_of(Outcome.of(job)))["usage"]
            assert job.generated == [300] * 41
            assert usage["draftTokens"] == usage["draftAccepted"] > 0
        assert engine.steps <= 1 + 40 // (DRAFTS + 1)  # every verifying pass kept all its drafts
        assert engine_status(engine.stats())["draftAcceptance"] == 1.0
    finally:
        close(engine)


def fresh_drafts(path, history, k):
    """Drafts from a new load that computes the whole history in one pass."""
    model = LlamaModel(path, load_options(1), lambda f: None)
    try:
        model.decode([SeqChunk(0, 0, list(history[:-1]), 1)])()
        return model._mtp.propose_many([DraftRequest(0, list(history), k)])[0]
    finally:
        model.close()


def test_mtp_memory_follows_rejections_and_slot_moves(models):
    """After rejected drafts (cells removed from both memories) and a slot move (the highest busy
    slot copied into a freed lower one), drafting through the live MTP memory gives what a
    fresh context computing the same history from scratch gives."""
    path = models["random"]
    engine, policy = make_engine(path, slots=3)
    try:
        jobs = [Job(prompt(20 + i, 10), options(n, policy=policy)) for i, n in enumerate((6, 40, 40))]
        for job in jobs:
            engine.submit(job)
        moved = False
        for _ in range(200):
            engine.step()
            if jobs[2].slot == 0:
                moved = True
            if moved and len(jobs[2].generated) >= 24:
                break
        assert moved and jobs[0].stop_reason == "length"
        assert jobs[1].drafted > jobs[1].accepted  # rejections happened
        session = engine.drafter.sessions["mtp"]
        live = [j for j in jobs if j.stop_reason is None]
        requests = [DraftRequest(j.slot, j.prompt + j.generated, DRAFTS) for j in live]
        got = session.propose_many(requests)
        assert got == session.propose_many(requests)  # drafting leaves the memory as it was
        for job, drafts in zip(live, got):
            assert len(drafts) == DRAFTS
            assert drafts == fresh_drafts(path, job.prompt + job.generated, DRAFTS)
        # A history the cells do not hold gets no drafts rather than wrong ones.
        other = list(live[0].prompt + live[0].generated)
        other[3] = (other[3] + 1) % 512
        assert session.propose_many([DraftRequest(live[0].slot, other, DRAFTS)]) == [[]]
    finally:
        close(engine)


def test_a_model_without_nextn_layers_is_refused():
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        LlamaBackend().load(embedded_default_path(), load_options(1), lambda f: None)
    model = LlamaBackend().load(embedded_default_path(), load_options(1, mtp=False), lambda f: None)
    try:
        with pytest.raises(ValueError, match="multi-token-prediction layers"):
            MtpPolicy().session(model, None, None)
    finally:
        model.close()


def test_mtp_through_the_server(models):
    from rpcclient import RpcClient, error_of

    tokens = prompt(30, 10)
    with RpcClient.spawn() as c:
        assert "mtp" in c.initialize()["capabilities"]["draftPolicies"]
        e = error_of(c.request("model/load", {"options": {"draftPolicy": "mtp", "contextLength": 256, "slots": 1}}))
        assert e["code"] in (-31003, -31006) and "multi-token-prediction" in e["message"]
        r = c.load_model(models["aligned"], contextLength=CTX, slots=2, draftPolicy="mtp", drafts=DRAFTS)
        assert r["draftPolicy"] == "mtp" and r["drafts"] == DRAFTS
        params = {"model": models["aligned"], "tokens": tokens, "options": {"maxTokens": 20, "temperature": 0}}
        got = c.call("inference/generate", params)
        off = c.call("inference/generate", {**params, "options": {**params["options"], "draftPolicy": "none"}})
        assert got["tokens"] == off["tokens"] == [300] * 20
        assert got["usage"]["draftTokens"] == got["usage"]["draftAccepted"] > 0
        assert off["usage"]["draftTokens"] == 0
        c.call("model/unload", {"model": models["aligned"]})
        r = c.load_model(models["random"], contextLength=CTX, slots=2, draftPolicy="mtp", drafts=DRAFTS)
        params = {"model": models["random"], "tokens": tokens, "options": {"maxTokens": 20, "temperature": 0}}
        got = c.call("inference/generate", params)
        off = c.call("inference/generate", {**params, "options": {**params["options"], "draftPolicy": "none"}})
        assert got["tokens"] == off["tokens"] and got["usage"]["draftTokens"] > 0
        c.assert_clean()
