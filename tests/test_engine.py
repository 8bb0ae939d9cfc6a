"""The engine on the real model (SmolLM2-135M through the llama backend), CPU.

The core property: a request's tokens are the same whether it runs alone or among others,
whatever the slot count, the pass size, when it arrived, and whether neighbours were cancelled.
The engine is driven step by step from the test thread, so arrival steps are exact.
"""

from __future__ import annotations

import os

import attrs
import numpy as np
import pytest
from engine_helpers import (
    CTX,
    WORDS,
    RepeatLast,
    _options,
    alone,
    make_engine,
    run_until_done,
    tokenize,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinfer_rpc import errors
from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.engine.job import GenerateOptions, Job, JobState, Outcome
from kinfer_rpc.engine.sampling import SamplingOptions
from kinfer_rpc.host.requests import reply_of
from kinfer_rpc.host.store import embedded_default_path
from kinfer_rpc.protocol.results import engine_status, reply_json
from kinfer_rpc.types import LoadOptions, SeqChunk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Prompts often share a start (a system prompt, a file), so the prefix pool gets hits and misses.
SHARED = ["You are a careful assistant. Answer briefly and exactly. " * 3, "def main():\n    print('hi')\n" * 4, ""]

request = st.tuples(
    st.tuples(st.sampled_from(SHARED), st.lists(st.sampled_from(WORDS), min_size=1, max_size=60).map(" ".join)).map(
        "".join
    ),
    st.integers(1, 12),  # max tokens
    st.sampled_from([0.0, 0.0, 0.7, 1.2]),  # greedy twice as often
    st.integers(0, 2**32),  # seed
    st.integers(0, 6),  # arrival step
    st.sampled_from([None, None, "e", ".", " the", "\n"]),  # stop string
)


@pytest.mark.model
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    requests=st.lists(request, min_size=2, max_size=7),
    slots=st.sampled_from([1, 2, 3, 8]),
    batch=st.sampled_from([16, 48, 512]),
    cancel=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 12)), max_size=2),
    prefix=st.sampled_from([-1, 0, 100000]),
)
def test_reply_is_the_same_alone_or_batched(requests, slots, batch, cancel, prefix):
    """Alone vs among others, with the prefix pool on (hits and misses) or off (compaction
    moving slots), whatever the pass size, arrival step or cancelled neighbours."""
    engine = make_engine(slots=slots, batch=batch, ubatch=min(batch, 512), prefix=prefix)
    try:
        jobs = [Job(list(tokenize(text)), _options(n, t, seed, stop)) for text, n, t, seed, _, stop in requests]
        arrivals = [r[4] for r in requests]
        cancels = {i % len(jobs): at for i, at in cancel}
        run_until_done(engine, jobs, arrivals, cancels)
        for job, (text, n, t, seed, _, stop) in zip(jobs, requests):
            if job.stop_reason == "cancelled":
                continue
            got = (tuple(job.generated), job.text, job.stop_reason)
            assert got == alone(tokenize(text), n, t, seed, stop), (text, n, t, seed, stop)
    finally:
        engine.stop()
        engine.model.close()


@pytest.mark.model
def test_chunked_prompt_matches_one_pass():
    text = " ".join(WORDS * 3)
    prompt = tokenize(text)
    assert len(prompt) > 64
    want = alone(prompt, 10, 0.0, 0)
    engine = make_engine(slots=2, batch=16, ubatch=16)
    try:
        job = Job(list(prompt), _options(10, 0.0, 0))
        run_until_done(engine, [job])
        assert (tuple(job.generated), job.text, job.stop_reason) == want
    finally:
        engine.model.close()


