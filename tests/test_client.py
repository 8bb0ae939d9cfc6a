"""kinfer_rpc.client against a real `kinfer-rpc` and the embedded model: the blocking client, its
streams, cancellation by breaking the loop, the async client (anyio) and its cancellation, and a
clean shutdown on close() and on garbage collection."""

from __future__ import annotations

import gc
import os
import sys
import time

import anyio
import pytest

from kinfer_rpc.client import (
    AsyncClient,
    Cancelled,
    Client,
    LoadedModel,
    Model,
    ModelStatus,
    Result,
    RpcError,
)

KINFER_RPC = [os.path.join(os.path.dirname(sys.executable), "kinfer-rpc")]
DEFAULT = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
LONG = {"maxTokens": 2000, "ignoreEos": True}  # would run for many seconds unless cancelled


@pytest.fixture(scope="module", autouse=True)
def passive_openmp():
    # llama.cpp's OpenMP workers spin while they wait; on a shared, busy CPU that costs 10x.
    old = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    yield
    if old is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    else:
        os.environ["OMP_WAIT_POLICY"] = old


@pytest.fixture(scope="module")
def loaded(passive_openmp):
    kinfer = Client(KINFER_RPC)
    progress = []
    info = kinfer.load(progress=progress.append, threads=1)
    yield kinfer, info, progress
    assert kinfer.close() == 0


@pytest.fixture
def kinfer(loaded):
    return loaded[0]


def _gone(pid: int) -> bool:
    """Exited and reaped: no process, and no zombie either."""
    return not os.path.exists(f"/proc/{pid}")


