/** The Python SDK and this client on one queue: bytes, metadata and ids cross unchanged. */
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { test } from "node:test";

import { Registry } from "prom-client";

import { Client, DeadLetter, type Item, type LeasedItem, Worker } from "../src/index.js";
import { type ServerProcess, python, queueName, serveFile } from "./server.js";

let server: ServerProcess;
let client: Client;

serveFile((s, c) => ([server, client] = [s, c]));

interface Wire {
  id: string;
  payload: string; // hex
  encoding: string;
  kind: string;
  reference: string;
  metadata: Record<string, string>;
}

const hex = (bytes: Uint8Array): string => Buffer.from(bytes).toString("hex");

/** Items whose payloads hold every byte value, empty, invalid UTF-8 and random bytes. */
function sampleItems(): Wire[] {
  return [
    { id: "", payload: hex(Uint8Array.from({ length: 256 }, (_, i) => i)), encoding: "application/octet-stream", kind: "all-bytes", reference: "r1", metadata: { traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01" } },
    { id: "", payload: "", encoding: "", kind: "", reference: "", metadata: {} },
    { id: "", payload: hex(Uint8Array.from([0xff, 0xfe, 0x00, 0xc3, 0x28])), encoding: "", kind: "invalid-utf8", reference: "", metadata: { "ünï": "cödé ✓", empty: "" } },
    { id: "", payload: hex(randomBytes(100_000)), encoding: "bin", kind: "big", reference: "ref/with/slashes", metadata: { a: "1", b: "2", c: "3" } },
  ];
}

const PY_PRODUCE = `
import json, sys, querator
address, queue = sys.argv[1], sys.argv[2]
items = json.load(sys.stdin)
with querator.Client(address) as client:
    result = client.produce(queue, [
        querator.Item(bytes.fromhex(i["payload"]), encoding=i["encoding"], kind=i["kind"],
                      reference=i["reference"], metadata=i["metadata"])
        for i in items
    ])
print(json.dumps(list(result.ids)))
`;

const PY_CONSUME = `
import json, sys, querator
address, queue, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = []
with querator.Client(address) as client:
    while len(out) < count:
        batch = client.lease(queue, batch_size=count - len(out), wait=5)
        out.extend({"id": i.id, "payload": bytes(i.payload).hex(), "encoding": i.encoding, "kind": i.kind,
                    "reference": i.reference, "metadata": dict(i.metadata)} for i in batch)
        client.complete(batch)
print(json.dumps(out))
`;

test("a Python producer and a TypeScript consumer", async () => {
  const q = queueName("py2ts");
  await client.createQueue(q);
  const sent = sampleItems();
  const ids = JSON.parse(await python(PY_PRODUCE, [server.address, q], JSON.stringify(sent))) as string[];
  assert.equal(ids.length, sent.length);

  const got: Wire[] = [];
  while (got.length < sent.length) {
    const batch = await client.lease(q, { batchSize: 10, waitMs: 5000 });
    got.push(...batch.map((i) => ({ id: i.id, payload: hex(i.payload), encoding: i.encoding, kind: i.kind, reference: i.reference, metadata: { ...i.metadata } })));
    await client.complete(batch);
  }
  assert.deepEqual(got, sent.map((s, n) => ({ ...s, id: ids[n]! })));
  assert.equal((await client.queueStats(q)).total, 0);
});

test("a TypeScript producer and a Python consumer", async () => {
  const q = queueName("ts2py");
  await client.createQueue(q);
  const sent = sampleItems();
  const items: Item[] = sent.map((s) => ({ payload: Buffer.from(s.payload, "hex"), encoding: s.encoding, kind: s.kind, reference: s.reference, metadata: s.metadata }));
  // Bare payloads too: they go in the compact form (ProduceRequest.payloads).
  const bare = [Uint8Array.from([0, 1, 2, 255]), "text ✓"];
  const produced = await client.produce(q, items);
  const producedBare = await client.produce(q, bare);

  const total = sent.length + bare.length;
  const got = JSON.parse(await python(PY_CONSUME, [server.address, q, String(total)])) as Wire[];
  const blank = { encoding: "", kind: "", reference: "", metadata: {} };
  assert.deepEqual(got, [
    ...sent.map((s, n) => ({ ...s, id: produced.ids[n]! })),
    { ...blank, id: producedBare.ids[0]!, payload: "000102ff" },
    { ...blank, id: producedBare.ids[1]!, payload: hex(new TextEncoder().encode("text ✓")) },
  ]);
  assert.equal((await client.queueStats(q)).total, 0);
});

/** The querator_worker_* samples of a Prometheus exposition as "name{label,label}", the
 * label names sorted, without values (the error label holds each language's class name)
 * and without prometheus_client's *_created samples. */
function metricShapes(exposition: string): string[] {
  const shapes = new Set<string>();
  for (const line of exposition.split("\n")) {
    const match = /^(querator_worker_\w+)(?:\{(.*)\})? /.exec(line);
    if (!match || match[1]!.endsWith("_created")) continue;
    const labels = [...(match[2] ?? "").matchAll(/(\w+)="/g)].map((m) => m[1]!).sort();
    shapes.add(`${match[1]}{${labels.join(",")}}`);
  }
  return [...shapes].sort();
}

/** The querator_worker_* samples of an exposition by "name{label="value",...}", the
 * labels sorted by name. */
function metricValues(exposition: string): Map<string, number> {
  const values = new Map<string, number>();
  for (const line of exposition.split("\n")) {
    const match = /^(querator_worker_\w+)(?:\{(.*)\})? (\S+)$/.exec(line);
    if (!match) continue;
    const labels = [...(match[2] ?? "").matchAll(/(\w+)="([^"]*)"/g)].map((m) => `${m[1]}="${m[2]}"`).sort();
    values.set(`${match[1]}{${labels.join(",")}}`, Number(match[3]));
  }
  return values;
}

test("the TypeScript worker's metrics have the Python worker's names and labels", async () => {
  const scenario = async (q: string): Promise<void> => {
    await client.createQueue(q, { maxAttempts: 2 });
    await client.produce(q, ["ok", "fails once", "poison"], { kind: "email" });
    await client.produce(q, ["unknown"], { kind: "fax" });
  };
  const pq = queueName("py-metrics");
  await scenario(pq);
  const fromPython = await python(
    `
import sys
from datetime import timedelta
import prometheus_client, querator

def handle(item):
    if item.text == "fails once" and item.attempts == 1:
        raise ValueError("once")
    if item.text == "poison":
        raise querator.DeadLetter("no")

with querator.Client(sys.argv[1]) as client:
    worker = querator.Worker(client, sys.argv[2], metrics=True, lease_wait=0.2, handle_signals=False,
                             retry_backoff=lambda n: timedelta(milliseconds=50))
    worker.handler("email")(handle)
    worker.run(until_empty=True)
print(prometheus_client.generate_latest().decode())
`,
    [server.address, pq],
  );
  const tq = queueName("ts-metrics");
  await scenario(tq);
  const registry = new Registry();
  const handle = (item: LeasedItem): void => {
    if (item.text === "fails once" && item.attempts === 1) throw new RangeError("once");
    if (item.text === "poison") throw new DeadLetter("no");
  };
  await new Worker(client, tq, { metrics: registry, handlers: { email: handle }, leaseWaitMs: 200, retryBackoff: () => 50, hooks: {}, handleSignals: false }).run({
    untilEmpty: true,
  });
  const fromTs = await registry.metrics();
  const shapes = metricShapes(fromPython);
  assert.ok(shapes.length >= 8, fromPython);
  assert.deepEqual(metricShapes(fromTs), shapes);
  // And the same counts, but for the error label's language.
  const py = metricValues(fromPython);
  const ts = metricValues(fromTs);
  for (const [sample, value] of [
    ['querator_worker_handled_total{kind="email",queue="Q"}', 2],
    ['querator_worker_dead_total{kind="email",queue="Q"}', 1],
    ['querator_worker_dead_total{kind="fax",queue="Q"}', 1],
    ['querator_worker_failed_total{error="DeadLetter",kind="fax",queue="Q"}', 1],
    ['querator_worker_handler_seconds_count{kind="email",queue="Q"}', 4],
    ['querator_worker_lease_lag_seconds_count{queue="Q"}', 5],
  ] as const) {
    assert.equal(py.get(sample.replace("Q", pq)), value, `python: ${sample}\n${fromPython}`);
    assert.equal(ts.get(sample.replace("Q", tq)), value, `typescript: ${sample}\n${fromTs}`);
  }
});
