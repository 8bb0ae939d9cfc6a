"""clients/nvim: the Lua module in a headless Neovim against a real `kinfer-rpc`.

Streams a chat reply into a buffer, writes the buffer to a file, cancels a second request, and
stops the server; suggests fill-in-the-middle completions as ghost text (on a copy of the embedded
model with FIM tokens, tests/modelgen/make_fim_model.py), accepts and dismisses them; holds a
conversation in one chat buffer (`:KinferChat`), sends the visual selection (`:'<,'>KinferSend`),
marks a cancelled reply, and runs `:checkhealth kinfer`. Skipped when
`nvim` is not installed (`apt-get install neovim`).
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
from paths import ROOT

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


# -- fill in the middle: kinfer.suggest / accept / dismiss -------------------------------------

PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n"
GREEDY = {"temperature": 0, "maxTokens": 16}
EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]

SUGGEST_SCRIPT = r"""
local kinfer = require('kinfer')
local out_dir = vim.env.KINFER_TEST_OUT
local report = {}
local function wait(pred) return vim.wait(60000, pred, 20) end
local GREEDY = vim.json.decode(vim.env.KINFER_TEST_GREEDY)
local keys = function(k) return vim.api.nvim_replace_termcodes(k, true, false, true) end
-- what the extmarks show in the suggestion's highlight group: the first line, then virt_lines
local function shown(buf)
  local marks = vim.api.nvim_buf_get_extmarks(buf, kinfer.ns, 0, -1, { details = true })
  local lines = {}
  for _, m in ipairs(marks) do
    local first = {}
    for _, chunk in ipairs(m[4].virt_text or {}) do
      if chunk[2] == kinfer.HL then first[#first + 1] = chunk[1] end
    end
    lines[#lines + 1] = table.concat(first)
    for _, line in ipairs(m[4].virt_lines or {}) do
      local parts = {}
      for _, chunk in ipairs(line) do
        if chunk[2] == kinfer.HL then parts[#parts + 1] = chunk[1] end
      end
      lines[#lines + 1] = table.concat(parts)
    end
  end
  return { count = #marks, text = table.concat(lines, '\n'), at = marks[1] and { marks[1][2], marks[1][3] } }
end
local function text_of(buf)
  return table.concat(vim.api.nvim_buf_get_lines(buf, 0, -1, false), '\n') .. '\n'
end
local function reset(buf)
  vim.api.nvim_buf_set_lines(buf, 0, -1, false, { 'def add(a, b):', '    return ' })
  vim.api.nvim_win_set_cursor(0, { 2, 11 })  -- after 'return ' ('virtualedit' lets it stand there)
end

local client = kinfer.start()
local loaded
client:load({ model = vim.env.KINFER_TEST_FIM, options = { threads = 1 } },
  function(err, result) loaded = err or result end)
wait(function() return loaded ~= nil end)
report.loaded = loaded.model
kinfer.setup({ client = client, infill = { options = GREEDY }, infill_keys = true })
vim.o.virtualedit = 'onemore'
local buf = vim.api.nvim_get_current_buf()

-- Client:infill with extra and stopAtLine
local r
client:infill(vim.env.KINFER_TEST_PREFIX, vim.env.KINFER_TEST_SUFFIX,
  { extra = vim.json.decode(vim.env.KINFER_TEST_EXTRA), stopAtLine = true, options = GREEDY },
  nil, function(err, result) r = err or result end)
wait(function() return r ~= nil end)
report.infill_extra = r

-- suggest at the cursor, streamed; then accept
reset(buf)
local done = nil
kinfer.suggest(client, { options = GREEDY, on_done = function(err, result) done = err or result end })
wait(function() return done ~= nil end)
report.suggest_result = done
report.suggest_shown = shown(buf)
report.suggestion = { kinfer.suggestion(buf) }
report.accepted = kinfer.accept(buf)
report.after_accept = text_of(buf)
report.after_accept_cursor = vim.api.nvim_win_get_cursor(0)
report.after_accept_shown = shown(buf)

-- dismiss
reset(buf)
done = nil
kinfer.suggest(client, { options = GREEDY, on_done = function(err, result) done = err or result end })
wait(function() return done ~= nil end)
report.before_dismiss = shown(buf).count
report.dismissed = kinfer.dismiss(buf)
report.after_dismiss = shown(buf)
report.after_dismiss_suggestion = kinfer.suggestion(buf) == nil
report.after_dismiss_text = text_of(buf)

-- a second suggestion while the first streams cancels the first
reset(buf)
local first, second, results = nil, nil, 0
kinfer.suggest(client, { options = { temperature = 0, maxTokens = 1000, ignoreEos = true },
  on_done = function(err, result) first = err or result; if not err then results = results + 1 end end })
wait(function() local t = kinfer.suggestion(buf); return t ~= nil and #t > 0 end)
report.first_streamed = shown(buf).count
kinfer.suggest(client, { options = GREEDY,
  on_done = function(err, result) second = err or result; if not err then results = results + 1 end end })
wait(function() return first ~= nil and second ~= nil end)
vim.wait(300)  -- nothing more arrives
report.first_code = first.code
report.second_result = second
report.results = results
report.race_shown = shown(buf)

-- in insert mode: <C-F> suggests, the suggestion stays while nothing is typed, <Tab> accepts
reset(buf)
local steps = {}
local timer = vim.fn.timer_start(50, function(t)
  local text, complete = kinfer.suggestion(buf)
  steps.ticks = (steps.ticks or 0) + 1
  if not steps.asked then
    steps.asked = true
    vim.api.nvim_feedkeys(keys('<C-F>'), 'm', false)
  elseif steps.ticks > 1200 then  -- a minute: give up, leave insert mode
    vim.fn.timer_stop(t)
    vim.api.nvim_feedkeys(keys('<Esc>'), 'n', false)
  elseif complete then
    vim.fn.timer_stop(t)
    steps.text, steps.mode = text, vim.fn.mode()
    vim.api.nvim_feedkeys(keys('<Tab><Esc>'), 'm', false)
  end
end, { ['repeat'] = -1 })
vim.api.nvim_feedkeys('A', 'x!', false)  -- returns when <Esc> ends insert mode
report.keys = steps
report.keys_text = text_of(buf)

-- typing in insert mode dismisses the suggestion (before insert mode ends)
reset(buf)
done = nil
kinfer.suggest(client, { options = GREEDY, on_done = function(err, result) done = err or result end })
wait(function() return done ~= nil end)
report.before_typing = shown(buf).count
vim.defer_fn(function()
  report.typed = { shown = shown(buf).count, gone = kinfer.suggestion(buf) == nil, mode = vim.fn.mode() }
  vim.api.nvim_feedkeys(keys('<Esc>'), 'n', false)
end, 300)
vim.api.nvim_feedkeys('ax', 'x!', false)
report.typed_text = text_of(buf)

-- <Tab> with no suggestion is a tab
reset(buf)
vim.api.nvim_feedkeys(keys('A<Tab><Esc>'), 'xm', false)
report.plain_tab = text_of(buf)

local code
client:stop(function(c) code = c end)
wait(function() return code ~= nil end)
report.exit_code = code
vim.fn.writefile({ vim.json.encode(report) }, out_dir .. '/report.json')
vim.cmd('qa!')
"""


def run_nvim(tmp_path, script: str, **env_vars: str) -> dict:
    """Run `script` in a headless Neovim with clients/nvim on its runtimepath; its report.json."""
    path = tmp_path / "script.lua"
    path.write_text(script)
    env = {**os.environ, "KINFER_TEST_OUT": str(tmp_path), "KINFER_RPC": KINFER_RPC, **env_vars}
    argv = [NVIM, "--headless", "-u", "NONE", "-i", "NONE", "-n"]
    argv += ["--cmd", f"set runtimepath^={ROOT / 'clients' / 'nvim'}", "-c", f"luafile {path}"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    report_file = tmp_path / "report.json"
    assert report_file.exists(), f"nvim wrote no report\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    return json.loads(report_file.read_text())


def test_nvim_suggests_fill_in_the_middle_as_ghost_text(tmp_path):
    from make_fim_model import make_fim_model
    from rpcclient import RpcClient

    fim = make_fim_model(tmp_path / "fim.gguf")
    # What inference/infill answers for the same buffer, cursor and options.
    with RpcClient.spawn() as c:
        c.initialize()
        c.call("model/load", {"model": fim, "options": {"threads": 1}})
        expected = c.call("inference/infill", {"prefix": PREFIX, "suffix": SUFFIX, "options": GREEDY})
        extra = c.call(
            "inference/infill",
            {"prefix": PREFIX, "suffix": SUFFIX, "extra": EXTRA, "options": {**GREEDY, "stopAtLine": True}},
        )
    text = expected["text"]
    assert "\n" in text  # the model's junk runs over several lines: virt_lines are drawn too
    report = run_nvim(
        tmp_path,
        SUGGEST_SCRIPT,
        KINFER_TEST_FIM=fim,
        KINFER_TEST_GREEDY=json.dumps(GREEDY),
        KINFER_TEST_PREFIX=PREFIX,
        KINFER_TEST_SUFFIX=SUFFIX,
        KINFER_TEST_EXTRA=json.dumps(EXTRA),
    )
    assert report["loaded"] == fim
    # Client:infill passes extra and stopAtLine
    assert report["infill_extra"]["text"] == extra["text"] and "\n" not in extra["text"]
    assert report["infill_extra"]["tokens"] == extra["tokens"]
    assert report["infill_extra"]["dropped"] == {"prefix": 0, "suffix": 0, "extra": 0}
    # suggest: the reply, shown at the cursor by one extmark, then accepted there
    assert report["suggest_result"]["text"] == text
    assert report["suggest_result"]["tokens"] == expected["tokens"]
    assert report["suggest_shown"] == {"count": 1, "text": text, "at": [1, 11]}
    assert report["suggestion"] == [text, True]
    assert report["accepted"] is True
    assert report["after_accept"] == PREFIX + text + SUFFIX
    last = text.split("\n")[-1]
    assert report["after_accept_cursor"] == [2 + text.count("\n"), len(last.encode())]
    assert report["after_accept_shown"]["count"] == 0
    # dismiss clears it and leaves the buffer
    assert report["before_dismiss"] == 1
    assert report["dismissed"] is True
    assert report["after_dismiss"]["count"] == 0 and report["after_dismiss_suggestion"]
    assert report["after_dismiss_text"] == PREFIX + SUFFIX
    # a second suggestion cancels the first: one result, shown once
    assert report["first_streamed"] == 1
    assert report["first_code"] == -32800
    assert report["second_result"]["text"] == text
    assert report["results"] == 1
    assert report["race_shown"] == {"count": 1, "text": text, "at": [1, 11]}
    # the keymaps in insert mode
    assert report["keys"].get("text") == text and report["keys"]["mode"] == "i", report["keys"]
    assert report["keys_text"] == PREFIX + text + SUFFIX
    assert report["before_typing"] == 1
    assert report["typed"] == {"shown": 0, "gone": True, "mode": "i"}
    assert report["typed_text"] == PREFIX + "x" + SUFFIX
    assert report["plain_tab"] == PREFIX + "\t" + SUFFIX
    assert report["exit_code"] == 0


NO_FIM_SCRIPT = r"""
local kinfer = require('kinfer')
local out_dir = vim.env.KINFER_TEST_OUT
local report = {}
local function wait(pred) return vim.wait(60000, pred, 20) end
local client = kinfer.start()
local loaded
client:load({ options = { threads = 1 } }, function(err, result) loaded = err or result end)
wait(function() return loaded ~= nil end)
report.loaded = loaded.model
vim.api.nvim_buf_set_lines(0, 0, -1, false, { 'def add(a, b):', '    return ' })
vim.o.virtualedit = 'onemore'
vim.api.nvim_win_set_cursor(0, { 2, 11 })
local done = nil
kinfer.suggest(client, { options = { temperature = 0, maxTokens = 16 },
  on_done = function(err, result) done = { err = err, result = result } end })
wait(function() return done ~= nil end)
vim.wait(200)
report.done = done
report.marks = #vim.api.nvim_buf_get_extmarks(0, kinfer.ns, 0, -1, {})
report.suggestion = kinfer.suggestion(0) == nil
report.accepted = kinfer.accept(0)
report.text = table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\n')
local code
client:stop(function(c) code = c end)
wait(function() return code ~= nil end)
report.exit_code = code
vim.fn.writefile({ vim.json.encode(report) }, out_dir .. '/report.json')
vim.cmd('qa!')
"""


def test_nvim_suggest_without_fim_tokens_shows_nothing_and_reports_32602(tmp_path):
    report = run_nvim(tmp_path, NO_FIM_SCRIPT)
    assert report["loaded"] == "smollm2-135m-instruct"
    err = report["done"]["err"]
    assert err["code"] == -32602 and "cannot fill in the middle" in err["message"], err
    assert report["done"].get("result") is None
    assert report["marks"] == 0 and report["suggestion"] is True
    assert report["accepted"] is False
    assert report["text"] == "def add(a, b):\n    return "
    assert report["exit_code"] == 0


# -- a conversation in one buffer, the selection as a prompt, a cancelled reply -------------------
CHAT_SCRIPT = r"""
local kinfer = require('kinfer')
local out_dir = vim.env.KINFER_TEST_OUT
local report = { sent = {}, prompt_tokens = {}, completion_tokens = {} }
local function wait(pred) return vim.wait(60000, pred, 20) end
local function keys(k) return vim.api.nvim_replace_termcodes(k, true, false, true) end

local client = kinfer.start()
-- what each chat request sends, and the server's token counts for it
local request = client.request
function client.request(self, method, params, on_done, on_piece)
  if method ~= 'inference/chat' then return request(self, method, params, on_done, on_piece) end
  report.sent[#report.sent + 1] = vim.deepcopy(params.messages)
  return request(self, method, params, function(err, result)
    if result then
      report.prompt_tokens[#report.prompt_tokens + 1] = result.usage.promptTokens
      report.completion_tokens[#report.completion_tokens + 1] = result.usage.completionTokens
    end
    if on_done then on_done(err, result) end
  end, on_piece)
end
local loaded
client:load({ options = { threads = 1 } }, function(err, result) loaded = err or result end)
wait(function() return loaded ~= nil end)
kinfer.setup({ client = client, options = { maxTokens = 8, temperature = 0 } })

-- two prompts, one chat buffer
vim.cmd('KinferChat Name a colour.')
local chat = kinfer.chat_buf()
report.chat_shown = vim.api.nvim_get_current_buf() == chat
wait(function() return not kinfer.chat_busy(chat) end)
vim.cmd('wincmd p')
vim.cmd('KinferChat Name another one.')
report.same_buffer = kinfer.chat_buf() == chat
wait(function() return not kinfer.chat_busy(chat) end)

-- the visual selection of another buffer, after an instruction
local src = vim.api.nvim_create_buf(true, false)
vim.cmd('wincmd p')
vim.api.nvim_set_current_buf(src)
vim.api.nvim_buf_set_lines(src, 0, -1, false, { 'skip me', 'def add(a, b):', '    return a + b', 'skip me too' })
vim.cmd('normal! 2GVj')
vim.api.nvim_feedkeys(keys(":KinferSend Explain this code.<CR>"), 'x', false)
wait(function() return not kinfer.chat_busy(chat) end)
-- a characterwise selection is the selected characters
vim.cmd('wincmd p')
vim.api.nvim_set_current_buf(src)
vim.cmd('normal! 2G5|v3l\27')  -- then <Esc>: the marks '< and '> are set
report.charwise = kinfer.selection_text(src, 2, 2)

-- a long reply, stopped with :KinferCancel
local cancelled = false
kinfer.chat_send(client, chat, 'Tell me a long story.', {
  options = { maxTokens = 2000, ignoreEos = true },
  on_done = function(err) report.cancel_code = err and err.code; cancelled = true end,
})
report.refused_while_busy = kinfer.chat_send(client, chat, 'Meanwhile?') == nil
wait(function() return #(vim.api.nvim_buf_get_lines(chat, -2, -1, false)[1] or '') > 10 end)
vim.cmd('KinferCancel')
wait(function() return cancelled end)
report.lines = vim.api.nvim_buf_get_lines(chat, 0, -1, false)
report.conversation = kinfer.conversation(chat)

local code
client:stop(function(c) code = c end)
wait(function() return code ~= nil end)
report.exit_code = code
vim.fn.writefile({ vim.json.encode(report) }, out_dir .. '/report.json')
vim.cmd('qa!')
"""

SELECTION = "Explain this code.\n\ndef add(a, b):\n    return a + b"


def test_nvim_chat_is_one_conversation_in_one_buffer(tmp_path):
    report = run_nvim(tmp_path, CHAT_SCRIPT, OMP_WAIT_POLICY="PASSIVE")
    assert report["chat_shown"] and report["same_buffer"]
    first, second, third, fourth = report["sent"]
    assert first == [{"role": "user", "content": "Name a colour."}]
    reply1 = report["conversation"][1]
    assert reply1["role"] == "assistant" and reply1["content"]
    # the second prompt carries the first exchange ...
    assert second == [first[0], reply1, {"role": "user", "content": "Name another one."}]
    # ... and the server read it: its prompt holds the first prompt and reply
    assert report["prompt_tokens"][1] > report["prompt_tokens"][0] + report["completion_tokens"][0]
    # the selected lines, after the instruction, with the conversation before them
    assert third[:4] == report["conversation"][:4] and third[4] == {"role": "user", "content": SELECTION}
    assert fourth[-1] == {"role": "user", "content": "Tell me a long story."} and len(fourth) == 7
    assert report["charwise"] == "add("

    # each prompt is shown above its reply, in order
    lines = report["lines"]
    conversation = report["conversation"]
    assert [m["role"] for m in conversation] == ["user", "assistant"] * 4
    text = "\n".join(lines)
    at = 0
    for m in conversation:
        heading = "## You\n" if m["role"] == "user" else "## kinfer\n"
        at = text.index(heading + m["content"], at) + len(heading + m["content"])
    # the stopped reply: what came, then a mark
    assert report["cancel_code"] == -32800 and report["refused_while_busy"]
    assert lines[-1] == "[cancelled]" and lines[-3] == "## kinfer" and lines[-2] == conversation[-1]["content"]
    assert len(conversation[-1]["content"]) > 10
    assert report["exit_code"] == 0


HEALTH_SCRIPT = r"""
vim.cmd('checkhealth kinfer')
local lines = vim.api.nvim_buf_get_lines(0, 0, -1, false)
vim.fn.writefile({ vim.json.encode({ lines = lines }) }, vim.env.KINFER_TEST_OUT .. '/report.json')
vim.cmd('qa!')
"""


def test_nvim_checkhealth_kinfer(tmp_path):
    report = run_nvim(tmp_path, HEALTH_SCRIPT, OMP_WAIT_POLICY="PASSIVE")
    text = "\n".join(report["lines"])
    assert "ERROR" not in text and "WARNING" not in text, text
    assert f"OK: found: {KINFER_RPC} ($KINFER_RPC)" in text
    assert "OK: it starts and answers initialize: kinfer-rpc" in text and "llama" in text
    assert "OK: smollm2-135m-instruct loads (backend llama" in text
    assert "the server shut down cleanly" in text


def test_nvim_checkhealth_kinfer_without_the_server(tmp_path):
    report = run_nvim(tmp_path, HEALTH_SCRIPT, KINFER_RPC=str(tmp_path / "no-such-kinfer-rpc"))
    text = "\n".join(report["lines"])
    assert "ERROR: " + str(tmp_path / "no-such-kinfer-rpc") + " not found" in text
    assert "OK:" not in text


def test_nvim_checkhealth_kinfer_reports_a_model_that_does_not_load(tmp_path):
    script = "require('kinfer.health').model = 'no-such-model'\n" + HEALTH_SCRIPT
    report = run_nvim(tmp_path, script, OMP_WAIT_POLICY="PASSIVE")
    text = "\n".join(report["lines"])
    assert "OK: it starts and answers initialize" in text
    assert "ERROR: no-such-model does not load: model 'no-such-model' not found" in text and "(-31001)" in text
    assert "the server shut down cleanly" in text
