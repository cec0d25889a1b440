import assert from "node:assert/strict";
import { describe, test } from "node:test";

import {
  Cancelled,
  Client,
  FailedPrecondition,
  InvalidRequest,
  ItemNotFound,
  LeasedItem,
  NotLeased,
  QueueExists,
  QueueNotFound,
  isLeaseLost,
} from "../src/index.js";
import { type ServerProcess, queueName, waitUntil, serveFile } from "./server.js";

let server: ServerProcess;
let client: Client;

serveFile((s, c) => ([server, client] = [s, c]));

describe("produce, lease, complete", () => {
  test("items go through unchanged and complete for good", async () => {
    const q = queueName();
    const info = await client.createQueue(q, { leaseTimeoutMs: 30_000, maxAttempts: 3 });
    assert.equal(info.name, q);
    assert.equal(info.leaseTimeoutMs, 30_000);
    assert.equal(info.maxAttempts, 3);
    assert.ok(info.createdAt instanceof Date);

    const bytes = Uint8Array.from({ length: 256 }, (_, i) => i);
    const produced = await client.produce(q, [
      "plain text",
      bytes,
      { payload: "{\"n\":1}", encoding: "application/json", kind: "job", reference: "ref-1", metadata: { traceparent: "00-abc-def-01", "k": "v" } },
    ]);
    assert.equal(produced.ids.length, 3);
    assert.equal(new Set(produced.ids).size, 3);
    assert.equal(produced.duplicates, 0);

    const items = await client.lease(q, { batchSize: 10, waitMs: 1000 });
    assert.deepEqual(items.map((i) => i.id), produced.ids);
    const [text, binary, rich] = items as [LeasedItem, LeasedItem, LeasedItem];
    assert.equal(text.text, "plain text");
    assert.deepEqual(binary.payload, bytes);
    assert.deepEqual(rich.json(), { n: 1 });
    assert.equal(rich.encoding, "application/json");
    assert.equal(rich.kind, "job");
    assert.equal(rich.reference, "ref-1");
    assert.deepEqual({ ...rich.metadata }, { traceparent: "00-abc-def-01", k: "v" });
    assert.equal(rich.attempts, 1);
    assert.ok(rich.leaseDeadline.getTime() > Date.now());
    assert.equal((await client.queueStats(q)).totalLeased, 3);

    await client.complete(items);
    assert.ok(items.every((i) => i.state === "completed"));
    const stats = await client.queueStats(q);
    assert.equal(stats.total, 0);
    assert.equal(stats.partitions.length, 1);
    // The partition's counters: what went through it, not what is in it.
    assert.equal(stats.partitions[0]?.produced, 3);
    assert.equal(stats.partitions[0]?.completed, 3);

    // Completed is gone: a second complete is answered as done (the first may have lost
    // its reply); an id never leased is a lost lease.
    await client.complete(text);
    const never = { queueName: q, partition: 0, id: `${text.id}0` };
    await assert.rejects(client.complete(never), (e: unknown) => e instanceof ItemNotFound && isLeaseLost(e));
  });

  test("a large produce is split into requests and keeps the order of ids", async () => {
    const q = queueName();
    await client.createQueue(q);
    const payloads = Array.from({ length: 2500 }, (_, i) => `item ${i}`);
    const produced = await client.produce(q, payloads, { batchSize: 1000 });
    assert.equal(produced.ids.length, 2500);
    const seen: string[] = [];
    while (seen.length < 2500) {
      const batch = await client.lease(q, { batchSize: 1000, waitMs: 1000 });
      assert.ok(batch.length > 0);
      for (const item of batch) assert.equal(item.text, payloads[seen.length + batch.indexOf(item)]);
      seen.push(...batch.map((i) => i.id));
      await client.complete(batch);
    }
    assert.deepEqual(seen, produced.ids);
  });

  test("a failed produce on the queue's stream fails alone, with the unary call's error", async () => {
    const q = queueName();
    await client.createQueue(q);
    const unary = new Client({ address: server.address, streams: false });
    try {
      for (const c of [client, unary]) {
        await assert.rejects(c.produce(q, [{ payload: "x", idempotencyKey: "k".repeat(600) }]), (e: unknown) => {
          assert.ok(e instanceof InvalidRequest, String(e));
          assert.ok(e.fieldViolations.some((v) => v.field.includes("idempotency_key")), JSON.stringify(e.fieldViolations));
          return true;
        });
        // The stream goes on: the next produce on it is stored.
        assert.equal((await c.produce(q, ["after"])).ids.length, 1);
      }
    } finally {
      unary.close();
    }
    assert.equal((await client.queueStats(q)).total, 2);
  });

  test("a produce that fails part way says what it stored", async () => {
    const q = queueName();
    await client.createQueue(q);
    const items = Array.from({ length: 2500 }, (_, i) => ({ payload: `item ${i}`, ...(i === 2100 ? { idempotencyKey: "k".repeat(600) } : {}) }));
    await assert.rejects(client.produce(q, items, { batchSize: 1000 }), (e: unknown) => {
      assert.ok(e instanceof InvalidRequest);
      assert.ok(e.produced);
      assert.equal(e.produced.ids.length, 2500);
      assert.ok(e.produced.ids.slice(0, 2000).every(Boolean));
      assert.ok(e.produced.ids.slice(2000).every((id) => id === ""));
      return true;
    });
    assert.equal((await client.queueStats(q)).total, 2000);
  });

  test("a lease completes the previous batch in the same call", async () => {
    const q = queueName();
    await client.createQueue(q);
    await client.produce(q, ["a", "b", "c", "d"]);
    const first = await client.lease(q, { batchSize: 2, waitMs: 0 });
    const second = await client.lease(q, { batchSize: 2, waitMs: 0, complete: first });
    assert.ok(first.every((i) => i.state === "completed"));
    assert.deepEqual(second.map((i) => i.text), ["c", "d"]);
    assert.equal((await client.queueStats(q)).total, 2);
  });

  test("for await over leased items; leaving the loop gives the rest of the batch back", async () => {
    const q = queueName();
    await client.createQueue(q);
    await client.produce(q, ["1", "2", "3", "4", "5"]);
    const got: string[] = [];
    for await (const item of client.leased(q, { batchSize: 5, waitMs: 500 })) {
      got.push(item.text);
      await item.complete();
      if (got.length === 2) break;
    }
    assert.deepEqual(got, ["1", "2"]);
    const stats = await client.queueStats(q);
    assert.equal(stats.total, 3);
    assert.equal(stats.totalLeased, 0, "the unconsumed items were given back at once");
  });
});