@pytest.mark.model
def test_a_pass_of_many_ubatches_places_every_sequences_cells():
    """llama.cpp finds every ubatch's cells before a pass (llama_kv_cache::prepare), placing each
    ubatch but the last (patches/llama-kv-prepare.patch) so the next finds other cells. Three
    prompts in one pass split into 9 ubatches (8 tokens a ubatch, across three KV streams), then
    one-token steps, give each sequence the logits and positions it gets decoded alone, its
    prompt in one ubatch."""
    prompt = tokenize(" ".join(WORDS[:24]))
    lengths = (20, 17, 13)

    def load(ubatch):
        opts = LoadOptions(context_length=CTX, slots=3, batch=512, ubatch=ubatch, threads=2)
        return LlamaBackend().load(embedded_default_path(), opts, lambda f: None)

    def steps(m, seqs):
        """The prompts' pass, then 3 steps of one token a sequence: each pass's rows, and each
        sequence's first and last position in its cells."""
        out = [np.array(m.decode([SeqChunk(s, 0, prompt[s : s + lengths[s]], 2) for s in seqs])())]
        for step in range(3):
            out.append(np.array(m.decode([SeqChunk(s, lengths[s] + step, (60 + s + step,), 1) for s in seqs])()))
        return out, [(m.L.llama_memory_seq_pos_min(m.mem, s), m.L.llama_memory_seq_pos_max(m.mem, s)) for s in seqs]

    m = load(8)
    try:
        together, kept = steps(m, (0, 1, 2))
    finally:
        m.close()
    assert kept == [(0, n + 2) for n in lengths]
    m = load(512)
    try:
        for s in range(3):
            alone, kept = steps(m, (s,))
            assert kept == [(0, lengths[s] + 2)]
            np.testing.assert_array_equal(together[0][2 * s : 2 * s + 2], alone[0])
            for t, a in zip(together[1:], alone[1:]):
                np.testing.assert_array_equal(t[s : s + 1], a)
    finally:
        m.close()


@pytest.fixture(scope="module")
def engine4():
    engine = make_engine(slots=4, batch=256)
    yield engine
    engine.model.close()


@pytest.mark.model
def test_max_tokens_and_length_reason(engine4):
    job = Job(list(tokenize("Count: one two three")), _options(5, 0.0, 0))
    run_until_done(engine4, [job])
    assert job.stop_reason == "length" and len(job.generated) == 5
    usage = reply_json(reply_of(Outcome.of(job)))["usage"]
    assert (usage["promptTokens"], usage["completionTokens"]) == (len(job.prompt), 5)


@pytest.mark.model
def test_stop_string_is_never_streamed(engine4):
    prompt = list(tokenize("one two three four five six seven eight nine ten one two three four"))
    free = Job(prompt, _options(20, 0.0, 0))
    run_until_done(engine4, [free])
    assert len(free.text) > 6
    stop = free.text[3:6]
    pieces = []
    job = Job(prompt, GenerateOptions(max_tokens=20, stop=(stop,), sampling=SamplingOptions(temperature=0.0)))
    job.on_piece = lambda text, toks: pieces.append(text)
    run_until_done(engine4, [job])
    assert job.stop_reason == "stop"
    assert job.text == free.text[: free.text.find(stop)]
    assert "".join(pieces) == job.text
    assert stop not in "".join(pieces)


@pytest.mark.model
def test_streamed_text_is_whole_characters(engine4):
    prompt = list(tokenize("Write in Japanese: 東京は日本の首都です。 東京"))
    pieces = []
    job = Job(prompt, _options(24, 0.9, 7))
    job.on_piece = lambda text, toks: pieces.append(text)
    run_until_done(engine4, [job])
    assert "".join(pieces) == job.text
    raw = b"".join(engine4.model.token_bytes(t) for t in job.generated)
    assert job.text == raw.decode("utf-8", "replace")
    for piece in pieces:
        piece.encode("utf-8")  # no lone surrogates / half characters
        assert "\ufffd" not in piece or "\ufffd" in raw.decode("utf-8", "replace")


@pytest.mark.model
def test_end_of_generation_stops(engine4):
    # SmolLM2 ends a chat turn with <|im_end|>: a short answer must stop by itself.
    from kinfer_rpc.host import templates as chat

    info = engine4.model.info
    text = chat.render(
        engine4.template, [{"role": "user", "content": "Say just: hi"}], bos=info.bos_text, eos=info.eos_text
    )
    job = Job(engine4.model.tokenize(text, False, True), _options(200, 0.0, 0))
    run_until_done(engine4, [job])
    assert job.stop_reason == "stop"
    assert len(job.generated) < 200
    assert not set(engine4.model.eog_tokens()) & set(job.generated)


