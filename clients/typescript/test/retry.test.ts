/** The one RetryPolicy: what it retries and when, and that the client's loops ask it. */
import assert from "node:assert/strict";
import { createServer } from "node:net";
import { test } from "node:test";

import { Client, ItemNotFound, RetryPolicy, Unavailable, Worker, backoff } from "../src/index.js";
import { ServerProcess, queueName, waitUntil } from "./server.js";

/** A loopback port nothing listens on: connections to it are refused. */
async function closedPort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address() as { port: number };
  await new Promise<void>((resolve) => server.close(() => resolve()));
  return port;
}

test("a policy retries its kinds of error, up to its retries, after its backoff", () => {
  const policy = new RetryPolicy({ retries: 2, backoff: (attempt) => attempt * 10 });
  const unavailable = new Unavailable("down");
  assert.equal(policy.delay(1, unavailable), 10);
  assert.equal(policy.delay(2, unavailable), 20);
  assert.equal(policy.delay(3, unavailable), undefined);
  assert.equal(policy.delay(1, new ItemNotFound("gone")), undefined);
  assert.equal(policy.delay(1, new Error("not a QueratorError")), undefined);
  const onLost = new RetryPolicy({ retries: 1, backoff: () => 5, on: [ItemNotFound] });
  assert.equal(onLost.delay(1, new ItemNotFound("gone")), 5);
  assert.equal(onLost.delay(1, unavailable), undefined);
  assert.throws(() => new RetryPolicy({ retries: -1 }), RangeError);
});

test("the default backoff: 100 ms doubling to 2 s, 80-100 % of it", () => {
  const policy = new RetryPolicy();
  assert.equal(policy.retries, 3);
  for (const [attempt, full] of [[1, 100], [2, 200], [5, 1600], [6, 2000], [9, 2000]] as const) {
    const ms = policy.backoff(attempt);
    assert.ok(ms > 0.8 * full - 1e-9 && ms <= full, `attempt ${attempt}: ${ms}`);
  }
  assert.throws(() => backoff({ initialMs: 10, maximumMs: 5 }), RangeError);
});

test("calls and leased() back off by the client's policy, and give up where it says", async () => {
  const asked: number[] = [];
  const policy = new RetryPolicy({ retries: 2, backoff: (attempt) => (asked.push(attempt), 1) });
  const client = new Client({ address: `127.0.0.1:${await closedPort()}`, retryPolicy: policy, timeoutMs: 5_000 });
  try {
    await assert.rejects(client.getQueue("q"), Unavailable);
    assert.deepEqual(asked, [1, 2]); // two retries, then the error
    asked.length = 0;
    const loop = async (): Promise<void> => {
      for await (const _item of client.leased("q", { waitMs: 100 })) assert.fail("nothing to lease");
    };
    await assert.rejects(loop(), Unavailable);
    // Each Lease call retries twice; leased() itself tries the call again twice.
    assert.deepEqual(asked, [1, 2, 1, 1, 2, 2, 1, 2]);
  } finally {
    client.close();
  }
});

test("the Worker's Lease loop backs off by its client's policy after UNAVAILABLE", async () => {
  const server = await ServerProcess.start();
  // retries: 0, so the client's own calls never ask the backoff: every ask is the Worker's.
  const asked: number[] = [];
  const client = new Client({ address: server.address, retryPolicy: new RetryPolicy({ retries: 0, backoff: (attempt) => (asked.push(attempt), 20) }) });
  let worker: Worker | undefined;
  try {
    const q = queueName();
    await client.createQueue(q);
    await client.produce(q, ["one"]);
    worker = new Worker(client, q, () => undefined, { leaseWaitMs: 200, hooks: {}, handleSignals: false });
    const running = worker.run();
    await waitUntil(() => worker!.stats.completed === 1, 20_000, "the item handled");
    await server.kill();
    await waitUntil(() => asked.length >= 3, 20_000, "three backoffs");
    await worker.stop();
    await running;
    assert.deepEqual(asked.slice(0, 3), [1, 2, 3]); // by consecutive failures
    assert.ok(worker.stats.errors >= 3);
  } finally {
    await worker?.stop();
    client.close();
    await server.stop();
  }
});
