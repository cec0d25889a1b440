/** The client against a real cluster: etcd and three `querator serve --cluster` nodes
 * (one cluster for this file). Where calls went is read from each node's own metrics
 * (querator_rpc_requests counts every call a node answers, a forwarded one on both the
 * node that forwarded it and the one that served it), or proved by pausing every node
 * but the one a call must reach. */
import assert from "node:assert/strict";
import { rmSync, writeFileSync } from "node:fs";
import zlib from "node:zlib";
import { test } from "node:test";

import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";

import { Client, ItemNotFound, type LeasedItem, type Logger, Unavailable, Worker } from "../src/index.js";
import { ClusterService } from "../src/v1.js";
import { clusterFile, type TestCluster } from "./cluster.js";
import { ServerProcess, freePort, queueName, waitUntil } from "./server.js";

let cluster: TestCluster;
const skip = clusterFile((c) => (cluster = c));

/** A plain Connect client of one node: no routing (for the tests' own look at things). */
function direct(address: string): ReturnType<typeof createClient<typeof ClusterService>> {
  return createClient(ClusterService, createGrpcTransport({ baseUrl: `http://${address}` }));
}

/** Until every node sees every member live (after a pause or a restart). */
async function allLive(): Promise<void> {
  await waitUntil(
    async () => {
      for (const node of cluster.nodes) {
        try {
          const info = await direct(node.server.address).clusterInfo({ queueNames: ["-"] }, { timeoutMs: 2_000 });
          if (info.members.length !== cluster.nodes.length || !info.members.every((m) => m.live) || !info.adminWritable) return false;
        } catch {
          return false;
        }
      }
      return true;
    },
    30_000,
    "every member live",
  );
}

async function homes(queue: string): Promise<string[]> {
  const info = await direct(cluster.addresses[0]!).clusterInfo({ queueNames: [queue] });
  return info.queues[0]!.homes;
}

function routed(extra: ConstructorParameters<typeof Client>[0] = {}): Client {
  return new Client({ addresses: cluster.addresses, timeoutMs: 10_000, ...extra });
}

async function total(method: string, queue: string): Promise<Map<string, number>> {
  const out = new Map<string, number>();
  for (const node of cluster.nodes) out.set(node.id, await cluster.rpcCount(node.id, method, queue));
  return out;
}

/** `texts` produced on each node in turn by a client of that node alone (no routing),
 * `batchSize` a request, one at a time: each node puts a request in its own partition
 * with the fewest ready items, so every partition gets some, whatever routing would
 * have picked. (A routing client picks nodes at random, weighted by counts of what
 * waits there: 12 batches over three nodes left one node a single batch in about one
 * run of fifty, and in one of six when the counts are missing, as when GetQueueStats
 * does not answer in time on a loaded machine.) */
async function produceOnEach(queue: string, texts: (node: number, i: number) => string, perNode: number, batchSize: number): Promise<void> {
  for (const [n, node] of cluster.nodes.entries()) {
    const there = new Client({ transport: createGrpcTransport({ baseUrl: `http://${node.server.address}` }) });
    try {
      await there.produce(queue, Array.from({ length: perNode }, (_, i) => texts(n, i)), { batchSize, maxInFlight: 1 });
    } finally {
      there.close();
    }
  }
}

async function drain(client: Client, queue: string, expected: number): Promise<LeasedItem[]> {
  const items: LeasedItem[] = [];
  await waitUntil(
    async () => {
      items.push(...(await client.lease(queue, { batchSize: 100, waitMs: 0 })));
      return items.length >= expected;
    },
    30_000,
    `${expected} items of ${queue}`,
  );
  return items;
}

