// A small Node client for kinfer-rpc on vscode-jsonrpc (the library VS Code's language clients use).
//
//   import { KinferClient } from 'kinfer-rpc-client';
//   const kinfer = await KinferClient.start();
//   const reply = await kinfer.chat([{ role: 'user', content: 'Hi' }], { options: { maxTokens: 50 } });
//   for await (const piece of kinfer.streamChat([{ role: 'user', content: 'Hi' }])) process.stdout.write(piece);
//   await kinfer.close();
//
// Agents: `chat(messages, { tools, toolChoice })` offers tools (sent beside `options`); the result's
// `toolCalls` are the calls the model made. `options.format` (a JSON schema or 'json'), `grammar`
// and `regex` hold the reply to a shape; `options.logprobs` adds each token's log probability.
//
// Code completion: `infill({ prefix, suffix, extra })` fills the gap between the text before and
// after a cursor, with a model that has fill-in-the-middle tokens (else -32602); `options.stopAtLine`
// completes one line, and the result's `dropped` says what did not fit the context.
//
// Cancel with a CancellationTokenSource (`{ token }`) or by breaking out of a stream: vscode-jsonrpc
// sends `$/cancelRequest` and the call rejects with a ResponseError whose code is -32800.

import { spawn } from 'node:child_process';
import rpc from 'vscode-jsonrpc/node.js';

const {
  CancellationTokenSource,
  ProgressType,
  ResponseError,
  StreamMessageReader,
  StreamMessageWriter,
  createMessageConnection,
} = rpc;

export { CancellationTokenSource, ResponseError };

/** The error code of a cancelled request (LSP's RequestCancelled). */
export { ErrorCodes } from './protocol.js';
export const REQUEST_CANCELLED = -32800;

/** inference/chat's params: the messages, and the tools and `think` beside the options. */
function chatFields(messages, { tools, toolChoice, think } = {}) {
  return {
    messages,
    ...(tools ? { tools } : {}),
    ...(toolChoice != null ? { toolChoice } : {}),
    ...(think != null ? { think } : {}),
  };
}

/** inference/generate's params: the prompt, and Ollama's `suffix` when given. */
function generateFields(prompt, { suffix } = {}) {
  return { prompt, ...(suffix != null ? { suffix } : {}) };
}

/** inference/infill's params: prefix, suffix, middle and extra (everything else is a call option). */
function infillFields({ prefix, suffix, middle, extra } = {}) {
  return {
    prefix,
    ...(suffix != null ? { suffix } : {}),
    ...(middle != null ? { middle } : {}),
    ...(extra ? { extra } : {}),
  };
}

const progressType = new ProgressType();
let tokens = 0;

/**
 * @typedef {{ role: string, content?: string, toolCalls?: ToolCall[], toolCallId?: string, name?: string,
 *             reasoning?: string }} ChatMessage
 * @typedef {{ id: string, type: 'function', function: { name: string, arguments: Record<string, unknown> } }} ToolCall
 * @typedef {{ token: number, text: string, logprob: number,
 *             topLogprobs: Array<{ token: number, text: string, logprob: number }> }} TokenLogprob
 * @typedef {{ text: string, tokens: number[], stopReason: string, seed: number,
 *             usage: { promptTokens: number, completionTokens: number, draftTokens: number,
 *                      draftAccepted: number, cachedTokens: number, reasoningTokens: number },
 *             timings: { queueMs: number, promptMs: number, generateMs: number, tokensPerSecond: number },
 *             model: string, reasoning?: string, logprobs?: TokenLogprob[], toolCalls?: ToolCall[],
 *             dropped?: { prefix: number, suffix: number, extra: number } }} InferenceResult
 * @typedef {{ text: string, tokens: number[], reasoning?: string, logprobs?: TokenLogprob[],
 *             toolCalls?: ToolCall[] }} PartialResult
 * @typedef {{ model?: string, options?: Record<string, unknown>,
 *             onPiece?: (text: string, value: PartialResult) => void,
 *             token?: import('vscode-jsonrpc').CancellationToken }} CallOptions
 * @typedef {CallOptions & { tools?: Array<Record<string, unknown>>,
 *             toolChoice?: string | { type: 'function', function: { name: string } },
 *             think?: boolean | 'low' | 'medium' | 'high' }} ChatCallOptions
 * @typedef {CallOptions & { suffix?: string }} GenerateCallOptions
 * @typedef {CallOptions & { prefix: string, suffix?: string,
 *             extra?: Array<{ filename?: string, text: string }> }} InfillParams
 * @typedef {{ command?: string, args?: string[], env?: NodeJS.ProcessEnv, cwd?: string,
 *             initializationOptions?: Record<string, unknown>, stderr?: 'inherit' | 'ignore' | 'pipe' }} StartOptions
 */

