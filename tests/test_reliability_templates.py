"""Security: chat templates that attack the sandbox (a copy of the embedded GGUF with a hostile
tokenizer.chat_template), and a template that loops forever.

Each test drives a real `kinfer-rpc` process through tests/rpcclient.py (which checks that stdout
carries nothing but frames and that every message matches spec/metaModel.json); docs/reliability.md
describes each test and the figures measured. Shared helpers: reliability_helpers.py, conftest.py.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time

import pytest
from protocol_fixtures import spawn  # noqa: F401  (fixture)
from reliability_helpers import (
    GREEDY,
    INVALID_PARAMS,
    NOT_SUPPORTED,
    REQUEST_CANCELLED,
)
from rpcclient import RpcClient, error_of, result_of

pytestmark = pytest.mark.model  # every test here loads a real model

_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _skip_gguf_value(f, vtype: int) -> None:
    if vtype in _GGUF_SCALARS:
        f.seek(_GGUF_SCALARS[vtype], 1)
    elif vtype == _GGUF_STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif vtype == _GGUF_ARRAY:
        etype, n = struct.unpack("<IQ", f.read(12))
        if etype in _GGUF_SCALARS:
            f.seek(n * _GGUF_SCALARS[etype], 1)
        else:
            for _ in range(n):
                _skip_gguf_value(f, etype)
    else:
        raise ValueError(f"GGUF value type {vtype}")


def gguf_with_string(src: str, dst: str, key: str, value: str) -> None:
    """Copy the GGUF v3 file `src` to `dst` with the string key `key` set to `value`.

    GGUF v3: magic, version u32, tensor count u64, KV count u64, the KVs (key: u64 length + bytes,
    type u32, value), the tensor infos, padding to general.alignment (default 32), the tensor data.
    Tensor offsets are relative to the data's start, so only the header changes (and its padding)."""
    with open(src, "rb") as f:
        magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
        assert magic == b"GGUF" and version == 3, (magic, version)
        kvs, alignment = [], 32
        for _ in range(n_kv):
            (klen,) = struct.unpack("<Q", f.read(8))
            k = f.read(klen)
            (vtype,) = struct.unpack("<I", f.read(4))
            start = f.tell()
            _skip_gguf_value(f, vtype)
            end = f.tell()
            f.seek(start)
            raw = f.read(end - start)
            if k == b"general.alignment":
                (alignment,) = struct.unpack("<I", raw)
            kvs.append((k, vtype, raw))
        infos_start = f.tell()
        for _ in range(n_tensors):
            (nlen,) = struct.unpack("<Q", f.read(8))
            f.seek(nlen, 1)
            (ndim,) = struct.unpack("<I", f.read(4))
            f.seek(8 * ndim + 4 + 8, 1)
        infos_end = f.tell()
        f.seek(infos_start)
        infos = f.read(infos_end - infos_start)
        data_start = -(-infos_end // alignment) * alignment
        kb, vb = key.encode(), value.encode()
        new = [(k, t, r) for k, t, r in kvs if k != kb] + [(kb, _GGUF_STRING, struct.pack("<Q", len(vb)) + vb)]
        head = struct.pack("<4sIQQ", b"GGUF", 3, n_tensors, len(new))
        head += b"".join(struct.pack("<Q", len(k)) + k + struct.pack("<I", t) + r for k, t, r in new) + infos
        head += b"\0" * (-len(head) % alignment)
        with open(dst, "wb") as out:
            out.write(head)
            f.seek(data_start)
            shutil.copyfileobj(f, out, 1 << 22)


def embedded_gguf() -> str:
    from kinfer_rpc.host.store import embedded_default_path

    return embedded_default_path()


# Each probe is one branch of ONE hostile template (chosen by the last message's content), followed by
# the same plain ChatML turn: a probe that renders harmlessly adds nothing to the prompt.
TAIL = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
MARKER = "MARKER_PATH"
PROBES = {
    # reach Python internals
    "mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals-os": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "lipsum": "{{ lipsum.__globals__['os'].system('touch MARKER_PATH') }}",
    "joiner": "{{ joiner.__init__.__globals__.os.system('touch MARKER_PATH') }}",
    "namespace": "{{ namespace.__init__.__globals__['__builtins__']['open']('MARKER_PATH', 'w') }}",
    "self-builtins": "{{ self.__init__.__globals__.__builtins__.open('MARKER_PATH', 'w').write('x') }}",
    "raise-globals": "{{ raise_exception.__globals__['jinja2'] }}",
    "strftime-globals": "{{ strftime_now.__globals__['datetime'].datetime }}",
    "format": "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "format-globals": "{{ '{0.__init__.__globals__}'.format(cycler) }}",
    "mutate-list": "{{ messages.append({'role': 'system', 'content': 'pwned'}) }}",
    "mutate-dict": "{% set x = messages[0].update({'content': 'pwned'}) %}",
    "loop-class": "{% for m in messages %}{{ loop.__class__.__init__.__globals__ }}{% endfor %}",
    # render to nothing: the sandbox turns unsafe attributes into undefined values
    "template-context": "{{ self._TemplateReference__context }}",
    "attr-filter": "{{ (messages|attr('__class__')) }}",
    "gi-frame": "{{ (messages|map('string')).gi_frame }}",
    "item-class": "{{ ''['__class__'] }}",
    # the file system: there is no loader, nothing can be read
    "include": "{% include '/etc/passwd' %}",
    "import": "{% import '/etc/passwd' as p %}{{ p }}",
    "extends": "{% extends '/etc/passwd' %}",
    "from-import": "{% from '/etc/passwd' import root %}{{ root }}",
    # resource limits the sandbox has
    "huge-range": "{% for i in range(10**9) %}{% endfor %}",
    "huge-string": "{{ 'a' * 4611686018427387904 }}",  # 2^62 bytes: no allocator gives that, whatever overcommit
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
}
BLOCKED = [
    "mro",
    "globals-os",
    "lipsum",
    "joiner",
    "namespace",
    "self-builtins",
    "raise-globals",
    "strftime-globals",
    "format",
    "format-globals",
    "mutate-list",
    "mutate-dict",
    "loop-class",
]
HARMLESS = ["template-context", "attr-filter", "gi-frame", "item-class"]
_BUG_TEMPLATE_ERRORS = (
    "bug: chat.py render() catches only jinja2.TemplateError and SecurityError; a template that fails with "
    "another exception ({}) is answered -32603 Internal error, where the spec says -32602 (the chat template "
    "fails on the messages). Reproduce: a GGUF whose tokenizer.chat_template is {!r}, then inference/chat"
)
FAILING = {  # probe -> the exception it raises inside render()
    "include": "TypeError: no loader for this environment specified",
    "import": "TypeError: no loader for this environment specified",
    "extends": "TypeError: no loader for this environment specified",
    "from-import": "TypeError: no loader for this environment specified",
    "huge-range": "OverflowError: Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000)",
    "huge-string": "MemoryError",
    "recursion": "RecursionError: maximum recursion depth exceeded",
}


def hostile_template(marker: str, probes: dict = PROBES) -> str:
    out = ""
    for i, (name, src) in enumerate(probes.items()):
        keyword = "if" if i == 0 else "elif"
        out += f"{{% {keyword} messages[-1]['content'] == '{name}' %}}{src.replace(MARKER, marker)}"
    return out + "{% endif %}{{ '" + TAIL.replace("\n", "\\n") + "' }}"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A server and a copy of the embedded model whose chat template is hostile."""
    folder = tmp_path_factory.mktemp("hostile")
    marker = str(folder / "pwned")
    path = str(folder / "hostile.gguf")
    gguf_with_string(embedded_gguf(), path, "tokenizer.chat_template", hostile_template(marker))
    c = RpcClient.spawn(env={"TMPDIR": str(folder)})
    try:
        c.initialize()
        info = c.call("model/load", {"model": path, "options": {"contextLength": 256, "slots": 1}}, timeout=60)
        assert info["source"] == "path" and info["model"] == path
        c.path, c.marker = path, marker
        baseline = c.call("inference/chat", _probe_params(path, "benign"))
        c.baseline_tokens = baseline["usage"]["promptTokens"]
        yield c
    finally:
        c.close(timeout=5, check=False)
    c.assert_clean()
    assert not os.path.exists(marker)


def _probe_params(path: str, probe: str) -> dict:
    return {"model": path, "messages": [{"role": "user", "content": probe}], "options": {"maxTokens": 1, **GREEDY}}


def _assert_nothing_leaked(c: RpcClient, response: dict) -> None:
    text = json.dumps(response)
    for secret in ("root:x:", "uid=", "/bin/bash", "<module", "<class", "__builtins__"):
        assert secret not in text, response
    assert not os.path.exists(c.marker), "the template wrote a file"
    assert c.proc.poll() is None, "the server died"


@pytest.mark.parametrize("probe", BLOCKED)
def test_hostile_chat_template_is_refused_by_the_sandbox_with_31006(hostile, probe):
    c = hostile
    r = c.request("inference/chat", _probe_params(c.path, probe), timeout=30)
    _assert_nothing_leaked(c, r)
    err = error_of(r)
    assert err["code"] == NOT_SUPPORTED, err
    assert "unsafe" in err["message"]
    assert result_of(c.request("inference/chat", _probe_params(c.path, "benign")))  # it keeps serving


@pytest.mark.parametrize("probe", HARMLESS)
def test_hostile_chat_template_renders_harmlessly(hostile, probe):
    c = hostile
    r = c.request("inference/chat", _probe_params(c.path, probe), timeout=30)
    _assert_nothing_leaked(c, r)
    # the probe rendered to nothing: the prompt is the plain turn's
    assert result_of(r)["usage"]["promptTokens"] == c.baseline_tokens


@pytest.mark.parametrize("probe", list(FAILING))
def test_hostile_chat_template_that_fails_is_32602_and_reads_nothing(hostile, probe):
    c = hostile
    r = c.request("inference/chat", _probe_params(c.path, probe), timeout=30)
    _assert_nothing_leaked(c, r)
    assert result_of(c.request("inference/chat", _probe_params(c.path, "benign")))  # it keeps serving
    assert error_of(r)["code"] in (INVALID_PARAMS, NOT_SUPPORTED), r


def test_a_template_that_loops_forever_does_not_stop_the_server(spawn, tmp_path):
    path = str(tmp_path / "slow.gguf")
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    gguf_with_string(embedded_gguf(), path, "tokenizer.chat_template", hostile_template("", {"loop": loop}))
    c = spawn()
    c.initialize()
    c.call("model/load", {"model": path, "options": {"contextLength": 256, "slots": 1}}, timeout=60)
    rid = c.request_async("inference/chat", _probe_params(path, "loop"))
    time.sleep(0.2)
    try:
        assert "result" in c.request("model/status", timeout=3)
        c.cancel(rid)
        # Cancelled, or refused first by the sandbox's loop budget (10^6 range items a render).
        assert error_of(c.response(rid, timeout=5))["code"] in (REQUEST_CANCELLED, NOT_SUPPORTED)
    finally:
        c.kill()


# -- renders bounded in time, output and memory, and stoppable ---------------------------------
# The server renders in worker processes (kinfer_rpc/host/render.py); KINFER_RENDER_SECONDS sets
# the time limit, 1 s here.
BOUNDED = {
    "slow": "{% set s = 'x' * 2000 %}{% for a in s %}{% for b in s %}{% for c in s %}{% endfor %}{% endfor %}"
    "{% endfor %}",
    "huge-value": "{{ 'a' * 4000000000 }}",
    "huge-power": "{{ 7 ** 100000000 }}",
    "huge-output": "{% for i in range(100) %}{{ 'a' * 1000000 }}{% endfor %}",
    "huge-memory": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "object": "{{ raise_exception }}",
    "object-in-list": "{{ [1, cycler] }}",
}


def _render_workers(server_pid: int) -> list[int]:
    """The server's render worker processes."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and b"kinfer_rpc.host.render" in cmd:
            out.append(int(pid))
    return out


def _bounded(spawn, tmp_path, seconds: str):
    path = str(tmp_path / "bounded.gguf")
    gguf_with_string(embedded_gguf(), path, "tokenizer.chat_template", hostile_template("", BOUNDED))
    c = spawn(env={"KINFER_RENDER_SECONDS": seconds})
    c.initialize()
    c.call("model/load", {"model": path, "options": {"contextLength": 256, "slots": 2}}, timeout=60)
    c.path = path
    return c


@pytest.fixture
def bounded(spawn, tmp_path):
    return _bounded(spawn, tmp_path, "1")


@pytest.fixture
def bounded_memory(spawn, tmp_path):
    """A time limit far above what filling the memory limit takes on a busy machine, so the
    memory limit is what stops the render."""
    return _bounded(spawn, tmp_path, "60")


def test_a_render_over_the_time_limit_is_32602_and_the_protocol_keeps_answering(bounded):
    c = bounded
    t0 = time.monotonic()
    rids = [c.request_async("inference/chat", _probe_params(c.path, "slow")) for _ in range(6)]
    time.sleep(0.3)
    worst = 0.0
    for _ in range(10):  # every worker busy, two renders waiting: status answers at once
        t = time.monotonic()
        assert "result" in c.request("model/status", timeout=3)
        worst = max(worst, time.monotonic() - t)
    assert worst < 0.1, worst
    from kinfer_rpc.host.render import WORKER_NICE

    server_nice = os.getpriority(os.PRIO_PROCESS, c.proc.pid)
    workers = _render_workers(c.proc.pid)
    assert workers
    for pid in workers:  # below the server: a spinning template yields to it
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, server_nice + WORKER_NICE)
    for rid in rids:
        err = error_of(c.response(rid, timeout=10))
        assert err["code"] == INVALID_PARAMS and "limit of 1 s" in err["message"], err
    assert time.monotonic() - t0 < 6  # four at once, then two: about 2 s
    assert result_of(c.request("inference/chat", _probe_params(c.path, "benign")))


