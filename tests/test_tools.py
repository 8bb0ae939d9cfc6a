"""Tool calls, host side: the params (messages with calls and results, tools, toolChoice), the
call formats' parsers whole and streamed, the grammars that force calls, and the tool template
of the test model (tests/modelgen/make_tool_model.py). No model is loaded here."""

from __future__ import annotations

import json
import mmap
import os
import re
import struct

import jsonschema
import llguidance as llg
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from make_tool_model import TOOL_TEMPLATE, make_tool_model

from kinfer_rpc import errors
from kinfer_rpc.host import gguf as host_gguf
from kinfer_rpc.host import templates
from kinfer_rpc.host.store import embedded_default_path
from kinfer_rpc.host.tools import (
    FORMATS,
    CallStream,
    ToolChoice,
    call_format,
    call_grammar,
    parse_calls,
    template_supports_tools,
)
from kinfer_rpc.protocol import params

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'The weather in a city } // # " é',
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": 'a city\'s name, e.g. "Paris" } {'},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
# $refs are relative to the parameters' own schema
MAKE = {
    "type": "function",
    "function": {
        "name": "make.thing-2",
        "parameters": {
            "$defs": {"P": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
            "type": "object",
            "properties": {"p": {"$ref": "#/$defs/P"}},
            "required": ["p"],
        },
    },
}
TOOLS = params.tools([WEATHER, TIME, MAKE])
NAMES = {t["function"]["name"] for t in TOOLS}


def call(i, name, args):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


def bad_params(fn, *args, field=None, words=()):
    with pytest.raises(errors.KinferError) as e:
        fn(*args)
    assert e.value.code == errors.INVALID_PARAMS
    if field is not None:
        assert field in e.value.message, e.value.message
    for w in words:
        assert w in e.value.message, e.value.message
    return e.value


# -- params.messages ---------------------------------------------------------------------------------


def test_plain_messages_are_as_before():
    got = params.messages([{"role": "system", "content": "s"}, {"role": "user", "content": "u", "extra": 1}])
    assert got == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    # a tool's result with neither id nor name (and no call before it) stays plain too
    assert params.messages([{"role": "tool", "content": "42"}]) == [{"role": "tool", "content": "42"}]


def test_assistant_tool_calls_are_shaped_for_templates():
    got = params.messages(
        [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "toolCalls": [
                    {
                        "id": "a1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    },
                    {"function": {"name": "get_time", "arguments": {"tz": "CET"}}},
                    {"function": {"name": "get_time"}},
                ],
            },
            {"role": "tool", "toolCallId": "a1", "content": "sunny"},
            {"role": "tool", "content": "12:00"},
            {"role": "tool", "content": "13:00", "name": "explicit"},
            {"role": "assistant", "content": "Sunny.", "toolCalls": None},
            {"role": "assistant", "content": "", "toolCalls": []},
        ]
    )
    assert got[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "a1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
        ],
    }
    assert got[2] == {"role": "tool", "content": "sunny", "tool_call_id": "a1", "name": "get_weather"}
    assert got[3] == {"role": "tool", "content": "12:00", "name": "get_time"}  # by position
    assert got[4] == {"role": "tool", "content": "13:00", "name": "explicit"}
    assert got[5] == {"role": "assistant", "content": "Sunny."}
    assert got[6] == {"role": "assistant", "content": ""}
    json.dumps(got)  # travels to the render worker as JSON


def test_assistant_content_beside_calls_is_kept():
    got = params.messages(
        [{"role": "assistant", "content": "Let me look.", "toolCalls": [{"function": {"name": "f"}}]}]
    )
    assert got[0]["content"] == "Let me look." and got[0]["tool_calls"][0]["function"]["name"] == "f"


