/** The Worker's features beside the Python one's: dispatch by kind, retry rules, handler
 * timeout, rate-limited failure logs and Prometheus metrics, against a real server.
 * Deliveries are counted by payload (stable), never by the per-lease id. */
import assert from "node:assert/strict";
import { connect } from "node:net";
import { test } from "node:test";

import { Registry } from "prom-client";

import { Client, DeadLetter, FailureLog, HandlerTimeout, type LeasedItem, RetryRule, Worker, type WorkerOptions } from "../src/index.js";
import { type ServerProcess, queueName, serveFile } from "./server.js";

let server: ServerProcess;
let client: Client;

serveFile((s, c) => ([server, client] = [s, c]));

const quick: WorkerOptions = { leaseWaitMs: 200, retryBackoff: () => 50, hooks: {}, handleSignals: false };

async function queueWithDlq(options: { maxAttempts?: number } = {}): Promise<[string, string]> {
  const dlq = queueName("dlq");
  const q = queueName();
  await client.createQueue(dlq);
  await client.createQueue(q, { deadQueue: dlq, ...options });
  return [q, dlq];
}

async function deadTexts(dlq: string): Promise<string[]> {
  return (await client.listItems(dlq).toArray()).map((s) => Buffer.from(s.payload).toString()).sort();
}

test("dispatch by kind: a handler map, worker.handler(), the default for other kinds, per-kind concurrency", async () => {
  const q = queueName();
  await client.createQueue(q);
  await client.produce(q, ["e1", "e2"], { kind: "email" });
  await client.produce(q, ["s1", "s2", "s3", "s4"], { kind: "slow" });
  await client.produce(q, ["x1"], { kind: "other" });
  await client.produce(q, ["n1"]);
  const seen: string[] = [];
  let slowNow = 0;
  let slowMax = 0;
  const worker = new Worker(client, q, (item) => void seen.push(`default:${item.kind}:${item.text}`), {
    ...quick,
    concurrency: 4,
    handlers: { email: (item) => void seen.push(`email:${item.text}`) },
  }).handler(
    "slow",
    async (item) => {
      slowMax = Math.max(slowMax, ++slowNow);
      await new Promise((r) => setTimeout(r, 100));
      slowNow--;
      seen.push(`slow:${item.text}`);
    },
    { concurrency: 1 },
  );
  await worker.run({ untilEmpty: true });
  assert.deepEqual(seen.sort(), ["default::n1", "default:other:x1", "email:e1", "email:e2", "slow:s1", "slow:s2", "slow:s3", "slow:s4"]);
  assert.equal(slowMax, 1, "kind 'slow' ran one at a time");
  assert.equal(worker.stats.completed, 8);
  assert.throws(() => worker.handler("late", () => undefined), /before the worker runs/);
  assert.throws(() => new Worker(client, q, { handlers: { a: { handler: () => undefined, concurrency: 0 } } }), RangeError);
});

test("an item of a kind without a handler is dead-lettered at once, as the Python worker does", async () => {
  const [q, dlq] = await queueWithDlq({ maxAttempts: 5 });
  await client.produce(q, ["mail"], { kind: "email" });
  await client.produce(q, ["fax"], { kind: "fax" });
  const dead: [string, unknown][] = [];
  const worker = new Worker(client, q, { ...quick, handlers: { email: () => undefined }, hooks: { onDead: (item, error) => void dead.push([item.text, error]) } });
  await worker.run({ untilEmpty: true });
  assert.equal(dead.length, 1);
  assert.equal(dead[0]![0], "fax");
  assert.ok(dead[0]![1] instanceof DeadLetter);
  assert.equal((dead[0]![1] as Error).message, "no handler for kind 'fax'");
  assert.deepEqual(worker.stats.failures, { DeadLetter: 1 });
  assert.equal(worker.stats.completed, 1);
  const [fax] = await client.lease(dlq, { waitMs: 1000 });
  assert.equal(fax?.text, "fax");
  assert.equal(fax?.deadAttempts, 1, "not retried first");
  await assert.rejects(new Worker(client, q, { ...quick }).run(), /the worker has no handler/);
});

class NetError extends Error {}
class NetTimeout extends NetError {}
class Flaky extends Error {}

