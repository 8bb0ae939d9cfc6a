-- :checkhealth kinfer: is kinfer-rpc there, does it start and answer initialize, does the default
-- model (or setup's `model`, or M.model) load. Neovim 0.7 to 0.9 report through require('health').report_*,
-- 0.10+ through vim.health.*.

local M = {}

local health = vim.health or require('health')
local ok = health.ok or health.report_ok
local info = health.info or health.report_info
local warn = health.warn or health.report_warn
local report_error = health.error or health.report_error
local start = health.start or health.report_start

M.TIMEOUT_MS = 120000 -- a load of a large model from a slow disk takes a while

--- The command :checkhealth kinfer runs: $KINFER_RPC, or kinfer-rpc on PATH.
function M.command()
  return vim.env.KINFER_RPC or 'kinfer-rpc'
end

function M.check()
  local kinfer = require('kinfer')
  start('kinfer-rpc')
  local cmd = M.command()
  local path = vim.fn.exepath(cmd)
  if path == '' then
    report_error(cmd .. ' not found', {
      'Put kinfer-rpc on PATH (the kinfer_rpc Python package installs it, e.g. in a virtualenv\'s bin),',
      'or set $KINFER_RPC to its path.',
    })
    return
  end
  ok('found: ' .. path .. (vim.env.KINFER_RPC and ' ($KINFER_RPC)' or ' (on PATH)'))

  local exit_code
  local client = kinfer.start({
    cmd = { path },
    on_exit = function(code)
      exit_code = code
    end,
  })
  vim.wait(60000, function()
    return client.ready or client.exited
  end, 20)
  if not client.ready then
    local why = client.exited and ('it exited, code ' .. tostring(client.exit_code)) or 'not within 60 seconds'
    report_error('it did not answer initialize (' .. why .. ')', {
      'Run `' .. path .. ' --log-level debug` to see why.',
    })
    if not client.exited then
      client:stop()
    end
    return
  end
  local server = client.server_info and client.server_info.serverInfo or {}
  local backends = client.server_info and client.server_info.capabilities and client.server_info.capabilities.backends
  ok(
    'it starts and answers initialize: '
      .. tostring(server.name or 'kinfer-rpc')
      .. ' '
      .. tostring(server.version or '')
      .. (type(backends) == 'table' and (', backends: ' .. table.concat(backends, ', ')) or '')
  )

  local model = M.model
  start(model and ('the model ' .. model) or 'the default model')
  local loaded
  client:load({ model = model }, function(err, result)
    loaded = { err = err, result = result }
  end)
  vim.wait(M.TIMEOUT_MS, function()
    return loaded ~= nil or client.exited
  end, 50)
  if loaded and loaded.result then
    local r = loaded.result
    ok(string.format('%s loads (backend %s, context %s tokens)', r.model, r.backend, tostring(r.contextLength)))
  elseif loaded then
    local err = loaded.err or {}
    local name = model or 'the default model'
    report_error(string.format('%s does not load: %s (%s)', name, tostring(err.message), tostring(err.code)), {
      'Check KINFER_MODELS and OLLAMA_MODELS, or name a model: setup({ model = ... }).',
    })
  elseif client.exited then
    report_error('the server exited during the load (code ' .. tostring(client.exit_code) .. ')')
  else
    warn('the load did not finish within ' .. M.TIMEOUT_MS / 1000 .. ' seconds')
  end

  client:stop()
  vim.wait(10000, function()
    return exit_code ~= nil
  end, 20)
  if exit_code == 0 then
    info('the server shut down cleanly')
  else
    warn('the server did not shut down cleanly (exit code ' .. tostring(exit_code) .. ')')
  end
end

return M
