"""A thinking model's reasoning through the HTTP faces, driven by the clients people use: the
official `openai` SDK (`reasoning_effort`, vLLM's `thinking_token_budget`; `reasoning_content`
in the message and in stream deltas, as DeepSeek's API, vLLM and llama-server give it) and the
`ollama` client (`think=`, `message.thinking`, `thinking` of a generate). The model is SmolLM2
with Qwen3's template and `<think>` tokens (tests/modelgen/make_think_model.py)."""

from __future__ import annotations

import json

import jsonschema
import ollama
import openai
import pytest
from make_think_model import make_think_model
from served import Served

from kinfer_rpc.host.store import DEFAULT_MODEL

pytestmark = pytest.mark.model

CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
    "required": ["name", "country"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Name a city in Europe, as JSON."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("http-think"))
    try:
        yield s
    finally:
        assert s.stop() == 0


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_think_model(tmp_path_factory.mktemp("think") / "smollm2-think.gguf"))


@pytest.fixture(scope="module")
def oa(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ol(served):
    return ollama.Client(host=served.url)


def _schema_format():
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}


# -- OpenAI ----------------------------------------------------------------------------------------
def test_openai_reasoning_content_apart_and_the_json_valid(oa, model):
    for seed in range(3):
        r = oa.chat.completions.create(
            model=model,
            messages=ASK,
            reasoning_effort="high",
            response_format=_schema_format(),
            extra_body={"thinking_token_budget": 8 + seed},
            temperature=0.9,
            seed=seed,
        )
        message = r.choices[0].message
        assert isinstance(message.reasoning_content, str) and "</think>" not in message.reasoning_content
        jsonschema.validate(json.loads(message.content), CITY)
        assert 1 <= r.usage.completion_tokens_details.reasoning_tokens <= 9 + seed


def test_openai_stream_deltas_carry_reasoning_content_then_content(oa, model):
    kw = dict(
        model=model,
        messages=ASK,
        response_format=_schema_format(),
        extra_body={"thinking_token_budget": 12},
        temperature=0,
    )
    whole = oa.chat.completions.create(**kw).choices[0].message
    reasoning, content, order = [], [], []
    for chunk in oa.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            if getattr(delta, "reasoning_content", None):
                reasoning.append(delta.reasoning_content)
                order.append("r")
            if delta.content:
                content.append(delta.content)
                order.append("c")
    assert "".join(reasoning) == whole.reasoning_content and "".join(content) == whole.content
    assert "".join(order).strip("r").strip("c") == ""  # all the reasoning, then all the content


def test_openai_effort_none_and_enable_thinking_false_turn_it_off(oa, model):
    for extra in ({"reasoning_effort": "none"}, {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
        r = oa.chat.completions.create(model=model, messages=ASK, max_tokens=8, temperature=0, **extra)
        assert getattr(r.choices[0].message, "reasoning_content", None) is None
        assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_openai_reasoning_on_a_model_that_cannot_is_a_400_naming_the_field(oa):
    with pytest.raises(openai.BadRequestError) as info:
        oa.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, reasoning_effort="low", max_tokens=4)
    assert info.value.body["param"] == "reasoning_effort" and "reasons apart" in info.value.body["message"]


def test_openai_history_takes_reasoning_content_back(oa, model):
    messages = [*ASK, {"role": "assistant", "content": '{"name": "Rome"}', "reasoning_content": "Rome is in Italy."}]
    messages.append({"role": "user", "content": "Another?"})
    r = oa.chat.completions.create(model=model, messages=messages, reasoning_effort="none", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


# -- Ollama ----------------------------------------------------------------------------------------
def test_ollama_thinking_apart_and_the_format_valid(ol, model):
    r = ol.chat(model=model, messages=ASK, think=True, format=CITY, options={"temperature": 0.9, "seed": 4})
    # no budget: the model thinks until it ends its turn, which closes the block for the format
    assert r.message.thinking is not None and "</think>" not in (r.message.thinking or "")
    jsonschema.validate(json.loads(r.message.content), CITY)


def test_ollama_streamed_thinking_then_content(ol, model):
    kw = dict(model=model, messages=ASK, think="low", options={"num_predict": 16, "temperature": 0})
    whole = ol.chat(**kw).message
    parts = list(ol.chat(stream=True, **kw))
    assert "".join(p.message.thinking or "" for p in parts) == (whole.thinking or "")
    assert "".join(p.message.content or "" for p in parts) == whole.content
    assert parts[-1].done


def test_ollama_think_false_and_generate(ol, model):
    off = ol.chat(model=model, messages=ASK, think=False, options={"num_predict": 6, "temperature": 0})
    assert not off.message.thinking
    g = ol.generate(model=model, prompt="Name a colour.", think=True, options={"num_predict": 6, "temperature": 0})
    assert g.thinking and g.response == ""
    with pytest.raises(ollama.ResponseError) as info:
        ol.generate(model=model, prompt="Name a colour.", think=True, raw=True)
    assert info.value.status_code == 400 and "think" in info.value.error


def test_ollama_think_on_a_model_that_cannot_is_a_400(ol):
    with pytest.raises(ollama.ResponseError) as info:
        ol.chat(model=DEFAULT_MODEL, messages=ASK, think=True)
    assert info.value.status_code == 400 and "reasons apart" in info.value.error
    ok = ol.chat(model=DEFAULT_MODEL, messages=ASK, think=False, options={"num_predict": 3})
    assert ok.message.content is not None


def test_ollama_history_takes_thinking_back(ol, model):
    messages = [*ASK, {"role": "assistant", "content": '{"name": "Rome"}', "thinking": "Rome is in Italy."}]
    messages.append({"role": "user", "content": "Another?"})
    r = ol.chat(model=model, messages=messages, think=False, options={"num_predict": 4})
    assert r.done
