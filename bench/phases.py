"""Where an engine's decode step goes: bench/engine_bench.py and bench/mlx_bench.py --phases."""

from __future__ import annotations

import time


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

    def __init__(self, engine):
        self.rows: list[tuple] = []  # (start, *PARTS)
        model, step = engine.model, engine.step
        inner = model.decode
        current = {}
        waited = [0.0]  # when the last wait ended

        def timed(name, fn):
            def wrapper(*args):
                t = time.perf_counter()
                out = fn(*args)
                current[name] = current.get(name, 0.0) + time.perf_counter() - t
                return out

            return wrapper

        engine._best = timed("argmax", engine._best)
        engine._plan = timed("plan", engine._plan)
        engine._drain_text = timed("text", engine._drain_text)

        def launch(inner):  # decode(chunks), and decode_next(tokens) where the backend has it
            def call(arg):
                t = time.perf_counter()
                if waited[0]:
                    current["gap"] = t - waited[0]
                wait = inner(arg)
                current["call"] = time.perf_counter() - t

                def timed_wait():
                    t = time.perf_counter()
                    out = wait()
                    waited[0] = time.perf_counter()
                    current["wait"] = waited[0] - t
                    return out

                return timed_wait

            return call

        def timed_step():
            current.clear()
            t = time.perf_counter()
            busy = step()
            current["step"] = time.perf_counter() - t
            if "wait" not in current:  # idle: no gap to the next pass
                waited[0] = 0.0
            self.rows.append((t, *(current.get(k, 0.0) for k in self.PARTS)))
            return busy

        model.decode = launch(inner)
        if hasattr(model, "decode_next"):
            model.decode_next = launch(model.decode_next)
        engine.step = timed_step

    def summary(self, after: float = 0.0) -> dict:
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