@pytest.mark.parametrize(
    "probe", ["huge-value", "huge-power", "huge-output", "huge-memory", "object", "object-in-list"]
)
def test_a_render_too_big_or_writing_objects_is_32602(request, probe):
    c = request.getfixturevalue("bounded_memory" if probe == "huge-memory" else "bounded")
    r = c.request("inference/chat", _probe_params(c.path, probe), timeout=90)
    err = error_of(r)
    assert err["code"] == INVALID_PARAMS, err
    words = {"huge-memory": "memory", "object": "object", "object-in-list": "object"}
    assert words.get(probe, "over the limit") in err["message"], err
    assert len(json.dumps(r)) < 2000  # the error names the limit, it does not echo the output
    assert result_of(c.request("inference/chat", _probe_params(c.path, "benign")))


def test_cancel_unload_and_exit_stop_a_render_at_once(bounded):
    c = bounded
    rid = c.request_async("inference/chat", _probe_params(c.path, "slow"))
    time.sleep(0.3)
    before = _render_workers(c.proc.pid)
    assert 1 <= len(before) <= 2  # the busy one, and a spare starting for the next render
    c.cancel(rid)
    assert error_of(c.response(rid, timeout=0.5))["code"] == REQUEST_CANCELLED
    time.sleep(0.2)
    after = _render_workers(c.proc.pid)
    assert len(after) == len(before) - 1 and set(after) <= set(before)  # the busy worker was killed, not left spinning

    rid = c.request_async("inference/chat", _probe_params(c.path, "slow"))
    time.sleep(0.3)
    c.call("model/unload", {"model": c.path}, timeout=10)
    err = error_of(c.response(rid, timeout=0.5))
    assert err["code"] == REQUEST_CANCELLED and "unloaded" in err["message"], err

    c.call("model/load", {"model": c.path, "options": {"contextLength": 256, "slots": 1}}, timeout=60)
    rid = c.request_async("inference/chat", _probe_params(c.path, "slow"))
    time.sleep(0.3)
    workers = _render_workers(c.proc.pid)
    t = time.monotonic()
    c.call("shutdown")
    c.notify("exit")
    assert c.proc.wait(5) == 0 and time.monotonic() - t < 2
    time.sleep(0.2)
    assert not [p for p in workers if os.path.exists(f"/proc/{p}")]


