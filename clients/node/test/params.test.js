// The params the client sends and the partial results it collects, against a stand-in connection
// (no server): tools and toolChoice beside the options, options as given, streamed tool calls.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { ErrorCodes, KinferClient, REQUEST_CANCELLED } from '../index.js';

const messages = [{ role: 'user', content: 'Weather in Paris?' }];
const weather = {
  type: 'function',
  function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } },
};
const call = { id: 'call_0', type: 'function', function: { name: 'get_weather', arguments: { city: 'Paris' } } };
const logprob = { token: 7, text: 'x', logprob: -0.5, topLogprobs: [] };
const result = { model: 'm', text: '', tokens: [7], stopReason: 'toolCalls', seed: 1, toolCalls: [call], logprobs: [logprob] };

/** A KinferClient on a connection that records requests and streams `partials` before answering. */
function recording(partials = []) {
  const sent = [];
  const handlers = new Map();
  const connection = {
    sendRequest(method, params) {
      sent.push({ method, params });
      const handler = handlers.get(params?.partialResultToken);
      for (const value of partials) handler?.(value);
      return Promise.resolve(result);
    },
    onProgress(_type, token, handler) {
      handlers.set(token, handler);
      return { dispose: () => handlers.delete(token) };
    },
  };
  return { kinfer: new KinferClient({}, connection, Promise.resolve(0)), sent };
}

test('tools and toolChoice go beside the options', async () => {
  const { kinfer, sent } = recording();
  const options = { maxTokens: 8, format: { type: 'object' }, logprobs: true, topLogprobs: 2 };
  const reply = await kinfer.chat(messages, { tools: [weather], toolChoice: 'required', options });
  assert.deepEqual(reply.toolCalls, [call]);
  assert.deepEqual(sent.at(-1), {
    method: 'inference/chat',
    params: { messages, tools: [weather], toolChoice: 'required', options },
  });
  const named = { type: 'function', function: { name: 'get_weather' } };
  await kinfer.chat(messages, { model: 'm', tools: [weather], toolChoice: named });
  assert.deepEqual(sent.at(-1).params, { messages, tools: [weather], toolChoice: named, model: 'm' });
  await kinfer.chat(messages);
  assert.deepEqual(sent.at(-1).params, { messages });
  await kinfer.generate('x', { options: { regex: '[0-9]+', logprobs: true } });
  assert.deepEqual(sent.at(-1).params, { prompt: 'x', options: { regex: '[0-9]+', logprobs: true } });
});

test('streams collect tool calls and logprobs; onPiece sees values without text', async () => {
  const partials = [
    { text: 'Hi', tokens: [1], logprobs: [logprob] },
    { text: '', tokens: [2], logprobs: [logprob], toolCalls: [call] },
  ];
  let { kinfer, sent } = recording(partials);
  const stream = kinfer.streamChat(messages, { tools: [weather], options: { logprobs: true } });
  const pieces = [];
  for await (const piece of stream) pieces.push(piece);
  assert.deepEqual(pieces, ['Hi']);
  assert.deepEqual(stream.toolCalls, [call]);
  assert.equal(stream.logprobs.length, 2);
  assert.deepEqual(sent.at(-1).params.tools, [weather]);
  assert.ok(sent.at(-1).params.partialResultToken);

  ({ kinfer } = recording(partials));
  const values = [];
  await kinfer.chat(messages, { tools: [weather], onPiece: (text, value) => values.push([text, value.toolCalls]) });
  assert.deepEqual(values, [['Hi', undefined], ['', [call]]]);
});

test('infill sends prefix, suffix and extra beside the options; generate takes a suffix', async () => {
  const { kinfer, sent } = recording();
  const extra = [{ filename: 'util.py', text: 'x = 1\n' }];
  await kinfer.infill({ prefix: 'a', suffix: 'b', extra, model: 'm', options: { stopAtLine: true } });
  assert.deepEqual(sent.at(-1), {
    method: 'inference/infill',
    params: { prefix: 'a', suffix: 'b', extra, model: 'm', options: { stopAtLine: true } },
  });
  await kinfer.infill({ prefix: 'a' });
  assert.deepEqual(sent.at(-1).params, { prefix: 'a' });
  const stream = kinfer.streamInfill({ prefix: 'a', suffix: '' });
  for await (const _piece of stream) { /* no pieces */ }
  assert.equal(sent.at(-1).method, 'inference/infill');
  assert.equal(sent.at(-1).params.suffix, '');
  assert.ok(sent.at(-1).params.partialResultToken);
  await kinfer.generate('a', { suffix: 'b', options: { maxTokens: 3 } });
  assert.deepEqual(sent.at(-1).params, { prompt: 'a', suffix: 'b', options: { maxTokens: 3 } });
  await kinfer.streamGenerate('a', { suffix: 'b' }).result;
  assert.deepEqual(sent.at(-1).params.suffix, 'b');
});

test('embed and rerank send their params as given, and leave out what is not set', async () => {
  const { kinfer, sent } = recording();
  await kinfer.embed(['a', 'b'], { model: 'm', dimensions: 128, normalize: undefined });
  await kinfer.rerank('q', ['d1', 'd2'], { topN: 1, returnDocuments: true });
  assert.deepEqual(sent, [
    { method: 'inference/embed', params: { input: ['a', 'b'], model: 'm', dimensions: 128 } },
    { method: 'inference/rerank', params: { query: 'q', documents: ['d1', 'd2'], topN: 1, returnDocuments: true } },
  ]);
});

test('the error codes by name come from the meta model', () => {
  assert.equal(ErrorCodes.RequestCancelled, REQUEST_CANCELLED);
  assert.equal(ErrorCodes.InvalidParams, -32602);
  assert.ok(Object.isFrozen(ErrorCodes));
});
