/** A real Querator server process for the tests: `querator serve` from the repository's
 * .venv, on a free port of 127.0.0.1, with a temporary data directory. */
import { type ChildProcess, execFile, spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { after, before } from "node:test";
import { promisify } from "node:util";

import { Client, type ClientOptions, Unauthenticated } from "../src/index.js";

/** The repository root (this file runs as dist/test/server.js). */
export const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");
export const VENV = process.env["QUERATOR_VENV"] ?? join(ROOT, ".venv");
export const PYTHON = join(VENV, "bin", "python");

export async function freePort(): Promise<number> {
  return new Promise((resolvePort, reject) => {
    const probe = createServer();
    probe.once("error", reject);
    probe.listen(0, "127.0.0.1", () => {
      const address = probe.address();
      const port = typeof address === "object" && address ? address.port : 0;
      probe.close(() => resolvePort(port));
    });
  });
}

export interface ServerOptions {
  /** Reuse an address and data directory (a restart); default: a free port, a new dir. */
  address?: string;
  dataDir?: string;
  args?: string[];
  env?: Record<string, string>;
  /** Client options for the readiness probe (e.g. tls, bearerToken). */
  probe?: ClientOptions;
}

export class ServerProcess {
  readonly address: string;
  readonly dataDir: string;
  readonly #proc: ChildProcess;
  #log = "";

  private constructor(address: string, dataDir: string, proc: ChildProcess) {
    this.address = address;
    this.dataDir = dataDir;
    this.#proc = proc;
    proc.stdout?.on("data", (d: Buffer) => (this.#log += d.toString()));
    proc.stderr?.on("data", (d: Buffer) => (this.#log += d.toString()));
  }

  get log(): string {
    return this.#log;
  }

  /** Start a server and wait until it answers (a fresh port is tried if one was taken). */
  static async start(options: ServerOptions = {}): Promise<ServerProcess> {
    for (let attempt = 1; ; attempt++) {
      const address = options.address ?? `127.0.0.1:${await freePort()}`;
      const dataDir = options.dataDir ?? mkdtempSync(join(tmpdir(), "querator-ts-"));
      const proc = spawn(join(VENV, "bin", "querator"), ["serve", "--address", address, "--data-dir", dataDir, "--log-level", "warning", ...(options.args ?? [])], {
        env: { ...process.env, ...options.env },
        stdio: ["ignore", "pipe", "pipe"],
      });
      const server = new ServerProcess(address, dataDir, proc);
      if (await server.#ready(options.probe ?? {})) return server;
      await server.stop();
      if (attempt >= 3 || options.address) throw new Error(`querator serve did not start on ${address}:\n${server.log}`);
    }
  }

  async #ready(probe: ClientOptions): Promise<boolean> {
    const client = new Client({ ...probe, address: this.address, retries: 0, timeoutMs: 2000 });
    const limit = Date.now() + 60_000;
    try {
      while (Date.now() < limit) {
        if (this.#proc.exitCode !== null) return false;
        try {
          await client.listQueues({ pageSize: 1 }).toArray();
          return true;
        } catch (error) {
          if (error instanceof Unauthenticated) return true; // up, and asking for a key
          await new Promise((r) => setTimeout(r, 100));
        }
      }
      return false;
    } finally {
      client.close();
    }
  }

  /** Send the server process a signal (e.g. SIGSTOP, SIGCONT). */
  signal(signal: NodeJS.Signals): void {
    this.#proc.kill(signal);
  }

  /** Whether the process still runs. */
  get running(): boolean {
    return this.#proc.exitCode === null && this.#proc.signalCode === null;
  }

  /** kill -9 the server, keeping its data directory. */
  async kill(): Promise<void> {
    const proc = this.#proc;
    if (proc.exitCode === null && proc.signalCode === null) {
      const exited = new Promise<void>((r) => proc.once("exit", () => r()));
      proc.kill("SIGKILL");
      await exited;
    }
  }

  /** Stop the server (SIGTERM, then SIGKILL after 10 s) and remove its data. */
  async stop(): Promise<void> {
    const proc = this.#proc;
    if (proc.exitCode === null && proc.signalCode === null) {
      const exited = new Promise<void>((r) => proc.once("exit", () => r()));
      proc.kill("SIGTERM");
      const timer = setTimeout(() => proc.kill("SIGKILL"), 10_000);
      await exited;
      clearTimeout(timer);
    }
    rmSync(this.dataDir, { recursive: true, force: true });
  }
}

const run = promisify(execFile);

/** A server of the test file's own and a client of it: started before the file's tests
 * (`use` then receives both), closed and stopped after them. */
export function serveFile(use: (server: ServerProcess, client: Client) => void, options: ServerOptions = {}): void {
  let server: ServerProcess | undefined;
  let client: Client | undefined;
  before(async () => {
    server = await ServerProcess.start(options);
    client = new Client({ address: server.address });
    use(server, client);
  });
  after(async () => {
    client?.close();
    await server?.stop();
  });
}

/** Run a Python script with the .venv's python (the Python SDK installed); its stdout. */
export async function python(script: string, args: string[] = [], input?: string): Promise<string> {
  const child = run(PYTHON, ["-c", script, ...args], { maxBuffer: 64 << 20, timeout: 60_000 });
  if (input !== undefined) {
    child.child.stdin?.end(input);
  }
  const { stdout } = await child;
  return stdout;
}

let counter = 0;
/** A queue name no other test uses. */
export function queueName(prefix = "q"): string {
  return `${prefix}-${process.pid}-${++counter}`;
}

/** Poll `check` until it returns true; fails after `timeoutMs`. */
export async function waitUntil(check: () => boolean | Promise<boolean>, timeoutMs = 20_000, what = "condition"): Promise<void> {
  const limit = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > limit) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}
