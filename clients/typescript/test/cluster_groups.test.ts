/** Ordered groups through the routing client against a real cluster (etcd and three
 * `querator serve --cluster` nodes): a group lives at its key's home, and each group's
 * items lease out in produce order. Deliveries are checked by payload. */
import assert from "node:assert/strict";
import { crc32 } from "node:zlib";
import { test } from "node:test";

import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";

import { Client } from "../src/index.js";
import { ClusterService } from "../src/v1.js";
import { clusterFile, type TestCluster } from "./cluster.js";
import { queueName } from "./server.js";

let cluster: TestCluster;
const skip = clusterFile((c) => (cluster = c));

test("grouped items go to their group's home and lease out in each group's order", { skip }, async () => {
  const q = queueName("groups");
  const client = new Client({ addresses: cluster.addresses, timeoutMs: 10_000 });
  try {
    await client.createQueue(q, { partitions: 6, leaseTimeoutMs: 60_000 });
    const info = await createClient(ClusterService, createGrpcTransport({ baseUrl: `http://${cluster.addresses[0]!}` })).clusterInfo({ queueNames: [q] });
    const homes = info.queues[0]!.homes;
    const keys = Array.from({ length: 9 }, (_, i) => `customer-${i}`);
    const items = Array.from({ length: 180 }, (_, n) => ({ payload: `${keys[n % 9]}/${n}`, groupKey: keys[n % 9]! }));
    const produced = await client.produce(q, items, { batchSize: 4, maxInFlight: 4 });
    produced.partitions.forEach((p, n) => {
      const key = items[n]!.groupKey;
      assert.equal(homes[p], homes[crc32(key) % 6], `${key} stored away from its home`);
    });
    const seen = new Map<string, number[]>();
    for (let round = 0; round < 2000; round++) {
      const batch = await client.lease(q, { batchSize: 50, waitMs: 200 });
      if (!batch.length && [...seen.values()].reduce((n, l) => n + l.length, 0) === 180) break;
      for (const item of batch) {
        const [key, n] = item.text.split("/");
        assert.equal(item.groupKey, key);
        seen.set(key!, [...(seen.get(key!) ?? []), Number(n)]);
      }
      if (batch.length) await client.complete(batch);
    }
    keys.forEach((key, i) => assert.deepEqual(seen.get(key), items.map((_, n) => n).filter((n) => n % 9 === i)));
  } finally {
    client.close();
  }
});
