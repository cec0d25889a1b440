import assert from "node:assert/strict";
import { test } from "node:test";

import { Client, DeadLetter, type LeasedItem, QueueNotFound, Worker } from "../src/index.js";
import { type ServerProcess, queueName, waitUntil, serveFile } from "./server.js";

let server: ServerProcess;
let client: Client;

serveFile((s, c) => ([server, client] = [s, c]));

const quiet = {}; // no hooks: no console output from expected failures

test("the worker completes on success, retries with backoff on a throw, dead-letters on DeadLetter", async () => {
  const dlq = queueName("dlq");
  const q = queueName();
  await client.createQueue(dlq);
  await client.createQueue(q, { deadQueue: dlq });
  const payloads = Array.from({ length: 50 }, (_, i) => `job ${i}`);
  await client.produce(q, [...payloads, "fail-once", "poison"]);

  const attempts = new Map<string, number[]>();
  const backoffAsked: number[] = [];
  const worker = new Worker(
    client,
    q,
    async (item: LeasedItem) => {
      attempts.set(item.text, [...(attempts.get(item.text) ?? []), item.attempts]);
      if (item.text === "fail-once" && item.attempts === 1) throw new Error("transient");
      if (item.text === "poison") throw new DeadLetter("cannot be handled");
    },
    { concurrency: 4, batchSize: 10, leaseWaitMs: 200, retryBackoff: (n) => (backoffAsked.push(n), 300), hooks: quiet, handleSignals: false },
  );
  const running = worker.run();
  await waitUntil(() => worker.stats.completed === 51 && worker.stats.dead === 1, 30_000, "all items handled");
  await worker.stop();
  await running;

  assert.deepEqual(attempts.get("fail-once"), [1, 2]);
  assert.deepEqual(backoffAsked, [1]);
  assert.deepEqual(attempts.get("poison"), [1]);
  for (const p of payloads) assert.deepEqual(attempts.get(p), [1], p);
  assert.equal(worker.stats.retried, 1);
  assert.equal(worker.stats.leased, 53);
  assert.equal((await client.queueStats(q)).total, 0);
  const dead = await client.lease(dlq, { batchSize: 10, waitMs: 1000 });
  assert.deepEqual(dead.map((i) => i.text), ["poison"]);
});

test("keep-alive: a handler that outlives its lease keeps it through Extend", async () => {
  const q = queueName();
  await client.createQueue(q, { leaseTimeoutMs: 2500 });
  await client.produce(q, "slow");
  const other = new Client({ address: server.address });
  let stolen: LeasedItem[] = [];
  let seenAttempts = 0;
  const worker = new Worker(
    client,
    q,
    async (item: LeasedItem) => {
      seenAttempts = item.attempts;
      // Two and a half lease lengths: without Extend the item would go back and another
      // consumer would get it. (Extends are due every 1.25 s: room for a loaded machine.)
      const until = Date.now() + 6250;
      while (Date.now() < until) {
        stolen = stolen.concat(await other.lease(q, { batchSize: 1, waitMs: 0 }));
        await new Promise((r) => setTimeout(r, 200));
      }
    },
    { concurrency: 1, leaseWaitMs: 200, hooks: quiet, handleSignals: false },
  );
  const running = worker.run();
  await waitUntil(() => worker.stats.completed === 1, 20_000, "the slow item completed");
  await worker.stop();
  await running;
  other.close();
  assert.deepEqual(stolen.map((i) => i.text), []);
  assert.equal(seenAttempts, 1);
  assert.ok(worker.stats.extended >= 2, `extended ${worker.stats.extended} times`);
  assert.equal(worker.stats.lost, 0);
  assert.equal((await client.queueStats(q)).total, 0);
});

