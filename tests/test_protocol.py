"""The protocol of spec/specification.md, against a real `kinfer-rpc` process.

Every server a test starts is checked at teardown: nothing but well-formed frames on stdout, and
every message valid against spec/metaModel.json (see protocol_fixtures.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import metamodel
import pytest
from protocol_fixtures import loaded, server, spawn  # noqa: F401  (fixtures)
from rpcclient import DEFAULT_MODEL, RpcClient, error_of, frame, raw_frame, result_of

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
SERVER_NOT_INITIALIZED = -32002
REQUEST_CANCELLED = -32800
MODEL_NOT_FOUND = -31001
CONTEXT_OVERFLOW = -31002
LOAD_FAILED = -31003
QUEUE_FULL = -31004
BACKEND_UNAVAILABLE = -31005

FAST = {"maxTokens": 8, "temperature": 0}
REQUEST_METHODS = [r["method"] for r in metamodel.model().model["requests"]]


@pytest.fixture(scope="module")
def shared():
    """One initialized server with the model loaded small, for the tests that only send bad params."""
    c = RpcClient.spawn()
    try:
        c.initialize()
        c.load_model()
        yield c
    finally:
        c.close(timeout=3.0, check=False)
    c.assert_clean()


# -- the meta model itself -------------------------------------------------------------------


def test_meta_model_matches_its_schema_and_references_resolve():
    import jsonschema

    with open(metamodel.SCHEMA_PATH) as f:
        schema = json.load(f)
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(metamodel.model().model, schema)
    assert metamodel.model().check_references() == []


def test_meta_model_error_codes_are_those_of_kinfer_rpc_errors():
    from kinfer_rpc import errors

    codes = {v for k, v in vars(errors).items() if k.isupper() and isinstance(v, int)}
    assert codes == metamodel.model().error_codes
    own = [c for c in codes if c > -32000]
    assert own and all(-31999 <= c <= -31000 for c in own)


def _wrong_value(mm, type_):
    """A value of the wrong type for a metaModel property type, or None to skip the property."""
    kind = type_["kind"]
    if kind == "or":
        refs = [t for t in type_["items"] if t["kind"] == "reference" and t["name"] in mm.structures]
        return ("nested", refs[0]["name"]) if refs else 12345
    if kind == "reference":
        if type_["name"] in mm.structures:
            return ("nested", type_["name"])
        if type_["name"] in mm.enumerations:
            return 12345 if mm.enumerations[type_["name"]]["type"]["name"] == "string" else "x"
        return None  # LSPAny, ProgressToken: anything goes
    if kind == "base":
        return 12345 if type_["name"] == "string" else "x"
    return "x"  # arrays


BASE_PARAMS = {
    "model/load": {"model": DEFAULT_MODEL},
    "model/unload": {"model": DEFAULT_MODEL},
    "model/status": {},
    "inference/generate": {"prompt": "x", "options": {"maxTokens": 1}},
    "inference/chat": {"messages": [{"role": "user", "content": "x"}], "options": {"maxTokens": 1}},
    "inference/tokenize": {"text": "x"},
}


def _documented_fields():
    mm = metamodel.model()
    for method, base in BASE_PARAMS.items():
        params_type = mm.requests[method]["params"]
        props, _ = mm._properties(params_type["name"])
        for name, prop in props.items():
            wrong = _wrong_value(mm, prop["type"])
            if wrong is None:
                continue
            if isinstance(wrong, tuple):  # an options structure: each of its members
                inner, _ = mm._properties(wrong[1])
                for iname, iprop in inner.items():
                    iwrong = _wrong_value(mm, iprop["type"])
                    if iwrong is not None and not isinstance(iwrong, tuple):
                        yield method, {**base, name: {**base.get(name, {}), iname: iwrong}}, f"{name}.{iname}"
            else:
                yield method, {**base, name: wrong}, name


@pytest.mark.model
@pytest.mark.parametrize("method, params, field", list(_documented_fields()))
def test_every_documented_param_is_known_to_the_server(shared, method, params, field):
    # A member the meta model documents, sent with a wrong type, is refused as a bad value (never as an
    # unknown member): the spec lists no param or option the server does not have.
    err = error_of(shared.request(method, params))
    assert err["code"] == INVALID_PARAMS, err
    leaf = field.rsplit(".", 1)[-1]
    assert not (isinstance(err.get("data"), dict) and leaf in err["data"].get("unknown", [])), err
    assert leaf in err["message"], err


# -- lifecycle -------------------------------------------------------------------------------


def test_requests_before_initialize_are_refused_with_32002(spawn):
    c = spawn()
    for method in ["model/list", "model/status", "shutdown", "inference/generate", "no/such/method"]:
        err = error_of(c.request(method, {}))
        assert err["code"] == SERVER_NOT_INITIALIZED, (method, err)
        assert "data" not in err
    # Notifications (other than exit) are dropped without an answer.
    c.notify("initialized", {})
    c.notify("$/cancelRequest", {"id": 1})
    init = c.initialize()
    assert init["protocolVersion"] == 1
    assert "result" in c.request("model/list")


def test_initialize_result(spawn):
    c = spawn()
    result = c.initialize()
    assert result["serverInfo"]["name"] == "kinfer-rpc"
    assert isinstance(result["serverInfo"]["version"], str) and result["serverInfo"]["version"]
    assert result["protocolVersion"] == 1
    caps = result["capabilities"]
    assert "llama" in caps["backends"]
    assert caps["backends"] == sorted(caps["backends"])
    assert sorted(caps["methods"]) == sorted(REQUEST_METHODS)
    assert caps["partialResults"] is True and caps["workDoneProgress"] is True and caps["cancellation"] is True
    assert caps["maxFrameBytes"] == 64 * 1024 * 1024
    assert any(p["name"] == "llama" for p in caps["plugins"])


def test_initialize_answers_within_a_second_of_spawn(spawn):
    c = spawn()
    rid = c.request_async("initialize", {"processId": None})
    response = c.response(rid, timeout=10)
    elapsed = c.times[c.index_of(response)] - c.started
    assert "result" in response
    assert elapsed < 1.0, f"initialize answered {elapsed:.2f} s after spawn"


def test_second_initialize_is_refused(server):
    err = error_of(server.request("initialize", {"processId": None}))
    assert err["code"] == INVALID_REQUEST
    assert "result" in server.request("model/list")


def test_bad_initialize_params_leave_the_server_uninitialized(spawn):
    c = spawn()
    err = error_of(c.request("initialize", {"initializationOptions": {"logLevel": "loud"}}))
    assert err["code"] == INVALID_PARAMS and "logLevel" in err["message"]
    err = error_of(c.request("initialize", {"processId": "me"}))
    assert err["code"] == INVALID_PARAMS and err["data"] == {"field": "params.processId"}
    for wrong in ([], "", 0, False):  # only an object (or nothing) is options
        err = error_of(c.request("initialize", {"initializationOptions": wrong}))
        assert err["code"] == INVALID_PARAMS and "initializationOptions must be an object" in err["message"], wrong
    err = error_of(c.request("initialize", {"processId": None, "colour": "blue"}))
    assert err["code"] == INVALID_PARAMS and err["data"] == {"unknown": ["colour"]}
    assert error_of(c.request("model/list"))["code"] == SERVER_NOT_INITIALIZED
    c.initialize()
    assert "result" in c.request("model/list")


@pytest.mark.model
def test_shutdown_answers_null_then_requests_are_refused(loaded):
    c = loaded
    assert result_of(c.request("shutdown")) is None
    for method, params in [
        ("model/list", {}),
        ("inference/generate", {"prompt": "hi"}),
        ("shutdown", {}),
        ("initialize", {}),
    ]:
        err = error_of(c.request(method, params))
        assert err["code"] == INVALID_REQUEST, (method, err)
    assert c.close() == 0


def test_shutdown_refuses_params(server):
    err = error_of(server.request("shutdown", {"now": True}))
    assert err["code"] == INVALID_PARAMS
    assert "result" in server.request("model/list")  # still running


def test_exit_after_shutdown_and_stdin_close_exits_0(server):
    assert result_of(server.request("shutdown")) is None
    server.notify("exit")
    assert server.close(timeout=5) == 0


def test_exit_without_shutdown_and_stdin_close_exits_1(server):
    server.notify("exit")
    assert server.close(timeout=5) == 1


def test_exit_after_shutdown_exits_0_while_stdin_stays_open(server):
    assert result_of(server.request("shutdown")) is None
    server.notify("exit")
    assert server.wait_exit(3.0) == 0


def test_exit_without_shutdown_exits_1_while_stdin_stays_open(server):
    server.notify("exit")
    assert server.wait_exit(3.0) == 1


def test_stdin_close_exits_within_2_seconds(spawn):
    c = spawn()
    c.initialize()
    t = time.monotonic()
    assert c.close(timeout=5) == 1  # no shutdown: 1
    assert time.monotonic() - t < 2.0


@pytest.mark.model
def test_stdin_close_with_a_loaded_model_exits_within_2_seconds(loaded):
    t = time.monotonic()
    assert loaded.close(timeout=5) == 1
    assert time.monotonic() - t < 2.0


def test_stdin_close_before_initialize_exits(spawn):
    c = spawn()
    assert c.close(timeout=5) == 1


def _dead_pid() -> int:
    """The pid of a process that has just ended (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _short_lived():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])


