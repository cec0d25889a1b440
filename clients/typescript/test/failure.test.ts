import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { join } from "node:path";
import { test } from "node:test";

import { Client, DeadLetter, type LeasedItem, MAX_ERROR_BYTES, RetryRule, Worker, failureText } from "../src/index.js";
import { type ServerProcess, VENV, python, queueName, waitUntil, serveFile } from "./server.js";

let server: ServerProcess;
let client: Client;

serveFile((s, c) => ([server, client] = [s, c]));

// `querator dlq show QUEUE ID`, the Python command line, as an operator would run it.
const DLQ_SHOW = `
import sys
from querator.cli import main
sys.exit(main(["dlq", "show", *sys.argv[1:]]))
`;

/** Text as the console's templates render it (Jinja's autoescape, markupsafe's entities). */
function htmlEscaped(text: string): string {
  const entities: Record<string, string> = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&#34;", "'": "&#39;" };
  return text.replace(/[&<>"']/g, (c) => entities[c]!);
}

/** `querator --address ADDRESS console --listen 127.0.0.1:0` against a server without keys
 * (no login): the page at `path`, then the console stopped by its PID. */
async function consolePage(address: string, path: string): Promise<string> {
  const proc = spawn(join(VENV, "bin", "querator"), ["--address", address, "console", "--listen", "127.0.0.1:0"], {
    stdio: ["ignore", "pipe", "pipe"],
  });
  let out = "";
  let err = "";
  proc.stderr.on("data", (d: Buffer) => (err += d.toString()));
  const exited = new Promise<void>((r) => proc.once("exit", () => r()));
  try {
    // Its first line names the port it got: "... serving http://127.0.0.1:PORT/".
    const base = await new Promise<string>((resolveBase, reject) => {
      const timer = setTimeout(() => reject(new Error(`the console did not start in 30 s: ${out}${err}`)), 30_000);
      proc.stdout.on("data", (d: Buffer) => {
        out += d.toString();
        const match = /serving (http:\/\/127\.0\.0\.1:\d+\/)/.exec(out);
        if (match) {
          clearTimeout(timer);
          resolveBase(match[1]!);
        }
      });
      proc.once("exit", (code) => {
        clearTimeout(timer);
        reject(new Error(`the console exited ${code}: ${out}${err}`));
      });
    });
    const response = await fetch(base + path, { redirect: "manual", signal: AbortSignal.timeout(30_000) });
    const page = await response.text();
    assert.equal(response.status, 200, `GET ${path}: ${response.status} ${response.headers.get("location") ?? ""}\n${page.slice(0, 500)}`);
    return page;
  } finally {
    if (proc.exitCode === null && proc.signalCode === null) {
      const timer = setTimeout(() => proc.kill("SIGKILL"), 15_000);
      proc.kill("SIGTERM");
      await exited;
      clearTimeout(timer);
    }
  }
}

function deep(n: number): never {
  if (n > 0) return deep(n - 1);
  throw new RangeError("too deep");
}

test("failureText: name and message first, then the frames nearest the throw that fit", () => {
  let caught: unknown;
  try {
    deep(3);
  } catch (e) {
    caught = e;
  }
  const text = failureText(caught);
  const lines = text.split("\n");
  assert.equal(lines[0], "RangeError: too deep");
  assert.match(lines[1]!, /^ {4}at deep \(/); // the frame that threw comes first
  assert.ok(Buffer.byteLength(text) <= MAX_ERROR_BYTES);
  assert.equal(failureText("plain text thrown"), "plain text thrown");
  const long = new Error("x".repeat(5000));
  assert.equal(failureText(long), `Error: ${"x".repeat(5000)}`); // alone past the bound: sent whole, the server cuts
  const wide = new Error("y".repeat(1900));
  const cut = failureText(wide);
  assert.ok(Buffer.byteLength(cut) <= MAX_ERROR_BYTES && cut.endsWith("left out"), cut.slice(-80));
});

test("the worker sends what went wrong: the next attempt and the dead letter see it, querator dlq show and the console show it", async () => {
  const dlq = queueName("dlq");
  const q = queueName();
  await client.createQueue(dlq);
  await client.createQueue(q, { deadQueue: dlq, maxAttempts: 2 });
  await client.produce(q, ["flaky", "poison"]);
  const seen: string[] = [];
  const worker = new Worker(
    client,
    q,
    async (item: LeasedItem) => {
      seen.push(`${item.text}#${item.attempts}: ${item.lastError.split("\n")[0]}`);
      if (item.text === "poison") throw new DeadLetter("customer 42 is gone");
      throw new TypeError(`cannot read 'total' of ${item.text} (attempt ${item.attempts})`);
    },
    { concurrency: 2, batchSize: 10, leaseWaitMs: 200, retryBackoff: () => 0, hooks: {}, handleSignals: false },
  );
  const running = worker.run();
  await waitUntil(() => worker.stats.dead === 2, 30_000, "both items dead-lettered");
  await worker.stop();
  await running;
  // The second attempt's handler saw why the first failed.
  assert.ok(seen.includes("flaky#2: TypeError: cannot read 'total' of flaky (attempt 1)"), seen.join("; "));

  await waitUntil(async () => (await client.listItems(dlq).toArray()).length === 2, 10_000, "dead letters stored");
  const letters = new Map((await client.listItems(dlq).toArray()).map((i) => [new TextDecoder().decode(i.payload), i]));
  const flaky = letters.get("flaky")!;
  assert.match(flaky.lastError, /^TypeError: cannot read 'total' of flaky \(attempt 2\)\n {4}at /);
  assert.ok(flaky.lastErrorAt instanceof Date);
  assert.match(letters.get("poison")!.lastError, /^DeadLetter: customer 42 is gone\n/);

  const shown = await python(DLQ_SHOW, [dlq, flaky.id, "--address", server.address]);
  assert.match(shown, /\nlast_error:\n {2}TypeError: cannot read 'total' of flaky \(attempt 2\)\n {6}at /);
  assert.match(shown, /^dead_reason: +\w+$/m);

  // The console's dead-letter view of the DLQ shows both handlers' errors, as its template escapes them.
  const page = await consolePage(server.address, `q/${encodeURIComponent(dlq)}/dead`);
  for (const error of [flaky.lastError, letters.get("poison")!.lastError]) {
    assert.ok(page.includes(htmlEscaped(error)), `not on the console's page:\n${error}`);
  }
  assert.ok(page.includes("TypeError: cannot read &#39;total&#39; of flaky (attempt 2)\n    at "));

  // A leased dead letter carries it too, and the client's retry takes text directly.
  const [again] = await client.lease(dlq, { batchSize: 1, waitMs: 1000 });
  assert.equal(again!.lastError.split("\n")[0]!.length > 0, true);
  await again!.retry({ error: "looked at by hand" });
  const relisted = (await client.listItems(dlq).toArray()).map((i) => i.lastError);
  assert.ok(relisted.includes("looked at by hand"), relisted.join(" | "));
});

class NetError extends Error {
  override name = "NetError";
}
class Flaky extends Error {
  override name = "Flaky";
}

test("every path of the worker sends the failure text: deadOn, a RetryRule and its maxAttempts, handlerTimeoutMs, an unknown kind, one batch of distinct errors", async () => {
  const dlq = queueName("dlq");
  const q = queueName();
  await client.createQueue(dlq);
  await client.createQueue(q, { deadQueue: dlq, maxAttempts: 5 });
  await client.produce(q, ["net", "flaky", ...Array.from({ length: 6 }, (_, i) => `batch ${i}`)], { kind: "job" });
  await client.produce(q, ["slow"], { kind: "tight" });
  await client.produce(q, ["fax"], { kind: "fax" });
  // What each attempt saw of the previous one's failure, by payload (stable across leases).
  const seen = new Map<string, string>();
  const handler = async (item: LeasedItem, signal: AbortSignal): Promise<void> => {
    if (item.attempts > 1) seen.set(item.text, item.lastError.split("\n")[0]!);
    if (item.text === "net") throw new NetError("connection refused");
    if (item.text === "flaky") throw new Flaky(`flaky attempt ${item.attempts}`);
    if (item.text === "slow" && item.attempts === 1) {
      await new Promise<void>((_, reject) => signal.addEventListener("abort", () => reject(new Error("gave up")), { once: true }));
    }
    if (item.text.startsWith("batch") && item.attempts === 1) throw new Error(`boom in ${item.text}`);
  };
  const worker = new Worker(client, q, {
    concurrency: 10,
    batchSize: 10,
    leaseWaitMs: 200,
    retryBackoff: () => 0,
    hooks: {},
    handleSignals: false,
    retryOn: [new RetryRule(Flaky, { maxAttempts: 2, backoff: () => 0 })],
    deadOn: [NetError],
    handlers: { job: handler, tight: { handler, handlerTimeoutMs: 150 } },
  });
  await worker.run({ untilEmpty: true });

  // Retried ones: the next attempt reads its own item's error, though all failed in one batch.
  for (let i = 0; i < 6; i++) assert.equal(seen.get(`batch ${i}`), `Error: boom in batch ${i}`);
  assert.equal(seen.get("flaky"), "Flaky: flaky attempt 1");
  assert.match(seen.get("slow")!, /^HandlerTimeout: the handler ran past handlerTimeoutMs \(150 ms\)/);

  // Dead ones: the error that killed each.
  const letters = new Map((await client.listItems(dlq).toArray()).map((i) => [new TextDecoder().decode(i.payload), i.lastError]));
  assert.deepEqual([...letters.keys()].sort(), ["fax", "flaky", "net"]);
  assert.match(letters.get("net")!, /^NetError: connection refused\n {4}at /);
  assert.match(letters.get("flaky")!, /^Flaky: flaky attempt 2\n {4}at /);
  assert.match(letters.get("fax")!, /^DeadLetter: no handler for kind 'fax'/);
});
