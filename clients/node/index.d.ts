import type { CancellationToken, MessageConnection } from 'vscode-jsonrpc';
import { CancellationTokenSource, ResponseError } from 'vscode-jsonrpc';
import type { ChildProcess } from 'node:child_process';

export { CancellationTokenSource, ResponseError };
export declare const REQUEST_CANCELLED: -32800;

export interface ChatMessage { role: string; content: string }
export interface InferenceResult {
  model: string;
  text: string;
  tokens: number[];
  stopReason: string;
  seed: number;
  usage: { promptTokens: number; completionTokens: number };
  timings: { queueMs: number; promptMs: number; generateMs: number; tokensPerSecond: number };
}
export interface WorkDoneProgress { kind: 'begin' | 'report' | 'end'; title?: string; message?: string; percentage?: number }
export interface CallOptions {
  model?: string;
  /** GenerateOptions, camelCase: maxTokens, temperature, topK, topP, minP, seed, stop, ignoreEos, ... */
  options?: Record<string, unknown>;
  onPiece?: (text: string, value: { text: string; tokens: number[] }) => void;
  token?: CancellationToken;
}
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
  generate(prompt: string, opts?: CallOptions): Promise<InferenceResult>;
  chat(messages: ChatMessage[], opts?: CallOptions): Promise<InferenceResult>;
  streamGenerate(prompt: string, opts?: CallOptions): Stream;
  streamChat(messages: ChatMessage[], opts?: CallOptions): Stream;
  /** shutdown + exit; resolves with the exit code (0 when clean). */
  close(timeoutMs?: number): Promise<number | string | null>;
}
