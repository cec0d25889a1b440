/**
 * Prometheus metrics of a worker through prom-client, an optional peer dependency:
 * loaded (import()) only when a worker asks for metrics. The names, labels and buckets
 * are the Python worker's (querator.Worker with metrics=True), so one dashboard reads
 * both.
 */
import { type Server, createServer } from "node:http";

import { errorName } from "./failures.js";

/** A prom-client Registry (`new Registry()`, or prom-client's default `register`): the
 * parts the worker uses, so this package's types do not need prom-client installed. */
export interface MetricsRegistry {
  getSingleMetric(name: string): unknown;
  registerMetric(metric: never): void;
  metrics(): Promise<string>;
  readonly contentType: string;
}

// Seconds: handlers from a millisecond to ten minutes; lease lag up to a day.
const HANDLER_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600];
const LAG_BUCKETS = [0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 86400];

interface Counter {
  inc(labels: Record<string, string>, value?: number): void;
}
interface Histogram {
  observe(labels: Record<string, string>, value: number): void;
}
interface PromClient {
  Counter: new (config: { name: string; help: string; labelNames: string[]; registers: MetricsRegistry[] }) => Counter;
  Histogram: new (config: { name: string; help: string; labelNames: string[]; buckets: number[]; registers: MetricsRegistry[] }) => Histogram;
  register: MetricsRegistry;
}

async function load(): Promise<PromClient> {
  try {
    const module = (await import("prom-client")) as unknown as PromClient & { default?: PromClient };
    return module.Counter ? module : module.default!;
  } catch (error) {
    throw new Error("worker metrics need prom-client: npm install prom-client", { cause: error });
  }
}

/** The metrics of one worker's queue, in `registry` (prom-client's default registry when
 * undefined). Families already in the registry (another worker's) are reused: every
 * worker of a process adds its own label values. */
export class WorkerMetrics {
  readonly #queue: string;
  readonly #handled: Counter;
  readonly #failed: Counter;
  readonly #dead: Counter;
  readonly #seconds: Histogram;
  readonly #lag: Histogram;

  /** The registry the metrics are in. */
  readonly registry: MetricsRegistry;

  private constructor(queue: string, registry: MetricsRegistry, families: [Counter, Counter, Counter, Histogram, Histogram]) {
    this.#queue = queue;
    this.registry = registry;
    [this.#handled, this.#failed, this.#dead, this.#seconds, this.#lag] = families;
  }

  static async create(queue: string, registry: MetricsRegistry | undefined): Promise<WorkerMetrics> {
    const pc = await load();
    const reg = registry ?? pc.register;
    const counter = (name: string, help: string, labelNames: string[]): Counter =>
      (reg.getSingleMetric(name) as Counter | undefined) ?? new pc.Counter({ name, help, labelNames, registers: [reg] });
    const histogram = (name: string, help: string, labelNames: string[], buckets: number[]): Histogram =>
      (reg.getSingleMetric(name) as Histogram | undefined) ?? new pc.Histogram({ name, help, labelNames, buckets, registers: [reg] });
    // prom-client takes a counter's name as exposed: the Python client's "querator_worker_handled"
    // is exposed as "querator_worker_handled_total".
    return new WorkerMetrics(queue, reg, [
      counter("querator_worker_handled_total", "Items whose handler returned and that were completed.", ["queue", "kind"]),
      counter(
        "querator_worker_failed_total",
        "Handlers that raised (error: the exception's type name), timed out or had no handler.",
        ["queue", "kind", "error"],
      ),
      counter("querator_worker_dead_total", "Items sent to the dead-letter queue.", ["queue", "kind"]),
      histogram("querator_worker_handler_seconds", "Time in the handler.", ["queue", "kind"], HANDLER_BUCKETS),
      histogram("querator_worker_lease_lag_seconds", "From an item's created_at (server clock) to its lease by this worker.", ["queue"], LAG_BUCKETS),
    ]);
  }

  leased(created: readonly Date[]): void {
    const now = Date.now();
    for (const at of created) this.#lag.observe({ queue: this.#queue }, Math.max(0, (now - at.getTime()) / 1000));
  }

  handled(kind: string, elapsedMs: number): void {
    this.#handled.inc({ queue: this.#queue, kind });
    this.#seconds.observe({ queue: this.#queue, kind }, elapsedMs / 1000);
  }

  /** A handler's failure; `elapsedMs` undefined when no handler ran (an unknown kind). */
  failed(kind: string, error: unknown, elapsedMs: number | undefined): void {
    this.#failed.inc({ queue: this.#queue, kind, error: errorName(error) });
    if (elapsedMs !== undefined) this.#seconds.observe({ queue: this.#queue, kind }, elapsedMs / 1000);
  }

  dead(kind: string): void {
    this.#dead.inc({ queue: this.#queue, kind });
  }
}

const servers = new Map<number, [Server, MetricsRegistry]>();

/** Serve `registry` over HTTP on `port` (any path answers the metrics), once per port and
 * process, as the Python worker's metrics_port; returns the port bound (0: a free one).
 * The server does not keep the process alive (unref) and runs until it exits. */
export async function serveMetrics(registry: MetricsRegistry, port: number, host: string): Promise<number> {
  const found = servers.get(port);
  if (port && found) {
    if (found[1] !== registry) throw new Error(`metrics port ${port} already serves another registry`);
    return port;
  }
  const server = createServer((_request, response) => {
    registry.metrics().then(
      (text) => response.writeHead(200, { "Content-Type": registry.contentType }).end(text),
      (error: unknown) => response.writeHead(500).end(String(error)),
    );
  });
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, host, () => {
      server.off("error", reject);
      resolve();
    });
  });
  server.unref();
  const address = server.address();
  const bound = typeof address === "object" && address ? address.port : port;
  servers.set(bound, [server, registry]);
  return bound;
}
