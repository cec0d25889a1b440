import assert from "node:assert/strict";
import { describe, test } from "node:test";

import { Client, InvalidRequest } from "../src/index.js";
import type { LeasedItem } from "../src/index.js";
import { type ServerProcess, queueName, serveFile } from "./server.js";

let server: ServerProcess;
let client: Client;

serveFile((s, c) => ([server, client] = [s, c]));

const texts = (items: LeasedItem[]): string[] => items.map((i) => i.text).sort();

describe("ordered groups", () => {
  test("a group's items are leased one at a time, in produce order; groups do not wait for each other", async () => {
    const q = queueName();
    await client.createQueue(q, { leaseTimeoutMs: 60_000 });
    await client.produce(q, [
      { payload: "A1", groupKey: "A" },
      { payload: "A2", groupKey: "A" },
      { payload: "B1", groupKey: "B" },
      "plain",
    ]);
    const first = await client.lease(q, { batchSize: 10, waitMs: 300 });
    assert.deepEqual(texts(first), ["A1", "B1", "plain"]);
    assert.deepEqual(Object.fromEntries(first.map((i) => [i.text, i.groupKey])), { A1: "A", B1: "B", plain: "" });
    assert.deepEqual(await client.lease(q, { batchSize: 10, waitMs: 300 }), []);
    const stats = await client.queueStats(q);
    assert.equal(stats.partitions[0]!.groupsInFlight, 2);
    assert.ok(stats.partitions[0]!.oldestWaitingInGroupMs !== undefined);
    assert.equal(stats.total, 4);
    await first.find((i) => i.text === "A1")!.complete();
    assert.deepEqual(texts(await client.lease(q, { batchSize: 10, waitMs: 300 })), ["A2"]);
  });

  test("one produce() of many groups keeps each group's order over batches sent side by side", async () => {
    const q = queueName();
    await client.createQueue(q, { leaseTimeoutMs: 60_000, partitions: 3 });
    const items = Array.from({ length: 300 }, (_, n) => ({ payload: `g${n % 7}/${n}`, groupKey: `g${n % 7}` }));
    const produced = await client.produce(q, items, { batchSize: 5, maxInFlight: 4 });
    assert.equal(produced.ids.length, 300);
    const seen = new Map<string, number[]>();
    for (let round = 0; round < 500; round++) {
      const batch = await client.lease(q, { batchSize: 50, waitMs: 300 });
      if (!batch.length && [...seen.values()].reduce((n, l) => n + l.length, 0) === 300) break;
      for (const item of batch) {
        const [key, n] = item.text.split("/");
        seen.set(key!, [...(seen.get(key!) ?? []), Number(n)]);
        await item.complete();
      }
    }
    for (let g = 0; g < 7; g++) {
      assert.deepEqual(seen.get(`g${g}`), items.map((_, n) => n).filter((n) => n % 7 === g));
    }
  });

  test("a too long group key is refused naming the field", async () => {
    const q = queueName();
    await client.createQueue(q);
    await assert.rejects(client.produce(q, [{ payload: "x", groupKey: "k".repeat(513) }]), (error: unknown) => {
      assert.ok(error instanceof InvalidRequest);
      assert.match(String((error as Error).message), /items\[0\]\.group_key/);
      return true;
    });
  });
});