@pytest.mark.model
def test_context_overflow_names_both_numbers(engine4):
    job = Job(list(range(1, CTX + 10)), _options(1, 0.0, 0))
    with pytest.raises(errors.KinferError) as exc:
        engine4.submit(job)
    assert exc.value.code == errors.CONTEXT_OVERFLOW
    assert str(CTX + 9) in exc.value.message and str(CTX) in exc.value.message


@pytest.mark.model
def test_queue_full_is_an_error():
    engine = make_engine(slots=1, batch=64)
    engine.max_queue = 2
    try:
        prompt = list(tokenize("hello"))
        engine.submit(Job(prompt, _options(1, 0.0, 0)))
        engine.submit(Job(prompt, _options(1, 0.0, 0)))
        with pytest.raises(errors.KinferError) as exc:
            engine.submit(Job(prompt, _options(1, 0.0, 0)))
        assert exc.value.code == errors.QUEUE_FULL
    finally:
        engine.model.close()


@pytest.mark.model
def test_cancel_frees_the_slot_at_the_next_step(engine4):
    prompt = list(tokenize("tell me a long story about a fox"))
    jobs = [Job(prompt, _options(300, 0.0, 0)) for _ in range(4)]
    for job in jobs:
        engine4.submit(job)
    for _ in range(3):
        engine4.step()
    assert engine_status(engine4.stats())["slotsBusy"] == 4
    for job in jobs:
        engine4.cancel(job)
    engine4.step()
    status = engine_status(engine4.stats())
    assert status["slotsBusy"] == 0 and status["queueLength"] == 0
    assert all(j.stop_reason == "cancelled" for j in jobs)


@pytest.mark.model
def test_prefix_pool_reuses_a_finished_conversation_and_replies_the_same():
    engine = make_engine(slots=2, batch=64, prefix=100000)
    try:
        system = SHARED[0]
        first = Job(list(tokenize(system + "Name a colour.")), _options(6, 0.0, 0))
        run_until_done(engine, [first])
        second_prompt = tokenize(system + "Name a fruit.")
        second = Job(list(second_prompt), _options(6, 0.0, 0))
        run_until_done(engine, [second])
        assert second.cached > 10  # the system prompt's cells were kept and reused
        assert reply_json(reply_of(Outcome.of(second)))["usage"]["cachedTokens"] == second.cached
        assert engine_status(engine.stats())["prefixHits"] >= 1
        assert (tuple(second.generated), second.text, second.stop_reason) == alone(second_prompt, 6, 0.0, 0)
    finally:
        engine.model.close()


@pytest.mark.model
def test_prefix_pool_copies_a_busy_slots_prefix():
    engine = make_engine(slots=2, batch=512, prefix=0)
    try:
        system = SHARED[1]
        long_job = Job(list(tokenize(system + "explain")), _options(40, 0.0, 0))
        engine.submit(long_job)
        engine.step()
        engine.step()
        prompt = tokenize(system + "comment")
        other = Job(list(prompt), _options(6, 0.0, 0))
        run_until_done(engine, [other])
        assert other.cached >= 8
        assert (tuple(other.generated), other.text, other.stop_reason) == alone(prompt, 6, 0.0, 0)
        engine.cancel(long_job)
        engine.step()
        assert engine_status(engine.stats())["cachedTokens"] == 0  # prefix 0 keeps nothing of finished ones
    finally:
        engine.model.close()


@pytest.mark.model
def test_compaction_moves_the_highest_busy_slot_down():
    engine = make_engine(slots=3, batch=512, prefix=-1)
    try:
        jobs = [Job(list(tokenize(f"story number {i}: once")), _options(n, 0.0, 0)) for i, n in enumerate((2, 30, 30))]
        for job in jobs:
            engine.submit(job)
        while jobs[0].stop_reason is None:
            engine.step()
        # The moved job is last in admission order but first by slot: a pass lists its chunks
        # by slot, so llama.cpp runs both sequences in one pass (passes started ahead after it,
        # by decode_next, repeat its rows).
        passes = []
        decode = engine.model.decode
        engine.model.decode = lambda chunks: passes.append([c.seq for c in chunks]) or decode(chunks)
        engine.step()
        assert sorted(j.slot for j in jobs[1:]) == [0, 1]  # no gap: slot 2 moved into 0
        assert passes == [[0, 1]]
        engine.model.decode = decode
        run_until_done(engine, [])
        while any(j.stop_reason is None for j in jobs):
            engine.step()
        for job in jobs[1:]:
            assert (tuple(job.generated), job.text, job.stop_reason) == alone(tuple(job.prompt), 30, 0.0, 0)
    finally:
        engine.model.close()


