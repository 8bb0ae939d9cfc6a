"""Replies held to a JSON schema, a regex or a grammar (llguidance), and token logprobs, in the
engine on the real model: the reply matches, it is the same alone or among other requests, with
drafting on or off, and logprobs are the raw logits' log-softmax."""

from __future__ import annotations

import json
import os
import re

import attrs
import jsonschema
import numpy as np
import pytest
from engine_helpers import WORDS, RepeatLast, _options, make_engine, run_until_done, tokenize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer_rpc.engine import grammar
from kinfer_rpc.engine.grammar import Grammars
from kinfer_rpc.engine.job import Job
from kinfer_rpc.engine.sampling import logprob
from kinfer_rpc.engine.scheduler import Engine
from kinfer_rpc.types import SeqChunk

pytestmark = pytest.mark.model  # every test here runs the real model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    ("format", PERSON),
    ("format", "json"),
    ("regex", r"(yes|no), because [a-z ]{1,30}\."),
    ("grammar", 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/\n'),
]
PROMPT = "Describe a person called Ada as JSON. Answer:"
SHORT = r"(yes|no)\. (yes|no)\."  # a grammar completed by a token of a decode pass, not the prompt's


@pytest.fixture(scope="module")
def engine():
    e = make_engine(slots=4)
    yield e
    e.model.close()


# Each engine's own compiler: a Grammars keeps the tokenizer of the model it first saw, which
# reads that model's vocabulary (a reference engine's model is closed after its test).
GRAMMARS: dict[Engine, Grammars] = {}


def job(engine, kind, source, text=PROMPT, n=48, temperature=0.0, seed=0, **more):
    matcher = GRAMMARS.setdefault(engine, Grammars()).matcher(engine.model, kind, source) if kind else None
    opts = attrs.evolve(_options(n, temperature, seed), **more)
    return Job(list(tokenize(text)), opts, constraint=matcher)


def check(kind, source, text):
    if kind == "format":
        value = json.loads(text)
        if isinstance(source, dict):
            jsonschema.validate(value, source)
    elif kind == "regex":
        assert re.fullmatch(source, text), text
    else:
        assert re.fullmatch(r"The answer is [0-9]{1,4}\.", text), text


