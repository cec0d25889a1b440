/** Item priorities through the TypeScript client: produce (per item and per call),
 * lease order, listing, import, the range check, and a cluster through any node. */
import assert from "node:assert/strict";
import { describe, test } from "node:test";

import { Client, InvalidRequest } from "../src/index.js";
import { TestCluster, etcdMissing } from "./cluster.js";
import { type ServerProcess, queueName, serveFile } from "./server.js";

let server: ServerProcess;
let client: Client;

serveFile((s, c) => ([server, client] = [s, c]));

describe("priorities", () => {
  test("a lease takes higher priorities first, FIFO within one; listing and import keep them", async () => {
    const q = queueName();
    await client.createQueue(q);
    await client.produce(q, ["low", { payload: "high", priority: 9 }, "plain"]);
    await client.produce(q, ["mid-a", "mid-b"], { priority: 5 });
    const listed = await client.listItems(q).toArray();
    assert.deepEqual(
      listed.map((i) => [new TextDecoder().decode(i.payload), i.priority]),
      [["low", 0], ["high", 9], ["plain", 0], ["mid-a", 5], ["mid-b", 5]],
    );
    const leased = await client.lease(q, { batchSize: 10, waitMs: 0 });
    assert.deepEqual(
      leased.map((i) => [i.text, i.priority]),
      [["high", 9], ["mid-a", 5], ["mid-b", 5], ["low", 0], ["plain", 0]],
    );
    await client.retry([leased[0]!]);
    const [again] = await client.lease(q, { batchSize: 1, waitMs: 1_000 });
    assert.deepEqual([again!.text, again!.priority], ["high", 9]);

    const other = queueName();
    await client.createQueue(other);
    await client.importItems(other, [{ payload: new TextEncoder().encode("s"), priority: 4 }]);
    assert.deepEqual((await client.listItems(other).toArray()).map((i) => i.priority), [4]);
  });

  test("a priority outside 0 to 9 is InvalidRequest naming items[i].priority", async () => {
    const q = queueName();
    await client.createQueue(q);
    await assert.rejects(client.produce(q, [{ payload: "ok", priority: 1 }, { payload: "x", priority: 10 }]), (e: unknown) => {
      assert.ok(e instanceof InvalidRequest);
      assert.ok(e.fieldViolations.some((v) => v.field === "items[1].priority"), JSON.stringify(e.fieldViolations));
      return true;
    });
  });
});

const skip = etcdMissing();

test("priorities in a cluster, produced and leased through every node", { skip }, async () => {
  const cluster = await TestCluster.start(3);
  try {
    const admin = new Client({ address: cluster.addresses[0]!, timeoutMs: 10_000 });
    const q = queueName("cq");
    await admin.createQueue(q, { partitions: 1 });
    admin.close();
    for (const address of cluster.addresses) {
      const c = new Client({ address, timeoutMs: 10_000 });
      try {
        await c.produce(q, ["a", { payload: "b", priority: 3 }, { payload: "c", priority: 9 }]);
        const leased = await c.lease(q, { batchSize: 10, waitMs: 1_000 });
        assert.deepEqual(leased.map((i) => [i.text, i.priority]), [["c", 9], ["b", 3], ["a", 0]], address);
        await c.complete(leased);
      } finally {
        c.close();
      }
    }
  } finally {
    await cluster.stop();
  }
});
