"""clients/nvim: the Lua module in a headless Neovim against a real `kinfer-rpc`.

Streams a chat reply into a buffer, writes the buffer to a file, cancels a second request, and
stops the server. Skipped when `nvim` is not installed (`apt-get install neovim`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NVIM = shutil.which("nvim")
KINFER_RPC = os.path.join(os.path.dirname(sys.executable), "kinfer-rpc")

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(
        NVIM is None, reason="Neovim is not installed (apt-get install neovim); the nvim client is untested here"
    ),
]

SCRIPT = r"""
local kinfer = require('kinfer')
local out_dir = vim.env.KINFER_TEST_OUT
local report = {}
local function wait(pred) return vim.wait(60000, pred, 20) end

local client = kinfer.start()
local loaded
client:load({ options = { threads = 1 } }, function(err, result) loaded = err or result end)
wait(function() return loaded ~= nil end)
report.loaded = loaded.model

-- stream a reply into a buffer and write the buffer out
local buf = vim.api.nvim_create_buf(true, false)
local done = false
local pieces = 0
kinfer.chat_to_buffer(client, buf, 'Name a colour.', {
  options = { maxTokens = 12, temperature = 0 },
  on_done = function(err, result)
    report.chat_error = err
    report.chat_text = result and result.text
    done = true
  end,
})
wait(function() return done end)
vim.api.nvim_buf_call(buf, function() vim.cmd('silent write! ' .. vim.fn.fnameescape(out_dir .. '/reply.txt')) end)

-- cancel a long request after a few pieces
local cancelled = false
local handle
local n = 0
handle = client:generate('Once upon a time', { options = { maxTokens = 2000, ignoreEos = true } }, function()
  n = n + 1
  if n == 3 then handle.cancel() end
end, function(err, result)
  report.cancel_code = err and err.code
  report.cancel_result = result
  cancelled = true
end)
wait(function() return cancelled end)
report.cancel_pieces = n

-- the server goes on serving
local after
client:generate('Hello', { options = { maxTokens = 2, temperature = 0 } }, nil,
  function(err, result) after = err or result end)
wait(function() return after ~= nil end)
report.after_tokens = after.usage and after.usage.completionTokens

local code
client:stop(function(c) code = c end)
wait(function() return code ~= nil end)
report.exit_code = code
vim.fn.writefile({ vim.json.encode(report) }, out_dir .. '/report.json')
vim.cmd('qa!')
"""


def test_nvim_streams_into_a_buffer_and_cancels(tmp_path):
    script = tmp_path / "test.lua"
    script.write_text(SCRIPT)
    env = {**os.environ, "KINFER_TEST_OUT": str(tmp_path), "KINFER_RPC": KINFER_RPC}
    proc = subprocess.run(
        [
            NVIM,
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
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    report_file = tmp_path / "report.json"
    assert report_file.exists(), f"nvim wrote no report\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    report = json.loads(report_file.read_text())
    assert report["loaded"] == "smollm2-135m-instruct"
    assert report.get("chat_error") is None, report
    reply = (tmp_path / "reply.txt").read_text()
    # The buffer starts with one empty line; the streamed pieces are appended to it.
    assert reply.rstrip("\n") == report["chat_text"]
    assert report["chat_text"]
    assert report["cancel_code"] == -32800
    assert 3 <= report["cancel_pieces"] < 2000
    assert report["after_tokens"] == 2
    assert report["exit_code"] == 0


# Ctrl-C at a terminal sends SIGINT to its foreground process group: Neovim's while it runs a shell
# command (`:!make`), or nvim --headless's. The server must not be in that group.
INTERRUPT_SCRIPT = r"""
local kinfer = require('kinfer')
local out_dir = vim.env.KINFER_TEST_OUT
local report = { pid = vim.fn.getpid() }
local function wait(pred)  -- SIGINT interrupts vim.wait: wait on
  local deadline = vim.loop.now() + 30000
  while not pred() and vim.loop.now() < deadline do
    vim.wait(100, pred, 20)
  end
  return pred()
end
local function mark(name) vim.fn.writefile({ vim.json.encode(report) }, out_dir .. '/' .. name) end

local client = kinfer.start({ on_exit = function(code) report.server_exit = report.server_exit or code end })
local loaded
client:load({ options = { threads = 1 } }, function(err, result) loaded = err or result end)
wait(function() return loaded ~= nil end)

local n, cancelled = 0, false
local handle
handle = client:generate('Count to a thousand.', { options = { maxTokens = 5000, ignoreEos = true } }, function()
  n = n + 1
  if n == 3 then mark('streaming') end
end, function(err) report.cancel_code = err and err.code; cancelled = true end)
wait(function() return vim.fn.filereadable(out_dir .. '/interrupted') == 1 end)
vim.wait(1000)  -- a while later, the person stops the reply
report.server_exit_before_stop = report.server_exit  -- nil: still serving
handle.cancel()
wait(function() return cancelled or client.exited end)

local after
client:generate('Hello', { options = { maxTokens = 2, temperature = 0 } }, nil,
  function(err, result) after = err or result end)
wait(function() return after ~= nil end)
report.after_tokens = after.usage and after.usage.completionTokens
report.after_error = after.message
local code
client:stop(function(c) code = c end)
wait(function() return code ~= nil end)
report.exit_code = code
mark('report.json')
vim.cmd('qa!')
"""


def test_sigint_to_neovims_process_group_does_not_reach_the_server(tmp_path):
    from reliability_helpers import children_of

    script = tmp_path / "interrupt.lua"
    script.write_text(INTERRUPT_SCRIPT)
    env = {**os.environ, "KINFER_TEST_OUT": str(tmp_path), "KINFER_RPC": KINFER_RPC}
    # Neovim in a terminal survives Ctrl-C (it reads it as a key, or catches SIGINT); headless, it
    # has no handler: it runs with SIGINT ignored here, as a UI's Neovim would go on. The server
    # sets its own handler whatever it inherits, so the signal ends it if it reaches it.
    argv = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', NVIM, "--headless", "-u", "NONE", "-i", "NONE", "-n"]
    argv += ["--cmd", f"set runtimepath^={ROOT / 'clients' / 'nvim'}", "-c", f"luafile {script}"]
    # A process group of its own, as a shell gives its foreground job.
    nvim = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "streaming").exists():
            assert nvim.poll() is None and time.monotonic() < deadline, nvim.stdout.read().decode(errors="replace")
            time.sleep(0.1)
        (server,) = [p for p in children_of(nvim.pid) if b"kinfer" in Path(f"/proc/{p}/cmdline").read_bytes()]
        os.killpg(nvim.pid, signal.SIGINT)  # what Ctrl-C at the terminal does
        (tmp_path / "interrupted").write_text("")
        nvim.wait(120)
    finally:
        if nvim.poll() is None:
            os.killpg(nvim.pid, signal.SIGKILL)
            nvim.wait()
    output = nvim.stdout.read().decode(errors="replace")
    report_file = tmp_path / "report.json"
    assert report_file.exists(), (
        f"nvim wrote no report (exit {nvim.returncode}): {sorted(os.listdir(tmp_path))}\n{output}"
    )
    report = json.loads(report_file.read_text())
    assert report.get("server_exit_before_stop") is None, report  # SIGINT did not reach the server
    assert report["cancel_code"] == -32800, report
    assert report.get("after_tokens") == 2, report  # the same server answered the next request
    assert report["exit_code"] == 0, report
    assert not os.path.exists(f"/proc/{server}")  # stopped and reaped by Neovim
