"""kinfer_rpc.client against a real `kinfer-rpc` and the embedded model: the blocking client, its
streams, cancellation by breaking the loop, the async client (anyio) and its cancellation, a
clean shutdown on close() and on garbage collection, the agent features (tools, format, grammar,
regex, logprobs) and fill-in-the-middle (infill, generate's suffix): their params and results
without a server, their replies with one."""

from __future__ import annotations

import gc
import json
import os
import re
import sys
import time

import anyio
import attrs
import pytest
from paths import ROOT

from kinfer_rpc import errors
from kinfer_rpc.client import (
    ERRORS,
    AsyncClient,
    BackendUnavailable,
    Cancelled,
    Client,
    ContextOverflow,
    Dropped,
    IgnoredParameter,
    InternalError,
    InvalidParams,
    InvalidRequest,
    LayerDevice,
    LoadedModel,
    LoadFailed,
    MethodNotFound,
    Model,
    ModelNotFound,
    ModelStatus,
    NotSupported,
    ParseError,
    QueueFull,
    Reproducibility,
    RequestCancelled,
    ResponseTooLarge,
    Result,
    RpcError,
    ServerGone,
    ServerNotInitialized,
    Timings,
    TokenLogprob,
    ToolCall,
    Usage,
)
from kinfer_rpc.client.wire import _error

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
    assert caught.value.code == -32800 and isinstance(caught.value, RequestCancelled)
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
            with pytest.raises(ModelNotFound):
                await kinfer.chat(MESSAGES, model="no-such-model")
            with pytest.raises(InvalidParams):
                await kinfer.generate("x", maxTokens=-1)
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
    assert caught.value.code == -32099 and isinstance(caught.value, ServerGone)
    kinfer.close()


# A server that answers initialize, then closes its stdout but keeps running (stdin still open):
# writes to it succeed, and only the reader can tell that nothing will ever answer.
MUTE_SERVER = r"""
import os, sys, time
from kinfer_rpc.protocol.framing import FrameParser, encode
parser = FrameParser()
while (message := parser.next()) is None:
    parser.feed(os.read(0, 65536))
os.write(1, encode({"jsonrpc": "2.0", "id": message["id"], "result": {"capabilities": {}}}))
os.close(1)
time.sleep(60)
"""


def test_a_request_after_the_servers_end_is_answered_at_once():
    kinfer = Client([sys.executable, "-c", MUTE_SERVER])
    try:
        time.sleep(0.5)  # the reader sees the end of stdout
        t0 = time.monotonic()
        with pytest.raises(RpcError) as caught:
            kinfer.request("model/list", {}, timeout=10)
        assert caught.value.code == -32099
        kinfer._wire.proc.kill()
        kinfer.close()
        assert time.monotonic() - t0 < 3
    finally:
        kinfer._wire.proc.kill()


# -- agents: tools, constrained replies, logprobs ------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 365},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
LOGPROB = {
    "token": 42,
    "text": " Paris",
    "logprob": -0.25,
    "topLogprobs": [{"token": 42, "text": " Paris", "logprob": -0.25}],
}
CALL = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
RESULT = {
    "text": "",
    "tokens": [1, 2],
    "stopReason": "toolCalls",
    "seed": 5,
    "usage": {"promptTokens": 3, "completionTokens": 2, "draftTokens": 0, "draftAccepted": 0, "cachedTokens": 0},
    "timings": {"queueMs": 0.0, "promptMs": 1.0, "generateMs": 2.0, "tokensPerSecond": 3.0},
    "model": DEFAULT,
    "toolCalls": [CALL],
    "logprobs": [LOGPROB, {**LOGPROB, "token": 7, "topLogprobs": []}],
}


class Schema:
    """Stands for a pydantic model: the client calls `model_json_schema()` and sends its result."""

    @classmethod
    def model_json_schema(cls):
        return CITY


