// Test only: kinfer-rpc as a language server, driven by vscode-languageserver-protocol (the
// protocol layer of VS Code's own LSP client). Usage: node client.js '<server argv as JSON>' '<init options JSON>'
// Prints one JSON report on stdout.
'use strict';
const { spawn } = require('child_process');
const {
  createProtocolConnection, StreamMessageReader, StreamMessageWriter,
  InitializeRequest, InitializedNotification, DidOpenTextDocumentNotification,
  DidChangeTextDocumentNotification, CompletionRequest, InlineCompletionRequest,
  ShutdownRequest, ExitNotification, TextDocumentSyncKind,
} = require('vscode-languageserver-protocol/node');

async function main() {
  const [cmd, ...args] = JSON.parse(process.argv[2]);
  const initOptions = JSON.parse(process.argv[3] || 'null');
  const text = process.argv[4] || 'def add(a, b):\n    return \n';
  const server = spawn(cmd, args, { stdio: ['pipe', 'pipe', 'inherit'] });
  const exited = new Promise((resolve) => server.on('exit', (code) => resolve(code)));
  const connection = createProtocolConnection(
    new StreamMessageReader(server.stdout), new StreamMessageWriter(server.stdin));
  const logs = [];
  connection.onNotification('window/logMessage', (p) => logs.push(p));
  connection.listen();
  const report = { logs };
  const init = await connection.sendRequest(InitializeRequest.type, {
    processId: process.pid,
    clientInfo: { name: 'vscode-languageserver-protocol test', version: '1' },
    locale: 'en',
    rootPath: process.cwd(),
    rootUri: 'file://' + process.cwd(),
    workspaceFolders: [{ uri: 'file://' + process.cwd(), name: 'test' }],
    capabilities: {
      general: { positionEncodings: ['utf-16'] },
      textDocument: {
        synchronization: { dynamicRegistration: false, didSave: true },
        completion: { completionItem: { snippetSupport: true } },
        inlineCompletion: {},
      },
    },
    initializationOptions: initOptions,
    trace: 'off',
  });
  report.sync = init.capabilities.textDocumentSync;
  report.incremental = report.sync.change === TextDocumentSyncKind.Incremental;
  report.completionProvider = init.capabilities.completionProvider;
  report.inlineCompletionProvider = init.capabilities.inlineCompletionProvider;
  await connection.sendNotification(InitializedNotification.type, {});
  const uri = 'file://' + process.cwd() + '/add.py';
  await connection.sendNotification(DidOpenTextDocumentNotification.type, {
    textDocument: { uri, languageId: 'python', version: 1, text },
  });
  // type "a +" after "return " (line 1, column 11)
  const lines = text.split('\n');
  const line = 1;
  let col = lines[line].length;
  let version = 1;
  for (const ch of 'a +') {
    await connection.sendNotification(DidChangeTextDocumentNotification.type, {
      textDocument: { uri, version: ++version },
      contentChanges: [{ range: { start: { line, character: col }, end: { line, character: col } }, text: ch }],
    });
    col += 1;
  }
  const t0 = Date.now();
  report.completion = await connection.sendRequest(CompletionRequest.type, {
    textDocument: { uri }, position: { line, character: col }, context: { triggerKind: 1 },
  });
  report.completionMs = Date.now() - t0;
  report.inline = await connection.sendRequest(InlineCompletionRequest.type, {
    textDocument: { uri }, position: { line, character: col }, context: { triggerKind: 1 },
  });
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
