"""Big prompts and texts: tokenizing runs off the event loop with the model held open, a prompt
no context could hold is refused before it is tokenized, and an unload while a text is tokenized
waits for it (it used to free the vocabulary under it)."""

from __future__ import annotations

import json
import time

import pytest
from protocol_fixtures import loaded, server, spawn  # noqa: F401

from kinfer_rpc import errors

pytestmark = pytest.mark.model


def test_a_prompt_no_context_could_hold_is_refused_at_once(loaded) -> None:  # noqa: F811
    prompt = "word " * 10_000_000  # 50 MB
    t = time.perf_counter()
    err = loaded.request("inference/generate", {"prompt": prompt, "options": {"maxTokens": 1}}, timeout=60)["error"]
    assert err["code"] == errors.CONTEXT_OVERFLOW
    assert err["data"] == {"promptBytes": len(prompt), "contextLength": 256}
    chat = {"messages": [{"role": "user", "content": prompt}], "options": {"maxTokens": 1}}
    assert loaded.request("inference/chat", chat, timeout=60)["error"]["code"] == errors.CONTEXT_OVERFLOW
    assert time.perf_counter() - t < 20  # framing 100 MB and rendering dominate; no tokenizing


def test_an_unload_while_a_text_is_tokenized_waits_for_it(loaded) -> None:  # noqa: F811
    text = "the quick brown fox jumps over the lazy dog " * 60_000
    name = loaded.call("model/status", {})["models"][0]["model"]
    rid = loaded.request_async("inference/tokenize", {"text": text})
    time.sleep(0.05)
    assert loaded.call("model/unload", {"model": name}, timeout=120) is None
    response = loaded.response(rid, timeout=120)
    # Tokenized whole (the unload waited), or refused because the unload came first: never a crash.
    if "error" in response:
        assert response["error"]["code"] == errors.INTERNAL_ERROR
        assert "unloaded" in response["error"]["message"]
    else:
        assert len(response["result"]["tokens"]) > 100_000
    assert loaded.call("model/status", {})["models"] == []
    assert loaded.call("model/list", {})  # still serving


def test_an_answer_over_the_frame_limit_becomes_an_error(spawn) -> None:  # noqa: F811
    c = spawn("--max-frame-bytes", "200000")
    assert c.initialize()["capabilities"]["maxFrameBytes"] == 200_000
    c.load_model()
    text = "the quick brown fox jumps over the lazy dog " * 2000  # 88 kB in, about 20k tokens out
    err = c.request("inference/tokenize", {"text": text})["error"]
    assert err["code"] == errors.RESPONSE_TOO_LARGE and "200000" in err["message"]
    assert c.call("inference/tokenize", {"text": "small"})["tokens"]  # still serving
    biggest = max(len(json.dumps(m, ensure_ascii=False).encode()) for m in c.messages)
    assert biggest <= 200_000, f"a frame body of {biggest} bytes, over the advertised limit"
