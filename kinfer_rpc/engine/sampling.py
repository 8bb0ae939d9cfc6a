"""Per-request sampling.

Every random draw comes from a stream keyed by (seed, position of the token being sampled), so
a seeded reply depends on nothing but its own logits: not on its neighbours, not on how many
steps it waited, not on whether drafts were checked in the same pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np


@attrs.frozen
class SamplingOptions:
    """Sampling settings of one request. temperature <= 0 means greedy (argmax)."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = 0


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of 64-bit words that scatters every input bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """The one uniform draw in [0, 1) for each (seed, position): a keyed hash of the two, so a
    draw depends on nothing else and any number of them cost one vectorized call."""
    with np.errstate(over="ignore"):
        seed = np.array([s & 0xFFFFFFFFFFFFFFFF for s in seeds], dtype=np.uint64)
        pos = np.array(positions, dtype=np.uint64)
        key = _mix(seed + np.uint64(0x9E3779B97F4A7C15))
        word = _mix(key ^ (pos * np.uint64(0xD1B54A32D192ED03)))
    return (word >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def uniform(seed: int, position: int) -> float:
    """The one uniform draw in [0, 1) for the token at `position` of a request seeded `seed`."""
    return float(uniforms([seed], [position])[0])


def _penalise(logits: np.ndarray, history: Sequence[int], opts: SamplingOptions) -> np.ndarray:
    if opts.repeat_penalty == 1.0 or opts.repeat_last_n == 0 or not len(history):
        return logits
    recent = np.unique(np.asarray(history[-opts.repeat_last_n :] if opts.repeat_last_n > 0 else history))
    logits = logits.astype(np.float64)  # a copy, in a type where the penalty can't overflow
    vals = logits[recent]
    big = np.finfo(np.float64).max  # a penalty near 0 divides a logit past it
    with np.errstate(over="ignore"):
        raised = np.minimum(vals / opts.repeat_penalty, big)
    logits[recent] = np.where(vals > 0, raised, vals * opts.repeat_penalty)
    return logits


_STRIDE = 16  # top()'s sample: every 16th logit


def sample(logits: np.ndarray, history: Sequence[int], position: int, opts: SamplingOptions) -> int:
    """Pick the token at `position` from one row of logits (sample_many of one row).

    `history` is the request's tokens so far (prompt and reply), used by the repeat penalty.
    """
    return sample_many([logits], [history], [position], [opts])[0]


def sample_many(
    rows: Sequence[np.ndarray],
    histories: Sequence[Sequence[int]],
    positions: Sequence[int],
    opts: Sequence[SamplingOptions],
) -> list[int]:
    """Pick each row's token, each from its own logits, history, position and options.

    Order as llama.cpp's default chain: penalties, top-k, temperature, top-p, min-p, draw. Each
    row's candidates are its own (top); rows with the same temperature and cuts then go through
    the cuts and the draw together, in one vectorized pass, by the very code that samples a row
    alone: every step of it is a row's own (elementwise, or a sequential sum along the row), so a
    row's token is the same however many rows are sampled with it.
    """
    out = [-1] * len(rows)
    groups: dict[tuple[float, int, float, float], list[int]] = {}
    penalised: dict[int, np.ndarray] = {}
    for i, (row, history, o) in enumerate(zip(rows, histories, opts)):
        row = penalised[i] = _penalise(row, history, o)
        finite = np.isfinite(row).any()
        if o.temperature <= 0 or not finite:
            out[i] = int(np.nanargmax(row)) if finite else int(np.argmax(row))
            continue
        n = row.shape[0]
        k = o.top_k if 0 < o.top_k < n else n
        groups.setdefault((o.temperature, k, o.top_p, o.min_p), []).append(i)
    for (temperature, k, top_p, min_p), members in groups.items():
        ids = np.full((len(members), k), -1, dtype=np.int64)
        vals = np.full((len(members), k), -np.inf, dtype=np.float64)
        for j, i in enumerate(members):
            best, values = top(penalised[i], k)
            ids[j, : len(best)] = best
            vals[j, : len(best)] = values
        draws = uniforms([opts[i].seed for i in members], [positions[i] for i in members])
        for i, token in zip(members, _draw(ids, vals, temperature, top_p, min_p, draws)):
            out[i] = token
    return out


def top(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's k best tokens, best first (by logit, then by token id: the set and its order are a
    pure function of the row, ties at the k-th place included), and their logits as float64.
    Tokens at -inf (a grammar's forbidden ones) and NaN are never among them: they could never be
    drawn; a row with fewer drawable tokens gives fewer.

    Exact, and cheaper than partitioning the whole row: the k-th best of every 16th logit is a
    logit that at least k of the row reach, so only the logits at or above it are looked at."""
    n = row.shape[0]
    cut = -np.inf
    if k < n and n >= 4 * _STRIDE * k:
        sampled = row[::_STRIDE]
        cut = np.partition(sampled, len(sampled) - k)[len(sampled) - k]
        if not cut > -np.inf:  # -inf, or NaN: every drawable token is a candidate
            cut = -np.inf
    live = np.flatnonzero(row >= cut) if cut > -np.inf else np.flatnonzero(row > -np.inf)
    vals = row[live].astype(np.float64)
    if len(live) > k:
        kth = np.partition(vals, len(vals) - k)[len(vals) - k]  # the k-th best value
        above = vals > kth
        tied = vals == kth  # of those, the lowest ids (live is in id order) fill the k places
        take = above | (tied & (np.cumsum(tied) <= k - int(above.sum())))
        live, vals = live[take], vals[take]
    order = np.argsort(-vals, kind="stable")  # best first; among equals, lower ids first
    return live[order], vals[order]


def _draw(
    ids: np.ndarray, vals: np.ndarray, temperature: float, top_p: float, min_p: float, u: np.ndarray
) -> list[int]:
    """Temperature, top-p, min-p and the draw over rows of top-k candidates (best first). Every
    total is the last of a sequential sum along its row."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        probs = np.exp((vals - vals[:, :1]) / temperature)
        total = np.cumsum(probs, axis=1)[:, -1:]
        probs = probs / total
        live = (probs > 0.0).sum(axis=1)  # tokens a grammar forbids, or whose odds underflow: never drawn
        n = live
        if top_p < 1.0:
            n = np.minimum(n, (np.cumsum(probs, axis=1) < top_p).sum(axis=1) + 1)
        if min_p > 0.0:
            n = np.minimum(n, (probs >= min_p * probs[:, :1]).sum(axis=1))
        n = np.maximum(n, 1)  # the best token survives every cut
        kept = np.where(np.arange(probs.shape[1])[None, :] < n[:, None], probs, 0.0)
        kept = kept / np.cumsum(kept, axis=1)[:, -1:]
        pick = (np.cumsum(kept, axis=1) <= u[:, None]).sum(axis=1)
    out = []
    for row, t, count, p, ok in zip(ids, total[:, 0], n, pick, np.isfinite(total[:, 0])):
        # A temperature so small that everything but the best underflows: that is greedy.
        out.append(int(row[0]) if not ok or t <= 0.0 else int(row[min(int(p), int(count) - 1)]))
    return out


@attrs.frozen
class TokenLogprob:
    """A reply token's log-probability and the `top` most likely tokens at its position, all
    from the model's raw logits (before penalties, temperature, the cuts and any grammar mask,
    as OpenAI's API reports them)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The log-softmax of one row at `token`, with its `top` best tokens (best first; ties by id)."""
    x = logits.astype(np.float64)
    finite = np.isfinite(x)
    peak = x[finite].max() if finite.any() else 0.0
    lse = peak + float(np.log(np.exp(x[finite] - peak).sum())) if finite.any() else 0.0
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, len(x))
        idx = np.argpartition(-x, k - 1)[:k]
        idx = idx[np.lexsort((idx, -x[idx]))]
        best = tuple((int(i), float(x[i] - lse)) for i in idx)
    return TokenLogprob(int(token), float(x[token] - lse), best)
