// Spawns a real `kinfer-rpc` ($KINFER_RPC or PATH) with the embedded model: streams a chat,
// cancels one, and shuts down cleanly. Run with `npm test` (node --test).
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import { CancellationTokenSource, KinferClient, REQUEST_CANCELLED, ResponseError } from '../index.js';

const messages = [{ role: 'user', content: 'Name a colour.' }];
let kinfer;

before(async () => {
  kinfer = await KinferClient.start({ env: { OMP_WAIT_POLICY: 'PASSIVE', ...process.env } });
  const progress = [];
  const loaded = await kinfer.load(undefined, { options: { threads: 1 }, onProgress: (v) => progress.push(v) });
  assert.equal(loaded.model, 'smollm2-135m-instruct');
  assert.equal(progress[0].kind, 'begin');
  assert.equal(progress.at(-1).kind, 'end');
});

after(async () => {
  if (kinfer) assert.equal(await kinfer.close(), 0);
});

test('initialize reports the server and its capabilities', () => {
  assert.equal(kinfer.serverInfo.serverInfo.name, 'kinfer-rpc');
  assert.ok(kinfer.capabilities.methods.includes('inference/chat'));
  assert.equal(kinfer.capabilities.cancellation, true);
});

test('a streamed chat concatenates to the final text', async () => {
  const options = { maxTokens: 12, temperature: 0 };
  const blocking = await kinfer.chat(messages, { options });
  assert.ok(blocking.text.length > 0);
  assert.equal(blocking.usage.completionTokens, blocking.tokens.length);

  const pieces = [];
  const streamed = await kinfer.chat(messages, { options, onPiece: (text) => pieces.push(text) });
  assert.ok(pieces.length > 1);
  assert.equal(pieces.join(''), streamed.text);
  assert.equal(streamed.text, blocking.text);

  const stream = kinfer.streamChat(messages, { options });
  let text = '';
  for await (const piece of stream) text += piece;
  assert.equal(text, (await stream.result).text);
  assert.equal(text, blocking.text);
});

test('a CancellationTokenSource cancels a request: -32800 with the partial result', async () => {
  const source = new CancellationTokenSource();
  let pieces = 0;
  const call = kinfer.generate('Once upon a time', {
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
  // the server goes on serving
  const next = await kinfer.generate('Hello', { options: { maxTokens: 2, temperature: 0 } });
  assert.equal(next.usage.completionTokens, 2);
});

test('breaking out of a stream cancels it', async () => {
  const stream = kinfer.streamGenerate('Once upon a time', { options: { maxTokens: 2000, ignoreEos: true } });
  let n = 0;
  for await (const _piece of stream) {
    if (++n === 2) break;
  }
  await assert.rejects(stream.result, (error) => error.code === REQUEST_CANCELLED);
});

test('format holds a reply to a JSON schema; logprobs come one per token', async () => {
  const schema = {
    type: 'object',
    properties: { colour: { type: 'string', maxLength: 20 } },
    required: ['colour'],
    additionalProperties: false,
  };
  const reply = await kinfer.chat(messages, { options: { format: schema, maxTokens: 40, temperature: 0 } });
  assert.equal(reply.stopReason, 'stop');
  assert.deepEqual(Object.keys(JSON.parse(reply.text)), ['colour']);

  const stream = kinfer.streamGenerate('The capital of France is', {
    options: { maxTokens: 5, temperature: 0, logprobs: true, topLogprobs: 2 },
  });
  for await (const _piece of stream) { /* read it all */ }
  const result = await stream.result;
  assert.deepEqual(result.logprobs.map((t) => t.token), result.tokens);
  assert.deepEqual(stream.logprobs, result.logprobs);
  assert.ok(result.logprobs.every((t) => t.logprob <= 0 && t.topLogprobs.length === 2));
});

test('tools go beside the options (the default model has no tools: -32602)', async () => {
  const tool = { type: 'function', function: { name: 'get_weather', parameters: { type: 'object' } } };
  await assert.rejects(
    kinfer.chat(messages, { tools: [tool], toolChoice: 'auto', options: { maxTokens: 4 } }),
    (error) => error.code === -32602 && /does not support tools/.test(error.message),
  );
});
