"""The README's client examples, run as they are written.

Every ```python block runs with this interpreter; the "Clients" section's ```js block runs with
`node` (importing `kinfer-rpc-client` as an installed package would), its ```lua block in a
headless Neovim, and its ```sh block with bash, with this virtualenv's bin first on PATH. An
example that names its model by $KINFER_TOOLS_MODEL (the "Agents" section's tools) runs on a copy
of the embedded model whose chat template takes tools (tests/modelgen/make_tool_model.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NODE_CLIENT = ROOT / "clients" / "node"
BIN = os.path.dirname(sys.executable)

FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)


def blocks(lang: str, section: str | None = None) -> list[str]:
    text = README.read_text()
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start : end if end != -1 else None]
    return [code for tag, code in FENCE.findall(text) if tag == lang]


def env() -> dict:
    e = dict(os.environ)
    e["PATH"] = BIN + os.pathsep + e.get("PATH", "")
    e["KINFER_RPC"] = os.path.join(BIN, "kinfer-rpc")
    # llama.cpp's OpenMP workers spin while they wait; on a shared, busy CPU that costs 10x.
    e.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return e


def test_each_client_has_an_example():
    assert (
        blocks("python", "Clients") and blocks("js", "Clients") and blocks("lua", "Clients") and blocks("sh", "Clients")
    )


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> str:
    from make_tool_model import make_tool_model

    return make_tool_model(tmp_path_factory.mktemp("tools") / "smollm2-tools.gguf")


@pytest.mark.model
@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.strip().splitlines()[0][:40])
def test_python_example(code, tmp_path, request):
    script = tmp_path / "example.py"
    script.write_text(code)
    e = env()
    if "KINFER_TOOLS_MODEL" in code:
        e["KINFER_TOOLS_MODEL"] = request.getfixturevalue("tool_model")
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=e,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.strip()


@pytest.fixture(scope="module")
def node_client():
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node/npm are not installed")
    if not (NODE_CLIENT / "node_modules" / "vscode-jsonrpc").is_dir():
        proc = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_CLIENT, capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            pytest.skip(f"npm ci failed in clients/node (no registry?): {proc.stderr[-500:]}")
    return node


@pytest.mark.model
def test_node_example(node_client, tmp_path):
    (code,) = blocks("js", "Clients")
    # Installed the way the README says: node_modules/kinfer-rpc-client is the package folder.
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "node_modules" / "kinfer-rpc-client").symlink_to(NODE_CLIENT, target_is_directory=True)
    (tmp_path / "example.mjs").write_text(code)
    proc = subprocess.run(
        [node_client, "example.mjs"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "cancelled: -32800" in proc.stdout
    assert "exit code 0" in proc.stdout


NVIM_EPILOGUE = r"""
vim.wait(60000, function() return done end, 20)
vim.fn.writefile(vim.api.nvim_buf_get_lines(buf, 0, -1, false), vim.env.KINFER_TEST_OUT .. '/buffer.txt')
local code
client:stop(function(c) code = c end)
vim.wait(20000, function() return code ~= nil end, 20)
vim.fn.writefile({ tostring(code) }, vim.env.KINFER_TEST_OUT .. '/exit.txt')
vim.cmd('qa!')
"""


@pytest.mark.model
def test_nvim_example(tmp_path):
    nvim = shutil.which("nvim")
    if nvim is None:
        pytest.skip("Neovim is not installed (apt-get install neovim): the nvim example is untested here")
    (code,) = blocks("lua", "Clients")
    script = tmp_path / "example.lua"
    script.write_text(code + NVIM_EPILOGUE)
    proc = subprocess.run(
        [
            nvim,
            "--headless",
            "-u",
            "NONE",
            "-i",
            "NONE",
            "-n",
            "--cmd",
            f"set runtimepath^={ROOT / 'clients' / 'nvim'}",
            "-c",
            f"luafile {script}",
        ],
        env={**env(), "KINFER_TEST_OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert (tmp_path / "exit.txt").exists(), f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert (tmp_path / "exit.txt").read_text().strip() == "0"
    assert "".join((tmp_path / "buffer.txt").read_text().split()), "nothing was streamed into the buffer"
    assert "tokens" in proc.stdout + proc.stderr  # the example's on_done printed


@pytest.mark.model
def test_cli_example(tmp_path):
    (code,) = blocks("sh", "Clients")
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", code],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "\x1b[" not in proc.stdout  # no colours when not on a terminal
    assert "['llama', 'mlx']" in proc.stdout  # kinfer doctor --json: the backends
    assert "tok/s" in proc.stdout
