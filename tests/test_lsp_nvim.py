"""Neovim's own LSP client (no plugin) completing from kinfer-rpc: `vim.lsp.start_client` with
`init_options`, a buffer attached, typing in insert mode (incremental didChange), then
`<C-x><C-o>` with `omnifunc=v:lua.vim.lsp.omnifunc`: the completion lands in the buffer.

Written for Neovim 0.7 (Debian's `neovim` package), the oldest with the API used here; skipped
only when `nvim` is not installed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lsp_helpers import events, fake_server, fim_model

NVIM = shutil.which("nvim")
KINFER_RPC = os.path.join(os.path.dirname(sys.executable), "kinfer-rpc")
EDITORS_MD = Path(__file__).resolve().parent.parent / "docs" / "editors.md"

pytestmark = pytest.mark.skipif(NVIM is None, reason="Neovim is not installed (apt-get install neovim)")

SCRIPT = r"""
local out = vim.env.KINFER_TEST_OUT
local report = { lines_before = {}, events = {} }
local function finish()
  report.lines = vim.api.nvim_buf_get_lines(0, 0, -1, false)
  report.mode = vim.fn.mode()
  vim.fn.writefile({ vim.fn.json_encode(report) }, out .. '/report.json')
  vim.cmd('qa!')
end

local buf = vim.api.nvim_get_current_buf()
vim.api.nvim_buf_set_name(buf, out .. '/add.py')
vim.bo[buf].filetype = 'python'
vim.api.nvim_buf_set_lines(buf, 0, -1, false, { 'def add(a, b):', '    return a' })
vim.o.completeopt = 'menu'  -- the first match is inserted

local initialized = false
local id = vim.lsp.start_client({
  name = 'kinfer',
  cmd = vim.fn.json_decode(vim.env.KINFER_LSP_CMD),
  root_dir = out,
  init_options = vim.fn.json_decode(vim.env.KINFER_LSP_INIT),
  on_init = function(client, result)
    report.sync = result.capabilities.textDocumentSync
    report.completion_provider = result.capabilities.completionProvider ~= nil
    initialized = true
  end,
})
report.client_id = id
vim.lsp.buf_attach_client(buf, id)
vim.bo[buf].omnifunc = 'v:lua.vim.lsp.omnifunc'
vim.wait(30000, function() return initialized end, 20)
report.initialized = initialized

vim.api.nvim_win_set_cursor(0, { 2, 0 })
local typed = vim.env.KINFER_TEST_TYPED
local keys = vim.api.nvim_replace_termcodes('A' .. typed .. '<C-x><C-o>', true, false, true)
vim.api.nvim_feedkeys(keys, 'nt', false)