# -- render workers shared in turns between connections -------------------------------------------
def test_render_turns_keep_a_worker_for_another_client_while_several_are_connected():
    import anyio

    from kinfer_rpc.host.render import _Turns

    async def main() -> None:
        turns = _Turns(2)
        order: list[str] = []
        release = anyio.Event()

        async def render(client: int, share: bool, name: str) -> None:
            async with turns.turn(client, share):
                order.append(name)
                await release.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(render, 1, True, "a1")
            tg.start_soon(render, 1, True, "a2")  # the last worker: kept for another client
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(render, 2, True, "b1")
            await anyio.wait_all_tasks_blocked()
            assert order == ["a1", "b1"]
            release.set()
        assert order == ["a1", "b1", "a2"]
        alone = _Turns(2)  # one client connected: every worker is its own
        async with alone.turn(1, False), alone.turn(1, False):
            assert alone.running == {1: 2}

    anyio.run(main)


def test_a_connection_whose_renders_hang_keeps_no_other_waiting(tmp_path):
    from served import BIN, Served

    path = str(tmp_path / "bounded.gguf")
    gguf_with_string(embedded_gguf(), path, "tokenizer.chat_template", hostile_template("", BOUNDED))
    served = Served(tmp_path, env={"KINFER_RENDER_SECONDS": "6"})
    attach = ("--attach", "--socket", str(served.socket))
    a = RpcClient.spawn(*attach, env=served.env, executable=str(BIN / "kinfer-rpc"))
    b = RpcClient.spawn(*attach, env=served.env, executable=str(BIN / "kinfer-rpc"))
    try:
        for c in (a, b):
            c.initialize()
            c.call("model/load", {"model": path, "options": {"contextLength": 256, "slots": 2}}, timeout=60)
        t0 = time.monotonic()
        hung = [a.request_async("inference/chat", _probe_params(path, "slow")) for _ in range(4)]
        time.sleep(0.5)  # every worker a may take is rendering
        assert result_of(b.request("inference/chat", _probe_params(path, "benign"), timeout=5))
        assert time.monotonic() - t0 < 5.5  # before a's first render reached its limit
        for rid in hung:
            assert error_of(a.response(rid, timeout=60))["code"] == INVALID_PARAMS  # over the limit
    finally:
        a.kill()
        b.kill()
        assert served.stop() == 0
