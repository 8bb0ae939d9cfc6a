"""The `kinfer` command, run as a person or a script would: chat, list, ps, doctor, bench."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from kinfer_rpc.client import Client

BIN = os.path.dirname(sys.executable)
KINFER = os.path.join(BIN, "kinfer")
DEFAULT = "smollm2-135m-instruct"


def env() -> dict:
    e = dict(os.environ)
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    e.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see tests/test_client.py
    e.pop("NO_COLOR", None)
    e.pop("FORCE_COLOR", None)
    return e


def kinfer(*args, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [KINFER, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env(),
        timeout=timeout,
        stdin=None if stdin is not None else subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (
        f"kinfer {' '.join(args)}: {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    assert "\x1b[" not in proc.stdout + proc.stderr, "colours when not on a terminal"
    return proc


def json_lines(text: str) -> list:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.mark.model
def test_chat_with_a_prompt():
    proc = kinfer("chat", "Name a colour.", "--max-tokens", "8", "--threads", "1")  # temperature 0 by default
    assert proc.stdout.strip()
    # or the model first (a unique prefix names it), then the prompt
    again = kinfer("chat", "smollm2", "Name a colour.", "--max-tokens", "8", "--threads", "1", "--temperature", "0")
    assert proc.stdout == again.stdout


@pytest.mark.model
def test_chat_json_output_parses():
    (a,) = json_lines(
        kinfer("--json", "chat", "Name a colour.", "--max-tokens", "6", "--threads", "1", "--seed", "3").stdout
    )
    (b,) = json_lines(
        kinfer("chat", "--json", "Name a colour.", "--max-tokens", "6", "--threads", "1", "--seed", "3").stdout
    )
    assert a["model"] == DEFAULT and a["text"] and a["usage"]["completionTokens"] <= 6
    assert a["seed"] == b["seed"] == 3
    assert a["text"] == b["text"]


@pytest.mark.model
def test_interactive_chat_keeps_the_history():
    proc = kinfer("chat", "--json", "--max-tokens", "4", "--threads", "1", stdin="Say one word.\n\nSay another word.\n")
    first, second = json_lines(proc.stdout)
    assert second["usage"]["promptTokens"] > first["usage"]["promptTokens"] + first["usage"]["completionTokens"]
    proc = kinfer("chat", "--max-tokens", "4", "--threads", "1", stdin="Say one word.\n/bye\nnot asked\n")
    assert len(proc.stdout.strip().splitlines()) == 1


def test_list():
    proc = kinfer("list")
    header, *rows = proc.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "SOURCE", "FORMAT"]
    assert any(row.startswith(DEFAULT) and "embedded" in row for row in rows)
    models = json.loads(kinfer("list", "--json").stdout)
    assert any(m["name"] == DEFAULT and m["source"] == "embedded" for m in models)


@pytest.mark.model
def test_ps_shows_the_servers_of_this_machine():
    with Client() as client:
        client.load(threads=1)
        servers = json.loads(kinfer("ps", "--json").stdout)
        mine = [s for s in servers if s["pid"] == client.pid]
        assert mine, servers
        (server,) = mine
        assert server["ppid"] == os.getpid() and server["clientProcessId"] == os.getpid()
        assert [m["name"] for m in server["models"]] == [DEFAULT]
        assert server["rssBytes"] > 0
        text = kinfer("ps").stdout
        assert any(line.split()[0] == str(client.pid) and DEFAULT in line for line in text.splitlines()[1:])
    servers = json.loads(kinfer("ps", "--json").stdout)
    assert client.pid not in [s["pid"] for s in servers]


@pytest.mark.model
def test_doctor_json():
    report = json.loads(kinfer("doctor", "--json").stdout)
    assert report["ok"] is True, report["problems"]
    assert "llama" in report["backends"]
    assert report["plugins"] and report["brokenPlugins"] == []
    assert report["defaultModel"]["name"] == DEFAULT and report["defaultModel"]["sizeBytes"] > 0
    assert os.path.exists(report["defaultModel"]["path"])
    assert report["memory"]["totalBytes"] > 0 and report["memory"]["availableBytes"] > 0
    assert isinstance(report["devices"], list) and isinstance(report["gpus"], list)
    assert report["error"] is not None or any(d["type"] == "cpu" for d in report["devices"])
    assert report["loadCheck"]["ok"] is True


def test_doctor_text():
    out = kinfer("doctor", "--no-load").stdout
    labels = [line.split()[0] for line in out.splitlines() if line.strip()]
    for label in ("backends", "gpu", "memory", "default"):
        assert label in labels, out
    assert DEFAULT in out


@pytest.mark.model
def test_bench_with_tiny_settings():
    report = json.loads(kinfer("bench", "--json", "-n", "3", "-c", "2", "--max-tokens", "4", "--threads", "1").stdout)
    assert report["requests"] == 3 and report["concurrency"] == 2
    assert report["completionTokens"] == 12  # end of text is ignored: every request makes all its tokens
    assert report["tokensPerSecond"] > 0 and report["perRequest"]["ttftMsMean"] > 0
    out = kinfer("bench", "-n", "2", "-c", "2", "--max-tokens", "2", "--threads", "1").stdout
    assert "tok/s" in out


def test_colours_on_a_terminal_only():
    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [KINFER, "list"], stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env(), timeout=60
        )
        os.close(slave)
        slave = None
        data = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(master)
        if slave is not None:
            os.close(slave)
    assert proc.returncode == 0
    assert b"\x1b[" in data and DEFAULT.encode() in data


@pytest.mark.parametrize("args", [["bench", "-n", "0"], ["chat", "--max-tokens", "x"]])
def test_bad_arguments_fail(args):
    proc = subprocess.run(
        [KINFER, *args], capture_output=True, text=True, env=env(), timeout=60, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 2
