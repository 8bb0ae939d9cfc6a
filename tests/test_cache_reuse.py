"""Reusing cached chunks that moved (`options.cacheReuse`, llama.cpp's `--cache-reuse`): the plan,
the prefix pool's bookkeeping of which cells are exact, and the promise.

A request that asks for reuse may get shifted cells, whose numbers differ from computing them in
place; a request that did not ask never gets them, so its reply is the same whatever ran before."""

from __future__ import annotations

import attrs
import pytest
from engine_helpers import _options, alone, make_engine, run_until_done, tokenize
from make_fim_model import make_fim_model
from protocol_fixtures import server, spawn  # noqa: F401
from rpcclient import RpcError

from kinfer_rpc.engine.job import GenerateOptions, Job
from kinfer_rpc.engine.slots import Slots, reuse_plan
from kinfer_rpc.types import Media, common_prefix


# -- the plan -------------------------------------------------------------------------------------
def test_a_chunk_after_text_left_out_moves_to_the_shared_prefix():
    kept = [1, 2, 3, 90, 91, 4, 5, 6, 7, 8, 9]
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert reuse_plan(kept, prompt, 3, len(prompt) - 1, 4) == [(5, 3, 6)]
    assert reuse_plan(kept, prompt, 3, len(prompt) - 1, 7) == []  # shorter than asked
    assert reuse_plan(kept, prompt, 3, len(prompt) - 1, 0) == []  # 0: never
    # the last prompt token is never reused (it gives the logits)
    assert reuse_plan(kept, [1, 2, 3, 4, 5, 6, 7, 8, 9], 3, 8, 4) == [(5, 3, 5)]


def test_chunks_come_in_order_and_text_inserted_before_one_is_not_reused():
    kept = [0, 50, 1, 2, 3, 51, 52, 4, 5, 6, 7]
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 99]
    assert reuse_plan(kept, prompt, 1, len(prompt) - 1, 3) == [(2, 1, 3), (7, 4, 4)]
    # something new before the chunk: the prompt's cells must run on without a gap
    assert reuse_plan(kept, [0, 77, 1, 2, 3, 4, 5, 6, 7, 99], 1, 9, 3) == []


# -- the pool's bookkeeping, on a model that records what is done to its cells -------------------
@attrs.define
class Cells:
    """A stand-in model: which token each cell of each sequence holds, and whether it is exact."""

    info: object = None
    seqs: dict[int, dict[int, tuple[int, bool]]] = attrs.field(factory=dict)

    def can_shift(self) -> bool:
        return True

    def seq_remove(self, seq, start=0, end=-1):
        cells = self.seqs.setdefault(seq, {})
        for pos in [p for p in cells if p >= start and (end < 0 or p < end)]:
            del cells[pos]

    def seq_copy(self, src, dst, start=0, end=-1):
        self.seqs[dst] = dict(self.seqs.get(src, {}))

    def seq_shift(self, seq, start, end, delta):
        cells = self.seqs[seq]
        moved = {p + delta: (t, False) for p, (t, _) in cells.items() if start <= p < end}
        for p in [p for p in cells if start <= p < end]:
            del cells[p]
        assert not set(moved) & set(cells), "a shift onto cells in use"
        cells.update(moved)

    def fill(self, job):
        """What decoding the rest of the job's prompt does: cells after its n_past (exact only
        when every cell before them is)."""
        cells = self.seqs.setdefault(job.slot, {})
        exact = all(cells[p][1] for p in range(job.n_past))
        for p in range(job.n_past, len(job.prompt)):
            cells[p] = (job.prompt[p], exact)
        job.n_past = len(job.prompt)


def run(slots, model, prompt, reuse):
    job = Job(list(prompt), GenerateOptions(cache_reuse=reuse))
    slots.take(job, [])
    cells = model.seqs.get(job.slot, {})
    assert sorted(cells) == list(range(job.n_past)), "the cells run on without a gap"
    assert [cells[p][0] for p in range(job.n_past)] == prompt[: job.n_past], "each cell holds its token"
    used_exact = all(cells[p][1] for p in range(job.n_past))
    model.fill(job)
    slots.give_back(job, [])
    return job, used_exact


