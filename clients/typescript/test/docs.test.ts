/** The TypeScript quick start in docs/quickstart.md runs as written against a real server. */
import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { promisify } from "node:util";
import { after, before, test } from "node:test";

import { ROOT, ServerProcess } from "./server.js";

const INDEX = join(dirname(fileURLToPath(import.meta.url)), "..", "src", "index.js");
let server: ServerProcess;
let dir: string;

before(async () => {
  server = await ServerProcess.start();
  dir = mkdtempSync(join(tmpdir(), "querator-ts-docs-"));
});

after(async () => {
  await server?.stop();
  if (dir) rmSync(dir, { recursive: true, force: true });
});

/** The first ```ts block under the heading that starts with `heading`. */
function snippet(page: string, heading: string): string {
  const text = readFileSync(join(ROOT, page), "utf8");
  const section = text.slice(text.indexOf(`\n${heading}`));
  const match = /```ts\n([\s\S]*?)```/.exec(section);
  assert.ok(match, `no ts block under ${heading} in ${page}`);
  return match[1]!;
}

test("docs/quickstart.md: From TypeScript", async () => {
  const code = snippet("docs/quickstart.md", "## 4. From TypeScript")
    .replace('"@querator/client"', JSON.stringify(pathToFileURL(INDEX).href))
    .replaceAll("127.0.0.1:2319", server.address);
  const file = join(dir, "quickstart.mjs");
  writeFileSync(file, code);
  const { stdout } = await promisify(execFile)("node", [file], { timeout: 60_000 });
  assert.match(stdout, /^produced 100$/m);
  assert.equal(stdout.match(/^handled by hand: job \d+ attempt 1$/gm)?.length, 5);
  assert.match(stdout, /^done: 95 completed by the worker$/m);
});

test("docs/typescript.md: Handlers by kind", async () => {
  const code = snippet("docs/typescript.md", "### Handlers by kind")
    .replace('"@querator/client"', JSON.stringify(pathToFileURL(INDEX).href))
    .replaceAll("127.0.0.1:2319", server.address);
  const file = join(dir, "kinds.mjs");
  writeFileSync(file, code);
  const { stdout } = await promisify(execFile)("node", [file], { timeout: 60_000 });
  assert.equal(stdout, "email to: ada, sms to: +100\n");
});

/** Run the first ts block under `heading` of docs/typescript.md as a module; its stdout. */
async function runSample(heading: string, name: string): Promise<string> {
  const code = snippet("docs/typescript.md", heading)
    .replace('"@querator/client"', JSON.stringify(pathToFileURL(INDEX).href))
    .replace('"prom-client"', JSON.stringify(import.meta.resolve("prom-client")))
    .replaceAll("127.0.0.1:2319", server.address);
  const file = join(dir, name);
  writeFileSync(file, code);
  const { stdout } = await promisify(execFile)("node", [file], { timeout: 60_000 });
  return stdout;
}

test("docs/typescript.md: Retry rules", async () => {
  assert.equal(await runSample("### Retry rules", "rules.mjs"), "1 completed, 1 dead; 2 timeouts, 1 invalid\n");
});

test("docs/typescript.md: Time limits", async () => {
  assert.equal(await runSample("### Time limits", "limits.mjs"), "1 completed, 1 timed out\n");
});

test("docs/typescript.md: Worker metrics", async () => {
  assert.equal(
    await runSample("### Worker metrics", "metrics.mjs"),
    [
      'querator_worker_handled_total{queue="thumbnails",kind="thumbnail"} 2',
      'querator_worker_failed_total{queue="thumbnails",kind="thumbnail",error="TypeError"} 1',
      'querator_worker_dead_total{queue="thumbnails",kind="thumbnail"} 1',
      "",
    ].join("\n"),
  );
});
