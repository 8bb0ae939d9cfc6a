"""A reply that begins inside a reasoning block, in the engine on the real model: its constraint
holds only what follows the block, the budget forces the block's end, an end of generation
inside the block closes it when a constraint waits, and the reply is the same alone or among
others, drafting or not, with the next pass started ahead or not.

The embedded model knows no reasoning markers, so the block's end here is either a token it never
writes (a control token: the budget must force it) or one its greedy reply writes anyway (the
model closes the block itself)."""

from __future__ import annotations

import json

import attrs
import jsonschema
import pytest
from engine_helpers import WORDS, RepeatLast, _options, make_engine, run_until_done, tokenize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer_rpc.engine.grammar import Grammars
from kinfer_rpc.engine.reasoning import Reasoning
from kinfer_rpc.engine.scheduler import Engine, Job
from kinfer_rpc.host import reasoning

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PROMPT = "Describe a person called Ada. Think first."
NEVER = 8  # <issue_start>: a control token the model does not write
GRAMMARS: dict[Engine, Grammars] = {}


@pytest.fixture(scope="module")
def engine():
    e = make_engine(slots=4)
    yield e
    e.model.close()


def job(engine, end=(NEVER,), budget=None, schema=PERSON, text=PROMPT, n=120, temperature=0.0, seed=0, **more):
    matcher = (
        GRAMMARS.setdefault(engine, Grammars()).matcher(engine.model, "format", json.dumps(schema)) if schema else None
    )
    opts = attrs.evolve(_options(n, temperature, seed), reasoning=Reasoning(tuple(end), budget), **more)
    return Job(list(tokenize(text)), opts, constraint=matcher)


def parts(engine, j):
    t = j.thinking
    return reasoning.split(j.text, t.reasoning_chars, t.answer_chars)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("budget", [0, 1, 12])
def test_the_budget_forces_the_end_and_the_answer_is_valid(engine, budget, temperature):
    j = job(engine, budget=budget, temperature=temperature, seed=5)
    run_until_done(engine, [j])
    assert j.generated[budget] == NEVER and j.thinking.closed_at == budget + 1
    assert NEVER not in j.generated[:budget]
    thought, answer = parts(engine, j)
    assert j.stop_reason == "stop", (j.stop_reason, j.text)
    jsonschema.validate(json.loads(answer), PERSON)
    assert "<issue_start>" not in thought + answer
    assert j.text[j.thinking.reasoning_chars : j.thinking.answer_chars] == "<issue_start>"


def test_the_model_closes_the_block_itself(engine):
    free = Job(list(tokenize(PROMPT)), _options(12, 0.0, 0))
    run_until_done(engine, [free])
    at = next(i for i in range(3, 12) if free.generated[i] not in free.generated[:i])
    end = free.generated[at]
    j = job(engine, end=(end,))
    run_until_done(engine, [j])
    assert j.generated[: at + 1] == free.generated[: at + 1]  # reasoned freely until the end came
    assert j.thinking.closed_at == at + 1 and j.thinking.count == at + 1
    jsonschema.validate(json.loads(parts(engine, j)[1]), PERSON)


def test_an_end_of_several_tokens_is_forced_whole(engine):
    end = tuple(tokenize(" ]]> done"))
    assert len(end) > 1
    j = job(engine, end=end, budget=4)
    run_until_done(engine, [j])
    assert tuple(j.generated[4 : 4 + len(end)]) == end and j.thinking.closed_at == 4 + len(end)
    jsonschema.validate(json.loads(parts(engine, j)[1]), PERSON)


def test_an_end_of_generation_inside_the_block_closes_it_when_a_constraint_waits(engine):
    free = Job(list(tokenize(PROMPT)), _options(8, 0.0, 0))
    run_until_done(engine, [free])
    stop = free.generated[3]  # the reply would end at its 4th token (a stop token, as an infill's)
    j = job(engine, stop_tokens=(stop,))
    run_until_done(engine, [j])
    assert j.generated[3] == NEVER and j.thinking.closed_at == 4
    assert parts(engine, j)[1].startswith("{")  # (the stop token, an ordinary one, may end the answer too)
    # without a constraint the reply ends there, all of it reasoning
    k = job(engine, schema=None, stop_tokens=(stop,))
    run_until_done(engine, [k])
    assert k.stop_reason == "stop" and k.thinking.inside and len(k.generated) == 3
    assert parts(engine, k) == (k.text.strip(), "")


def test_logprobs_stay_one_per_token_with_forced_and_replaced_tokens(engine):
    j = job(engine, budget=3, temperature=0.7, seed=2, logprobs=2)
    run_until_done(engine, [j])
    assert len(j.logprobs) == len(j.generated) and j.logprobs[3].token == NEVER


reasoner = st.tuples(
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join),
    st.sampled_from([None, 0, 3, 9]),  # the budget
    st.sampled_from([0.0, 0.8]),
    st.integers(0, 1000),
    st.booleans(),  # held to the schema
)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=st.lists(reasoner, min_size=2, max_size=4), arrivals=st.lists(st.integers(0, 5), min_size=4))
def test_the_same_reply_alone_or_among_others_drafting_or_not(engine, requests, arrivals):
    def make(r, drafting=False):
        text, budget, t, seed, held = r
        more = {"drafts": 3, "draft_policy": RepeatLast()} if drafting else {}
        return job(
            engine, budget=budget, schema=PERSON if held else None, text=text, n=30, temperature=t, seed=seed, **more
        )

    alone = []
    for r in requests:
        j = make(r)
        run_until_done(engine, [j])
        alone.append(j)
    together = [make(r, drafting=i % 2 == 0) for i, r in enumerate(requests)]
    run_until_done(engine, together, arrivals=arrivals[: len(together)])
    for a, b in zip(alone, together):
        assert (a.generated, a.text, a.stop_reason) == (b.generated, b.text, b.stop_reason)
        assert (a.thinking.reasoning_chars, a.thinking.answer_chars) == (
            b.thinking.reasoning_chars,
            b.thinking.answer_chars,
        )


def test_held_replies_that_reason_start_passes_ahead_and_stay_the_same(engine):
    reference = make_engine(slots=4, start_ahead=False)

    def jobs(e):
        return [job(e, budget=b, text=f"{w} Answer:", n=40) for b, w in zip((2, 6, None, 10), WORDS)]

    try:
        want = run_until_done(reference, jobs(reference))
        before = engine.started_ahead
        got = run_until_done(engine, jobs(engine))
        assert engine.started_ahead > before
        for a, b in zip(want, got):
            assert (a.generated, a.text, a.stop_reason) == (b.generated, b.text, b.stop_reason)
    finally:
        reference.model.close()
