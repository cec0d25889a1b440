/** The routing table (testdata/routing/cases.json) against the client's cluster map: the
 * node each call is sent to. The server's policy and the Python SDK run the same table
 * (server/tests/test_routing_table.py, clients/python/tests/test_sdk_routing_table.py). */
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { test } from "node:test";

import { type DescMessage, fromJson, type JsonValue } from "@bufbuild/protobuf";

import { QueueService } from "../src/gen/querator/v1/queue_pb.js";
import { QueuesService } from "../src/gen/querator/v1/queues_pb.js";
import { StorageService } from "../src/gen/querator/v1/storage_pb.js";
import { ClusterMap, keyPartition, type RoutedRequest, targetOf } from "../src/routing.js";

interface Cluster {
  homes: string[];
  key_partitions: number;
  live: string[];
}
interface Case {
  name: string;
  cluster: Cluster;
  call: { method: string; request: Record<string, JsonValue> };
  client?: { node?: string; one_of?: string[] };
}
interface Table {
  key_partitions: { key: string; partitions: number; partition: number }[];
  cases: Case[];
}

// dist/test/ -> the repository root
const table = JSON.parse(readFileSync(new URL("../../../../testdata/routing/cases.json", import.meta.url), "utf8")) as Table;

function inputOf(method: string): DescMessage {
  for (const service of [QueueService, QueuesService, StorageService]) {
    const found = service.methods.find((m) => m.name === method);
    if (found) return found.input;
  }
  throw new Error(`no method ${method}`);
}

function mapOf(cluster: Cluster): ClusterMap {
  const nodes = [...new Set([...cluster.homes, ...cluster.live])].sort();
  const map = new ClusterMap();
  map.apply(
    {
      clustered: true,
      revision: 1n,
      members: nodes.map((n) => ({ nodeId: n, address: `${n}:1`, live: cluster.live.includes(n) })),
      queues: [{ queueName: "q", homes: cluster.homes, keyPartitions: cluster.key_partitions }],
    },
    undefined,
    0,
  );
  map.applyStats("q", [], 0);
  return map;
}

for (const c of table.cases) {
  const want = c.client;
  if (!want) continue;
  test(`routing table: ${c.name}`, () => {
    const map = mapOf(c.cluster);
    const request = fromJson(inputOf(c.call.method), { ...c.call.request, queueName: "q" }) as RoutedRequest;
    const target = targetOf(c.call.method, request);
    if (want.one_of) {
      const chosen = new Set<string>();
      for (let i = 0; i < 60; i++) {
        const node = map.nodeFor(target, 0, i / 60);
        chosen.add(node);
        map.leased("q", node, 0); // found nothing there: a Lease moves on
      }
      assert.deepEqual([...chosen].sort(), [...want.one_of].sort());
    } else {
      assert.equal(map.nodeFor(target, 0), want.node);
    }
  });
}

test("routing table: every key vector", () => {
  for (const v of table.key_partitions) assert.equal(keyPartition(v.key, v.partitions), v.partition, v.key);
});

test("a server before keyPartitions: keys spread over every partition", () => {
  const map = mapOf({ homes: ["n1", "n2", "n3"], key_partitions: 0, live: ["n1", "n2", "n3"] });
  assert.equal(map.keyHome("q", "b"), "n3"); // crc32("b") % 3 = 2
});