def test_result_parses_tool_calls_and_logprobs():
    r = Result.from_json(RESULT)
    assert r.stop_reason == "toolCalls" and r.tool_calls == [ToolCall("call_0", "get_weather", {"city": "Paris"})]
    first, second = r.logprobs
    assert first == TokenLogprob(42, " Paris", -0.25, [TokenLogprob(42, " Paris", -0.25)])
    assert second.token == 7 and second.top == []
    # absent: no calls, and no logprobs (None: not asked for, unlike [] for zero tokens)
    plain = Result.from_json({k: v for k, v in RESULT.items() if k not in ("toolCalls", "logprobs")})
    assert plain.tool_calls == [] and plain.logprobs is None
    assert Result.from_json({**RESULT, "logprobs": []}).logprobs == []
    # OpenAI's form of the arguments (a JSON string) is parsed too
    openai = {**CALL, "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert ToolCall.from_json(openai).arguments == {"a": 1}
    # a cancelled request's partial result is a Result as well
    assert Cancelled(-32800, "cancelled", {**RESULT, "stopReason": "cancelled"}).partial.tool_calls == r.tool_calls


def test_result_message_and_tool_answers_continue_the_conversation():
    r = Result.from_json(RESULT)
    assert r.message == {"role": "assistant", "content": "", "toolCalls": [CALL]}
    (call,) = r.tool_calls
    assert call.to_json() == CALL
    assert call.answer("18 C") == {"role": "tool", "toolCallId": "call_0", "name": "get_weather", "content": "18 C"}
    assert json.loads(call.answer({"temperature": 18})["content"]) == {"temperature": 18}
    text_only = Result.from_json({**RESULT, "text": "Hi", "toolCalls": None, "stopReason": "stop"})
    assert text_only.message == {"role": "assistant", "content": "Hi"}


def _recording_client():
    """A Client whose requests are recorded and answered with RESULT (no server)."""
    kinfer = Client.__new__(Client)
    sent = []

    def request(method, params=None, timeout=None):
        sent.append((method, params))
        return RESULT

    kinfer.request = request
    return kinfer, sent


def test_tools_and_tool_choice_go_beside_the_options():
    kinfer, sent = _recording_client()
    r = kinfer.chat(MESSAGES, tools=[WEATHER], tool_choice="required", maxTokens=5, logprobs=True, topLogprobs=2)
    assert r.tool_calls[0].name == "get_weather"
    method, params = sent[-1]
    assert method == "inference/chat"
    assert params == {
        "messages": MESSAGES,
        "tools": [WEATHER],
        "toolChoice": "required",
        "options": {"maxTokens": 5, "logprobs": True, "topLogprobs": 2},
    }
    named = {"type": "function", "function": {"name": "get_weather"}}
    kinfer.chat(MESSAGES, DEFAULT, tools=[WEATHER], tool_choice=named)
    assert sent[-1][1] == {"messages": MESSAGES, "model": DEFAULT, "tools": [WEATHER], "toolChoice": named}
    kinfer.chat(MESSAGES)  # neither: nothing new in the params
    assert sent[-1][1] == {"messages": MESSAGES}


@pytest.mark.parametrize(
    "given, sent_as",
    [(CITY, CITY), ("json", "json"), (Schema, CITY)],
    ids=["schema", "json", "model_json_schema"],
)
def test_format_takes_a_schema_json_or_a_model_class(given, sent_as):
    kinfer, sent = _recording_client()
    kinfer.generate("x", format=given, maxTokens=3)
    assert sent[-1] == ("inference/generate", {"prompt": "x", "options": {"format": sent_as, "maxTokens": 3}})
    kinfer.chat(MESSAGES, format=given)
    assert sent[-1] == ("inference/chat", {"messages": MESSAGES, "options": {"format": sent_as}})


def test_format_takes_a_pydantic_model():
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        city: str
        days: int

    kinfer, sent = _recording_client()
    kinfer.chat(MESSAGES, format=City)
    assert sent[-1][1]["options"]["format"] == City.model_json_schema()


def test_async_client_sends_tools_and_format_the_same_way():
    async def main():
        kinfer = AsyncClient(KINFER_RPC)  # not entered: no server
        sent = []

        async def request(method, params=None):
            sent.append((method, params))
            return RESULT

        kinfer.request = request
        r = await kinfer.chat(MESSAGES, tools=[WEATHER], tool_choice="auto", format=Schema, logprobs=True)
        assert r.tool_calls and r.logprobs
        return sent

    ((method, params),) = anyio.run(main)
    assert method == "inference/chat"
    assert params == {
        "messages": MESSAGES,
        "tools": [WEATHER],
        "toolChoice": "auto",
        "options": {"format": CITY, "logprobs": True},
    }


class _FakeWire:
    """What a Stream needs of the wire: ids, the token table and request() (no process)."""

    def __init__(self):
        import itertools
        from concurrent.futures import Future

        self.ids = itertools.count(1)
        self.tokens = {}
        self.sent = []
        self.future = Future()

    def request(self, method, params):
        self.sent.append((method, params))
        return 1, self.future

    def cancel(self, rid):
        pass


def test_stream_collects_streamed_tool_calls_and_logprobs():
    from kinfer_rpc.client import Stream

    wire = _FakeWire()
    stream = Stream(wire, "inference/chat", {"messages": MESSAGES, "tools": [WEATHER]})
    q = wire.tokens[stream.token]
    q.put({"text": "Hi", "tokens": [1], "logprobs": [LOGPROB]})
    q.put({"text": "", "tokens": [2], "logprobs": [{**LOGPROB, "token": 7}], "toolCalls": [CALL]})
    wire.future.set_result({"jsonrpc": "2.0", "id": 1, "result": RESULT})
    assert list(stream) == ["Hi"]  # a partial result without text is no piece
    assert [t.token for t in stream.logprobs] == [42, 7]
    assert stream.tool_calls == stream.result.tool_calls == [ToolCall("call_0", "get_weather", {"city": "Paris"})]


# with the server (these need the server side of tools, constraints and logprobs)
def _json_of(text: str):
    return json.loads(text)


@pytest.mark.model
def test_format_holds_the_reply_to_a_schema(kinfer):
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "Where should I go on holiday, and for how long? Answer in JSON."}]
    r = kinfer.chat(messages, format=CITY, maxTokens=60, temperature=0)
    assert r.stop_reason == "stop", r  # complete: the reply ends with the value
    jsonschema.validate(_json_of(r.text), CITY)
    # the same through a model class, streamed: the same reply
    stream = kinfer.stream_chat(messages, format=Schema, maxTokens=60, temperature=0)
    assert "".join(stream) == r.text and stream.result.tokens == r.tokens
    any_json = kinfer.generate("A JSON list of three colours:", format="json", maxTokens=60, seed=1)
    if any_json.stop_reason == "stop":
        _json_of(any_json.text)