test("retryOn / deadOn: the most specific class wins, a RetryRule's maxAttempts and backoff, a kind's rules first", async () => {
  const [q, dlq] = await queueWithDlq({ maxAttempts: 10 });
  await client.produce(q, ["timeout", "net", "flaky", "plain"]);
  await client.produce(q, ["kind-net"], { kind: "strict" });
  const attempts = new Map<string, number[]>();
  const backoffs: string[] = [];
  const handler = (item: LeasedItem): void => {
    attempts.set(item.text, [...(attempts.get(item.text) ?? []), item.attempts]);
    if (item.text === "timeout" && item.attempts < 3) throw new NetTimeout("slow network");
    if (item.text === "net") throw new NetError("refused");
    if (item.text === "flaky") throw new Flaky("again");
    if (item.text === "plain" && item.attempts < 2) throw new Error("once");
    if (item.text === "kind-net") throw new NetTimeout("slow network, strict kind");
  };
  const worker = new Worker(client, q, handler, {
    ...quick,
    retryBackoff: (n) => (backoffs.push(`default:${n}`), 20),
    retryOn: [NetTimeout, new RetryRule(Flaky, { maxAttempts: 2, backoff: (n) => (backoffs.push(`flaky:${n}`), 20) })],
    deadOn: [NetError],
    handlers: { strict: { handler, deadOn: [NetTimeout] } },
  });
  await worker.run({ untilEmpty: true });
  assert.deepEqual(attempts.get("timeout"), [1, 2, 3], "NetTimeout is named in retryOn: retried though its parent is in deadOn");
  assert.deepEqual(attempts.get("net"), [1], "NetError is dead at once");
  assert.deepEqual(attempts.get("flaky"), [1, 2], "the rule's maxAttempts");
  assert.deepEqual(attempts.get("plain"), [1, 2]);
  assert.deepEqual(attempts.get("kind-net"), [1], "the kind's deadOn is looked up before the worker's retryOn");
  assert.deepEqual(backoffs.sort(), ["default:1", "default:1", "default:2", "flaky:1"]);
  assert.deepEqual(await deadTexts(dlq), ["flaky", "kind-net", "net"]);
  assert.deepEqual(worker.stats.failures, { NetTimeout: 3, NetError: 1, Flaky: 2, Error: 1 });
  assert.throws(() => new Worker(client, q, handler, { retryOn: [NetError], deadOn: [NetError] }), /both retryOn and deadOn/);
});

test("handlerTimeoutMs: the handler's signal fires, the item is retried, then dead-lettered on its last attempt", async () => {
  const [q, dlq] = await queueWithDlq({ maxAttempts: 2 });
  await client.produce(q, ["listens", "ignores", "fast"]);
  await client.produce(q, ["kind-limit"], { kind: "tight" });
  const aborted: [string, unknown][] = [];
  const finishedLate: string[] = [];
  const handler = async (item: LeasedItem, signal: AbortSignal): Promise<void> => {
    if (item.text === "fast") return;
    if ((item.text === "listens" || item.text === "kind-limit") && item.attempts === 2) return;
    if (item.text === "ignores" || (item.text === "kind-limit" && item.attempts === 1)) {
      // Ignores its signal: JavaScript cannot stop it, so it runs on after the limit.
      await new Promise((r) => setTimeout(r, 700));
      finishedLate.push(`${item.text}#${item.attempts}`);
      return;
    }
    await new Promise<void>((_, reject) =>
      signal.addEventListener("abort", () => (aborted.push([item.text, signal.reason]), reject(new Error("gave up on abort"))), { once: true }),
    );
  };
  const worker = new Worker(client, q, handler, {
    ...quick,
    concurrency: 4,
    handlerTimeoutMs: 400,
    handlers: { tight: { handler, handlerTimeoutMs: 150 } },
  });
  const began = Date.now();
  await worker.run({ untilEmpty: true });
  assert.deepEqual(aborted.map(([text]) => text), ["listens"]);
  assert.ok(aborted[0]![1] instanceof HandlerTimeout);
  assert.deepEqual(await deadTexts(dlq), ["ignores"], "out of attempts after two time-outs");
  assert.equal(worker.stats.timedOut, 4, "listens once, ignores twice, kind-limit once (150 ms < 700 ms)");
  assert.deepEqual(worker.stats.failures, { HandlerTimeout: 4 });
  assert.equal(worker.stats.completed, 3, "fast, listens and kind-limit on their second attempt");
  assert.ok(Date.now() - began < 20_000);
  // The abandoned calls ran on to their end: the limit is soft.
  await new Promise((r) => setTimeout(r, 800));
  assert.deepEqual(finishedLate.sort(), ["ignores#1", "ignores#2", "kind-limit#1"]);
});

