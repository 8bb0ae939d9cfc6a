"""`kinfer ps`'s state per server (the status file each server keeps) and `kinfer show`'s license."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from cli_helpers import DEFAULT, kinfer
from store_helpers import MEDIA, OllamaStore, place

from kinfer_rpc.client import Cancelled, Client
from kinfer_rpc.host import status as server_status
from kinfer_rpc.host.store import embedded_default_path


def _mine(pid: int) -> dict:
    servers = json.loads(kinfer("ps", "--json").stdout)
    (server,) = [s for s in servers if s["pid"] == pid]
    return server


def _until(pid: int, state: str, busy: int = 0, timeout: float = 30.0) -> dict:
    """The server as `kinfer ps --json` shows it, once in `state` with the model ready and `busy`
    of its slots busy (a request counted running may reach its slot a status write later)."""
    deadline = time.monotonic() + timeout
    while True:
        server = _mine(pid)
        ready = any(
            m["name"] == DEFAULT and m.get("state") == "ready" and m.get("slotsBusy") == busy for m in server["models"]
        )
        if (server["state"] == state and ready) or time.monotonic() > deadline:
            return server
        time.sleep(0.2)


@pytest.mark.model
def test_ps_shows_a_server_busy_then_idle(tmp_path, monkeypatch):
    monkeypatch.setenv("KINFER_HOME", str(tmp_path))  # the server's and kinfer ps's
    with Client() as client:
        status_file = tmp_path / "run" / f"{client.pid}.json"
        client.load(threads=1, contextLength=4096)
        idle = _until(client.pid, "idle")
        assert idle["state"] == "idle" and idle["requestsRunning"] == 0, idle
        (model,) = [m for m in idle["models"] if m["name"] == DEFAULT]
        assert model["state"] == "ready" and model["slotsBusy"] == 0 and model["slots"] >= 1
        assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700
        stream = client.stream_generate("Count to a thousand:", maxTokens=4000, ignoreEos=True)
        next(iter(stream))  # it runs
        busy = _until(client.pid, "busy", busy=1)
        assert busy["state"] == "busy" and busy["requestsRunning"] == 1, busy
        (model,) = [m for m in busy["models"] if m["name"] == DEFAULT]
        assert model["slotsBusy"] == 1
        row = [line for line in kinfer("ps").stdout.splitlines() if line.split()[:1] == [str(client.pid)]]
        assert row and " busy " in row[0] and "1/" in row[0], row
        stream.cancel()
        with pytest.raises(Cancelled):
            stream.wait(30)
        after = _until(client.pid, "idle")
        assert after["state"] == "idle" and after["requestsRunning"] == 0, after
        header, *rows = kinfer("ps").stdout.splitlines()
        assert header.split()[4:6] == ["STATE", "REQUESTS"]
        assert status_file.exists()
    assert not status_file.exists()


def test_status_files_of_dead_processes_are_ignored_and_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("KINFER_HOME", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    run = tmp_path / "run"
    run.mkdir()
    stale = run / f"{dead.pid}.json"
    stale.write_text(json.dumps({"pid": dead.pid, "startedAt": 0, "models": [], "requestsRunning": 3}))
    mine = server_status.StatusFile()
    assert mine.update([{"name": "m", "state": "loading", "slotsBusy": 0, "slots": 0, "queued": 0}], 0)
    assert not mine.update([{"name": "m", "state": "loading", "slotsBusy": 0, "slots": 0, "queued": 0}], 0)
    found = server_status.read_all()
    assert list(found) == [os.getpid()] and found[os.getpid()]["models"][0]["state"] == "loading"
    assert not stale.exists()
    mine.remove()
    assert server_status.read_all() == {}


def test_a_status_file_that_cannot_be_written_is_no_error(tmp_path, monkeypatch):
    (tmp_path / "home").write_text("a file where the folder would be")
    monkeypatch.setenv("KINFER_HOME", str(tmp_path / "home"))
    status = server_status.StatusFile()
    assert not status.update([], 0) and not status.update([], 1)
    status.remove()


# -- show's license ---------------------------------------------------------------------------------
@pytest.fixture
def licensed_store(tmp_path, monkeypatch):
    """A GGUF whose general.license is set, at a path; and an Ollama model with two license layers."""
    gguf = Path(embedded_default_path())
    licensed = tmp_path / "licensed.gguf"
    _copy_with_license(gguf, licensed, "MIT-0")
    store = OllamaStore(tmp_path / "ollama")
    digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    place(gguf, store.root / "blobs" / digest.replace(":", "-"))
    model = {"mediaType": MEDIA + "model", "digest": digest, "size": gguf.stat().st_size}
    text = "MIT License\n\nCopyright (c) a pirate\n\nPermission is hereby granted...\n"
    layers = [model, store.blob(text.encode(), "license"), store.blob(b"Extra terms.", "license")]
    store.manifest("registry.ollama.ai/library/pirate/latest", layers)
    monkeypatch.setenv("OLLAMA_MODELS", str(store.root))
    monkeypatch.setenv("KINFER_MODELS", str(tmp_path / "kinfer"))
    monkeypatch.setenv("KINFER_HOME", str(tmp_path / "home"))
    return licensed


def _copy_with_license(src: Path, dst: Path, license: str) -> None:
    """The GGUF at src with general.license set (as tests/modelgen/make_tool_model.py copies)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    w = gguf.GGUFWriter(str(dst), arch, endianess=reader.endianess)
    alignment = reader.fields.get(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        w.data_alignment = alignment.contents()
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in (gguf.Keys.General.ARCHITECTURE, "general.license"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    w.add_string("general.license", license)
    for t in reader.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    w.close()


def test_show_the_license(licensed_store):
    from kinfer_rpc.host import gguf as gguf_meta

    assert gguf_meta.read(licensed_store).license == "MIT-0"
    assert gguf_meta.read(embedded_default_path()).license == "apache-2.0"
    doc = json.loads(kinfer("show", "--json", str(licensed_store)).stdout)
    assert doc["license"] == "MIT-0"
    assert kinfer("show", str(licensed_store), "--license").stdout == "MIT-0\n"
    text = kinfer("show", str(licensed_store)).stdout
    assert "License" in text and "MIT-0" in text
    # an Ollama model: its license layers, one after the other
    doc = json.loads(kinfer("show", "--json", "pirate").stdout)
    assert doc["license"] == "MIT License\n\nCopyright (c) a pirate\n\nPermission is hereby granted...\n\nExtra terms."
    text = kinfer("show", "pirate").stdout
    assert "MIT License" in text and "kinfer show --license" in text and "Extra terms." not in text
    assert kinfer("show", "pirate", "--license").stdout.endswith("Extra terms.\n")


def test_the_state_ps_shows():
    from kinfer_rpc.cli.servers import _state

    def model(state: str, busy: int = 0, queued: int = 0) -> dict:
        return {"name": "m", "state": state, "slotsBusy": busy, "slots": 4, "queued": queued}

    assert _state(None) is None  # no status file: an older server, or one that cannot write it
    assert _state({"models": [], "requestsRunning": 0}) == "idle"
    assert _state({"models": [model("ready")], "requestsRunning": 0}) == "idle"
    assert _state({"models": [model("loading")], "requestsRunning": 0}) == "loading"
    assert _state({"models": [model("ready", busy=1)], "requestsRunning": 1}) == "busy"
    assert _state({"models": [model("ready", queued=2)], "requestsRunning": 0}) == "busy"
    assert _state({"models": [model("loading"), model("ready")], "requestsRunning": 2}) == "busy"