test("Complete, Retry and Extend go straight to the item's home: no node forwards one", { skip }, async () => {
  const q = queueName("home");
  const client = routed();
  try {
    await client.createQueue(q, { partitions: 6 });
    const placed = await homes(q);
    assert.equal(new Set(placed).size, 3, `partitions on every node: ${placed.join(",")}`);
    await produceOnEach(q, (n, i) => `item ${n}-${i}`, 20, 5);
    const items = await drain(client, q, 60);
    assert.equal(new Set(items.map((i) => i.partition)).size, 6, "items from every partition");

    const byNode = new Map<string, number>();
    for (const item of items) byNode.set(placed[item.partition]!, (byNode.get(placed[item.partition]!) ?? 0) + 1);
    for (const item of items) await item.extend({ leaseTimeoutMs: 60_000 });
    const retried = items.slice(0, 12);
    for (const item of retried) await item.retry();
    for (const item of items.slice(12)) await item.complete();
    const again = await drain(client, q, 12);
    for (const item of again) await item.complete();

    // One call per item, each counted once and only by its home: a call sent elsewhere
    // would be counted twice (by the node it reached and by the home it was forwarded to).
    const extends_ = await total("Extend", q);
    const completes = await total("Complete", q);
    const retries = await total("Retry", q);
    for (const [node, count] of byNode) assert.equal(extends_.get(node), count, `Extend calls answered by ${node}`);
    assert.equal([...completes.values()].reduce((a, b) => a + b, 0), 60);
    assert.equal([...retries.values()].reduce((a, b) => a + b, 0), 12);
    const againByNode = new Map<string, number>();
    for (const item of [...items.slice(12), ...again]) againByNode.set(placed[item.partition]!, (againByNode.get(placed[item.partition]!) ?? 0) + 1);
    for (const [node, count] of againByNode) assert.equal(completes.get(node), count, `Complete calls answered by ${node}`);

    // And structurally: with every other node paused, items of one node's partitions
    // still complete at once (a call through a paused node would hang to its deadline).
    await client.produce(q, Array.from({ length: 30 }, (_, i) => `more ${i}`), { batchSize: 5 });
    const more = await drain(client, q, 30);
    const target = placed[more[0]!.partition]!;
    const held = more.filter((i) => placed[i.partition] === target);
    const others = cluster.nodes.filter((n) => n.id !== target);
    for (const n of others) n.server.signal("SIGSTOP");
    try {
      for (const item of held) await item.complete({ timeoutMs: 3_000 });
    } finally {
      for (const n of others) n.server.signal("SIGCONT");
      await allLive(); // a pause past the membership TTL: registered again before the next test
    }
    assert.ok(held.every((i) => i.state === "completed"));
    await client.complete(more.filter((i) => placed[i.partition] !== target));
  } finally {
    client.close();
  }
});

test("Produce spreads over the nodes; Lease goes to the node whose partitions hold the items", { skip }, async () => {
  const q = queueName("spread");
  const client = routed();
  try {
    await client.createQueue(q, { partitions: 6 });
    const placed = await homes(q);
    await client.produce(q, Array.from({ length: 6000 }, (_, i) => `item ${i}`), { batchSize: 100 });
    const stats = await client.queueStats(q);
    const perNode = new Map<string, number>();
    for (const p of stats.partitions) perNode.set(placed[p.partition]!, (perNode.get(placed[p.partition]!) ?? 0) + p.total);
    const mean = 6000 / 3;
    for (const [node, count] of perNode) assert.ok(count <= 1.5 * mean, `${node} holds ${count} of 6000 items (mean ${mean})`);
    assert.equal(perNode.size, 3);
    await client.clearQueue(q);

    // Items only on one node (produced there by a client that does not route): a
    // routing consumer's Leases go straight to that node, none through another.
    const lone = placed[0]!;
    const there = new Client({ transport: createGrpcTransport({ baseUrl: `http://${cluster.node(lone).server.address}` }) });
    try {
      await there.produce(q, Array.from({ length: 30 }, (_, i) => `lone ${i}`));
    } finally {
      there.close();
    }
    const before = await total("LeaseStream", q);
    const forwardedBefore = await cluster.rpcCount(lone, "Lease", q);
    const consumer = routed();
    try {
      const got: LeasedItem[] = [];
      for (let i = 0; i < 3; i++) got.push(...(await consumer.lease(q, { batchSize: 10, waitMs: 0 })));
      assert.equal(got.length, 30);
      assert.ok(got.every((item) => placed[item.partition] === lone));
      const after = await total("LeaseStream", q);
      for (const node of cluster.nodes) {
        const leases = after.get(node.id)! - before.get(node.id)!;
        assert.equal(leases, node.id === lone ? 3 : 0, `Leases answered by ${node.id}`);
      }
      assert.equal(await cluster.rpcCount(lone, "Lease", q), forwardedBefore, "no Lease forwarded to the node with the items");
      await consumer.complete(got);
    } finally {
      consumer.close();
    }
  } finally {
    client.close();
  }
});

