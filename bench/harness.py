"""What every benchmark here shares: starting kinfer's engine on a backend, running a set of
requests through it with a timestamp per token, the prompt/decode split llama-batched-bench
reports, where a decode step's time goes (`PhaseTimer`), and the one result format.

Result format: every benchmark prints one JSON object per line on stdout, each with `bench` (the
script's name) and `case` (what was measured), then its figures: `*_tps` tokens per second,
`*_s` seconds, `ms_*` milliseconds a step. Tables and logs go to stderr or follow the JSON lines,
so `grep '^{'` always gives the records. bench/compare.py reads them this way.

The scripts import kinfer as an installed package (`pip install -e .`, or PYTHONPATH at the
checkout's root) and this module as their neighbour (Python puts a script's folder on the path).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kinfer_rpc.engine.job import GenerateOptions, Job
from kinfer_rpc.engine.sampling import SamplingOptions
from kinfer_rpc.engine.scheduler import Engine

Record = dict[str, Any]


def emit(case: str, record: Record, *, bench: str | None = None) -> Record:
    """Print one result line: `bench` and `case` first, then the record's figures."""
    out = {"bench": bench or os.path.splitext(os.path.basename(sys.argv[0]))[0], "case": case, **record}
    print(json.dumps(out), flush=True)
    return out


def greedy(max_tokens: int) -> GenerateOptions:
    """Options for a benchmark request: greedy, ignoring end of generation (llama-batched-bench's)."""
    return GenerateOptions(max_tokens=max_tokens, ignore_eos=True, sampling=SamplingOptions(temperature=0.0))


def distinct_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """N prompts of one length that share no prefix, from the ordinary part of the vocabulary."""
    top = min(vocab, 49152) - 200
    return [[(7 + 13 * i + 31 * j) % top + 100 for j in range(length)] for i in range(n)]


def start_engine(load: Callable[[Any], Any], *, what: str = "the model", **engine_kwargs: Any) -> Engine:
    """An engine on its worker thread, as the server runs it, once `load(progress)` has loaded its
    model; exits with a message when the load fails."""
    ready = threading.Event()
    engine = Engine(load, lambda fn: fn(), on_ready=lambda exc: ready.set(), **engine_kwargs)
    engine.start()
    ready.wait()
    if engine.model is None:
        raise SystemExit(f"could not load {what} (see the log above)")
    return engine


class Run:
    """Requests submitted together, each token's arrival time kept (perf_counter)."""

    def __init__(
        self,
        engine: Engine,
        prompts: Sequence[Sequence[int]],
        options: GenerateOptions,
        constraint: Callable[[], Any] | None = None,
    ) -> None:
        """`constraint()`, when given, makes each job's matcher (kinfer_rpc.engine.grammar)."""
        finished = threading.Semaphore(0)
        self.times: list[list[float]] = [[] for _ in prompts]
        self.jobs = [
            Job(
                list(p),
                options,
                on_done=lambda j: finished.release(),
                on_piece=lambda text, toks, t=self.times[i]: t.extend([time.perf_counter()] * len(toks)),
                constraint=constraint() if constraint is not None else None,
            )
            for i, p in enumerate(prompts)
        ]
        self.t0 = time.perf_counter()
        for job in self.jobs:
            engine.submit(job)
        for _ in self.jobs:
            finished.acquire()
        self.t_end = time.perf_counter()

    @property
    def t_all_in(self) -> float:
        """When the last request got its first token: the end of llama-batched-bench's prompt phase."""
        return max(t[0] for t in self.times)

    def timing(self, prompt_tokens: int | None = None) -> Record:
        return timing(self.t0, self.t_end, self.times, prompt_tokens)

    @property
    def replies(self) -> list[list[int]]:
        return [j.generated for j in self.jobs]


def timing(t0: float, t_end: float, times: Sequence[Sequence[float]], prompt_tokens: int | None = None) -> Record:
    """Prompt phase until every request has its first token, then the decode phase with all of
    them running, as llama-batched-bench splits T_PP and T_TG; `times` holds each request's token
    arrival times."""
    t_all_in = max(t[0] for t in times)
    decode_tokens = sum(1 for t in times for x in t if x > t_all_in)
    t_decode = t_end - t_all_in
    total = sum(len(t) for t in times)
    out: Record = {"prompt_s": round(t_all_in - t0, 4)}
    if prompt_tokens is not None:
        out["prompt_tps"] = round(prompt_tokens / (t_all_in - t0), 2)
    out.update(
        decode_s=round(t_decode, 4),
        decode_tps=round(decode_tokens / t_decode, 2) if t_decode > 0 else 0.0,
        total_tps=round(total / (t_end - t0), 2),
        tokens=total,
    )
    return out