export class KinferClient {
  /**
   * Spawn `kinfer-rpc` ($KINFER_RPC, or from PATH) and initialize it.
   * @param {StartOptions} [opts]
   * @returns {Promise<KinferClient>}
   */
  static async start(opts = {}) {
    const command = opts.command ?? process.env.KINFER_RPC ?? 'kinfer-rpc';
    const child = spawn(command, [...(opts.args ?? []), '--clientProcessId', String(process.pid)], {
      stdio: ['pipe', 'pipe', opts.stderr ?? 'inherit'],
      env: opts.env ?? process.env,
      cwd: opts.cwd,
      // A process group (a session) of its own: a terminal's Ctrl-C (SIGINT to the foreground
      // group) reaches this program, not the server. Not unref'd: the server is still this
      // process's child, and it exits when this process dies (its stdin closes).
      detached: process.platform !== 'win32',
    });
    const exited = new Promise((resolve) => child.once('exit', (code, signal) => resolve(code ?? signal)));
    await new Promise((resolve, reject) => {
      child.once('spawn', resolve);
      child.once('error', reject);
    });
    const connection = createMessageConnection(new StreamMessageReader(child.stdout), new StreamMessageWriter(child.stdin));
    connection.listen();
    const client = new KinferClient(child, connection, exited);
    try {
      client.serverInfo = await connection.sendRequest('initialize', {
        processId: process.pid,
        clientInfo: { name: 'kinfer-rpc-client (node)' },
        capabilities: {},
        initializationOptions: opts.initializationOptions ?? {},
      });
      await connection.sendNotification('initialized', {});
    } catch (error) {
      child.kill();
      connection.dispose();
      throw error;
    }
    return client;
  }

  /** @private */
  constructor(child, connection, exited) {
    /** The server process. */
    this.process = child;
    /** The vscode-jsonrpc MessageConnection, for anything this class does not wrap. */
    this.connection = connection;
    /** @type {any} the initialize result: serverInfo, protocolVersion, capabilities */
    this.serverInfo = undefined;
    this.exited = exited;
    this.closed = false;
  }

  get capabilities() {
    return this.serverInfo?.capabilities ?? {};
  }

  /** Any request: resolves with the result, rejects with a ResponseError. */
  request(method, params, token) {
    // (vscode-jsonrpc sends a lone undefined or null as `[null]`: leave params out instead)
    const args = [...(params == null ? [] : [params]), ...(token ? [token] : [])];
    return this.connection.sendRequest(method, ...args);
  }

  notify(method, params) {
    return params == null ? this.connection.sendNotification(method) : this.connection.sendNotification(method, params);
  }

  /** @returns {Promise<Array<{ name: string, source: string, format: string, path: string, sizeBytes: number, loaded: boolean }>>} */
  async models() {
    return (await this.request('model/list', {})).models;
  }

  /**
   * Load a model (the default without a name). `onProgress` gets the work-done values
   * ({ kind: 'begin' | 'report' | 'end', title?, message?, percentage? }).
   */
  async load(model, { options, backend, onProgress, token } = {}) {
    const params = { ...(model ? { model } : {}), ...(backend ? { backend } : {}), ...(options ? { options } : {}) };
    if (!onProgress) return this.request('model/load', params, token);
    const workDoneToken = `load-${++tokens}`;
    const handler = this.connection.onProgress(progressType, workDoneToken, onProgress);
    try {
      return await this.request('model/load', { ...params, workDoneToken }, token);
    } finally {
      handler.dispose();
    }
  }

  async status(model) {
    return (await this.request('model/status', model ? { model } : {})).models;
  }

  /**
   * inference/embed: one vector per input (a string is one input), with an embedding model.
   * @param {string | string[]} input
   * @param {{ model?: string, normalize?: boolean, truncate?: boolean, dimensions?: number, token?: CancellationToken }} [opts]
   * @returns {Promise<{ model: string, embeddings: number[][], usage: { promptTokens: number } }>}
   */
  embed(input, { token, ...fields } = {}) {
    return this.request('inference/embed', { input, ...defined(fields) }, token);
  }

  /**
   * inference/rerank: the documents by their relevance to the query, best first, with a reranker.
   * @param {string} query
   * @param {string[]} documents
   * @param {{ model?: string, topN?: number, returnDocuments?: boolean, token?: CancellationToken }} [opts]
   * @returns {Promise<{ model: string, results: Array<{ index: number, relevanceScore: number, document?: string }>, usage: { promptTokens: number } }>}
   */
  rerank(query, documents, { token, ...fields } = {}) {
    return this.request('inference/rerank', { query, documents, ...defined(fields) }, token);
  }

  /**
   * inference/generate. With `onPiece`, pieces are streamed to it as they come. With `suffix`
   * (Ollama's) the prompt is the text before a gap and the request is an infill of the two.
   * @param {string} prompt
   * @param {GenerateCallOptions} [opts]
   * @returns {Promise<InferenceResult>}
   */
  generate(prompt, opts = {}) {
    return this.#call('inference/generate', generateFields(prompt, opts), opts);
  }

  /**
   * inference/infill: fill the gap between `prefix` and `suffix` (code completion at a cursor),
   * with `extra` files as context, using the model's fill-in-the-middle tokens. `options` are
   * generate's and `stopAtLine`; with `onPiece`, pieces are streamed to it as they come. The
   * result's `dropped` counts the characters left out of a short context.
   * @param {InfillParams} params
   * @returns {Promise<InferenceResult>}
   */
  infill(params) {
    return this.#call('inference/infill', infillFields(params), params);
  }

