/** The Python SDK and this client on one queue: bytes, metadata and ids cross unchanged. */
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { after, before, test } from "node:test";

import { Client, type Item } from "../src/index.js";
import { ServerProcess, python, queueName } from "./server.js";

let server: ServerProcess;
let client: Client;

before(async () => {
  server = await ServerProcess.start();
  client = new Client({ address: server.address });
});

after(async () => {
  client?.close();
  await server?.stop();
});

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
