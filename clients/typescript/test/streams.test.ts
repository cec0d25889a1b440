/** Produce and Lease streams: a server that dies and comes back; a client never closed. */
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { dirname, join } from "node:path";
import { test, after } from "node:test";
import { fileURLToPath, pathToFileURL } from "node:url";
import { promisify } from "node:util";

import { Client, Unavailable } from "../src/index.js";
import { ServerProcess, queueName } from "./server.js";

const servers: ServerProcess[] = [];
after(async () => {
  for (const s of servers) await s.stop();
});

test("after kill -9 a produce fails Unavailable; once the server is back a new stream carries it, and acknowledged items were kept", async () => {
  const first = await ServerProcess.start();
  servers.push(first);
  const client = new Client({ address: first.address, retries: 0, timeoutMs: 5000 });
  try {
    const q = queueName();
    await client.createQueue(q);
    const before = await client.produce(q, ["one", "two"]);

    await first.kill();
    await assert.rejects(client.produce(q, "while down"), Unavailable);

    const second = await ServerProcess.start({ address: first.address, dataDir: first.dataDir });
    servers.push(second);
    const afterRestart = await client.produce(q, "three");
    assert.equal(afterRestart.ids.length, 1);
    const items = await client.lease(q, { batchSize: 10, waitMs: 1000 });
    assert.deepEqual(items.map((i) => i.text), ["one", "two", "three"]);
    assert.deepEqual(items.slice(0, 2).map((i) => i.id), before.ids);
  } finally {
    client.close();
  }
});

test("a program that never closes its client still exits: idle streams close themselves", async () => {
  const server = await ServerProcess.start();
  servers.push(server);
  const index = pathToFileURL(join(dirname(fileURLToPath(import.meta.url)), "..", "src", "index.js")).href;
  const script = `
    import { Client } from ${JSON.stringify(index)};
    const client = new Client({ address: ${JSON.stringify(server.address)} });
    await client.createQueue("forgotten");
    await client.produce("forgotten", ["a", "b"]);
    const items = await client.lease("forgotten", { batchSize: 2, waitMs: 1000 });
    await client.complete(items);
    console.log("done", items.length);
  `;
  const started = Date.now();
  const { stdout } = await promisify(execFile)("node", ["--input-type=module", "-e", script], { timeout: 30_000 });
  assert.equal(stdout.trim(), "done 2");
  assert.ok(Date.now() - started < 20_000, `exited after ${Date.now() - started} ms`);
});
