import type { CancellationToken, MessageConnection } from 'vscode-jsonrpc';
import { CancellationTokenSource, ResponseError } from 'vscode-jsonrpc';
import type { ChildProcess } from 'node:child_process';

export { CancellationTokenSource, ResponseError };
export declare const REQUEST_CANCELLED: -32800;

/** A tool call the model made (`arguments` is a JSON object, not a string as in OpenAI's API). */
export interface ToolCall {
  id: string;
  type: 'function';
  function: { name: string; arguments: Record<string, unknown> };
}
/** A tool the model may call (OpenAI's shape); `parameters` is a JSON schema. */
export interface Tool {
  type: 'function';
  function: { name: string; description?: string; parameters?: Record<string, unknown> };
}
/** 'auto' (the default with tools), 'none', 'required', a function's name, or OpenAI's object form. */
export type ToolChoice = 'auto' | 'none' | 'required' | (string & {}) | { type: 'function'; function: { name: string } };
export interface ChatMessage {
  role: string; // 'system' | 'user' | 'assistant' | 'tool' | ...
  content?: string; // required but for an assistant message with toolCalls
  toolCalls?: ToolCall[]; // an assistant message's calls, as a result gave them
  toolCallId?: string; // a 'tool' message: the id of the call it answers
  name?: string; // a 'tool' message: the function's name
  reasoning?: string; // an assistant message's reasoning, as a result gave it (the template keeps or drops it)
  /** Images the message shows, before its content: base64 of an image file, a data: URL, or an
   *  absolute path on the server's machine; for a model loaded with a vision projector
   *  (load's `options.projector`), else -31006. */
  images?: string[];
}
export interface TopLogprob { token: number; text: string; logprob: number }
/** A generated token's natural log probability, from the raw logits (before sampling and any grammar). */
export interface TokenLogprob extends TopLogprob {
  /** The `topLogprobs` most likely tokens of the position, best first. */
  topLogprobs: TopLogprob[];
}
/** Request options (GenerateOptions in spec/specification.md), camelCase. */
export interface GenerateOptions {
  maxTokens?: number;
  stop?: string | string[];
  temperature?: number;
  topK?: number;
  topP?: number;
  minP?: number;
  repeatPenalty?: number;
  repeatLastN?: number;
  seed?: number;
  drafts?: number;
  draftPolicy?: string;
  ignoreEos?: boolean;
  /** Hold the reply to a JSON schema, or to any JSON object ('json'); named as Ollama names it. */
  format?: Record<string, unknown> | 'json';
  /** Hold the reply to a grammar in llguidance's Lark-like syntax. */
  grammar?: string;
  /** Hold the reply to a regular expression (the whole reply matches). */
  regex?: string;
  /** Return each generated token's log probability (`logprobs` in the result and partial results). */
  logprobs?: boolean;
  /** 0..20: and this many most likely tokens of each position; needs `logprobs: true`. */
  topLogprobs?: number;
  /** A thinking model (chat): the most tokens its reasoning takes before its end is forced. */
  maxReasoningTokens?: number;
  /** Reuse cached chunks of at least this many tokens that moved, by shifting KV cells (0: never); gives up the same reply. */
  cacheReuse?: number;
  [option: string]: unknown;
}
/** inference/infill's options: generate's, and `stopAtLine`. */
export interface InfillOptions extends GenerateOptions {
  /** End the reply at the first line break after non-blank text (a line completion). */
  stopAtLine?: boolean;
}
/** One `$/progress` value of a streamed reply. */
export interface PartialResult {
  text: string;
  tokens: number[];
  reasoning?: string; // a thinking model's new reasoning (`text` is then the answer's alone)
  logprobs?: TokenLogprob[]; // with options.logprobs
  toolCalls?: ToolCall[]; // with tools: the calls completed since the previous value
}
export interface InferenceResult {
  model: string;
  text: string;
  tokens: number[];
  /** 'stop' | 'length' | 'toolCalls' (the model called tools) | 'cancelled' (in a -32800's data) */
  stopReason: string;
  seed: number;
  /** draftTokens / draftAccepted: drafted tokens and those kept; cachedTokens: prompt tokens whose cells came from the prefix pool. */
  usage: {
    promptTokens: number;
    completionTokens: number;
    draftTokens: number;
    draftAccepted: number;
    cachedTokens: number;
    /** Of completionTokens, those of a thinking model's reasoning (its end included). */
    reasoningTokens: number;
  };
  timings: { queueMs: number; promptMs: number; generateMs: number; tokensPerSecond: number };
  /** A thinking model's reasoning, apart from `text` (present when the reply began in a reasoning block). */
  reasoning?: string;
  /** With options.logprobs: one entry per token. */
  logprobs?: TokenLogprob[];
  /** Chat with tools: the calls the model made (absent when none). */
  toolCalls?: ToolCall[];
  /** inference/infill (and generate with a suffix): characters left out of a short context, from
   * the prefix's start, the suffix's end, the extra context's start and the middle's start (with a middle). */
  dropped?: { prefix: number; suffix: number; extra: number; middle?: number };
}
export interface WorkDoneProgress { kind: 'begin' | 'report' | 'end'; title?: string; message?: string; percentage?: number }
export interface CallOptions {
  model?: string;
  /** GenerateOptions, camelCase: maxTokens, temperature, topK, topP, minP, seed, stop, ignoreEos, format, logprobs, ... */
  options?: GenerateOptions;
  /** Each streamed value; with logprobs or tools also values whose `text` is empty. */
  onPiece?: (text: string, value: PartialResult) => void;
  token?: CancellationToken;
}
export interface ChatCallOptions extends CallOptions {
  /** Functions the model may call; sent beside `options`. */
  tools?: Tool[];
  toolChoice?: ToolChoice;
  /** A thinking model: whether it reasons first, or how much; default: as its template does. */
  think?: boolean | 'low' | 'medium' | 'high';
  /** A stream's reasoning pieces, as they come (the iterator gives the answer's). */
  onReasoning?: (text: string) => void;
}
export interface GenerateCallOptions extends CallOptions {
  /** Ollama's suffix: the prompt is the text before a gap, this the text after it (an infill). */
  suffix?: string;
}
export interface InfillParams extends CallOptions {
  /** The text before the gap (the cursor). */
  prefix: string;
  /** The text after the gap; default ''. */
  suffix?: string;
  /** The gap's start already written (the current line before the cursor): after the FIM middle token. */
  middle?: string;
  /** Other files as context (at most 1024); a file without a name is 'tmp'. */
  extra?: Array<{ filename?: string; text: string }>;
  options?: InfillOptions;
}
export interface EmbedOptions {
  model?: string;
  normalize?: boolean;
  truncate?: boolean;
  dimensions?: number;
  token?: CancellationToken;
}
export interface EmbedResult { model: string; embeddings: number[][]; usage: { promptTokens: number } }
export interface RerankOptions { model?: string; topN?: number; returnDocuments?: boolean; token?: CancellationToken }
export interface RerankedDocument { index: number; relevanceScore: number; document?: string }
export interface RerankResult { model: string; results: RerankedDocument[]; usage: { promptTokens: number } }
export interface StartOptions {
  command?: string;
  args?: string[];
  env?: NodeJS.ProcessEnv;
  cwd?: string;
  initializationOptions?: Record<string, unknown>;
  stderr?: 'inherit' | 'ignore' | 'pipe';
}
export interface Stream extends AsyncIterableIterator<string> {
  /** The final result; rejects with a ResponseError (code -32800 when cancelled). */
  result: Promise<InferenceResult>;
  /** The tool calls streamed so far (chat with tools). */
  readonly toolCalls: ToolCall[];
  /** The logprobs streamed so far (with options.logprobs). */
  readonly logprobs: TokenLogprob[];
  /** A thinking model's reasoning streamed so far (the pieces are the answer's). */
  readonly reasoning: string;
  cancel(): void;
}

