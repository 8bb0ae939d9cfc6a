-- kinfer.nvim: talk to kinfer-rpc (local LLM inference over JSON-RPC on stdio) from Neovim.
--
--   local kinfer = require('kinfer')
--   local client = kinfer.start()                       -- spawns `kinfer-rpc` ($KINFER_RPC or PATH)
--   local buf = vim.api.nvim_create_buf(true, true)
--   kinfer.chat_to_buffer(client, buf, 'Why is the sky blue?', { options = { maxTokens = 200 } })
--   client:stop()
--
-- or `require('kinfer').setup()` for :KinferChat {prompt} and :KinferCancel.
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

--- :KinferChat {prompt} streams a reply into a scratch buffer; :KinferCancel stops it.
function M.setup(opts)
  opts = opts or {}
  local client, current
  vim.api.nvim_create_user_command('KinferChat', function(cmd)
    client = client or M.start(opts)
    vim.cmd(opts.split or 'new')
    local buf = vim.api.nvim_get_current_buf()
    vim.bo[buf].buftype = 'nofile'
    vim.bo[buf].filetype = 'markdown'
    current = M.chat_to_buffer(client, buf, cmd.args, { model = opts.model, options = opts.options })
  end, { nargs = '+' })
  vim.api.nvim_create_user_command('KinferCancel', function()
    if current then
      current.cancel()
    end
  end, {})
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
