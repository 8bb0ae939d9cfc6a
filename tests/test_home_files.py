"""kinfer's files under $KINFER_HOME against what another local user or a stray process can plant
there: FIFOs (a reader would block forever), symbolic links (a writer would write through them),
devices, oversized files, loose or foreign folders. kinfer_rpc/host/files.py, and the places
that use it: the status files `kinfer ps` reads, the config file, saved conversations, the
chat's history, the model cache `pull` writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import KINFER, env

from kinfer_rpc.host import files
from kinfer_rpc.host import status as server_status
from kinfer_rpc.host.pull import PullError, _locked, _write_manifest


def test_read_regular_refuses_what_is_not_a_bounded_regular_file(tmp_path):
    good = tmp_path / "good"
    good.write_bytes(b"x" * 10)
    assert files.read_regular(good, 10) == b"x" * 10
    with pytest.raises(files.Unsafe, match="larger than 9 bytes"):
        files.read_regular(good, 9)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(files.Unsafe, match="not a regular file"):
        files.read_regular(fifo, 100)  # refused at once, not waited on
    with pytest.raises(files.Unsafe, match="not a regular file"):
        files.read_regular(Path("/dev/zero"), 100)
    link = tmp_path / "link"
    link.symlink_to(good)
    assert files.read_regular(link, 10) == b"x" * 10  # a model file may be a link
    with pytest.raises(files.Unsafe, match="symbolic link"):
        files.read_regular(link, 10, follow=False)


def test_private_dir_makes_checks_and_tightens(tmp_path):
    made = files.private_dir(tmp_path / "a" / "b")
    assert made.stat().st_mode & 0o777 == 0o700
    os.chmod(made, 0o755)
    files.private_dir(made)
    assert made.stat().st_mode & 0o777 == 0o700  # ours, loose: tightened
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "linked").symlink_to(elsewhere)
    with pytest.raises(files.Unsafe, match="symbolic link"):
        files.private_dir(tmp_path / "linked")
    with pytest.raises(FileNotFoundError):
        files.private_dir(tmp_path / "missing", create=False)


def test_write_private_never_follows_a_link_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep me")
    folder = files.private_dir(tmp_path / "run")
    planted = folder / "123.json"
    planted.symlink_to(target)
    files.write_private(planted, b"{}")
    assert target.read_text() == "keep me"  # the link was replaced, not written through
    assert not planted.is_symlink() and planted.read_bytes() == b"{}"
    assert planted.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in folder.iterdir()) == ["123.json"]
    # a folder that is a link is not written in
    (tmp_path / "run2").symlink_to(folder)
    with pytest.raises(files.Unsafe):
        files.write_private(tmp_path / "run2" / "x.json", b"{}")


def test_status_files_skip_fifos_links_and_linked_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("KINFER_HOME", str(tmp_path))
    mine = server_status.StatusFile()
    assert mine.update([], 0)
    run = tmp_path / "run"
    # another live process (this test's parent) gets a FIFO, this one's file stays readable
    os.mkfifo(run / f"{os.getppid()}.json")
    target = tmp_path / "target.json"
    target.write_text(json.dumps({"pid": 1, "startedAt": 0, "models": [], "requestsRunning": 0}))
    (run / "1.json").symlink_to(target)  # pid 1 is alive: a link is skipped, not read
    found = server_status.read_all()
    assert list(found) == [os.getpid()]
    # the run folder replaced by a link: not read, not written through
    mine.remove()
    for entry in run.iterdir():
        entry.unlink()
    run.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run.symlink_to(elsewhere)
    assert server_status.read_all() == {}
    assert not mine.update([{"name": "m"}], 1)
    assert list(elsewhere.iterdir()) == []


def test_kinfer_ps_does_not_hang_on_a_fifo(tmp_path):
    """A FIFO named like a live process's status file: `kinfer ps` answers (it used to wait
    forever on the FIFO)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.mkfifo(run / f"{sleeper.pid}.json")
        proc = subprocess.run(
            [KINFER, "ps", "--json"],
            capture_output=True,
            text=True,
            env={**env(), "KINFER_HOME": str(tmp_path)},
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    finally:
        sleeper.kill()
        sleeper.wait()
    assert proc.returncode == 0, proc.stderr
    assert all(s.get("pid") != sleeper.pid for s in json.loads(proc.stdout)), proc.stdout


def test_a_config_file_that_is_a_fifo_is_an_error_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "config.toml")
    proc = subprocess.run(
        [KINFER, "list"],
        capture_output=True,
        text=True,
        env={**env(), "KINFER_HOME": str(tmp_path)},
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0 and "config.toml" in proc.stderr and "not a regular file" in proc.stderr, proc


def test_pull_writes_no_file_through_a_link(tmp_path):
    target = tmp_path / "victim"
    target.write_text("keep me")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    partial = blobs / "sha256-x.partial"
    partial.symlink_to(target)
    with pytest.raises(PullError, match="symbolic link is not followed"):
        with _locked(partial):
            pass
    os.mkfifo(blobs / "fifo.partial")
    with pytest.raises(PullError, match="not a regular file"):
        with _locked(blobs / "fifo.partial"):
            pass
    manifest = tmp_path / "manifests" / "latest"
    manifest.parent.mkdir()
    manifest.symlink_to(target)
    _write_manifest(manifest, b"{}")
    assert target.read_text() == "keep me" and manifest.read_bytes() == b"{}" and not manifest.is_symlink()


def test_the_chat_history_is_never_written_through_a_link(tmp_path, monkeypatch):
    pytest.importorskip("readline")
    from kinfer_rpc.cli import chat as cli

    monkeypatch.setenv("KINFER_HOME", str(tmp_path))
    target = tmp_path / "victim"
    target.write_text("keep me")
    (tmp_path / "history").symlink_to(target)
    save = cli._line_editing()
    save()
    assert target.read_text() == "keep me" and (tmp_path / "history").is_symlink()  # left alone
    (tmp_path / "history").unlink()
    save()
    history = tmp_path / "history"
    assert history.is_file() and not history.is_symlink() and history.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".history.")] == []
