"""The model store: Ollama's layout, kinfer's folder, paths, GGUF metadata, integrity.

A real Ollama-layout store is built in a temp dir from the embedded SmolLM2 GGUF: the model blob
under its real sha256, template/system/params layers as real blobs, manifests in Ollama's format.
The last tests load and chat with it by name through a real `kinfer-rpc` process.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from make_vision_projector import make_vision_projector, png
from store_helpers import MEDIA, OllamaStore, place

from kinfer_rpc import errors
from kinfer_rpc.default_plugins.llama import vision
from kinfer_rpc.host import gguf as gguf_meta
from kinfer_rpc.host.options import RequestOptions
from kinfer_rpc.host.store import DEFAULT_MODEL, ModelStore, embedded_default_path

KINFER_RPC = os.path.join(os.path.dirname(sys.executable), "kinfer-rpc")
SYSTEM = "You are a pirate. Answer like one."
PARAMS = {
    "num_predict": 3,
    "seed": 42,
    "top_k": 20,
    "temperature": 0,
    "stop": ["<|im_end|>"],
    "num_ctx": 1024,
    "mirostat": 0,
    "top_p": 7.5,
}
TEMPLATE = "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}<|im_start|>user\n{{ .Prompt }}"


@pytest.fixture(scope="module")
def gguf() -> tuple[Path, str]:
    path = Path(embedded_default_path())
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            sha.update(chunk)
    return path, "sha256:" + sha.hexdigest()


@pytest.fixture(scope="module")
def stores(tmp_path_factory, gguf):
    """OLLAMA_MODELS, KINFER_MODELS and KINFER_HOME folders, built once for the module."""
    src, digest = gguf
    base = tmp_path_factory.mktemp("stores")
    ollama = OllamaStore(base / "ollama")
    place(src, ollama.root / "blobs" / digest.replace(":", "-"))
    model = {"mediaType": MEDIA + "model", "digest": digest, "size": src.stat().st_size}
    extras = [
        ollama.blob(TEMPLATE.encode(), "template"),
        ollama.blob(SYSTEM.encode(), "system"),
        ollama.blob(json.dumps(PARAMS).encode(), "params"),
        ollama.blob(b"Apache 2.0", "license"),
    ]
    ollama.manifest("registry.ollama.ai/library/smollm2/135m", [model, *extras])
    ollama.manifest("registry.ollama.ai/library/smollm2/q4", [model])
    ollama.manifest("registry.ollama.ai/someone/smollm2/135m", [model])
    ollama.manifest("example.com:5000/team/smollm2/latest", [model])
    projector = Path(make_vision_projector(base / "mmproj.gguf")).read_bytes()  # SmolLM2's embeddings
    ollama.manifest("registry.ollama.ai/library/llava/7b", [model, ollama.blob(projector, "projector")])
    ollama.manifest("registry.ollama.ai/library/tuned/latest", [model, ollama.blob(b"\0" * 64, "adapter")])
    ollama.manifest(
        "registry.ollama.ai/library/mlxmodel/latest",
        [
            {**ollama.blob(b"\0" * 32, "tensor"), "name": "model.embed_tokens.weight"},
            {**ollama.blob(b"\1" * 32, "tensor"), "name": "lm_head.weight"},
        ],
    )
    (ollama.root / "manifests/registry.ollama.ai/library/broken").mkdir(parents=True)
    (ollama.root / "manifests/registry.ollama.ai/library/broken/latest").write_text("{not json")
    kinfer = base / "kinfer"
    kinfer.mkdir()
    place(src, kinfer / "tiny-kinfer.gguf")
    data = src.read_bytes()
    (kinfer / "half.gguf").write_bytes(data[: len(data) // 2])
    (kinfer / "header-cut.gguf").write_bytes(data[:5000])
    home = base / "home"
    return {"OLLAMA_MODELS": str(ollama.root), "KINFER_MODELS": str(kinfer), "KINFER_HOME": str(home)}


@pytest.fixture
def store(stores, monkeypatch) -> ModelStore:
    for key, value in stores.items():
        monkeypatch.setenv(key, value)
    return ModelStore()


def _error(fn, *args) -> errors.KinferError:
    with pytest.raises(errors.KinferError) as info:
        fn(*args)
    return info.value


# -- names ---------------------------------------------------------------------------------------
def test_three_ollama_name_forms_resolve_to_the_same_blob(store, gguf):
    refs = [
        store.resolve(n)
        for n in ("smollm2:135m", "library/smollm2:135m", "registry.ollama.ai/library/smollm2:135m", "SmolLM2:135M")
    ]
    assert {r.name for r in refs} == {"smollm2:135m"}
    ref = refs[0]
    assert ref.source == "ollama" and ref.format == "gguf" and ref.digest == gguf[1]
    assert Path(ref.path) == Path(os.environ["OLLAMA_MODELS"]) / "blobs" / gguf[1].replace(":", "-")


def test_ollama_layers_become_defaults(store):
    ref = store.resolve("smollm2:135m")
    assert ref.system == SYSTEM
    assert ref.template == TEMPLATE  # kept, never executed
    # Ollama's names mapped to kinfer's; num_ctx is the load's default; unknown (mirostat) and
    # invalid (top_p 7.5) parameters are dropped rather than failing every request.
    assert ref.defaults == RequestOptions(max_tokens=3, seed=42, top_k=20, temperature=0, stop=["<|im_end|>"])
    assert ref.context_length == 1024
    assert store.resolve("smollm2:q4").defaults == RequestOptions() and store.resolve("smollm2:q4").system is None
    # ... and the load result says which were left out, and why
    assert dict(ref.ignored).keys() == {"mirostat", "top_p"}
    assert "no equivalent" in dict(ref.ignored)["mirostat"] and "topP" in dict(ref.ignored)["top_p"]


def test_names_as_ollama_shows_them_and_other_namespaces_and_hosts(store):
    names = [r.name for r in store.list()]
    assert names[0] == DEFAULT_MODEL
    for expected in [
        "smollm2:135m",
        "smollm2:q4",
        "someone/smollm2:135m",
        "example.com:5000/team/smollm2:latest",
        "llava:7b",
        "mlxmodel:latest",
        "tiny-kinfer",
        "half",
    ]:
        assert expected in names
    assert not any("broken" in n for n in names)  # an unreadable manifest is skipped
    assert store.resolve("someone/smollm2:135m").name == "someone/smollm2:135m"
    assert store.resolve("registry.ollama.ai/someone/smollm2:135m").name == "someone/smollm2:135m"
    assert store.resolve("example.com:5000/team/smollm2").name == "example.com:5000/team/smollm2:latest"
    assert store.resolve("mlxmodel").name == "mlxmodel:latest"  # the tag defaults to latest


def test_unique_prefixes_resolve(store):
    assert store.resolve("smollm2:q").name == "smollm2:q4"
    assert store.resolve("tiny").name == "tiny-kinfer"
    assert store.resolve("someone/").name == "someone/smollm2:135m"
    assert store.resolve("smollm2-1").name == DEFAULT_MODEL
    assert store.resolve(None).source == "embedded"


def test_ambiguous_names_list_the_candidates(store):
    err = _error(store.resolve, "smollm")
    assert err.code == errors.MODEL_NOT_FOUND and "ambiguous" in err.message
    assert err.data["model"] == "smollm"
    assert set(err.data["candidates"]) == {DEFAULT_MODEL, "smollm2:135m", "smollm2:q4"}
    for name in err.data["candidates"]:
        assert name in err.message


def test_unknown_names_list_what_exists(store):
    err = _error(store.resolve, "qwen3:8b")
    assert err.code == errors.MODEL_NOT_FOUND and "not found" in err.message
    assert {"smollm2:135m", "tiny-kinfer", DEFAULT_MODEL} <= set(err.data["available"])
    assert "smollm2:135m" in err.message


def test_paths(store, gguf, tmp_path):
    ref = store.resolve(str(gguf[0]))
    assert ref.source == "path" and ref.format == "gguf" and ref.path == str(gguf[0])
    blob = store.resolve("smollm2:135m").path  # an Ollama blob by path: GGUF by its magic
    assert store.resolve(blob).format == "gguf"
    mlx = tmp_path / "an-mlx-model"
    mlx.mkdir()
    (mlx / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 40960}))
    assert store.resolve(str(mlx)).format == "mlx"
    assert _error(store.resolve, str(tmp_path / "missing.gguf")).code == errors.MODEL_NOT_FOUND


# -- metadata ------------------------------------------------------------------------------------
def test_model_list_metadata_from_the_gguf_header(store, gguf):
    entries = {r.name: store.describe(r) for r in store.list()}
    for name in ["smollm2:135m", "tiny-kinfer", DEFAULT_MODEL]:
        e = entries[name]
        assert e["format"] == "gguf" and e["architecture"] == "llama" and e["quantization"] == "Q4_1"
        assert e["contextLength"] == 8192 and abs(e["parameters"] - 134.5e6) < 0.1e6
        assert "error" not in e
    assert entries["smollm2:135m"]["sizeBytes"] >= gguf[0].stat().st_size  # every layer counted
    assert entries["smollm2:135m"]["source"] == "ollama" and entries["tiny-kinfer"]["source"] == "kinfer"
    assert entries["mlxmodel:latest"]["format"] == "mlx"
    assert "(truncated?)" in entries["half"]["error"] and entries["half"]["architecture"] is None
    assert "not support" in entries["tuned:latest"]["error"]
    assert "error" not in entries["llava:7b"] and entries["llava:7b"]["architecture"] == "llama"


def test_gguf_header_reader(gguf):
    meta = gguf_meta.read(gguf[0])
    assert meta.version == 3 and meta.tensor_count > 0 and meta.n_vocab == 49152
    assert meta.data_end == gguf[0].stat().st_size
    assert "im_start" in meta.chat_template
    assert gguf_meta.read(gguf[0]) is meta  # cached


@pytest.mark.parametrize("name", ["half", "header-cut"])
def test_truncated_gguf_is_a_clear_error(store, name):
    ref = store.resolve(name)
    err = _error(store.prepare, ref)
    assert err.code == errors.LOAD_FAILED and "(truncated?)" in err.message and name in err.message


@pytest.mark.parametrize(
    "content", [b"", b"GGUF", b"GGUF" + b"\0" * 64, b"GGUF\3\0\0\0" + b"\xff" * 40, b"hello world" * 9]
)
def test_garbage_is_a_clear_error(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    err = _error(gguf_meta.read, bad)
    assert err.code == errors.LOAD_FAILED and str(bad) in err.message


# -- integrity -----------------------------------------------------------------------------------
def test_verify_catches_a_corrupt_blob(tmp_path, gguf, monkeypatch):
    src, digest = gguf
    ollama = OllamaStore(tmp_path / "ollama")
    blob = ollama.root / "blobs" / digest.replace(":", "-")
    data = bytearray(src.read_bytes())
    data[-1000] ^= 0xFF  # inside the tensor data: the header still reads fine
    blob.write_bytes(data)
    ollama.manifest(
        "registry.ollama.ai/library/damaged/latest",
        [{"mediaType": MEDIA + "model", "digest": digest, "size": len(data)}],
    )
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama.root))
    monkeypatch.setenv("KINFER_HOME", str(tmp_path / "home"))
    store = ModelStore()
    ref = store.resolve("damaged")
    err = _error(store.prepare, ref)  # on by default for an Ollama blob under the threshold
    assert err.code == errors.LOAD_FAILED and "corrupt" in err.message
    assert err.data["expected"] == digest and err.data["actual"] != digest
    assert digest in err.message and err.data["actual"] in err.message
    store.prepare(ref, verify=False)  # asked not to: only the header is checked
    assert not (tmp_path / "home" / "verified.json").exists()


def test_verified_digests_are_cached(store, stores, monkeypatch):
    ref = store.resolve("smollm2:135m")
    store.prepare(ref, verify=True)
    saved = json.loads((Path(stores["KINFER_HOME"]) / "verified.json").read_text())["verified"]
    assert [e["digest"] for e in saved] == [ref.digest]
    calls = []
    monkeypatch.setattr("hashlib.sha256", lambda *a: calls.append(a) or hashlib.new("sha256", *a))
    ModelStore().prepare(ref, verify=True)  # a fresh store reads the cache file: no re-hash
    store.prepare(ref, verify=True)
    assert calls == []


def test_a_missing_blob_is_a_clear_error(tmp_path, monkeypatch):
    ollama = OllamaStore(tmp_path / "ollama")
    ollama.manifest(
        "registry.ollama.ai/library/partial/latest",
        [{"mediaType": MEDIA + "model", "digest": "sha256:" + "ab" * 32, "size": 1234}],
    )
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama.root))
    store = ModelStore()
    ref = store.resolve("partial")
    assert "error" in store.describe(ref)
    err = _error(store.prepare, ref)
    assert err.code == errors.LOAD_FAILED and "missing" in err.message and "pull it again" in err.message


def test_unsupported_layers(store):
    err = _error(store.resolve, "tuned")
    assert err.code == errors.NOT_SUPPORTED and "LoRA adapter" in err.message
    vision = store.resolve("llava:7b")  # a vision model serves text; its projector is known
    assert vision.unsupported is None and vision.projector is not None
    assert Path(vision.projector).parent.name == "blobs"
    assert Path(vision.projector).read_bytes()[:4] == b"GGUF"
    ref = store.resolve("mlxmodel")
    assert ref.format == "mlx" and [n for n, _ in ref.blobs] == ["model.embed_tokens.weight", "lm_head.weight"]


# -- through a real server ------------------------------------------------------------------------
class Server:
    """A tiny client: Content-Length frames on the child's stdin, frames read with a timeout."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen(
            [KINFER_RPC], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
        self.inbox: queue.Queue = queue.Queue()
        self.ids = iter(range(1, 1 << 30))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        out = self.proc.stdout
        while True:
            headers = {}
            while (line := out.readline()) not in (b"\r\n", b""):
                key, _, value = line.decode().partition(":")
                headers[key.strip().lower()] = value.strip()
            if not line:
                return
            self.inbox.put(json.loads(out.read(int(headers["content-length"]))))

    def send(self, message: dict) -> None:
        body = json.dumps(message).encode()
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.proc.stdin.flush()

    def request(self, method: str, params=None, timeout: float = 60) -> dict:
        rid = next(self.ids)
        self.send({"jsonrpc": "2.0", "id": rid, "method": method, "params": params or {}})
        deadline = time.monotonic() + timeout
        while True:
            msg = self.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
            if msg.get("id") == rid and "method" not in msg:
                return msg

    def call(self, method: str, params=None) -> dict:
        msg = self.request(method, params)
        assert "result" in msg, msg
        return msg["result"]

    def close(self) -> int:
        self.request("shutdown")
        self.send({"jsonrpc": "2.0", "method": "exit"})
        self.proc.stdin.close()
        return self.proc.wait(timeout=20)