@pytest.mark.parametrize(
    "message, field",
    [
        ({"role": "user", "content": "x", "toolCalls": [{"function": {"name": "f"}}]}, "messages[0].toolCalls"),
        ({"role": "assistant", "toolCalls": "f"}, "messages[0].toolCalls"),
        ({"role": "assistant", "toolCalls": [1]}, "messages[0].toolCalls[0]"),
        (
            {"role": "assistant", "toolCalls": [{"type": "code", "function": {"name": "f"}}]},
            "messages[0].toolCalls[0].type",
        ),
        ({"role": "assistant", "toolCalls": [{"function": "f"}]}, "messages[0].toolCalls[0].function"),
        ({"role": "assistant", "toolCalls": [{"function": {"name": ""}}]}, "messages[0].toolCalls[0].function.name"),
        (
            {"role": "assistant", "toolCalls": [{"function": {"arguments": {}}}]},
            "messages[0].toolCalls[0].function.name",
        ),
        (
            {"role": "assistant", "toolCalls": [{"function": {"name": "f", "arguments": "{nope"}}]},
            "messages[0].toolCalls[0].function.arguments",
        ),
        (
            {"role": "assistant", "toolCalls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            "messages[0].toolCalls[0].function.arguments",
        ),
        (
            {"role": "assistant", "toolCalls": [{"function": {"name": "f", "arguments": [1]}}]},
            "messages[0].toolCalls[0].function.arguments",
        ),
        (
            {"role": "assistant", "toolCalls": [{"function": {"name": "f", "arguments": {"x": "\ud800"}}}]},
            "messages[0].toolCalls[0].function.arguments",
        ),
        ({"role": "assistant", "toolCalls": [{"id": 3, "function": {"name": "f"}}]}, "messages[0].toolCalls[0].id"),
        ({"role": "tool"}, "messages[0]"),
        ({"role": "tool", "content": "x", "toolCallId": 5}, "messages[0].toolCallId"),
        ({"role": "tool", "content": "x", "name": ["f"]}, "messages[0].name"),
        ({"role": "assistant", "content": None}, "messages[0]"),
    ],
)
def test_bad_messages_are_32602_naming_the_field(message, field):
    e = bad_params(params.messages, [message], field=field)
    assert e.data is None or e.data["field"].startswith(field)


# -- params.tools and params.tool_choice ---------------------------------------------------------------


def test_tools_are_normalized():
    got = params.tools(
        [
            {"type": "function", "function": {"name": "a.b-c_1", "description": "d", "parameters": {}, "strict": True}},
            {"function": {"name": "x"}},
        ]
    )
    assert got == [
        {"type": "function", "function": {"name": "a.b-c_1", "description": "d", "parameters": {}}},
        {"type": "function", "function": {"name": "x"}},
    ]
    assert params.tools(None) == [] and params.tools([]) == []


@pytest.mark.parametrize(
    "value, field",
    [
        ({"type": "function"}, "tools"),
        ([1], "tools[0]"),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"function": {"name": "has space"}}], "tools[0].function.name"),
        ([{"function": {"name": "x" * 65}}], "tools[0].function.name"),
        ([{"function": {"name": ""}}], "tools[0].function.name"),
        ([{"function": {"name": "f"}}, {"function": {"name": "f"}}], "tools[1].function.name"),
        ([{"function": {"name": "f", "parameters": "object"}}], "tools[0].function.parameters"),
        ([{"function": {"name": "f", "parameters": ["x"]}}], "tools[0].function.parameters"),
        ([{"function": {"name": "f", "description": 3}}], "tools[0].function.description"),
        ([{"function": {"name": "f", "description": "\udc00"}}], "tools[0].function.description"),
        ([{"function": {"name": f"f{i}"}} for i in range(129)], "tools"),
    ],
)
def test_bad_tools_are_32602_naming_the_field(value, field):
    bad_params(params.tools, value, field=field)


def test_128_tools_are_fine():
    assert len(params.tools([{"function": {"name": f"f{i}"}} for i in range(128)])) == 128


def test_tool_choice():
    tools = params.tools([WEATHER, TIME])
    assert params.tool_choice(None, tools) == ToolChoice("auto")
    assert params.tool_choice(None, []) == ToolChoice("none")
    for word in ("auto", "none", "required"):
        assert params.tool_choice(word, tools) == ToolChoice(word)
    assert params.tool_choice("get_time", tools) == ToolChoice("function", "get_time")
    obj = {"type": "function", "function": {"name": "get_weather"}}
    assert params.tool_choice(obj, tools) == ToolChoice("function", "get_weather")
    # a tool named like a word is named with the object form
    named_none = params.tools([{"function": {"name": "none"}}])
    assert params.tool_choice("none", named_none) == ToolChoice("none")
    assert params.tool_choice({"function": {"name": "none"}}, named_none) == ToolChoice("function", "none")


