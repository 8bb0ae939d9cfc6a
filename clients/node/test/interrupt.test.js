// Ctrl-C at a terminal: SIGINT to the foreground process group. A program using the client, run
// as a terminal runs it (a process group of its own), gets SIGINT to its whole group: it cancels
// its request and goes on with the same server, which the signal never reached.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { test } from 'node:test';

const CLIENT = fileURLToPath(new URL('../index.js', import.meta.url));

const PROGRAM = `
import { CancellationTokenSource, KinferClient } from ${JSON.stringify(CLIENT)};

const kinfer = await KinferClient.start();
await kinfer.load(undefined, { options: { threads: 1 } });
console.log('server', kinfer.process.pid);
const source = new CancellationTokenSource();
process.on('SIGINT', () => source.cancel()); // Ctrl-C stops the reply
let pieces = 0;
try {
  await kinfer.generate('Count to a thousand.', {
    options: { maxTokens: 5000, ignoreEos: true, temperature: 0 },
    onPiece: () => { if (++pieces === 3) console.log('streaming'); },
    token: source.token,
  });
  console.log('the request ran to its end');
} catch (error) {
  console.log('cancelled', error.code, error.data.usage.completionTokens > 0);
}
await new Promise((resolve) => setTimeout(resolve, 1000)); // a while later, the next question
const reply = await kinfer.generate('Hello', { options: { maxTokens: 2, temperature: 0 } });
console.log('then', reply.usage.completionTokens, 'tokens from', kinfer.process.pid);
console.log('exit code', await kinfer.close());
`;

const group = (pid) => Number(readFileSync(`/proc/${pid}/stat`, 'utf8').split(') ')[1].split(' ')[2]);

test('Ctrl-C (SIGINT to the program\'s process group) cancels the request and keeps the server', { skip: process.platform !== 'linux' && 'reads /proc' }, async () => {
  // detached: the program leads a process group of its own, as a shell's foreground job does
  const program = spawn(process.execPath, ['--input-type=module', '-e', PROGRAM], {
    detached: true,
    stdio: ['ignore', 'pipe', 'inherit'],
    env: { OMP_WAIT_POLICY: 'PASSIVE', ...process.env },
  });
  const exited = once(program, 'exit');
  let output = '';
  const seen = (text) => new Promise((resolve, reject) => {
    const check = () => output.includes(text) && resolve();
    program.stdout.on('data', (data) => { output += data; check(); });
    program.once('exit', () => reject(new Error(`"${text}" never came: ${output}`)));
    check();
  });
  try {
    await seen('streaming');
    const server = Number(output.split('server ')[1].split('\n')[0]);
    const serverGroup = group(server);
    process.kill(-program.pid, 'SIGINT'); // what Ctrl-C at the terminal does
    const [code] = await exited;
    assert.equal(code, 0, output);
    assert.match(output, /cancelled -32800 true/);
    assert.match(output, new RegExp(`then 2 tokens from ${server}`));
    assert.match(output, /exit code 0/);
    assert.notEqual(serverGroup, program.pid);
  } finally {
    if (program.exitCode === null && program.signalCode === null) process.kill(-program.pid, 'SIGKILL');
  }
});
