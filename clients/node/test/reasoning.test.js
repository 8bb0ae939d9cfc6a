// A thinking model's reasoning against a real `kinfer-rpc` ($KINFER_RPC or PATH), on a copy of the
// embedded model with Qwen3's chat template and <think> tokens, made by
// tests/modelgen/make_think_model.py with `python` from PATH ($PYTHON).
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, before, test } from 'node:test';

import { KinferClient, ResponseError } from '../index.js';

const MAKE_THINK_MODEL = fileURLToPath(new URL('../../../tests/modelgen/make_think_model.py', import.meta.url));
const city = {
  type: 'object',
  properties: { name: { type: 'string', maxLength: 30 }, country: { type: 'string', maxLength: 30 } },
  required: ['name', 'country'],
  additionalProperties: false,
};
const ask = [{ role: 'user', content: 'Name a city in Europe, as JSON.' }];
let kinfer;
let dir;
let thinker; // the loaded model's name

before(async () => {
  dir = mkdtempSync(join(tmpdir(), 'kinfer-think-'));
  const path = join(dir, 'think.gguf');
  execFileSync(process.env.PYTHON ?? 'python', [MAKE_THINK_MODEL, path], { stdio: 'inherit' });
  kinfer = await KinferClient.start({ env: { OMP_WAIT_POLICY: 'PASSIVE', ...process.env } });
  thinker = (await kinfer.load(path, { options: { contextLength: 1024, slots: 2, threads: 1 } })).model;
}, { timeout: 240_000 });

after(async () => {
  if (kinfer) assert.equal(await kinfer.close(), 0);
  if (dir) rmSync(dir, { recursive: true, force: true });
}, { timeout: 60_000 });

test('reasoning comes apart from a JSON answer, whole and streamed', { timeout: 120_000 }, async () => {
  const opts = { model: thinker, think: true, options: { format: city, maxReasoningTokens: 12, temperature: 0 } };
  const reply = await kinfer.chat(ask, opts);
  assert.ok(reply.reasoning.length > 0 && !reply.reasoning.includes('</think>'));
  assert.ok(reply.usage.reasoningTokens >= 1 && reply.usage.reasoningTokens <= 13);
  const parsed = JSON.parse(reply.text);
  assert.equal(typeof parsed.name, 'string');
  const thoughts = [];
  const stream = kinfer.streamChat(ask, { ...opts, onReasoning: (text) => thoughts.push(text) });
  let text = '';
  for await (const piece of stream) text += piece;
  const streamed = await stream.result;
  assert.equal(text, reply.text);
  assert.equal(stream.reasoning, reply.reasoning);
  assert.equal(thoughts.join(''), reply.reasoning);
  assert.equal(streamed.reasoning, reply.reasoning);
});

test('think: false gives no reasoning; the reasoning goes back in the history', { timeout: 120_000 }, async () => {
  const off = await kinfer.chat(ask, { model: thinker, think: false, options: { maxTokens: 6, temperature: 0 } });
  assert.equal(off.reasoning, undefined);
  assert.equal(off.usage.reasoningTokens, 0);
  const history = [...ask, { role: 'assistant', content: '{}', reasoning: 'Paris is in France.' }, { role: 'user', content: 'More?' }];
  const next = await kinfer.chat(history, { model: thinker, think: 'low', options: { maxReasoningTokens: 2, maxTokens: 8 } });
  assert.ok(typeof next.reasoning === 'string');
});

test('think on a model that cannot think is -32602 naming the field', { timeout: 120_000 }, async () => {
  await assert.rejects(
    kinfer.chat(ask, { model: 'smollm2-135m-instruct', think: true, options: { maxTokens: 2 } }),
    (err) => err instanceof ResponseError && err.code === -32602 && err.data.field === 'think',
  );
});