describe("retry", () => {
  test("retry to the dead-letter queue, and by running out of attempts", async () => {
    const dlq = queueName("dlq");
    const q = queueName();
    await client.createQueue(dlq);
    await client.createQueue(q, { deadQueue: dlq, maxAttempts: 2 });
    await client.produce(q, ["to-dead", "to-exhaust"]);
    const [toDead, toExhaust] = (await client.lease(q, { batchSize: 2, waitMs: 1000 })) as [LeasedItem, LeasedItem];

    await toDead.retry({ dead: true });
    assert.equal(toDead.state, "dead");
    await toExhaust.retry();
    assert.equal(toExhaust.state, "retried");
    const again = await client.lease(q, { batchSize: 2, waitMs: 1000 });
    assert.deepEqual(again.map((i) => [i.text, i.attempts]), [["to-exhaust", 2]]);
    await again[0]!.retry(); // its second attempt failed: max_attempts reached

    const dead = await client.lease(dlq, { batchSize: 10, waitMs: 2000 });
    assert.deepEqual(dead.map((i) => i.text).sort(), ["to-dead", "to-exhaust"]);
    assert.equal((await client.queueStats(q)).total, 0);
  });

  test("an item the server dead-letters for running out of attempts is marked dead, its neighbour retried", async () => {
    const dlq = queueName("dlq");
    const q = queueName();
    await client.createQueue(dlq);
    await client.createQueue(q, { deadQueue: dlq, maxAttempts: 2 });
    await client.produce(q, "spent");
    const [first] = await client.lease(q, { batchSize: 1, waitMs: 1000 });
    await first!.retry();
    await client.produce(q, "fresh");
    const both = await client.lease(q, { batchSize: 2, waitMs: 1000 });
    const spent = both.find((i) => i.text === "spent")!;
    const fresh = both.find((i) => i.text === "fresh")!;
    assert.equal(spent.attempts, 2);
    assert.equal(fresh.attempts, 1);

    const result = await client.retry(both);
    assert.deepEqual(result.deadIds, [spent.id]);
    assert.equal(spent.state, "dead");
    assert.equal(fresh.state, "retried");
    const dead = await client.lease(dlq, { batchSize: 10, waitMs: 2000 });
    assert.deepEqual(dead.map((i) => i.text), ["spent"]);
  });

  test("retry later schedules the item", async () => {
    const q = queueName();
    await client.createQueue(q);
    await client.produce(q, "later");
    const [item] = await client.lease(q, { batchSize: 1, waitMs: 1000 });
    await item!.retry({ inMs: 60_000 });
    const stats = await client.queueStats(q);
    assert.equal(stats.scheduled, 1);
    assert.equal(stats.total, 0);
    const scheduled = await client.listScheduledItems(q).toArray();
    assert.equal(scheduled.length, 1);
    assert.ok(scheduled[0]!.enqueueAt!.getTime() > Date.now() + 50_000);
  });
});

