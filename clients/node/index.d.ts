import type { CancellationToken, MessageConnection } from 'vscode-jsonrpc';
import { CancellationTokenSource, ResponseError } from 'vscode-jsonrpc';
import type { ChildProcess } from 'node:child_process';

export { CancellationTokenSource, ResponseError };
export declare const REQUEST_CANCELLED: -32800;

// The protocol's own types (ChatMessage, Tool, ToolCall, GenerateOptions, InfillOptions,
// InferenceResult, TokenLogprob, EmbedResult, RerankResult, ...) and ErrorCodes: generated from
// spec/metaModel.json into protocol.d.ts and protocol.js.
export * from './protocol.js';
import type {
  ChatMessage,
  EmbedResult,
  GenerateOptions,
  InferencePartialResult,
  InferenceResult,
  InfillOptions,
  RerankResult,
  TokenLogprob,
  Tool,
  ToolCall,
} from './protocol.js';

/** 'auto' (the default with tools), 'none', 'required', a function's name, or OpenAI's object form. */
export type ToolChoice = 'auto' | 'none' | 'required' | (string & {}) | { type: 'function'; function: { name: string } };
/** One `$/progress` value of a streamed reply. */
export type PartialResult = InferencePartialResult;
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
export interface RerankOptions { model?: string; topN?: number; returnDocuments?: boolean; token?: CancellationToken }
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
