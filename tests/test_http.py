"""The HTTP faces (`kinfer serve --http`) driven by the clients people use: the official `openai`
SDK (sync and async, streaming, tools, `chat.completions.parse`), the `ollama` client, and
LangChain's `langchain-openai` and `langchain-ollama`, on the embedded model (and its copies with
a tool template and fill-in-the-middle tokens). Hostile input lives in test_http_hostile.py."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import anyio
import httpx
import ollama
import openai
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from make_fim_model import make_fim_model
from make_tool_model import make_tool_model
from served import Served

from kinfer_rpc.host.store import DEFAULT_MODEL

pytestmark = pytest.mark.model

BIN = Path(sys.executable).parent
MODEL = DEFAULT_MODEL


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("http"))
    try:
        yield s
    finally:
        assert s.stop() == 0


@pytest.fixture(scope="module")
def oa(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return str(make_tool_model(tmp_path_factory.mktemp("tools") / "smollm2-tools.gguf"))


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory):
    return str(make_fim_model(tmp_path_factory.mktemp("fim") / "smollm2-fim.gguf"))


# -- OpenAI ----------------------------------------------------------------------------------------
def test_openai_chat_whole_and_streamed_are_the_same_reply(oa):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0.7, seed=7)
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(
        oa.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            temperature=0.7,
            seed=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # seeded: the same reply streamed or not
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert usage.usage.prompt_tokens_details.cached_tokens > 0  # the prefix pool served the second
    assert [m.id for m in oa.models.list()] == [MODEL]


def test_openai_async_streaming(served):
    async def main():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
        whole = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
        )
        await client.close()
        return "".join(pieces), whole.choices[0].message.content

    streamed, whole = anyio.run(main)
    assert streamed == whole and streamed


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_openai_parse_with_a_pydantic_model(oa):
    done = oa.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Make up a person."}],
        response_format=Person,
        max_tokens=60,
        temperature=0,
    )
    assert isinstance(done.choices[0].message.parsed, Person)  # the schema held the reply


def test_openai_logprobs(oa):
    r = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    c = oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=1)
    assert len(c.choices[0].logprobs.tokens) == 4 and c.usage.completion_tokens == 4


def test_openai_tools_required_and_the_result_fed_back(oa, tool_model):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city", "days"],
                },
            },
        }
    ]
    messages = [{"role": "user", "content": "What's the weather in Paris for two days?"}]
    r = oa.chat.completions.create(
        model=tool_model, messages=messages, tools=tools, tool_choice="required", max_tokens=60, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(args["city"], str) and isinstance(args["days"], int)
    streamed = list(
        oa.chat.completions.create(
            model=tool_model,
            messages=messages,
            tools=tools,
            tool_choice="required",
            max_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    deltas = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert [json.loads(d.function.arguments) for d in deltas] == [args]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    after = oa.chat.completions.create(model=tool_model, messages=messages, tools=tools, max_tokens=10, temperature=0)
    assert after.choices[0].message.content is not None


def test_openai_completions_with_a_suffix_fill_in_the_middle(oa, fim_model):
    r = oa.completions.create(
        model=fim_model, prompt="def add(a, b):\n    return ", suffix="\n", max_tokens=8, temperature=0
    )
    assert r.object == "text_completion" and r.usage.completion_tokens <= 8
    with pytest.raises(openai.BadRequestError, match="fill in the middle"):
        oa.completions.create(model=MODEL, prompt="def f(", suffix=")", max_tokens=4)


def test_openai_errors_name_the_field(oa):
    with pytest.raises(openai.NotFoundError) as e:
        oa.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="presence_penalty") as e:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], presence_penalty=1)
    assert e.value.body["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError, match="n is not supported"):
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    with pytest.raises(openai.BadRequestError, match="image_url"):
        oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
        )


def test_the_same_reply_over_http_whatever_else_runs(oa):
    def ask(i: int, max_tokens: int) -> str:
        r = oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
            max_tokens=max_tokens,
            temperature=0.8,
            seed=100 + i,
        )
        return r.choices[0].message.content

    alone = [ask(i, 12) for i in range(3)]
    together: dict[int, str] = {}

    def one(i: int) -> None:
        together[i] = ask(i % 3, 12) if i < 3 else ask(i, 24)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [together[i] for i in range(3)] == alone


def test_a_client_that_disconnects_cancels_its_request(served):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a very long story"}],
        "stream": True,
        "max_tokens": 4000,
    }
    with httpx.Client(timeout=30) as h, h.stream("POST", served.url + "/v1/chat/completions", json=body) as r:
        for _ in r.iter_lines():
            break  # one event, then the client goes away
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if all(m.get("slotsBusy", 0) == 0 for m in served.status()):
            return
        time.sleep(0.2)
    raise AssertionError("the disconnected request kept its slot")


def test_an_http_connection_holds_its_model_only_while_a_request_runs(served):
    """A model's holders are its open sessions, and an HTTP connection only while a request of it
    runs: a kept-alive connection between requests, or one gone, holds nothing."""

    def holders() -> int:
        (m,) = [m for m in served.status() if m["model"] == MODEL]
        return m["holders"]

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count"}], "max_tokens": 4000, "ignore_eos": True}
    with httpx.Client(timeout=60) as h:
        for _ in range(3):  # one kept-alive connection, request after request
            r = h.post(served.url + "/v1/chat/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 200
            assert holders() == 0
        with h.stream("POST", served.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()  # kept: a dropped iterator closes the stream
            assert r.status_code == 200 and next(lines).startswith("data: ")
            assert holders() == 1  # while it runs
    deadline = time.monotonic() + 20
    while holders() != 0:
        assert time.monotonic() < deadline, "a connection gone still holds its model"
        time.sleep(0.1)


# -- Ollama ----------------------------------------------------------------------------------------
def test_ollama_client(served):
    c = ollama.Client(host=served.url)
    assert [m.model for m in c.list().models] == [MODEL]
    r = c.chat(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], options={"temperature": 0, "num_predict": 8}
    )
    assert r.done and r.done_reason == "length" and r.eval_count == 8 and r.message.content
    streamed = "".join(
        p.message.content
        for p in c.chat(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi"}],
            options={"temperature": 0, "num_predict": 8},
            stream=True,
        )
    )
    assert streamed == r.message.content
    g = c.generate(model=MODEL, prompt="Say hi", options={"temperature": 0, "num_predict": 8})
    assert g.response == r.message.content  # the prompt in the chat template, as Ollama does
    raw = c.generate(model=MODEL, prompt="Once upon a time", raw=True, options={"temperature": 0, "num_predict": 4})
    assert raw.eval_count == 4
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    f = c.chat(
        model=MODEL, messages=[{"role": "user", "content": "A number"}], format=schema, options={"temperature": 0}
    )
    assert isinstance(json.loads(f.message.content)["n"], int)
    assert c.show(MODEL).details.family == "llama"
    assert MODEL in [m.model for m in c.ps().models]
    assert c.generate(model=MODEL, prompt="", keep_alive=0).done_reason == "unload"
    assert MODEL not in [m.model for m in c.ps().models]
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model=MODEL, messages=[{"role": "user", "content": "x"}], options={"mirostat": 1})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        c.pull("no/such:model")  # no registry is reachable from the tests: a clear error, not a hang
    assert e.value.status_code == 400
    assert httpx.get(served.url + "/api/version").json()["version"]


def test_ollama_tools_are_offered_as_openais_are(served, oa, tool_model):
    """Ollama's chat has no tool_choice: its tools are offered as OpenAI's with "auto", and the
    same request gets the same reply (calls or text) through either face."""
    c = ollama.Client(host=served.url)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    messages = [{"role": "user", "content": "Use the tool: what is the weather in Paris?"}]
    r = c.chat(model=tool_model, messages=messages, tools=[tool], options={"temperature": 0, "num_predict": 40})
    o = oa.chat.completions.create(
        model=tool_model, messages=messages, tools=[tool], tool_choice="auto", max_tokens=40, temperature=0
    )
    calls = [(t.function.name, dict(t.function.arguments)) for t in r.message.tool_calls or ()]
    assert calls == [(t.function.name, json.loads(t.function.arguments)) for t in o.choices[0].message.tool_calls or ()]
    assert (r.message.content or None) == (o.choices[0].message.content or None)


# -- LangChain -------------------------------------------------------------------------------------
def test_langchain_openai_and_ollama(served):
    from langchain_ollama import ChatOllama
    from langchain_openai import ChatOpenAI

    oa = ChatOpenAI(base_url=served.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=8)
    reply = oa.invoke("Say hi")
    assert reply.content and reply.usage_metadata["output_tokens"] == 8
    assert "".join(c.content for c in oa.stream("Say hi")) == reply.content
    person = ChatOpenAI(base_url=served.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=60)
    structured = person.with_structured_output(Person, method="json_schema").invoke("Make up a person.")
    assert isinstance(structured, Person)
    ol = ChatOllama(base_url=served.url, model=MODEL, temperature=0, num_predict=8)
    assert ol.invoke("Say hi").content == reply.content  # the same model, prompt and options


def test_a_lone_session_beside_an_idle_http_face_keeps_every_slot(tmp_path):
    """The faces count as a client only while an HTTP request runs: a daemon serving HTTP once
    held back a lone session's last slot for a client that never came (32 requests at once ran
    31, then 1: two thirds of the speed)."""
    from rpcclient import RpcClient

    s = Served(tmp_path)
    c = RpcClient.spawn("--attach", "--socket", str(s.socket), env=s.env, executable=str(BIN / "kinfer-rpc"))
    try:
        c.initialize()
        c.load_model(slots=2, contextLength=512)
        opts = {"maxTokens": 400, "ignoreEos": True, "temperature": 0}
        rids = [c.request_async("inference/generate", {"prompt": f"Count to {i}", "options": opts}) for i in (3, 4)]
        deadline = time.monotonic() + 30
        while c.call("model/status")["models"][0]["slotsBusy"] < 2:
            assert time.monotonic() < deadline, "the second request never got the model's last slot"
            time.sleep(0.05)
        for rid in rids:
            c.cancel(rid)
            c.response(rid, timeout=30)
        c.close(check=False)
    finally:
        c.kill()
        assert s.stop() == 0


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_a_streamed_piece_is_the_same_bytes_as_its_chunk_encoded_whole(text):
    from kinfer_rpc.protocol.openai import _event, _Template

    def make(content: str) -> dict:
        return {"id": "chatcmpl-1", "model": 'm"\u00e9', "choices": [{"delta": {"content": content}}], "usage": None}

    assert _Template(make)(text) == _event(make(text))
