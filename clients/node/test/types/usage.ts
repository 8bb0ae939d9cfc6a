// Compiled by `npm test` (tsc --noEmit -p test/types): the declarations in index.d.ts take the
// calls the README and the tests make, and refuse what the protocol does not have. Not run.
import { CancellationTokenSource, ErrorCodes, KinferClient, REQUEST_CANCELLED, ResponseError } from '../../index.js';
import type { ChatMessage, InferenceResult, PartialResult, Stream, Tool, ToolCall, TokenLogprob } from '../../index.js';

const weather: Tool = {
  type: 'function',
  function: { name: 'get_weather', description: 'The weather now.', parameters: { type: 'object' } },
};

export async function agent(): Promise<number | string | null> {
  const kinfer = await KinferClient.start({ env: process.env, stderr: 'ignore' });
  const loaded = await kinfer.load(undefined, { options: { threads: 1 }, onProgress: (v) => v.percentage });
  const messages: ChatMessage[] = [{ role: 'user', content: 'What is the weather in Paris?' }];
  const reply: InferenceResult = await kinfer.chat(messages, {
    model: loaded.model,
    tools: [weather],
    toolChoice: 'auto', // (required or a name cannot go with a format: the server refuses that)
    options: { maxTokens: 60, temperature: 0, logprobs: true, topLogprobs: 3, format: 'json' },
    onPiece: (text: string, value: PartialResult) => value.toolCalls?.length ?? text.length,
  });
  const calls: ToolCall[] = reply.toolCalls ?? [];
  messages.push({ role: 'assistant', content: reply.text, toolCalls: calls });
  for (const call of calls) {
    const city: unknown = call.function.arguments.city;
    messages.push({ role: 'tool', toolCallId: call.id, name: call.function.name, content: JSON.stringify({ city }) });
  }
  const first: TokenLogprob | undefined = reply.logprobs?.[0];
  const best: number = first ? first.topLogprobs[0].logprob : 0;
  const used: number = reply.usage.completionTokens + reply.usage.cachedTokens + reply.usage.draftAccepted + best;
  const named = await kinfer.chat(messages, { tools: [weather], toolChoice: { type: 'function', function: { name: 'get_weather' } } });
  const stream: Stream = kinfer.streamChat(messages, { tools: [weather] });
  for await (const piece of stream) void piece.length;
  void (await stream.result).stopReason, stream.toolCalls.length, named.timings.tokensPerSecond, used;
  const gap = await kinfer.infill({ prefix: 'def f():\n    ', suffix: '\n', options: { stopAtLine: true } });
  void gap.dropped?.prefix;
  const source = new CancellationTokenSource();
  try {
    await kinfer.generate('Hi', { token: source.token, options: { maxTokens: 1, grammar: 'start: "a"', regex: undefined } });
  } catch (err) {
    if (err instanceof ResponseError && err.code === REQUEST_CANCELLED) return null;
  }
  // @ts-expect-error a format is a schema object or 'json', nothing else
  await kinfer.generate('Hi', { options: { format: 'yaml' } });
  // @ts-expect-error a tool's type is 'function'
  await kinfer.chat(messages, { tools: [{ type: 'retrieval', function: { name: 'x' } }] });
  return kinfer.close();
}

// embed and rerank: typed results
export async function embedding(kinfer: KinferClient): Promise<number> {
  const out = await kinfer.embed(['a', 'b'], { model: 'minilm', dimensions: 128 });
  const ranked = await kinfer.rerank('q', ['d'], { topN: 1, returnDocuments: true });
  const first: string | undefined = ranked.results[0].document;
  return out.embeddings[0][0] + out.usage.promptTokens + ranked.results[0].relevanceScore + (first ? 1 : 0);
}

// a thinking model: think beside the options, the reasoning apart in the result and the stream
export async function thinking(kinfer: KinferClient): Promise<string> {
  const messages: ChatMessage[] = [{ role: 'user', content: 'Why?' }];
  const reply = await kinfer.chat(messages, { think: 'high', options: { maxReasoningTokens: 64, format: 'json' } });
  messages.push({ role: 'assistant', content: reply.text, reasoning: reply.reasoning });
  const stream = kinfer.streamChat(messages, { think: false, onReasoning: (text: string) => text.length });
  for await (const piece of stream) void piece.length;
  const tokens: number = reply.usage.reasoningTokens;
  // @ts-expect-error think is a boolean or a level
  await kinfer.chat(messages, { think: 'max' });
  return stream.reasoning + (reply.reasoning ?? '') + tokens;
}

// The error codes by name, generated from the meta model: a code the protocol has, typed as itself.
export const cancelled: -32800 = ErrorCodes.RequestCancelled;
export const notFound: -31001 = ErrorCodes.ModelNotFound;