@pytest.mark.model
def test_regex_and_grammar_hold_the_reply(kinfer):
    r = kinfer.generate("The year the Berlin Wall fell:", regex="[12][0-9]{3}", maxTokens=10, temperature=0.7, seed=3)
    assert r.stop_reason == "stop" and re.fullmatch("[12][0-9]{3}", r.text), r
    g = kinfer.chat(
        [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        grammar='start: "yes" | "no"',
        maxTokens=10,
        temperature=0,
    )
    assert g.stop_reason == "stop" and g.text in ("yes", "no"), g


@pytest.mark.model
def test_constraint_errors_are_32602(kinfer):
    with pytest.raises(RpcError) as caught:
        kinfer.generate("x", regex="[unclosed", maxTokens=2)
    assert caught.value.code == -32602
    assert caught.value.data["field"] == "options.regex" and caught.value.data["error"]
    with pytest.raises(RpcError) as caught:
        kinfer.generate("x", regex="a", grammar='start: "a"', maxTokens=2)
    assert caught.value.code == -32602
    with pytest.raises(RpcError) as caught:
        kinfer.generate("x", topLogprobs=3, maxTokens=2)
    assert caught.value.code == -32602 and "topLogprobs" in caught.value.message


@pytest.mark.model
def test_logprobs_one_per_token(kinfer):
    r = kinfer.generate("The capital of France is", maxTokens=6, temperature=0, logprobs=True, topLogprobs=3)
    assert r.logprobs is not None and [t.token for t in r.logprobs] == r.tokens
    for t in r.logprobs:
        assert t.logprob <= 0.0 and len(t.top) == 3
        assert [x.logprob for x in t.top] == sorted((x.logprob for x in t.top), reverse=True)
        # greedy: the token chosen is the model's best, and its logprob is the best one's
        assert t.top[0].token == t.token and t.top[0].logprob == pytest.approx(t.logprob)
    assert "".join(t.text for t in r.logprobs) == r.text
    # streamed: the partial results' logprobs concatenate to the result's
    stream = kinfer.stream_generate("The capital of France is", maxTokens=6, temperature=0, logprobs=True)
    list(stream)
    assert stream.logprobs == [attrs.evolve(t, top=[]) for t in r.logprobs] == stream.result.logprobs
    assert kinfer.generate("Hi", maxTokens=2, temperature=0).logprobs is None


@pytest.mark.model
def test_tools_reach_the_server_beside_the_options(kinfer):
    # SmolLM2's chat template has no tools: the server refuses them as such (sent among the
    # options they would be refused as an unknown option instead).
    with pytest.raises(RpcError) as caught:
        kinfer.chat(MESSAGES, tools=[WEATHER], tool_choice="auto", maxTokens=4)
    assert caught.value.code == -32602 and "does not support tools" in caught.value.message
    with pytest.raises(RpcError) as caught:
        kinfer.stream_chat(MESSAGES, tools=[WEATHER], maxTokens=4).wait(timeout=60)
    assert caught.value.code == -32602 and "does not support tools" in caught.value.message


@pytest.mark.model
def test_async_client_format_and_logprobs():
    async def main():
        async with AsyncClient(KINFER_RPC) as kinfer:
            await kinfer.load(threads=1)
            r = await kinfer.chat(
                [{"role": "user", "content": "A city and a number of days, as JSON."}],
                format=CITY,
                logprobs=True,
                maxTokens=60,
                temperature=0,
            )
            assert r.stop_reason == "stop" and set(_json_of(r.text)) == {"city", "days"}
            assert [t.token for t in r.logprobs] == r.tokens
            stream = kinfer.stream_chat(MESSAGES, logprobs=True, maxTokens=5, temperature=0)
            async for _ in stream:
                pass
            assert stream.logprobs == stream.result.logprobs and len(stream.logprobs) == len(stream.result.tokens)
            with pytest.raises(RpcError) as caught:
                await kinfer.chat(MESSAGES, tools=[WEATHER], maxTokens=4)
            assert caught.value.code == -32602

    anyio.run(main)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> str:
    """SmolLM2 with a chat template that takes tools (tests/modelgen/make_tool_model.py)."""
    from make_tool_model import make_tool_model

    return make_tool_model(tmp_path_factory.mktemp("tools") / "smollm2-tools.gguf")


@pytest.mark.model
def test_tool_calls_and_the_conversation_after_them(kinfer, tool_model):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = kinfer.chat(messages, tool_model, tools=[WEATHER], tool_choice="required", maxTokens=80, temperature=0)
    assert r.stop_reason == "toolCalls" and r.tool_calls, r
    call = r.tool_calls[0]
    assert call.id and call.name == "get_weather" and isinstance(call.arguments.get("city"), str)
    # streamed, with the function named (both forms): the calls come in the partial results too
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("get_weather", named):
        stream = kinfer.stream_chat(
            messages, tool_model, tools=[WEATHER], tool_choice=choice, maxTokens=80, temperature=0
        )
        list(stream)
        assert stream.result.stop_reason == "toolCalls" and stream.result.tool_calls
        assert stream.tool_calls == stream.result.tool_calls
    # the messages the Result and the call make are what the server takes for the next turn
    after = messages + [r.message] + [c.answer({"city": c.arguments["city"], "sky": "sunny"}) for c in r.tool_calls]
    nxt = kinfer.chat(after, tool_model, tools=[WEATHER], tool_choice="none", maxTokens=8, temperature=0)
    assert nxt.tool_calls == [] and nxt.stop_reason in ("stop", "length")


# -- fill in the middle ------------------------------------------------------------------------
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))\n"
UTIL = {"util.py": "def sub(a, b):\n    return a - b\n"}
FIM_GREEDY = {"maxTokens": 12, "temperature": 0}


