"""Sampling and text streaming, without a model."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kinfer_rpc.engine.sampling import SamplingOptions, sample, sample_many, top, uniform
from kinfer_rpc.engine.text import TextStream


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, 2.0, -1.0], dtype=np.float32)
    assert sample(logits, [], 5, SamplingOptions(temperature=0.0)) == 1


def test_repeat_penalty_changes_greedy_choice():
    logits = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    opts = SamplingOptions(temperature=0.0, repeat_penalty=1.5)
    assert sample(logits, [0], 1, opts) == 1


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**63 - 1), st.integers(0, 100000))
def test_draw_depends_only_on_seed_and_position(seed, pos):
    assert uniform(seed, pos) == uniform(seed, pos)
    assert 0.0 <= uniform(seed, pos) < 1.0


def test_seeded_sampling_is_a_pure_function():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=1000).astype(np.float32)
    opts = SamplingOptions(temperature=1.0, top_k=50, top_p=0.9, min_p=0.0, seed=123)
    picks = [sample(logits, [], p, opts) for p in range(200)]
    assert picks == [sample(logits, [], p, opts) for p in range(200)]
    assert len(set(picks)) > 5  # it really samples
    top = set(np.argsort(-logits)[:50])
    assert set(picks) <= top


def test_min_p_keeps_only_likely_tokens():
    logits = np.array([10.0, 9.9, 0.0, -5.0], dtype=np.float32)
    opts = SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5, seed=9)
    assert {sample(logits, [], p, opts) for p in range(100)} == {0, 1}


def test_stream_holds_back_possible_stop_prefix():
    s = TextStream(("STOP",))
    assert s.push(b"hello S") == "hello "
    assert s.push(b"T") == ""
    assert s.push(b"x") == "STx"
    assert s.push(b" STO") == " "
    assert s.push(b"P and more") == ""
    assert s.stopped and s.text == "hello STx "


def test_stream_never_splits_a_character():
    s = TextStream()
    data = "é東".encode()
    out = [s.push(data[i : i + 1]) for i in range(len(data))]
    assert out == ["", "é", "", "", "東"]
    assert s.finish() == ""


@settings(max_examples=100, deadline=None)
@given(
    st.text(min_size=0, max_size=40),
    st.lists(st.integers(1, 5), min_size=1, max_size=20),
    st.text(min_size=1, max_size=4),
)
def test_stream_pieces_concatenate_to_text_before_stop(text, cuts, stop):
    data = text.encode()
    s = TextStream((stop,))
    pieces, i, k = [], 0, 0
    while i < len(data) and not s.stopped:
        n = cuts[k % len(cuts)]
        pieces.append(s.push(data[i : i + n]))
        i, k = i + n, k + 1
    pieces.append(s.finish())
    joined = "".join(pieces)
    expected = text[: text.find(stop)] if stop in text else text
    assert joined == expected


def mask_words(keep: np.ndarray) -> np.ndarray:
    """A boolean mask as llguidance's bitmask row: int32 words, bit i of the row = token i."""
    return np.packbits(np.concatenate([keep, np.zeros(-len(keep) % 32, bool)]), bitorder="little").view(np.int32)