@pytest.mark.model  # no model, but not fast: ~1.5 s waiting on the server's once-a-second process watch
def test_client_process_death_is_noticed(spawn):
    child = _short_lived()
    c = spawn("--clientProcessId", str(child.pid))
    c.initialize({"initializationOptions": {"logLevel": "warning"}})
    child.wait()
    m = c.wait_for(lambda m: m.get("method") == "window/logMessage" and "died" in m["params"]["message"], timeout=5)
    assert m["params"]["type"] == 2


@pytest.mark.model  # no model, but not fast: ~1.5 s waiting on the server's once-a-second process watch
def test_client_process_id_argument_death_exits(spawn):
    child = _short_lived()
    c = spawn("--clientProcessId", str(child.pid))
    c.initialize()
    child.wait()
    assert c.wait_exit(4.0) == 1


@pytest.mark.model  # no model, but not fast: ~1.5 s waiting on the server's once-a-second process watch
def test_initialize_process_id_death_exits(spawn):
    c = spawn()
    c.initialize({"processId": _dead_pid()})
    assert c.wait_exit(4.0) == 1


# -- envelopes and params ----------------------------------------------------------------------


def test_unknown_method_is_32601_with_the_name_in_data(server):
    err = error_of(server.request("model/explode", {}))
    assert err["code"] == METHOD_NOT_FOUND
    assert err["data"] == "model/explode"


def test_unknown_notification_is_ignored(server):
    server.notify("model/explode", {"x": 1})
    server.notify("$/somethingElse", {})
    assert "result" in server.request("model/list")