def _idle(kinfer: Client, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        status = kinfer.status(DEFAULT)[0]
        if status.slots_busy == 0 and status.queue_length == 0:
            return
        assert time.monotonic() < deadline, f"the server is still busy: {status}"
        time.sleep(0.05)


# -- the blocking client -----------------------------------------------------------------------
@pytest.mark.model
def test_initialize_and_load_progress(loaded):
    kinfer, info, progress = loaded
    assert kinfer.server_info["serverInfo"]["name"] == "kinfer-rpc"
    assert "llama" in kinfer.capabilities["backends"]
    assert isinstance(info, LoadedModel) and info.model == DEFAULT and info.backend == "llama"
    assert progress[0].kind == "begin" and progress[0].title
    assert progress[-1].kind == "end"
    percentages = [p.percentage for p in progress if p.kind == "report"]
    assert percentages == sorted(percentages)


@pytest.mark.model
def test_models_and_status_are_typed(kinfer):
    models = kinfer.models()
    assert all(isinstance(m, Model) for m in models)
    default = next(m for m in models if m.name == DEFAULT)
    assert default.source == "embedded" and default.loaded and default.size_bytes > 0
    (status,) = kinfer.status(DEFAULT)
    assert isinstance(status, ModelStatus) and status.state == "ready" and status.slots >= 1


@pytest.mark.model
def test_blocking_generate_and_chat(kinfer):
    r = kinfer.generate("The capital of France is", maxTokens=4, temperature=0)
    assert isinstance(r, Result)
    assert r.stop_reason in ("length", "stop", "eos") and len(r.tokens) == r.usage.completion_tokens <= 4
    assert r.model == DEFAULT and r.usage.prompt_tokens > 0 and r.timings.generate_ms >= 0
    c = kinfer.chat(MESSAGES, maxTokens=6, temperature=0)
    assert c.text and c.usage.completion_tokens <= 6
    # same seed, same reply
    a = kinfer.generate("Once upon a time", maxTokens=6, seed=7)
    b = kinfer.generate("Once upon a time", maxTokens=6, seed=a.seed)
    assert a.text == b.text and a.seed == 7


@pytest.mark.model
def test_stream_concatenates_to_the_final_text(kinfer):
    blocking = kinfer.chat(MESSAGES, maxTokens=10, temperature=0)
    stream = kinfer.stream_chat(MESSAGES, maxTokens=10, temperature=0)
    pieces = list(stream)
    assert len(pieces) > 1
    assert "".join(pieces) == stream.result.text == stream.text == blocking.text
    assert stream.result.tokens == blocking.tokens


@pytest.mark.model
def test_breaking_the_loop_cancels(kinfer):
    stream = kinfer.stream_generate("Once upon a time", **LONG)
    response = stream.response
    for i, _ in enumerate(stream):
        if i == 2:
            break
    del stream  # what leaving the loop's scope does
    answer = response.result(timeout=30)
    assert answer["error"]["code"] == -32800
    partial = answer["error"]["data"]
    assert 3 <= len(partial["tokens"]) < 2000
    # the next request still works
    assert kinfer.generate("Hello", maxTokens=2, temperature=0).usage.completion_tokens == 2


@pytest.mark.model
def test_breaking_an_unnamed_loop_frees_the_slot(kinfer):
    for _ in kinfer.stream_generate("Once upon a time", **LONG):
        break
    _idle(kinfer)  # 2000 tokens would keep a slot busy for many seconds


@pytest.mark.model
def test_cancelled_stream_raises_with_the_partial_result(kinfer):
    stream = kinfer.stream_generate("Once upon a time", **LONG)
    next(stream)
    stream.cancel()
    with pytest.raises(Cancelled) as caught:
        stream.wait(timeout=30)
    assert caught.value.code == -32800
    assert caught.value.partial is not None and 1 <= len(caught.value.partial.tokens) < 2000


@pytest.mark.model
def test_errors_are_rpc_errors(kinfer):
    with pytest.raises(RpcError) as caught:
        kinfer.chat(MESSAGES, model="no-such-model", maxTokens=1)
    assert caught.value.code == -31001
    with pytest.raises(RpcError) as caught:
        kinfer.generate("x", maxTokens=-1)
    assert caught.value.code == -32602


# -- the async client --------------------------------------------------------------------------
@pytest.mark.model
def test_async_client():
    async def main():
        async with AsyncClient(KINFER_RPC) as kinfer:
            pid = kinfer.pid
            progress = []
            info = await kinfer.load(progress=progress.append, threads=1)
            assert info.model == DEFAULT and progress[-1].kind == "end"

            r = await kinfer.chat(MESSAGES, maxTokens=8, temperature=0)
            assert isinstance(r, Result) and r.text

            # streaming: the pieces concatenate to the final text
            stream = kinfer.stream_chat(MESSAGES, maxTokens=8, temperature=0)
            pieces = [p async for p in stream]
            assert len(pieces) > 1 and "".join(pieces) == stream.result.text == r.text

            # concurrent calls, each its own reply
            results = {}

            async def one(seed):
                results[seed] = await kinfer.generate("Once upon a time", maxTokens=4, seed=seed)

            async with anyio.create_task_group() as tg:
                for seed in (1, 2, 3):
                    tg.start_soon(one, seed)
            assert sorted(results) == [1, 2, 3] and all(x.seed == s for s, x in results.items())

            # cancelling the awaiting task (a cancel scope) cancels the request on the server
            with anyio.move_on_after(0.3) as scope:
                await kinfer.generate("Once upon a time", **LONG)
            assert scope.cancelled_caught
            await _async_idle(kinfer)

            # ... and so does cancelling a task that iterates a stream: the server answers -32800
            stream = kinfer.stream_generate("Once upon a time", **LONG)
            with anyio.CancelScope() as scope:
                n = 0
                async for _ in stream:
                    n += 1
                    if n == 3:
                        scope.cancel()
            with anyio.fail_after(30):
                while stream.response is None:
                    await anyio.sleep(0.02)
            assert stream.response["error"]["code"] == -32800
            assert 3 <= len(stream.response["error"]["data"]["tokens"]) < 2000

            # breaking out of an async loop
            async for _ in kinfer.stream_generate("Once upon a time", **LONG):
                break
            await _async_idle(kinfer)

            # still serving
            assert (await kinfer.generate("Hello", maxTokens=2, temperature=0)).usage.completion_tokens == 2
            with pytest.raises(RpcError):
                await kinfer.chat(MESSAGES, model="no-such-model")
        assert kinfer.returncode == 0
        assert _gone(pid)

    anyio.run(main)


async def _async_idle(kinfer: AsyncClient, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while True:
            status = (await kinfer.status(DEFAULT))[0]
            if status.slots_busy == 0 and status.queue_length == 0:
                return
            await anyio.sleep(0.05)


# -- lifetime ----------------------------------------------------------------------------------
def test_close_shuts_the_server_down():
    kinfer = Client(KINFER_RPC)
    pid = kinfer.pid
    assert kinfer.close() == 0
    assert _gone(pid)
    assert kinfer.close() == 0  # idempotent


def test_garbage_collection_shuts_the_server_down():
    kinfer = Client(KINFER_RPC)
    pid, proc = kinfer.pid, kinfer._wire.proc
    del kinfer
    gc.collect()
    assert proc.returncode == 0
    assert _gone(pid)


def test_a_dead_server_fails_requests_instead_of_hanging():
    kinfer = Client(KINFER_RPC)
    kinfer._wire.proc.kill()
    kinfer._wire.proc.wait()
    with pytest.raises(RpcError) as caught:
        kinfer.request("model/list", {}, timeout=10)
    assert caught.value.code == -32099
    kinfer.close()
