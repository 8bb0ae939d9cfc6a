// inference/infill (and generate's suffix) against a real `kinfer-rpc` ($KINFER_RPC or PATH), on a
// copy of the embedded model with fill-in-the-middle tokens made by tests/modelgen/make_fim_model.py
// with `python` from PATH ($PYTHON): the one kinfer-rpc is installed in.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, before, test } from 'node:test';

import { CancellationTokenSource, KinferClient, REQUEST_CANCELLED, ResponseError } from '../index.js';

const MAKE_FIM_MODEL = fileURLToPath(new URL('../../../tests/modelgen/make_fim_model.py', import.meta.url));
const prefix = 'def add(a, b):\n    return ';
const suffix = '\n\nprint(add(1, 2))\n';
const extra = [{ filename: 'util.py', text: 'def sub(a, b):\n    return a - b\n' }];
const options = { maxTokens: 12, temperature: 0 };
let kinfer;
let dir;
let fim; // the loaded FIM model's name

before(async () => {
  dir = mkdtempSync(join(tmpdir(), 'kinfer-fim-'));
  const path = join(dir, 'fim.gguf');
  execFileSync(process.env.PYTHON ?? 'python', [MAKE_FIM_MODEL, path], { stdio: 'inherit' });
  kinfer = await KinferClient.start({ env: { OMP_WAIT_POLICY: 'PASSIVE', ...process.env } });
  const loaded = await kinfer.load(path, { options: { contextLength: 1024, slots: 2, batch: 256, threads: 1 } });
  fim = loaded.model;
});

after(async () => {
  if (kinfer) assert.equal(await kinfer.close(), 0);
  if (dir) rmSync(dir, { recursive: true, force: true });
});

test('infill sends prefix, suffix and extra and answers as the server does', async () => {
  assert.ok(kinfer.capabilities.methods.includes('inference/infill'));
  const reply = await kinfer.infill({ prefix, suffix, extra, model: fim, options });
  const raw = await kinfer.request('inference/infill', { model: fim, prefix, suffix, extra, options });
  assert.equal(reply.model, fim);
  assert.deepEqual(reply.tokens, raw.tokens);
  assert.equal(reply.text, raw.text);
  assert.ok(reply.tokens.length > 0 && reply.tokens.length <= 12);
  assert.deepEqual(reply.dropped, { prefix: 0, suffix: 0, extra: 0 });
  // generate with a suffix is the same infill (without extra)
  const a = await kinfer.infill({ prefix, suffix, options });
  const b = await kinfer.generate(prefix, { suffix, options });
  assert.deepEqual(b.tokens, a.tokens);
  assert.equal(b.text, a.text);
  assert.deepEqual(b.dropped, a.dropped);
  assert.ok(a.usage.promptTokens < reply.usage.promptTokens); // the extra context was in reply's prompt
});

test('a streamed infill concatenates to the final text', async () => {
  const blocking = await kinfer.infill({ prefix, suffix, extra, options });
  const pieces = [];
  const streamed = await kinfer.infill({ prefix, suffix, extra, options, onPiece: (text) => pieces.push(text) });
  assert.ok(pieces.length > 0);
  assert.equal(pieces.join(''), streamed.text);
  assert.deepEqual(streamed.tokens, blocking.tokens);

  const stream = kinfer.streamInfill({ prefix, suffix, extra, options });
  let text = '';
  for await (const piece of stream) text += piece;
  const result = await stream.result;
  assert.equal(text, result.text);
  assert.equal(text, blocking.text);
  assert.deepEqual(result.dropped, { prefix: 0, suffix: 0, extra: 0 });
});

test('stopAtLine ends at the first line break; a long prefix loses its start and says so', async () => {
  const line = await kinfer.infill({ prefix, suffix, options: { maxTokens: 24, temperature: 0, stopAtLine: true } });
  assert.equal(line.stopReason, 'stop');
  assert.ok(line.text.trim().length > 0 && !line.text.trimStart().includes('\n'), line.text);
  // the prefix keeps 3/4 of a 256-token batch
  const long = Array.from({ length: 300 }, (_, i) => `x${i} = ${i}\n`).join('') + prefix;
  const reply = await kinfer.infill({ prefix: long, suffix, options });
  assert.ok(reply.dropped.prefix > 0 && reply.dropped.prefix < long.length);
  assert.equal(reply.dropped.suffix, 0);
  assert.ok(reply.usage.promptTokens < 256);
});

test('a CancellationTokenSource cancels an infill: -32800 with the partial result', async () => {
  const source = new CancellationTokenSource();
  let pieces = 0;
  const call = kinfer.infill({
    prefix: 'Once upon a time',
    options: { maxTokens: 2000, ignoreEos: true },
    onPiece: () => {
      if (++pieces === 3) source.cancel();
    },
    token: source.token,
  });
  await assert.rejects(call, (error) => {
    assert.ok(error instanceof ResponseError);
    assert.equal(error.code, REQUEST_CANCELLED);
    assert.ok(error.data.tokens.length >= 3 && error.data.tokens.length < 2000);
    return true;
  });
});

test('a model without fill-in-the-middle tokens is -32602 with the tokens it has', async () => {
  await assert.rejects(
    kinfer.infill({ prefix, suffix, model: 'smollm2-135m-instruct', options: { maxTokens: 2 } }),
    (error) => {
      assert.equal(error.code, -32602);
      assert.match(error.message, /cannot fill in the middle/);
      assert.deepEqual(error.data, { field: 'model', fimTokens: { rep: 4 } });
      return true;
    },
  );
});