test("a pause set through one node holds on every node until resumed through another", { skip }, async () => {
  const q = queueName("paused");
  const client = routed();
  try {
    await client.createQueue(q, { partitions: 3 });
    await client.produce(q, Array.from({ length: 30 }, (_, i) => `p${i}`), { batchSize: 5 });
    const admin = new Client({ transport: createGrpcTransport({ baseUrl: `http://${cluster.addresses[0]!}` }) });
    try {
      assert.equal((await admin.pauseQueue(q)).paused, true);
      // Each node's gauge reads its own actors' settings: every home applied the pause.
      for (const node of cluster.nodes) {
        await waitUntil(async () => (await cluster.metric(node.id, "querator_queue_paused", { queue: q })) === 1, 15_000, `${node.id} paused`);
      }
      assert.deepEqual(await client.lease(q, { batchSize: 50, waitMs: 500 }), []);
      const waiting = client.lease(q, { batchSize: 50, waitMs: 20_000 });
      await new Promise((resolve) => setTimeout(resolve, 500));
      const resumer = new Client({ transport: createGrpcTransport({ baseUrl: `http://${cluster.addresses[2]!}` }) });
      try {
        assert.equal((await resumer.resumeQueue(q)).paused, false);
      } finally {
        resumer.close();
      }
      const got = await waiting;
      assert.ok(got.length > 0, "the waiting lease was served after the resume");
      for (let i = 0; i < 20 && got.length < 30; i++) got.push(...(await client.lease(q, { batchSize: 50, waitMs: 500 })));
      assert.deepEqual(got.map((item) => item.text).sort(), Array.from({ length: 30 }, (_, i) => `p${i}`).sort());
      await client.complete(got);
    } finally {
      admin.close();
    }
  } finally {
    client.close();
  }
});

test("no consumer idles while another node has ready items", { skip }, async () => {
  const q = queueName("idle");
  const admin = routed();
  await admin.createQueue(q, { partitions: 3 });
  const placed = await homes(q);
  const consumers = [routed(), routed(), routed()];
  try {
    // Three consumers waiting (30 s) before anything is there, on whichever nodes their
    // turn gives them; then items arrive on one node only.
    const started = Date.now();
    const waiting = consumers.map((c, i) => c.lease(q, { batchSize: 100, waitMs: 30_000, clientId: `c${i}` }));
    await new Promise((r) => setTimeout(r, 300));
    const lone = placed[2]!;
    const there = new Client({ transport: createGrpcTransport({ baseUrl: `http://${cluster.node(lone).server.address}` }) });
    try {
      await there.produce(q, Array.from({ length: 20 }, (_, i) => `x ${i}`));
    } finally {
      there.close();
    }
    // The first consumer to see them takes all 20 (batchSize 100), whichever node it waits on.
    const first = await Promise.race(waiting.map((p, i) => p.then((items) => ({ i, items }))));
    const elapsed = Date.now() - started;
    assert.equal(first.items.length, 20, `consumer ${first.i} answered after ${elapsed} ms with ${first.items.length} items; homes ${placed.join(",")}`);
    assert.ok(elapsed < 25_000, `the items reached a waiting consumer before its wait ran out (${elapsed} ms)`);
    await admin.complete(first.items);
    // The others keep waiting; more items reach them the same way.
    const rest = waiting.filter((_, i) => i !== first.i);
    const other = new Client({ transport: createGrpcTransport({ baseUrl: `http://${cluster.node(placed[0]!).server.address}` }) });
    try {
      await other.produce(q, ["late"]);
    } finally {
      other.close();
    }
    const second = await Promise.race(rest);
    assert.deepEqual(second.map((i) => i.text), ["late"]);
    await admin.complete(second);
  } finally {
    for (const c of consumers) c.close();
    admin.close();
  }
});

