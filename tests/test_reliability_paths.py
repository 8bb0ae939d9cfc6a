"""Security: model names and store entries that try to reach files that are not models.

Each test drives a real `kinfer-rpc` process through tests/rpcclient.py (which checks that stdout
carries nothing but frames and that every message matches spec/metaModel.json); docs/reliability.md
describes each test and the figures measured. Shared helpers: reliability_helpers.py, conftest.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest
from protocol_fixtures import spawn  # noqa: F401  (fixture)
from reliability_helpers import (
    LOAD_FAILED,
    MODEL_NOT_FOUND,
    chat,
)
from rpcclient import DEFAULT_MODEL, error_of


@pytest.fixture
def store(tmp_path):
    """Empty stores: KINFER_MODELS and OLLAMA_MODELS in a temporary folder."""
    kinfer = tmp_path / "kinfer-models"
    ollama = tmp_path / "ollama-models"
    kinfer.mkdir()
    ollama.mkdir()
    return {"KINFER_MODELS": str(kinfer), "OLLAMA_MODELS": str(ollama), "KINFER_HOME": str(tmp_path / "home")}


@pytest.mark.parametrize(
    "name",
    [
        "../../etc/passwd",
        "../../../../../../etc/passwd",
        "/etc/passwd",
        "/etc/shadow",
        "~/../../etc/passwd",
        "/proc/self/environ",
        "/proc/self/mem",
        "/dev/zero",
        "/dev/urandom",
        "/etc",
        "/",
        "./",
        "../",
        "/etc/passwd.gguf",
        "x\u0000.gguf",
        "/etc/passwd\u0000.gguf",
        "smollm2-135m-instruct/../../../etc/passwd",
        "etc/passwd",
        "..",
        "...",
        "%2e%2e/%2e%2e/etc/passwd",
        "file:///etc/passwd",
        "http://127.0.0.1:1/x.gguf",
    ],
)
def test_model_names_never_open_files_the_user_did_not_name_as_models(bare, name):
    c = bare
    for method in ("model/load", "inference/generate"):
        params = (
            {"model": name} if method == "model/load" else {"model": name, "prompt": "x", "options": {"maxTokens": 1}}
        )
        r = c.request(method, params, timeout=10)
        err = error_of(r)
        assert err["code"] in (MODEL_NOT_FOUND, LOAD_FAILED), r
        assert "root:" not in json.dumps(r)
    assert c.call("model/status") == {"models": []}


def test_store_links_to_files_that_are_not_models_are_refused(spawn, store, tmp_path):
    folder = store["KINFER_MODELS"]
    os.symlink("/etc/passwd", os.path.join(folder, "passwd.gguf"))  # looks like a model by its name
    os.symlink("/etc/hostname", os.path.join(folder, "hostname"))  # no .gguf, no GGUF magic: not a model
    os.symlink("loop.gguf", os.path.join(folder, "loop.gguf"))  # a symlink loop
    os.symlink("/nonexistent/x.gguf", os.path.join(folder, "dangling.gguf"))
    os.mkfifo(os.path.join(folder, "fifo.gguf"))  # opening it would block forever
    os.mkdir(os.path.join(folder, "dir.gguf"))
    with open(os.path.join(folder, "fake.gguf"), "wb") as f:
        f.write(b"root:x:0:0:root:/root:/bin/bash\n" * 4)
    c = spawn(env=store)
    c.initialize()
    listed = {m["name"]: m for m in c.call("model/list", timeout=10)["models"]}
    assert set(listed) == {DEFAULT_MODEL, "passwd", "fake"}, listed
    for name in ("passwd", "fake"):
        assert listed[name]["architecture"] is None and "error" in listed[name]
        err = error_of(c.request("model/load", {"model": name}, timeout=10))
        assert err["code"] == LOAD_FAILED, err
        assert "root:" not in json.dumps(err)
    for name in ("hostname", "loop", "dangling", "fifo", "dir"):
        assert error_of(c.request("model/load", {"model": name}, timeout=10))["code"] == MODEL_NOT_FOUND
    for name in ("fifo.gguf", "loop.gguf", "dangling.gguf", "dir.gguf"):  # the same files named by path
        assert (
            error_of(c.request("model/load", {"model": os.path.join(folder, name)}, timeout=10))["code"]
            == MODEL_NOT_FOUND
        )
    assert c.call("model/status") == {"models": []}


def test_ollama_manifests_cannot_point_outside_the_blob_folder(spawn, store):
    root = store["OLLAMA_MODELS"]
    manifest_dir = os.path.join(root, "manifests", "registry.ollama.ai", "library", "evil")
    os.makedirs(manifest_dir)
    os.makedirs(os.path.join(root, "blobs"))
    layers = [
        {"mediaType": "application/vnd.ollama.image.model", "digest": "sha256:../../../../../../etc/passwd", "size": 1},
        {"mediaType": "application/vnd.ollama.image.system", "digest": "sha256:/etc/passwd", "size": 1},
        {"mediaType": "application/vnd.ollama.image.params", "digest": "..", "size": 1},
    ]
    with open(os.path.join(manifest_dir, "latest"), "w") as f:
        json.dump({"schemaVersion": 2, "layers": layers}, f)
    c = spawn(env=store)
    c.initialize()
    listed = {m["name"]: m for m in c.call("model/list", timeout=10)["models"]}
    evil = listed["evil:latest"]
    blobs = os.path.realpath(os.path.join(root, "blobs"))
    assert os.path.realpath(evil["path"]).startswith(blobs + os.sep), evil
    err = error_of(c.request("model/load", {"model": "evil"}, timeout=10))
    assert err["code"] == LOAD_FAILED and "root:" not in json.dumps(err)
    err = error_of(c.request("inference/chat", {"model": "evil", **chat("hi")}, timeout=10))
    assert err["code"] == LOAD_FAILED


# -- a store on a hung file system ---------------------------------------------------------------
# The real server, with the GGUF header reader made to hang (4 s, once) on files named slow*: a
# stand-in for a file on a hung network file system.
HUNG_READER = r"""
import os, sys, time
from kinfer_rpc.host import gguf
from kinfer_rpc.protocol import server

