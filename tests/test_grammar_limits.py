"""Schemas, grammars, regexes and tools as deep and as wide as a request can make them: each is
refused with -32602 naming a limit (kinfer_rpc.engine.grammar_limits) or compiles, and none
takes the process down. Compiles run against the embedded model's vocabulary in this process
(a stack overflow would end pytest); a few go through a real server, which must answer after.
docs/reliability.md lists the limits and what was measured."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rpcclient import RpcClient, _key

from kinfer_rpc import errors
from kinfer_rpc.default_plugins.llama import LlamaBackend
from kinfer_rpc.engine import grammar_limits as limits
from kinfer_rpc.engine.grammar import Grammars
from kinfer_rpc.host import tools
from kinfer_rpc.host.store import embedded_default_path
from kinfer_rpc.types import LoadOptions

G = limits.MAX_GROUP_NESTING


# -- inputs ---------------------------------------------------------------------------------------
def chain(n: int, body: str = '"t{i}" {next} | "e"', name: str = "r") -> str:
    """`start: r0`, then each rule `body` referring to the next (`{next}`), n deep, the last "e":
    with the default body, the grammar that crashed the server at 5,000 rules."""
    rules = [f"start: {name}0"] + [f"{name}{i}: " + body.format(i=i, next=f"{name}{i + 1}") for i in range(n)]
    return "\n".join([*rules, f'{name}{n}: "e"'])


def fill(body: str, name: str = "r", budget: int = limits.MAX_TEXT_BYTES) -> str:
    """A chain of rules `body` as long as fits in `budget` bytes."""
    n = budget // len(f"{name}99999: " + body.format(i=99999, next=f"{name}99999") + "\n") - 2
    return chain(n, body, name)


def ref_chain(n: int) -> dict:
    """A schema whose $refs lead n deep: each $def's one property is the next."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested(levels: int, kind: str = "array") -> dict:
    """A schema of arrays of arrays (or objects of objects), `levels` JSON levels deep."""
    schema: dict = {"type": "string"}
    depth = 1
    while depth + (1 if kind == "array" else 2) <= levels:
        if kind == "array":
            schema = {"type": "array", "items": schema}
            depth += 1
        else:
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
            depth += 2
    return schema


def properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def compact(n: int) -> str:
    """A schema of n properties that may be anything, in as few bytes as JSON allows."""
    return json.dumps({"properties": {f"p{i}": {} for i in range(n)}}, separators=(",", ":"))


def tool(i: int) -> dict:
    """A tool with the parameters of a real one: strings, an enum, numbers, a nested object, a list."""
    return {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "a file"},
                    "mode": {"enum": ["read", "write", "append"]},
                    "line": {"type": "integer", "minimum": 1},
                    "range": {
                        "type": "object",
                        "properties": {"start": {"type": "integer"}, "end": {"type": "integer"}},
                        "required": ["start", "end"],
                    },
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                    "force": {"type": "boolean"},
                },
                "required": ["path", "mode"],
                "additionalProperties": False,
            },
        },
    }


def refusal(kind: str, source) -> errors.KinferError | None:
    """The KinferError check() raises, or None."""
    try:
        limits.check(kind, json.dumps(source) if kind == "format" else source, f"options.{kind}")
    except errors.KinferError as exc:
        return exc
    return None


