// Test only: types a function at the end of a real file through vscode-languageserver-protocol,
// as VS Code's client does: a didChange per keystroke, an Automatic inline completion after each
// (the one before cancelled with $/cancelRequest), then the last suggestion accepted (inserted,
// its command run through workspace/executeCommand) and the next one asked for.
// Usage: node typing.js '<server argv as JSON>' '<init options JSON>' FILE 'TYPED' [WAIT_MS]
// (WAIT_MS: how long the client waits after running the command before asking again; then it
// types one more character and asks once more, a request nothing was computed ahead for.)
// Prints one JSON report on stdout.
'use strict';
const fs = require('fs');
const { spawn } = require('child_process');
const {
  createProtocolConnection, StreamMessageReader, StreamMessageWriter, CancellationTokenSource,
  InitializeRequest, InitializedNotification, DidOpenTextDocumentNotification,
  DidChangeTextDocumentNotification, DidSaveTextDocumentNotification, InlineCompletionRequest,
  ExecuteCommandRequest, ShutdownRequest, ExitNotification,
} = require('vscode-languageserver-protocol/node');

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function main() {
  const [cmd, ...args] = JSON.parse(process.argv[2]);
  const initOptions = JSON.parse(process.argv[3] || 'null');
  const file = process.argv[4];
  const typed = process.argv[5];
  const waitMs = Number(process.argv[6] || 0);
  const server = spawn(cmd, args, { stdio: ['pipe', 'pipe', 'inherit'] });
  const exited = new Promise((resolve) => server.on('exit', (code) => resolve(code)));
  const connection = createProtocolConnection(
    new StreamMessageReader(server.stdout), new StreamMessageWriter(server.stdin));
  connection.listen();
  const report = { requests: 0, cancelled: 0, empty: 0 };
  const init = await connection.sendRequest(InitializeRequest.type, {
    processId: process.pid,
    rootUri: 'file://' + process.cwd(),
    capabilities: {
      textDocument: { synchronization: { didSave: true }, inlineCompletion: {} },
      workspace: { executeCommand: {} },
    },
    initializationOptions: initOptions,
  });
  report.commands = init.capabilities.executeCommandProvider.commands;
  await connection.sendNotification(InitializedNotification.type, {});

  const uri = 'file://' + file;
  let text = fs.readFileSync(file, 'utf8');
  let version = 1;
  await connection.sendNotification(DidOpenTextDocumentNotification.type, {
    textDocument: { uri, languageId: 'python', version, text },
  });
  const end = () => {
    const lines = text.split('\n');
    return { line: lines.length - 1, character: lines[lines.length - 1].length };
  };
  const insert = async (s) => {
    const at = end();
    text += s;
    await connection.sendNotification(DidChangeTextDocumentNotification.type, {
      textDocument: { uri, version: ++version }, contentChanges: [{ range: { start: at, end: at }, text: s }],
    });
  };
  const ask = (token) => {
    report.requests += 1;
    return connection.sendRequest(InlineCompletionRequest.type, {
      textDocument: { uri }, position: end(), context: { triggerKind: 1 },
    }, token);
  };

  // Typing: each keystroke cancels the request before it.
  let source = null;
  let pending = null;
  const settle = (p) => p.then((r) => { if (!r.items.length) report.empty += 1; return r; },
    (err) => { if (err && err.code === -32800) { report.cancelled += 1; return null; } throw err; });
  for (const ch of typed) {
    if (source) source.cancel();
    await insert(ch);
    source = new CancellationTokenSource();
    pending = settle(ask(source.token));
    await sleep(15);
  }
  let t0 = Date.now();
  const last = await pending;
  report.lastMs = Date.now() - t0;
  report.last = last;
  report.typedText = text;
  if (last && last.items.length) {
    const item = last.items[0];
    await insert(item.insertText);  // the client inserts the suggestion, then runs its command
    await connection.sendRequest(ExecuteCommandRequest.type, { command: item.command.command, arguments: item.command.arguments });
    await sleep(waitMs);
    t0 = Date.now();
    report.next = await ask();
    report.nextMs = Date.now() - t0;
    await insert(' ');
    t0 = Date.now();
    report.fresh = await ask();
    report.freshMs = Date.now() - t0;
  }
  await connection.sendNotification(DidSaveTextDocumentNotification.type, { textDocument: { uri } });
  report.stats = await connection.sendRequest(ExecuteCommandRequest.type, { command: 'kinfer.stats', arguments: [{ uri }] });
  report.finalText = text;
  await connection.sendRequest(ShutdownRequest.type);
  await connection.sendNotification(ExitNotification.type);
  report.exitCode = await exited;
  connection.dispose();
  process.stdout.write(JSON.stringify(report) + '\n');
}

main().catch((err) => {
  process.stdout.write(JSON.stringify({ error: String(err && err.stack || err) }) + '\n');
  process.exit(1);
});