def test_infill_and_generates_suffix_params():
    kinfer, sent = _recording_client()
    kinfer.infill(PREFIX, SUFFIX, DEFAULT, extra=UTIL, stopAtLine=True, maxTokens=8)
    assert sent[-1] == (
        "inference/infill",
        {
            "prefix": PREFIX,
            "suffix": SUFFIX,
            "model": DEFAULT,
            "extra": [{"filename": "util.py", "text": UTIL["util.py"]}],
            "options": {"stopAtLine": True, "maxTokens": 8},
        },
    )
    files = [{"text": "x = 1\n"}, {"filename": "b.py", "text": "y = 2\n"}]  # the protocol's own shape
    kinfer.infill(PREFIX, extra=files)
    assert sent[-1] == ("inference/infill", {"prefix": PREFIX, "suffix": "", "extra": files})
    kinfer.generate(PREFIX, suffix=SUFFIX, maxTokens=3)
    assert sent[-1] == ("inference/generate", {"prompt": PREFIX, "suffix": SUFFIX, "options": {"maxTokens": 3}})
    kinfer.generate(PREFIX)  # no suffix: none sent
    assert sent[-1] == ("inference/generate", {"prompt": PREFIX})


def test_result_parses_dropped():
    r = Result.from_json({**RESULT, "dropped": {"prefix": 120, "suffix": 7, "extra": 0}})
    assert r.dropped == Dropped(prefix=120, suffix=7, extra=0)
    assert Result.from_json(RESULT).dropped is None  # generate and chat have none