export declare class KinferClient {
  static start(opts?: StartOptions): Promise<KinferClient>;
  readonly process: ChildProcess;
  readonly connection: MessageConnection;
  serverInfo: any;
  readonly capabilities: Record<string, any>;
  request<R = any>(method: string, params?: unknown, token?: CancellationToken): Promise<R>;
  notify(method: string, params?: unknown): Promise<void>;
  models(): Promise<Array<{ name: string; source: string; format: string; path: string; sizeBytes: number; loaded: boolean }>>;
  load(model?: string, opts?: { options?: Record<string, unknown>; backend?: string; onProgress?: (v: WorkDoneProgress) => void; token?: CancellationToken }): Promise<any>;
  status(model?: string): Promise<any[]>;
  /** inference/embed: one vector per input, with an embedding model. */
  embed(input: string | string[], opts?: EmbedOptions): Promise<EmbedResult>;
  /** inference/rerank: the documents by their relevance to the query, best first, with a reranker. */
  rerank(query: string, documents: string[], opts?: RerankOptions): Promise<RerankResult>;
  generate(prompt: string, opts?: GenerateCallOptions): Promise<InferenceResult>;
  /** inference/infill: fill the gap between prefix and suffix (a model with FIM tokens, else -32602). */
  infill(params: InfillParams): Promise<InferenceResult>;
  chat(messages: ChatMessage[], opts?: ChatCallOptions): Promise<InferenceResult>;
  streamGenerate(prompt: string, opts?: GenerateCallOptions): Stream;
  streamInfill(params: InfillParams): Stream;
  streamChat(messages: ChatMessage[], opts?: ChatCallOptions): Stream;
  /** shutdown + exit; resolves with the exit code (0 when clean). */
  close(timeoutMs?: number): Promise<number | string | null>;
}