@pytest.mark.model
def test_passes_started_ahead_keep_replies_through_cancels_stops_and_moves():
    """A pass started before the last one's tokens are taken (Engine._start_next) feeds each
    job the token it is about to take, so replies are the reference's; a job cancelled or
    stopped by a stop string while such a pass runs loses that row and frees its slot after
    the pass, and the compaction and a newcomer that follow change no reply."""
    engine = make_engine(slots=3, batch=512, prefix=-1)
    try:
        prompts = [tokenize(f"note {i}: the river and the bridge at night") for i in range(4)]
        free = alone(prompts[1], 24, 0.0, 0)
        stop = free[1][4:8]
        jobs = [
            Job(list(prompts[0]), _options(40, 0.0, 0)),
            Job(list(prompts[1]), _options(24, 0.0, 0, stop)),
            Job(list(prompts[2]), _options(30, 0.0, 0)),
        ]
        fed = []  # (token fed, token the job had taken last) for every row of every pass
        decode = engine.model.decode

        def watch(chunks):
            by_slot = {j.slot: j for j in engine._active}
            fed.extend(
                (c.tokens[0], by_slot[c.seq].generated[-1])
                for c in chunks
                if len(c.tokens) == 1 and by_slot[c.seq].generated
            )
            return decode(chunks)

        decode_next = engine.model.decode_next
        nexts = [0]

        def watch_next(tokens):  # a pass started ahead: the last pass's rows, in slot order
            rows = sorted(engine._active, key=lambda j: j.slot)
            assert len(rows) == len(tokens)
            fed.extend((t, j.generated[-1]) for t, j in zip(tokens, rows))
            nexts[0] += 1
            return decode_next(tokens)

        engine.model.decode = watch
        engine.model.decode_next = watch_next
        for job in jobs:
            engine.submit(job)
        for _ in range(30):
            engine.step()
            if engine._running is not None and len(jobs[0].generated) >= 6:
                break
        assert engine._running is not None  # a pass holding jobs[0]'s row is in flight
        engine.cancel(jobs[0])  # while a pass holding its row runs
        engine.step()
        assert jobs[0].stop_reason == "cancelled" and jobs[0] not in engine._active
        late = Job(list(prompts[3]), _options(12, 0.0, 0))
        engine.submit(late)
        while any(j.stop_reason is None for j in (late, *jobs)):
            engine.step()
        assert engine.started_ahead > 20 and nexts[0] == engine.started_ahead  # all by decode_next
        assert any(token != last for token, last in fed)  # fed before being taken
        assert not engine._active
        assert jobs[1].stop_reason == "stop" and stop not in jobs[1].text
        for job, n, stop_at in ((jobs[1], 24, stop), (jobs[2], 30, None), (late, 12, None)):
            assert (tuple(job.generated), job.text, job.stop_reason) == alone(tuple(job.prompt), n, 0.0, 0, stop_at)
    finally:
        engine.model.close()


@pytest.mark.model
def test_no_pass_starts_ahead_where_decode_waits_for_it():
    engine = make_engine(slots=2, start_ahead=None, gpu_layers=0)  # the CPU's llama_decode returns when done
    try:
        jobs = [Job(list(tokenize("count to ten: one two")), _options(8, 0.0, 0)) for _ in range(2)]
        run_until_done(engine, jobs)
        assert engine.started_ahead == 0 and not engine.model.decode_async
    finally:
        engine.model.close()


