"""Helpers of the engine tests (test_engine.py, test_drafts.py, test_mtp.py, test_mlx.py): an engine on
the embedded model driven step by step, the reference replies of requests run alone, and a draft policy.
Plain functions and classes, imported as a module (conftest.py puts tests/ on the path).
"""

from __future__ import annotations

import functools

from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.engine.job import GenerateOptions, Job
from kinfer_rpc.engine.sampling import SamplingOptions
from kinfer_rpc.engine.scheduler import Engine
from kinfer_rpc.host.store import embedded_default_path
from kinfer_rpc.types import LoadOptions

CTX = 512
WORDS = (
    "the quick brown fox jumps over lazy dog code editor agent function return value "
    "Paris France capital river bridge night rain coffee müde café 東京 über naïve "
    "def class import print while for if else True None 0 1 2 42 { } ( ) ; : , . \n"
).split(" ")


class Queued:
    """The model with its pass run at the wait, as on a GPU, where decode() only queues it: what
    the engine does between the two (freeing or moving a slot) then comes before the pass, so
    doing it while a pass is in flight breaks that pass. Everything else is the model's."""

    decode_async = True

    def __init__(self, model):
        self._model = model
        self._queued = False

    def __getattr__(self, name):
        return getattr(self._model, name)

    def _queue(self, run, arg):
        assert not self._queued, "a pass was started before the last one was waited for"
        arg = list(arg)
        self._queued = True

        def wait():
            self._queued = False
            return run(arg)()

        return wait

    def decode(self, chunks):
        return self._queue(self._model.decode, chunks)

    def decode_next(self, tokens):
        return self._queue(self._model.decode_next, tokens)

    def seq_remove(self, seq, start=0, end=-1):
        assert not self._queued, "cells removed while a pass is in flight"
        self._model.seq_remove(seq, start, end)

    def seq_copy(self, src, dst, start=0, end=-1):
        assert not self._queued, "cells copied while a pass is in flight"
        self._model.seq_copy(src, dst, start, end)

    def set_device_greedy(self, seq, on):
        assert not self._queued, "a sequence's argmax moved while a pass is in flight"
        return self._model.set_device_greedy(seq, on)

    def set_device_argmax(self, seq, on):
        assert not self._queued, "a sequence's argmax moved while a pass is in flight"
        return self._model.set_device_argmax(seq, on)


class HostArgmax:
    """The model with every argmax left to the engine (all logits come back): the reference
    that the argmax inside the pass (patches/llama-output-argmax.patch) is checked against."""

    device_greedy = False

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)


def make_engine(
    slots=4, batch=512, ubatch=512, ctx=CTX, prefix=-1, start_ahead=True, gpu_layers=-1, device_argmax=True
) -> Engine:
    """On the CPU llama_decode waits for its pass, so the engine would not start passes ahead
    of their bookkeeping (Engine._start_next). The tests queue passes as a GPU does (Queued), so
    it does, and check that path's replies against the reference engine's (`alone`), which also
    takes every argmax itself (HostArgmax) where the patched llama.cpp takes it in the pass."""
    path = embedded_default_path()
    opts = LoadOptions(context_length=ctx, slots=slots, batch=batch, ubatch=ubatch, threads=2, gpu_layers=gpu_layers)

    def load(progress):
        model = LlamaBackend().load(path, opts, progress)
        if not device_argmax:
            model = HostArgmax(model)
        return Queued(model) if start_ahead else model

    # start_ahead None: the engine follows the model (the CPU's llama_decode: not ahead).
    engine = Engine(
        load, lambda fn: fn(), batch=batch, prefix=prefix, start_ahead=False if start_ahead is False else None
    )
    engine.load_model()
    return engine


def run_until_done(engine: Engine, jobs, arrivals=None, cancels=None, limit=5000):
    """Submit jobs at their arrival steps, cancel at given steps, step until all are done."""
    arrivals = arrivals or [0] * len(jobs)
    cancels = cancels or {}
    done = set()
    for job in jobs:
        job.on_done = lambda _outcome, job=job: done.add(id(job))
    step = 0
    while len(done) < len(jobs):
        for job, at in zip(jobs, arrivals):
            if at == step:
                engine.submit(job)
        for i, at in cancels.items():
            if at == step:
                engine.cancel(jobs[i])
        engine.step()
        step += 1
        assert step < limit, "the engine did not finish"
    return jobs


@functools.cache
def alone(prompt: tuple, max_tokens: int, temperature: float, seed: int, stop: str | None = None) -> tuple:
    engine = _alone_engine()
    job = Job(list(prompt), _options(max_tokens, temperature, seed, stop))
    run_until_done(engine, [job])
    return tuple(job.generated), job.text, job.stop_reason


@functools.lru_cache(maxsize=1)
def _alone_engine():
    return make_engine(slots=1, batch=512, start_ahead=False, device_argmax=False)


def _options(max_tokens, temperature, seed, stop=None):
    return GenerateOptions(
        max_tokens=max_tokens,
        stop=(stop,) if stop else (),
        sampling=SamplingOptions(temperature=temperature, seed=seed),
    )


@functools.cache
def tokenize(text: str) -> tuple:
    return tuple(_alone_engine().model.tokenize(text, False, True))


class RepeatLast:
    name = "repeat-last"

    def propose(self, history, k):
        return [history[-1]] * k


def mlx_kernel_engine(
    monkeypatch, path, calls: list, drafts: int = 0, batch: int = 16, context_length: int = CTX, **load
) -> Engine:
    """An mlx engine whose decode passes run as with the CUDA attention kernel, here on the CPU:
    the kernel's part (it writes the pass's cells into the buffers it is given and returns the
    attention) played by MLX's own operations (attention.reference), routed as on the GPU. Each
    call of the kernel appends to `calls`. `load`: the rest of the LoadOptions."""
    import sys

    from kinfer_rpc.default_plugins.mlx import MlxBackend, routing
    from kinfer_rpc.default_plugins.mlx import attention as att

    monkeypatch.setattr(
        att,
        "attention",
        lambda q, nk, nv, k, v, s, c, sc, counter, heads=None, splits=None: (
            calls.append(counter.size) or att.reference(q, nk, nv, k, v, s, c, sc)
        ),
    )

    def loaded(progress):
        opts = LoadOptions(context_length=context_length, batch=batch, drafts=drafts, **load)
        m = MlxBackend().load(str(path), opts, progress)
        module = sys.modules[type(m.model.layers[0].self_attn).__module__]
        monkeypatch.setattr(module, "scaled_dot_product_attention", module.scaled_dot_product_attention)
        assert routing._route_attention(m.model)
        m._use_kernel()
        return m

    e = Engine(loaded, lambda fn: fn(), batch=batch, prefix=-1)
    e.load_model()
    return e
