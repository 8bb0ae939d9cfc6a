-- kinfer.nvim: talk to kinfer-rpc (local LLM inference over JSON-RPC on stdio) from Neovim.
--
--   local kinfer = require('kinfer')
--   local client = kinfer.start()                       -- spawns `kinfer-rpc` ($KINFER_RPC or PATH)
--   local buf = vim.api.nvim_create_buf(true, true)
--   kinfer.chat_to_buffer(client, buf, 'Why is the sky blue?', { options = { maxTokens = 200 } })
--   client:stop()
--
-- or `require('kinfer').setup()` for :KinferChat [prompt] (a conversation in one buffer),
-- :'<,'>KinferSend [instruction] (the selection as a prompt), :KinferCancel and :checkhealth kinfer;
-- kinfer.suggest(client) / kinfer.accept() / kinfer.dismiss() for fill-in-the-middle completions
-- at the cursor shown as ghost text (setup({ infill_keys = true }): <C-F> and <Tab> in insert mode).
--
-- Built on vim.lsp.rpc.start: works with Neovim 0.7 (start(cmd, args, dispatchers)) and 0.10+
-- (start(cmd_list, dispatchers)). Streaming uses partialResultToken + $/progress; cancelling sends
-- $/cancelRequest. Neovim's RPC layer swallows the server's -32800 answer, so a cancelled call's
-- on_done gets { code = -32800, message = 'cancelled' } once the server has answered.

local M = {}

M.REQUEST_CANCELLED = -32800

local Client = {}
Client.__index = Client

-- Run fn on the main loop, keeping the order the server's messages came in. Neovim schedules
-- dispatchers and answer callbacks itself (0.7 does; where it calls one in a fast event, it is
-- scheduled here): scheduling a stream's pieces again would run its last pieces after its answer,
-- which drops them.
local function in_order(fn)
  if vim.in_fast_event() then
    vim.schedule(fn)
  else
    fn()
  end
end