local deadline = vim.loop.now() + tonumber(vim.env.KINFER_TEST_WAIT_MS)
local timer = vim.loop.new_timer()
timer:start(100, 50, vim.schedule_wrap(function()
  local line = vim.api.nvim_buf_get_lines(buf, 1, 2, false)[1]
  report.seen = line
  local before = '    return a' .. typed
  if line ~= before and line ~= '    return a' and vim.startswith(line, before) then
    timer:stop()
    report.completed = true
    finish()
  elseif vim.loop.now() > deadline then
    timer:stop()
    report.completed = false
    finish()
  end
end))
"""


def run_nvim(tmp_path, cmd, env, init_options, wait_ms=30000, typed=" + b"):
    """nvim drives the server: `typed` after `    return a`, then omni-completion (Ctrl-X Ctrl-O)."""
    script = tmp_path / "test.lua"
    script.write_text(SCRIPT)
    env = {
        **env,
        "KINFER_TEST_OUT": str(tmp_path),
        "KINFER_LSP_CMD": json.dumps(cmd),
        "KINFER_LSP_INIT": json.dumps(init_options),
        "KINFER_TEST_WAIT_MS": str(wait_ms),
        "KINFER_TEST_TYPED": typed,
        "XDG_STATE_HOME": str(tmp_path / "state"),  # the LSP log goes here, not to the user's
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    proc = subprocess.run(
        [NVIM, "--headless", "-u", "NONE", "-i", "NONE", "-n", "-c", f"luafile {script}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=wait_ms / 1000 + 90,
        stdin=subprocess.DEVNULL,
    )
    report_file = tmp_path / "report.json"
    assert report_file.exists(), f"nvim wrote no report\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    return json.loads(report_file.read_text())


def test_nvim_omnifunc_completes_from_the_server(tmp_path):
    log = tmp_path / "infill.jsonl"
    cmd, env = fake_server(log)
    report = run_nvim(tmp_path, cmd, env, {"completion": {"maxTokens": 16}})
    assert report["initialized"] and report["completion_provider"]
    assert report["sync"]["change"] == 2
    start = [e for e in events(log) if e["event"] == "start"][-1]
    # the buffer as typed reached the server through incremental changes
    assert start["prefix"] == "def add(a, b):\n    return a + b"
    assert start["suffix"] == "\n"
    assert start["options"]["maxTokens"] == 16
    expected = f"    return a + b_fake({len(start['prefix'])},{len(start['suffix'])})"
    assert report["completed"], report
    assert report["lines"] == ["def add(a, b):", expected]


DRIVE_DOCS_CONFIG = r"""
local out = vim.env.KINFER_TEST_OUT
local report = {}
vim.cmd('edit ' .. vim.fn.fnameescape(out .. '/add.py'))  -- FileType python: the docs' autocmd
local buf = vim.api.nvim_get_current_buf()
vim.api.nvim_buf_set_lines(buf, 0, -1, false, { 'def add(a, b):', '    return a' })
report.omnifunc = vim.bo[buf].omnifunc
vim.wait(30000, function()
  local clients = vim.lsp.buf_get_clients(buf)
  return next(clients) ~= nil and clients[next(clients)].initialized ~= false
end, 20)
vim.wait(500)
vim.api.nvim_win_set_cursor(0, { 2, 0 })
vim.api.nvim_feedkeys(vim.api.nvim_replace_termcodes('A + b<C-x><C-o>', true, false, true), 'nt', false)
local deadline = vim.loop.now() + 30000
local timer = vim.loop.new_timer()
timer:start(100, 50, vim.schedule_wrap(function()
  local line = vim.api.nvim_buf_get_lines(buf, 1, 2, false)[1]
  if vim.startswith(line, '    return a + b_') or vim.loop.now() > deadline then
    timer:stop()
    report.lines = vim.api.nvim_buf_get_lines(buf, 0, -1, false)
    vim.fn.writefile({ vim.fn.json_encode(report) }, out .. '/report.json')
    vim.cmd('qa!')
  end
end))
"""


def test_the_neovim_config_in_docs_editors_md(tmp_path):
    """docs/editors.md's init.lua, as written, with `kinfer-rpc` on PATH (the fake server)."""
    config = re.search(r"## Neovim.*?```lua\n(.*?)```", EDITORS_MD.read_text(), re.S).group(1)
    assert "vim.lsp.start_client" in config and "omnifunc" in config
    (tmp_path / "init.lua").write_text(config)
    (tmp_path / "drive.lua").write_text(DRIVE_DOCS_CONFIG)
    log = tmp_path / "infill.jsonl"
    cmd, env = fake_server(log)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "kinfer-rpc"
    shim.write_text("#!/bin/sh\nexec " + shlex.join(cmd) + ' "$@"\n')
    shim.chmod(0o755)
    env = {
        **env,
        "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        "KINFER_TEST_OUT": str(tmp_path),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    proc = subprocess.run(
        [
            NVIM,
            "--headless",
            "-u",
            str(tmp_path / "init.lua"),
            "-i",
            "NONE",
            "-n",
            "-c",
            "filetype on",
            "-c",
            f"luafile {tmp_path / 'drive.lua'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    report_file = tmp_path / "report.json"
    assert report_file.exists(), f"nvim wrote no report\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    report = json.loads(report_file.read_text())
    assert report["omnifunc"] == "v:lua.vim.lsp.omnifunc"
    start = [e for e in events(log) if e["event"] == "start"][-1]
    assert start["options"]["maxTokens"] == 48  # the docs' init_options reached the server
    assert [e for e in events(log) if e["event"] == "load"][0]["model"] == "qwen2.5-coder:1.5b"
    assert report["lines"][1] == f"    return a + b_fake({len(start['prefix'])},{len(start['suffix'])})"


@pytest.mark.model
def test_nvim_omnifunc_completes_from_a_fim_model(tmp_path):
    model = fim_model(tmp_path)
    if model is None:
        pytest.skip("the server has no inference/infill or tests/modelgen no FIM model helper")
    env = {k: v for k, v in os.environ.items() if k != "KINFER_RPC_PLUGINS"}
    init = {"completion": {"model": model, "loadOptions": {"contextLength": 2048, "slots": 1}, "maxTokens": 8}}
    # The cursor's line goes to the model as infill's middle, after its FIM middle token: typed
    # `    return a +`, the greedy reply completes the line (typed whole, it rightly adds nothing).
    report = run_nvim(tmp_path, [KINFER_RPC], env, init, wait_ms=90000, typed=" +")
    assert report["completed"], report
    assert report["lines"] == ["def add(a, b):", "    return a + b"]


TYPE_INTO_REPO = r"""
local out, root = vim.env.KINFER_TEST_OUT, vim.env.KINFER_TEST_ROOT
local report = {}
local initialized = false
vim.o.hidden = true  -- a buffer left stays loaded (and open on the server)
local id = vim.lsp.start_client({
  name = 'kinfer',
  cmd = vim.fn.json_decode(vim.env.KINFER_LSP_CMD),
  root_dir = root,
  init_options = vim.fn.json_decode(vim.env.KINFER_LSP_INIT),
  on_init = function() initialized = true end,
})
vim.wait(30000, function() return initialized end, 20)
-- two files of this repository: the one with the definition, then the one typed into
for _, name in ipairs({ 'text.py', 'ring.py' }) do
  vim.cmd('edit ' .. vim.fn.fnameescape(root .. '/kinfer_rpc/protocol/' .. name))
  vim.bo.filetype = 'python'
  vim.lsp.buf_attach_client(0, id)
end
local buf = vim.api.nvim_get_current_buf()
vim.bo[buf].omnifunc = 'v:lua.vim.lsp.omnifunc'
vim.bo[buf].autoindent = false  -- the keys typed are the text typed
vim.o.completeopt = 'menu'
vim.wait(300)
local typed = '<CR>def label_width(label):<CR>    return utf16_'
vim.api.nvim_feedkeys(vim.api.nvim_replace_termcodes('Go' .. typed .. '<C-x><C-o>', true, false, true), 'nt', false)
local deadline = vim.loop.now() + 30000
local timer = vim.loop.new_timer()
timer:start(100, 50, vim.schedule_wrap(function()
  local line = vim.api.nvim_buf_get_lines(buf, -2, -1, false)[1]
  if (vim.startswith(line, '    return utf16_') and #line > 17) or vim.loop.now() > deadline then
    timer:stop()
    report.lines = vim.api.nvim_buf_get_lines(buf, 0, -1, false)
    vim.fn.writefile({ vim.fn.json_encode(report) }, out .. '/report.json')
    vim.cmd('qa!')
  end
end))
"""


def test_nvim_types_a_function_into_a_file_of_this_repository(tmp_path):
    """Neovim's client, two files of this repository open: a function typed at the end of
    kinfer_rpc/protocol/ring.py that uses text.py's `utf16_len`; the completion request carries
    text.py's definition (the ring) and its answer lands in the buffer. Nothing is written."""
    root = Path(__file__).resolve().parent.parent
    ring_py, text_py = root / "kinfer_rpc" / "protocol" / "ring.py", root / "kinfer_rpc" / "protocol" / "text.py"
    log = tmp_path / "infill.jsonl"
    cmd, env = fake_server(log)
    script = tmp_path / "type.lua"
    script.write_text(TYPE_INTO_REPO)
    env = {
        **env,
        "KINFER_TEST_OUT": str(tmp_path),
        "KINFER_TEST_ROOT": str(root),
        "KINFER_LSP_CMD": json.dumps(cmd),
        "KINFER_LSP_INIT": json.dumps({"completion": {"maxTokens": 16}}),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    before = ring_py.read_text()
    proc = subprocess.run(
        [NVIM, "--headless", "-u", "NONE", "-i", "NONE", "-n", "-c", f"luafile {script}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        cwd=root,  # the server (python -c) imports this checkout's kinfer_rpc
    )
    report_file = tmp_path / "report.json"
    assert report_file.exists(), f"nvim wrote no report\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    report = json.loads(report_file.read_text())
    assert ring_py.read_text() == before  # typed in the buffer only
    typed = "\ndef label_width(label):\n    return utf16_"  # after a blank line: the file ends with a line break
    start = [e for e in events(log) if e["event"] == "start"][-1]
    assert start["prefix"] == before + typed
    # the ring: text.py's first 64 lines, and ring.py's own, far above the cursor
    assert [e["filename"] for e in start["extra"]] == [str(text_py), str(ring_py)]
    assert "def utf16_len(text: str) -> int:" in start["extra"][0]["text"]
    expected = f"    return utf16__fake({len(start['prefix'])},{len(start['suffix'])})"
    assert report["lines"][-1] == expected
    assert report["lines"][:-3] == before.splitlines()
