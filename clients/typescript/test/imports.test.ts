/** The client's module graph: no import runs in a circle, type-only imports and
 * re-exports included (as the Python SDK's tests/test_sdk_imports.py checks the SDK's). */
import assert from "node:assert/strict";
import { readFileSync, readdirSync } from "node:fs";
import { dirname, join, posix } from "node:path";
import { fileURLToPath } from "node:url";
import { test } from "node:test";
import ts from "typescript";

/** The sources, not the compiled copies: this file runs from dist/test. */
const SRC = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "src");

/** The modules a source file names: every relative import, `import type` and
 * `export ... from` among them (they tie the modules as closely for a reader, and a
 * type-only circle turns into a runtime one with the first value import), and dynamic
 * `import()`s. As names relative to src, without extension ("client", "gen/...").
 * Import-like text in comments and strings is not an import: TypeScript's own scanner
 * tells them apart. */
function importsOf(module: string, text: string): Set<string> {
  const out = new Set<string>();
  for (const { fileName } of ts.preProcessFile(text, true, true).importedFiles) {
    if (!fileName.startsWith(".")) continue; // a package
    out.add(posix.normalize(posix.join(posix.dirname(module), fileName)).replace(/\.(js|ts)$/, ""));
  }
  return out;
}

/** The hand-written modules of src (src/gen is generated) and what each imports. */
function moduleGraph(): Map<string, Set<string>> {
  const graph = new Map<string, Set<string>>();
  for (const file of readdirSync(SRC)) {
    if (!file.endsWith(".ts") || file.endsWith(".d.ts")) continue;
    const module = file.slice(0, -".ts".length);
    graph.set(module, importsOf(module, readFileSync(join(SRC, file), "utf8")));
  }
  return graph;
}

/** A circle in `graph` as the path that closes it ([a, b, a]), or undefined. */
function findCycle(graph: Map<string, Set<string>>): string[] | undefined {
  const state = new Map<string, "open" | "done">();
  const path: string[] = [];
  const visit = (node: string): string[] | undefined => {
    state.set(node, "open");
    path.push(node);
    for (const dep of [...(graph.get(node) ?? [])].sort()) {
      if (!graph.has(dep)) continue;
      if (state.get(dep) === "open") return [...path.slice(path.indexOf(dep)), dep];
      if (!state.has(dep)) {
        const found = visit(dep);
        if (found) return found;
      }
    }
    state.set(node, "done");
    path.pop();
    return undefined;
  };
  for (const node of [...graph.keys()].sort()) {
    if (state.has(node)) continue;
    const found = visit(node);
    if (found) return found;
  }
  return undefined;
}

test("the client's modules import no circle", () => {
  const graph = moduleGraph();
  assert.ok(graph.has("client") && graph.has("items") && graph.has("worker"), "the walk saw the modules");
  assert.ok(graph.get("worker")!.has("client"), "the walk saw the imports");
  const cycle = findCycle(graph);
  assert.equal(cycle, undefined, cycle?.join(" -> "));
});

test("type-only imports and re-exports are edges; comments are not", () => {
  const text = [
    'import type { Client } from "./client.js";',
    'export { MAX_BATCH } from "./operations.js";',
    "import {",
    "  a,",
    '} from "./gen/querator/v1/queue_pb.js";',
    'import { create } from "@bufbuild/protobuf";',
    '// import { Worker } from "./worker.js";',
    '/** `import { QueueInfo } from "./models.js"` */',
  ].join("\n");
  assert.deepEqual([...importsOf("items", text)].sort(), ["client", "gen/querator/v1/queue_pb", "operations"]);
});

test("a circle would be found", () => {
  const graph = new Map([
    ["a", new Set(["b"])],
    ["b", new Set(["c", "x"])],
    ["c", new Set(["a"])],
  ]);
  assert.deepEqual(findCycle(graph), ["a", "b", "c", "a"]);
  assert.equal(findCycle(new Map([["a", new Set(["b"])], ["b", new Set<string>()]])), undefined);
});

test("index.ts lists what it exports; the generated code stays in v1", async () => {
  const index = readFileSync(join(SRC, "index.ts"), "utf8");
  assert.doesNotMatch(index, /export \*/);
  assert.doesNotMatch(index, /from "\.\/gen\//);
  const api: Record<string, unknown> = await import("../src/index.js");
  const v1: Record<string, unknown> = await import("../src/v1.js");
  assert.ok("QueueInfoSchema" in v1 && "QueueService" in v1);
  const generated = Object.keys(api).filter((name) => name in v1);
  assert.deepEqual(generated, []);
});