test("a node killed -9 costs no error to Produce or Lease, and nothing acknowledged is lost", { skip }, async () => {
  const q = queueName("kill");
  const logged: string[] = [];
  const logger: Logger = { warn: (m) => logged.push(m), info: (m) => logged.push(m) };
  const admin = routed();
  await admin.createQueue(q, { partitions: 6, leaseTimeoutMs: 3_000 });
  const placed = await homes(q);
  const victim = "n3";
  const producer = routed({ retryProduce: true, logger });
  const consumer = routed({ logger: {} });
  const acknowledged = new Set<string>();
  const leasedIds = new Set<string>();
  const completeFailures: { partition: number; error: unknown }[] = [];
  const failures: unknown[] = [];
  let produced = 0;
  let stop = false;
  // A lease's items complete in one call. Their 3 s lease may still run out first on a
  // loaded machine: they then come back under new ids (leased again below), and the
  // Complete of the old ids is NOT_FOUND, rightly; any other NOT_FOUND is a failure.
  const settle = async (items: LeasedItem[]): Promise<void> => {
    try {
      await consumer.complete(items);
    } catch (error) {
      const expired = items.length > 0 && items.every((i) => i.leaseDeadline.getTime() <= Date.now());
      if (!(error instanceof ItemNotFound && expired)) throw error;
    }
  };
  const going = (what: string) => (): boolean => {
    if (failures.length) throw new Error(`an error reached the user (${what}): ${failures.map(String).join("; ")}`);
    return true;
  };
  try {
    const produce = (async () => {
      for (let batch = 0; !stop; batch++) {
        const result = await producer.produce(q, Array.from({ length: 20 }, (_, i) => `b${batch}-${i}`), { batchSize: 10 });
        for (const id of result.ids) acknowledged.add(id);
        produced += 20;
        await new Promise((r) => setTimeout(r, 10));
      }
    })().catch((error: unknown) => void failures.push(error));
    const consume = (async () => {
      while (!stop) {
        const items = await consumer.lease(q, { batchSize: 20, waitMs: 200 });
        for (const item of items) leasedIds.add(item.id);
        try {
          await settle(items);
        } catch (error) {
          completeFailures.push({ partition: items[0]!.partition, error });
        }
      }
    })().catch((error: unknown) => void failures.push(error));
    await waitUntil(() => going("before")() && produced >= 200 && leasedIds.size >= 100, 30_000, "traffic before the kill");
    await cluster.node(victim).server.kill();
    const killedAt = produced;
    // A client that still sees the dead node as live (its membership lasts a TTL more):
    // a Produce it sends there never arrives, so it goes to another node, even without
    // retryProduce.
    const lateLog: string[] = [];
    const late = routed({ logger: { warn: (m) => lateLog.push(m) } });
    try {
      for (let i = 0; i < 20; i++) {
        const result = await late.produce(q, [`late ${i}`, `late ${i}b`], { maxInFlight: 1 });
        for (const id of result.ids) acknowledged.add(id);
      }
    } finally {
      late.close();
    }
    // 20 batches, each sent to the dead node with a chance of a third or more until
    // the client knew: it did find out, from a refused connection.
    assert.ok(lateLog.some((m) => m.includes(`node ${victim} is down`)), `logged: ${lateLog.join(" | ")}`);
    await waitUntil(() => going("after the kill")() && produced >= killedAt + 400, 60_000, "produce going on after the kill");
    stop = true;
    await Promise.all([produce, consume]);
    going("at the end")();

    assert.ok(logged.some((m) => m.includes(`node ${victim} is down`)), `logged: ${logged.join(" | ")}`);
    for (const { partition, error } of completeFailures) {
      assert.ok(error instanceof Unavailable, String(error));
      assert.equal(placed[partition], victim, "only items homed on the dead node fail to complete");
    }

    // Back: every acknowledged item is there, on the node that took it.
    await cluster.restart(victim);
    await allLive();
    await waitUntil(
      async () => {
        const items = await consumer.lease(q, { batchSize: 100, waitMs: 500 });
        for (const item of items) leasedIds.add(item.id);
        await settle(items);
        return [...acknowledged].every((id) => leasedIds.has(id)) && (await admin.queueStats(q)).total === 0;
      },
      60_000,
      "every acknowledged item leased after the restart",
    );
  } finally {
    stop = true;
    producer.close();
    consumer.close();
    admin.close();
  }
});