def test_bad_tool_choice():
    tools = params.tools([WEATHER, TIME])
    e = bad_params(params.tool_choice, "get_wether", tools, words=("get_wether", "get_weather, get_time"))
    assert e.data == {"field": "toolChoice", "available": ["get_weather", "get_time"]}
    bad_params(params.tool_choice, {"type": "function", "function": {"name": "nope"}}, tools, words=("get_weather",))
    bad_params(params.tool_choice, "required", [], field="toolChoice")
    bad_params(params.tool_choice, "get_time", [], field="toolChoice")
    bad_params(params.tool_choice, 3, tools, field="toolChoice")
    bad_params(params.tool_choice, {"type": "function", "function": "x"}, tools, field="toolChoice")
    bad_params(
        params.tool_choice, {"type": "function", "function": {"name": 1}}, tools, field="toolChoice.function.name"
    )


# -- templates ---------------------------------------------------------------------------------------


def test_template_support_and_format():
    smol = host_gguf.read(embedded_default_path()).chat_template
    # SmolLM2-135M-Instruct's own template is plain ChatML: it never reads `tools`
    assert smol and not template_supports_tools(smol)
    assert not template_supports_tools(None) and not template_supports_tools(templates.CHATML)
    assert template_supports_tools(TOOL_TEMPLATE) and call_format(TOOL_TEMPLATE) == "hermes"
    assert call_format("{% for m in messages %}[TOOL_CALLS]{{ m.tool_calls|tojson }}{% endfor %}") == "mistral"
    assert call_format("{{ '<|python_tag|>' }}{% if tools %}{% endif %}") == "llama3"
    assert call_format("{% if message.role == 'ipython' %}{% endif %}") == "llama3"
    assert call_format("{% if tools %}{{ tools|tojson }}{% endif %}") == "json"
    assert call_format(None) == "json"


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Nice?"},
    {
        "role": "assistant",
        "toolCalls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"function": {"name": "get_weather", "arguments": {"city": "Nice", "note": "<b> & 'q' é"}}},
        ],
    },
    {"role": "tool", "toolCallId": "c1", "content": "sunny"},
    {"role": "tool", "content": "rain"},
    {"role": "assistant", "content": "Sunny in Paris, rain in Nice."},
    {"role": "user", "content": "Thanks"},
]


def test_tool_template_renders_tools_calls_and_results():
    text = templates.render(TOOL_TEMPLATE, params.messages(CHAT), tools=params.tools([WEATHER, TIME]))
    tool_lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in params.tools([WEATHER, TIME]))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert f"<tools>\n{tool_lines}\n</tools>" in text  # tojson as Hugging Face's: keys in order, no escapes
    assert (
        "<|im_start|>user\nWeather in Paris and Nice?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice", "note": "<b> & \'q\' é"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n"
        "<|im_start|>assistant\nSunny in Paris, rain in Nice.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"
    ) in text
    # the calls the template writes are the calls the parser reads back
    reply = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_calls(reply, call_format(TOOL_TEMPLATE), NAMES)
    assert content == "" and [c["function"]["arguments"]["city"] for c in calls] == ["Paris", "Nice"]


def test_tool_template_without_tools_is_smollm2s_own():
    smol = host_gguf.read(embedded_default_path()).chat_template
    for chat in ([{"role": "user", "content": "hi"}], [{"role": "system", "content": "s"}, *CHAT[-2:]]):
        msgs = params.messages(chat)
        assert templates.render(TOOL_TEMPLATE, msgs) == templates.render(smol, msgs)


