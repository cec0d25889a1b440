/** The client's cluster calls on a replicated queue left with no in-sync copy to take
 * over (a cluster of two nodes of its own, processes killed with SIGKILL): the copy is
 * killed, so the primary acknowledges alone; the primary is killed and the copy comes
 * back. `clusterInfo({ checkMembers: true })` says why the copy may not take over
 * (`failoverBlocked`), a plain `retireNode` of the dead primary fails naming the queue,
 * and `retireNode(..., { promoteCopiesBehind: true })` makes the copy the primary,
 * saying at which position (`copiesPromoted`). */
import assert from "node:assert/strict";
import { test } from "node:test";

import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";

import { Client, FailedPrecondition } from "../src/index.js";
import { QueuesService } from "../src/v1.js";
import { clusterFile, type TestCluster } from "./cluster.js";
import { queueName, waitUntil } from "./server.js";

let cluster: TestCluster;
const skip = clusterFile((c) => (cluster = c), 2, 2);

test("clusterInfo says why no copy takes over, and retireNode promotes the copy behind only when asked", { skip }, async () => {
  const q = queueName("short");
  const a = cluster.nodes[0]!;
  const viaA = new Client({ addresses: [a.server.address], timeoutMs: 20_000 });
  let viaCopy: Client | undefined;
  try {
    // The client's QueueSettings has no replicas: the generated service is called.
    await createClient(QueuesService, createGrpcTransport({ baseUrl: `http://${a.server.address}` })).createQueue({
      queue: { queueName: q, replicas: 2, requestedPartitions: 1 },
    });
    await waitUntil(async () => (await viaA.clusterInfo({ queueNames: [q] })).replicated[q]?.inSync.length === 2, 20_000, "both copies in sync");
    const placed = (await viaA.clusterInfo({ queueNames: [q] })).replicated[q]!;
    assert.equal(placed.replicas.length, 2);
    const primary = cluster.node(placed.primary);
    const copy = cluster.node(placed.replicas.find((n) => n !== placed.primary)!);
    const viaPrimary = new Client({ addresses: [primary.server.address], timeoutMs: 20_000 });
    try {
      await viaPrimary.produce(q, ["both-1", "both-2"]);
      await copy.server.kill();
      // The primary waits for the silent copy up to the lag bound, then drops it from the
      // in-sync set and acknowledges alone: "alone" is on the primary only.
      await viaPrimary.produce(q, ["alone"]);
      await waitUntil(async () => (await viaPrimary.clusterInfo({ queueNames: [q] })).replicated[q]!.inSync.join() === primary.id, 15_000, "the copy dropped");
      assert.equal((await viaPrimary.clusterInfo({ queueNames: [q], checkMembers: true })).replicated[q]!.failoverBlocked, "");
    } finally {
      viaPrimary.close();
    }
    await primary.server.kill();
    await cluster.restart(copy.id);
    viaCopy = new Client({ addresses: [copy.server.address], timeoutMs: 20_000 });
    const client = viaCopy;
    await waitUntil(
      async () => {
        const members = (await client.clusterInfo()).members;
        return members.some((m) => m.nodeId === copy.id && m.live) && !members.some((m) => m.nodeId === primary.id && m.live);
      },
      30_000,
      "the copy live, the primary not",
    );
    const view = await client.clusterInfo({ queueNames: [q], checkMembers: true });
    assert.ok(view.clustered && view.nodeId === copy.id, JSON.stringify(view));
    const blocked = view.replicated[q]!;
    assert.equal(blocked.primary, primary.id);
    assert.ok(blocked.failoverBlocked.includes(`node '${copy.id}' is not in the in-sync set`), blocked.failoverBlocked);
    assert.equal(view.members.find((m) => m.nodeId === copy.id)?.fenced, false);

    await assert.rejects(
      client.retireNode(primary.id),
      (e: unknown) => e instanceof FailedPrecondition && e.rawMessage.includes(`queue '${q}': node '${primary.id}' holds its only in-sync copy`),
    );
    const retired = await client.retireNode(primary.id, { promoteCopiesBehind: true });
    assert.equal(retired.partitionsRecreated, 0);
    assert.equal(retired.copiesPromoted.length, 1);
    const [promoted] = retired.copiesPromoted;
    assert.equal(promoted!.queueName, q);
    assert.equal(promoted!.nodeId, copy.id);
    assert.equal(promoted!.epoch, placed.epoch);
    assert.ok(promoted!.lsn > 0, JSON.stringify(promoted));
    assert.equal(promoted!.newEpoch, placed.epoch + 1);
    const now = (await client.clusterInfo({ queueNames: [q] })).replicated[q]!;
    assert.equal(now.primary, copy.id);
    assert.deepEqual(now.replicas, [copy.id]);
    // The copy serves what it held: "alone" is the loss the answer named.
    const got: string[] = [];
    for (let i = 0; i < 20 && got.length < 2; i++) {
      got.push(...(await client.lease(q, { batchSize: 10, waitMs: 300 })).map((item) => new TextDecoder().decode(item.payload)));
    }
    assert.deepEqual(got.sort(), ["both-1", "both-2"]);
  } finally {
    viaA.close();
    viaCopy?.close();
  }
});