-- The server runs in a process group (a session) of its own: Ctrl-C at the terminal while Neovim
-- runs a shell command (`:!make`), or at a headless Neovim, sends SIGINT to Neovim's group, and
-- must not end the server. Neovim 0.8+ spawns it detached (extra_spawn_params.detached); 0.7
-- cannot, so `setsid` runs it there: setsid execs it in place (a child is not a group leader, so
-- it does not fork), and the server stays Neovim's child, which exits when Neovim goes (its stdin
-- closes, its parent is gone). Not on Windows, where a detached process gets a console of its own.
local function start_rpc(cmd, dispatchers)
  local unix = vim.fn.has('win32') == 0
  local extra = { detached = unix }
  if vim.fn.has('nvim-0.10') == 1 then
    return vim.lsp.rpc.start(cmd, dispatchers, extra)
  end
  if unix and vim.fn.has('nvim-0.8') == 0 and vim.fn.executable('setsid') == 1 then
    cmd = vim.list_extend({ 'setsid' }, cmd)
  end
  local args = {}
  for i = 2, #cmd do
    args[#args + 1] = cmd[i]
  end
  return vim.lsp.rpc.start(cmd[1], args, dispatchers, extra)
end

--- Spawn and initialize a server. opts: cmd (list), on_notification(method, params), on_exit(code).
function M.start(opts)
  opts = opts or {}
  local cmd = vim.deepcopy(opts.cmd or { vim.env.KINFER_RPC or 'kinfer-rpc' })
  vim.list_extend(cmd, { '--clientProcessId', tostring(vim.fn.getpid()) })
  local self = setmetatable({ ready = false, queued = {}, streams = {}, serial = 0, exited = false }, Client)
  self.rpc = start_rpc(cmd, {
    notification = function(method, params)
      if method == '$/progress' and type(params) == 'table' and self.streams[params.token] then
        local handler = self.streams[params.token]
        in_order(function()
          handler(params.value)
        end)
      elseif opts.on_notification then
        in_order(function()
          opts.on_notification(method, params)
        end)
      end
    end,
    on_exit = function(code, _signal)
      self.exited = true
      self.exit_code = code
      vim.schedule(function()
        if self.on_exit then
          self.on_exit(code)
        end
        if opts.on_exit then
          opts.on_exit(code)
        end
      end)
    end,
  })
  if not self.rpc then
    error('kinfer: could not start ' .. cmd[1])
  end
  self.rpc.request('initialize', {
    processId = vim.fn.getpid(),
    clientInfo = { name = 'kinfer.nvim' },
    capabilities = vim.empty_dict(),
    initializationOptions = vim.empty_dict(),
  }, function(err, result)
    if err then
      vim.notify('kinfer: initialize failed: ' .. tostring(err.message or err), vim.log.levels.ERROR)
      return
    end
    self.server_info = result
    self.rpc.notify('initialized', vim.empty_dict())
    self.ready = true
    local queued = self.queued
    self.queued = {}
    for _, send in ipairs(queued) do
      send()
    end
  end)
  return self
end

local function when_ready(self, send)
  if self.ready then
    send()
  else
    table.insert(self.queued, send)
  end
end

--- A request; on_done(err, result). Returns a handle with :cancel().
function Client:request(method, params, on_done, on_piece)
  local handle = { done = false, cancelled = false }
  local token
  local function finish(err, result)
    if handle.done then
      return
    end
    handle.done = true
    if token then
      self.streams[token] = nil
    end
    if on_done then
      on_done(err, result)
    end
  end
  if on_piece then
    self.serial = self.serial + 1
    token = 'nvim-' .. self.serial
    params = vim.tbl_extend('force', params or {}, { partialResultToken = token })
    self.streams[token] = function(value)
      if not handle.done and not handle.cancelled and value and value.text and value.text ~= '' then
        on_piece(value.text, value)
      end
    end
  end
  function handle.cancel()
    if handle.done or handle.cancelled then
      return
    end
    handle.cancelled = true
    if handle.id then
      self.rpc.notify('$/cancelRequest', { id = handle.id })
    end
  end
  when_ready(self, function()
    if handle.cancelled then
      return finish({ code = M.REQUEST_CANCELLED, message = 'cancelled' })
    end
    local ok, id = self.rpc.request(method, params, function(err, result)
      in_order(function()
        finish(err, result)
      end)
    end, function()
      -- Any answer came; a cancelled request's (-32800) never reaches the callback above.
      vim.schedule(function()
        if handle.cancelled then
          finish({ code = M.REQUEST_CANCELLED, message = 'cancelled' })
        end
      end)
    end)
    if not ok then
      return finish({ code = -32099, message = 'the server is gone' })
    end
    handle.id = id
  end)
  return handle
end

function Client:notify(method, params)
  when_ready(self, function()
    self.rpc.notify(method, params)
  end)
end

local function inference_params(fields, opts)
  opts = opts or {}
  if opts.model then
    fields.model = opts.model
  end
  if opts.options then
    fields.options = opts.options
  end
  return fields
end

--- model/load; opts: model, options (camelCase load options). on_done(err, result).
function Client:load(opts, on_done)
  return self:request('model/load', inference_params({}, opts), on_done)
end

--- inference/chat; opts: model, options. on_piece(text) streams; on_done(err, result).
function Client:chat(messages, opts, on_piece, on_done)
  return self:request('inference/chat', inference_params({ messages = messages }, opts), on_done, on_piece)
end

--- inference/generate; opts: model, options. on_piece(text) streams; on_done(err, result).
function Client:generate(prompt, opts, on_piece, on_done)
  return self:request('inference/generate', inference_params({ prompt = prompt }, opts), on_done, on_piece)
end

--- inference/infill: fill the gap between prefix and suffix (the model needs FIM tokens, else
--- -32602). opts: model, options (generate's and stopAtLine), extra ({ {filename?, text}, ... },
--- other files as context), stopAtLine (a shorthand for options.stopAtLine). on_piece(text)
--- streams; on_done(err, result), result as generate's plus dropped.
function Client:infill(prefix, suffix, opts, on_piece, on_done)
  opts = opts or {}
  local fields = inference_params({ prefix = prefix, suffix = suffix or '' }, opts)
  if opts.extra and #opts.extra > 0 then
    fields.extra = opts.extra
  end
  if opts.stopAtLine ~= nil then
    fields.options = vim.tbl_extend('force', fields.options or {}, { stopAtLine = opts.stopAtLine })
  end
  return self:request('inference/infill', fields, on_done, on_piece)
end

--- shutdown, exit; on_exit(code) when the process has gone (0 when clean).
function Client:stop(on_exit)
  if self.exited then
    if on_exit then
      vim.schedule(function()
        on_exit(self.exit_code)
      end)
    end
    return
  end
  self.on_exit = on_exit
  when_ready(self, function()
    self.rpc.request('shutdown', nil, function()
      self.rpc.notify('exit', nil)
    end)
  end)
end

--- Append text at the end of a buffer (text may hold newlines).
function M.append(buf, text)
  local parts = vim.split(text, '\n', { plain = true })
  local last = vim.api.nvim_buf_line_count(buf)
  local tail = vim.api.nvim_buf_get_lines(buf, last - 1, last, false)[1] or ''
  parts[1] = tail .. parts[1]
  vim.api.nvim_buf_set_lines(buf, last - 1, last, false, parts)
end

--- Stream a chat reply into `buf`. `prompt` is a string or a list of messages.
--- opts: model, options, on_done(err, result). Returns the handle (:cancel()).
function M.chat_to_buffer(client, buf, prompt, opts)
  opts = opts or {}
  local messages = type(prompt) == 'string' and { { role = 'user', content = prompt } } or prompt
  return client:chat(messages, opts, function(text)
    if vim.api.nvim_buf_is_valid(buf) then
      M.append(buf, text)
    end
  end, function(err, result)
    if opts.on_done then
      opts.on_done(err, result)
    elseif err and err.code ~= M.REQUEST_CANCELLED then
      vim.notify('kinfer: ' .. tostring(err.message), vim.log.levels.ERROR)
    end
  end)
end

-- buf, or the current buffer for nil or 0.
local function buffer(buf)
  if buf == nil or buf == 0 then
    return vim.api.nvim_get_current_buf()
  end
  return buf
end

-- A conversation in one buffer --------------------------------------------------------------------
--
-- Each exchange is the prompt under a `## You` heading, then the reply streamed under `## kinfer`.
-- The conversation so far (the prompts and the replies, as messages) goes with each new prompt.
-- A reply stopped before its end keeps what came and is followed by a `[cancelled]` line; one
-- that failed by an `[error: ...]` line.

M.YOU = '## You'
M.ASSISTANT = '## kinfer'
M.CANCELLED = '[cancelled]'

-- buf -> { messages = {...}, handle = the reply coming now or nil, opts }
local chats = {}

local function write_lines(buf, lines)
  local count = vim.api.nvim_buf_line_count(buf)
  local first = vim.api.nvim_buf_get_lines(buf, 0, 1, false)[1]
  if count == 1 and first == '' then
    vim.api.nvim_buf_set_lines(buf, 0, 1, false, lines)
  else
    vim.api.nvim_buf_set_lines(buf, count, count, false, lines)
  end
end

--- The chat buffer: `buf` made one (or, without it, a new scratch buffer named kinfer://chat).
--- opts: model, options (each chat request's). Returns the buffer.
function M.chat_buffer(buf, opts)
  if buf == nil then
    buf = vim.api.nvim_create_buf(true, true)
    pcall(vim.api.nvim_buf_set_name, buf, 'kinfer://chat')
    vim.bo[buf].filetype = 'markdown'
  end
  buf = buffer(buf)
  if not chats[buf] then
    chats[buf] = { messages = {}, opts = opts or {} }
    vim.api.nvim_buf_attach(buf, false, {
      on_detach = function()
        chats[buf] = nil
      end,
    })
  elseif opts then
    chats[buf].opts = opts
  end
  return buf
end

--- The conversation of a chat buffer so far: a list of { role, content } messages.
function M.conversation(buf)
  local chat = chats[buffer(buf)]
  return chat and vim.deepcopy(chat.messages) or {}
end

--- The chat buffer of :KinferChat and :KinferSend (nil before setup, or before the first use).
function M.chat_buf()
  return nil
end

--- Whether a reply is coming into the chat buffer now.
function M.chat_busy(buf)
  local chat = chats[buffer(buf)]
  return chat ~= nil and chat.handle ~= nil
end

--- Send `prompt` in the chat buffer `buf` (made a chat buffer if it is not one): the prompt is
--- shown, then the reply streams in below it; the request carries the conversation so far.
--- opts: model, options (default: the chat buffer's), on_done(err, result). Returns the handle
--- (:cancel()), or nil when a reply is still coming (cancel it first).
function M.chat_send(client, buf, prompt, opts)
  buf = M.chat_buffer(buf)
  local chat = chats[buf]
  opts = vim.tbl_extend('force', chat.opts, opts or {})
  if chat.handle then
    vim.notify('kinfer: a reply is still coming (:KinferCancel stops it)', vim.log.levels.WARN)
    return nil
  end
  local lines = { M.YOU }
  vim.list_extend(lines, vim.split(prompt, '\n', { plain = true }))
  vim.list_extend(lines, { '', M.ASSISTANT, '' })
  if vim.api.nvim_buf_line_count(buf) > 1 or vim.api.nvim_buf_get_lines(buf, 0, 1, false)[1] ~= '' then
    table.insert(lines, 1, '')
  end
  write_lines(buf, lines)
  local messages = vim.deepcopy(chat.messages)
  messages[#messages + 1] = { role = 'user', content = prompt }
  local reply = ''
  local handle
  handle = client:chat(messages, opts, function(text)
    reply = reply .. text
    if vim.api.nvim_buf_is_valid(buf) then
      M.append(buf, text)
    end
  end, function(err, result)
    if chat.handle == handle then
      chat.handle = nil
    end
    local text = (not err and result and result.text) or reply
    -- the conversation goes on with what was shown, a stopped reply's part included
    chat.messages[#chat.messages + 1] = { role = 'user', content = prompt }
    chat.messages[#chat.messages + 1] = { role = 'assistant', content = text }
    if vim.api.nvim_buf_is_valid(buf) then
      if err and err.code == M.REQUEST_CANCELLED then
        write_lines(buf, { M.CANCELLED })
      elseif err then
        write_lines(buf, { '[error: ' .. tostring(err.message) .. ']' })
      end
    end
    if opts.on_done then
      opts.on_done(err, result)
    elseif err and err.code ~= M.REQUEST_CANCELLED then
      vim.notify('kinfer: ' .. tostring(err.message), vim.log.levels.ERROR)
    end
  end)
  if not handle.done then
    chat.handle = handle
  end
  return handle
end

--- Cancel the reply coming into the chat buffer, if one is. Returns whether one was.
function M.chat_cancel(buf)
  local chat = chats[buffer(buf)]
  if chat and chat.handle then
    chat.handle.cancel()
    return true
  end
  return false
end

--- The text of lines line1..line2 of `buf` (1-based, inclusive). When they are the last visual
--- selection and it was characterwise, only the selected characters (to the end of a line).
function M.selection_text(buf, line1, line2)
  buf = buffer(buf)
  local lines = vim.api.nvim_buf_get_lines(buf, line1 - 1, line2, false)
  if buf == vim.api.nvim_get_current_buf() and vim.fn.visualmode() == 'v' then
    local s, e = vim.fn.getpos("'<"), vim.fn.getpos("'>")
    if s[2] == line1 and e[2] == line2 and #lines > 0 then
      local last = e[3] >= 2147483647 and #lines[#lines] or e[3]
      lines[#lines] = lines[#lines]:sub(1, last)
      lines[1] = lines[1]:sub(s[3])
    end
  end
  return table.concat(lines, '\n')
end

--- Send lines line1..line2 of `buf` (the visual selection, from a range) as a prompt to the chat
--- buffer `chat_buf`; `instruction`, if given, goes before them. Returns the handle.
function M.send_range(client, chat_buf, buf, line1, line2, instruction, opts)
  local text = M.selection_text(buf, line1, line2)
  if instruction and instruction ~= '' then
    text = instruction .. '\n\n' .. text
  end
  return M.chat_send(client, chat_buf, text, opts)
end

-- Fill in the middle at the cursor, shown as ghost text -------------------------------------------
--
-- A suggestion is the streamed reply of inference/infill for the buffer's text before and after
-- a position (the cursor), drawn with extmarks in the namespace M.ns in the highlight group
-- KinferSuggestion (default: linked to Comment): its first line as virt_text at the position,
-- 'overlay' (Neovim 0.7 has no 'inline': at the end of a line, the overlay past its last character
-- looks like inserted text; in the middle of a line it is followed by the rest of the line, so that
-- the line reads as it will once accepted), its further lines as virt_lines below. Tabs in the text
-- are drawn as 'tabstop' spaces. One suggestion per buffer: a new one cancels the one before.

M.ns = vim.api.nvim_create_namespace('kinfer_suggestion')
M.HL = 'KinferSuggestion'
vim.cmd('highlight default link ' .. M.HL .. ' Comment')

-- buf -> { text, row (1-based), col (0-based bytes), cursor, tick, mark, handle, done }
local suggestions = {}

-- The window that shows buf: the current one if it does, else the first; nil if none.
local function window(buf)
  if vim.api.nvim_win_get_buf(0) == buf then
    return vim.api.nvim_get_current_win()
  end
  local win = vim.fn.bufwinid(buf)
  return win ~= -1 and win or nil
end

-- The buffer's text before and after (row, col), the text ending with a line break as Neovim
-- writes the file ('eol', or 'fixeol' when not 'binary').
local function around(buf, row, col)
  local lines = vim.api.nvim_buf_get_lines(buf, 0, -1, false)
  local line = lines[row] or ''
  local before = {}
  for i = 1, row - 1 do
    before[#before + 1] = lines[i]
  end
  before[#before + 1] = line:sub(1, col)
  local after = { line:sub(col + 1) }
  for i = row + 1, #lines do
    after[#after + 1] = lines[i]
  end
  local suffix = table.concat(after, '\n')
  local bo = vim.bo[buf]
  if bo.eol or (bo.fixeol and not bo.binary) then
    suffix = suffix .. '\n'
  end
  return table.concat(before, '\n'), suffix
end

local function shown(buf, text)
  return (text:gsub('\t', string.rep(' ', vim.bo[buf].tabstop)))
end

local function render(buf, s)
  if not vim.api.nvim_buf_is_valid(buf) then
    return
  end
  if s.text == '' then
    if s.mark then
      vim.api.nvim_buf_del_extmark(buf, M.ns, s.mark)
      s.mark = nil
    end
    return
  end
  local lines = vim.split(shown(buf, s.text), '\n', { plain = true })
  local rest = shown(buf, (vim.api.nvim_buf_get_lines(buf, s.row - 1, s.row, false)[1] or ''):sub(s.col + 1))
  local first = {}
  if lines[1] ~= '' then
    first[1] = { lines[1], M.HL }
  end
  local below = {}
  for i = 2, #lines do
    below[#below + 1] = { { lines[i], M.HL } }
  end
  if rest ~= '' then
    if #lines == 1 then
      first[#first + 1] = { rest, 'Normal' }
    else
      -- the rest of the line goes after the last line; blank out what the overlay does not cover
      local pad = vim.fn.strdisplaywidth(rest) - vim.fn.strdisplaywidth(lines[1])
      if pad > 0 then
        first[#first + 1] = { string.rep(' ', pad), 'Normal' }
      end
      table.insert(below[#below], { rest, 'Normal' })
    end
  end
  s.mark = vim.api.nvim_buf_set_extmark(buf, M.ns, s.row - 1, s.col, {
    id = s.mark,
    virt_text = #first > 0 and first or nil,
    virt_text_pos = 'overlay',
    virt_lines = #below > 0 and below or nil,
    hl_mode = 'combine',
    right_gravity = false,
  })
end

local watching = false

-- Typing, moving the cursor or leaving insert mode makes a suggestion stale: it goes.
local function watch()
  if watching then
    return
  end
  watching = true
  local group = vim.api.nvim_create_augroup('KinferSuggestion', { clear = true })
  vim.api.nvim_create_autocmd({ 'TextChanged', 'TextChangedI', 'TextChangedP', 'CursorMoved', 'CursorMovedI' }, {
    group = group,
    callback = function(args)
      local s = suggestions[args.buf]
      if not s then
        return
      end
      local cursor = vim.api.nvim_win_get_cursor(0)
      if
        vim.api.nvim_buf_get_changedtick(args.buf) ~= s.tick
        or cursor[1] ~= s.cursor[1]
        or cursor[2] ~= s.cursor[2]
      then
        M.dismiss(args.buf)
      end
    end,
  })
  vim.api.nvim_create_autocmd({ 'InsertLeave', 'BufLeave', 'BufUnload' }, {
    group = group,
    callback = function(args)
      M.dismiss(args.buf)
    end,
  })
end

--- The buffer's suggestion: its text so far (nil when none) and whether its reply is complete.
function M.suggestion(buf)
  local s = suggestions[buffer(buf)]
  if s then
    return s.text, s.done
  end
end

--- Suggest a completion at the cursor: inference/infill of the current buffer's text before and
--- after it, streamed as ghost text; cancels the buffer's suggestion before. opts: model, options,
--- extra, stopAtLine (as Client:infill), buf (default: current), pos ({row, col}: 1-based row,
--- 0-based byte column, where text goes in as typed in insert mode; default: the cursor),
--- on_done(err, result) (default: errors other than a cancel are notified). Returns the handle.
function M.suggest(client, opts)
  opts = opts or {}
  local buf = buffer(opts.buf)
  M.dismiss(buf)
  watch()
  local win = window(buf)
  local cursor = win and vim.api.nvim_win_get_cursor(win) or { 1, 0 }
  local pos = opts.pos or cursor
  local prefix, suffix = around(buf, pos[1], pos[2])
  local s = {
    text = '',
    row = pos[1],
    col = pos[2],
    cursor = cursor,
    tick = vim.api.nvim_buf_get_changedtick(buf),
    done = false,
  }
  suggestions[buf] = s
  local handle = client:infill(prefix, suffix, opts, function(text)
    if suggestions[buf] == s then
      s.text = s.text .. text
      render(buf, s)
    end
  end, function(err, result)
    s.done = true
    s.handle = nil
    if suggestions[buf] == s then
      if err then
        M.dismiss(buf)
      else
        -- the result is the reference: the stream may hold text the reply then leaves out
        s.text = result and result.text or s.text
        render(buf, s)
      end
    end
    if opts.on_done then
      opts.on_done(err, result)
    elseif err and err.code ~= M.REQUEST_CANCELLED then
      vim.notify('kinfer: ' .. tostring(err.message), vim.log.levels.ERROR)
    end
  end)
  if not s.done then
    s.handle = handle
  end
  return handle
end

--- Clear the buffer's suggestion, cancelling its reply if it is still coming. Returns whether
--- there was one.
function M.dismiss(buf)
  buf = buffer(buf)
  local s = suggestions[buf]
  if not s then
    return false
  end
  suggestions[buf] = nil
  if s.handle then
    s.handle.cancel()
  end
  if vim.api.nvim_buf_is_valid(buf) then
    vim.api.nvim_buf_clear_namespace(buf, M.ns, 0, -1)
  end
  return true
end

--- Insert the buffer's suggestion where it is shown (what has come so far, if its reply is still
--- coming: the rest is cancelled), clear it, and put the cursor after it in a window showing the
--- buffer. Returns whether there was text to insert.
function M.accept(buf)
  buf = buffer(buf)
  local s = suggestions[buf]
  if not s then
    return false
  end
  local at = s.mark and vim.api.nvim_buf_get_extmark_by_id(buf, M.ns, s.mark, {})
  M.dismiss(buf)
  if not at or not at[1] or s.text == '' then
    return false
  end
  local lines = vim.split(s.text, '\n', { plain = true })
  local row, col = at[1], at[2]
  vim.api.nvim_buf_set_text(buf, row, col, row, col, lines)
  local win = window(buf)
  if win then
    local last = #lines == 1 and col + #lines[1] or #lines[#lines]
    vim.api.nvim_win_set_cursor(win, { row + #lines, last })
  end
  return true
end

--- :KinferChat [prompt] shows the chat buffer (one conversation, kept across prompts) and sends
--- the prompt in it; :[range]KinferSend [instruction] sends the lines of the range (the visual
--- selection: :'<,'>KinferSend) there, after the instruction if given; :KinferCancel stops the
--- reply coming. opts: cmd and on_exit (M.start), client (one from M.start to use instead of
--- starting one on first use), model and options (the chat's), split (the command that opens a
--- window for the chat buffer, default 'new'), infill (M.suggest's opts for the keymaps),
--- infill_keys (insert-mode keymaps: true for { suggest = '<C-F>', accept = '<Tab>' }, or a table
--- naming either; nil or false: none). accept falls back to the key itself when no suggestion is
--- shown.
function M.setup(opts)
  opts = opts or {}
  local client, chat = opts.client, nil
  if opts.model then
    require('kinfer.health').model = opts.model -- :checkhealth kinfer loads the chat's model
  end
  local function show_chat()
    client = client or M.start(opts)
    if not (chat and vim.api.nvim_buf_is_valid(chat)) then
      chat = M.chat_buffer(nil, { model = opts.model, options = opts.options })
    end
    local win = vim.fn.bufwinid(chat)
    if win ~= -1 then
      vim.api.nvim_set_current_win(win)
    else
      vim.cmd(opts.split or 'new')
      vim.api.nvim_win_set_buf(0, chat)
    end
  end
  M.chat_buf = function()
    return chat
  end
  vim.api.nvim_create_user_command('KinferChat', function(cmd)
    show_chat()
    if cmd.args ~= '' then
      M.chat_send(client, chat, cmd.args)
    end
  end, { nargs = '*' })
  vim.api.nvim_create_user_command('KinferSend', function(cmd)
    local source = vim.api.nvim_get_current_buf()
    local text = M.selection_text(source, cmd.line1, cmd.line2)
    if cmd.args ~= '' then
      text = cmd.args .. '\n\n' .. text
    end
    show_chat()
    M.chat_send(client, chat, text)
  end, { nargs = '*', range = true })
  vim.api.nvim_create_user_command('KinferCancel', function()
    if chat then
      M.chat_cancel(chat)
    end
  end, {})
  local keys = opts.infill_keys
  if keys == true then
    keys = { suggest = '<C-F>', accept = '<Tab>' }
  end
  if keys and keys.suggest then
    vim.keymap.set('i', keys.suggest, function()
      client = client or M.start(opts)
      M.suggest(client, opts.infill)
    end, { desc = 'kinfer: suggest a completion at the cursor' })
  end
  if keys and keys.accept then
    local fallback = vim.api.nvim_replace_termcodes(keys.accept, true, false, true)
    vim.keymap.set('i', keys.accept, function()
      if not M.accept() then
        vim.api.nvim_feedkeys(fallback, 'ni', false)
      end
    end, { desc = 'kinfer: accept the suggestion' })
  end
  vim.api.nvim_create_autocmd('VimLeavePre', {
    callback = function()
      if client then
        client:stop()
        vim.wait(2000, function()
          return client.exited
        end, 20)
      end
    end,
  })
end

return M
