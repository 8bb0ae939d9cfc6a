"""kinfer-rpc as a language server, driven from Node by vscode-languageserver-protocol (the
protocol layer VS Code's LSP client is built on): initialize, didOpen, incremental didChange,
completion and inline completion, shutdown and exit; and typing a function into a file of this
repository as VS Code does (tests/lsp_node/typing.js), accepting a suggestion and getting the next.

The client lives in tests/lsp_node (its own package.json: not a dependency of clients/node).
Skipped when node or npm is missing or `npm ci` cannot reach a registry.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lsp_helpers import events, fake_server, fim_model

KINFER_RPC = os.path.join(os.path.dirname(sys.executable), "kinfer-rpc")
NODE_DIR = Path(__file__).resolve().parent / "lsp_node"


@pytest.fixture(scope="module")
def node():
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node/npm are not installed")
    if not (NODE_DIR / "node_modules" / "vscode-languageserver-protocol").exists():
        proc = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            pytest.skip(f"npm ci failed in tests/lsp_node (no registry?): {proc.stderr[-500:]}")
    return node


def drive(node, cmd, env, init_options=None, text=None):
    args = [node, str(NODE_DIR / "client.js"), json.dumps(cmd), json.dumps(init_options)]
    if text is not None:
        args.append(text)
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip(), f"no report\nstderr: {proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in report, report["error"]
    return report


def test_vscode_languageserver_protocol_client(node, tmp_path):
    log = tmp_path / "infill.jsonl"
    cmd, env = fake_server(log)
    report = drive(node, cmd, env, {"completion": {"maxTokens": 8}})
    assert report["incremental"] is True and report["sync"]["openClose"] is True
    assert report["completionProvider"] == {"resolveProvider": False}
    assert report["inlineCompletionProvider"] == {}
    start = next(e for e in events(log) if e["event"] == "start")
    assert start["prefix"] == "def add(a, b):\n    return a +"
    assert start["suffix"] == "\n"
    assert start["options"]["maxTokens"] == 8
    (item,) = report["completion"]["items"]
    assert item["textEdit"]["newText"] == "_fake(29,1)"
    assert item["textEdit"]["range"]["start"] == {"line": 1, "character": 14}
    assert report["inline"]["items"][0]["insertText"] == "_fake(29,1)"
    assert report["exitCode"] == 0


@pytest.mark.model
def test_vscode_languageserver_protocol_client_with_a_fim_model(node, tmp_path):
    model = fim_model(tmp_path)
    if model is None:
        pytest.skip("the server has no inference/infill or tests/modelgen no FIM model helper")
    env = {k: v for k, v in os.environ.items() if k != "KINFER_RPC_PLUGINS"}
    init = {"completion": {"model": model, "loadOptions": {"contextLength": 2048, "slots": 1}, "maxTokens": 8}}
    report = drive(node, [KINFER_RPC], env, init)
    assert report["completion"]["isIncomplete"] is True
    for item in report["completion"]["items"]:
        assert item["textEdit"]["range"]["end"] == {"line": 1, "character": 14}
    assert isinstance(report["inline"]["items"], list)
    assert report["exitCode"] == 0


# -- typing a function into a file of this repository ------------------------------------------------
RING_PY = Path(__file__).resolve().parent.parent / "kinfer_rpc" / "protocol" / "ring.py"
TYPED = "\n\ndef chunk_count(ring):\n    return len(ring"


def typing(node, cmd, env, init_options, typed=TYPED, wait_ms=0):
    args = [node, str(NODE_DIR / "typing.js"), json.dumps(cmd), json.dumps(init_options), str(RING_PY), typed]
    args.append(str(wait_ms))
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert proc.stdout.strip(), f"no report\nstderr: {proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in report, report["error"]
    return report


def test_typing_a_function_into_a_file_of_this_repository(node, tmp_path):
    log = tmp_path / "infill.jsonl"
    cmd, env = fake_server(log, delay=0.05)
    report = typing(node, cmd, env, {"completion": {"maxTokens": 8}})
    assert report["commands"] == ["kinfer.accepted", "kinfer.stats"]
    source = RING_PY.read_text()
    assert report["typedText"] == source + TYPED
    # one request a keystroke, the one before cancelled by the client (-32800) or made stale
    # (answered empty) unless it was done by then (how many were depends on the machine's load)
    assert report["requests"] == len(TYPED) + 2  # and the one after acceptance, and one more
    assert report["cancelled"] + report["empty"] > 0
    started = [e for e in events(log) if e["event"] == "start"]
    done = [e for e in events(log) if e["event"] == "done"]
    assert len(done) < len(started)  # the stale ones stopped
    answered = report["requests"] - report["cancelled"] - report["empty"]
    # the last keystroke's request: the whole text before the cursor, an Automatic request's options
    last = next(e for e in reversed(started) if e["prefix"] == source + TYPED)
    assert last["options"]["stopAtLine"] is True and "tMaxPredictMs" not in last["options"]
    (item,) = report["last"]["items"]
    assert item["insertText"].startswith("_fake(")
    # accepted: the next suggestion was computed ahead (an infill of the text with it) and served
    after = source + TYPED + item["insertText"]
    assert [e["prefix"] for e in started].count(after) == 1
    assert report["next"]["items"] and report["finalText"] == after + " "
    assert [e["prefix"] for e in started].count(after + " ") == 1  # one more character: asked afresh
    stats = report["stats"]["documents"][RING_PY.as_uri()]
    assert stats["answered"] == stats["offered"] >= answered >= 3  # (a cancel may come after the answer)
    assert (stats["accepted"], stats["acceptedChars"], stats["speculated"]) == (1, len(item["insertText"]), 1)
    assert report["exitCode"] == 0


@pytest.mark.model
def test_typing_a_function_with_a_fim_model(node, tmp_path):
    model = fim_model(tmp_path)
    if model is None:
        pytest.skip("the server has no inference/infill or tests/modelgen no FIM model helper")
    env = {k: v for k, v in os.environ.items() if k != "KINFER_RPC_PLUGINS"}
    init = {
        "completion": {
            "model": model,
            "loadOptions": {"contextLength": 4096, "slots": 1},
            "maxTokens": 8,
            "automatic": {"tMaxPromptMs": 0},  # the first request loads the model
        }
    }
    report = typing(node, [sys.executable, "-m", "kinfer_rpc"], env, init, wait_ms=1000)
    print("last:", report["last"], report["lastMs"], "ms; next:", report.get("next"), report.get("nextMs"), "ms")
    print("fresh:", report.get("fresh"), report.get("freshMs"), "ms")
    print("stats:", report["stats"])
    assert report["typedText"] == RING_PY.read_text() + TYPED
    stats = report["stats"]["documents"][RING_PY.as_uri()]
    if report["last"] and report["last"]["items"]:
        assert stats["accepted"] == 1 and stats["speculated"] == 1
    assert report["exitCode"] == 0
