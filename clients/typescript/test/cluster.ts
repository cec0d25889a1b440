/** A real etcd and three `querator serve --cluster` nodes for the cluster tests, as
 * server/tests/cluster_helpers.py starts them: etcd from the `etcd` binary on free
 * loopback ports (./dev test installs it when it can), each node with its own data
 * directory and a metrics endpoint, everything stopped by its PID. */
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before } from "node:test";

import { ServerProcess, freePort } from "./server.js";

/** Why the cluster tests cannot run here (no etcd binary), or false. In CI they must
 * not silently vanish: there the missing binary fails them instead. */
export function etcdMissing(): string | false {
  try {
    execFileSync("sh", ["-c", "command -v etcd"], { stdio: "ignore" });
    return false;
  } catch {
    if (process.env["CI"] === "true") throw new Error("the cluster tests need the etcd binary (Debian: apt-get install etcd-server)");
    return "the cluster tests need the etcd binary (Debian: apt-get install etcd-server; ./dev test installs it when run as root)";
  }
}

/** A cluster of `size` nodes (membership `ttl` seconds) of the test file's own, when
 * etcd is installed: started before the file's tests (`use` then receives it), stopped
 * after them. Returns etcdMissing()'s answer, for the tests' `skip`. */
export function clusterFile(use: (cluster: TestCluster) => void, size = 3, ttl = 3): string | false {
  const skip = etcdMissing();
  let cluster: TestCluster | undefined;
  before(async () => {
    if (skip) return;
    cluster = await TestCluster.start(size, ttl);
    use(cluster);
  });
  after(async () => {
    await cluster?.stop();
  });
  return skip;
}

export class Etcd {
  readonly endpoint: string;
  readonly #proc: ChildProcess;
  readonly #dir: string;
  #log = "";

  private constructor(endpoint: string, proc: ChildProcess, dir: string) {
    this.endpoint = endpoint;
    this.#proc = proc;
    this.#dir = dir;
    proc.stderr?.on("data", (d: Buffer) => (this.#log = (this.#log + d.toString()).slice(-4000)));
  }

  static async start(): Promise<Etcd> {
    const dir = mkdtempSync(join(tmpdir(), "querator-ts-etcd-"));
    const client = `http://127.0.0.1:${await freePort()}`;
    const peer = `http://127.0.0.1:${await freePort()}`;
    const proc = spawn(
      "etcd",
      [
        "--name", "test", "--data-dir", join(dir, "data"),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", `test=${peer}`, "--log-level", "warn",
      ],
      { stdio: ["ignore", "ignore", "pipe"] },
    );
    const etcd = new Etcd(client.slice("http://".length), proc, dir);
    const limit = Date.now() + 30_000;
    for (;;) {
      if (proc.exitCode !== null) throw new Error(`etcd exited with ${proc.exitCode}:\n${etcd.#log}`);
      try {
        if ((await fetch(`${client}/health`)).ok) return etcd;
      } catch {
        // not listening yet
      }
      if (Date.now() > limit) throw new Error(`etcd did not answer within 30 s:\n${etcd.#log}`);
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  async stop(): Promise<void> {
    const proc = this.#proc;
    if (proc.exitCode === null && proc.signalCode === null) {
      const exited = new Promise<void>((r) => proc.once("exit", () => r()));
      proc.kill("SIGKILL");
      await exited;
    }
    rmSync(this.#dir, { recursive: true, force: true });
  }
}

/** One node: its server process, id, metrics address and fault file (kept across
 * restarts; write the file to make the node's storage fail, see server faults.py). */
export interface ClusterNode {
  id: string;
  server: ServerProcess;
  metrics: string;
  faultFile: string;
}

export class TestCluster {
  readonly etcd: Etcd;
  readonly url: string;
  readonly nodes: ClusterNode[] = [];
  readonly ttl: number;
  readonly #faults = mkdtempSync(join(tmpdir(), "querator-ts-faults-"));

  private constructor(etcd: Etcd, ttl: number) {
    this.etcd = etcd;
    this.ttl = ttl;
    this.url = `etcd://${etcd.endpoint}/ts-${process.pid}-${Math.random().toString(16).slice(2, 8)}`;
  }

  /** etcd and `size` nodes n1..n<size>, started side by side. */
  static async start(size = 3, ttl = 3): Promise<TestCluster> {
    const cluster = new TestCluster(await Etcd.start(), ttl);
    try {
      const nodes = await Promise.all(
        Array.from({ length: size }, async (_, i) => {
          const metrics = `127.0.0.1:${await freePort()}`;
          const id = `n${i + 1}`;
          const faultFile = join(cluster.#faults, id);
          return { id, metrics, faultFile, server: await ServerProcess.start({ args: cluster.#args(id, metrics), env: { QUERATOR_FAULT_FILE: faultFile } }) };
        }),
      );
      cluster.nodes.push(...nodes);
    } catch (error) {
      await cluster.stop();
      throw error;
    }
    return cluster;
  }

  #args(id: string, metrics: string): string[] {
    return ["--cluster", this.url, "--node-id", id, "--cluster-lease-ttl", String(this.ttl), "--metrics-address", metrics];
  }

  node(id: string): ClusterNode {
    const node = this.nodes.find((n) => n.id === id);
    if (!node) throw new Error(`no node ${id}`);
    return node;
  }

  get addresses(): string[] {
    return this.nodes.map((n) => n.server.address);
  }

  /** Start a node again on its address and data directory (after kill()). */
  async restart(id: string): Promise<void> {
    const node = this.node(id);
    node.server = await ServerProcess.start({
      address: node.server.address,
      dataDir: node.server.dataDir,
      args: this.#args(id, node.metrics),
      env: { QUERATOR_FAULT_FILE: node.faultFile },
    });
  }

  /** querator_rpc_requests_total of a node for `method` and `queue`, all status codes. */
  rpcCount(id: string, method: string, queue: string): Promise<number> {
    return this.metric(id, "querator_rpc_requests_total", { method, queue });
  }

  /** The sum of a node's series of `name` whose labels include `labels`. */
  async metric(id: string, name: string, labels: Record<string, string>): Promise<number> {
    const text = await (await fetch(`http://${this.node(id).metrics}/metrics`)).text();
    const wanted = Object.entries(labels).map(([k, v]) => `${k}="${v}"`);
    let total = 0;
    for (const line of text.split("\n")) {
      if (!line.startsWith(`${name}{`) || !wanted.every((w) => line.includes(w))) continue;
      total += Number(line.slice(line.lastIndexOf(" ") + 1));
    }
    return total;
  }

  async stop(): Promise<void> {
    for (const node of this.nodes) {
      node.server.signal("SIGCONT");
      await node.server.stop();
    }
    await this.etcd.stop();
    rmSync(this.#faults, { recursive: true, force: true });
  }
}
