"""Security: model files whose metadata or tensor table would take the server down.

llama.cpp asserts on some hyperparameters (GGML_ASSERT aborts the process: every model and request
with it), divides by others, and computes NaNs from a NaN norm epsilon until a sampler asserts at the
first decode. kinfer checks a GGUF before llama.cpp sees it (kinfer_rpc.host.gguf.check_llama) and
answers -31003 saying what is wrong. The corpus (tests/hostile_gguf.py) is the embedded model with
one thing wrong in its metadata or its tensor table, each file a hole where the weights were (the
header is all that is read before the refusal).

The server tests drive a real `kinfer-rpc` process through tests/rpcclient.py (which checks that
stdout carries nothing but frames and that every message matches spec/metaModel.json);
docs/reliability.md describes them.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hostile_gguf import CORPUS, Gguf, build_corpus
from protocol_fixtures import spawn  # noqa: F401  (fixture)
from reliability_helpers import GREEDY, LOAD_FAILED, children_of, no_traceback
from rpcclient import DEFAULT_MODEL, RpcClient, error_of, result_of, send_together

from kinfer_rpc import errors
from kinfer_rpc.host import gguf as gguf_meta
from kinfer_rpc.host.store import embedded_default_path

SMALL = {"contextLength": 256, "slots": 1}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (path, a piece of the message its refusal must carry)."""
    return build_corpus(embedded_default_path(), tmp_path_factory.mktemp("hostile-gguf"))


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    """One initialized server with empty model stores, for the whole corpus."""
    root = tmp_path_factory.mktemp("gguf-server")
    env = {"KINFER_MODELS": str(root / "kinfer"), "OLLAMA_MODELS": str(root / "ollama"), "KINFER_HOME": str(root)}
    c = RpcClient.spawn(env=env)
    try:
        c.initialize()
        yield c
    finally:
        c.close(timeout=5, check=False)
    c.assert_clean()
    no_traceback(c)


def _alive(c: RpcClient) -> None:
    assert c.proc.poll() is None, c.stderr_tail()
    assert children_of(c.proc.pid) == [], "the server started a process (a debugger?)"


# -- the check, in process -----------------------------------------------------------------------
def test_the_embedded_model_passes():
    assert gguf_meta.llama_problems(gguf_meta.read(embedded_default_path())) == []


def test_the_corpus_writer_changes_nothing_else(tmp_path):
    """The rewrite without a mutation reads back as the original: every refusal below is its mutation's."""
    src = embedded_default_path()
    same = Gguf.read(src).write(str(tmp_path / "same.gguf"), data="sparse")
    a, b = gguf_meta.read(src), gguf_meta.read(same)
    assert a.metadata == b.metadata and a.tensors == b.tensors and a.data_end == b.data_end
    assert gguf_meta.llama_problems(b) == []


@pytest.mark.parametrize("name", list(CORPUS))
def test_check_llama_says_what_is_wrong(corpus, name):
    path, expected = corpus[name]
    with pytest.raises(errors.KinferError) as caught:
        gguf_meta.check_llama(path)
    exc = caught.value
    assert exc.code == errors.LOAD_FAILED and exc.data == {"path": path}
    assert path in exc.message and expected in exc.message, exc.message


# -- through the server --------------------------------------------------------------------------
@pytest.mark.model
@pytest.mark.parametrize("name", list(CORPUS))
def test_a_hostile_gguf_is_answered_31003_and_the_server_lives(gguf_server, corpus, name):
    c = gguf_server
    path, expected = corpus[name]
    err = error_of(c.request("model/load", {"model": path, "options": SMALL}, timeout=30))
    assert err["code"] == LOAD_FAILED and err["data"] == {"path": path}, err
    assert expected in err["message"], err["message"]
    _alive(c)
    assert c.call("model/status") == {"models": []}


@pytest.mark.model
def test_the_server_serves_after_the_whole_corpus_at_once(gguf_server, corpus):
    """Every hostile file in one write, through model/load and inference/generate; then the
    embedded model loads and answers."""
    c = gguf_server
    messages, ids = [], []
    for i, (path, _) in enumerate(corpus.values()):
        for method, params in (
            ("model/load", {"model": path, "options": SMALL}),
            ("inference/generate", {"model": path, "prompt": "Hi", "options": {"maxTokens": 2}}),
        ):
            rid = f"hostile-{i}-{method}"
            ids.append(rid)
            messages.append({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
    send_together(c, messages)
    for rid in ids:
        assert error_of(c.response(rid, timeout=60))["code"] == LOAD_FAILED
    _alive(c)
    c.load_model()
    out = result_of(
        c.request("inference/generate", {"prompt": "Once upon a time", "options": {"maxTokens": 4, **GREEDY}})
    )
    assert out["usage"]["completionTokens"] == 4 and out["text"], out
    c.call("model/unload", {"model": DEFAULT_MODEL})  # the next test loads it again, with a draft model


@pytest.mark.model
def test_a_hostile_draft_model_is_refused_too(gguf_server, corpus):
    c = gguf_server
    path, expected = corpus["block-count-100000"]
    options = {**SMALL, "draftPolicy": "draft-model", "draftModel": path}
    err = error_of(c.request("model/load", {"options": options}, timeout=30))
    assert err["code"] == LOAD_FAILED and expected in err["message"], err
    _alive(c)


def test_the_server_turns_ggml_backtraces_off():
    """An abort in ggml would otherwise fork gdb to print a backtrace (kinfer_rpc.protocol.server.main
    sets GGML_NO_BACKTRACE before any library loads); here main runs without its event loop."""
    code = (
        "import os, sys\n"
        "from kinfer_rpc.protocol import server\n"
        "server.anyio.run = lambda *a, **k: sys.stderr.write('GGML_NO_BACKTRACE=%s' % os.environ.get("
        "'GGML_NO_BACKTRACE')) and 0\n"
        "server.main([])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GGML_NO_BACKTRACE"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=60
    )
    assert b"GGML_NO_BACKTRACE=1" in done.stderr, done.stderr
