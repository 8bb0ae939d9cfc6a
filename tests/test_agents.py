"""What agent frameworks ask of kinfer-rpc, through the protocol on the embedded model: replies
held to a JSON schema, a regex or a grammar, and token logprobs (streamed with the pieces).
Every message the server sends is checked against spec/metaModel.json (protocol_fixtures)."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from protocol_fixtures import loaded, server, spawn  # noqa: F401
from rpcclient import RpcError

pytestmark = pytest.mark.model

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}


def chat(c, content, **options):
    return c.call(
        "inference/chat",
        {"messages": [{"role": "user", "content": content}], "options": {"maxTokens": 120, **options}},
        timeout=60,
    )


def test_format_schema_gives_valid_json(loaded):
    r = chat(loaded, "Give me a city as JSON.", format=CITY, temperature=0)
    jsonschema.validate(json.loads(r["text"]), CITY)
    assert r["stopReason"] == "stop"
    # seeded sampling is held to the schema too
    r = chat(loaded, "Give me a city as JSON.", format=CITY, temperature=1.0, seed=5)
    jsonschema.validate(json.loads(r["text"]), CITY)


def test_format_json_regex_and_grammar(loaded):
    r = chat(loaded, 'Reply with the JSON object {"ok": true}.', format="json", temperature=0)
    assert r["text"].startswith("{")
    if r["stopReason"] == "stop":  # (a 135M model may nest objects until maxTokens)
        assert isinstance(json.loads(r["text"]), dict)
    r = chat(loaded, "Is the sky blue?", regex="(Yes|No)[.]", temperature=0)
    assert re.fullmatch("(Yes|No)[.]", r["text"])
    grammar = 'start: "Colour: " COLOUR\nCOLOUR: "red" | "green" | "blue"\n'
    r = loaded.call(
        "inference/generate", {"prompt": "My favourite colour", "options": {"grammar": grammar, "maxTokens": 20}}
    )
    assert r["text"] in {"Colour: red", "Colour: green", "Colour: blue"}


@pytest.mark.parametrize(
    "options,field",
    [
        ({"format": {"type": "nonsense"}}, "options.format"),
        ({"format": 3}, "options.format"),
        ({"grammar": "start: ("}, "options.grammar"),
        ({"regex": "a("}, "options.regex"),
        ({"regex": ""}, "options.regex"),
        ({"topLogprobs": 2}, "options.topLogprobs"),
        ({"logprobs": True, "topLogprobs": 21}, "options.topLogprobs"),
    ],
)
def test_bad_constraints_are_invalid_params_and_the_server_serves_on(loaded, options, field):
    with pytest.raises(RpcError) as info:
        loaded.call("inference/generate", {"prompt": "Hi", "options": options})
    assert info.value.code == -32602
    assert info.value.data["field"] == field
    if field in ("options.grammar", "options.regex") and options[field.split(".")[1]]:
        assert info.value.data["error"]  # llguidance's own message
    assert loaded.call("inference/generate", {"prompt": "Hi", "options": {"maxTokens": 2}})["tokens"]


def test_two_constraints_at_once_are_invalid_params(loaded):
    with pytest.raises(RpcError) as info:
        loaded.call("inference/generate", {"prompt": "Hi", "options": {"format": "json", "regex": "a"}})
    assert info.value.code == -32602 and "at most one" in info.value.message


def test_logprobs_stream_with_the_pieces_and_match_the_result(loaded):
    rid = loaded.request_async(
        "inference/generate",
        {
            "prompt": "The capital of France is",
            "options": {"maxTokens": 8, "ignoreEos": True, "temperature": 0, "logprobs": True, "topLogprobs": 3},
            "partialResultToken": "lp",
        },
    )
    result = loaded.response(rid)["result"]
    entries = result["logprobs"]
    assert [e["token"] for e in entries] == result["tokens"]
    assert "".join(e["text"] for e in entries) == result["text"]
    for e in entries:
        assert e["logprob"] <= 0 and len(e["topLogprobs"]) == 3
        tops = [t["logprob"] for t in e["topLogprobs"]]
        assert tops == sorted(tops, reverse=True)
        assert e["topLogprobs"][0]["token"] == e["token"]  # greedy: the best token is taken
        assert math.isclose(e["topLogprobs"][0]["logprob"], e["logprob"])
    streamed = [x for v in loaded.progress("lp") for x in v.get("logprobs", [])]
    assert streamed == entries
    # without asking: no logprobs anywhere
    plain = loaded.call("inference/generate", {"prompt": "The capital of France is", "options": {"maxTokens": 4}})
    assert "logprobs" not in plain


def test_logprobs_are_the_same_alone_or_among_others(spawn):
    c = spawn()
    c.initialize()
    c.load_model(slots=4, contextLength=512)
    params = {
        "prompt": "Write a haiku about rain.",
        "options": {"maxTokens": 16, "temperature": 0.9, "seed": 3, "logprobs": True, "topLogprobs": 2},
    }
    want = c.call("inference/generate", params)
    others = [
        c.request_async("inference/generate", {"prompt": f"Story {i}: once", "options": {"maxTokens": 30}})
        for i in range(3)
    ]
    got = c.call("inference/generate", params)
    for rid in others:
        c.response(rid)
    assert got["tokens"] == want["tokens"] and got["logprobs"] == want["logprobs"]


# -- tools ----------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from make_tool_model import make_tool_model

    return str(make_tool_model(tmp_path_factory.mktemp("tools") / "smollm2-tools.gguf"))


@pytest.fixture
def tooled(spawn, tool_model):
    c = spawn()
    c.initialize()
    c.call("model/load", {"model": tool_model, "options": {"contextLength": 1024, "slots": 4}}, timeout=60)
    return c


def tool_chat(c, messages, tools, choice=None, **options):
    params = {"messages": messages, "tools": tools, "options": {"maxTokens": 120, "temperature": 0, **options}}
    if choice is not None:
        params["toolChoice"] = choice
    return c.call("inference/chat", params, timeout=60)


def check_calls(calls, tools):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(call["function"]["arguments"], schemas[call["function"]["name"]])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_required_tool_call_always_parses_and_validates(tooled, temperature):
    for seed in range(3):
        r = tool_chat(tooled, ASK, [WEATHER, TIME], "required", temperature=temperature, seed=seed)
        assert r["stopReason"] == "toolCalls" and r["toolCalls"], r
        check_calls(r["toolCalls"], [WEATHER, TIME])


def test_a_named_tool_is_the_one_called(tooled):
    for choice in ("get_time", {"type": "function", "function": {"name": "get_time"}}):
        r = tool_chat(tooled, ASK, [WEATHER, TIME], choice)
        assert {c["function"]["name"] for c in r["toolCalls"]} == {"get_time"}
        check_calls(r["toolCalls"], [TIME])


def test_tool_calls_stream_as_they_complete(tooled):
    rid = tooled.request_async(
        "inference/chat",
        {
            "messages": ASK,
            "tools": [WEATHER],
            "toolChoice": "required",
            "options": {"maxTokens": 120, "temperature": 0},
            "partialResultToken": "calls",
        },
    )
    result = tooled.response(rid, timeout=60)["result"]
    streamed = [c for v in tooled.progress("calls") for c in v.get("toolCalls", [])]
    assert streamed == result["toolCalls"]
    assert "<tool_call>" in "".join(v["text"] for v in tooled.progress("calls"))  # pieces are the raw reply
    assert "<tool_call>" not in result["text"]  # the result's text is the reply without the calls


def test_a_tool_result_fed_back_continues_the_conversation(tooled):
    call = tool_chat(tooled, ASK, [WEATHER], "required")["toolCalls"][0]
    messages = [
        *ASK,
        {"role": "assistant", "content": "", "toolCalls": [call]},
        {"role": "tool", "toolCallId": call["id"], "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    r = tool_chat(tooled, messages, [WEATHER], "none")
    assert r["stopReason"] in ("stop", "length") and r["text"] and "toolCalls" not in r
    r = tool_chat(tooled, messages, [WEATHER])  # auto: the model may answer or call again
    if "toolCalls" in r:
        check_calls(r["toolCalls"], [WEATHER])


def test_a_required_call_is_the_same_alone_or_among_others(tooled):
    want = tool_chat(tooled, ASK, [WEATHER, TIME], "required", temperature=0.8, seed=9)
    others = [
        tooled.request_async("inference/generate", {"prompt": f"Tell me a story {i}", "options": {"maxTokens": 40}})
        for i in range(3)
    ]
    got = tool_chat(tooled, ASK, [WEATHER, TIME], "required", temperature=0.8, seed=9)
    for rid in others:
        tooled.response(rid, timeout=60)
    assert (got["tokens"], got["toolCalls"]) == (want["tokens"], want["toolCalls"])


def test_tools_need_a_template_that_takes_them(loaded):
    with pytest.raises(RpcError) as info:
        tool_chat(loaded, ASK, [WEATHER], "required")
    assert info.value.code == -32602 and "does not support tools" in info.value.message


def test_a_forced_call_whose_schema_does_not_compile_is_invalid_params(tooled):
    """The grammar of forced calls is built from the tools' schemas: one llguidance cannot compile
    is -32602 naming `tools`, with llguidance's message; the server goes on."""
    bad = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 7}}}},
    }
    with pytest.raises(RpcError) as info:
        tool_chat(tooled, ASK, [bad], "required")
    assert info.value.code == -32602 and info.value.message.startswith("tools does not compile")
    assert info.value.data["field"] == "tools" and info.value.data["error"]
    assert tool_chat(tooled, ASK, [WEATHER], "required")["toolCalls"]