  /**
   * inference/chat. With `onPiece`, pieces are streamed to it as they come. `tools`,
   * `toolChoice` and `think` (a thinking model: true, false, 'low', 'medium', 'high') go beside
   * `options`; the result's `toolCalls` are the calls the model made, its `reasoning` a thinking
   * model's reasoning (`text` is then the answer alone).
   * @param {ChatMessage[]} messages
   * @param {ChatCallOptions} [opts]
   * @returns {Promise<InferenceResult>}
   */
  chat(messages, opts = {}) {
    return this.#call('inference/chat', chatFields(messages, opts), opts);
  }

  /**
   * `for await (const piece of kinfer.streamChat(messages, opts))`. Breaking out of the loop
   * cancels the request; `.result` is the promise of the final result; `.cancel()` cancels;
   * `.toolCalls`, `.logprobs` and `.reasoning` collect what the partial results carried (the
   * pieces are the answer's text; a thinking model's reasoning goes to `.reasoning` and to
   * `onReasoning`, as it comes).
   * @param {ChatMessage[]} messages
   * @param {ChatCallOptions} [opts]
   */
  streamChat(messages, opts = {}) {
    return this.#stream('inference/chat', chatFields(messages, opts), opts);
  }

  /** @param {string} prompt @param {GenerateCallOptions} [opts] */
  streamGenerate(prompt, opts = {}) {
    return this.#stream('inference/generate', generateFields(prompt, opts), opts);
  }

  /**
   * `for await (const piece of kinfer.streamInfill({ prefix, suffix }))`, as streamChat. The
   * pieces are the reply as generated: a repeat of the suffix that the final text leaves out
   * may be among them.
   * @param {InfillParams} params
   */
  streamInfill(params) {
    return this.#stream('inference/infill', infillFields(params), params);
  }

  async #call(method, fields, { model, options, onPiece, token } = {}) {
    const params = { ...fields, ...(model ? { model } : {}), ...(options ? { options } : {}) };
    if (!onPiece) return this.request(method, params, token);
    const partialResultToken = `stream-${++tokens}`;
    const handler = this.connection.onProgress(progressType, partialResultToken, (value) => {
      if (value?.text || value?.reasoning || value?.toolCalls?.length || value?.logprobs?.length) {
        onPiece(value.text ?? '', value);
      }
    });
    try {
      return await this.request(method, { ...params, partialResultToken }, token);
    } finally {
      handler.dispose();
    }
  }

  #stream(method, fields, opts) {
    const source = new CancellationTokenSource();
    opts.token?.onCancellationRequested(() => source.cancel());
    const queue = [];
    const toolCalls = [];
    const logprobs = [];
    let reasoning = '';
    let wake = null;
    let finished = false;
    let failure = null;
    const result = this.#call(method, fields, {
      ...opts,
      token: source.token,
      onPiece: (text, value) => {
        if (value?.toolCalls) toolCalls.push(...value.toolCalls);
        if (value?.logprobs) logprobs.push(...value.logprobs);
        if (value?.reasoning) {
          reasoning += value.reasoning;
          opts.onReasoning?.(value.reasoning);
        }
        if (!text) return;
        queue.push(text);
        wake?.();
      },
    });
    result.then(
      () => { finished = true; wake?.(); },
      (error) => { finished = true; failure = error; wake?.(); },
    );
    return {
      result,
      toolCalls,
      logprobs,
      get reasoning() {
        return reasoning;
      },
      cancel: () => source.cancel(),
      [Symbol.asyncIterator]() {
        return this;
      },
      async next() {
        for (;;) {
          if (queue.length) return { value: queue.shift(), done: false };
          if (finished) {
            if (failure) throw failure;
            return { value: undefined, done: true };
          }
          await new Promise((resolve) => { wake = resolve; });
          wake = null;
        }
      },
      async return() {
        if (!finished) source.cancel();
        return { value: undefined, done: true };
      },
    };
  }

  /** shutdown, exit, and wait for the process: resolves with its exit code (0 when clean). */
  async close(timeoutMs = 10000) {
    if (this.closed) return this.exited;
    this.closed = true;
    let timer;
    const timeout = new Promise((resolve) => { timer = setTimeout(resolve, timeoutMs, 'timeout'); });
    try {
      if (this.process.exitCode === null) {
        await Promise.race([this.request('shutdown'), timeout]);
        await this.notify('exit');
      }
    } catch {
      // the server is gone already
    }
    const code = await Promise.race([this.exited, timeout]);
    clearTimeout(timer);
    this.connection.dispose();
    if (code === 'timeout') {
      this.process.kill('SIGKILL');
      return this.exited;
    }
    return code;
  }
}

/** The members of `fields` that are set (undefined ones are left out, not sent as null). */
function defined(fields) {
  return Object.fromEntries(Object.entries(fields).filter(([, v]) => v !== undefined));
}