read = gguf.read


def hung(path, *a, **k):
    if os.path.basename(str(path)).startswith("slow") and not os.path.exists(path + ".read"):
        open(path + ".read", "w").close()
        time.sleep(4)
    return read(path, *a, **k)


gguf.read = hung
sys.exit(server.main(sys.argv[1:]))
"""


def test_a_hung_store_file_does_not_hang_model_list(tmp_path):
    from rpcclient import RpcClient

    from kinfer_rpc.host.store import embedded_default_path

    models = tmp_path / "models"
    models.mkdir()
    for name in ("fine.gguf", "slow.gguf"):  # copies: the store knows a link to the embedded model
        shutil.copyfile(embedded_default_path(), models / name)
    env = {
        "KINFER_MODELS": str(models),
        "OLLAMA_MODELS": str(tmp_path / "ollama"),
        "KINFER_HOME": str(tmp_path / "home"),
        "KINFER_LIST_SECONDS": "1",
    }
    c = RpcClient.spawn("-c", HUNG_READER, env=env, executable=sys.executable)
    try:
        c.initialize()
        t0 = time.monotonic()
        listed = {m["name"]: m for m in c.call("model/list", {}, timeout=10)["models"]}
        assert time.monotonic() - t0 < 3
        assert listed["fine"]["architecture"] == "llama" and "error" not in listed["fine"]
        assert "within 1 s" in listed["slow"]["error"] and listed["slow"]["architecture"] is None
        # while the hung read goes on, a second list is answered at once, with an error
        r = c.request("model/list", {}, timeout=10)
        assert r["error"]["code"] == -32603 and "still waiting" in r["error"]["message"], r
        assert "result" in c.request("model/status", {}, timeout=2)
        time.sleep(3.5)  # the read ends: the next list is whole
        listed = {m["name"]: m for m in c.call("model/list", {}, timeout=10)["models"]}
        assert "error" not in listed["slow"] and listed["slow"]["architecture"] == "llama"
    finally:
        c.close(timeout=5, check=False)
    c.assert_clean()


def test_model_lists_at_once_are_all_answered(spawn, store):
    """Reads that are merely running (not stuck past the limit) never turn another list away."""
    c = spawn(env=store)
    c.initialize()
    rids = [c.request_async("model/list", {}) for _ in range(8)]
    for rid in rids:
        assert "result" in c.response(rid, timeout=30)