@pytest.mark.parametrize("params", ["null", "omitted", "{}", "[]"])
def test_params_null_omitted_or_empty_are_accepted(server, params):
    message = {"jsonrpc": "2.0", "id": "p", "method": "model/list"}
    if params != "omitted":
        message["params"] = json.loads(params)
    server.send(message)
    assert "models" in result_of(server.response("p", timeout=10))


def test_params_that_are_not_object_or_array_are_32600(server):
    for i, params in enumerate([1, "x", True]):
        server.send({"jsonrpc": "2.0", "id": i, "method": "model/list", "params": params})
        assert error_of(server.response(i, timeout=10))["code"] == INVALID_REQUEST


def test_positional_params_that_do_not_fit_are_32602(server):
    err = error_of(server.request("model/list", [1, 2]))
    assert err["code"] == INVALID_PARAMS and isinstance(err["data"], str)


@pytest.mark.model
@pytest.mark.parametrize(
    "method, params, unknown",
    [
        ("model/list", {"verbose": True}, "verbose"),
        ("model/status", {"model": DEFAULT_MODEL, "all": 1}, "all"),
        ("model/load", {"model": DEFAULT_MODEL, "contextLength": 64}, "contextLength"),
        pytest.param("model/list", {"ctx": 1}, "ctx"),
        ("model/unload", {"model": DEFAULT_MODEL, "force": True}, "force"),
        ("inference/tokenize", {"text": "hi", "special": True}, "special"),
        ("inference/chat", {"messages": [{"role": "user", "content": "hi"}], "temp": 0}, "temp"),
    ],
)
def test_unknown_param_field_is_32602_naming_it(shared, method, params, unknown):
    err = error_of(shared.request(method, params))
    assert err["code"] == INVALID_PARAMS
    assert unknown in err["message"]
    assert err["data"] == {"unknown": [unknown]}


@pytest.mark.model
@pytest.mark.parametrize(
    "method, params, unknown",
    [
        ("inference/generate", {"prompt": "hi", "options": {"maxTokns": 5}}, "maxTokns"),
        ("inference/chat", {"messages": [{"role": "user", "content": "hi"}], "options": {"top_k": 5}}, "top_k"),
        ("model/load", {"options": {"context_length": 64}}, "context_length"),
    ],
)
def test_unknown_option_is_32602_naming_it(shared, method, params, unknown):
    err = error_of(shared.request(method, params))
    assert err["code"] == INVALID_PARAMS
    assert unknown in err["message"] and err["data"] == {"unknown": [unknown]}


@pytest.mark.model
@pytest.mark.parametrize(
    "method, params, field",
    [
        ("model/load", {"model": 5}, "params.model"),
        ("model/load", {"options": {"contextLength": "big"}}, "options.contextLength"),
        ("model/load", {"options": {"slots": 0}}, "options.slots"),
        ("model/load", {"options": {"flashAttention": "yes"}}, "options.flashAttention"),
        ("model/status", {"model": 1}, "params.model"),
        ("model/unload", {"model": ["a"]}, "params.model"),
        ("inference/generate", {"prompt": 5}, "params.prompt"),
        ("inference/generate", {"prompt": "hi", "addSpecial": "no"}, "params.addSpecial"),
        ("inference/generate", {"prompt": "hi", "options": {"maxTokens": -1}}, "options.maxTokens"),
        ("inference/generate", {"prompt": "hi", "options": {"maxTokens": 1.5}}, "options.maxTokens"),
        ("inference/generate", {"prompt": "hi", "options": {"maxTokens": True}}, "options.maxTokens"),
        ("inference/generate", {"prompt": "hi", "options": {"maxTokens": 2**40}}, "options.maxTokens"),
        ("inference/generate", {"prompt": "hi", "options": {"temperature": "hot"}}, "options.temperature"),
        ("inference/generate", {"prompt": "hi", "options": {"topP": 2}}, "options.topP"),
        ("inference/generate", {"prompt": "hi", "options": {"seed": -1}}, "options.seed"),
        ("inference/generate", {"prompt": "hi", "options": {"ignoreEos": 1}}, "options.ignoreEos"),
        ("inference/chat", {"messages": [{"role": "user", "content": "x"}], "model": {}}, "params.model"),
        ("inference/tokenize", {"text": 5}, "params.text"),
        ("inference/tokenize", {"text": "x", "parseSpecial": None, "addSpecial": 0}, "params.addSpecial"),
    ],
)
def test_wrong_types_are_32602_naming_the_field(shared, method, params, field):
    err = error_of(shared.request(method, params))
    assert err["code"] == INVALID_PARAMS, err
    assert err["data"] == {"field": field}
    assert field in err["message"]


@pytest.mark.model
@pytest.mark.parametrize(
    "method, params, words",
    [
        ("inference/generate", {}, "exactly one"),
        ("inference/generate", {"prompt": "hi", "tokens": [1]}, "exactly one"),
        ("inference/generate", {"tokens": ["a"]}, "tokens"),
        ("inference/generate", {"tokens": [10**9]}, "vocabulary"),
        ("inference/generate", {"tokens": []}, "empty"),
        ("inference/generate", {"prompt": "hi", "options": "fast"}, "options"),
        ("inference/generate", {"prompt": "hi", "options": {"stop": 5}}, "stop"),
        ("inference/chat", {"messages": "hi"}, "messages"),
        ("inference/chat", {"messages": []}, "messages"),
        ("inference/chat", {"messages": [{"role": "user"}]}, "messages[0]"),
        ("inference/tokenize", {}, "text"),
        ("model/unload", {}, "model"),
        ("model/load", {"options": {"slots": 8, "batch": 4}}, "slots"),
    ],
)
def test_missing_or_conflicting_params_are_32602(shared, method, params, words):
    err = error_of(shared.request(method, params))
    assert err["code"] == INVALID_PARAMS, err
    assert words in err["message"]


