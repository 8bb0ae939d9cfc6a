// Two real clients through one daemon (`kinfer serve`): this Node client and the Python client,
// both attached with `kinfer-rpc --attach`, load the same model once and stream from it. Run with
// `npm test` (node --test); needs `kinfer` and `python3` with kinfer installed beside kinfer-rpc.
import assert from 'node:assert/strict';
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { after, before, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';

import { KinferClient } from '../index.js';

const home = mkdtempSync(join(tmpdir(), 'kinfer-node-daemon-'));
const socket = join(home, 'kinfer.sock');
const env = { ...process.env, KINFER_HOME: home, OMP_WAIT_POLICY: 'PASSIVE' };
delete env.XDG_RUNTIME_DIR;
const rpc = process.env.KINFER_RPC ?? 'kinfer-rpc';
// the Python that runs kinfer-rpc (its shebang), for the Python client
const rpcPath = rpc.includes('/') ? rpc : execFileSync('which', [rpc], { encoding: 'utf8' }).trim();
const python = join(dirname(rpcPath), 'python3');
let daemon;

before(async () => {
  daemon = spawn(join(dirname(rpcPath), 'kinfer'), ['serve', '--socket', socket], { env, stdio: 'inherit' });
  for (let i = 0; i < 600 && !existsSync(socket); i++) await sleep(100);
  assert.ok(existsSync(socket), 'the daemon did not start');
});

after(async () => {
  daemon.kill('SIGTERM');
  await new Promise((resolve) => daemon.once('exit', resolve));
  rmSync(home, { recursive: true, force: true });
});

test('a Node and a Python client share one loaded model through the daemon', async () => {
  const node = await KinferClient.start({ args: ['--attach', '--socket', socket], env });
  try {
    const loaded = await node.load(undefined);
    assert.equal(loaded.model, 'smollm2-135m-instruct');
    const options = { maxTokens: 8, temperature: 0 };
    const messages = [{ role: 'user', content: 'Name a colour.' }];
    const pieces = [];
    const mine = await node.chat(messages, { options, onPiece: (text) => pieces.push(text) });
    assert.equal(pieces.join(''), mine.text);
    // The Python client, attached to the same daemon, loads the same model: the same instance.
    const py = spawnSync(
      python,
      [
        '-c',
        `import json, sys
from kinfer_rpc.client import Client
with Client(sys.argv[1:]) as c:
    loaded = c.load(None)
    r = c.chat([{"role": "user", "content": "Name a colour."}], maxTokens=8, temperature=0)
    status = c.request("model/status", {})["models"]
    print(json.dumps({"loads": loaded.loads, "holders": loaded.holders, "text": r.text, "models": len(status)}))`,
        rpcPath,
        '--attach',
        '--socket',
        socket,
      ],
      { env, encoding: 'utf8', timeout: 120000 },
    );
    assert.equal(py.status, 0, py.stderr);
    const report = JSON.parse(py.stdout.trim().split('\n').at(-1));
    assert.equal(report.models, 1); // loaded once
    assert.equal(report.loads, 2); // Node's load, then Python's, answered by the same instance
    assert.equal(report.holders, 2);
    assert.equal(report.text, mine.text); // the same request, the same reply, whichever client
  } finally {
    assert.equal(await node.close(), 0);
  }
});
