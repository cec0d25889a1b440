/** messageId and the dead-letter fields on leased and stored items, and redriveItems,
 * against a real server. Deliveries are counted by messageId and payload, which the
 * contract keeps stable, never by the per-lease id. */
import assert from "node:assert/strict";
import { test } from "node:test";

import { Client, InvalidRequest, type LeasedItem } from "../src/index.js";
import { type ServerProcess, queueName, serveFile } from "./server.js";

let server: ServerProcess;
let client: Client;

serveFile((s, c) => ([server, client] = [s, c]));

async function leaseAll(q: string, n: number): Promise<LeasedItem[]> {
  const out: LeasedItem[] = [];
  while (out.length < n) {
    const got = await client.lease(q, { batchSize: n - out.length, waitMs: 2000 });
    assert.ok(got.length, `leased ${out.length} of ${n} from ${q}`);
    out.push(...got);
  }
  return out;
}

test("messageId is the produced id and stays through retries; a fresh item has no dead-letter fields", async () => {
  const q = queueName();
  await client.createQueue(q);
  const { ids } = await client.produce(q, ["one", "two"]);
  const first = await leaseAll(q, 2);
  assert.deepEqual(first.map((i) => i.messageId), ids);
  for (const item of first) {
    assert.equal(item.sourceId, "");
    assert.equal(item.deadReason, undefined);
    assert.equal(item.deadAt, undefined);
    assert.equal(item.deadAttempts, 0);
  }
  await client.retry(first);
  const again = await leaseAll(q, 2);
  assert.deepEqual(again.map((i) => [i.text, i.messageId, i.attempts]), [["one", ids[0], 2], ["two", ids[1], 2]]);
  assert.ok(again.every((i, n) => i.id !== first[n]!.id), "the lease id changes on redelivery");
  const stored = await client.listItems(q).toArray();
  assert.deepEqual(stored.map((s) => s.messageId), ids);
});

test("dead letters carry why, when and after how many attempts they died, leased and listed", async () => {
  const dlq = queueName("dlq");
  const q = queueName();
  await client.createQueue(dlq);
  await client.createQueue(q, { deadQueue: dlq, maxAttempts: 2 });
  const { ids } = await client.produce(q, ["given-up", "worn-out"]);
  const before = Date.now();
  const [givenUp, wornOut] = await leaseAll(q, 2);
  await givenUp!.retry({ dead: true });
  await wornOut!.retry();
  const [second] = await leaseAll(q, 1);
  assert.equal(second!.attempts, 2);
  await second!.retry(); // its last attempt: the server dead-letters it

  const dead = await leaseAll(dlq, 2);
  const byText = new Map(dead.map((i) => [i.text, i]));
  const a = byText.get("given-up")!;
  const b = byText.get("worn-out")!;
  assert.equal(a.messageId, ids[0]);
  assert.equal(a.sourceId, givenUp!.id);
  assert.equal(a.deadReason, "retry_dead");
  assert.equal(a.deadAttempts, 1);
  assert.equal(a.attempts, 1, "attempts counts leases in the dead-letter queue");
  assert.ok(a.deadAt instanceof Date && a.deadAt.getTime() >= before - 5000 && a.deadAt.getTime() <= Date.now() + 5000, String(a.deadAt));
  assert.equal(b.messageId, ids[1]);
  assert.equal(b.sourceId, second!.id);
  assert.equal(b.deadReason, "max_attempts");
  assert.equal(b.deadAttempts, 2);

  await client.retry(dead); // back to the dead-letter queue's ready items, to list them
  const listed = await client.listItems(dlq).toArray();
  assert.deepEqual(
    listed.map((s) => [s.messageId, s.deadReason, s.deadAttempts, s.deadAt?.getTime()]).sort(),
    [[ids[0], "retry_dead", 1, a.deadAt!.getTime()], [ids[1], "max_attempts", 2, b.deadAt!.getTime()]].sort(),
  );
});