def test_invalid_envelopes(server):
    c = server
    c.send({"jsonrpc": "1.0", "id": "a", "method": "model/list"})
    assert error_of(c.response("a", timeout=10))["code"] == INVALID_REQUEST
    c.send({"jsonrpc": "2.0", "id": "b", "method": 5})
    assert error_of(c.response("b", timeout=10))["code"] == INVALID_REQUEST
    start = len(c.messages)
    c.send({"jsonrpc": "2.0", "id": {"x": 1}, "method": "model/list"})
    m = c.wait_for(lambda m: "error" in m and m.get("id") is None, timeout=10, start=start)
    assert m["error"]["code"] == INVALID_REQUEST
    assert "result" in c.request("model/list")


def test_framing_errors_are_answered_with_id_null_and_the_server_goes_on(server):
    c = server
    start = len(c.messages)
    c.send_raw(raw_frame(b"{not json"))
    c.send_raw(raw_frame(b"\xff\xfe"))
    c.send_raw(frame([{"jsonrpc": "2.0", "id": 1, "method": "model/list"}]))
    # A broken header block must come in the same write as the next frame: read on its own, it sends the
    # server into an endless loop (see test_garbage_alone_then_a_valid_request_is_answered).
    rid = c.request_async("model/list", prefix=b"Content-Length: x\r\n\r\n")
    assert "result" in c.response(rid, timeout=10)
    errs = [m["error"] for m in c.messages[start:] if "error" in m]
    assert [e["code"] for e in errs] == [PARSE_ERROR, PARSE_ERROR, INVALID_REQUEST, PARSE_ERROR]
    assert all(m["id"] is None for m in c.messages[start:] if "error" in m)


def test_oversize_frame_is_refused_and_the_next_frame_read(spawn):
    c = spawn("--max-frame-bytes", "4000")  # initialize's answer (the capabilities) must fit
    caps = c.initialize()["capabilities"]
    assert caps["maxFrameBytes"] == 4000
    start = len(c.messages)
    c.send({"jsonrpc": "2.0", "id": "big", "method": "inference/tokenize", "params": {"text": "x" * 8000}})
    assert "result" in c.request("model/list")
    err = c.wait_for(lambda m: "error" in m, start=start)
    assert err["id"] is None and err["error"]["code"] == INVALID_REQUEST and "4000" in err["error"]["message"]
    assert "big" not in [m.get("id") for m in c.messages]


@pytest.mark.model
def test_a_running_id_cannot_be_reused(loaded):
    c = loaded
    c.request_async(
        "inference/generate",
        {"prompt": "Once", "options": {"maxTokens": 200, "ignoreEos": True}, "partialResultToken": "dup"},
        id="same",
    )
    c.wait_for(lambda m: m.get("method") == "$/progress")
    c.send({"jsonrpc": "2.0", "id": "same", "method": "model/list"})
    c.wait_for(lambda m: m.get("id") == "same" and "error" in m and m["error"]["code"] == INVALID_REQUEST)
    c.cancel("same")
    c.wait_for(lambda m: m.get("id") == "same" and "error" in m and m["error"]["code"] == REQUEST_CANCELLED)


# -- models ----------------------------------------------------------------------------------


def test_model_list(server):
    models = result_of(server.request("model/list"))["models"]
    default = [m for m in models if m["name"] == DEFAULT_MODEL]
    assert default and default[0]["source"] == "embedded" and default[0]["format"] == "gguf"
    assert default[0]["loaded"] is False and default[0]["sizeBytes"] > 0


@pytest.mark.model
def test_model_load_status_unload(server):
    c = server
    info = c.load_model()
    assert info["model"] == DEFAULT_MODEL and info["backend"] == "llama" and info["slots"] == 1
    assert info["contextLength"] >= 256
    listed = {m["name"]: m for m in c.call("model/list")["models"]}
    assert listed[DEFAULT_MODEL]["loaded"] is True
    status = c.call("model/status")["models"]
    assert [s["model"] for s in status] == [DEFAULT_MODEL] and status[0]["state"] == "ready"
    assert c.call("model/status", {"model": "other"}) == {"models": []}
    # Loading again returns the loaded model, as it is.
    assert c.call("model/load", {"model": DEFAULT_MODEL}) == {**info, "loads": 2}  # the same instance, shared
    assert c.call("model/unload", {"model": DEFAULT_MODEL}) is None
    assert c.call("model/status") == {"models": []}
    err = error_of(c.request("model/unload", {"model": DEFAULT_MODEL}))
    assert err["code"] == MODEL_NOT_FOUND


def test_unknown_model_is_31001_listing_the_available_ones(server):
    for method, params in [
        ("model/load", {"model": "no-such-model"}),
        ("inference/generate", {"model": "no-such-model", "prompt": "hi", "options": FAST}),
        ("inference/tokenize", {"model": "no-such-model", "text": "hi"}),
    ]:
        err = error_of(server.request(method, params))
        assert err["code"] == MODEL_NOT_FOUND, err
        assert err["data"]["model"] == "no-such-model"
        assert DEFAULT_MODEL in err["data"]["available"]
        assert DEFAULT_MODEL in err["message"]