def run_one(engine: Engine, prompt: Sequence[int], options: GenerateOptions) -> Run:
    """One request alone."""
    return Run(engine, [prompt], options)


class PhaseTimer:
    """Where a decode step's time goes (--phases): the time inside the backend's decode() call
    (building the batch, llama_decode queuing the pass), inside its wait (the device finishing,
    the logits coming back), and the rest of the step (the engine's host work: planning,
    sampling, bookkeeping, text), per step, over the steps after every request is in; of the
    engine's host work, the argmax over the logits, the planning of the pass and the text work
    (which runs while the device computes the pass) on their own; and the gap, from the end of
    one pass's wait to the next decode() call, in which the device has nothing to do (the engine
    starts the next pass before its bookkeeping when it can, so the gap can be shorter than the
    host work)."""

    PARTS = ("call", "wait", "step", "argmax", "plan", "text", "gap")

    def __init__(self, engine: Any) -> None:
        self.rows: list[tuple[float, ...]] = []  # (start, *PARTS)
        # per step, each pass it launched: its one-token rows, prompt chunks and their tokens
        self.launched: list[list[tuple[int, int, int]]] = []
        model, step = engine.model, engine.step
        current: dict[str, float] = {}
        waited = [0.0]  # when the last wait ended
        launched: list[tuple[int, int, int]] = []  # by the step running now (self.launched)

        def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any) -> Any:
                t = time.perf_counter()
                out = fn(*args)
                current[name] = current.get(name, 0.0) + time.perf_counter() - t
                return out

            return wrapper

        engine.chooser.best = timed("argmax", engine.chooser.best)
        engine._plan = timed("plan", engine._plan)
        engine._drain_text = timed("text", engine._drain_text)

        def launch(inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
            # decode(chunks), and decode_next(tokens) where the backend has it
            def call(arg: Any) -> Any:
                t = time.perf_counter()
                if arg and isinstance(arg[0], int):  # decode_next's tokens
                    launched.append((len(arg), 0, 0))
                else:
                    long = [len(c.tokens) for c in arg if len(c.tokens) > 1]
                    launched.append((len(arg) - len(long), len(long), sum(long)))
                if waited[0]:
                    current["gap"] = t - waited[0]
                wait = inner(arg)
                current["call"] = time.perf_counter() - t

                def timed_wait() -> Any:
                    t = time.perf_counter()
                    out = wait()
                    waited[0] = time.perf_counter()
                    current["wait"] = waited[0] - t
                    return out

                return timed_wait

            return call

        def timed_step() -> Any:
            current.clear()
            launched.clear()
            t = time.perf_counter()
            busy = step()
            current["step"] = time.perf_counter() - t
            if "wait" not in current:  # idle: no gap to the next pass
                waited[0] = 0.0
            self.rows.append((t, *(current.get(k, 0.0) for k in self.PARTS)))
            self.launched.append(launched[:])
            return busy

        model.decode = launch(model.decode)
        if hasattr(model, "decode_next"):
            model.decode_next = launch(model.decode_next)
        engine.step = timed_step

    def trace(self, after: float = 0.0) -> list[Record]:
        """Every step started after `after`, the prompt's included: its parts in ms (where one
        slow step hides) and the passes it launched, each as [one-token rows, prompt chunks,
        their tokens] (a step waits for the pass it launched, or for the one the step before
        launched ahead)."""
        return [
            {
                "at_ms": round((r[0] - after) * 1000, 2),
                **{k: round(r[1 + i] * 1000, 3) for i, k in enumerate(self.PARTS) if r[1 + i]},
                "launched": passes,
            }
            for r, passes in zip(self.rows, self.launched)
            if r[0] > after
        ]

    def summary(self, after: float = 0.0) -> Record:
        """Mean ms a step of each part, over the steps started after `after` (perf_counter)."""
        rows = [r for r in self.rows if r[0] > after and r[3] > 0]
        if not rows:
            return {}
        ms = {k: sum(r[1 + i] for r in rows) / len(rows) * 1000 for i, k in enumerate(self.PARTS)}
        return {
            "phase_steps": len(rows),
            "ms_step": round(ms["step"], 3),
            "ms_decode_call": round(ms["call"], 3),
            "ms_wait": round(ms["wait"], 3),
            "ms_engine_host": round(ms["step"] - ms["call"] - ms["wait"], 3),
            "ms_argmax": round(ms["argmax"], 3),
            "ms_plan": round(ms["plan"], 3),
            "ms_text": round(ms["text"], 3),
            "ms_gap": round(ms["gap"], 3),
        }
