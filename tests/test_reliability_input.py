"""Reliability: bad input, the boundaries the fuzzers do not pin down.

What test_fuzz.py and test_protocol.py already cover (framing fuzz, params fuzz, most error paths) is
not repeated: here are prompts of 0 tokens and of the whole context through each inference method,
and the largest accepted and smallest refused numbers.

Each test drives a real `kinfer-rpc` process through tests/rpcclient.py (which checks that stdout
carries nothing but frames and that every message matches spec/metaModel.json); docs/reliability.md
describes each test and the figures measured. Shared helpers: reliability_helpers.py, conftest.py.
"""

from __future__ import annotations

import time

import pytest
from reliability_helpers import (
    CONTEXT_OVERFLOW,
    GREEDY,
    INT31,
    INVALID_PARAMS,
    SEED_MAX,
    chat,
    no_traceback,
    tokens_of,
)
from rpcclient import DEFAULT_MODEL, RpcClient, error_of, result_of


@pytest.fixture(scope="module")
def small():
    """One server with the embedded model loaded small: two slots of 256 cells."""
    c = RpcClient.spawn()
    try:
        c.initialize()
        info = c.load_model(contextLength=256, slots=2)
        c.context = info["contextLength"]
        yield c
    finally:
        c.close(timeout=5, check=False)
    c.assert_clean()
    no_traceback(c)


@pytest.mark.model
def test_zero_token_prompts_are_32602_through_every_inference_method(small):
    c = small
    assert c.call("inference/tokenize", {"text": ""}) == {"tokens": [], "pieces": []}
    for params in (
        {"prompt": ""},
        {"prompt": "", "addSpecial": False},
        {"tokens": []},
        {"tokens": [], "addSpecial": True},
    ):
        err = error_of(c.request("inference/generate", {**params, "options": {"maxTokens": 2}}))
        assert err["code"] == INVALID_PARAMS, (params, err)
    assert (
        error_of(c.request("inference/chat", {"messages": [], "options": {"maxTokens": 2}}))["code"] == INVALID_PARAMS
    )
    # A chat whose messages are all empty still has the template's tokens: it is answered.
    r = result_of(c.request("inference/chat", chat("")))
    assert r["usage"]["promptTokens"] > 0
    # The server goes on serving.
    assert result_of(c.request("inference/generate", {"prompt": "Hi", "options": {"maxTokens": 2}}))