def test_async_client_sends_infill_params_the_same_way():
    async def main():
        kinfer = AsyncClient(KINFER_RPC)  # not entered: no server
        sent = []

        async def request(method, params=None):
            sent.append((method, params))
            return {**RESULT, "dropped": {"prefix": 1, "suffix": 2, "extra": 3}}

        kinfer.request = request
        r = await kinfer.infill(PREFIX, SUFFIX, extra=UTIL, maxTokens=4)
        assert r.dropped == Dropped(1, 2, 3)
        await kinfer.generate(PREFIX, suffix=SUFFIX)
        return sent

    infill, generate = anyio.run(main)
    assert infill == (
        "inference/infill",
        {
            "prefix": PREFIX,
            "suffix": SUFFIX,
            "extra": [{"filename": "util.py", "text": UTIL["util.py"]}],
            "options": {"maxTokens": 4},
        },
    )
    assert generate == ("inference/generate", {"prompt": PREFIX, "suffix": SUFFIX})


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory) -> str:
    """SmolLM2 with fill-in-the-middle tokens (tests/modelgen/make_fim_model.py)."""
    from make_fim_model import make_fim_model

    return make_fim_model(tmp_path_factory.mktemp("fim") / "fim.gguf")


@pytest.fixture
def fim(kinfer, fim_model):
    """The FIM model's name, loaded (a load of a loaded model answers at once)."""
    return kinfer.load(fim_model, contextLength=1024, slots=2, batch=256, threads=1).model


@pytest.mark.model
def test_infill_is_the_servers_reply(kinfer, fim):
    r = kinfer.infill(PREFIX, SUFFIX, fim, extra=UTIL, **FIM_GREEDY)
    raw = kinfer.request(
        "inference/infill",
        {
            "model": fim,
            "prefix": PREFIX,
            "suffix": SUFFIX,
            "extra": [{"filename": "util.py", "text": UTIL["util.py"]}],
            "options": FIM_GREEDY,
        },
    )
    assert isinstance(r, Result) and r.model == fim
    assert (r.text, r.tokens, r.stop_reason) == (raw["text"], raw["tokens"], raw["stopReason"])
    assert r.tokens and r.usage.completion_tokens == len(r.tokens) <= 12
    assert r.dropped == Dropped(0, 0, 0)
    # generate with a suffix is the same infill (without extra)
    a = kinfer.infill(PREFIX, SUFFIX, fim, **FIM_GREEDY)
    b = kinfer.generate(PREFIX, fim, suffix=SUFFIX, **FIM_GREEDY)
    assert (a.text, a.tokens, a.dropped) == (b.text, b.tokens, b.dropped)
    assert a.usage.prompt_tokens < r.usage.prompt_tokens  # the extra context was in r's prompt