def test_sandbox_tojson_and_arguments_text():
    msgs = params.messages(CHAT[2:3])
    out = templates.render(
        "{% for c in messages[0].tool_calls %}{{ c.function.arguments }}|{{ c.function.arguments | tojson }}"
        "|{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }};{% endfor %}@@{% endfor %}"
        "{{ tools[0] | tojson(indent=1) }}@@{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}",
        msgs,
        tools=[{"b": 1, "a": "<&>"}],
    )
    assert out.split("@@") == [
        '{"city": "Paris"}|{"city": "Paris"}|city=Paris;',
        '{"city": "Nice", "note": "<b> & \'q\' é"}|{"city": "Nice", "note": "<b> & \'q\' é"}'
        "|city=Nice;note=<b> & 'q' é;",
        '{\n "b": 1,\n "a": "<&>"\n}',
        '[{"a":"<&>","b":1}]',
    ]
    bad_params(templates.render, "{{ tools | tojson(indent=100) }}", msgs, words=("indent",))
    with pytest.raises(errors.KinferError) as e:  # the arguments are as immutable as the rest
        templates.render("{{ messages[0].tool_calls[0].function.arguments.update({'x': 1}) }}", msgs)
    assert e.value.code == errors.NOT_SUPPORTED
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


# -- the test model ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """SmolLM2-135M-Instruct with TOOL_TEMPLATE as its chat template (a few seconds to write)."""
    return make_tool_model(tmp_path_factory.mktemp("tool-model") / "smollm2-tools.gguf")


