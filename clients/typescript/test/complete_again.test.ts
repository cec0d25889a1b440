/** Complete and Retry after a lost answer: the client sends them again on UNAVAILABLE and
 * the server answers the ids the first send settled as done. The answer is really lost:
 * the client talks through a loopback proxy that throws the server's replies away and,
 * once the server has applied the call, cuts the connection. */
import assert from "node:assert/strict";
import { type Server, type Socket, connect, createServer } from "node:net";
import { after, before, test } from "node:test";

import { Client, Unavailable } from "../src/index.js";
import { ServerProcess, queueName, waitUntil } from "./server.js";

/** A TCP proxy on 127.0.0.1 in front of `target` that can drop what the target answers. */
class Proxy {
  readonly #server: Server;
  readonly #sockets = new Set<Socket>();
  dropReplies = false;
  address = "";

  constructor(target: string) {
    const port = Number(target.slice(target.lastIndexOf(":") + 1));
    this.#server = createServer((client) => {
      const upstream = connect(port, "127.0.0.1");
      for (const socket of [client, upstream]) {
        this.#sockets.add(socket);
        socket.on("error", () => undefined);
        socket.on("close", () => {
          this.#sockets.delete(socket);
          client.destroy();
          upstream.destroy();
        });
      }
      client.on("data", (chunk: Buffer) => upstream.write(chunk));
      upstream.on("data", (chunk: Buffer) => {
        if (!this.dropReplies) client.write(chunk);
      });
    });
  }

  async start(): Promise<void> {
    await new Promise<void>((resolve) => this.#server.listen(0, "127.0.0.1", resolve));
    const { port } = this.#server.address() as { port: number };
    this.address = `127.0.0.1:${port}`;
  }

  /** Close every connection (the calls on them fail UNAVAILABLE) and pass replies again. */
  cut(): void {
    for (const socket of this.#sockets) socket.destroy();
    this.dropReplies = false;
  }

  async close(): Promise<void> {
    this.cut();
    await new Promise<void>((resolve) => this.#server.close(() => resolve()));
  }
}

let server: ServerProcess;
let direct: Client;
let proxy: Proxy;

before(async () => {
  server = await ServerProcess.start();
  direct = new Client({ address: server.address });
  proxy = new Proxy(server.address);
  await proxy.start();
});

after(async () => {
  direct?.close();
  await proxy?.close();
  await server?.stop();
});

async function leased(q: string): Promise<number> {
  return (await direct.queueStats(q)).partitions[0]!.totalLeased;
}

test("a Complete and a Retry whose answers were lost are sent again and succeed", async () => {
  const q = queueName();
  await direct.createQueue(q, { leaseTimeoutMs: 600_000 });
  await direct.produce(q, ["a", "b", "c"]);
  const far = new Client({ address: proxy.address, retries: 5, streams: false });
  try {
    const items = await far.lease(q, { batchSize: 3, waitMs: 1_000 });
    assert.equal(items.length, 3);
    proxy.dropReplies = true;
    const completing = far.complete(items.slice(0, 2));
    await waitUntil(async () => (await leased(q)) === 1, 10_000, "the server applied the Complete");
    proxy.cut();
    // Sent again after UNAVAILABLE, answered as done, the ids the lost first send completed named.
    assert.deepEqual(await completing, { alreadyCompleted: items.slice(0, 2).map((i) => i.id), keyItemsCompleted: 0 });
    assert.deepEqual(items.map((i) => i.state), ["completed", "completed", "leased"]);

    proxy.dropReplies = true;
    const retrying = far.retry(items.slice(2));
    await waitUntil(async () => (await leased(q)) === 0, 10_000, "the server applied the Retry");
    proxy.cut();
    assert.deepEqual(await retrying, { deadIds: [], alreadyRetried: [items[2]!.id] });
    assert.equal(items[2]!.state, "retried");
  } finally {
    far.close();
  }
  const stats = (await direct.queueStats(q)).partitions[0]!;
  assert.deepEqual([stats.total, stats.totalLeased], [1, 0]); // back once, not twice
  const [again] = await direct.lease(q, { batchSize: 10, waitMs: 1_000 });
  assert.equal(again?.text, "c");
  assert.equal(again?.attempts, 2);
});

test("a first send reports nothing done before; lease keys count what they completed", async () => {
  const q = queueName();
  await direct.createQueue(q, { leaseTimeoutMs: 600_000 });
  await direct.produce(q, ["a", "b", "c", "d"]);
  const [a, b] = await direct.lease(q, { batchSize: 2, waitMs: 1_000 });
  assert.deepEqual(await a!.complete(), { alreadyCompleted: [], keyItemsCompleted: 0 });
  assert.deepEqual(await direct.retry(b!), { deadIds: [], alreadyRetried: [] });
  const keyed = await direct.lease(q, { batchSize: 2, waitMs: 1_000, leaseKey: "k" });
  const [last] = await direct.lease(q, { batchSize: 1, waitMs: 1_000 });
  assert.deepEqual(await last!.retry({ dead: true }), { deadIds: [last!.id], alreadyRetried: [] });
  assert.equal(last!.state, "dead");
  const byKey = { leaseKeys: ["k"], queueName: q };
  assert.deepEqual(await direct.complete([], byKey), { alreadyCompleted: [], keyItemsCompleted: keyed.length });
  assert.deepEqual(await direct.complete([], byKey), { alreadyCompleted: [], keyItemsCompleted: 0 });
});

test("with retryComplete off, the lost answer surfaces as UNAVAILABLE", async () => {
  const q = queueName();
  await direct.createQueue(q, { leaseTimeoutMs: 600_000 });
  await direct.produce(q, ["a"]);
  const far = new Client({ address: proxy.address, retries: 5, streams: false, retryComplete: false });
  try {
    const items = await far.lease(q, { batchSize: 1, waitMs: 1_000 });
    proxy.dropReplies = true;
    const completing = far.complete(items);
    await waitUntil(async () => (await leased(q)) === 0, 10_000, "the server applied the Complete");
    proxy.cut();
    await assert.rejects(completing, Unavailable);
  } finally {
    far.close();
  }
});
