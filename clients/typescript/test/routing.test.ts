/** The routing decisions alone (no I/O): the map's revisions, node backoff, where
 * Produce and Lease go by the counts. The cluster tests run them against real nodes. */
import assert from "node:assert/strict";
import { test } from "node:test";

import { type ClusterAnswer, ClusterMap, DOWN_CAP_MS, DOWN_FIRST_MS, keyPartition } from "../src/routing.js";
import { python } from "./server.js";

function answer(revision: number, homes: string[], live: Record<string, boolean> = {}): ClusterAnswer {
  const nodes = [...new Set(homes)].sort();
  return {
    clustered: true,
    revision: BigInt(revision),
    members: nodes.map((n) => ({ nodeId: n, address: `127.0.0.1:${1000 + nodes.indexOf(n)}`, live: live[n] ?? true })),
    queues: [{ queueName: "q", homes }],
  };
}

test("a view with a lower revision never replaces a newer one", () => {
  const map = new ClusterMap();
  map.apply(answer(7, ["a", "b", "c"]), ["q"], 0);
  map.apply(answer(5, ["a", "a", "a"]), ["q"], 1);
  assert.deepEqual(map.homes("q"), ["a", "b", "c"]);
  map.apply(answer(9, ["a", "b", "c", "c"], { b: false }), ["q"], 2);
  assert.deepEqual(map.homes("q"), ["a", "b", "c", "c"]);
  assert.equal(map.address("b"), "", "a member that is not live has no address to send to");
  assert.equal(map.revision, 9n);
});

test("a queue the cluster does not have is asked about again only after a while", () => {
  const map = new ClusterMap();
  map.apply({ clustered: true, revision: 3n, members: [], queues: [] }, ["gone"], 100);
  assert.equal(map.needsLookup("gone", 100), false);
  assert.equal(map.needsLookup("gone", 1200), true);
  assert.equal(map.needsLookup("never-asked", 100), true);
});

test("a node that fails is skipped with doubling backoff up to the cap, logged once each way", () => {
  const logged: string[] = [];
  const map = new ClusterMap({ warn: (m) => logged.push(m), info: (m) => logged.push(m) });
  map.apply(answer(1, ["a", "b"]), ["q"], 0);
  let now = 0;
  const delays: number[] = [];
  for (let i = 0; i < 8; i++) {
    map.markDown("a", now, "refused");
    let until = now;
    while (map.isDown("a", until)) until += 10;
    delays.push(until - now);
    assert.equal(map.produceNode("q", now + 1), "b", "a down node gets no Produce");
    now = until;
  }
  assert.equal(delays[0], DOWN_FIRST_MS);
  assert.equal(delays[1], 2 * DOWN_FIRST_MS);
  assert.equal(Math.max(...delays), DOWN_CAP_MS);
  assert.equal(logged.length, 1);
  map.markUp("a");
  map.markUp("a");
  assert.equal(logged.length, 2);
  assert.match(logged[1]!, /node a answers again/);
});

test("Produce prefers the node with the fewest items per partition; Lease the nodes with ready items", () => {
  const map = new ClusterMap();
  map.apply(answer(1, ["a", "a", "b", "b"]), ["q"], 0);
  // No counts: by partitions, evenly.
  assert.equal(map.produceNode("q", 0, 0.49), "a");
  assert.equal(map.produceNode("q", 0, 0.51), "b");
  map.applyStats("q", [
    { partition: 0, ready: 500 },
    { partition: 1, ready: 500 },
    { partition: 2, ready: 0 },
    { partition: 3, ready: 0 },
  ], 0);
  const picks = Array.from({ length: 100 }, (_, i) => map.produceNode("q", 0, i / 100));
  assert.ok(picks.filter((n) => n === "b").length > 95, "the empty node takes nearly all");
  assert.equal(map.leaseNode("q", 0, 0.99), "a", "only a has ready items");
  map.leased("q", "a", 0); // a Lease there came back empty: the counts were stale
  assert.equal(map.leaseNode("q", 0, 0), "b", "the next Lease tries the other node");
});

test("a key's partition is the server's: crc32 of its UTF-8 bytes", async () => {
  const keys = ["order-1", "ключ", "🙂 key", ""];
  const expected = JSON.parse(await python("import json, sys, zlib; print(json.dumps([zlib.crc32(k.encode()) % 7 for k in json.loads(sys.argv[1])]))", [JSON.stringify(keys)]));
  assert.deepEqual(keys.map((k) => keyPartition(k, 7)), expected);
});

test("a node that answered UNAVAILABLE about a queue is left out of that queue alone, never its last node", () => {
  const logged: string[] = [];
  const map = new ClusterMap({ warn: (m) => logged.push(m) });
  map.apply({ ...answer(1, ["a", "b"]), queues: [{ queueName: "q", homes: ["a", "b"] }, { queueName: "r", homes: ["a", "b"] }] }, ["q", "r"], 0);
  map.markQueueDown("q", "a", 0);
  for (let i = 0; i < 10; i++) assert.equal(map.produceNode("q", 1, i / 10), "b");
  assert.equal(map.produceNode("r", 1, 0), "a", "other queues still use the node");
  map.markQueueDown("q", "b", 0);
  assert.ok(map.produceNode("q", 1, 0) !== undefined, "with every node left out, one is still tried");
  assert.equal(map.produceNode("q", DOWN_FIRST_MS + 1, 0), "a", "back after the backoff");
  assert.deepEqual(logged, []);
});
