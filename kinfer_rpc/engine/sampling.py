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


def uniform(seed: int, position: int) -> float:
    """The one uniform draw in [0, 1) for the token at `position` of a request seeded `seed`."""
    return float(np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, position]).random())


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


def top(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best tokens of a row, best first (by logit, then by token id, so the order is a
    pure function of the row), and their logits as float64. Tokens at -inf (a grammar's
    forbidden ones) and NaN are never among them: they could never be drawn.

    Exact, and cheaper than partitioning the whole row: the k-th best of every 16th logit is a
    logit that at least k of the row reach, so only the logits at or above it are sorted."""
    n = logits.shape[0]
    if k < n and n >= 4 * _STRIDE * k:
        sampled = logits[::_STRIDE]
        cut = np.partition(sampled, len(sampled) - k)[len(sampled) - k]
        live = np.flatnonzero(logits >= cut) if cut > -np.inf else np.flatnonzero(logits > -np.inf)
    else:
        live = np.flatnonzero(logits > -np.inf)
    vals = logits[live].astype(np.float64)
    order = np.lexsort((live, -vals))[:k]
    return live[order], vals[order]


def sample(logits: np.ndarray, history: Sequence[int], position: int, opts: SamplingOptions) -> int:
    """Pick the token at `position` from one row of logits.

    `history` is the request's tokens so far (prompt and reply), used by the repeat penalty.
    Order as llama.cpp's default chain: penalties, top-k, temperature, top-p, min-p, draw.
    """
    logits = _penalise(logits, history, opts)
    if opts.temperature <= 0 or not np.isfinite(logits).any():
        return int(np.nanargmax(logits)) if np.isfinite(logits).any() else int(np.argmax(logits))
    n = logits.shape[0]
    k = opts.top_k if 0 < opts.top_k < n else n
    idx, vals = top(logits, k)
    vals = (vals - vals[0]) / opts.temperature
    probs = np.exp(vals)
    total = probs.sum()
    if not np.isfinite(total) or total <= 0.0:
        # A temperature so small that everything but the best underflows: that is greedy.
        return int(idx[0])
    probs /= total
    if probs[-1] == 0.0:  # tokens a grammar forbids (or whose odds underflow): never drawn
        live = probs > 0.0
        idx, probs = idx[live], probs[live]
    if opts.top_p < 1.0:
        cut = max(1, int(np.searchsorted(np.cumsum(probs), opts.top_p)) + 1)
        idx, probs = idx[:cut], probs[:cut]
    if opts.min_p > 0.0:
        keep = probs >= opts.min_p * probs[0]
        idx, probs = idx[keep], probs[keep]
    probs = probs / probs.sum()  # never empty: the best token always survives both cuts
    u = uniform(opts.seed, position)
    pick = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return int(idx[min(pick, len(idx) - 1)])


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