@pytest.mark.model
def test_a_pass_started_ahead_leaves_room_for_moves_and_newcomers():
    """No pass starts ahead while a slot is still to move (two gaps close in two steps) or while
    a request waits for a free slot (it joins at the next step but one, at the latest)."""
    engine = make_engine(slots=5, batch=512, prefix=-1)
    try:
        prompts = [tokenize(f"note {i}: the river and the bridge at night") for i in range(6)]
        assert len({len(p) for p in prompts}) == 1
        jobs = [Job(list(p), _options(6 if i in (1, 2) else 40, 0.0, 0)) for i, p in enumerate(prompts[:5])]
        for job in jobs:
            engine.submit(job)
        for _ in range(30):
            engine.step()
            if jobs[1].stop_reason is not None:
                break
        assert jobs[2].stop_reason is not None and sorted(j.slot for j in engine._active) == [0, 3, 4]
        engine.step()
        engine.step()
        assert sorted(j.slot for j in engine._active) == [0, 1, 2]  # slot 4 went to 1, then 3 to 2
        assert engine._running is not None
        late = Job(list(prompts[5]), _options(8, 0.0, 0))
        engine.submit(late)
        engine.step()
        engine.step()
        assert late in engine._active
        while any(j.stop_reason is None for j in (late, *jobs)):
            engine.step()
        for job in (late, *jobs):
            assert (tuple(job.generated), job.text, job.stop_reason) == alone(
                tuple(job.prompt), job.options.max_tokens, 0.0, 0
            )
    finally:
        engine.model.close()


@pytest.mark.model
def test_decode_next_is_the_last_pass_one_token_further():
    """decode_next(tokens) gives the logits decode() gives for the same rows one position on,
    and refuses where the last pass was not one token a row or cells moved since."""
    m = LlamaBackend().load(
        embedded_default_path(), LoadOptions(context_length=CTX, slots=3, threads=2), lambda f: None
    )
    try:
        prompt = tokenize(" ".join(WORDS[:12]))

        def start():
            for s in range(3):
                m.seq_remove(s)
            m.decode([SeqChunk(s, 0, prompt[: 6 + s], 1) for s in range(3)])()
            with pytest.raises(ValueError):  # a pass of prompts is not one token a row
                m.decode_next([5, 6, 7])
            return np.array(m.decode([SeqChunk(s, 6 + s, (100 + s,), 1) for s in range(3)])())

        start()
        tokens = [200, 300, 400]
        ref = np.array(m.decode([SeqChunk(s, 7 + s, (tokens[s],), 1) for s in range(3)])())
        ref2 = np.array(m.decode([SeqChunk(s, 8 + s, (tokens[s] + 1,), 1) for s in range(3)])())
        start()
        np.testing.assert_array_equal(np.array(m.decode_next(tokens)()), ref)
        np.testing.assert_array_equal(np.array(m.decode_next([t + 1 for t in tokens])()), ref2)
        with pytest.raises(ValueError):
            m.decode_next([1, 2])  # not one token a row
        m.seq_remove(2, 9)
        with pytest.raises(ValueError):
            m.decode_next([1, 2, 3])  # cells moved since
    finally:
        m.close()


def _patched_llama() -> bool:
    """Whether the loaded libllama has kinfer's argmax patch (patches/build_llama.sh)."""
    from kinfer_rpc.default_plugins.llama import library

    library.load()
    return library.output_argmax()[0] is not None


def test_the_patched_llama_is_loaded_where_it_was_built():
    """The README's test command builds it into .llama/lib; the tests then run on it (conftest),
    unless LLAMA_CPP_LIB_PATH names another library."""
    if not os.environ.get("KINFER_TESTS_ON_PATCHED_LLAMA"):
        pytest.skip("not built here (bash patches/build_llama.sh), or LLAMA_CPP_LIB_PATH names another library")
    assert os.environ["LLAMA_CPP_LIB_PATH"] == os.path.join(ROOT, ".llama", "lib") and _patched_llama()


needs_patch = pytest.mark.skipif(
    "not _patched_llama()", reason="needs kinfer's patched llama.cpp: bash patches/build_llama.sh"
)