def test_tool_model_is_smollm2_with_the_tool_template(tool_model):
    src, dst = embedded_default_path(), tool_model
    a, b = host_gguf.read(src), host_gguf.read(dst)
    assert b.chat_template == TOOL_TEMPLATE and template_supports_tools(b.chat_template)
    for field in ("architecture", "name", "context_length", "quantization", "parameters", "tensor_count", "n_vocab"):
        assert getattr(a, field) == getattr(b, field), field
    assert (a.hparams, a.weight_bytes) == (b.hparams, b.weight_bytes)
    n = a.weight_bytes  # the tensor data: the same bytes at the end of both files
    with open(src, "rb") as f, open(dst, "rb") as g:
        f.seek(-n, os.SEEK_END)
        g.seek(-n, os.SEEK_END)
        while chunk := f.read(1 << 22):
            assert chunk == g.read(len(chunk))
    vocab = gguf_arrays(dst, "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    assert vocab == gguf_arrays(src, "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


# -- parsing -------------------------------------------------------------------------------------------

W_PARIS = {"city": "Paris"}
PARSE_CASES = [
    # (format, reply, content, [(name, arguments)])
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "parameters": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>',
        "Let me check.",
        [("get_weather", W_PARIS), ("get_time", {"tz": "CET"})],
    ),
    (  # a list in one block; no arguments; a block left open at the end
        "hermes",
        '<tool_call>[{"name": "get_time"}, {"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": null}',
        "",
        [("get_time", {}), ("get_weather", W_PARIS), ("get_time", {})],
    ),
    (  # blocks left open, each ended by the next
        "hermes",
        '<tool_call>{"name": "get_time"}\n<tool_call>{"name": "make.thing-2", "arguments": {"p": {"x": 1}}}\n',
        "",
        [("get_time", {}), ("make.thing-2", {"p": {"x": 1}})],
    ),
    (  # unknown tool, broken JSON, not a call, arguments not an object: all stay content
        "hermes",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> '
        '<tool_call>{"name": "get_time", "arguments": {</tool_call> '
        '<tool_call>{"name": "get_time", "results": []}</tool_call> '
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call> '
        '<tool_call>{"name": "get_time", "arguments": "{oops"}</tool_call>',
        None,
        [],
    ),
    (  # OpenAI's own shape inside a block; a bad block beside a good one stays content
        "hermes",
        'A <tool_call>{"type": "function", "function": {"name": "get_time", "arguments": "{}"}}</tool_call> B '
        "<tool_call>nope</tool_call> C",
        "A  B <tool_call>nope</tool_call> C",
        [("get_time", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", W_PARIS), ("get_time", {})],
    ),
    (  # the newer syntax, with and without a call id
        "mistral",
        'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}',
        "Sure.",
        [("get_weather", W_PARIS), ("get_time", {})],
    ),
    (  # a list with one non-call is no call; an unknown name in the newer syntax neither
        "mistral",
        '[TOOL_CALLS][{"name": "get_time"}, {"name": "rm"}] [TOOL_CALLS]rm[ARGS]{} [TOOL_CALLS] text',
        None,
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS]{"name": "get_time", "arguments": {}} [{"name": "get_time", "arguments": {"a": 1}}] tail',
        "tail",
        [("get_time", {}), ("get_time", {"a": 1})],
    ),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", W_PARIS)]),
    (
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
        [("get_weather", W_PARIS), ("get_time", {})],
    ),
    (  # several bare objects; `parameters` and `arguments` both read
        "llama3",
        ' {"name": "get_time", "parameters": {}}\n{"name": "get_weather", "arguments": {"city": "Paris"}} ',
        "",
        [("get_time", {}), ("get_weather", W_PARIS)],
    ),
    ("llama3", 'The JSON is {"name": "get_time", "parameters": {}}.', None, []),  # not a reply of calls
    ("json", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [("get_weather", W_PARIS)]),
    (
        "json",
        'Calling:\n```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time"}]'
        "\n```\nDone.",
        "Calling:\n\nDone.",
        [("get_weather", W_PARIS), ("get_time", {})],
    ),
    ("json", '```\n{"name": "get_time", "arguments": "{}"}\n```', "", [("get_time", {})]),
    ("json", '{"name": "get_weather", "result": "sunny"}', None, []),  # JSON, but not a call
    ("json", '{"name": "get_weather", "arguments": {}, "parameters": {}}', None, []),
    ("json", '[{"name": "get_time"}, 3]', None, []),
    ("json", "[]", None, []),
    ("json", '{"name": "get_time"', None, []),
    ("json", "", None, []),
    ("json", "[" * 5000 + "]" * 5000, None, []),  # deep nesting
    ("json", '{"name": "get_time", "arguments": {"n": ' + "9" * 5000 + "}}", None, []),  # past int's digit limit
    # the generic syntax when the format's markup has no call
    ("hermes", '{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
    ("mistral", 'x\n```json\n{"name": "get_time"}\n```', "x", [("get_time", {})]),
    ("hermes", '<tool_call>{"name": "rm"}</tool_call> {"name": "get_time"}', None, []),
    ("unknown-format", '{"name": "get_time"}', "", [("get_time", {})]),
]


@pytest.mark.parametrize("fmt, text, content, calls", PARSE_CASES)
def test_parse_calls(fmt, text, content, calls):
    got_content, got = parse_calls(text, fmt, NAMES)
    assert got == [call(i, n, a) for i, (n, a) in enumerate(calls)]
    assert got_content == (text if content is None else content)


def test_only_the_given_names_are_calls():
    text = '<tool_call>{"name": "get_time"}</tool_call>'
    assert parse_calls(text, "hermes", set()) == (text, [])
    assert parse_calls(text, "hermes", {"get_time"})[1] == [call(0, "get_time", {})]


# -- streaming -----------------------------------------------------------------------------------------


def stream(text, fmt, cuts, names=NAMES):
    s = CallStream(fmt, names)
    calls, at = [], []
    bounds = sorted(set(cuts) | {0, len(text)})
    for a, b in zip(bounds, bounds[1:]):
        new = s.feed(text[a:b])
        calls += new
        at += [b] * len(new)
    calls += s.finish()
    assert s.finish() == []
    return calls, at


def test_a_stream_gives_each_call_when_its_markup_closes():
    text = PARSE_CASES[0][1]
    calls, at = stream(text, "hermes", range(len(text)))
    first_close = text.index("</tool_call>") + len("</tool_call>")
    assert at == [first_close, len(text)] and calls == parse_calls(text, "hermes", NAMES)[1]
    text = PARSE_CASES[6][1]  # mistral's newer syntax: at each call's closing brace
    calls, at = stream(text, "mistral", range(len(text)))
    assert at == [text.index("}") + 1, len(text)] and len(calls) == 2


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(PARSE_CASES), data=st.data())
def test_stream_gives_parse_calls_calls_whatever_the_split(case, data):
    fmt, text = case[0], case[1]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=40))
    assert stream(text, fmt, cuts)[0] == parse_calls(text, fmt, NAMES)[1]


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    "```json\n",
    "```",
    "[ARGS]",
    "[CALL_ID]x1",
    "get_time",
    "rm",
    '{"name": "get_time"}',
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "get_weather", "parameters": "{\\"city\\": \\"<tool_call>\\"}"}',
    '{"name": "rm", "arguments": {}}',
    '{"city": "Nice"}',
    "[",
    "]",
    "{",
    "}",
    '"',
    "\\",
    ";",
    ",",
    "\n",
    " ",
    "text",
    "<tool_c",
    "[TOOL_",
    "1",
    "null",
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from([*FORMATS, "other"]),
    pieces=st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=14),
    data=st.data(),
)
def test_any_text_parses_without_raising_and_streams_the_same(fmt, pieces, data):
    text = "".join(pieces)
    content, calls = parse_calls(text, fmt, NAMES)
    assert isinstance(content, str) and all(c["function"]["name"] in NAMES for c in calls)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 1))
    assert stream(text, fmt, cuts)[0] == calls