@pytest.fixture(scope="module")
def server(stores):
    env = {**os.environ, **stores}
    env.pop("KINFER_RPC_PLUGINS", None)
    s = Server(env)
    s.call("initialize", {"processId": os.getpid(), "capabilities": {}})
    s.send({"jsonrpc": "2.0", "method": "initialized", "params": {}})
    yield s
    try:
        assert s.close() == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def test_server_lists_ollama_models(server):
    models = {m["name"]: m for m in server.call("model/list")["models"]}
    m = models["smollm2:135m"]
    assert m["source"] == "ollama" and m["format"] == "gguf" and m["loaded"] is False
    assert (m["architecture"], m["quantization"], m["contextLength"]) == ("llama", "Q4_1", 8192)
    assert abs(m["parameters"] - 134.5e6) < 0.1e6 and m["sizeBytes"] > 98_000_000
    assert models[DEFAULT_MODEL]["source"] == "embedded" and models["tiny-kinfer"]["source"] == "kinfer"


@pytest.mark.model
def test_server_chats_with_an_ollama_model_by_name(server):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = server.call(
        "inference/chat", {"model": "smollm2:135m", "messages": messages, "options": {"maxTokens": 8, "temperature": 0}}
    )
    assert r["model"] == "smollm2:135m" and r["text"].strip()
    assert 3 < r["usage"]["completionTokens"] <= 8  # the request's maxTokens beats num_predict
    # The params layer: num_predict 3 and seed 42 apply when the request does not say.
    d = server.call("inference/chat", {"model": "smollm2:135m", "messages": messages})
    assert d["usage"]["completionTokens"] == 3 and d["stopReason"] == "length" and d["seed"] == 42
    assert (
        server.call(
            "inference/chat", {"model": "smollm2:135m", "messages": messages, "options": {"seed": 7, "maxTokens": None}}
        )["seed"]
        == 7
    )
    # The system layer is the default system message, as if the request had given it.
    explicit = server.call(
        "inference/chat",
        {
            "model": "smollm2:135m",
            "options": {"maxTokens": 1},
            "messages": [{"role": "system", "content": SYSTEM}, *messages],
        },
    )
    assert explicit["usage"]["promptTokens"] == d["usage"]["promptTokens"]
    other = server.call(
        "inference/chat",
        {
            "model": "smollm2:135m",
            "options": {"maxTokens": 1},
            "messages": [{"role": "system", "content": "Be brief."}, *messages],
        },
    )
    assert other["usage"]["promptTokens"] != d["usage"]["promptTokens"]
    # num_ctx is the load's context length; the model now shows as loaded.
    status = server.call("model/status", {"model": "smollm2:135m"})["models"][0]
    assert status["state"] == "ready"
    assert server.call("model/load", {"model": "library/smollm2:135m"})["contextLength"] == 1024
    assert {m["name"]: m["loaded"] for m in server.call("model/list")["models"]}["smollm2:135m"] is True


