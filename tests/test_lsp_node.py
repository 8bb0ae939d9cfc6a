"""kinfer-rpc as a language server, driven from Node by vscode-languageserver-protocol (the
protocol layer VS Code's LSP client is built on): initialize, didOpen, incremental didChange,
completion and inline completion, shutdown and exit.

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