def forced(fmt, calls):
    """Calls exactly as call_grammar writes them."""
    if fmt == "llama3":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if fmt == "json":
        objs = [{"name": n, "arguments": a} for n, a in calls]
        return json.dumps(objs[0] if len(objs) == 1 else objs)
    return markup(fmt, calls)


def markup(fmt, calls):
    """Calls as a model of the format writes them."""
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    if fmt == "llama3":
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return "```json\n" + json.dumps([{"name": n, "arguments": a} for n, a in calls]) + "\n```"


# no markup inside the arguments' strings: "</tool_call>" or "```" there would end a block early
texts = st.text(alphabet=st.characters(blacklist_characters="<`"), max_size=10)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(texts, json_values, max_size=4)


@settings(max_examples=200, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    calls=st.lists(st.tuples(st.sampled_from(sorted(NAMES)), arguments), min_size=1, max_size=4),
    before=st.text(max_size=20).filter(lambda t: not re.search(r"[<\[`{]", t)),
    data=st.data(),
)
def test_calls_round_trip_through_their_markup(fmt, calls, before, data):
    text = before + markup(fmt, calls)
    content, got = parse_calls(text, fmt, NAMES)
    assert got == [call(i, n, a) for i, (n, a) in enumerate(calls)]
    assert content == before.strip()
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=30))
    assert stream(text, fmt, cuts)[0] == got


# -- grammars ------------------------------------------------------------------------------------------


class ByteTokens:
    """A byte-level vocabulary for llguidance: token i < 256 is byte i, then EOS, then `extra`
    special tokens (llguidance marks a special token's bytes with a 0xFF prefix)."""

    def __init__(self, extra=()):
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"] + [b"\xff" + e.encode() for e in extra]
        self.eos_token_id = 256
        self.bos_token_id = None
        self.special_token_ids = list(range(256, 257 + len(extra)))

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


SPECIAL = {"<tool_call>": 257, "</tool_call>": 258, "[TOOL_CALLS]": 259}
BYTES = llg.LLTokenizer(llg.TokenizerWrapper(ByteTokens(list(SPECIAL))))


def gguf_arrays(path, *keys):
    """The arrays `keys` of a GGUF's header (strings as bytes), read in a few lines: gguf's own
    reader takes seconds over SmolLM2's vocabulary."""
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    out = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:

        def string(pos):
            (n,) = struct.unpack_from("<Q", m, pos)
            return bytes(m[pos + 8 : pos + 8 + n]), pos + 8 + n

        _, _, _, n_kv = struct.unpack_from("<4sIQQ", m, 0)
        pos = 24
        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", m, pos)
            pos += 4
            value: object = None
            if vtype == 8:
                _, pos = string(pos)
            elif vtype == 9:
                sub, n = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if sub == 8:
                    value = []
                    for _ in range(n):
                        item, pos = string(pos)
                        value.append(item)
                else:
                    value = struct.unpack_from(f"<{n}{'BbHhIif?'[sub] if sub < 8 else 'Qqd'[sub - 10]}", m, pos)
                    pos += n * sizes[sub]
            else:
                pos += sizes[vtype]
            if key.decode() in keys:
                out[key.decode()] = value
    return out