test("importItems keeps messageId and the dead-letter fields", async () => {
  const q = queueName("dlq");
  await client.createQueue(q);
  const deadAt = new Date(Date.UTC(2026, 0, 2, 3, 4, 5, 678));
  await client.importItems(q, [
    { payload: Buffer.from("imported"), messageId: "m-1", sourceId: "s-1", deadReason: "expired", deadAt, deadAttempts: 4, attempts: 0 },
  ]);
  const [stored] = await client.listItems(q).toArray();
  assert.equal(stored!.messageId, "m-1");
  assert.equal(stored!.sourceId, "s-1");
  assert.equal(stored!.deadReason, "expired");
  assert.equal(stored!.deadAt?.getTime(), deadAt.getTime());
  assert.equal(stored!.deadAttempts, 4);
  await assert.rejects(client.importItems(q, [{ payload: Buffer.from("x"), deadReason: "bored" as never }]), RangeError);
});

test("redriveItems moves dead letters back by kind and reason, page by page, up to a limit", async () => {
  const dlq = queueName("dlq");
  const q = queueName();
  const other = queueName("other");
  await client.createQueue(dlq);
  await client.createQueue(q, { deadQueue: dlq, maxAttempts: 1 });
  await client.createQueue(other);
  const emails = await client.produce(q, ["e1", "e2", "e3"], { kind: "email" });
  const sms = await client.produce(q, ["s1", "s2"], { kind: "sms" });
  const leased = await leaseAll(q, 5);
  const bySms = leased.filter((i) => i.kind === "sms");
  await client.retry(leased.filter((i) => i.kind === "email"), { dead: true }); // retry_dead
  await client.retry(bySms); // last attempt: max_attempts

  // Filters: nothing is both an email and out of attempts.
  assert.deepEqual(await client.redriveItems(dlq, { kind: "email", deadReason: "max_attempts" }), { moved: 0, messageIds: [], skipped: 0 });
  // One email, to another queue.
  const one = await client.redriveItems(dlq, { kind: "email", limit: 1, to: other });
  assert.equal(one.moved, 1);
  assert.ok(emails.ids.includes(one.messageIds[0]!));
  // The rest of the emails, back where they died.
  const rest = await client.redriveItems(dlq, { deadReason: "retry_dead" });
  assert.equal(rest.moved, 2);
  assert.deepEqual([...one.messageIds, ...rest.messageIds].sort(), [...emails.ids].sort());
  // The sms by reason.
  const texts = await client.redriveItems(dlq, { deadReason: "max_attempts" });
  assert.deepEqual([...texts.messageIds].sort(), [...sms.ids].sort());
  assert.equal((await client.queueStats(dlq)).total, 0);

  const back = await leaseAll(q, 4);
  assert.equal(back.filter((i) => i.kind === "sms").length, 2);
  assert.deepEqual(back.map((i) => i.messageId).sort(), [...rest.messageIds, ...texts.messageIds].sort());
  const moved = await leaseAll(other, 1);
  assert.deepEqual(moved.map((i) => i.messageId), one.messageIds);
  assert.equal(moved[0]!.deadReason, undefined, "a redriven item is no dead letter any more");
  assert.notEqual(moved[0]!.sourceId, "", "its id in the dead-letter queue");

  await assert.rejects(client.redriveItems(dlq, { limit: 0 }), RangeError);
  await assert.rejects(client.redriveItems(dlq, { to: dlq }), InvalidRequest);
});

test("redriveItems pages past 1,000 items", async () => {
  const dlq = queueName("dlq");
  const q = queueName();
  await client.createQueue(dlq);
  await client.createQueue(q, { deadQueue: dlq });
  const n = 1200;
  const { ids } = await client.produce(q, Array.from({ length: n }, (_, i) => `p${i}`));
  for (let left = n; left > 0; ) {
    const got = await client.lease(q, { batchSize: Math.min(left, 1000), waitMs: 2000 });
    await client.retry(got, { dead: true });
    left -= got.length;
  }
  const done = await client.redriveItems(dlq);
  assert.equal(done.moved, n);
  assert.deepEqual(new Set(done.messageIds), new Set(ids));
  assert.equal((await client.queueStats(q)).total, n);
});