@pytest.mark.parametrize("kind,source", CONSTRAINTS, ids=["schema", "json", "regex", "grammar"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_constrained_reply_matches(engine, kind, source, temperature):
    j = job(engine, kind, source, n=200, temperature=temperature, seed=7)
    run_until_done(engine, [j])
    assert j.stop_reason == "stop", (j.stop_reason, j.text)
    check(kind, source, j.text)


def test_max_tokens_cuts_a_constrained_reply(engine):
    j = job(engine, "format", PERSON, n=3)
    run_until_done(engine, [j])
    assert j.stop_reason == "length" and len(j.generated) == 3


def test_a_bad_schema_is_invalid_params():
    from kinfer_rpc import errors
    from kinfer_rpc.host.store import embedded_default_path  # noqa: F401  (the engine's model)

    e = make_engine(slots=1)
    try:
        for kind, source in [("format", {"type": "nope"}), ("regex", "a("), ("grammar", "start: (")]:
            with pytest.raises(errors.KinferError) as info:
                Grammars().matcher(e.model, kind, source)
            assert info.value.code == errors.INVALID_PARAMS
            assert info.value.data["field"] == f"options.{kind}" and info.value.data["error"]
    finally:
        e.model.close()


request = st.tuples(
    st.sampled_from([None, 0, 1, 2, 3]),  # None: unconstrained, else an index into CONSTRAINTS
    st.lists(st.sampled_from(WORDS), min_size=1, max_size=20).map(" ".join),
    st.sampled_from([0.0, 0.0, 0.8]),
    st.integers(0, 1000),
    st.sampled_from([None, 3]),  # logprobs: None, or with 3 alternatives
)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=st.lists(request, min_size=2, max_size=5), arrivals=st.lists(st.integers(0, 6), min_size=5))
def test_the_same_reply_alone_or_among_others(engine, requests, arrivals):
    def make(r):
        c, text, t, seed, lp = r
        kind, source = CONSTRAINTS[c] if c is not None else (None, None)
        return job(engine, kind, source, text + " Answer:", n=24, temperature=t, seed=seed, logprobs=lp)

    alone = []
    for r in requests:
        j = make(r)
        run_until_done(engine, [j])
        alone.append(j)
    together = [make(r) for r in requests]
    run_until_done(engine, together, arrivals=arrivals[: len(together)])
    for a, b in zip(alone, together):
        assert (a.generated, a.text, a.stop_reason) == (b.generated, b.text, b.stop_reason)
        assert a.logprobs == b.logprobs


@pytest.mark.parametrize("kind,source", CONSTRAINTS[:1] + CONSTRAINTS[2:], ids=["schema", "regex", "grammar"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafting_never_changes_a_constrained_reply(engine, kind, source, temperature):
    plain = job(engine, kind, source, n=60, temperature=temperature, seed=3)
    run_until_done(engine, [plain])

    class Oracle:  # drafts the reply itself, then a wrong token: accepted runs and rejections
        name = "oracle"

        def propose(self, history, k):
            done = len(history) - len(plain.prompt)
            return [*plain.generated[done : done + k - 1], 17]

    for policy in (RepeatLast(), Oracle()):
        drafted = job(engine, kind, source, n=60, temperature=temperature, seed=3, drafts=4, draft_policy=policy)
        run_until_done(engine, [drafted])
        want = (plain.generated, plain.text, plain.stop_reason)
        assert (drafted.generated, drafted.text, drafted.stop_reason) == want
    assert drafted.drafted > 0 and drafted.accepted > 0


def test_logprobs_are_the_raw_logits_log_softmax(engine):
    j = job(engine, None, None, "The capital of France is", n=4, temperature=0.9, seed=11, logprobs=5, ignore_eos=True)
    run_until_done(engine, [j])
    assert len(j.logprobs) == len(j.generated) == 4
    model = engine.model
    model.seq_remove(3)
    # an earlier job on slot 3 may have left it greedy: its pass would then bring back only the
    # argmax, and the logits read would be an older pass's
    model.set_device_greedy(3, False)
    logits = model.decode([SeqChunk(3, 0, j.prompt, 1)])()[0].astype(np.float64)
    model.seq_remove(3)
    want = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    first = j.logprobs[0]
    assert first.token == j.generated[0]
    assert first.logprob == pytest.approx(want[first.token], abs=1e-9)
    assert [t for t, _ in first.top] == list(np.argsort(-want, kind="stable")[:5])
    assert [lp for _, lp in first.top] == pytest.approx(sorted(want, reverse=True)[:5], abs=1e-9)
    assert logprob(logits, first.token, 0).top == ()


def test_logprobs_of_a_constrained_reply_are_before_the_mask(engine):
    j = job(engine, "regex", r"zebra", n=8, logprobs=2)
    run_until_done(engine, [j])
    assert j.text == "zebra" and len(j.logprobs) == len(j.generated)
    # "z..." is not what the model would say here: the raw logprob is low, and the best
    # alternatives are not the token taken.
    assert j.logprobs[0].logprob < j.logprobs[0].top[0][1]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A SentencePiece vocabulary (tokenizing puts a space in front), as Llama 2's: random weights."""
    import subprocess
    import sys

    path = tmp_path_factory.mktemp("spm") / "tiny.gguf"
    maker = os.path.join(os.path.dirname(__file__), "modelgen", "make_model.py")
    subprocess.run([sys.executable, maker, str(path), "--shape", "tiny"], check=True, capture_output=True)
    from kinfer_rpc.default_plugins.llama import LlamaBackend
    from kinfer_rpc.types import LoadOptions

    m = LlamaBackend().load(str(path), LoadOptions(context_length=256, slots=2, threads=2), lambda f: None)
    yield m
    m.close()


def test_a_sentencepiece_vocabulary_is_tokenized_without_its_space(spm_model):
    """llguidance forces the tokens of text the grammar leaves no choice about: they must be the
    text's own, not those of a space and the text."""
    tok = Grammars().tokenizer(spm_model)
    assert tok.tokenize_str("{") == [t for t in range(spm_model.info.n_vocab) if spm_model.token_bytes(t) == b"{"][:1]
    engine = Engine(lambda progress: spm_model, lambda fn: fn(), batch=512)
    engine.load_model()
    matcher = Grammars().matcher(spm_model, "format", PERSON)
    j = Job([1, 300, 400, 500], _options(80, 0.0, 0), constraint=matcher)
    run_until_done(engine, [j])
    assert j.error is None and j.text.startswith("{") and '"name"' in j.text
    assert "\n\n\n" not in j.text  # whitespace is bounded as llama.cpp bounds it: no endless padding
    if j.stop_reason == "stop":
        jsonschema.validate(json.loads(j.text), PERSON)


def test_greedy_held_replies_start_the_next_pass_ahead_and_stay_the_same(engine):
    """A pass of greedy rows, some held to grammars, starts the next pass as soon as their tokens
    are chosen (Engine._start_next); the replies are those of an engine that never starts ahead."""
    reference = make_engine(slots=4, start_ahead=False)

    def jobs(e):
        kinds = [CONSTRAINTS[0], (None, None), CONSTRAINTS[2], CONSTRAINTS[3]]
        return [job(e, k, s, f"{w} Answer:", n=40) for (k, s), w in zip(kinds, WORDS)]

    try:
        want = run_until_done(reference, jobs(reference))
        before = engine.started_ahead
        got = run_until_done(engine, jobs(engine))
        assert engine.started_ahead > before + 10
        for a, b in zip(want, got):
            assert (a.generated, a.text, a.stop_reason) == (b.generated, b.text, b.stop_reason)
        check(*CONSTRAINTS[0], got[0].text) if got[0].stop_reason == "stop" else None
    finally:
        reference.model.close()


def test_a_grammar_completed_while_the_next_pass_runs_gives_its_slot_back_after_it(engine, monkeypatch):
    """A held row's matcher consumes its token once the next pass has started (Engine._consume_held),
    so a grammar completed by that token ends its job while the next pass holds the job's row: the
    row is thrown away and the slot given back only after that pass. A job waiting for a slot
    then takes it; every reply is the one of an engine that never starts ahead."""
    reference = make_engine(slots=4, start_ahead=False)
    ended_ahead: list[Job] = []
    end_job = Engine._end_job

    def spy(self, job, reason, events, ahead):
        end_job(self, job, reason, events, ahead)
        if self._running is not None and job in self._running.ended:
            ended_ahead.append(job)

    def jobs(e):
        short = job(e, "regex", SHORT, f"{WORDS[0]} Answer:", n=40)
        rest = [job(e, None, None, f"{w} Answer:", n=30) for w in WORDS[1:4]]
        waiting = job(e, *CONSTRAINTS[2], f"{WORDS[4]} Answer:", n=40)
        return [short, *rest, waiting]

    try:
        want = run_until_done(reference, jobs(reference))
        monkeypatch.setattr(Engine, "_end_job", spy)
        got = run_until_done(engine, jobs(engine))
        assert got[0] in ended_ahead  # the short grammar's job: its row in the next pass thrown away
        assert got[0].stop_reason == "stop" and re.fullmatch(SHORT, got[0].text)
        for a, b in zip(want, got):
            assert (a.generated, a.text, a.stop_reason) == (b.generated, b.text, b.stop_reason)
        check(*CONSTRAINTS[2], got[4].text) if got[4].stop_reason == "stop" else None
    finally:
        reference.model.close()


def test_a_reply_cancelled_after_its_grammar_completed_ahead_stays_complete(engine):
    """A client's cancel that arrives after the reply's grammar completed, while the next pass
    still holds its row (its slot not yet given back), changes nothing: the reply stays as it
    ended and the engine goes on serving the others."""
    short = job(engine, "regex", SHORT, f"{WORDS[0]} Answer:", n=40)
    rest = [job(engine, None, None, f"{w} Answer:", n=30) for w in WORDS[1:4]]
    done: list[Job] = []
    for j in [short, *rest]:
        j.on_done = lambda _outcome, j=j: done.append(j)
        engine.submit(j)
    cancelled = False
    for _ in range(500):
        engine.step()
        if not cancelled and engine._running is not None and short in engine._running.ended:
            engine.cancel(short)  # between the step that ended it and the one that frees its slot
            cancelled = True
        if len(done) == 4:
            break
    assert cancelled, "the grammar did not complete while a pass was started ahead"
    assert engine.failure is None
    assert sorted(map(id, done)) == sorted(map(id, [short, *rest]))  # each reported once
    assert short.stop_reason == "stop" and re.fullmatch(SHORT, short.text)
    assert all(j.error is None and j.stop_reason in ("length", "stop") for j in rest)


def test_format_json_takes_any_json_object_and_nothing_else(engine):
    """`format: "json"` holds a reply to a JSON object, as Ollama's JSON mode does: any object is a
    complete reply; an array, a string, a number or a literal is refused from its first token."""
    for text in ['{"ok": true}', '{"a": [1, {"b": null}], "c": "d"}', "{}"]:
        matcher = Grammars().matcher(engine.model, "format", "json")
        for token in engine.model.tokenize(text, False, False):
            assert matcher.consume_token(token), (text, matcher.get_error())
        assert matcher.is_accepting(), text
    for text in ["[1, 2]", '"yes"', "42", "null"]:
        matcher = Grammars().matcher(engine.model, "format", "json")
        first = engine.model.tokenize(text, False, False)[0]
        assert not matcher.consume_token(first), text


def test_a_vocabulary_that_cannot_be_read_refuses_constraints_clearly(engine):
    """A model whose backend cannot give its tokens' bytes (a plugin's gap) cannot be masked:
    every constrained request is -32602 naming its option and why, once the first found it;
    the vocabulary is not walked again for each request."""
    from kinfer_rpc import errors

    class NoBytes:
        def __init__(self, model):
            self._model, self.calls = model, 0

        def __getattr__(self, name):
            return getattr(self._model, name)

        def token_bytes(self, token):
            self.calls += 1
            raise NotImplementedError("this backend keeps its vocabulary to itself")

    model, grammars = NoBytes(engine.model), Grammars()
    cases = (("format", PERSON, "options.format"), ("regex", "a+", "options.regex"), ("tools", 'start: "x"', "tools"))
    for kind, source, field in cases:
        with pytest.raises(errors.KinferError) as refused:
            grammars.matcher(model, kind, source)
        assert refused.value.code == errors.INVALID_PARAMS and refused.value.data["field"] == field
        assert "cannot apply to this model" in refused.value.message and "keeps its vocabulary" in refused.value.message
    assert model.calls == 1


def test_masks_are_computed_while_the_pass_runs(engine, monkeypatch):
    """Every mask of a pass's rows is computed between the pass's launch and its wait (the test
    engine's model runs a pass only at its wait, as a GPU would finish it then)."""
    compute = grammar.Masks.compute
    in_flight: list[bool] = []

    def spy(self, matchers):
        in_flight.append(engine.model._queued)  # Queued: True from decode() until the wait
        return compute(self, matchers)

    monkeypatch.setattr(grammar.Masks, "compute", spy)
    held = [job(engine, *CONSTRAINTS[0], f"{w} Answer:", n=30) for w in WORDS[:2]]
    run_until_done(engine, [*held, job(engine, None, None, f"{WORDS[2]} Answer:", n=30)])
    assert len(in_flight) >= 30 and all(in_flight)


def test_a_mask_that_allows_every_token_is_not_applied(engine, monkeypatch):
    """Where the grammar allows every token the row is sampled as it is, unmasked: a sampled reply
    under such masks is the unconstrained reply of the same seed."""
    compute, masked = grammar.Masks.compute, grammar.masked
    unmasked: list[bool] = []

    def open_masks(self, matchers):
        bits = compute(self, matchers)
        bits[:] = -1  # as a grammar that allows every token gives them
        return bits

    def spy(row, keep):
        unmasked.append(keep is None)
        return masked(row, keep)

    plain = job(engine, None, None, f"{WORDS[3]} Answer:", n=12, temperature=0.8, seed=11)
    run_until_done(engine, [plain])
    monkeypatch.setattr(grammar.Masks, "compute", open_masks)
    monkeypatch.setattr(grammar, "masked", spy)
    held = job(engine, "regex", r"[\s\S]*", f"{WORDS[3]} Answer:", n=12, temperature=0.8, seed=11)
    run_until_done(engine, [held])
    assert held.error is None and held.generated == plain.generated
    assert len(unmasked) >= 10 and all(unmasked)


def test_a_held_greedy_rows_best_token_comes_from_the_device(engine, monkeypatch):
    """With llama.cpp's argmax in the pass (DeviceArgmax), a greedy row held to a grammar tries the
    device's argmax against its mask instead of one taken here, in passes started ahead and in
    the others alike; the replies are those of an engine that takes every argmax itself."""
    reference = make_engine(slots=4, start_ahead=False, device_argmax=False)
    known: list[int] = []
    choose, best_allowed = grammar.Masks.choose, grammar.best_allowed

    def spy_choose(self, logits, picks, given=None):
        known.extend(given or [])
        return choose(self, logits, picks, given)

    def spy_best(row, bits, rounds=4, ids=None, best=None):
        known.append(-1 if best is None else best)
        return best_allowed(row, bits, rounds, ids, best)

    def jobs(e):
        kinds = [CONSTRAINTS[0], (None, None), CONSTRAINTS[2], CONSTRAINTS[3]]
        return [job(e, k, s, f"{w} Answer:", n=40) for (k, s), w in zip(kinds, WORDS[4:])]

    try:
        want = run_until_done(reference, jobs(reference))
        monkeypatch.setattr(grammar.Masks, "choose", spy_choose)
        monkeypatch.setattr(grammar, "best_allowed", spy_best)
        got = run_until_done(engine, jobs(engine))
        assert engine.chooser.masked is not None and any(engine.chooser.masked.values())
        assert len(known) > 60 and all(t >= 0 for t in known), known  # every held row's: from the device
        for a, b in zip(want, got):
            assert (a.generated, a.text, a.stop_reason) == (b.generated, b.text, b.stop_reason)
    finally:
        reference.model.close()