@pytest.mark.model
def test_a_vision_model_answers_text_and_reads_images(server):
    """An Ollama model with a projector layer loads with it (where libmtmd is there: else for text
    alone, and a message's images are refused)."""
    reply = server.call("inference/generate", {"model": "llava:7b", "prompt": "Hello", "options": {"maxTokens": 2}})
    assert reply["usage"]["completionTokens"] >= 1
    image = base64.b64encode(png(8, 8, (0, 128, 0))).decode()
    answer = server.request(
        "inference/chat",
        {
            "model": "llava:7b",
            "messages": [{"role": "user", "content": "What is this?", "images": [image]}],
            "options": {"maxTokens": 2},
        },
    )
    if vision.available()[0]:
        assert answer["result"]["usage"]["promptTokens"] > 16, answer
        assert server.call("model/status", {"model": "llava:7b"})["models"][0]["images"]["encoded"] == 1
    else:
        err = answer["error"]
        assert err["code"] == errors.NOT_SUPPORTED and err["data"]["field"] == "messages[0].images", err


def test_server_errors_are_answers_not_crashes(server):
    cases = [
        ("half", errors.LOAD_FAILED, "(truncated?)"),
        ("mlxmodel", errors.LOAD_FAILED, "loading mlxmodel:latest failed"),  # the mlx backend reads its blobs
        ("tuned", errors.NOT_SUPPORTED, "LoRA adapter"),
        ("smollm", errors.MODEL_NOT_FOUND, "ambiguous"),
        ("qwen3:8b", errors.MODEL_NOT_FOUND, "smollm2:135m"),
    ]
    for name, code, text in cases:
        err = server.request("model/load", {"model": name})["error"]
        assert err["code"] == code and text in err["message"], (name, err)
    err = server.request("model/load", {"model": "smollm2:q4", "options": {"verify": "yes"}})["error"]
    assert err["code"] == errors.INVALID_PARAMS and "verify" in err["message"]
    assert server.call("model/list")["models"]  # still serving


