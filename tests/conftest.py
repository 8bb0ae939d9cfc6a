"""Shared fixtures of the tests, and the environment every test runs in (the patched llama.cpp,
OpenMP workers that do not spin, the helper modules on sys.path)."""

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import pytest

# llama.cpp's OpenMP workers spin while waiting; on a shared 2-core machine that makes every
# model in the suite (in-process or a spawned server) many times slower. Set before any load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Test helpers (rpcclient, engine_helpers, reliability_helpers...) and the model generators
# (modelgen/make_*.py, also run as scripts) are imported as plain modules.
sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "modelgen")]

# kinfer's patched llama.cpp (patches/build_llama.sh, run by the README's test command): load it
# instead of the wheel's library where it was built.
_PATCHED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".llama", "lib")
if os.path.exists(os.path.join(_PATCHED, "libllama.so")) and "LLAMA_CPP_LIB_PATH" not in os.environ:
    os.environ["LLAMA_CPP_LIB_PATH"] = _PATCHED
    os.environ["KINFER_TESTS_ON_PATCHED_LLAMA"] = "1"

from cli_helpers import FAKE_SERVER, KINFER, json_lines  # noqa: E402
from lsp_helpers import fim_model  # noqa: E402
from readme_helpers import blocks, pulls_before  # noqa: E402
from registry_helpers import Server  # noqa: E402
from reliability_helpers import no_traceback  # noqa: E402  (after the path and environment above)
from rpcclient import RpcClient  # noqa: E402
from store_helpers import MEDIA, OllamaStore, place  # noqa: E402
from tmux_helpers import Tmux, tmux_binary  # noqa: E402

from kinfer_rpc.host.store import embedded_default_path  # noqa: E402

# -- fixtures shared by several test modules ---------------------------------------------------


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """One initialized server that never loads a model, with empty model stores."""
    root = tmp_path_factory.mktemp("bare")
    env = {
        "KINFER_MODELS": str(root / "kinfer"),
        "OLLAMA_MODELS": str(root / "ollama"),
        "KINFER_HOME": str(root / "home"),
    }
    c = RpcClient.spawn(env=env)
    try:
        c.initialize()
        yield c
    finally:
        c.close(timeout=5, check=False)
    c.assert_clean()
    no_traceback(c)


@pytest.fixture
def small_store(tmp_path, monkeypatch):
    """Model stores that hold tiny-a and tiny-b (the embedded model's file) beside the default."""
    folder = tmp_path / "kinfer"
    folder.mkdir()
    for name in ("tiny-a", "tiny-b"):
        place(Path(embedded_default_path()), folder / f"{name}.gguf")
    monkeypatch.setenv("KINFER_MODELS", str(folder))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("KINFER_HOME", str(tmp_path / "home"))


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """kinfer runs the stand-in server; returns the params of the chats it got."""
    script = tmp_path / "fake-kinfer-rpc"
    script.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    script.chmod(0o755)
    log = tmp_path / "chats.jsonl"
    monkeypatch.setenv("KINFER_RPC", str(script))
    monkeypatch.setenv("FAKE_LOG", str(log))
    return lambda: json_lines(log.read_text()) if log.exists() else []


# -- show, and list's NUM_CTX: what the stores say of a model, nothing loaded -----------------------
@pytest.fixture
def pirate_store(tmp_path, monkeypatch):
    """An Ollama model with its own parameters, system message and Go template."""
    gguf = Path(embedded_default_path())
    store = OllamaStore(tmp_path / "ollama")
    digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    place(gguf, store.root / "blobs" / digest.replace(":", "-"))
    model = {"mediaType": MEDIA + "model", "digest": digest, "size": gguf.stat().st_size}
    params = {"num_ctx": 2048, "temperature": 0.2, "num_predict": 40, "stop": ["<|im_end|>"], "mirostat": 1}
    layers = [
        model,
        store.blob(json.dumps(params).encode(), "params"),
        store.blob(b"You are a pirate.\nAnswer like one.", "system"),
        store.blob(b"{{ .System }}{{ .Prompt }}", "template"),
    ]
    store.manifest("registry.ollama.ai/library/pirate/latest", layers)
    monkeypatch.setenv("OLLAMA_MODELS", str(store.root))
    monkeypatch.setenv("KINFER_MODELS", str(tmp_path / "kinfer"))
    monkeypatch.setenv("KINFER_HOME", str(tmp_path / "home"))


@pytest.fixture
def term(tmp_path, monkeypatch):
    """A terminal (tmux) of our own; the history file goes to a home of its own."""
    binary = tmux_binary()
    if binary is None:
        pytest.skip("tmux is not installed and could not be installed (apt-get install tmux)")
    monkeypatch.setenv("KINFER_HOME", str(tmp_path / "home"))
    t = Tmux(binary, tmp_path)
    try:
        yield t
    finally:
        t.close()


@pytest.fixture
def fake(tmp_path):
    """The stand-in server of tests/test_cli.py: the command line that runs kinfer on it, and the
    params of the chats it got."""
    script = tmp_path / "fake-kinfer-rpc"
    script.write_text(f"#!{sys.executable}\n" + FAKE_SERVER)
    script.chmod(0o755)
    log = tmp_path / "chats.jsonl"

    class Fake:
        command = f"exec env KINFER_RPC={script} FAKE_LOG={log} {KINFER}"

        @staticmethod
        def chats() -> list:
            return json_lines(log.read_text()) if log.exists() else []

    return Fake


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A registry on 127.0.0.1 serving, under each name the README pulls, a stand-in: the tool
    model, or the fill-in-the-middle one for a coder model."""
    from make_fim_model import make_fim_model
    from make_tool_model import make_tool_model

    folder = tmp_path_factory.mktemp("stand-ins")
    made: dict[str, Path] = {}
    server = Server()
    for code in [*blocks("python"), *blocks("sh", "The first five minutes")]:
        for name in re.findall(r"kinfer pull ([a-z0-9][a-z0-9.:/_-]*)", code) + pulls_before(code):
            kind = "fim" if "coder" in name else "tools"
            if kind not in made:
                make = make_fim_model if kind == "fim" else make_tool_model
                made[kind] = Path(make(folder / f"{kind}.gguf"))
            model, tag = name.split(":")
            data = made[kind]
            digest = "sha256:" + hashlib.sha256(data.read_bytes()).hexdigest()
            server.model(f"library/{model}", tag, [("model", data, digest)])
    yield server
    server.close()


@pytest.fixture(scope="module")
def fim(tmp_path_factory):
    path = fim_model(tmp_path_factory.mktemp("fim"))
    if path is None:
        pytest.skip("the server has no inference/infill or tests/modelgen no FIM model helper")
    return path
