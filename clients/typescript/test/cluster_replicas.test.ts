/** The client and a replicated queue whose primary changes (a cluster of its own: a
 * node is killed). A node that can neither serve nor forward a call answers
 * "not primary: <node> epoch <e>"; the client reads the map again before its next call
 * and sends it straight to the new primary. The election is made through the server's
 * compare-and-swap on the shard record, as its failover makes it. */
import assert from "node:assert/strict";
import { test } from "node:test";

import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";

import { Client, Unavailable } from "../src/index.js";
import { ClusterService, QueuesService } from "../src/v1.js";
import { clusterFile, type TestCluster } from "./cluster.js";
import { python, queueName, waitUntil } from "./server.js";

let cluster: TestCluster;
// A membership TTL long enough that the survivor is out of the in-sync set (a Python
// process started for it) well before the killed primary's membership lapses.
const skip = clusterFile((c) => (cluster = c), 3, 10);

/** The queue's shard record, or one change of it through its compare-and-swap under
 * `writer`'s membership (as a primary or a failover makes it): `shrink` drops `node`
 * from the in-sync set, `elect` makes it primary alone in sync under the next epoch
 * (its incarnation given). Prints the record as JSON. */
const SHARD = `
import asyncio, dataclasses, json, sys
from querator_server.cluster.etcd import Etcd
from querator_server.cluster.shard_table import ShardTable

@dataclasses.dataclass
class Writer:
    node: str
    create_revision: int

async def main(endpoint, prefix, queue, change, writer, node, incarnation):
    client = Etcd([endpoint])
    try:
        _, entry = await client.get(prefix + b"queues/" + queue.encode())
        table = ShardTable(client, prefix)
        record = await table.fetch(json.loads(entry.value)["shard"])
        if change != "read":
            _, member = await client.get(prefix + b"members/" + writer.encode())
            table.writer = Writer(writer, member.create_revision)
            if change == "shrink":
                record = await table.shrink_isr(record, node)
            else:
                record = await table.elect(record, node, [(node, incarnation)])
        print(json.dumps(dataclasses.asdict(record)))
    finally:
        await client.close()

endpoint, prefix, queue, change, writer, node, incarnation = sys.argv[1:]
asyncio.run(main(endpoint, prefix.encode(), queue, change, writer, node, incarnation))
`;

type Record = { epoch: number; primary: string; isr: [string, string][] };

async function shard(queue: string, change = "read", writer = "", node = "", incarnation = ""): Promise<Record> {
  const prefix = `/${cluster.url.split("/").pop()}/`;
  return JSON.parse(await python(SHARD, [cluster.etcd.endpoint, prefix, queue, change, writer, node, incarnation])) as Record;
}

function info(address: string, queue: string) {
  return createClient(ClusterService, createGrpcTransport({ baseUrl: `http://${address}` })).clusterInfo({ queueNames: [queue] });
}

/** Every call a node answered for `method` (on any queue label: a node holding no copy
 * of the queue counts it unlabelled). */
async function answered(id: string): Promise<number> {
  let total = 0;
  for (const method of ["Produce", "ProduceStream"]) total += await cluster.metric(id, "querator_rpc_requests_total", { method });
  return total;
}

test("a call refused by a node that is not the primary makes the client read the map again and go on", { skip }, async () => {
  const q = queueName("replicated");
  const first = cluster.nodes[0]!.server.address;
  await createClient(QueuesService, createGrpcTransport({ baseUrl: `http://${first}` })).createQueue({
    queue: { queueName: q, replicas: 2, requestedPartitions: 2 },
  });
  const placement = (await info(first, q)).queues[0]!;
  const [old, fresh] = placement.replicas as [string, string];
  assert.equal(placement.primary, old);
  const bystander = cluster.nodes.find((n) => n.id !== old && n.id !== fresh)!;
  // The primary last: with it gone, calls that name no live node go to the bystander.
  const addresses = [bystander.server.address, cluster.node(fresh).server.address, cluster.node(old).server.address];
  const client = new Client({ addresses, timeoutMs: 5_000, clusterRefreshMs: 3_600_000 });
  try {
    // Both copies in step, each under its own incarnation.
    await waitUntil(async () => (await shard(q)).isr.every(([, i]) => i !== ""), 20_000, "both copies claimed");
    const claimed = new Map((await shard(q)).isr);
    await client.produce(q, ["before"]);
    // The primary dies, and its in-sync set is left with itself alone (as a primary drops
    // a silent copy): no copy may take over by itself, so the shard waits.
    await cluster.node(old).server.kill();
    assert.equal((await shard(q, "shrink", bystander.id, fresh)).epoch, 1);
    await waitUntil(
      async () => !(await info(bystander.server.address, q)).members.some((m) => m.nodeId === old && m.live),
      30_000,
      "the killed primary no longer live",
    );
    await assert.rejects(client.produce(q, ["refused"]), (e: unknown) => e instanceof Unavailable && e.rawMessage.includes(`not primary: ${old} epoch 1`));

    assert.equal((await shard(q, "elect", fresh, fresh, claimed.get(fresh))).epoch, 2);
    await waitUntil(async () => (await info(bystander.server.address, q)).queues[0]!.primary === fresh, 10_000, "the election seen");
    const viaBystander = await answered(bystander.id);
    await client.produce(q, ["after"]);
    // Straight to the new primary: the bystander forwarded nothing.
    assert.equal(await answered(bystander.id), viaBystander);
    const got: string[] = [];
    for (let i = 0; i < 10 && got.length < 2; i++) {
      got.push(...(await client.lease(q, { batchSize: 10, waitMs: 500 })).map((item) => new TextDecoder().decode(item.payload)));
    }
    assert.deepEqual(got.sort(), ["after", "before"]); // the copy kept what the old primary acknowledged
  } finally {
    client.close();
  }
});
