// Tool calls against a real `kinfer-rpc` ($KINFER_RPC or PATH), on a copy of the embedded model
// whose chat template takes tools (Qwen's way), made by tests/modelgen/make_tool_model.py with
// `python` from PATH ($PYTHON): the one kinfer-rpc is installed in.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, before, test } from 'node:test';

import { KinferClient, ResponseError } from '../index.js';

const MAKE_TOOL_MODEL = fileURLToPath(new URL('../../../tests/modelgen/make_tool_model.py', import.meta.url));
const weather = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'The weather now in a city.',
    parameters: {
      type: 'object',
      properties: { city: { type: 'string', maxLength: 40 }, unit: { enum: ['c', 'f'] } },
      required: ['city', 'unit'],
      additionalProperties: false,
    },
  },
};
const time = {
  type: 'function',
  function: {
    name: 'get_time',
    parameters: { type: 'object', properties: { zone: { type: 'string', maxLength: 20 } }, required: ['zone'] },
  },
};
const ask = [{ role: 'user', content: 'What is the weather in Paris?' }];
const options = { maxTokens: 120, temperature: 0 };
let kinfer;
let dir;
let tooled; // the loaded model's name

/** A call as the spec promises it: an id, a tool's name, arguments an object holding its schema's required keys. */
function checkCall(call) {
  assert.equal(call.type, 'function');
  assert.ok(typeof call.id === 'string' && call.id.length > 0);
  const tool = [weather, time].find((t) => t.function.name === call.function.name);
  assert.ok(tool, `a call of a tool that was not offered: ${call.function.name}`);
  const args = call.function.arguments;
  assert.equal(typeof args, 'object');
  for (const key of tool.function.parameters.required) assert.ok(key in args, `${key} missing in ${JSON.stringify(args)}`);
  if (tool === weather) {
    assert.equal(typeof args.city, 'string');
    assert.ok(['c', 'f'].includes(args.unit));
    assert.deepEqual(Object.keys(args).sort(), ['city', 'unit']);
  }
}

before(async () => {
  dir = mkdtempSync(join(tmpdir(), 'kinfer-tools-'));
  const path = join(dir, 'tools.gguf');
  execFileSync(process.env.PYTHON ?? 'python', [MAKE_TOOL_MODEL, path], { stdio: 'inherit' });
  kinfer = await KinferClient.start({ env: { OMP_WAIT_POLICY: 'PASSIVE', ...process.env } });
  const loaded = await kinfer.load(path, { options: { contextLength: 1024, slots: 2, threads: 1 } });
  tooled = loaded.model;
}, { timeout: 240_000 });

after(async () => {
  if (kinfer) assert.equal(await kinfer.close(), 0);
  if (dir) rmSync(dir, { recursive: true, force: true });
}, { timeout: 60_000 });

test('a required call comes back parsed, with its arguments an object of its schema', { timeout: 120_000 }, async () => {
  const reply = await kinfer.chat(ask, { model: tooled, tools: [weather, time], toolChoice: 'required', options });
  assert.equal(reply.stopReason, 'toolCalls');
  assert.ok(reply.toolCalls.length > 0);
  reply.toolCalls.forEach(checkCall);
});

test('a named tool is the one called, and a streamed chat collects the same calls', { timeout: 120_000 }, async () => {
  const opts = { model: tooled, tools: [weather, time], toolChoice: 'get_weather', options };
  const reply = await kinfer.chat(ask, opts);
  assert.ok(reply.toolCalls.every((c) => c.function.name === 'get_weather'));
  reply.toolCalls.forEach(checkCall);
  const stream = kinfer.streamChat(ask, opts);
  let text = '';
  for await (const piece of stream) text += piece;
  const streamed = await stream.result;
  // The pieces are the raw reply, call markup included; the final text is what is left without it.
  assert.ok(text.includes('</tool_call>') && text.length > streamed.text.length);
  assert.equal(streamed.text, reply.text);
  assert.deepEqual(stream.toolCalls, streamed.toolCalls);
  assert.deepEqual(streamed.toolCalls.map((c) => c.function), reply.toolCalls.map((c) => c.function));
});

test('a tool result fed back continues the conversation', { timeout: 120_000 }, async () => {
  const reply = await kinfer.chat(ask, { model: tooled, tools: [weather], toolChoice: 'required', options });
  const [call] = reply.toolCalls;
  const messages = [
    ...ask,
    { role: 'assistant', content: reply.text, toolCalls: reply.toolCalls },
    { role: 'tool', toolCallId: call.id, name: call.function.name, content: JSON.stringify({ sky: 'sunny', temperature: 18 }) },
  ];
  const next = await kinfer.chat(messages, { model: tooled, tools: [weather], options: { maxTokens: 30, temperature: 0 } });
  assert.ok(['stop', 'length', 'toolCalls'].includes(next.stopReason));
  assert.ok(next.tokens.length > 0);
});

test('a tool choice naming no offered tool is -32602 listing the tools', { timeout: 120_000 }, async () => {
  await assert.rejects(
    kinfer.chat(ask, { model: tooled, tools: [weather], toolChoice: 'get_time', options }),
    (err) => err instanceof ResponseError && err.code === -32602 && err.data.available.includes('get_weather'),
  );
});
