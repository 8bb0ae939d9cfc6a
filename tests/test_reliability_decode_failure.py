"""A decode that fails (what a GPU out-of-memory does to llama_decode): the requests in flight get
the failure as their answer, the model leaves the loaded models, model/status says it failed, and
the next request loads it again. The real model, with its decode made to fail on demand."""

from __future__ import annotations

import threading

import anyio
import pytest

from kinfer_rpc import errors
from kinfer_rpc.engine.job import GenerateOptions, Job, Outcome
from kinfer_rpc.host.options import LoadRequest
from kinfer_rpc.host.plugins import load_plugins
from kinfer_rpc.host.runtime import Runtime
from kinfer_rpc.protocol.handlers import Handlers

pytestmark = pytest.mark.model

OOM = "llama_decode failed: out of memory"


def test_a_failed_decode_answers_in_flight_requests_and_unloads_the_model() -> None:
    async def main() -> None:
        runtime = Runtime(load_plugins())
        handlers = Handlers(runtime)
        entry = await runtime.load(None, None, LoadRequest(context_length=256, slots=2))
        model = entry.engine.model
        assert model is not None
        fail = threading.Event()
        decode = model.decode

        def failing(chunks):  # type: ignore[no-untyped-def]
            if fail.is_set():
                raise RuntimeError(OOM)
            return decode(chunks)

        model.decode = failing  # type: ignore[method-assign]
        done: list[Outcome] = []
        both = anyio.Event()

        def on_done(job: Outcome) -> None:
            done.append(job)
            if len(done) == 2:
                both.set()

        ids = model.tokenize("Tell me a long story about the sea.", True, False)
        options = GenerateOptions(max_tokens=200, ignore_eos=True)
        firsts = anyio.Event()

        def on_piece(text: str, tokens: list[int]) -> None:
            fail.set()  # fail the passes after the first pieces, while both run
            firsts.set()

        for _ in range(2):
            runtime.start(entry, list(ids), options, on_piece=on_piece, on_done=on_done)
        with anyio.fail_after(60):
            await both.wait()
        for job in done:
            assert isinstance(job.error, RuntimeError) and OOM in str(job.error)
        # By the time the answers are out, the model has left: a client that asks at once sees it.
        assert entry.name not in runtime.loaded
        status = (await handlers.model_status(None))["models"]
        assert status == [{"model": entry.name, "backend": "llama", "state": "failed", "error": OOM}]

        # A request that reaches the failed engine anyway gets a documented error, not a crash.
        with pytest.raises(errors.KinferError) as refused:
            entry.engine.submit(Job(list(ids), options))
        assert refused.value.code == errors.INTERNAL_ERROR and "failed and was unloaded" in refused.value.message

        # The next request loads the model again, once the failed engine has closed its model
        # (its memory is free before the new one places): recovered, and status says ready.
        again = await runtime.model_for(entry.name)
        assert not entry.engine._thread.is_alive() and entry.engine.model is None
        assert again is not entry and again.engine.model is not None
        assert [m["state"] for m in (await handlers.model_status(None))["models"]] == ["ready"]
        finished = anyio.Event()
        replies: list[Outcome] = []
        runtime.start(
            again,
            list(ids),
            GenerateOptions(max_tokens=4, ignore_eos=True),
            on_done=lambda j: (replies.append(j), finished.set()),
        )
        with anyio.fail_after(60):
            await finished.wait()
        assert replies[0].error is None and len(replies[0].generated) == 4
        runtime.close()

    anyio.run(main)


def test_unloading_a_failed_model_forgets_the_failure() -> None:
    async def main() -> None:
        runtime = Runtime(load_plugins())
        runtime.failed["gone"] = ("llama", OOM)
        await runtime.unload("gone")
        assert runtime.failed == {}
        assert (await Handlers(runtime).model_status(None))["models"] == []

    anyio.run(main)