@pytest.mark.model
def test_prompts_of_the_whole_context_are_31002_through_every_inference_method(small):
    c = small
    ctx = c.context
    # tokens: ctx - 1 fits (one cell left for the reply), ctx does not
    fits = [504] * (ctx - 1)
    r = result_of(c.request("inference/generate", {"tokens": fits, "options": {"maxTokens": 5, **GREEDY}}))
    assert r["usage"]["promptTokens"] == ctx - 1
    assert len(r["tokens"]) == 1 and r["stopReason"] in ("length", "stop")  # the slot is full after one
    for n in (ctx, ctx + 1, 10 * ctx):
        err = error_of(c.request("inference/generate", {"tokens": [504] * n, "options": {"maxTokens": 2}}))
        assert err["code"] == CONTEXT_OVERFLOW and err["data"] == {"promptTokens": n, "contextLength": ctx}, err
    # prompt text
    text = "hello " * (ctx + 10)
    n = len(tokens_of(c, text))
    assert n >= ctx
    err = error_of(c.request("inference/generate", {"prompt": text, "options": {"maxTokens": 2}}))
    assert err["code"] == CONTEXT_OVERFLOW and err["data"] == {"promptTokens": n, "contextLength": ctx}
    # chat: the rendered template counts
    err = error_of(c.request("inference/chat", chat("hello " * ctx)))
    assert err["code"] == CONTEXT_OVERFLOW
    assert err["data"]["contextLength"] == ctx and err["data"]["promptTokens"] > ctx
    # a chat a little under the context is answered
    r = result_of(c.request("inference/chat", chat("hello " * (ctx // 2))))
    assert ctx // 2 < r["usage"]["promptTokens"] < ctx


@pytest.mark.model
def test_a_huge_prompt_is_refused_quickly_and_the_server_goes_on(small):
    c = small
    t = time.monotonic()
    err = error_of(
        c.request("inference/generate", {"prompt": "lorem ipsum " * 200_000, "options": {"maxTokens": 1}}, timeout=60)
    )  # 2.4 MB of text, ~400k tokens: refused on its size before it is tokenized
    assert err["code"] == CONTEXT_OVERFLOW and err["data"]["promptBytes"] == 2_400_000
    err = error_of(
        c.request("inference/generate", {"tokens": [504] * 300_000, "options": {"maxTokens": 1}}, timeout=60)
    )
    assert err["code"] == CONTEXT_OVERFLOW and err["data"]["promptTokens"] == 300_000
    err = error_of(c.request("inference/chat", chat("lorem ipsum " * 100_000), timeout=60))
    assert err["code"] == CONTEXT_OVERFLOW
    assert time.monotonic() - t < 30
    assert result_of(c.request("inference/generate", {"prompt": "Hi", "options": {"maxTokens": 2}}))


@pytest.mark.model
@pytest.mark.parametrize("method", ["inference/generate", "inference/chat"])
@pytest.mark.parametrize(
    "option, value",
    [
        ("maxTokens", -1),
        ("maxTokens", -(2**63)),
        ("maxTokens", INT31 + 1),
        ("maxTokens", 10**30),
        ("maxTokens", 1e300),
        ("temperature", -0.0001),
        ("temperature", 100.0001),
        ("temperature", 1e308),
        ("temperature", -1e308),
        ("topK", -1),
        ("topK", INT31 + 1),
        ("topK", 10**100),
        ("topP", -1e-9),
        ("topP", 1.0000001),
        ("minP", 1e30),
        ("repeatPenalty", -1),
        ("repeatPenalty", 1e300),
        ("repeatLastN", -2),
        ("repeatLastN", INT31 + 1),
        ("seed", -1),
        ("seed", SEED_MAX + 1),
        ("seed", 4363940103922254300),  # a JavaScript number would read it as another seed
        ("seed", 2**64),
        ("seed", 10**40),
        ("drafts", -1),
        ("drafts", 65),
        ("drafts", 2**70),
    ],
)
def test_out_of_range_numbers_are_32602_naming_the_field(small, method, option, value):
    base = {"prompt": "Hi"} if method == "inference/generate" else {"messages": [{"role": "user", "content": "Hi"}]}
    err = error_of(small.request(method, {**base, "options": {"maxTokens": 2, option: value}}))
    assert err["code"] == INVALID_PARAMS, err
    assert err["data"] == {"field": f"options.{option}"}, err


@pytest.mark.model
@pytest.mark.parametrize(
    "options",
    [
        {"maxTokens": INT31, "stop": "."},  # the largest maxTokens: ends at the slot's end or a stop
        {"seed": SEED_MAX, "temperature": 0.7},
        {"seed": 0, "temperature": 100},
        {"topK": INT31, "temperature": 0.5, "seed": 1},
        {"repeatLastN": INT31, "repeatPenalty": 100, "seed": 2},
        {"repeatLastN": -1, "repeatPenalty": 0.01, "seed": 3},
        {"topP": 0, "minP": 1, "temperature": 1, "seed": 4},
        {"temperature": 1e-300, "seed": 5},
    ],
)
def test_extreme_but_valid_numbers_are_served(small, options):
    c = small
    prompt = [504] * (c.context - 40)  # the slot holds 40 more tokens, so maxTokens 2^31-1 ends soon
    r = result_of(
        c.request("inference/generate", {"tokens": prompt, "options": {"maxTokens": 6, **options}}, timeout=60)
    )
    assert r["usage"]["completionTokens"] == len(r["tokens"]) <= 40
    if "seed" in options:
        assert r["seed"] == options["seed"]
    # ... and the model still serves the next request
    assert result_of(c.request("inference/generate", {"prompt": "Hi", "options": {"maxTokens": 2, **GREEDY}}))


@pytest.mark.parametrize(
    "options, field",
    [
        ({"contextLength": 15}, "options.contextLength"),
        ({"contextLength": 2**24 + 1}, "options.contextLength"),
        ({"contextLength": 2**64}, "options.contextLength"),
        ({"slots": 1025}, "options.slots"),
        ({"batch": 2**20 + 1}, "options.batch"),
        ({"ubatch": 0}, "options.ubatch"),
        ({"threads": 0}, "options.threads"),
        ({"threads": 10**9}, "options.threads"),
        ({"gpuLayers": -2}, "options.gpuLayers"),
        ({"maxQueue": 0}, "options.maxQueue"),
        ({"drafts": 65}, "options.drafts"),
    ],
)
def test_out_of_range_load_options_are_32602(bare, options, field):
    # The model is not loaded, so the options are really checked (and nothing is allocated).
    err = error_of(bare.request("model/load", {"model": DEFAULT_MODEL, "options": options}))
    assert err["code"] == INVALID_PARAMS and err["data"] == {"field": field}, err
    assert bare.call("model/status") == {"models": []}


@pytest.mark.model
def test_more_slots_than_llama_cpp_runs_is_32602_before_the_weights_are_read(bare):
    """llama.cpp makes no context of more than 256 sequences: the load says so at once, naming the
    option, and leaves nothing behind (it was a failed context after the weights, with a traceback)."""
    err = error_of(
        bare.request("model/load", {"model": DEFAULT_MODEL, "options": {"slots": 257, "contextLength": 64}}, timeout=60)
    )
    assert err["code"] == INVALID_PARAMS and err["data"] == {"field": "options.slots"}, err
    assert "256" in err["message"]
    assert bare.call("model/status") == {"models": []}
    assert "Traceback" not in bare.stderr_tail(100_000)


@pytest.mark.model
@pytest.mark.parametrize("ids", [[-1], [2**31], [2**63], [10**30], [0, 504, -5]])
def test_token_ids_outside_the_vocabulary_are_32602(small, ids):
    err = error_of(small.request("inference/generate", {"tokens": ids, "options": {"maxTokens": 1}}))
    assert err["code"] == INVALID_PARAMS


@pytest.mark.model
def test_a_random_seed_is_exact_in_javascript_and_gives_its_reply_again(small):
    """A seed the server picks is below 2^53, so any client (JSON.parse in JavaScript included)
    can hand it back unchanged and get the same reply."""
    first = result_of(
        small.request("inference/generate", {"prompt": "Once", "options": {"maxTokens": 6, "temperature": 1}})
    )
    assert 0 <= first["seed"] < 2**53
    assert float(first["seed"]) == first["seed"]  # what a JavaScript number holds
    again = result_of(
        small.request(
            "inference/generate",
            {"prompt": "Once", "options": {"maxTokens": 6, "temperature": 1, "seed": first["seed"]}},
        )
    )
    assert again["tokens"] == first["tokens"]