test("a Worker on a routing client drains every node's partitions, settling each item at its home", { skip }, async () => {
  const q = queueName("worker");
  const client = routed();
  try {
    await client.createQueue(q, { partitions: 3 });
    const placed = await homes(q);
    await produceOnEach(q, (n, i) => `job ${30 * n + i}`, 30, 10);
    const seen = new Map<string, number>();
    const worker = new Worker(
      client,
      q,
      (item) => {
        seen.set(placed[item.partition]!, (seen.get(placed[item.partition]!) ?? 0) + 1);
        if (item.text === "job 7" && item.attempts === 1) throw new Error("once");
      },
      { concurrency: 4, batchSize: 10, leaseWaitMs: 500, hooks: {}, handleSignals: false, retryBackoff: () => 0 },
    );
    const running = worker.run();
    await waitUntil(() => worker.stats.completed === 90, 30_000, "90 items completed");
    await worker.stop();
    await running;
    assert.equal(worker.stats.retried, 1);
    assert.equal(seen.size, 3, "items of every node's partitions");
    // Every completion (by Complete, or carried by the next Lease) was counted once: a
    // node that passed one on to the home would count it too (a Lease's completions are
    // counted by the node it reached, a forwarded Complete again by the home).
    let completed = 0;
    let retried = 0;
    for (const node of cluster.nodes) {
      completed += await cluster.metric(node.id, "querator_items_total", { queue: q, action: "completed" });
      retried += await cluster.metric(node.id, "querator_items_total", { queue: q, action: "retried" });
    }
    assert.equal(completed, 90);
    assert.equal(retried, 1);
    assert.equal((await client.queueStats(q)).total, 0);
  } finally {
    client.close();
  }
});

/** A queue whose partitions 0 and 1 (on two nodes) hold one item each under the same id:
 * each node issues ids from its own counters (docs/cluster.md, Limits), so an item is
 * named by its partition and its id together. */
async function oneIdInTwoPartitions(client: Client, q: string, leaseTimeoutMs?: number): Promise<void> {
  await client.createQueue(q, { partitions: 3, ...(leaseTimeoutMs ? { leaseTimeoutMs } : {}) });
  await waitUntil(async () => new Set(await homes(q)).size === 3, 20_000, "three homes");
  const ids: string[] = [];
  for (const p of [0, 1]) ids.push(...(await client.importItems(q, [{ payload: new TextEncoder().encode(`in ${p}`) }], { partition: p })));
  assert.equal(ids[0], ids[1], `the test needs one id in two partitions, got ${ids}`);
}

test("a Worker keeps alive each of two items of one id in two partitions: neither is lost and handled again", { skip }, async () => {
  const q = queueName("sameid");
  const client = routed();
  try {
    await oneIdInTwoPartitions(client, q, 2_000);
    const started: string[] = [];
    let secondDone = false;
    const worker = new Worker(
      client,
      q,
      async (item) => {
        started.push(item.text);
        if (started.length === 1) {
          // Held for 2.5 lease timeouts while the other is handled at once.
          await waitUntil(() => secondDone, 20_000, "the other item handled");
          await new Promise((r) => setTimeout(r, 5_000));
          return;
        }
        secondDone = true;
      },
      { concurrency: 2, leaseWaitMs: 5_000, hooks: {}, handleSignals: false },
    );
    const running = worker.run();
    // Every item started is settled (an item handled again adds one to both).
    await waitUntil(() => started.length >= 2 && worker.stats.completed + worker.stats.lost >= started.length, 30_000, "every item settled");
    await worker.stop();
    await running;
    assert.deepEqual({ completed: worker.stats.completed, lost: worker.stats.lost }, { completed: 2, lost: 0 });
    assert.deepEqual(started.sort(), ["in 0", "in 1"]);
    assert.equal((await client.queueStats(q)).total, 0);
  } finally {
    client.close();
  }
});

test("a single server: one ClusterInfo on the first data call, then nothing but the calls themselves", async () => {
  const metrics = `127.0.0.1:${await freePort()}`;
  const server = await ServerProcess.start({ args: ["--metrics-address", metrics] });
  const count = async (method: string): Promise<number> => {
    const text = await (await fetch(`http://${metrics}/metrics`)).text();
    return text
      .split("\n")
      .filter((l) => l.startsWith("querator_rpc_requests_total{") && l.includes(`method="${method}"`))
      .reduce((n, l) => n + Number(l.slice(l.lastIndexOf(" ") + 1)), 0);
  };
  const client = new Client({ address: server.address });
  try {
    const q = queueName("single");
    await client.createQueue(q, { partitions: 2 });
    assert.equal(client.clustered, undefined, "admin calls do not ask");
    for (let i = 0; i < 5; i++) {
      await client.produce(q, [`a ${i}`, `b ${i}`]);
      const items = await client.lease(q, { batchSize: 2, waitMs: 1000 });
      await client.extend(items);
      await client.complete(items);
    }
    assert.equal(client.clustered, false);
    assert.equal(await count("ClusterInfo"), 1);
    assert.equal(await count("GetQueueStats"), 0, "no counts asked of a single server");
    assert.equal(await count("Complete"), 5, "one per lease (a lease is of one partition)");
  } finally {
    client.close();
    await server.stop();
  }
});