describe("extend", () => {
  test("extend moves the lease deadline; an extended item is not re-leased", async () => {
    const q = queueName();
    await client.createQueue(q, { leaseTimeoutMs: 1500 });
    await client.produce(q, "long work");
    const [item] = (await client.lease(q, { batchSize: 1, waitMs: 1000 })) as [LeasedItem];
    const before = item.leaseDeadline.getTime();
    const deadline = await item.extend({ leaseTimeoutMs: 20_000 });
    assert.ok(deadline.getTime() > before + 15_000, `${deadline.toISOString()} vs ${new Date(before).toISOString()}`);
    assert.equal(item.leaseDeadline.getTime(), deadline.getTime());
    // Past the original lease: still ours, nothing to lease.
    await new Promise((r) => setTimeout(r, 2000));
    assert.deepEqual(await client.lease(q, { batchSize: 1, waitMs: 0 }), []);
    await item.complete();
  });

  test("extend of an item whose lease ran out is a lost lease", async () => {
    const q = queueName();
    await client.createQueue(q, { leaseTimeoutMs: 300 });
    await client.produce(q, "short");
    const [item] = (await client.lease(q, { batchSize: 1, waitMs: 1000 })) as [LeasedItem];
    await new Promise((r) => setTimeout(r, 1200));
    await assert.rejects(item.extend(), (e: unknown) => isLeaseLost(e) && (e instanceof NotLeased || e instanceof ItemNotFound));
  });
});

