"""`kinfer pull` and `kinfer rm` against a real HTTP server on 127.0.0.1 that serves Ollama's
registry layout (/v2/<ns>/<model>/manifests/<tag>, /v2/<ns>/<model>/blobs/<digest>) and Hugging
Face's (/api/models/ORG/REPO/tree/main, /ORG/REPO/resolve/main/FILE), with the embedded SmolLM2
GGUF as the model blob."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import BIN, KINFER
from registry_helpers import Server
from store_helpers import sha_digest

from kinfer_rpc.cli import main as kinfer_main
from kinfer_rpc.host import pull as pullmod
from kinfer_rpc.host.options import RequestOptions
from kinfer_rpc.host.store import ModelStore, embedded_default_path

PARAMS = {"temperature": 0.25, "num_ctx": 1024}


@pytest.fixture(scope="module")
def gguf() -> tuple[Path, str, int]:
    path = Path(embedded_default_path())
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            sha.update(chunk)
    return path, "sha256:" + sha.hexdigest(), path.stat().st_size


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("KINFER_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    monkeypatch.setenv("KINFER_HOME", str(tmp_path / "home"))
    s = Server()
    monkeypatch.setenv("KINFER_REGISTRY", s.url)
    monkeypatch.setenv("KINFER_HF_ENDPOINT", s.url)
    yield s
    s.close()


def smollm2(server: Server, gguf, repo: str = "library/smollm2", tag: str = "135m") -> dict[str, Any]:
    path, digest, _ = gguf
    return server.model(repo, tag, [("model", path, digest), ("params", json.dumps(PARAMS).encode(), None)])


def models() -> Path:
    return Path(os.environ["KINFER_MODELS"])


def run(capsys, *args: str) -> tuple[int, str, str]:
    rc = kinfer_main(list(args))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    e.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return e


def listed() -> list[dict[str, Any]]:
    """`kinfer --json list`, as a person's script runs it (a server reads the stores)."""
    proc = subprocess.run(
        [KINFER, "--json", "list"], capture_output=True, text=True, env=env(), timeout=120, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def partials() -> list[Path]:
    return sorted((models() / "blobs").glob("*.partial")) if (models() / "blobs").is_dir() else []


# -- names and files ----------------------------------------------------------------------------
def test_names():
    n = pullmod.parse_name("qwen3:0.6b")
    assert (n.host, n.namespace, n.model, n.tag, n.display) == (
        "registry.ollama.ai",
        "library",
        "qwen3",
        "0.6b",
        "qwen3:0.6b",
    )
    assert pullmod.parse_name("qwen3").tag == "latest"
    assert pullmod.parse_name("alice/tool:v1").display == "alice/tool:v1"
    n = pullmod.parse_name("example.com:5000/team/model:q4")
    assert (n.host, n.namespace, n.model, n.tag) == ("example.com:5000", "team", "model", "q4")
    n = pullmod.parse_name("huggingface.co/Org/Repo-GGUF:Q8_0")
    assert n.is_hf and n.display == "hf.co/Org/Repo-GGUF:Q8_0"
    assert not pullmod.parse_name("hf.co/Org/Repo").explicit_tag
    for bad in ("", "a/b/c/d", "../x", "ns/..", "model:..", "a//b", "x:y:z", "ns/m:.hidden"):
        with pytest.raises(pullmod.PullError, match="not a model name"):
            pullmod.parse_name(bad)


def test_picking_the_gguf_as_ollama_does():
    files = ["README.md", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf", "mmproj-m-f16.gguf", "m-Q4_K.gguf"]
    assert pullmod.pick_gguf(files, None) == "m-Q4_K_M.gguf"
    assert pullmod.pick_gguf(files, "q8_0") == "m-Q8_0.gguf"
    assert pullmod.pick_gguf(files, "Q4_K") == "m-Q4_K.gguf"  # alone in the name beats Q4_K_M
    assert pullmod.pick_gguf(["only-F16.gguf", "README.md"], None) == "only-F16.gguf"
    with pytest.raises(pullmod.PullError, match="no .gguf file matches 'Q5_0'"):
        pullmod.pick_gguf(files, "Q5_0")
    with pytest.raises(pullmod.PullError, match="several files"):
        pullmod.pick_gguf(["a-Q8_0.gguf", "b-Q8_0.gguf"], "Q8_0")
    with pytest.raises(pullmod.PullError, match="no .gguf file"):
        pullmod.pick_gguf(["README.md"], None)


# -- Ollama's registry ----------------------------------------------------------------------------
@pytest.mark.model
def test_pull_by_name_then_chat(server, gguf, capsys):
    smollm2(server, gguf)
    rc, out, err = run(capsys, "pull", "smollm2:135m")
    assert rc == 0, err
    assert "pulled smollm2:135m" in out
    manifest = models() / "manifests/registry.ollama.ai/library/smollm2/135m"
    assert manifest.is_file()
    blob = models() / "blobs" / gguf[1].replace(":", "-")
    assert blob.stat().st_size == gguf[2] and not partials()
    ref = ModelStore().resolve("smollm2:135m")
    assert (ref.source, ref.path, ref.digest) == ("kinfer", str(blob), gguf[1])
    assert ref.defaults == RequestOptions(temperature=0.25) and ref.context_length == 1024  # the params layer
    assert ModelStore().resolve("registry.ollama.ai/library/smollm2:135m") == ref
    # the real server loads it by its name and answers
    proc = subprocess.run(
        [KINFER, "--json", "chat", "-m", "smollm2:135m", "hi", "--max-tokens", "2", "--threads", "1"],
        capture_output=True,
        text=True,
        env=env(),
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    reply = json.loads(proc.stdout)
    assert reply["model"] == "smollm2:135m" and reply["text"]
    # pulled again: nothing downloaded twice
    before = len(server.requests(f"/v2/library/smollm2/blobs/{gguf[1]}"))
    assert run(capsys, "pull", "smollm2:135m")[0] == 0
    assert len(server.requests(f"/v2/library/smollm2/blobs/{gguf[1]}")) == before


def test_a_cut_connection_is_resumed_with_a_range_request(server, gguf, capsys):
    smollm2(server, gguf)
    path = f"/v2/library/smollm2/blobs/{gguf[1]}"
    server.cut[path] = 10 << 20
    rc, _, err = run(capsys, "pull", "smollm2:135m")
    assert rc == 0, err
    first, second = server.requests(path)
    assert "Range" not in first
    assert second["Range"] == f"bytes={10 << 20}-"
    assert (models() / "blobs" / gguf[1].replace(":", "-")).stat().st_size == gguf[2]
    assert not partials()


def test_an_interrupted_pull_continues_in_the_next(server, gguf, capsys):
    smollm2(server, gguf)
    path = f"/v2/library/smollm2/blobs/{gguf[1]}"
    server.cut[path] = 3 << 20
    with pytest.raises(pullmod.PullError, match="pull again to continue"):
        pullmod.pull("smollm2:135m", retries=0)
    (partial,) = partials()
    assert partial.stat().st_size == 3 << 20
    assert not (models() / "manifests").exists()  # not listed while incomplete
    rc, _, err = run(capsys, "pull", "smollm2:135m")
    assert rc == 0, err
    assert server.requests(path)[-1]["Range"] == f"bytes={3 << 20}-"
    assert ModelStore().resolve("smollm2:135m").source == "kinfer"
    assert not partials()


def test_a_server_without_ranges_starts_the_blob_over(server, gguf, capsys):
    smollm2(server, gguf)
    path = f"/v2/library/smollm2/blobs/{gguf[1]}"
    server.cut[path] = 5 << 20
    server.ranges = False
    rc, _, err = run(capsys, "pull", "smollm2:135m")
    assert rc == 0, err
    assert server.requests(path)[1]["Range"] == f"bytes={5 << 20}-"  # asked, answered 200: started over
    assert ModelStore().resolve("smollm2:135m").source == "kinfer" and not partials()
    ModelStore().verify(ModelStore().resolve("smollm2:135m").path, gguf[1])


def test_a_digest_that_does_not_match_installs_nothing(server, capsys):
    data = b"GGUF" + os.urandom(4096)
    wrong = sha_digest(b"something else")
    server.model("library/broken", "latest", [("model", data, wrong)])
    rc, out, err = run(capsys, "pull", "broken")
    assert rc == 1 and not out
    assert "does not match its digest" in err and wrong in err and "partial file was deleted" in err
    assert not (models() / "manifests").exists()
    assert not (models() / "blobs" / wrong.replace(":", "-")).exists() and not partials()
    assert all(r.name != "broken:latest" for r in ModelStore().list())


def test_a_model_the_registry_lacks(server, capsys):
    rc, out, err = run(capsys, "pull", "nosuchmodel:7b")
    assert rc == 1 and not out
    assert "model not found in the registry" in err and "nosuchmodel:7b" in err
    assert not (models() / "manifests").exists()


def test_an_unreachable_registry(server, capsys):
    rc, _, err = run(capsys, "pull", "--registry", "http://127.0.0.1:9", "smollm2")
    assert rc == 1 and "cannot reach the registry http://127.0.0.1:9" in err


def test_blobs_redirected_elsewhere(server, gguf, capsys):
    doc = smollm2(server, gguf, repo="alice/smol", tag="v1")
    for layer in [doc["config"], *doc["layers"]]:
        path = f"/v2/alice/smol/blobs/{layer['digest']}"
        server.routes[f"/cdn/{layer['digest']}"] = server.routes.pop(path)
        server.redirects[path] = f"{server.url}/cdn/{layer['digest']}"
    rc, out, err = run(capsys, "pull", "alice/smol:v1")
    assert rc == 0, err
    assert "pulled alice/smol:v1" in out
    assert server.requests(f"/cdn/{gguf[1]}")
    assert ModelStore().resolve("alice/smol:v1").digest == gguf[1]


def test_a_registry_named_in_the_name(server, gguf, capsys):
    smollm2(server, gguf, repo="team/smol", tag="q4")
    host = server.url.removeprefix("http://")
    rc, out, err = run(capsys, "--json", "pull", "--insecure", f"{host}/team/smol:q4")
    assert rc == 0, err
    assert json.loads(out)["name"] == f"{host}/team/smol:q4"
    assert (models() / "manifests" / host / "team/smol/q4").is_file()


# -- Hugging Face -----------------------------------------------------------------------------------
@pytest.mark.model
def test_pull_from_hugging_face_with_a_quant(server, gguf, capsys):
    path, digest, size = gguf
    other = b"GGUF" + b"\0" * 100
    files = {"SmolLM2-135M-Instruct-Q4_1.gguf": path, "SmolLM2-135M-Instruct-Q8_0.gguf": other}
    tree: list[dict[str, Any]] = [{"type": "file", "path": "README.md", "size": 5, "oid": "ab" * 20}]
    for name, content in files.items():
        d = digest if isinstance(content, Path) else sha_digest(content)
        n = size if isinstance(content, Path) else len(content)
        tree.append({"type": "file", "path": name, "size": n, "oid": "cd" * 20, "lfs": {"oid": d[7:], "size": n}})
        # as Hugging Face does, resolve/ redirects to where the file lies
        server.redirects[f"/someone/SmolLM2-GGUF/resolve/main/{name}"] = f"{server.url}/lfs/{d[7:]}"
        server.routes[f"/lfs/{d[7:]}"] = content
    server.routes["/api/models/someone/SmolLM2-GGUF/tree/main"] = json.dumps(tree).encode()

    rc, out, err = run(capsys, "pull", "hf.co/someone/SmolLM2-GGUF:q4_1")
    assert rc == 0, err
    assert "SmolLM2-135M-Instruct-Q4_1.gguf" in out
    assert (models() / "manifests/hf.co/someone/SmolLM2-GGUF/q4_1").is_file()
    ref = ModelStore().resolve("hf.co/someone/SmolLM2-GGUF:q4_1")
    assert (ref.source, ref.format, ref.digest) == ("kinfer", "gguf", digest)
    ModelStore().prepare(ref)  # its sha256 and header, as a load checks them
    assert any(m["name"] == "hf.co/someone/SmolLM2-GGUF:q4_1" and m["source"] == "kinfer" for m in listed())

    rc, _, err = run(capsys, "pull", "hf.co/someone/SmolLM2-GGUF:Q5_K_M")
    assert rc == 1 and "no .gguf file matches 'Q5_K_M'" in err and "Q8_0" in err
    rc, _, err = run(capsys, "pull", "hf.co/someone/NoSuchRepo")
    assert rc == 1 and "model not found on Hugging Face" in err


# -- rm ---------------------------------------------------------------------------------------------
@pytest.mark.model
def test_rm(server, gguf, capsys, tmp_path):
    smollm2(server, gguf)
    smollm2(server, gguf, repo="alice/smol", tag="v1")  # the same model blob
    assert run(capsys, "pull", "smollm2:135m")[0] == 0
    assert run(capsys, "pull", "alice/smol:v1")[0] == 0
    blob = models() / "blobs" / gguf[1].replace(":", "-")

    rc, out, _ = run(capsys, "rm", "smollm2:135m")
    assert rc == 0 and "deleted smollm2:135m" in out
    assert blob.is_file()  # alice/smol:v1 still uses it
    names = [m["name"] for m in listed()]
    assert "smollm2:135m" not in names and "alice/smol:v1" in names

    rc, _, _ = run(capsys, "rm", "alice/smol:v1")
    assert rc == 0 and not blob.exists() and not list((models() / "blobs").iterdir())
    assert not (models() / "manifests/registry.ollama.ai").exists()
    assert all(m["source"] != "kinfer" for m in listed())

    # a model only in Ollama's folder is refused, and left as it is
    ollama = Path(os.environ["OLLAMA_MODELS"]) / "manifests/registry.ollama.ai/library/theirs/latest"
    ollama.parent.mkdir(parents=True)
    ollama.write_text(json.dumps({"layers": []}))
    rc, _, err = run(capsys, "rm", "theirs")
    assert rc == 1 and "Ollama's store" in err and "ollama rm" in err
    assert ollama.is_file()
    rc, _, err = run(capsys, "rm", "nothing:here")
    assert rc == 1 and "no model that `kinfer pull` downloaded is named 'nothing:here'" in err