def _gpt2_bytes():
    """GPT-2's byte-level BPE spells byte b as the character bytes_to_unicode()[b]; the inverse."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@pytest.fixture(scope="session")
def smol_tokens():
    """llguidance's tokenizer of SmolLM2's vocabulary, control tokens special as the engine's has
    them; its BPE (for the tokens a grammar forces) is rebuilt with `tokenizers` from the GGUF."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    a = gguf_arrays(
        embedded_default_path(), "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"
    )
    pieces = [t.decode() for t in a["tokenizer.ggml.tokens"]]
    merges = [tuple(m.decode().split(" ", 1)) for m in a["tokenizer.ggml.merges"]]
    bpe = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    byte = _gpt2_bytes()
    special = [kind == 3 for kind in a["tokenizer.ggml.token_type"]]
    tokens = [b"\xff" + p.encode() if sp else bytes(byte[c] for c in p) for p, sp in zip(pieces, special)]

    class Wrapped:
        def __init__(self):
            self.tokens = tokens
            self.eos_token_id = pieces.index("<|im_end|>")
            self.bos_token_id = None
            self.special_token_ids = [i for i, sp in enumerate(special) if sp]

        def __call__(self, text):
            if isinstance(text, bytes):
                text = text.decode("utf-8", "replace")
            return bpe.encode(text, add_special_tokens=False).ids

    tok = llg.LLTokenizer(llg.TokenizerWrapper(Wrapped()))
    text = '<tool_call>\n{"name": "x"}\n</tool_call> é'
    assert tok.decode_str(tok.tokenize_str(text)) == text
    return tok


def matcher(grammar, tok=BYTES):
    g = llg.LLMatcher.grammar_from_lark(grammar)
    assert llg.LLMatcher.validate_grammar(g, tok) == ""
    m = llg.LLMatcher(tok, g, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(grammar, text_or_ids, tok=BYTES):
    """Whether the grammar takes exactly this reply (then end of generation)."""
    m = matcher(grammar, tok)
    ids = text_or_ids if isinstance(text_or_ids, list) else tok.greedy_tokenize(text_or_ids)
    return m.consume_tokens(ids) and m.is_accepting() and m.consume_token(tok.eos_token) and not m.is_error()


CHOICES = [ToolChoice("required"), ToolChoice("function", "get_weather"), ToolChoice("function", "make.thing-2")]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: c.name or c.mode)
@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "single"])
def test_grammar_compiles(fmt, choice, parallel):
    g = call_grammar(TOOLS, choice, fmt, parallel=parallel)
    assert llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(g)) == ""
    assert llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(g), BYTES) == ""


GOOD = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Nice", "days": 3})]
MIXED = [("get_time", {"tz": "CET", "n": [1, 2.5, None]}), ("make.thing-2", {"p": {"x": -1.5}}), *GOOD]


