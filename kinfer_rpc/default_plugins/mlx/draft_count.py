"""The mlx backend's draft count: drafts per step when a load names none (DEFAULT_DRAFTS), and
the measurement the table comes from (step_cost_curve, pick_drafts; bench/mlx_bench.py --mode
curve).
"""

from __future__ import annotations

import time

from kinfer_rpc.types import LoadedModel, SeqChunk

# Drafts per step when a load names no count, by device and weight form, from the measured cost of
# a pass over k+1 positions of one sequence (bench/mlx_bench.py --mode curve; pick_drafts at 70%
# acceptance), fixed for the life of a load:
# - CUDA, dense float16 (the H200, MLX 0.32.4, 7.4B): 1 row 7.06 ms, 2-16 rows 1.15-1.25x: 13.
# - CUDA, 4-bit: 2-7 rows run as matrix-vector passes (5 rows 2.82x), 8-16 rows about 1.95x: 14.
# - CPU (SmolLM2, 2 cores): 2 rows 1.49x, 3 rows 1.44x, then about +0.4x a row: 2.
DEFAULT_DRAFTS = {("gpu", "dense"): 13, ("gpu", "quantized"): 14, ("cpu", "dense"): 2, ("cpu", "quantized"): 2}


def step_cost_curve(model: LoadedModel, k_max: int = 16, repeats: int = 3, context: int = 64) -> list[float]:
    """Seconds a pass over one sequence's k+1 positions takes, k = 0..k_max (for the draft count)."""
    costs = []
    prompt = list(range(1, context + 1))
    model.seq_remove(0)
    model.decode([SeqChunk(0, 0, prompt, 1)])()
    for k in range(k_max + 1):
        best = float("inf")
        for _ in range(repeats + 1):
            t = time.perf_counter()
            model.decode([SeqChunk(0, context, [1] * (k + 1), k + 1)])()
            best = min(best, time.perf_counter() - t)
            model.seq_remove(0, context, -1)
        costs.append(best)
    return costs


def pick_drafts(costs: list[float], acceptance: float = 0.7) -> int:
    """The draft count that gives the most expected tokens per second of pass, at an acceptance
    rate typical of edits (each draft accepted with `acceptance` given the ones before it)."""

    def gain(k: int) -> float:
        return sum(acceptance**i for i in range(k + 1)) / costs[k]

    return max(range(len(costs)), key=gain)
