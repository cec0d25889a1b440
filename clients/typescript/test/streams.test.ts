/** Produce over a ProduceStream when the server dies and comes back. */
import assert from "node:assert/strict";
import { after, test } from "node:test";

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