def test_mlx_folder_metadata(tmp_path):
    import struct

    folder = tmp_path / "mlx-4bit"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {"model_type": "qwen3", "max_position_embeddings": 40960, "quantization": {"bits": 4, "group_size": 64}}
        )
    )
    header = {
        "__metadata__": {"format": "mlx"},
        "w.weight": {"dtype": "U32", "shape": [256, 8], "data_offsets": [0, 8192]},  # 256 x 64 packed
        "w.scales": {"dtype": "F16", "shape": [256, 1], "data_offsets": [8192, 8704]},
        "w.biases": {"dtype": "F16", "shape": [256, 1], "data_offsets": [8704, 9216]},
        "norm.weight": {"dtype": "F16", "shape": [64], "data_offsets": [9216, 9344]},
    }
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    assert gguf_meta.read_mlx(folder) == {
        "architecture": "qwen3",
        "parameters": 256 * 64 + 64,
        "quantization": "4bit",
        "contextLength": 40960,
    }


def test_store_files_that_never_end_are_refused_unread(tmp_path, gguf, monkeypatch):
    """A layer blob that is a FIFO (a reader would block forever) or a link to /dev/zero (a
    reader would run out of memory), and a manifest that is a FIFO: the store lists what it can,
    within seconds, reading none of them."""
    src, digest = gguf
    ollama = OllamaStore(tmp_path / "ollama")
    place(src, ollama.root / "blobs" / digest.replace(":", "-"))
    model = {"mediaType": MEDIA + "model", "digest": digest, "size": src.stat().st_size}
    fifo = {"mediaType": MEDIA + "template", "digest": "sha256:" + "f" * 64, "size": 10}
    os.mkfifo(ollama.root / "blobs" / ("sha256-" + "f" * 64))
    zero = {"mediaType": MEDIA + "system", "digest": "sha256:" + "0" * 64, "size": 10}
    os.symlink("/dev/zero", ollama.root / "blobs" / ("sha256-" + "0" * 64))
    ollama.manifest("registry.ollama.ai/library/odd/latest", [model, fifo, zero])
    piped = ollama.root / "manifests/registry.ollama.ai/library/piped/latest"
    piped.parent.mkdir(parents=True)
    os.mkfifo(piped)
    for key, value in {
        "OLLAMA_MODELS": ollama.root,
        "KINFER_MODELS": tmp_path / "k",
        "KINFER_HOME": tmp_path / "h",
    }.items():
        monkeypatch.setenv(key, str(value))
    listed: list = []
    reader = threading.Thread(target=lambda: listed.extend(ModelStore().list()), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "listing the store blocked on a FIFO or read /dev/zero"
    odd = [r for r in listed if r.name == "odd:latest"]
    assert len(odd) == 1 and odd[0].template is None and odd[0].system is None
    assert not any(r.name.startswith("piped") for r in listed)


def test_the_load_result_says_what_an_ollama_model_brought_that_is_not_used(server):
    r = server.call("model/load", {"model": "smollm2:135m"})
    assert {p["name"] for p in r["ignoredParameters"]} == {"mirostat", "top_p"}
    assert r["chatTemplate"] == "gguf" and "Go template is not run" in r["chatTemplateNote"]
    plain = server.call("model/load", {"model": "smollm2:q4"})
    assert plain["ignoredParameters"] == [] and "chatTemplateNote" not in plain