test("400 failures log a bounded number of lines (three per error class and minute), each failure counted", async (t) => {
  const [q, dlq] = await queueWithDlq({ maxAttempts: 1 });
  const n = 400;
  await client.produce(q, Array.from({ length: n }, (_, i) => `bad ${i}`));
  await client.produce(q, ["odd one"]);
  const warn = t.mock.method(console, "warn", () => undefined);
  const worker = new Worker(
    client,
    q,
    (item) => {
      throw item.text === "odd one" ? new TypeError("a different failure") : new Error("the same broken dependency");
    },
    { leaseWaitMs: 200, concurrency: 50, handleSignals: false }, // the default hooks, logging to console
  );
  await worker.run({ untilEmpty: true });
  const lines = warn.mock.calls.map((c) => String(c.arguments[0]));
  warn.mock.restore();
  assert.equal(worker.stats.dead, n + 1);
  assert.equal(worker.stats.failed, n + 1);
  assert.deepEqual(worker.stats.failures, { Error: n, TypeError: 1 });
  const failures = lines.filter((l) => l.includes("dead-lettered after"));
  assert.equal(failures.length, 4, `${lines.length} lines:\n${lines.join("\n")}`);
  assert.equal(failures.filter((l) => l.includes("TypeError: a different failure")).length, 1, "the one that differs is not hidden");
  assert.match(failures[0]!, /\n\s+at /, "with the stack");
  assert.equal((await client.queueStats(dlq)).total, n + 1);
});

test("FailureLog: after the burst, the next line of a class says how many were left out", async () => {
  const log = new FailureLog({ burst: 2, windowMs: 200 });
  const lines: string[] = [];
  const logger = { warn: (line: string) => void lines.push(line.split("\n")[0]!) };
  for (let i = 0; i < 10; i++) log.warn(logger, `failure ${i}`, new RangeError("x"));
  log.warn(logger, "dead", new DeadLetter("given up"));
  await new Promise((r) => setTimeout(r, 250));
  log.warn(logger, "failure 10", new RangeError("x"));
  assert.deepEqual(lines, ["failure 0", "failure 1", "dead", "failure 10 (8 more RangeError not logged)"]);
});

test("metrics: the Python worker's names and labels, scraped from a real prom-client registry", async () => {
  const [q] = await queueWithDlq({ maxAttempts: 2 });
  await client.produce(q, ["ok 1", "ok 2", "fails once"], { kind: "email" });
  await client.produce(q, ["poison"], { kind: "sms" });
  await client.produce(q, ["unknown"], { kind: "fax" });
  const registry = new Registry();
  const handler = (item: LeasedItem): void => {
    if (item.text === "fails once" && item.attempts === 1) throw new RangeError("once");
    if (item.text === "poison") throw new DeadLetter("no");
  };
  const worker = new Worker(client, q, { ...quick, metrics: registry, handlers: { email: handler, sms: handler } });
  await worker.run({ untilEmpty: true });
  const text = await registry.metrics();
  const value = (line: string): number | undefined => {
    const found = text.split("\n").find((l) => l.startsWith(`${line} `));
    return found === undefined ? undefined : Number(found.slice(line.length + 1));
  };
  const l = `queue="${q}"`;
  assert.equal(value(`querator_worker_handled_total{${l},kind="email"}`), 3, text);
  assert.equal(value(`querator_worker_failed_total{${l},kind="email",error="RangeError"}`), 1);
  assert.equal(value(`querator_worker_failed_total{${l},kind="sms",error="DeadLetter"}`), 1);
  assert.equal(value(`querator_worker_failed_total{${l},kind="fax",error="DeadLetter"}`), 1);
  assert.equal(value(`querator_worker_dead_total{${l},kind="sms"}`), 1);
  assert.equal(value(`querator_worker_dead_total{${l},kind="fax"}`), 1);
  assert.equal(value(`querator_worker_handler_seconds_count{${l},kind="email"}`), 4, "handled and failed runs");
  assert.equal(value(`querator_worker_handler_seconds_bucket{le="600",${l},kind="email"}`), 4);
  assert.equal(value(`querator_worker_lease_lag_seconds_count{${l}}`), 6);
  assert.match(text, /# TYPE querator_worker_handler_seconds histogram/);
  // A second worker in the same registry adds its own label values.
  const q2 = queueName();
  await client.createQueue(q2);
  await client.produce(q2, ["x"]);
  const served = new Worker(client, q2, () => undefined, { ...quick, metrics: registry, metricsPort: 0, metricsHost: "127.0.0.1" });
  await served.run({ untilEmpty: true });
  // Served over HTTP, as the Python worker's metrics_port.
  const response = await fetch(`http://127.0.0.1:${served.metricsPort}/metrics`);
  assert.equal(response.status, 200);
  assert.match(response.headers.get("content-type") ?? "", /^text\/plain/);
  assert.match(await response.text(), new RegExp(`querator_worker_handled_total\\{queue="${q2}",kind=""\\} 1`));
});

/** Whether something accepts a TCP connection at host:port. */
async function answers(host: string, port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = connect(port, host);
    socket.once("connect", () => {
      socket.destroy();
      resolve(true);
    });
    socket.once("error", () => resolve(false));
  });
}

