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