@pytest.mark.model
def test_infill_stop_at_line_and_a_long_prefix(kinfer, fim):
    line = kinfer.infill(PREFIX, SUFFIX, fim, stopAtLine=True, maxTokens=24, temperature=0)
    assert line.stop_reason == "stop" and line.text.strip() and "\n" not in line.text.lstrip()
    # 3/4 of a 256-token batch is kept of the prefix: its start is left out, and the result says so
    long = "".join(f"x{i} = {i}\n" for i in range(300)) + PREFIX
    r = kinfer.infill(long, SUFFIX, fim, **FIM_GREEDY)
    assert 0 < r.dropped.prefix < len(long) and r.dropped.suffix == r.dropped.extra == 0
    assert r.usage.prompt_tokens < 256


@pytest.mark.model
def test_stream_infill_concatenates_to_the_final_text(kinfer, fim):
    blocking = kinfer.infill(PREFIX, SUFFIX, fim, extra=UTIL, **FIM_GREEDY)
    stream = kinfer.stream_infill(PREFIX, SUFFIX, fim, extra=UTIL, **FIM_GREEDY)
    pieces = list(stream)
    assert pieces and "".join(pieces) == stream.text == stream.result.text == blocking.text
    assert stream.result.tokens == blocking.tokens and stream.result.dropped == Dropped(0, 0, 0)


@pytest.mark.model
def test_infill_without_fim_tokens_is_32602(kinfer):
    with pytest.raises(RpcError) as caught:
        kinfer.infill(PREFIX, SUFFIX, DEFAULT, maxTokens=4)
    assert caught.value.code == -32602 and "cannot fill in the middle" in caught.value.message
    assert caught.value.data == {"field": "model", "fimTokens": {"rep": 4}}
    with pytest.raises(RpcError) as caught:
        kinfer.generate(PREFIX, DEFAULT, suffix=SUFFIX, maxTokens=4)
    assert caught.value.code == -32602


@pytest.mark.model
def test_async_infill(fim_model):
    async def main():
        async with AsyncClient(KINFER_RPC) as kinfer:
            await kinfer.load(fim_model, contextLength=1024, slots=2, batch=256, threads=1)
            r = await kinfer.infill(PREFIX, SUFFIX, extra=UTIL, **FIM_GREEDY)
            assert r.tokens and r.dropped == Dropped(0, 0, 0)
            stream = kinfer.stream_infill(PREFIX, SUFFIX, extra=UTIL, **FIM_GREEDY)
            pieces = [p async for p in stream]
            assert "".join(pieces) == stream.result.text == r.text and stream.result.tokens == r.tokens
            g = await kinfer.generate(PREFIX, suffix=SUFFIX, **FIM_GREEDY)
            assert g.dropped == Dropped(0, 0, 0) and g.usage.prompt_tokens < r.usage.prompt_tokens
            line = await kinfer.infill(PREFIX, SUFFIX, stopAtLine=True, maxTokens=24, temperature=0)
            assert line.stop_reason == "stop" and "\n" not in line.text.lstrip()

    anyio.run(main)


# -- error classes -----------------------------------------------------------------------------
# spec/specification.md's "Error codes" table: each code, the class the client raises for it.
DOCUMENTED = {
    -32700: ParseError,
    -32600: InvalidRequest,
    -32601: MethodNotFound,
    -32602: InvalidParams,
    -32603: InternalError,
    -32002: ServerNotInitialized,
    -32800: RequestCancelled,
    -31001: ModelNotFound,
    -31002: ContextOverflow,
    -31003: LoadFailed,
    -31004: QueueFull,
    -31005: BackendUnavailable,
    -31006: NotSupported,
    -31007: ResponseTooLarge,
    -32099: ServerGone,  # the client's own: the server exited before it answered
}