@pytest.mark.model
@needs_patch
def test_argmax_in_the_pass_is_the_host_argmax_and_leaves_other_rows_alone():
    """patches/llama-output-argmax.patch: a pass ends in one argmax over its output rows. A greedy
    sequence's rows get it (several rows too: drafts), and it is the host's argmax of the same
    logits; other rows keep their logits. A pass of only greedy rows copies back no logits, and
    turning greedy off brings them back (with no greedy sequence the graph has no argmax)."""
    m = LlamaBackend().load(
        embedded_default_path(), LoadOptions(context_length=CTX, slots=4, threads=2), lambda f: None
    )
    try:
        prompt = tokenize(" ".join(WORDS[:20]))
        chunks = [
            SeqChunk(0, 0, prompt[:10], 3),
            SeqChunk(1, 0, prompt[:8], 1),
            SeqChunk(2, 0, prompt[:12], 1),
            SeqChunk(3, 0, prompt[:7], 2),
        ]

        def run():
            for s in range(4):
                m.seq_remove(s)
            return np.array(m.decode(chunks)()), m.sampled_tokens()

        ref, none = run()
        assert none == [-1] * 7
        host = ref.argmax(axis=1).tolist()
        assert m.device_greedy and m.set_device_greedy(0, True) and m.set_device_greedy(2, True)
        logits, got = run()
        assert got == host[:3] + [-1, host[4], -1, -1]
        np.testing.assert_array_equal(logits, ref)  # rows of other sequences need their logits
        for s in (1, 3):
            m.set_device_greedy(s, True)
        logits, got = run()
        assert got == host and m._argmax_mode == 2  # only token ids came back
        for s in range(4):
            m.set_device_greedy(s, False)
        logits, got = run()
        assert got == [-1] * 7 and m._argmax_mode == 0  # no greedy sequence: no argmax in the graph
        np.testing.assert_array_equal(logits, ref)
        assert m.set_device_greedy(0, True)  # and back
        logits, got = run()
        assert got == host[:3] + [-1] * 4
        np.testing.assert_array_equal(logits, ref)
    finally:
        m.close()


@pytest.mark.model
@needs_patch
def test_greedy_replies_take_their_argmax_in_the_pass():
    """A greedy request's rows (a drafting one's too) get their argmax in the pass; a seeded
    one's logits still come back. Replies are the host-argmax reference's."""
    engine = make_engine(slots=3, start_ahead=False)
    model = engine.model
    sampled = model.sampled_tokens
    from_pass = []

    def watch():
        tokens = sampled()
        from_pass.extend(t for t in tokens if t >= 0)
        return tokens

    model.sampled_tokens = watch
    try:
        prompts = [tokenize(f"note {i}: the river and the bridge at night") for i in range(3)]
        drafting = attrs.evolve(_options(16, 0.0, 0), drafts=1, draft_policy=RepeatLast())
        jobs = [
            Job(list(prompts[0]), _options(16, 0.0, 0)),
            Job(list(prompts[1]), _options(16, 0.7, 5)),
            Job(list(prompts[2]), drafting),
        ]
        run_until_done(engine, jobs)
        assert jobs[2].drafted > 0
        assert len(from_pass) >= len(jobs[0].generated) + len(jobs[2].generated)
        for job, t, seed in ((jobs[0], 0.0, 0), (jobs[1], 0.7, 5), (jobs[2], 0.0, 0)):
            assert (tuple(job.generated), job.text, job.stop_reason) == alone(tuple(job.prompt), 16, t, seed)
        # A seeded request taking a greedy slot turns its argmax in the pass off.
        late = Job(list(prompts[0]), _options(8, 0.7, 1))
        run_until_done(engine, [late])
        assert late.slot not in model._greedy
        assert (tuple(late.generated), late.text, late.stop_reason) == alone(tuple(late.prompt), 8, 0.7, 1)
    finally:
        engine.model.close()


# -- slots shared fairly between connections (Engine._next_waiting) --------------------------------
def _owned(owner: int, prompt: tuple, max_tokens: int) -> Job:
    return Job(list(prompt), _options(max_tokens, 0.0, 1), owner=owner)


def test_a_flooding_connection_leaves_a_slot_for_another():
    engine = make_engine(slots=4)
    try:
        engine.share = True  # more than one connection is open
        prompt = tokenize("The quick brown fox")
        flood = [_owned(1, prompt, 200) for _ in range(10)]
        for job in flood:
            engine.submit(job)
        engine.step()
        assert sum(j.state is not JobState.WAITING for j in flood) == 3  # one slot stays free
        editor = _owned(2, tokenize("def add(a, b):"), 4)
        engine.submit(editor)
        engine.step()
        assert editor.state is not JobState.WAITING  # in at the next step, not behind the flood
        while editor.state is not JobState.DONE:
            engine.step()
        assert tuple(editor.generated) == alone(tokenize("def add(a, b):"), 4, 0.0, 1)[0]  # the same reply
        for job in flood:
            engine.cancel(job)
        while engine.step():
            pass
    finally:
        engine.stop()