def test_ambiguous_model_prefix_is_31001_with_candidates(spawn, tmp_path):
    for name in ["alpha-one.gguf", "alpha-two.gguf"]:
        (tmp_path / name).write_bytes(b"not a model")
    c = spawn(env={"KINFER_MODELS": str(tmp_path)})
    c.initialize()
    names = {m["name"]: m for m in c.call("model/list")["models"]}
    assert names["alpha-one"]["source"] == "kinfer" and names["alpha-one"]["format"] == "gguf"
    err = error_of(c.request("model/load", {"model": "alpha"}))
    assert err["code"] == MODEL_NOT_FOUND
    assert err["data"] == {"model": "alpha", "candidates": ["alpha-one", "alpha-two"]}


def test_backend_unavailable_is_31005(server, spawn, tmp_path):
    err = error_of(server.request("model/load", {"backend": "nope"}))
    assert err["code"] == BACKEND_UNAVAILABLE and "llama" in err["message"]
    mlx = tmp_path / "some-mlx-model"
    mlx.mkdir()
    (mlx / "config.json").write_text("{}")
    # Without the mlx plugin (tests/test_mlx.py loads real MLX folders with it).
    bare = spawn(env={**os.environ, "KINFER_RPC_PLUGINS": "llama,drafts"})
    bare.initialize()
    err = error_of(bare.request("model/load", {"model": str(mlx)}))
    assert err["code"] == BACKEND_UNAVAILABLE and "mlx" in err["message"]


def minimal_gguf(path, architecture: str) -> None:
    """A GGUF v3 file with one key (general.architecture) and no tensors: a sound header, no model."""
    import struct

    def string(s: str) -> bytes:
        data = s.encode()
        return struct.pack("<Q", len(data)) + data

    path.write_bytes(
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + string("general.architecture")
        + struct.pack("<I", 8)
        + string(architecture)
    )