def _spec_codes() -> dict[int, str]:
    """The codes and names of the specification's error table."""
    spec = (ROOT / "spec" / "specification.md").read_text()
    table = spec[spec.index("### Error codes") :]
    table = table[: table.index("\n### ")]
    return {int(code): name for code, name in re.findall(r"^\| (-\d+) \| (\w+) \|", table, re.M)}


def test_every_documented_code_has_its_class():
    spec = _spec_codes()
    assert len(spec) >= 14 and set(spec) | {-32099} == set(DOCUMENTED) == set(ERRORS)
    for code, name in spec.items():
        assert DOCUMENTED[code].__name__ == name  # the class is named as the spec names the code
    # the server's constants are the same codes
    constants = {getattr(errors, n) for n in dir(errors) if n.isupper() and isinstance(getattr(errors, n), int)}
    assert constants == set(spec)
    for code, cls in DOCUMENTED.items():
        assert ERRORS[code] is cls and cls.CODE == code and issubclass(cls, RpcError)
        e = _error({"error": {"code": code, "message": "m", "data": {"x": 1}}})
        assert type(e) is cls and (e.code, e.message, e.data) == (code, "m", {"x": 1})
    assert Cancelled is RequestCancelled
    # an undocumented code, or none, is a plain RpcError
    assert type(_error({"error": {"code": -1, "message": "m"}})) is RpcError
    assert type(_error({"error": {}})) is RpcError


@pytest.mark.model
def test_each_error_class_for_its_cause(kinfer, loaded, tmp_path):
    with pytest.raises(ModelNotFound) as caught:
        kinfer.chat(MESSAGES, model="no-such-model", maxTokens=1)
    assert caught.value.code == -31001 and caught.value.data["model"] == "no-such-model"
    with pytest.raises(InvalidParams):
        kinfer.generate("x", maxTokens=-1)
    with pytest.raises(MethodNotFound) as caught:
        kinfer.request("no/such", {})
    assert caught.value.data == "no/such"
    context = loaded[1].context_length
    with pytest.raises(ContextOverflow) as caught:
        kinfer.generate("hi " * (context + 8), maxTokens=1)
    assert caught.value.data["contextLength"] == context
    garbage = tmp_path / "x.gguf"
    garbage.write_bytes(b"not a model at all" * 64)
    with pytest.raises(LoadFailed):
        kinfer.load(str(garbage), threads=1)
    stream = kinfer.stream_generate("Once upon a time", **LONG)
    next(stream)
    stream.cancel()
    with pytest.raises(RequestCancelled):
        stream.wait(timeout=30)
    # all of them are RpcErrors
    with pytest.raises(RpcError):
        kinfer.chat(MESSAGES, model="no-such-model", maxTokens=1)


# -- typed results: every field the spec gives ---------------------------------------------------
def _snake(name: str) -> str:
    return re.sub(r"[A-Z]", lambda m: "_" + m.group(0).lower(), name)


# metaModel structure -> the client's class, and the properties it names otherwise
TYPED = {
    "InferenceOutcome": (Result, {}),
    "InferenceResult": (Result, {}),
    "Usage": (Usage, {}),
    "Timings": (Timings, {}),
    "LoadedModel": (LoadedModel, {}),
    "ModelStatusReady": (ModelStatus, {}),
    "ModelStatusFailed": (ModelStatus, {}),
    "ModelStatusLoading": (ModelStatus, {}),
    "ModelListEntry": (Model, {}),
    "InfillDropped": (Dropped, {}),
    "TokenLogprob": (TokenLogprob, {"topLogprobs": "top"}),
    "Reproducibility": (Reproducibility, {}),
    "IgnoredParameter": (IgnoredParameter, {}),
    "LayerDevice": (LayerDevice, {}),
}