def test_a_forced_call_cannot_also_take_a_format(tooled):
    with pytest.raises(RpcError) as info:
        tool_chat(tooled, ASK, [WEATHER], "required", format="json")
    assert info.value.code == -32602 and info.value.data["field"] == "toolChoice"


def test_unknown_tool_choice_is_invalid_params(tooled):
    with pytest.raises(RpcError) as info:
        tool_chat(tooled, ASK, [WEATHER], "get_time")
    assert info.value.code == -32602


def test_parallel_tool_calls_false_is_one_call(tooled):
    """`parallelToolCalls: false` holds a forced reply to exactly one call (the small model,
    free to, calls again and again until maxTokens) and keeps only an auto reply's first."""
    many = tool_chat(tooled, ASK, [WEATHER], "required", maxTokens=80)
    assert len(many["toolCalls"]) > 1 and many["stopReason"] == "toolCalls"
    params = {
        "messages": ASK,
        "tools": [WEATHER, TIME],
        "toolChoice": "required",
        "parallelToolCalls": False,
        "options": {"maxTokens": 80, "temperature": 0},
    }
    one = tooled.call("inference/chat", params, timeout=60)
    assert len(one["toolCalls"]) == 1 and one["text"] == ""
    assert one["usage"]["completionTokens"] < 80  # the grammar ended the reply after the call
    check_calls(one["toolCalls"], [WEATHER, TIME])
    with pytest.raises(RpcError) as info:
        tooled.call("inference/chat", {**params, "parallelToolCalls": "no"})
    assert info.value.code == -32602
