"""The HTTP faces against hostile input: malformed and oversized bodies, invalid UTF-8, unknown
fields, a fuzz of both APIs' bodies (hypothesis) and headers, slow clients, the API key, CORS and
addresses off loopback. Every answer is a 4xx in the API's own error shape, never a 500, and the
server serves the next request."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from served import BIN, Served

from kinfer_rpc.host.store import DEFAULT_MODEL as MODEL

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("hostile"))
    try:
        yield s
    finally:
        assert s.stop() == 0


def _ok_after(served) -> None:
    """The server still answers an ordinary request."""
    r = httpx.post(
        served.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["type"] in ("invalid_request_error", "server_error")
    return err


def test_malformed_bodies_are_400_in_each_apis_shape(served):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        for body in (b"{", b"[1, 2]", b"\xff\xfe not utf-8", b"", b'"text"'):
            _openai_error(httpx.post(served.url + path, content=body), 400)
    for path in ("/api/chat", "/api/generate", "/api/embed", "/api/show", "/api/pull"):
        r = httpx.post(served.url + path, content=b"{")
        assert r.status_code == 400 and isinstance(r.json()["error"], str)
    _ok_after(served)


def test_unknown_fields_are_refused_by_name(served):
    err = _openai_error(
        httpx.post(served.url + "/v1/chat/completions", json={"model": MODEL, "messages": [], "frobnicate": 1}), 400
    )
    assert err["param"] == "frobnicate"
    r = httpx.post(served.url + "/api/generate", json={"model": MODEL, "prompt": "x", "frobnicate": 1})
    assert r.status_code == 400 and "frobnicate" in r.json()["error"]
    r = httpx.get(served.url + "/api/delete")
    assert r.status_code == 404 and isinstance(r.json()["error"], str)


def test_a_body_over_the_limit_is_413(served):
    from kinfer_rpc.protocol.web import MAX_BODY

    with socket.create_connection(("127.0.0.1", served.port)) as s:  # the length alone says too much
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n{" % (MAX_BODY + 1)
        )
        s.settimeout(30)
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    chunk = b" " * (1 << 20)

    def body():
        for _ in range(MAX_BODY // len(chunk) + 2):
            yield chunk

    r = httpx.post(served.url + "/api/chat", content=body(), timeout=60)  # chunked: no length given
    assert r.status_code == 413 and "limit" in r.json()["error"]
    _ok_after(served)


def test_slow_clients_do_not_hold_up_others(served):
    slow = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", served.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
        slow.append(s)
    t = time.monotonic()
    _ok_after(served)
    assert time.monotonic() - t < 30
    for s in slow:
        s.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
OPENAI_CHAT = [
    "model",
    "messages",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "response_format",
    "seed",
    "stop",
    "temperature",
    "top_p",
    "logprobs",
    "top_logprobs",
    "n",
    "presence_penalty",
    "parallel_tool_calls",
    "reasoning_effort",
    "thinking_token_budget",
    "chat_template_kwargs",
]
OLLAMA_CHAT = ["model", "messages", "tools", "format", "options", "stream", "keep_alive", "think"]


def _fuzzed(keys: list[str], small: dict) -> st.SearchStrategy[dict]:
    """Bodies of random values for the API's own fields, most of them wrong; `small` is merged in
    last, so that a body that happens to be valid asks for a few tokens only."""
    return st.dictionaries(st.sampled_from(keys), json_values, max_size=6).map(lambda d: {**d, **small})


ENDPOINTS = {
    "/v1/chat/completions": _fuzzed(OPENAI_CHAT, {"max_tokens": 2}),
    "/v1/completions": _fuzzed(
        ["model", "prompt", "suffix", "stream", "echo", "logprobs", "stop", "seed"], {"max_tokens": 2}
    ),
    "/v1/embeddings": _fuzzed(["model", "input", "encoding_format", "dimensions"], {}),
    "/api/chat": _fuzzed(OLLAMA_CHAT, {"options": {"num_predict": 2}}),
    "/api/generate": _fuzzed(
        ["model", "prompt", "suffix", "system", "raw", "format", "stream", "images", "think"],
        {"options": {"num_predict": 2}},
    ),
    "/api/embed": _fuzzed(["model", "input", "truncate", "dimensions"], {}),
    "/api/show": _fuzzed(["model", "name", "verbose"], {}),
}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_bodies_get_a_4xx_or_an_answer_never_a_500(served, data):
    path = data.draw(st.sampled_from(sorted(ENDPOINTS)))
    body = data.draw(ENDPOINTS[path])
    if path.startswith("/v1/") and "model" not in body:
        body["model"] = MODEL
    # json.dumps writes NaN and Infinity as Python's json reads them (httpx refuses to send them)
    content = json.dumps(body)
    r = httpx.post(served.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        error = json.loads(r.text.splitlines()[0])["error"]
        assert isinstance(error, str if path.startswith("/api/") else dict), r.text
    elif r.headers["content-type"].startswith(("text/event-stream", "application/x-ndjson")):
        assert r.text  # a stream that ended (an error inside it is its last line)


PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)  # printable ASCII


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.text(PRINTABLE.filter(lambda c: c != ":"), min_size=1, max_size=30),
    value=st.text(PRINTABLE, max_size=60),
)
def test_fuzzed_headers_never_a_500(served, name, value):
    try:
        r = httpx.post(
            served.url + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
            headers={name: value},
            timeout=60,
        )
    except httpx.LocalProtocolError:
        return  # a header httpx itself will not send
    assert r.status_code < 500, r.text


def test_an_api_key_is_needed_when_set_and_compared(tmp_path):
    s = Served(tmp_path, "--api-key", "s3cret")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        assert httpx.post(s.url + "/v1/chat/completions", json=body).status_code == 401
        wrong = httpx.post(s.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        tags = httpx.get(s.url + "/api/tags")  # Ollama's face, Ollama's error shape
        assert tags.status_code == 401 and isinstance(tags.json()["error"], str)
        ok = httpx.post(s.url + "/v1/chat/completions", json=body, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    finally:
        assert s.stop() == 0


def test_off_loopback_without_a_key_refuses_to_start(tmp_path):
    out = subprocess.run(
        [str(BIN / "kinfer"), "serve", "--socket", str(tmp_path / "k.sock"), "--http", "0.0.0.0:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "needs --api-key" in out.stderr


def test_cors_only_for_the_origins_named(served, tmp_path):
    origin = {"origin": "http://example.test"}
    assert "access-control-allow-origin" not in httpx.get(served.url + "/v1/models", headers=origin).headers
    s = Served(tmp_path, "--cors", "http://example.test")
    try:
        r = httpx.get(s.url + "/v1/models", headers=origin)
        assert r.headers["access-control-allow-origin"] == "http://example.test"
        other = httpx.get(s.url + "/v1/models", headers={"origin": "http://evil.test"})
        assert "access-control-allow-origin" not in other.headers
    finally:
        assert s.stop() == 0