def test_typed_results_have_every_spec_field():
    meta = json.loads((ROOT / "spec" / "metaModel.json").read_text())
    structures = {s["name"]: s for s in meta["structures"]}
    for name, (cls, renamed) in TYPED.items():
        fields = {f.name for f in attrs.fields(cls)}
        for prop in structures[name]["properties"]:
            field = renamed.get(prop["name"], _snake(prop["name"]))
            assert field in fields, f"{cls.__name__} has no field for {name}.{prop['name']}"


LOADED = {
    "model": DEFAULT,
    "backend": "llama",
    "path": "/m.gguf",
    "source": "embedded",
    "architecture": "llama",
    "parameters": 135,
    "sizeBytes": 1,
    "contextLength": 2048,
    "contextTrain": 8192,
    "slots": 2,
    "batch": 512,
    "ubatch": 512,
    "gpuLayers": 0,
    "flashAttention": False,
    "draftPolicy": "ngram",
    "drafts": 4,
    "weights": "dense",
    "reproducible": {"promised": True, "reason": "one slot"},
    "prefix": 4096,
    "placement": "fit",
    "placementReason": "all of it fits",
    "hostTensors": ["ffn_.*"],
    "chatTemplate": "chatml",
    "chatTemplateNote": "a Go template",
    "ignoredParameters": [{"name": "mirostat", "reason": "no equivalent"}],
    "rpcServers": ["127.0.0.1:50052"],
    "devices": [{"device": "RPC0", "server": "127.0.0.1:50052", "layers": [[0, 29]]}],
    "splitMode": "layer",
    "tensorSplit": [0.6, 0.4],
    "mainGpu": 1,
}


def test_results_parse_usage_and_the_loads_fields():
    usage = Result.from_json({**RESULT, "usage": {**RESULT["usage"], "draftTokens": 9, "draftAccepted": 5}}).usage
    assert usage == Usage(3, 2, draft_tokens=9, draft_accepted=5, cached_tokens=0)
    assert Result.from_json({**RESULT, "usage": {"promptTokens": 8, "cachedTokens": 6}}).usage.cached_tokens == 6
    m = LoadedModel.from_json(LOADED)
    assert (m.draft_policy, m.drafts, m.weights, m.prefix) == ("ngram", 4, "dense", 4096)
    assert m.reproducible == Reproducibility(True, "one slot")
    assert (m.placement, m.placement_reason, m.host_tensors) == ("fit", "all of it fits", ["ffn_.*"])
    assert (m.chat_template, m.chat_template_note) == ("chatml", "a Go template")
    assert m.ignored_parameters == [IgnoredParameter("mirostat", "no equivalent")]
    assert m.rpc_servers == ["127.0.0.1:50052"]
    assert m.devices == [LayerDevice("RPC0", "127.0.0.1:50052", [(0, 29)])]
    assert (m.split_mode, m.tensor_split, m.main_gpu) == ("layer", [0.6, 0.4], 1)
    optional = ("rpcServers", "devices", "splitMode", "tensorSplit", "mainGpu")
    bare = LoadedModel.from_json({k: v for k, v in LOADED.items() if k not in optional})
    assert bare.rpc_servers is None and bare.devices is None
    assert (bare.split_mode, bare.tensor_split, bare.main_gpu) == (None, None, None)
    failed = ModelStatus.from_json({"model": "m", "backend": "llama", "state": "failed", "error": "no memory"})
    assert failed.error == "no memory"


@pytest.mark.model
def test_the_servers_load_and_reply_fill_the_new_fields(kinfer, loaded):
    info = loaded[1]
    assert info.weights in ("quantized", "dense") and isinstance(info.reproducible, Reproducibility)
    assert info.placement_reason and info.chat_template in ("gguf", "chatml") and info.drafts >= 0
    first = kinfer.chat([{"role": "user", "content": "Say a fruit and a colour."}], maxTokens=2, temperature=0)
    again = kinfer.chat([{"role": "user", "content": "Say a fruit and a colour."}], maxTokens=2, temperature=0)
    assert first.usage.draft_tokens >= first.usage.draft_accepted >= 0
    assert again.usage.cached_tokens > 0 or info.prefix == -1  # the prompt again: from the prefix pool
    (status,) = kinfer.status(DEFAULT)
    assert status.batch > 0 and status.placement_reason