def test_a_request_that_did_not_ask_never_gets_shifted_cells():
    model = Cells()
    slots = Slots(model, 1, 10_000)
    base = list(range(100, 160))
    run(slots, model, base, 0)
    moved, exact = run(slots, model, base[:5] + base[20:] + [7], 8)  # 15 tokens left out: shifted
    assert moved.cached == 5 + 40 and not exact
    assert slots.exact == {0: 5}
    # the same prompt again, without asking: only the 5 exact cells
    again, exact = run(slots, model, base[:5] + base[20:] + [7], 0)
    assert again.cached == 5 and exact
    assert slots.exact == {}  # recomputed from there on: every cell exact again
    # asking again: everything the pool has (the last prompt token is always computed)
    third, _ = run(slots, model, base[:5] + base[20:] + [7], 8)
    assert third.cached == len(third.prompt) - 1


def test_a_request_that_asked_may_build_on_shifted_cells_and_the_pool_remembers():
    model = Cells()
    slots = Slots(model, 1, 10_000)
    base = list(range(100, 160))
    run(slots, model, base, 0)
    run(slots, model, base[:5] + base[20:], 8)
    # the next one extends that history: its common prefix runs past the exact cells
    longer, exact = run(slots, model, base[:5] + base[20:] + [1, 2, 3], 8)
    assert longer.cached == len(base[:5] + base[20:]) and not exact
    assert slots.exact == {0: 5}
    plain, exact = run(slots, model, base[:5] + base[20:] + [1, 2, 3], 0)
    assert plain.cached == 5 and exact


def test_a_request_that_did_not_ask_shares_only_exact_cells_of_a_running_one():
    model = Cells()
    slots = Slots(model, 3, 10_000)
    base = list(range(100, 160))
    run(slots, model, base, 0)
    running = Job(base[:5] + base[20:] + [7], GenerateOptions(cache_reuse=8))
    slots.take(running, [])
    assert running.cached == 45
    model.fill(running)  # still running: its cells are shared by copy, not kept
    plain = Job(base[:5] + base[20:] + [7, 8], GenerateOptions())
    slots.take(plain, [running])
    assert plain.slot != running.slot and plain.cached == 0  # 5 exact cells: under MIN_SHARED
    asking = Job(base[:5] + base[20:] + [7, 8], GenerateOptions(cache_reuse=8))
    slots.take(asking, [running])
    assert asking.cached == len(running.prompt)
    assert slots.exact[asking.slot] == 5


# -- on the model ---------------------------------------------------------------------------------
@pytest.mark.model
def test_reuse_on_the_model_and_the_promise_for_requests_that_did_not_ask():
    engine = make_engine(slots=1, batch=64, prefix=100_000)
    try:
        lines = [f"value_{i} = compute({i}, {i * 3})\n" for i in range(30)]
        first = list(tokenize("".join(lines) + "result ="))
        run_until_done(engine, [Job(list(first), _options(4, 0.0, 0))])
        # lines 1-4 left out, as a prefix window that moved: the rest is a chunk that moved
        head, left_out = len(tokenize(lines[0])), len(tokenize("".join(lines[:5])))
        assert first[:left_out] == list(tokenize("".join(lines[:5])))
        prompt = first[:head] + first[left_out:]
        reused = Job(list(prompt), attrs.evolve(_options(4, 0.0, 0), cache_reuse=16))
        run_until_done(engine, [reused])
        assert reused.cached >= len(prompt) - 2, (reused.cached, len(prompt))
        assert reused.generated  # a reply, from shifted cells: not promised to be the alone one
        # a request that did not ask reads its prompt again, and replies as alone
        plain = Job(list(prompt), _options(4, 0.0, 0))
        run_until_done(engine, [plain])
        assert plain.cached == common_prefix(first, prompt) < 20  # the exact cells only
        assert (tuple(plain.generated), plain.text, plain.stop_reason) == alone(tuple(prompt), 4, 0.0, 0)
    finally:
        engine.model.close()


# -- through the protocol -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fim_path(tmp_path_factory):
    return make_fim_model(tmp_path_factory.mktemp("fim") / "fim.gguf")