@settings(max_examples=300, deadline=None)
@given(
    allowed_bits=st.lists(st.booleans(), min_size=1, max_size=300),
    density=st.sampled_from([0.0, 0.02, 0.3, 0.6, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_a_masks_allowed_ids_and_count_are_its_set_bits(allowed_bits, density, seed):
    """Both ways of listing the allowed ids (a few non-zero words, or many) give the set bits in
    order, and the count and sparse_ids agree with them."""
    from kinfer_rpc.engine import grammar

    keep = np.array(allowed_bits, dtype=bool)
    keep &= np.random.default_rng(seed).random(len(keep)) < density  # sparse masks as well as open ones
    bits = mask_words(keep)
    want = np.flatnonzero(keep)
    assert grammar.allowed_ids(bits, len(keep)).tolist() == want.tolist()
    assert grammar.allowed_count(bits) == len(want)
    popcount, grammar._bitwise_count = grammar._bitwise_count, None  # numpy 1's way
    try:
        assert grammar.allowed_count(bits) == len(want)
    finally:
        grammar._bitwise_count = popcount
    ids = grammar.sparse_ids(bits, len(keep))
    assert (ids is None) == (len(want) * 2 > len(keep))
    assert ids is None or ids.tolist() == want.tolist()


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, float("-inf")]), min_size=1, max_size=70),
    allowed_bits=st.lists(st.booleans(), min_size=70, max_size=70),
)
def test_the_greedy_token_under_a_mask_is_the_masked_rows_argmax(values, allowed_bits):
    from kinfer_rpc.engine import grammar

    row = np.array(values, dtype=np.float32)
    keep = np.array(allowed_bits[: len(row)], dtype=bool)
    bits = mask_words(keep)
    got = grammar.best_allowed(row, bits)
    if np.isfinite(row[keep]).any():
        assert got == sample(grammar.masked(row, keep), [], 0, SamplingOptions(temperature=0.0))
    elif keep.any():  # every allowed token at -inf: still an allowed one
        assert keep[got]


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, 2.0, float("-inf")]), min_size=1, max_size=400),
    forbidden=st.sets(st.integers(0, 399), max_size=12),
    top_forbidden=st.integers(0, 6),
)
def test_the_greedy_token_under_a_mostly_open_mask_is_the_masked_rows_argmax(values, forbidden, top_forbidden):
    """A mask that allows nearly everything (inside a JSON string), with the row's best tokens
    among the forbidden ones: the tries of the next best tokens give the masked row's argmax."""
    from kinfer_rpc.engine import grammar

    row = np.array(values, dtype=np.float32)
    keep = np.ones(len(row), dtype=bool)
    keep[[i for i in forbidden if i < len(row)]] = False
    keep[np.argsort(-row, kind="stable")[:top_forbidden]] = False  # the best ones forbidden
    bits = mask_words(keep)
    got = grammar.best_allowed(row, bits)
    if np.isfinite(row[keep]).any():
        assert got == sample(grammar.masked(row, keep), [], 0, SamplingOptions(temperature=0.0))
    elif keep.any():
        assert keep[got]


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.lists(st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0, 2.0, float("-inf")]), min_size=96, max_size=96),
            st.lists(st.booleans(), min_size=96, max_size=96),
            st.sampled_from(["as drawn", "sparse", "open", "nan"]),
        ),
        min_size=1,
        max_size=8,
    ),
    held=st.data(),
)
def test_a_pass_of_held_rows_gets_each_rows_own_greedy_choice(data, held):
    """Masks.choose over a pass (the own best tokens from one argmax, a sparse mask's allowed ids
    listed beforehand as the engine lists them while the pass runs) gives every held row the
    token best_allowed gives it alone, NaNs included."""
    from kinfer_rpc.engine import grammar

    logits = np.array([values for values, _, _ in data], dtype=np.float32)
    rows = sorted(held.draw(st.sets(st.integers(0, len(data) - 1), min_size=1)))
    picks = []
    for r in rows:
        _, allowed_bits, kind = data[r]
        keep = np.array(allowed_bits, dtype=bool)
        if kind == "sparse":
            keep[3:] = False
        elif kind == "open":  # everything but the row's best token
            keep[:] = True
            keep[int(logits[r].argmax())] = False
        elif kind == "nan":
            logits[r, 7] = np.nan
        bits = mask_words(keep)
        picks.append((r, bits, grammar.sparse_ids(bits, logits.shape[1])))
    got = grammar.Masks(logits.shape[1]).choose(logits, picks)
    assert got == [grammar.best_allowed(logits[r], bits) for r, bits, _ in picks]
    # With some rows' best tokens known (taken on the device: any of the largest values, NaNs
    # skipped), each row gets what best_allowed gives it with that token.
    known = []
    for r, _, _ in picks:
        top = np.flatnonzero(logits[r] == np.nanmax(logits[r])) if not np.isnan(logits[r]).all() else []
        known.append(int(held.draw(st.sampled_from(list(top)))) if len(top) and held.draw(st.booleans()) else -1)
    got = grammar.Masks(logits.shape[1]).choose(logits, picks, known)
    assert got == [
        grammar.best_allowed(logits[r], bits, ids=ids, best=k if k >= 0 else None)
        for (r, bits, ids), k in zip(picks, known)
    ]


# -- many rows at once (sample_many): the same token as alone -----------------------------------------
options_ = st.builds(
    SamplingOptions,
    temperature=st.sampled_from([0.0, 0.2, 0.8, 1.5]),
    top_k=st.sampled_from([0, 1, 5, 40]),
    top_p=st.sampled_from([0.5, 0.95, 1.0]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    repeat_penalty=st.sampled_from([1.0, 1.3]),
    seed=st.integers(0, 2**53 - 1),
)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.sampled_from([7, 300, 5000]), same=st.booleans())
def test_rows_sampled_together_get_the_token_each_gets_alone(data, n, same):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    count = data.draw(st.integers(1, 9))
    rows = (rng.standard_normal((count, n)) * rng.uniform(0.3, 8)).astype(np.float32)
    if data.draw(st.booleans()):
        rows[rng.random(rows.shape) < 0.9] = -np.inf  # held to a grammar
    if data.draw(st.booleans()):
        rows = np.round(rows)  # many ties
    opts = [data.draw(options_)] * count if same else [data.draw(options_) for _ in range(count)]
    histories = [list(rng.integers(0, n, 8)) for _ in range(count)]
    positions = [int(p) for p in rng.integers(0, 4096, count)]
    together = sample_many(list(rows), histories, positions, opts)
    assert together == [sample(rows[i], histories[i], positions[i], opts[i]) for i in range(count)]
    assert all(0 <= t < n for t in together)


def test_the_draw_follows_the_distribution():
    row = np.log(np.array([1.0, 2.0, 3.0], dtype=np.float32))
    opts = [SamplingOptions(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s) for s in range(12000)]
    picks = np.bincount(sample_many([row] * 12000, [[]] * 12000, [5] * 12000, opts), minlength=3) / 12000
    assert np.allclose(picks, [1 / 6, 2 / 6, 3 / 6], atol=0.02)


def test_the_top_k_keeps_the_lowest_ids_among_ties():
    row = np.array([1.0, 3.0, 3.0, 3.0, 2.0] * 200, dtype=np.float32)  # long enough for the sampled cut
    ids, vals = top(row, 2)
    assert list(ids) == [1, 2] and list(vals) == [3.0, 3.0]