# -- the limits, without a model ---------------------------------------------------------------------
OVER = [
    ("grammar", "a: " + '"x" ' * (limits.MAX_TEXT_BYTES // 4) + "\nstart: a", "bytes"),
    ("grammar", chain(limits.MAX_RULES, "{next}", "a"), "rules"),
    ("grammar", "start: " + "(" * (G + 1) + '"a"' + ")" * (G + 1), "nesting"),
    ("grammar", "start: %json " + json.dumps(nested(limits.MAX_SCHEMA_NESTING + 1)), "nesting"),
    ("grammar", f"start: a | b\na: %json {compact(6000)}\nb: %json {compact(4000)}", "schemas"),  # together
    ("grammar", "start: /" + "(" * 101 + "a" + ")" * 101 + "/", "nesting"),
    ("regex", "(" * (limits.MAX_REGEX_NESTING + 1) + "a" + ")" * (limits.MAX_REGEX_NESTING + 1), "nesting"),
    ("regex", "a" * (limits.MAX_TEXT_BYTES + 1), "bytes"),
    ("format", nested(limits.MAX_SCHEMA_NESTING + 1), "nesting"),
    ("format", nested(limits.MAX_SCHEMA_NESTING + 2, "object"), "nesting"),
    ("format", properties(limits.MAX_SCHEMAS), "schemas"),  # its properties and itself
    ("format", {"enum": ["x" * 1000] * 1100}, "bytes"),
]
UNDER = [
    ("grammar", chain(limits.MAX_RULES - 2, "{next}", "a")),
    ("grammar", "start: " + "(" * G + '"a"' + ")" * G),
    ("grammar", 'start: "((((" /[(]{3}\\(/ a  // ((((((\na: "b: c" # (((\n'),  # parentheses that are no group
    ("grammar", "start: %json " + json.dumps(nested(limits.MAX_SCHEMA_NESTING))),
    ("regex", "(" * limits.MAX_REGEX_NESTING + "a" + ")" * limits.MAX_REGEX_NESTING),
    ("regex", r"[(]\(" * 500 + "[[:alpha:]()]"),
    ("format", nested(limits.MAX_SCHEMA_NESTING)),
    ("format", properties(limits.MAX_SCHEMAS - 2)),
    ("format", "json"),
]


@pytest.mark.parametrize("kind,source,limit", OVER, ids=[f"{k}-{m}-{i}" for i, (k, _, m) in enumerate(OVER)])
def test_over_a_limit_is_32602_naming_it(kind, source, limit):
    exc = refusal(kind, source)
    assert exc is not None and exc.code == errors.INVALID_PARAMS
    assert exc.data["field"] == f"options.{kind}" and exc.data["limit"] == limit
    assert exc.message.startswith(f"options.{kind} ") and f"{exc.data['max']:,}" in exc.message
    assert exc.data["error"] in exc.message


@pytest.mark.parametrize("kind,source", UNDER, ids=[f"{k}-{i}" for i, (k, _) in enumerate(UNDER)])
def test_at_a_limit_is_accepted(kind, source):
    assert refusal(kind, source) is None


def test_tools_are_bounded_together():
    assert limits.check_tools([tool(i)["function"] for i in range(128)]) is None  # the most tools a request has
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    with pytest.raises(errors.KinferError) as exc:
        tools.call_grammar([{"function": {"name": f"t{i}", "parameters": big}} for i in range(40)], REQUIRED, "json")
    assert exc.value.data == {"field": "tools", "error": exc.value.data["error"], "limit": "schemas", "max": 10_000}


REQUIRED = tools.ToolChoice("required")


def test_tools_nested_past_what_json_can_write_are_refused_by_nesting():
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(errors.KinferError) as exc:
        limits.check_tools([{"name": "t", "parameters": deep}])
    assert exc.value.data["limit"] == "nesting"


# -- compiled against the embedded model's vocabulary -----------------------------------------------
@pytest.fixture(scope="module")
def model():
    opts = LoadOptions(context_length=64, slots=1, batch=16, ubatch=16, threads=1)
    m = LlamaBackend().load(embedded_default_path(), opts, lambda _: None)
    yield m
    m.close()


@pytest.fixture(scope="module")
def grammars(model):
    g = Grammars()
    g.tokenizer(model)  # the vocabulary walked once
    return g


def compiles(grammars, model, kind, source) -> bool:
    """True when it compiles; False when it is refused -32602 (over a limit or not compiling)."""
    try:
        grammars.matcher(model, kind, source)
    except errors.KinferError as exc:
        assert exc.code == errors.INVALID_PARAMS, exc.message
        assert exc.data["field"] == ("tools" if kind == "tools" else f"options.{kind}")
        return False
    return True


# The deepest inputs under the limits: each took 20 to 100 MiB of the compile thread's stack
# (a thread's usual 8 MiB overflowed at a tenth of them).
DEEPEST = {
    "rules referring to rules": ("grammar", chain(limits.MAX_RULES - 2, "{next}", "a")),
    "groups in rules referring to rules": ("grammar", fill("(" * G + "{next}" + ")" * G)),
    "terminals of groups of terminals": ("grammar", fill("(" * G + '"t" {next}' + ")" * G, "T")),
    "schema $refs leading to $refs": ("format", ref_chain(3300)),
}


@pytest.mark.model
@pytest.mark.parametrize("name", list(DEEPEST))
def test_the_deepest_inputs_under_the_limits_compile(grammars, model, name):
    kind, source = DEEPEST[name]
    assert compiles(grammars, model, kind, source)


@pytest.mark.model
def test_real_sized_schemas_and_tool_lists_compile(grammars, model):
    """Limits far above what real requests send: 200 properties, 64 tools of real parameters."""
    schema = {**properties(200), "required": [f"p{i}" for i in range(0, 200, 2)]}
    assert compiles(grammars, model, "format", schema)
    grammar = tools.call_grammar([tool(i) for i in range(64)], REQUIRED, "hermes")
    assert compiles(grammars, model, "tools", grammar)


# A corpus of deep and wide inputs, from well under to well over the limits; each compiles or is
# refused -32602 (and its refusal names a limit when a limit is over).
SIZES = st.integers(1, 6).flatmap(lambda e: st.integers(10 ** (e - 1), 2 * 10**e))
GRAMMARS = st.one_of(
    st.builds(lambda n: chain(min(n, 20_000)), SIZES),
    st.builds(lambda n, g: chain(min(n, 3000), "(" * g + '"t" {next}' + ")" * g + ' | "e"'), SIZES, st.integers(0, 30)),
    st.builds(lambda n: chain(min(n, 20_000), name="T"), SIZES),
    st.builds(lambda n: "start: " + " | ".join(f'"w{i}"' for i in range(min(n, 30_000))), SIZES),
    st.builds(lambda g: "start: " + "(" * g + '"a"' + ")" * g, st.integers(0, 40)),
    st.builds(lambda d: "start: %json " + json.dumps(nested(d)), st.integers(1, 140)),
)
SCHEMAS = st.one_of(
    st.builds(lambda n: ref_chain(min(n, 12_000)), SIZES),
    st.builds(lambda d, k: nested(d, k), st.integers(1, 140), st.sampled_from(["array", "object"])),
    st.builds(lambda n: properties(min(n, 15_000)), SIZES),
    st.builds(lambda n: {"anyOf": [{"type": "integer", "minimum": i} for i in range(min(n, 12_000))]}, SIZES),
)
REGEXES = st.one_of(
    st.builds(lambda g: "(" * g + "a" + ")" * g, st.integers(1, 300)),
    st.builds(lambda n: "|".join(f"w{i}" for i in range(min(n, 30_000))), SIZES),
)
CORPUS = st.one_of(
    st.tuples(st.just("grammar"), GRAMMARS), st.tuples(st.just("format"), SCHEMAS), st.tuples(st.just("regex"), REGEXES)
)


@pytest.mark.model
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(CORPUS)
def test_a_corpus_of_deep_and_wide_inputs_compiles_or_is_refused(grammars, model, case):
    kind, source = case
    over = refusal(kind, source)
    compiled = compiles(grammars, model, kind, source)
    assert not (over and compiled), "an input over a limit compiled"


# -- through a real server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    c = RpcClient.spawn()
    c.initialize()
    c.load_model(slots=1, contextLength=256, threads=1)
    yield c
    c.close(check=False)
    c.assert_clean()


def generate(c: RpcClient, **options) -> dict:
    options = {"maxTokens": 3, "temperature": 0, **options}
    return c.request("inference/generate", {"prompt": "Say", "options": options}, timeout=60)


@pytest.mark.model
def test_what_crashed_the_server_is_answered_and_it_goes_on(server):
    """4,000 chained rules and $refs 1,500 deep overflowed the 8 MiB stack of the thread that
    compiled them (SIGSEGV); 5,000 rules are over the size limit now."""
    assert generate(server, grammar=chain(4000))["result"]["text"] in ("e", "t0", "t0t", "t0t1")
    assert "result" in generate(server, format=ref_chain(1500))
    err = generate(server, grammar=chain(5000))["error"]
    assert err["code"] == errors.INVALID_PARAMS and err["data"]["limit"] == "bytes"
    assert err["message"] == f"options.grammar is 131,693 bytes, over the limit of {limits.MAX_TEXT_BYTES:,}"
    assert server.call("model/status", timeout=10)["models"]


@pytest.mark.model
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(CORPUS)
def test_the_server_answers_deep_and_wide_inputs_and_goes_on(server, case):
    kind, source = case
    answer = generate(server, **{kind: source})
    assert "result" in answer or answer["error"]["code"] == errors.INVALID_PARAMS
    assert server.call("model/status", timeout=10)["models"]


@pytest.mark.model
def test_slow_compiles_hold_up_no_other_request_and_a_cancel_answers_at_once(server):
    """Schemas within the limits that take seconds to compile (9,000 properties): a plain
    request on the same model is answered while they compile (they once held its tokenizing
    thread), and a cancelled one is answered at once, its compile left to end on its own."""
    slow = {"format": properties(9000), "maxTokens": 1, "temperature": 0}
    heavy = [server.request_async("inference/generate", {"prompt": "Say", "options": slow}) for _ in range(4)]
    time.sleep(0.5)  # the first compiles are running
    plain = server.request_async("inference/generate", {"prompt": "Say", "options": {"maxTokens": 3}})
    assert "result" in server.response(plain, timeout=30)
    assert not any(_key(rid) in server.responses for rid in heavy[1:])  # still compiling
    server.cancel(heavy[-1])
    cancelled = server.response(heavy[-1], timeout=5)
    assert cancelled["error"]["code"] == errors.REQUEST_CANCELLED
    assert not any(_key(rid) in server.responses for rid in heavy[1:-1])  # answered before them
    for rid in heavy[:-1]:
        assert "result" in server.response(rid, timeout=120)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have a niceness of their own on Linux")
def test_a_compile_runs_below_the_server():
    from kinfer_rpc.engine.grammar import COMPILE_NICE, on_compile_stack

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    here = niceness()
    assert on_compile_stack(niceness) == min(19, here + COMPILE_NICE)
    assert niceness() == here  # the server's own threads keep theirs