@pytest.mark.model
def test_a_prefix_window_that_moves_is_not_read_again_with_cache_reuse(spawn, fim_path):
    """Lines typed above the cursor's line: the prefix's kept window moves now and then. Without
    reuse that keystroke reads the whole prefix again; with it, the part of the prefix still kept
    moves into place and only the new lines are read."""
    c = spawn()
    c.initialize()
    c.call("model/load", {"model": fim_path, "options": {"contextLength": 512, "slots": 1, "batch": 128}})
    lines = "".join(f"x{i} = {i}\n" for i in range(60))

    def complete(n, reuse):
        prefix = lines + "".join(f"y{i} = {i}\n" for i in range(n))
        opts = {"temperature": 0, "maxTokens": 4, "cacheReuse": reuse}
        return c.call("inference/infill", {"prefix": prefix, "middle": "z = ", "suffix": "\n", "options": opts})

    worst, replies = {}, {}
    for reuse in (0, 8):
        reads, moves = [], set()
        for n in range(40):
            r = complete(n, reuse)
            assert r["stopReason"] in ("stop", "length") and r["usage"]["completionTokens"] == len(r["tokens"])
            replies[reuse, n] = r["tokens"]
            moves.add(r["dropped"]["prefix"])
            reads.append(r["usage"]["promptTokens"] - r["usage"]["cachedTokens"])
        assert len(moves) > 2, "the window moved"
        worst[reuse] = max(reads[1:])
    assert worst[0] > 60 and worst[8] < 20, worst
    # the promise for requests that did not ask: after the shifted runs, each reply is again the
    # one the same request got before any cell was shifted (the pool now holds shifted cells)
    for n in (39, 38, 20, 0):
        assert complete(n, 0)["tokens"] == replies[0, n], n


@pytest.mark.model
def test_cache_reuse_is_refused_where_cells_cannot_move(spawn, fim_path):
    c = spawn()
    c.initialize()
    c.call("model/load", {"model": fim_path, "options": {"contextLength": 512, "slots": 1, "prefix": -1}})
    with pytest.raises(RpcError) as e:
        c.call("inference/infill", {"prefix": "x = ", "options": {"cacheReuse": 64}})
    assert e.value.code == -32602 and "cacheReuse" in e.value.message and "prefix -1" in e.value.message
    for bad in (-1, "64", True):
        with pytest.raises(RpcError) as e:
            c.call("inference/infill", {"prefix": "x = ", "options": {"cacheReuse": bad}})
        assert e.value.code == -32602 and "cacheReuse" in e.value.message
    assert c.call("inference/infill", {"prefix": "x = ", "options": {"cacheReuse": 0, "maxTokens": 1}})["tokens"]


def test_the_pool_shares_and_keeps_only_the_cells_before_an_image():
    """An image's positions hold placeholders in the prompt's tokens: the pool never shares
    them (the same placeholders stand for any image), nor keeps what comes after them."""
    model = Cells()
    slots = Slots(model, 2, 10_000)
    base = list(range(100, 160))

    def image_job(start: int) -> Job:
        return Job(list(base), GenerateOptions(), media=(Media(start, 16, "an image's hash"),))

    job = image_job(10)
    slots.take(job, [])
    assert job.n_past == 0
    model.fill(job)
    slots.give_back(job, [])
    assert slots.kept[job.slot] == base[:10] and sorted(model.seqs[job.slot]) == list(range(10))
    again = image_job(10)  # the same tokens: only those before the image come from the pool
    slots.take(again, [])
    assert again.cached == 10
    model.fill(again)
    # a running job's cells are shared up to its first image too
    other = Job(list(base), GenerateOptions())
    slots.take(other, [again])
    assert other.cached <= 10
    slots.give_back(again, [other])
    # a prompt that begins with an image shares nothing; the slot it takes leaves the pool
    first = image_job(0)
    slots.take(first, [other])
    assert first.n_past == 0 and first.slot not in slots.kept and first.slot not in slots.free
    slots._trim()  # the pool's trimming never touches a busy slot's cells
    assert first.slot not in slots.kept