def test_owners_take_turns_and_one_client_alone_uses_every_slot():
    engine = make_engine(slots=4)
    try:
        prompt = tokenize("Once upon a time")
        lone = [_owned(1, prompt, 2) for _ in range(6)]
        for job in lone:
            engine.submit(job)
        engine.step()
        assert sum(j.state is not JobState.WAITING for j in lone) == 4  # share off: every slot
        while any(j.state is not JobState.DONE for j in lone):
            engine.step()
        engine.share = True
        first = [_owned(1, prompt, 50) for _ in range(4)]
        second = [_owned(2, prompt, 50) for _ in range(4)]
        for job in first + second:  # owner 1's four arrive before owner 2's
            engine.submit(job)
        engine.step()
        taken = [j.owner for j in first + second if j.state is not JobState.WAITING]
        assert sorted(taken) == [1, 1, 2, 2]  # turns: two each, not owner 1's four
        for job in first + second:
            engine.cancel(job)
        while engine.step():
            pass
    finally:
        engine.stop()


def test_rows_are_rationed_between_owners_on_the_cpu_and_replies_stay_the_same():
    engine = make_engine(slots=4, start_ahead=False)  # passes computed in the call, as on a CPU
    try:
        engine.share = True
        prompts = [tokenize(f"Story {i}: once upon a time") for i in range(3)]
        flood = [_owned(1, p, 12) for p in prompts]
        editor = _owned(2, tokenize("def add(a, b):"), 12)
        rows_per_pass: list[dict[int, int]] = []
        decode = engine.model.decode

        def counted(chunks):
            mine: dict[int, int] = {}
            for c in chunks:
                if len(c.tokens) == 1:  # a reply's row (the prompts' chunks are longer)
                    owner = next(j.owner for j in flood + [editor] if j.slot == c.seq)
                    mine[owner] = mine.get(owner, 0) + 1
            rows_per_pass.append(mine)
            return decode(chunks)

        engine.model.decode = counted
        run_until_done(engine, flood + [editor])
        shared = [m for m in rows_per_pass if len(m) == 2]
        assert shared and all(m[1] == 1 for m in shared)  # no more rows than the editor's one
        for job, prompt in zip(flood, prompts):
            assert tuple(job.generated) == alone(prompt, 12, 0.0, 1)[0]  # left out of passes, same reply
        assert tuple(editor.generated) == alone(tokenize("def add(a, b):"), 12, 0.0, 1)[0]
    finally:
        engine.stop()


def test_a_light_connection_reads_its_prompt_alone_on_the_cpu_and_replies_stay_the_same():
    engine = make_engine(slots=4, start_ahead=False)  # passes computed in the call, as on a CPU
    try:
        engine.share = True
        prompts = [tokenize(f"Story {i}: once upon a time") for i in range(3)]
        flood = [_owned(1, p, 12) for p in prompts]
        editor = _owned(2, tokenize("def add(a, b):"), 6)
        passes: list[list[tuple[int, int]]] = []  # (owner, tokens) of each chunk
        decode = engine.model.decode

        def counted(chunks):
            jobs = flood + [editor]
            passes.append([(next(j.owner for j in jobs if j.slot == c.seq), len(c.tokens)) for c in chunks])
            return decode(chunks)

        engine.model.decode = counted
        for job in flood:
            engine.submit(job)
        for _ in range(3):  # the flood reads its prompts and decodes
            engine.step()
        assert all(job.state is JobState.GENERATING for job in flood)
        engine.submit(editor)
        while engine.step():
            pass
        editor_prompt = [p for p in passes if (2, len(editor.prompt)) in p]
        assert editor_prompt and all(owner == 2 for p in editor_prompt for owner, _ in p)  # alone
        assert any(len({owner for owner, _ in p}) == 2 for p in passes)  # then shared again
        for job, prompt in zip(flood, prompts):
            assert tuple(job.generated) == alone(prompt, 12, 0.0, 1)[0]  # waited a pass, same reply
        assert tuple(editor.generated) == alone(tokenize("def add(a, b):"), 6, 0.0, 1)[0]
    finally:
        engine.stop()