def test_unusable_gguf_is_31003(server, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    err = error_of(server.request("model/load", {"model": str(bad)}, timeout=10))
    assert err["code"] == LOAD_FAILED and "broken.gguf" in err["message"]
    assert server.call("model/status") == {"models": []}


def test_backend_load_failure_is_31003(server, tmp_path):
    ids = []
    for i in range(12):  # each load loses the race about half the time: 12 make a pass by luck unlikely
        bad = tmp_path / f"no-such-arch-{i}.gguf"
        minimal_gguf(bad, "kinfer-no-such-architecture")
        ids.append(server.request_async("model/load", {"model": str(bad)}))
    for rid in ids:
        err = error_of(server.response(rid, timeout=5))
        assert err["code"] == LOAD_FAILED and "no-such-arch" in err["message"]


@pytest.mark.model
def test_model_load_work_done_progress(server):
    c = server
    rid = c.request_async(
        "model/load", {"model": DEFAULT_MODEL, "options": {"contextLength": 256, "slots": 1}, "workDoneToken": "load-1"}
    )
    response = c.response(rid, timeout=60)
    assert result_of(response)["model"] == DEFAULT_MODEL
    values = c.progress("load-1")
    assert values[0]["kind"] == "begin" and DEFAULT_MODEL in values[0]["title"]
    assert values[-1] == {"kind": "end", "message": "loaded"}
    reports = values[1:-1]
    assert all(v["kind"] == "report" for v in reports)
    percentages = [v["percentage"] for v in reports]
    assert percentages == sorted(percentages) and all(0 <= p <= 100 for p in percentages)
    # Every $/progress of the request comes before its response.
    last_progress = max(i for i, m in enumerate(c.messages) if m.get("method") == "$/progress")
    assert last_progress < c.index_of(response)
    # An already loaded model answers at once, without progress.
    c.call("model/load", {"model": DEFAULT_MODEL, "workDoneToken": "load-2"})
    assert c.progress("load-2") == []


@pytest.mark.model
def test_cancelled_model_load_ends_its_progress(server):
    c = server
    rid = c.request_async(
        "model/load", {"model": DEFAULT_MODEL, "options": {"contextLength": 256, "slots": 1}, "workDoneToken": "w"}
    )
    c.wait_for(lambda m: m.get("method") == "$/progress")
    c.cancel(rid)
    response = c.response(rid, timeout=30)
    assert error_of(response)["code"] == REQUEST_CANCELLED
    c.call("model/status")
    time.sleep(1.0)
    c.call("model/status")
    values = c.progress("w")
    assert values[-1]["kind"] == "end"
    last_progress = max(i for i, m in enumerate(c.messages) if m.get("method") == "$/progress")
    assert last_progress < c.index_of(response)


@pytest.mark.model
def test_non_object_options_are_refused_for_a_loaded_model(loaded):
    for bad in [0, False, "", []]:
        err = error_of(loaded.request("model/load", {"model": DEFAULT_MODEL, "options": bad}))
        assert err["code"] == INVALID_PARAMS


# -- inference ---------------------------------------------------------------------------------


@pytest.mark.model
def test_generate_result(loaded):
    r = loaded.call("inference/generate", {"prompt": "The capital of France is", "options": {**FAST, "seed": 7}})
    assert r["model"] == DEFAULT_MODEL
    assert r["stopReason"] in ("stop", "length") and r["seed"] == 7
    assert 0 < len(r["tokens"]) <= 8 and r["usage"]["completionTokens"] == len(r["tokens"])
    assert r["usage"]["promptTokens"] > 0


@pytest.mark.model
def test_generate_from_tokens_equals_generate_from_prompt(loaded):
    toks = loaded.call("inference/tokenize", {"text": "Hello, my name is"})
    assert len(toks["tokens"]) == len(toks["pieces"]) and "".join(toks["pieces"]) == "Hello, my name is"
    a = loaded.call("inference/generate", {"prompt": "Hello, my name is", "options": FAST})
    b = loaded.call("inference/generate", {"tokens": toks["tokens"], "options": FAST})
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"]


@pytest.mark.model
def test_chat_result(loaded):
    r = loaded.call("inference/chat", {"messages": [{"role": "user", "content": "Say hi"}], "options": FAST})
    assert r["model"] == DEFAULT_MODEL and r["stopReason"] in ("stop", "length")


@pytest.mark.model
def test_stop_string_ends_the_text(loaded):
    r = loaded.call(
        "inference/generate", {"prompt": "1, 2, 3, 4,", "options": {"maxTokens": 20, "temperature": 0, "stop": ["7"]}}
    )
    assert "7" not in r["text"]


@pytest.mark.model
def test_max_tokens_zero_generates_nothing(loaded):
    r = loaded.call("inference/generate", {"prompt": "Hello", "options": {"maxTokens": 0}})
    assert r["tokens"] == [] and r["text"] == ""


@pytest.mark.model
@pytest.mark.parametrize("options", [{"repeatPenalty": 0}, {"repeatPenalty": 1e-40}, {"temperature": 5e-324}])
def test_degenerate_sampling_options_do_not_break_the_model(loaded, options):
    r = loaded.request("inference/generate", {"prompt": "Hello Hello Hello", "options": {"maxTokens": 3, **options}})
    assert "result" in r or r["error"]["code"] == INVALID_PARAMS, r
    after = loaded.request("inference/generate", {"prompt": "Hi", "options": FAST})
    assert "result" in after, after


@pytest.mark.model
@pytest.mark.parametrize("method", ["inference/generate", "inference/chat"])
def test_partial_results_come_before_the_response_and_concatenate(loaded, method):
    c = loaded
    params = (
        {"prompt": "Once upon a time"}
        if method == "inference/generate"
        else {"messages": [{"role": "user", "content": "Tell me a story"}]}
    )
    rid = c.request_async(
        method, {**params, "options": {"maxTokens": 12, "temperature": 0, "ignoreEos": True}, "partialResultToken": 42}
    )
    response = c.response(rid)
    result = result_of(response)
    values = c.progress(42)
    assert values, "no partial results"
    assert "".join(v["text"] for v in values) == result["text"]
    assert [t for v in values for t in v["tokens"]] == result["tokens"]
    assert len(result["tokens"]) == 12
    last_progress = max(i for i, m in enumerate(c.messages) if m.get("method") == "$/progress")
    assert last_progress < c.index_of(response)


@pytest.mark.model
def test_no_partial_results_without_a_token(loaded):
    loaded.call("inference/generate", {"prompt": "Hi", "options": FAST})
    assert loaded.notifications("$/progress") == []


@pytest.mark.model
def test_cancel_a_long_generation_answers_32800_with_the_partial_result(loaded):
    c = loaded
    rid = c.request_async(
        "inference/generate",
        {
            "prompt": "Once upon a time",
            "options": {"maxTokens": 240, "temperature": 0, "ignoreEos": True},
            "partialResultToken": "long",
        },
    )
    c.wait_for(lambda m: m.get("method") == "$/progress" and len(c.progress("long")) >= 3, timeout=30)
    t = time.monotonic()
    c.cancel(rid)
    err = error_of(c.response(rid, timeout=10))
    assert time.monotonic() - t < 2.0
    assert err["code"] == REQUEST_CANCELLED
    data = err["data"]
    assert data["stopReason"] == "cancelled"
    streamed = c.progress("long")
    assert data["text"].startswith("".join(v["text"] for v in streamed))
    streamed_tokens = [t for v in streamed for t in v["tokens"]]
    assert data["tokens"][: len(streamed_tokens)] == streamed_tokens
    assert 3 <= len(data["tokens"]) < 240
    assert data["usage"]["completionTokens"] == len(data["tokens"])
    # The slot is free again.
    assert "result" in c.request("inference/generate", {"prompt": "Hi", "options": FAST})


@pytest.mark.model
def test_cancel_of_an_unknown_or_finished_request_is_ignored(loaded):
    loaded.cancel("never-sent")
    loaded.cancel(12345)
    r = loaded.request("inference/generate", {"prompt": "Hi", "options": FAST})
    loaded.cancel(r["id"])
    assert "result" in loaded.request("model/list")


@pytest.mark.model
def test_context_overflow_is_31002_naming_both_numbers(server):
    c = server
    info = c.load_model(contextLength=64)
    ctx = info["contextLength"]  # what was allocated (llama.cpp rounds small contexts up)
    prompt = "hello " * (ctx + 20)
    n = len(c.call("inference/tokenize", {"text": prompt})["tokens"])
    assert n >= ctx
    err = error_of(c.request("inference/generate", {"prompt": prompt, "options": FAST}))
    assert err["code"] == CONTEXT_OVERFLOW
    assert err["data"] == {"promptTokens": n, "contextLength": ctx}
    assert str(n) in err["message"] and str(ctx) in err["message"]


@pytest.mark.model
def test_queue_full_is_31004(server):
    c = server
    c.load_model(maxQueue=1)
    a = c.request_async(
        "inference/generate",
        {"prompt": "Once", "options": {"maxTokens": 240, "ignoreEos": True}, "partialResultToken": "a"},
    )
    c.wait_for(lambda m: m.get("method") == "$/progress")  # a holds the only slot
    b = c.request_async("inference/generate", {"prompt": "Twice", "options": FAST})  # waits in the queue
    deadline = time.monotonic() + 10
    while c.call("model/status")["models"][0]["queueLength"] < 1:
        assert time.monotonic() < deadline, "b never reached the queue"
        time.sleep(0.02)
    err = error_of(c.request("inference/generate", {"prompt": "Thrice", "options": FAST}, timeout=10))
    assert err["code"] == QUEUE_FULL
    c.cancel(a)
    assert error_of(c.response(a, timeout=10))["code"] == REQUEST_CANCELLED
    assert "result" in c.response(b, timeout=30)


# -- server -> client messages ----------------------------------------------------------------


@pytest.mark.model
def test_no_log_messages_without_log_level(loaded):
    loaded.call("inference/generate", {"prompt": "Hi", "options": FAST})
    assert loaded.notifications("window/logMessage") == []


@pytest.mark.model
def test_log_messages_at_the_asked_level(spawn):
    c = spawn()
    c.initialize({"initializationOptions": {"logLevel": "info"}})
    c.load_model()
    m = c.wait_for(lambda m: m.get("method") == "window/logMessage" and "loaded" in m["params"]["message"])
    assert m["params"]["type"] == 3
    assert all(n["params"]["type"] <= 3 for n in c.notifications("window/logMessage"))


def test_broken_plugin_is_reported_with_log_message(spawn, tmp_path):
    site = tmp_path / "site"
    dist = site / "kinfer_spec_broken-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kinfer-spec-broken\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[kinfer_rpc]\nspecbroken = kinfer_spec_broken_no_such_module\n")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    c = spawn(env=env)
    rid = c.request_async("initialize", {"processId": None})
    response = c.response(rid, timeout=10)
    broken = result_of(response)["capabilities"]["brokenPlugins"]
    assert [b["name"] for b in broken] == ["specbroken"]
    assert "ModuleNotFoundError" in broken[0]["error"]
    logs = [m for m in c.notifications("window/logMessage") if "specbroken" in m["params"]["message"]]
    assert len(logs) == 1 and logs[0]["params"]["type"] == 1
    assert c.index_of(logs[0]) < c.index_of(response)
    assert "llama" in result_of(response)["capabilities"]["backends"]  # the rest still loads