test("graceful stop: running handlers finish and complete, leased items not started go back", async () => {
  const q = queueName();
  await client.createQueue(q, { leaseTimeoutMs: 60_000 });
  await client.produce(q, ["a", "b", "c", "d", "e", "f"]);
  let release: () => void = () => undefined;
  const gate = new Promise<void>((r) => (release = r));
  const started: string[] = [];
  const worker = new Worker(
    client,
    q,
    async (item: LeasedItem) => {
      started.push(item.text);
      await gate;
    },
    { concurrency: 2, batchSize: 2, leaseWaitMs: 200, hooks: quiet, handleSignals: false },
  );
  const running = worker.run();
  // Two running, two more leased and waiting for a slot (concurrency + batchSize).
  await waitUntil(() => started.length === 2 && worker.stats.leased === 4, 20_000, "two running, two waiting");
  const stopped = worker.stop();
  setTimeout(release, 300);
  await stopped;
  await running;

  assert.deepEqual(started, ["a", "b"]);
  assert.equal(worker.stats.completed, 2);
  assert.equal(worker.stats.released, 2);
  const stats = await client.queueStats(q);
  assert.equal(stats.total, 4, "c, d given back and e, f never leased");
  assert.equal(stats.totalLeased, 0);
  const back = await client.lease(q, { batchSize: 10, waitMs: 0 });
  // c and d were leased once before they were given back.
  assert.deepEqual(back.map((i) => [i.text, i.attempts]).sort(), [["c", 2], ["d", 2], ["e", 1], ["f", 1]]);
});

test("keep-alive goes on through a graceful stop while a handler finishes", async () => {
  const q = queueName();
  await client.createQueue(q, { leaseTimeoutMs: 2500 });
  await client.produce(q, "finishing");
  let started = false;
  const worker = new Worker(
    client,
    q,
    async () => {
      started = true;
      await new Promise((r) => setTimeout(r, 6250)); // two and a half lease lengths
    },
    { concurrency: 1, leaseWaitMs: 200, shutdownTimeoutMs: 30_000, hooks: quiet, handleSignals: false },
  );
  const running = worker.run();
  await waitUntil(() => started, 20_000, "the handler started");
  await worker.stop(); // returns once the handler finished and its item completed
  await running;
  assert.equal(worker.stats.completed, 1);
  assert.equal(worker.stats.lost, 0);
  assert.ok(worker.stats.extended >= 2, `extended ${worker.stats.extended} times`);
  assert.equal((await client.queueStats(q)).total, 0);
});

test("a worker stopped before it runs returns at once", async () => {
  const worker = new Worker(client, queueName("never"), () => undefined, { handleSignals: false });
  await worker.stop();
  await worker.run();
  assert.equal(worker.stats.leased, 0);
});

test("stop gives up on a handler that outlives shutdownTimeoutMs: its signal fires, its item goes back", async () => {
  const q = queueName();
  await client.createQueue(q, { leaseTimeoutMs: 60_000 });
  await client.produce(q, "stuck");
  let aborted = false;
  const worker = new Worker(
    client,
    q,
    (_item: LeasedItem, signal: AbortSignal) =>
      new Promise<void>((resolve) => signal.addEventListener("abort", () => ((aborted = true), resolve()), { once: true })),
    { concurrency: 1, leaseWaitMs: 200, shutdownTimeoutMs: 300, hooks: quiet, handleSignals: false },
  );
  const running = worker.run();
  await waitUntil(() => worker.stats.leased === 1, 20_000, "the item leased");
  await worker.stop();
  await running;
  assert.ok(aborted);
  assert.equal(worker.stats.completed, 0);
  assert.equal(worker.stats.released, 1);
  const [item] = await client.lease(q, { batchSize: 1, waitMs: 1000 });
  assert.equal(item?.text, "stuck");
  assert.equal(item?.attempts, 2);
});

test("SIGTERM stops a running worker gracefully", async () => {
  const q = queueName();
  await client.createQueue(q);
  const worker = new Worker(client, q, () => undefined, { leaseWaitMs: 5000, hooks: quiet });
  const running = worker.run();
  await waitUntil(() => process.listenerCount("SIGTERM") > 0, 10_000, "the signal handler");
  process.kill(process.pid, "SIGTERM");
  await running;
  assert.equal(process.listenerCount("SIGTERM"), 0);
});

test("a worker on a missing queue fails at start with QueueNotFound", async () => {
  const worker = new Worker(client, queueName("missing"), () => undefined, { handleSignals: false });
  await assert.rejects(worker.run(), QueueNotFound);
});