test("a node whose storage fails stays in use: its UNAVAILABLE is about its items, not the node", { skip }, async () => {
  const q = queueName("faulty");
  const logged: string[] = [];
  const client = routed({ logger: { warn: (m) => logged.push(m), info: (m) => logged.push(m) } });
  try {
    await client.createQueue(q, { partitions: 3 });
    const placed = await homes(q);
    await client.produce(q, Array.from({ length: 30 }, (_, i) => `f ${i}`), { batchSize: 5 });
    const items = await drain(client, q, 30);
    const sick = placed[items[0]!.partition]!;
    const there = items.filter((i) => placed[i.partition] === sick);
    writeFileSync(cluster.node(sick).faultFile, "io-error\n");
    try {
      await assert.rejects(client.complete(there), (e: unknown) => e instanceof Unavailable && /storage|faulty/.test(e.message));
      // The node answered: it is not taken for gone. Produces keep going (retried, as
      // the server answered that a batch was not stored; its partitions, once marked
      // faulty, are passed over by the node itself).
      await client.produce(q, Array.from({ length: 20 }, (_, i) => `g ${i}`), { batchSize: 2, retry: true });
      assert.deepEqual(logged, []);
    } finally {
      rmSync(cluster.node(sick).faultFile, { force: true });
    }
    await waitUntil(
      async () => {
        try {
          await client.complete(there.filter((i) => i.state === "leased"));
          return true;
        } catch (error) {
          if (error instanceof Unavailable) return false;
          throw error;
        }
      },
      30_000,
      "the items complete once the storage works again",
    );
    await client.complete(items.filter((i) => placed[i.partition] !== sick));
    await drain(client, q, 20).then((rest) => client.complete(rest));
    assert.deepEqual(logged, []);
  } finally {
    client.close();
  }
});

test("bootstrap addresses: the first that answers tells the client the rest", { skip }, async () => {
  const dead = `127.0.0.1:${await freePort()}`; // nothing listens there
  const client = new Client({ addresses: [dead, cluster.addresses[1]!], timeoutMs: 10_000, retries: 0 });
  try {
    const q = queueName("boot");
    await client.createQueue(q, { partitions: 3 });
    assert.equal(client.clustered, true);
    await client.produce(q, Array.from({ length: 30 }, (_, i) => `b ${i}`), { batchSize: 1 });
    const items = await drain(client, q, 30);
    await client.complete(items);
    // Every node took part, the one never named among them.
    const placed = await homes(q);
    assert.deepEqual(new Set(items.map((i) => placed[i.partition])), new Set(["n1", "n2", "n3"]));
  } finally {
    client.close();
  }
});

test("the map is read once for many concurrent first calls (one ClusterInfo at a time)", { skip }, async () => {
  const q = queueName("flight");
  const admin = routed();
  await admin.createQueue(q, { partitions: 3 });
  admin.close();
  const infos = async (): Promise<number> => {
    let n = 0;
    for (const node of cluster.nodes) n += await cluster.metric(node.id, "querator_rpc_requests_total", { method: "ClusterInfo" });
    return n;
  };
  const before = await infos();
  const client = routed();
  try {
    await Promise.all(Array.from({ length: 20 }, (_, i) => client.produce(q, [`c ${i}`])));
    assert.equal(client.clustered, true);
    assert.equal(await infos(), before + 1);
    assert.equal((await client.queueStats(q)).total, 20);
  } finally {
    client.close();
  }
});

