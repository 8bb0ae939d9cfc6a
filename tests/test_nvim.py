"""clients/nvim: the Lua module in a headless Neovim against a real `kinfer-rpc`.

Streams a chat reply into a buffer, writes the buffer to a file, cancels a second request, and
stops the server. Skipped when `nvim` is not installed (`apt-get install neovim`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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