@pytest.mark.model
def test_stdout_carries_nothing_but_frames(spawn):
    # Debug logging makes llama.cpp talk a lot; none of it may reach stdout except as window/logMessage.
    c = spawn()
    c.initialize({"initializationOptions": {"logLevel": "debug"}})
    c.load_model()
    c.call("inference/chat", {"messages": [{"role": "user", "content": "hi"}], "options": FAST})
    c.call("inference/tokenize", {"text": "héllo ✓"})
    c.call("shutdown")
    c.notify("exit")
    assert c.close() == 0
    assert c.failures == []
    assert len(c.notifications("window/logMessage")) > 10
    assert c.stdout_bytes == c.frame_bytes > 0


@pytest.mark.model
def test_every_message_of_a_full_session_validates(spawn):
    c = spawn()
    c.request("model/list")  # -32002
    c.initialize({"initializationOptions": {"logLevel": "info"}})
    c.call("model/list")
    c.request(
        "model/load", {"model": DEFAULT_MODEL, "options": {"contextLength": 256, "slots": 2}, "workDoneToken": "w"}
    )
    c.call("model/status")
    c.call("inference/tokenize", {"text": "Hello"})
    c.request("inference/generate", {"prompt": "Hello", "options": FAST, "partialResultToken": "g"})
    c.request(
        "inference/chat", {"messages": [{"role": "user", "content": "hi"}], "options": FAST, "partialResultToken": "c"}
    )
    rid = c.request_async(
        "inference/generate",
        {"prompt": "Once", "options": {"maxTokens": 200, "ignoreEos": True}, "partialResultToken": "x"},
    )
    c.wait_for(lambda m: m.get("method") == "$/progress" and m["params"]["token"] == "x")
    c.cancel(rid)
    c.response(rid)
    c.request("model/explode")
    c.request("inference/generate", {"prompt": "hi", "options": {"bogus": 1}})
    c.request("model/load", {"model": "nope"})
    c.request("model/unload", {"model": DEFAULT_MODEL})
    c.call("shutdown")
    c.notify("exit")
    assert c.close() == 0
    c.assert_clean()
    kinds = {m.get("method") or ("error" if "error" in m else "result") for m in c.messages}
    assert {"$/progress", "window/logMessage", "error", "result"} <= kinds


# -- known bugs: inputs that make the server misbehave ---------------------------------------------


def test_garbage_alone_then_a_valid_request_is_answered(server):
    server.send_raw(b"garbage\r\n\r\n")
    time.sleep(0.3)  # let the server read it on its own
    assert "result" in server.request("model/list", timeout=3)


def test_lone_surrogate_in_method_name_is_answered(server):
    server.send_raw(raw_frame(b'{"jsonrpc":"2.0","id":"s","method":"\\ud800"}'))
    err = error_of(server.response("s", timeout=5))
    assert err["code"] == METHOD_NOT_FOUND


def test_lone_surrogate_in_id_is_answered(server):
    server.expect("\ud800", "model/list")
    server.send_raw(raw_frame(b'{"jsonrpc":"2.0","id":"\\ud800","method":"model/list"}'))
    server.wait_for(lambda m: "result" in m or "error" in m, timeout=5)
    assert "result" in server.request("model/list", timeout=5)