test("burst mode waits for the items of a killed node, then drains them once it is back", { skip }, async () => {
  const q = queueName("burst");
  const victim = "n3";
  await allLive();
  const client = routed();
  try {
    await client.createQueue(q, { partitions: 3, leaseTimeoutMs: 30_000 });
    const placed = await homes(q);
    await produceOnEach(q, (n, i) => `job ${30 * n + i}`, 30, 10);
    const onVictim = (await client.queueStats(q)).partitions
      .filter((p) => placed[p.partition] === victim)
      .reduce((n, p) => n + p.total, 0);
    assert.ok(onVictim > 0, `homes ${placed.join(",")}`);
    await cluster.node(victim).server.kill();
    await waitUntil(async () => (await client.queueStats(q)).partitions.some((p) => p.faulty), 30_000, "the dead node's partitions faulty");
    const faulty = (await client.queueStats(q)).partitions.filter((p) => p.faulty);
    assert.ok(faulty.every((p) => p.total === 0 && p.failure.includes(victim)), JSON.stringify(faulty));
    const seen = new Set<string>();
    const options = { concurrency: 4, leaseWaitMs: 500, handleSignals: false };

    // A bound on the wait: run() throws rather than resolve as if the queue were empty.
    const hasty = new Worker(client, q, (item) => void seen.add(item.text), { ...options, hooks: {}, faultyTimeoutMs: 1_500 });
    await assert.rejects(hasty.run({ untilEmpty: true }), (error: unknown) => {
      assert.ok(error instanceof Unavailable && error.message.includes("stayed faulty") && error.message.includes(victim), String(error));
      return true;
    });
    assert.equal(seen.size, 90 - onVictim, "what the live nodes held, handled");

    // No bound: it waits, saying what for, and drains the node's items once it is back.
    const waits: string[] = [];
    const onWaitFaulty = (parts: readonly { failure: string }[]): void => void waits.push(parts.map((p) => p.failure).join("; "));
    const worker = new Worker(client, q, (item) => void seen.add(item.text), { ...options, hooks: { onWaitFaulty } });
    let returned = false;
    const running = worker.run({ untilEmpty: true }).then(() => void (returned = true));
    await new Promise((r) => setTimeout(r, 3_000));
    assert.equal(returned, false, `run({ untilEmpty: true }) resolved with ${onVictim} items on a dead node`);
    assert.ok(waits.length >= 1 && waits[0]!.includes(victim), waits.join(" | "));
    await cluster.restart(victim);
    await running;
    assert.equal(seen.size, 90);
    assert.equal((await client.queueStats(q)).total, 0);
  } finally {
    if (!cluster.node(victim).server.running) await cluster.restart(victim);
    await allLive();
    client.close();
  }
});

test("a Complete and a Retry sent again through another node answer OK, the ids named already done", { skip }, async () => {
  const q = queueName("again");
  const admin = routed();
  try {
    await admin.createQueue(q, { partitions: 3, leaseTimeoutMs: 600_000 });
    const placed = await homes(q);
    assert.equal(new Set(placed).size, 3, `a partition on every node: ${placed.join(",")}`);
    const [home, away, other] = cluster.nodes;
    // Clients of one node alone (no routing): what they send to a partition another node
    // homes, that node forwards.
    const through = (address: string): Client => new Client({ transport: createGrpcTransport({ baseUrl: `http://${address}` }) });
    const first = through(away!.server.address);
    const second = through(other!.server.address);
    try {
      const producer = through(home!.server.address);
      await producer.produce(q, ["a", "b", "c"]).finally(() => producer.close());
      const crc32 = (zlib as { crc32?: (data: Uint8Array) => number }).crc32!;
      const key = Array.from({ length: 10_000 }, (_, i) => `k${i}`).find((k) => placed[crc32(Buffer.from(k)) % 3] === home!.id)!;
      const items = await first.lease(q, { batchSize: 3, waitMs: 1_000, leaseKey: key });
      assert.deepEqual(items.map((i) => i.text), ["a", "b", "c"]);
      assert.ok(items.every((i) => placed[i.partition] === home!.id), "leased from home's partition through away");
      const done = items.slice(0, 2);
      const refs = items.map(({ queueName, partition, id }) => ({ queueName, partition, id }));
      assert.deepEqual(await first.complete(done), { alreadyCompleted: [], keyItemsCompleted: 0 });
      assert.deepEqual(await first.retry(items[2]!), { deadIds: [], alreadyRetried: [] });
      // Sent again through another node, which forwards them: OK, and reported done.
      const again = await second.complete(refs.slice(0, 2));
      assert.deepEqual([...again.alreadyCompleted].sort(), done.map((i) => i.id).sort());
      assert.deepEqual(await second.retry(refs[2]!), { deadIds: [], alreadyRetried: [items[2]!.id] }); // back once
      await assert.rejects(second.complete([refs[0]!, { ...refs[0]!, id: `${refs[0]!.id}0` }]), ItemNotFound);
      assert.equal((await admin.queueStats(q)).partitions.reduce((n, p) => n + p.total, 0), 1);
    } finally {
      first.close();
      second.close();
    }
  } finally {
    admin.close();
  }
});