test("the metrics port binds 127.0.0.1 unless metricsHost names another address", async () => {
  // Off the network by default: another loopback address (127.0.0.2) is refused, which a
  // port bound to every interface would accept.
  const q = queueName();
  await client.createQueue(q);
  await client.produce(q, ["x", "y"]);
  const plain = new Worker(client, q, () => undefined, { ...quick, metrics: new Registry(), metricsPort: 0 });
  await plain.run({ untilEmpty: true });
  const port = plain.metricsPort!;
  assert.deepEqual([await answers("127.0.0.1", port), await answers("127.0.0.2", port)], [true, false]);
  const told = new Worker(client, q, () => undefined, { ...quick, metrics: new Registry(), metricsPort: 0, metricsHost: "127.0.0.2" });
  await told.run({ untilEmpty: true });
  const other = told.metricsPort!;
  assert.deepEqual([await answers("127.0.0.2", other), await answers("127.0.0.1", other)], [true, false]);
});

test("a lost lease among retries settled together costs only its own item", async () => {
  const q = queueName();
  await client.createQueue(q, { leaseTimeoutMs: 60_000 });
  await client.produce(q, ["fails", "doomed"]);
  let open: () => void = () => undefined;
  const gate = new Promise<void>((r) => (open = r));
  let arrived = 0;
  const lost: string[] = [];
  const worker = new Worker(
    client,
    q,
    async (item) => {
      if (item.attempts > 1) return;
      if (item.text === "doomed") await client.deleteItems(q, [item.id], { partition: item.partition }); // its lease is gone
      if (++arrived === 2) open();
      await gate;
      // Both fail in one turn, "fails" first: their retries are settled together.
      if (item.text === "doomed") await Promise.resolve();
      throw new Error(`${item.text} failed`);
    },
    { ...quick, concurrency: 2, batchSize: 2, hooks: { onLeaseLost: (item) => void lost.push(item.text) } },
  );
  await worker.run({ untilEmpty: true });
  assert.deepEqual(lost, ["doomed"]);
  assert.equal(worker.stats.lost, 1);
  assert.equal(worker.stats.retried, 1, "'fails' was retried, not taken for lost");
  assert.equal(worker.stats.completed, 1, "'fails' came back and was handled");
});

test("maxLeaseDurationMs: keep-alive extends up to the cap, then lets the lease run out", async () => {
  const q = queueName();
  await client.createQueue(q, { leaseTimeoutMs: 1500 });
  await client.produce(q, "long");
  const other = new Client({ address: server.address });
  const capped: string[] = [];
  let started = false;
  const worker = new Worker(
    client,
    q,
    async (item) => {
      if (item.attempts > 1) return;
      started = true;
      await new Promise((r) => setTimeout(r, 4500));
    },
    { ...quick, concurrency: 1, maxLeaseDurationMs: 2800, hooks: { onLeaseCapped: (item) => void capped.push(item.text) } },
  );
  const running = worker.run();
  try {
    while (!started) await new Promise((r) => setTimeout(r, 20));
    // Extended up to 2.8 s from its lease (a whole extension, then a shorter one), no further.
    const [again] = await other.lease(q, { waitMs: 5000 });
    assert.equal(again?.text, "long");
    assert.equal(again?.attempts, 2);
    assert.deepEqual(capped, ["long"]);
    assert.equal(worker.stats.leaseCapped, 1);
    assert.ok(worker.stats.extended >= 1, `extended ${worker.stats.extended} times`);
    await again!.complete();
    await new Promise((r) => setTimeout(r, 2000)); // the first handler ends; its completion finds the lease gone
  } finally {
    await worker.stop();
    await running;
    other.close();
  }
  assert.equal(worker.stats.lost, 1);
  assert.equal(worker.stats.completed, 0);
  assert.throws(() => new Worker(client, q, () => undefined, { maxLeaseDurationMs: 0 }), RangeError);
});