@pytest.mark.model
def test_lone_surrogate_in_text_is_32602(loaded):
    loaded.send_raw(raw_frame(b'{"jsonrpc":"2.0","id":"s","method":"inference/tokenize","params":{"text":"a\\ud800"}}'))
    assert error_of(loaded.response("s", timeout=10))["code"] == INVALID_PARAMS


def test_huge_integer_literal_is_a_parse_error_answered_with_its_id(server):
    body = b'{"jsonrpc":"2.0","id":"n","method":"model/list","params":{"x":' + b"7" * 5000 + b"}}"
    server.expect("n", "model/list")
    server.send_raw(raw_frame(body))
    assert server.response("n", timeout=5)["error"]["code"] == PARSE_ERROR
    assert "result" in server.request("model/list", timeout=5)


def test_requests_nested_up_to_and_past_the_parsers_limit_are_answered_with_their_ids(server):
    """Every depth around json.loads' limit: parsed and refused by the method (-32602, its params
    unknown), or too deep to parse (-32700); never -32600 with id null, which jsonschema's
    validation of the envelope gave where repr() of the request ran out of recursion."""
    codes = set()
    for depth in range(900, 1000, 4):
        rid = f"d{depth}"
        server.expect(rid, "model/list")
        body = b'{"jsonrpc":"2.0","id":"%s","method":"model/list","params":{"a":' % rid.encode()
        server.send_raw(raw_frame(body + b"[" * depth + b"]" * depth + b"}}"))
        codes.add(server.response(rid, timeout=5)["error"]["code"])
    assert codes == {INVALID_PARAMS, PARSE_ERROR}


def test_a_request_nested_3000_deep_is_answered_with_its_id(server):
    """Valid JSON nested deeper than the parser takes: its request is answered, not left waiting."""
    deep = b"[" * 3000 + b"]" * 3000
    server.expect("deep", "model/list")
    server.send_raw(raw_frame(b'{"jsonrpc":"2.0","id":"deep","method":"model/list","params":{"a":' + deep + b"}}"))
    err = server.response("deep", timeout=5)["error"]
    assert err["code"] == PARSE_ERROR and "nests JSON deeper" in err["message"]
    assert "result" in server.request("model/list", timeout=5)


@pytest.mark.parametrize("name", ["~no-such-user-kinfer/model.gguf", "/" + "a" * 300 + ".gguf"])
def test_unusable_model_paths_are_31001(server, name):
    err = error_of(server.request("model/load", {"model": name}))
    assert err["code"] == MODEL_NOT_FOUND


@pytest.mark.model
def test_progress_token_must_be_integer_or_string(loaded):
    err = error_of(
        loaded.request("inference/generate", {"prompt": "hi", "options": FAST, "partialResultToken": {"a": 1}})
    )
    assert err["code"] == INVALID_PARAMS


BAD_PARAMS = [None, [], "x", 5, {"x": 1}, [1, 2], {"id": {"a": 1}}, {"settings": []}, {"textDocument": 5}]
NOTIFICATIONS = [
    "initialized",
    "$/cancelRequest",
    "$/setTrace",
    "$/progress",
    "workspace/didChangeConfiguration",
    "textDocument/didOpen",
    "textDocument/didChange",
    "textDocument/didClose",
    "textDocument/didSave",
    "window/workDoneProgress/cancel",
    "$/unknown",
]


def test_bad_notifications_are_a_log_line_each_never_a_traceback():
    """Notifications have no answer: a bad one is at most one line on stderr, and the server goes on."""
    with RpcClient.spawn("--log-level", "info") as c:
        c.initialize()
        for method in NOTIFICATIONS:
            for params in BAD_PARAMS:
                c.notify(method, params)
        assert "result" in c.request("model/list")
        time.sleep(0.5)
        said = c.stderr_tail(1 << 20)
    assert "Traceback" not in said, said[-3000:]
    assert len(said.splitlines()) <= len(NOTIFICATIONS) * len(BAD_PARAMS) + 10, said[-3000:]


# -- a cancel that lands as the reply is done -------------------------------------------------------
def test_a_cancel_that_lands_after_the_handler_finished_gets_the_reply():
    """A `$/cancelRequest` that arrives while the handler takes its last step (no checkpoint after
    it) must not turn a whole reply into -32800: the handler finished, so its reply is the answer,
    as after the response. Seen on a GPU in the cancel storm: -32800 whose partial result had
    stopReason "length"."""
    import anyio

    from kinfer_rpc.protocol.connection import Connection

    sent: list[dict] = []
    holder: list[Connection] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def work(ctx) -> dict:
        await anyio.sleep(0)
        # the cancel comes in now, and the handler's last step has no checkpoint
        await holder[0].receive({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": ctx.id}})
        return {"text": "done", "stopReason": "length"}

    async def slow(ctx) -> dict:
        await anyio.sleep(0)
        await holder[0].receive({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": ctx.id}})
        await anyio.sleep(0)  # a checkpoint: this one is cancelled
        return {"text": "never"}

    async def main() -> None:
        conn = Connection(send, {"work": work, "slow": slow}, {})
        holder.append(conn)

        async def messages():
            yield {"jsonrpc": "2.0", "id": 1, "method": "work", "params": {}}
            yield {"jsonrpc": "2.0", "id": 2, "method": "slow", "params": {}}
            await anyio.sleep(0.2)

        await conn.serve(messages())

    anyio.run(main)
    by_id = {m["id"]: m for m in sent}
    assert by_id[1] == {"jsonrpc": "2.0", "id": 1, "result": {"text": "done", "stopReason": "length"}}
    assert by_id[2]["error"]["code"] == -32800
