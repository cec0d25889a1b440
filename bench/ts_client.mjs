// W1 with the TypeScript client (clients/typescript, built by `./dev test` or `npx tsc`):
// one process producing, or draining, one queue. Run by bench/sdk_clients.py, which
// runs the Python SDK the same way beside it.
//
//   node bench/ts_client.mjs produce|drain ADDRESS QUEUE ITEMS [BATCH] [INFLIGHT]
//
// Prints one JSON line: {"items", "seconds", "cpu_s"} (cpu_s: this process's CPU time).
import { randomBytes } from "node:crypto";

import { Client } from "../clients/typescript/dist/src/index.js";

const [role, address, queue, itemsArg, batchArg = "100", inflightArg = "8"] = process.argv.slice(2);
const items = Number(itemsArg);
const batch = Number(batchArg);
const inflight = Number(inflightArg);
if (!["produce", "drain"].includes(role ?? "") || !address || !queue || !(items > 0)) {
  console.error("usage: node bench/ts_client.mjs produce|drain ADDRESS QUEUE ITEMS [BATCH] [INFLIGHT]");
  process.exit(2);
}

const client = new Client({ address });
await client.getQueue(queue); // connected before the clock starts

let done = 0;
const cpu0 = process.cpuUsage();
const t0 = performance.now();
if (role === "produce") {
  // 256 random bytes per item, made before timing; payloads only: the compact form.
  const pool = randomBytes(256 * 4096);
  const payloads = Array.from({ length: items }, (_, i) => pool.subarray((i % 4096) * 256, (i % 4096 + 1) * 256));
  const cpuMade = process.cpuUsage();
  const tMade = performance.now();
  const result = await client.produce(queue, payloads, { batchSize: batch, maxInFlight: inflight });
  done = result.ids.length;
  report(tMade, cpuMade);
} else {
  async function loop(n) {
    while (done < items) {
      const leased = await client.lease(queue, { batchSize: batch, waitMs: 500, clientId: `ts-drain-${n}` });
      if (leased.length) {
        await client.complete(leased);
        done += leased.length;
      }
    }
  }
  await Promise.all(Array.from({ length: inflight }, (_, n) => loop(n)));
  report(t0, cpu0);
}
client.close();

function report(start, cpuStart) {
  const seconds = (performance.now() - start) / 1000;
  const cpu = process.cpuUsage(cpuStart);
  console.log(JSON.stringify({ items: done, seconds, cpu_s: (cpu.user + cpu.system) / 1e6 }));
}
