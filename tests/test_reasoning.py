"""A thinking model's reasoning kept apart, through `kinfer-rpc` as a client spawns it: `think`
sets the template's switches, `reasoning` and `text` come apart in results and in streamed
`$/progress`, `maxReasoningTokens` bounds the reasoning, a `format` or a tool grammar holds only
the answer (valid every time), the history keeps or drops earlier reasoning as the template says,
and a model that cannot think refuses `think` with a documented error.

The thinking model is SmolLM2 with Qwen3's template and `<think>`/`</think>` tokens
(tests/modelgen/make_think_model.py); its weights never close the block by themselves, so the
answers here come after a budget forces the end."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from make_think_model import THINK_TEMPLATE, make_think_model
from rpcclient import RpcClient

from kinfer_rpc.client import Client, InvalidParams, NotSupported, Thought
from kinfer_rpc.host import reasoning, templates
from kinfer_rpc.host.store import DEFAULT_MODEL
from kinfer_rpc.protocol import params

pytestmark = pytest.mark.model

CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
    "required": ["name", "country"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Name a city in Europe, as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    return str(make_think_model(tmp_path_factory.mktemp("think") / "smollm2-think.gguf"))


class Thinker:
    """A client with the thinking model loaded: chat() and stream_chat() name it."""

    def __init__(self, client: Client, model: str):
        self.client, self.model = client, model

    def chat(self, messages, **kw):
        return self.client.chat(messages, self.model, **kw)

    def stream_chat(self, messages, **kw):
        return self.client.stream_chat(messages, self.model, **kw)


@pytest.fixture(scope="module")
def kinfer(think_model):
    with Client() as c:
        yield Thinker(c, c.load(think_model, contextLength=1024, slots=4).model)


# -- the template's switches and the prompt (no model) ------------------------------------------
def render(messages, think):
    found = reasoning.Markers(switch=True)
    prompt = templates.render(THINK_TEMPLATE, params.messages(messages), variables=reasoning.switches(found, think))
    return reasoning.prompt_end(found, prompt, think)


def test_think_false_renders_the_template_with_thinking_off():
    prompt, inside = render(ASK, False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not inside
    assert prompt.count("<think>") == 1  # the template's own empty block, not a second one


@pytest.mark.parametrize("think", [None, True, "high"])
def test_thinking_opens_the_block_for_the_reply(think):
    prompt, inside = render(ASK, think)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n") and inside


def test_a_template_that_opens_the_block_itself_is_closed_empty_for_think_false():
    found = reasoning.Markers()
    assert reasoning.prompt_end(found, "x<|im_start|>assistant\n<think>\n", None) == (
        "x<|im_start|>assistant\n<think>\n",
        True,
    )
    closed, inside = reasoning.prompt_end(found, "x<|im_start|>assistant\n<think>\n", False)
    assert closed == "x<|im_start|>assistant\n<think>\n\n</think>\n\n" and not inside


def test_earlier_reasoning_is_dropped_and_the_current_turns_kept_as_the_template_says():
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning": "EARLIER THOUGHT"},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning": "CURRENT THOUGHT",
            "toolCalls": [{"id": "c0", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "toolCallId": "c0", "content": "18 C"},
    ]
    prompt, _ = render(history, None)
    assert "EARLIER THOUGHT" not in prompt
    assert "<think>\nCURRENT THOUGHT\n</think>\n\n" in prompt


def test_the_splitter_gives_what_the_whole_reply_splits_into():
    text = "\n  first thought\n\n more  \n</think>\n\n  answer {x}  "
    rc, ac = text.index("</think>"), text.index("</think>") + len("</think>")
    for cut in range(1, 6):
        s = reasoning.Splitter()
        pieces = [text[i : i + cut] for i in range(0, len(text), cut)]
        parts = [
            # (the engine knows where the block ends once it reads the end's one token)
            s.feed(p, rc if s.seen + len(p) > rc else None, ac if s.seen + len(p) > rc else None)
            for p in pieces
        ]
        assert ("".join(a for a, _ in parts), "".join(b for _, b in parts)) == reasoning.split(text, rc, ac)
    assert reasoning.split(text, rc, ac) == ("first thought\n\n more", "answer {x}  ")


# -- through the server ----------------------------------------------------------------------------
def test_format_after_reasoning_is_valid_json_every_time(kinfer):
    thought = 0
    for seed in range(6):
        budget = 4 + 7 * seed
        r = kinfer.chat(ASK, think=True, format=CITY, maxReasoningTokens=budget, temperature=1.0, seed=seed)
        # the budget then the forced </think>; or less, where the model would have ended its turn
        # inside the block: its end of turn closes the block instead, and the answer follows
        n = r.usage.reasoning_tokens
        assert 1 <= n <= budget + 1 and r.tokens[n - 1] == 9 and 9 not in r.tokens[: n - 1], r
        thought += n == budget + 1 and bool(r.reasoning)
        assert r.stop_reason == "stop", r
        jsonschema.validate(json.loads(r.text), CITY)
        assert "<think>" not in r.reasoning + r.text and "</think>" not in r.reasoning + r.text
    assert thought >= 3


def test_reasoning_and_text_stream_apart_and_add_up_to_the_result(kinfer):
    stream = kinfer.stream_chat(ASK, think="low", format=CITY, maxReasoningTokens=20, temperature=0.0)
    pieces = list(stream)
    thoughts = [p for p in pieces if isinstance(p, Thought)]
    answer = [p for p in pieces if not isinstance(p, Thought)]
    r = stream.result
    assert "".join(thoughts) == stream.reasoning == r.reasoning and r.reasoning
    assert "".join(answer) == stream.text == r.text
    assert pieces.index(answer[0]) > pieces.index(thoughts[-1])  # reasoning first, then the answer
    jsonschema.validate(json.loads(r.text), CITY)


def test_progress_values_carry_reasoning_apart_from_text(think_model):
    with RpcClient.spawn() as c:
        c.initialize()
        c.load_model(think_model, contextLength=512, slots=1)
        rid = c.request_async(
            "inference/chat",
            {
                "messages": ASK,
                "think": True,
                "options": {"maxReasoningTokens": 6, "maxTokens": 20, "temperature": 0},
                "partialResultToken": "p",
            },
        )
        result = c.response(rid, timeout=60)["result"]
        values = c.progress("p")
        refused = c.request("inference/chat", {"model": DEFAULT_MODEL, "messages": ASK, "think": "low"}, timeout=60)
        assert refused["error"]["code"] == -32602 and refused["error"]["data"]["field"] == "think"
        c.close()
    c.assert_clean()  # every message as spec/metaModel.json says
    assert "".join(v.get("reasoning", "") for v in values) == result["reasoning"]
    assert "".join(v["text"] for v in values) == result["text"]
    assert sum(len(v["tokens"]) for v in values) == len(result["tokens"])
    assert result["usage"]["reasoningTokens"] == 7


def test_think_false_gives_no_reasoning(kinfer):
    r = kinfer.chat(ASK, think=False, maxTokens=12, temperature=0)
    assert r.reasoning is None and r.usage.reasoning_tokens == 0 and "think>" not in r.text
    # without a budget nothing bounds the reasoning but maxTokens: all of it is reasoning
    t = kinfer.chat(ASK, maxTokens=12, temperature=0)
    assert t.reasoning and t.text == "" and t.stop_reason == "length" and t.usage.reasoning_tokens == 12


def test_a_forced_tool_call_follows_the_reasoning(kinfer):
    r = kinfer.chat(
        [{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        think=True,
        maxReasoningTokens=10,
        temperature=0.7,
        seed=3,
    )
    assert r.reasoning and r.stop_reason == "toolCalls" and r.tool_calls[0].name == "get_weather"
    message = r.message
    assert message["reasoning"] == r.reasoning
    follow = kinfer.chat(
        [{"role": "user", "content": "Weather in Paris?"}, message, r.tool_calls[0].answer("18 C")],
        tools=[WEATHER],
        think=False,
        maxTokens=8,
        temperature=0,
    )
    assert follow.reasoning is None


def test_the_same_reply_alone_or_among_others(kinfer):
    def ask(seed, drafts=False):
        opts = {"draftPolicy": "ngram"} if drafts else {}
        r = kinfer.chat(ASK, think=True, format=CITY, maxReasoningTokens=5 + seed, temperature=0.8, seed=seed, **opts)
        return r.tokens, r.reasoning, r.text

    alone = [ask(s) for s in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda s: ask(s, drafts=s % 2 == 1), range(4)))
    assert together == alone


# -- refusals --------------------------------------------------------------------------------------
def test_think_on_a_model_that_cannot_think_is_invalid_params(kinfer):
    for given in ({"think": True}, {"think": "high"}, {"maxReasoningTokens": 10}):
        with pytest.raises(InvalidParams) as info:
            kinfer.client.chat(ASK, DEFAULT_MODEL, maxTokens=4, **given)  # ChatML, no <think>
        field = "think" if "think" in given else "options.maxReasoningTokens"
        assert info.value.data["field"] == field and "reasons apart" in info.value.message
    assert kinfer.client.chat(ASK, DEFAULT_MODEL, think=False, maxTokens=4, temperature=0).reasoning is None


def test_reasoning_in_channels_is_refused_as_not_supported(kinfer, tmp_path):
    from make_tool_model import make_tool_model

    harmony = (
        "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>{% endfor %}"
    )
    path = make_tool_model(tmp_path / "channels.gguf", template=harmony + "<|start|>assistant")
    with pytest.raises(NotSupported) as info:
        kinfer.client.chat(ASK, str(path), think="high", maxTokens=4)
    assert info.value.data["field"] == "think" and "channels" in info.value.message


def test_bad_think_values_and_misplaced_budgets_are_invalid_params(kinfer):
    with pytest.raises(InvalidParams) as info:
        kinfer.chat(ASK, think="max", maxTokens=4)
    assert info.value.data == {"field": "think"}
    with pytest.raises(InvalidParams) as info:
        kinfer.client.generate("Hello", kinfer.model, maxReasoningTokens=3, maxTokens=4)
    assert info.value.data == {"field": "options.maxReasoningTokens"}