@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_takes_calls_and_they_parse_back(fmt):
    required = call_grammar(TOOLS, ToolChoice("required"), fmt)
    named = call_grammar(TOOLS, ToolChoice("function", "get_weather"), fmt)
    single = call_grammar(TOOLS, ToolChoice("required"), fmt, parallel=False)
    for calls, ok_named in ([GOOD[:1], True], [GOOD, True], [MIXED[:1], False], [MIXED, False]):
        text = forced(fmt, calls)
        assert accepts(required, text), (fmt, text)
        assert accepts(named, text) == ok_named, (fmt, text)
        assert accepts(single, text) == (len(calls) == 1), (fmt, text)
        assert parse_calls(text, fmt, NAMES) == ("", [call(i, n, a) for i, (n, a) in enumerate(calls)])
    if fmt == "json":  # a list of one call too
        assert accepts(required, json.dumps([{"name": "get_time", "arguments": {}}]))
        assert not accepts(single, json.dumps([{"name": "get_time", "arguments": {}}]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_refuses_what_is_not_such_calls(fmt):
    g = call_grammar(TOOLS, ToolChoice("required"), fmt)
    one = forced(fmt, GOOD[:1])
    assert accepts(g, one)
    wrong = [
        "",
        "Sure! " + one,  # text before
        one + " ",  # after
        one.replace('"Paris"', "1"),  # city must be a string
        one.replace('{"city": "Paris"}', "{}"),  # city is required
        one.replace('{"city": "Paris"}', '{"city": "Paris", "days": 9}'),  # days <= 7
        one.replace('{"city": "Paris"}', '{"city":"Paris"}'),  # the JSON is written as the templates write it
        one.replace("get_weather", "rm_rf"),  # unknown tool
        one.replace("get_weather", "get_time").replace('{"city": "Paris"}', "[1]"),  # arguments are an object
    ]
    for text in wrong:
        assert text == "" or text != one
        assert not accepts(g, text), (fmt, text)


def test_grammar_with_special_markers():
    g = call_grammar(TOOLS, ToolChoice("required"), "hermes", special=SPECIAL)
    body = list(b'\n{"name": "get_time", "arguments": {}}\n')
    assert accepts(g, [257, *body, 258])
    assert accepts(g, [257, *body, 258, *b"\n", 257, *body, 258])
    assert not accepts(g, list(b"<tool_call>") + body + list(b"</tool_call>"))  # spelt, not the token
    g = call_grammar(TOOLS, ToolChoice("required"), "mistral", special=SPECIAL)
    assert accepts(g, [259, *b'[{"name": "get_time", "arguments": {}}]'])
    assert not accepts(g, list(b'[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'))


def test_grammar_refuses_choices_that_force_nothing():
    for choice in (ToolChoice("auto"), ToolChoice("none"), ToolChoice("function", "nope")):
        with pytest.raises(ValueError):
            call_grammar(TOOLS, choice, "hermes")
    with pytest.raises(ValueError):
        call_grammar([], ToolChoice("required"), "hermes")


def test_a_schema_llguidance_cannot_compile_fails_validation():
    bad = params.tools(
        [{"function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 7}}}}}]
    )
    g = call_grammar(bad, ToolChoice("required"), "hermes")
    assert llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_lark(g)) != ""


# Tools whose calls a random walk finishes quickly: enums, booleans, bounded integers.
WALK_TOOLS = params.tools(
    [
        {
            "function": {
                "name": "set_unit",
                "parameters": {
                    "type": "object",
                    "properties": {"unit": {"enum": ["c", "f", "k\u00e9"]}, "ok": {"type": "boolean"}},
                    "required": ["unit", "ok"],
                    "additionalProperties": False,
                },
            }
        },
        {
            "function": {
                "name": "pick",
                "parameters": {
                    "type": "object",
                    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["n"],
                    "additionalProperties": False,
                },
            }
        },
    ]
)


def walk(grammar, tok, rng, steps=400):
    """A reply the grammar forces, each token drawn at random among those it allows; None when it
    ran past `steps` tokens."""
    m = matcher(grammar, tok)
    ids = []
    for _ in range(steps):
        allowed = np.flatnonzero(np.frombuffer(m.compute_logit_bias(), np.uint8))
        assert len(allowed), m.get_error()
        t = int(rng.choice(allowed))
        if t == tok.eos_token:
            assert m.is_accepting()
            return tok.decode_bytes(ids).decode("utf-8")
        assert m.consume_token(t), m.get_error()
        ids.append(t)
    return None


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_reply_the_grammar_forces_parses_to_valid_calls(fmt, smol_tokens):
    names = {t["function"]["name"] for t in WALK_TOOLS}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in WALK_TOOLS}
    rng = np.random.default_rng(sum(map(ord, fmt)))
    for choice in (ToolChoice("required"), ToolChoice("function", "pick")):
        g = call_grammar(WALK_TOOLS, choice, fmt)
        done = 0
        for tok in (BYTES, smol_tokens):
            for _ in range(6):
                text = walk(g, tok, rng)
                if text is None:
                    continue
                content, calls = parse_calls(text, fmt, names)
                assert content == "" and calls, (fmt, text)
                for c in calls:
                    fn = c["function"]
                    assert choice.mode == "required" or fn["name"] == choice.name
                    jsonschema.validate(fn["arguments"], schemas[fn["name"]])
                assert stream(text, fmt, range(0, len(text), 3), names)[0] == calls
                done += 1
        assert done >= 6


def test_calls_in_smollm2s_tokens(smol_tokens):
    g = call_grammar(TOOLS, ToolChoice("required"), "hermes")
    text = markup("hermes", GOOD)
    ids = smol_tokens.greedy_tokenize(text)
    assert len(ids) < len(text.encode())  # multi-byte tokens
    assert accepts(g, ids, smol_tokens)
    assert not accepts(g, smol_tokens.greedy_tokenize(text.replace('"Paris"', "75")), smol_tokens)
    assert not accepts(g, ids + smol_tokens.greedy_tokenize(" "), smol_tokens)