describe("queues and errors", () => {
  test("queue admin: create, get, update, list by pages, clear, delete", async () => {
    const prefix = queueName("admin");
    for (let i = 0; i < 5; i++) await client.createQueue(`${prefix}-${i}`);
    await assert.rejects(client.createQueue(`${prefix}-0`), QueueExists);
    const updated = await client.updateQueue(`${prefix}-1`, { reference: "note", maxAttempts: 7 });
    assert.equal(updated.reference, "note");
    assert.equal(updated.maxAttempts, 7);
    assert.equal((await client.getQueue(`${prefix}-1`)).maxAttempts, 7);

    const pages = [];
    for await (const page of client.listQueues({ pageSize: 2 }).pages()) pages.push(page);
    assert.ok(pages.length >= 3);
    const names: string[] = [];
    for await (const queue of client.listQueues({ pageSize: 2 })) names.push(queue.name);
    assert.deepEqual(names.filter((n) => n.startsWith(prefix)), [0, 1, 2, 3, 4].map((i) => `${prefix}-${i}`));

    await client.produce(`${prefix}-2`, ["x", "y"]);
    assert.equal((await client.listItems(`${prefix}-2`).toArray()).length, 2);
    await client.clearQueue(`${prefix}-2`);
    assert.equal((await client.queueStats(`${prefix}-2`)).total, 0);
    await client.deleteQueue(`${prefix}-2`);
    await assert.rejects(client.getQueue(`${prefix}-2`), QueueNotFound);
  });

  test("bad input is InvalidRequest naming the field", async () => {
    const q = queueName();
    await client.createQueue(q);
    await assert.rejects(client.lease(q, { batchSize: 5000, waitMs: 0 }), (e: unknown) => {
      assert.ok(e instanceof InvalidRequest);
      assert.equal(e.status, "INVALID_ARGUMENT");
      assert.ok(e.fieldViolations.some((v) => v.field === "batch_size"), JSON.stringify(e.fieldViolations));
      return true;
    });
    await assert.rejects(client.produce("no-such-queue-here", "x"), QueueNotFound);
  });

  test("an AbortSignal ends a waiting lease; a call deadline bounds the wait", async () => {
    const q = queueName();
    await client.createQueue(q);
    let started = Date.now();
    await assert.rejects(client.lease(q, { waitMs: 20_000, signal: AbortSignal.timeout(300) }), Cancelled);
    assert.ok(Date.now() - started < 10_000);
    // The abandoned Lease takes nothing: an item produced now goes to the next one.
    await client.produce(q, "after the abort");
    const [item] = await client.lease(q, { waitMs: 5000 });
    assert.equal(item?.text, "after the abort");
    assert.equal(item?.attempts, 1);
    await item!.complete();
    // The server answers a Lease a little before the call's deadline: OK, no items.
    started = Date.now();
    assert.deepEqual(await client.lease(q, { waitMs: 20_000, timeoutMs: 1000 }), []);
    assert.ok(Date.now() - started < 10_000);
    // A closed client refuses calls and cancels those in flight.
    const other = new Client({ address: server.address });
    const waiting = other.lease(q, { waitMs: 20_000 });
    setTimeout(() => other.close(), 200);
    await assert.rejects(waiting, Cancelled);
    await assert.rejects(other.getQueue(q), /closed/);
  });
});

describe("pause and resume", () => {
  test("a paused queue takes produce and hands out nothing; a waiting lease is served on resume", async () => {
    const q = queueName();
    await client.createQueue(q);
    const info = await client.pauseQueue(q);
    assert.equal(info.paused, true);
    assert.equal(info.producePaused, false);
    assert.equal((await client.getQueue(q)).paused, true);
    await client.produce(q, ["a", "b"]);
    const started = Date.now();
    assert.deepEqual(await client.lease(q, { batchSize: 5, waitMs: 300 }), []);
    assert.ok(Date.now() - started >= 250, "the lease waited its time, as on an empty queue");
    const waiting = client.lease(q, { batchSize: 5, waitMs: 20_000 });
    await waitUntil(async () => (await client.queueStats(q)).leaseWaiting === 1, 10_000, "the lease to wait");
    const resumed = await client.resumeQueue(q);
    assert.equal(resumed.paused, false);
    const items = await waiting;
    assert.deepEqual(items.map((i) => i.text), ["a", "b"]);
    await client.complete(items);
  });

  test("paused for produce: produce is refused with FailedPrecondition until resumed", async () => {
    const q = queueName();
    await client.createQueue(q);
    const info = await client.pauseQueue(q, { produce: true });
    assert.equal(info.producePaused, true);
    await assert.rejects(client.produce(q, ["x"]), (e: unknown) => e instanceof FailedPrecondition && /paused for produce/.test(String(e)));
    await client.resumeQueue(q);
    assert.equal((await client.produce(q, ["x"])).ids.length, 1);
    await assert.rejects(client.pauseQueue(queueName()), QueueNotFound);
  });
});
