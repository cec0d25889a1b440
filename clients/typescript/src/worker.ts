/**
 * A Worker leases items, runs a handler on each, then completes, retries or
 * dead-letters them: the Python SDK's Worker, for Node.
 *
 * Delivery is at least once: an item is completed only after its handler returned; an
 * item whose worker died (or lost its lease) comes back by lease expiry and is handled
 * again with `attempts` one higher. Handlers must therefore be idempotent.
 *
 * One Lease is in flight at a time, sent once there is room for a batch
 * (concurrency + batchSize items held at most); leased items wait for a free handler
 * slot. Completions and retries that pile up while a call runs go in the next call,
 * one per partition. Held items' leases are extended (Extend) when half of their time
 * is gone, until the handler settles them.
 */
import type { Client } from "./client.js";
import { Dispatch, type Handler, type KindHandler, type KindOptions, type Route, checkKindOptions } from "./dispatch.js";
import { Cancelled, DeadLetter, HandlerTimeout, type QueratorError, Unavailable, isLeaseLost } from "./errors.js";
import { failureText } from "./failure.js";
import { type DeadOn, FailureLog, FailureRules, type RetryOn, errorName } from "./failures.js";
import type { LeasedItem } from "./items.js";
import { type MetricsRegistry, WorkerMetrics, serveMetrics } from "./metrics.js";
import { MAX_BATCH } from "./operations.js";
import { backoff, sleep } from "./retry.js";
import type { PartitionStats } from "./models.js";
import type { Logger } from "./routing.js";

export type { Handler, KindHandler, KindOptions } from "./dispatch.js";

/** Callbacks for metrics and logging; every one optional, each must be quick. An
 * exception thrown by a hook is ignored. */
export interface WorkerHooks {
  onLease?(items: readonly LeasedItem[]): void;
  onStart?(item: LeasedItem): void;
  onComplete?(item: LeasedItem, elapsedMs: number): void;
  onRetry?(item: LeasedItem, error: unknown, retryAt: Date): void;
  /** DeadLetter thrown, a rule of `deadOn`, out of attempts, or no handler for its kind. */
  onDead?(item: LeasedItem, error: unknown): void;
  onExtend?(items: readonly LeasedItem[]): void;
  onLeaseLost?(item: LeasedItem, error: QueratorError): void;
  /** The item's handler still runs at maxLeaseDurationMs: its lease is no longer
   * extended, and the item comes back to the queue when it runs out. */
  onLeaseCapped?(item: LeasedItem): void;
  onRelease?(items: readonly LeasedItem[]): void;
  onError?(error: unknown): void;
  /** Burst mode: every readable partition is empty, `faulty` are not readable (their node
   * down, their storage failing) and may hold items, so the worker waits for them;
   * called when it starts waiting, then at most once a minute. */
  onWaitFaulty?(faulty: readonly PartitionStats[], waitedMs: number): void;
}

/** Counters of what a worker did so far. */
export interface WorkerStats {
  leased: number;
  completed: number;
  retried: number;
  dead: number;
  extended: number;
  lost: number;
  released: number;
  /** Calls of the worker's that failed (Lease, Complete, Retry, Extend). */
  errors: number;
  /** Handlers that threw (or ran past handlerTimeoutMs, or had no handler for the
   * item's kind); `failures` counts them by error class name. */
  failed: number;
  failures: Record<string, number>;
  /** Handlers that ran past handlerTimeoutMs (also counted in `failed`). */
  timedOut: number;
  /** Items whose lease stopped being extended at maxLeaseDurationMs. */
  leaseCapped: number;
}

export interface WorkerOptions {
  /** Handlers running at once. Default 10. */
  concurrency?: number;
  /** Items asked for per Lease call (default: concurrency, at most 1,000). */
  batchSize?: number;
  /** How long a Lease waits on the server when nothing is ready. Default 30 s. */
  leaseWaitMs?: number;
  /** Extend the leases of held items when half their time is gone. Default true. */
  keepAlive?: boolean;
  /** Lease length Extend asks for (default: the queue's lease timeout). */
  leaseExtensionMs?: number;
  /** Keep-alive never holds an item longer than this from its lease (default: no cap);
   * past it, its lease runs out and the item comes back to the queue. */
  maxLeaseDurationMs?: number;
  /** Delay before a failed item comes back, by its attempt number (1 = first lease).
   * Default: backoff() (1 s doubling to 5 minutes, jittered). */
  retryBackoff?: (attempt: number) => number;
  /** Error classes (or RetryRules with a backoff and maxAttempts of their own) that are
   * retried; with `deadOn`, the most specific class named wins. */
  retryOn?: RetryOn;
  /** Error classes that send the item to the dead-letter queue at once. */
  deadOn?: DeadOn;
  /** A handler still running after this long is given up: its signal fires, and the
   * item is retried as if it threw HandlerTimeout. Default: no limit. */
  handlerTimeoutMs?: number;
  /** Handlers by item `kind` (the handler given to the constructor takes the other
   * kinds; with none, an item of an unknown kind is dead-lettered). */
  handlers?: Record<string, Handler | KindHandler>;
  /** Record Prometheus metrics with prom-client (an optional peer dependency): true for
   * prom-client's default registry, or a Registry of yours. */
  metrics?: boolean | MetricsRegistry;
  /** Serve the metrics over HTTP on this port (0: a free one; `worker.metricsPort` tells
   * which), once per port and process; implies `metrics`. */
  metricsPort?: number;
  /** The address the metrics port binds (default "127.0.0.1": this machine only, as the
   * Python worker's metrics_host; "0.0.0.0" for every interface). */
  metricsHost?: string;
  /** Where the default hooks log (default: console). */
  logger?: Logger;
  /** At stop: how long running handlers may finish before their items are released. Default 30 s. */
  shutdownTimeoutMs?: number;
  /** At stop: how long a Lease in flight may still answer before it is cancelled. Default 1 s. */
  leaseGraceMs?: number;
  /** Stop gracefully on SIGTERM and SIGINT while run() runs. Default true. */
  handleSignals?: boolean;
  /** Callbacks for metrics and logging (default: defaultWorkerHooks(logger): failures
   * logged, at most three per error class and minute). */
  hooks?: WorkerHooks;
  /** The Lease client_id (default: host, pid and a random suffix). */
  clientId?: string;
  /** Burst mode (`run({ untilEmpty: true })`): how long to wait for faulty partitions
   * once every other partition is empty; past it run() throws Unavailable naming them
   * instead of resolving. Default: wait until they are back (or stop()). */
  faultyTimeoutMs?: number;
}

/** Options of one run(). */
export interface RunOptions {
  /** Burst mode: resolve once the queue has nothing ready, leased (by anyone) or
   * scheduled, every partition readable (none faulty), and the worker holds nothing. */
  untilEmpty?: boolean;
}

/** Keep-alive does not bother to extend a lease by less than this (maxLeaseDurationMs). */
const MIN_EXTENSION_MS = 1000;
/** Burst mode: the longest a Lease waits, so that the worker notices soon that the queue
 * ran dry (items leased by others or scheduled may still come back). */
const BURST_WAIT_MS = 1000;
/** Burst mode: how often onWaitFaulty is called while faulty partitions keep it waiting. */
const FAULTY_LOG_EVERY_MS = 60_000;

/** The hooks a worker has unless given its own: handler failures logged with their
 * stack, at most three per error class and minute (the next line of a class says how many
 * were left out), as the Python worker logs them; lost leases, failed calls and burst
 * mode waiting on faulty partitions. Spread them to keep them beside hooks of your own:
 * `hooks: { ...defaultWorkerHooks(), onComplete }`. */
export function defaultWorkerHooks(logger: Logger = console): WorkerHooks {
  const failures = new FailureLog();
  return {
    onRetry: (item, error, at) =>
      failures.warn(logger, `querator: handler failed for item ${item.id} (attempt ${item.attempts}), retry at ${at.toISOString()}: ${String(error)}`, error),
    onDead: (item, error) => failures.warn(logger, `querator: item ${item.id} dead-lettered after ${item.attempts} attempts: ${String(error)}`, error),
    onLeaseLost: (item, error) => logger.warn?.(`querator: lease of item ${item.id} lost: ${error.message}`),
    onLeaseCapped: (item) => logger.warn?.(`querator: item ${item.id} held for maxLeaseDurationMs: its lease is no longer extended`),
    onError: (error) => (logger.error ?? logger.warn)?.call(logger, `querator: worker call failed: ${String(error)}`),
    onWaitFaulty: (faulty, waitedMs) =>
      logger.warn?.(
        `querator: burst mode: the queue is empty where it can be read, waiting for ${faulty.length} faulty partitions ` +
          `(for ${Math.round(waitedMs / 1000)} s so far): ${describeFaulty(faulty)}`,
      ),
  };
}

function describeFaulty(faulty: readonly PartitionStats[]): string {
  const shown = faulty.slice(0, 5).map((p) => `partition ${p.partition}: ${p.failure}`);
  if (faulty.length > 5) shown.push(`and ${faulty.length - 5} more`);
  return shown.join("; ");
}

interface Held {
  item: LeasedItem;
  /** Its handler; undefined: none for its kind (dead-lettered at once). */
  route: Route | undefined;
  /** performance.now() at which to extend the lease. */
  extendAt: number;
  /** performance.now() when its Lease was sent: maxLeaseDurationMs counts from here. */
  leasedAt: number;
  /** Keep-alive stopped at maxLeaseDurationMs. */
  capped: boolean;
  lengthMs: number;
  started: boolean;
  /** Settling or settled: keep-alive leaves it alone. */
  settling: boolean;
  lost: boolean;
}

/** An item's key among those a worker holds: its partition and its id. In a cluster each
 * partition's home issues ids from its own counters, so items of two partitions may have
 * the same id (docs/cluster.md, Limits). */
function heldKey(item: LeasedItem): string {
  return `${item.partition}/${item.id}`;
}

type RetrySettlement = { held: Held; kind: "retry"; at: Date | undefined; dead: boolean; error: unknown };
type Settlement = { held: Held; kind: "complete" } | RetrySettlement;

/** The options of a worker's Retry call (see Worker.#retryOrder); `error` is the
 * handler's failure text, which becomes the item's lastError. */
type RetryOrder = { at?: Date; dead: boolean; error: string };

/** Equal orders, equal keys: every field of the order counts (a Date as its ISO time). */
function retryKey(order: RetryOrder): string {
  return JSON.stringify(order);
}

function randomSuffix(): string {
  return Math.random().toString(16).slice(2, 10);
}

/**
 * Runs `handler` (or the handler of the item's kind) on items of `queueName`:
 *
 * - it returned: the item is completed (unless the handler settled it itself);
 * - it threw DeadLetter, or an error of `deadOn`: the item goes to the dead-letter queue;
 * - it threw anything else, or ran past `handlerTimeoutMs`: the item is retried at now +
 *   the backoff of the matching `retryOn` rule (else `retryBackoff`), dead-lettered
 *   instead once it used the queue's maxAttempts (or the rule's);
 * - no handler for its kind: dead-lettered at once.
 *
 * `await worker.run()` runs until `worker.stop()` (or SIGTERM/SIGINT): leasing stops,
 * leased items not started are released (Retry now), running handlers get
 * shutdownTimeoutMs to finish, and the items of those that do not are released too.
 */
export class Worker {
  readonly client: Client;
  readonly queueName: string;
  readonly stats: WorkerStats = {
    leased: 0,
    completed: 0,
    retried: 0,
    dead: 0,
    extended: 0,
    lost: 0,
    released: 0,
    errors: 0,
    failed: 0,
    failures: {},
    timedOut: 0,
    leaseCapped: 0,
  };
  readonly #dispatch: Dispatch;
  readonly #o: Required<
    Pick<WorkerOptions, "concurrency" | "leaseWaitMs" | "keepAlive" | "retryBackoff" | "shutdownTimeoutMs" | "leaseGraceMs" | "handleSignals">
  >;
  readonly #batchSize: number;
  readonly #extensionMs: number | undefined;
  readonly #maxLeaseMs: number | undefined;
  readonly #handlerTimeoutMs: number | undefined;
  readonly #rules: FailureRules;
  readonly #hooks: WorkerHooks;
  readonly #clientId: string;
  readonly #metricsOption: boolean | MetricsRegistry;
  readonly #metricsServe: { port: number; host: string } | undefined;
  #metrics: WorkerMetrics | undefined;
  /** The port the metrics are served on, once run() started with `metricsPort`. */
  metricsPort: number | undefined;
  readonly #held = new Map<string, Held>(); // by heldKey()
  readonly #waiting: Held[] = [];
  readonly #running = new Set<Promise<void>>();
  #settlements: Settlement[] = [];
  #settling: Promise<void> | undefined;
  #stopping = false;
  #runPromise: Promise<void> | undefined;
  readonly #stop = new AbortController();
  readonly #handlerAbort = new AbortController();
  #wake: (() => void) | undefined;
  #newLeases: (() => void) | undefined;
  /** Shut down: keep-alive, which runs on while handlers finish at stop, ends. */
  #done = false;
  #leaseTimeoutMs = 60_000;
  #maxAttempts = 0;
  #untilEmpty = false;
  readonly #faultyTimeoutMs: number | undefined;
  /** Burst mode: since when every readable partition is empty while others are faulty
   * (performance.now(); undefined: not so), when onWaitFaulty was last called, and what
   * run() throws once faultyTimeoutMs has passed. */
  #faultySince: number | undefined;
  #faultyLogged: number | undefined;
  #burstError: QueratorError | undefined;

  /** `new Worker(client, queue, handler, options)`, or without a handler for every item:
   * `new Worker(client, queue, { handlers: { email: sendEmail } })` and/or
   * `worker.handler("email", sendEmail)`. */
  constructor(client: Client, queueName: string, handler?: Handler | WorkerOptions, options: WorkerOptions = {}) {
    if (handler !== undefined && typeof handler !== "function") {
      options = handler;
      handler = undefined;
    }
    this.client = client;
    this.queueName = queueName;
    this.#o = {
      concurrency: options.concurrency ?? 10,
      leaseWaitMs: options.leaseWaitMs ?? 30_000,
      keepAlive: options.keepAlive ?? true,
      retryBackoff: options.retryBackoff ?? backoff(),
      shutdownTimeoutMs: options.shutdownTimeoutMs ?? 30_000,
      leaseGraceMs: options.leaseGraceMs ?? 1_000,
      handleSignals: options.handleSignals ?? true,
    };
    if (this.#o.concurrency < 1) throw new RangeError("concurrency must be at least 1");
    this.#batchSize = Math.min(options.batchSize ?? this.#o.concurrency, MAX_BATCH);
    if (this.#batchSize < 1) throw new RangeError(`batchSize must be between 1 and ${MAX_BATCH}`);
    this.#extensionMs = options.leaseExtensionMs;
    if (options.maxLeaseDurationMs !== undefined && !(options.maxLeaseDurationMs > 0)) {
      throw new RangeError(`maxLeaseDurationMs must be positive, got ${options.maxLeaseDurationMs}`);
    }
    this.#maxLeaseMs = options.maxLeaseDurationMs;
    checkKindOptions("", { ...(options.handlerTimeoutMs !== undefined ? { handlerTimeoutMs: options.handlerTimeoutMs } : {}) });
    this.#handlerTimeoutMs = options.handlerTimeoutMs;
    this.#rules = new FailureRules(options.retryOn ?? [], options.deadOn ?? [], this.#o.retryBackoff);
    this.#dispatch = new Dispatch(handler, options.handlers);
    this.#hooks = options.hooks ?? defaultWorkerHooks(options.logger);
    this.#clientId = options.clientId ?? `node:${process.pid}:${randomSuffix()}`;
    if (options.faultyTimeoutMs !== undefined && !(options.faultyTimeoutMs > 0)) {
      throw new RangeError(`faultyTimeoutMs must be positive, got ${options.faultyTimeoutMs}`);
    }
    this.#faultyTimeoutMs = options.faultyTimeoutMs;
    if (options.metricsPort !== undefined && !(Number.isInteger(options.metricsPort) && options.metricsPort >= 0 && options.metricsPort <= 65535)) {
      throw new RangeError(`metricsPort must be between 0 and 65535, got ${options.metricsPort}`);
    }
    this.#metricsServe = options.metricsPort === undefined ? undefined : { port: options.metricsPort, host: options.metricsHost ?? "127.0.0.1" };
    this.#metricsOption = options.metrics || this.#metricsServe !== undefined;
  }

  /** Handle items of `kind` with `handler` (and the kind's own options); before run().
   * Returns the worker, so that calls chain. */
  handler(kind: string, handler: Handler, options: KindOptions = {}): this {
    this.#dispatch.add(kind, handler, options);
    return this;
  }

  /** Run until stopped; with `untilEmpty` (burst mode), also resolve once the queue is
   * empty: nothing ready, leased or scheduled, no partition faulty, nothing held. Throws
   * at start-up when the queue cannot be read (e.g. QueueNotFound), and in burst mode
   * Unavailable when partitions stay faulty past faultyTimeoutMs. */
  run(options: RunOptions = {}): Promise<void> {
    if (!this.#runPromise) {
      this.#untilEmpty = options.untilEmpty ?? false;
      this.#runPromise = this.#run();
    }
    return this.#runPromise;
  }

  /** Ask the worker to stop gracefully; resolves once run() has returned. */
  async stop(): Promise<void> {
    this.#stopping = true;
    this.#stop.abort();
    this.#wake?.();
    if (this.#runPromise) await this.#runPromise.catch(() => undefined);
  }

  #hook<K extends keyof WorkerHooks>(name: K, ...args: Parameters<NonNullable<WorkerHooks[K]>>): void {
    try {
      (this.#hooks[name] as ((...a: unknown[]) => void) | undefined)?.call(this.#hooks, ...args);
    } catch {
      // a hook must not break the worker
    }
  }

  #error(error: unknown): void {
    this.stats.errors++;
    this.#hook("onError", error);
  }

  async #run(): Promise<void> {
    this.#dispatch.start(this.#rules);
    if (this.#stopping) return; // stopped before it started
    if (this.#metricsOption) {
      this.#metrics = await WorkerMetrics.create(this.queueName, this.#metricsOption === true ? undefined : this.#metricsOption);
      if (this.#metricsServe) this.metricsPort = await serveMetrics(this.#metrics.registry, this.#metricsServe.port, this.#metricsServe.host);
    }
    let info;
    try {
      info = await this.client.getQueue(this.queueName, { signal: this.#stop.signal });
    } catch (error) {
      if (error instanceof Cancelled && this.#stopping) return;
      throw error;
    }
    this.#leaseTimeoutMs = info.leaseTimeoutMs;
    this.#maxAttempts = info.maxAttempts;
    const onSignal = (): void => void this.stop();
    if (this.#o.handleSignals) {
      process.on("SIGTERM", onSignal);
      process.on("SIGINT", onSignal);
    }
    const keepAlive = this.#o.keepAlive ? this.#keepAlive() : Promise.resolve();
    try {
      for await (const batch of this.#batches()) {
        this.#take(batch);
      }
    } finally {
      if (this.#o.handleSignals) {
        process.off("SIGTERM", onSignal);
        process.off("SIGINT", onSignal);
      }
      await this.#shutdown();
      this.#done = true;
      this.#newLeases?.();
      await keepAlive;
    }
    if (this.#burstError) throw this.#burstError;
  }

  /** Burst mode, with nothing held: whether the queue has nothing ready, leased (by
   * anyone) or scheduled. A faulty partition (its node down, its storage failing) may
   * hold items that its counts do not show: the queue is not empty until it is back and
   * empty too. */
  async #drained(): Promise<boolean> {
    let stats;
    try {
      stats = await this.client.queueStats(this.queueName, { signal: this.#stop.signal });
    } catch (error) {
      if (!(error instanceof Cancelled && this.#stopping)) this.#error(error);
      return false;
    }
    if (stats.total || stats.scheduled) {
      this.#faultySince = undefined;
      return false;
    }
    const faulty = stats.partitions.filter((p) => p.faulty);
    if (!faulty.length) return true;
    const now = performance.now();
    this.#faultySince ??= now;
    const waited = now - this.#faultySince;
    if (this.#faultyTimeoutMs !== undefined && waited >= this.#faultyTimeoutMs) {
      this.#burstError = new Unavailable(
        `queue '${this.queueName}' is empty where it can be read, but ${faulty.length} of its partitions stayed faulty ` +
          `for ${Math.round(waited / 1000)} s (faultyTimeoutMs), so it may still hold items: ${describeFaulty(faulty)}`,
      );
      this.#stopping = true;
      return false;
    }
    if (this.#faultyLogged === undefined || now - this.#faultyLogged >= FAULTY_LOG_EVERY_MS) {
      this.#faultyLogged = now;
      this.#hook("onWaitFaulty", faulty, waited);
    }
    return false;
  }

  // -- leasing ----------------------------------------------------------------------------

  /** The worker's leased batches, one Lease at a time, each sent once there is room. */
  async *#batches(): AsyncGenerator<LeasedItem[], void, undefined> {
    const maxHeld = this.#o.concurrency + this.#batchSize;
    let failures = 0;
    while (!this.#stopping) {
      const room = maxHeld - this.#held.size;
      // A full batch, or whatever fits once no leased item waits for a handler.
      if (room < this.#batchSize && (room <= 0 || this.#waiting.length > 0)) {
        await new Promise<void>((resolve) => (this.#wake = resolve));
        continue;
      }
      if (this.#untilEmpty && this.#held.size === 0 && (await this.#drained())) return;
      if (this.#stopping) return;
      const sent = performance.now();
      const [signal, done] = this.#leaseSignal();
      let items: LeasedItem[];
      try {
        items = await this.client.lease(this.queueName, {
          batchSize: Math.min(room, this.#batchSize),
          waitMs: this.#untilEmpty ? Math.min(this.#o.leaseWaitMs, BURST_WAIT_MS) : this.#o.leaseWaitMs,
          clientId: this.#clientId,
          signal,
        });
        failures = 0;
      } catch (error) {
        if (error instanceof Cancelled && this.#stopping) return;
        failures++;
        this.#error(error);
        // UNAVAILABLE: the client's own backoff (its RetryPolicy); a server that answers
        // with an error is asked again less often, up to every 5 s.
        const delay = error instanceof Unavailable ? this.client.retryPolicy.backoff(failures) : Math.min(5000, 200 * 2 ** failures);
        await sleep(delay, this.#stop.signal);
        continue;
      } finally {
        done();
      }
      if (items.length) {
        this.stats.leased += items.length;
        this.#hook("onLease", items);
        this.#metrics?.leased(items.map((i) => i.createdAt));
        for (const item of items) {
          const held: Held = {
            item,
            route: this.#dispatch.route(item.kind),
            extendAt: sent + this.#leaseTimeoutMs / 2,
            leasedAt: sent,
            capped: false,
            lengthMs: this.#leaseTimeoutMs,
            started: false,
            settling: false,
            lost: false,
          };
          this.#held.set(heldKey(item), held);
        }
        this.#newLeases?.();
        yield items;
      }
    }
  }

  /** The signal of a Lease call, and the function to call once it answered: at stop,
   * the call gets leaseGraceMs to answer (its items are then released) rather than being
   * cut off while it may commit. */
  #leaseSignal(): [AbortSignal, () => void] {
    const grace = new AbortController();
    let timer: NodeJS.Timeout | undefined;
    const onStop = (): void => {
      timer = setTimeout(() => grace.abort(), this.#o.leaseGraceMs);
    };
    if (this.#stop.signal.aborted) onStop();
    else this.#stop.signal.addEventListener("abort", onStop, { once: true });
    return [
      grace.signal,
      () => {
        clearTimeout(timer);
        this.#stop.signal.removeEventListener("abort", onStop);
      },
    ];
  }

  #take(items: LeasedItem[]): void {
    for (const item of items) {
      const held = this.#held.get(heldKey(item))!;
      if (held.route) this.#waiting.push(held);
      else void this.#noHandler(held);
    }
    this.#pump();
  }

  /** Start handlers while there are free slots, each item's kind within its own limit. */
  #pump(): void {
    while (!this.#stopping && this.#running.size < this.#o.concurrency && this.#waiting.length) {
      const index = this.#waiting.findIndex((h) => h.route!.hasRoom);
      if (index < 0) break;
      const [held] = this.#waiting.splice(index, 1) as [Held];
      const route = held.route!;
      route.running++;
      const task: Promise<void> = this.#process(held, route).finally(() => {
        route.running--;
        this.#running.delete(task);
        this.#pump();
        this.#wake?.();
      });
      this.#running.add(task);
    }
    if (!this.#waiting.length) this.#wake?.();
  }

  // -- handling ---------------------------------------------------------------------------

  async #process(held: Held, route: Route): Promise<void> {
    const item = held.item;
    held.started = true;
    this.#hook("onStart", item);
    const began = performance.now();
    let error: unknown;
    let failed = false;
    const timeoutMs = route.options.handlerTimeoutMs ?? this.#handlerTimeoutMs;
    try {
      if (timeoutMs === undefined) await route.handler(item, this.#handlerAbort.signal);
      else await this.#limited(route, item, timeoutMs);
    } catch (e) {
      error = e;
      failed = true;
    }
    const elapsed = performance.now() - began;
    if (this.#handlerAbort.signal.aborted && !item.settled) return; // given up at shutdown: released there
    held.settling = true;
    try {
      if (failed) this.#failed(item, error, elapsed);
      if (item.settled) {
        if (item.state === "completed") this.#completed(item, elapsed);
        else if (item.state === "dead") this.#dead(item, error);
        else this.stats.retried++;
        return;
      }
      if (!failed) {
        if (await this.#settle({ held, kind: "complete" })) this.#completed(item, elapsed);
        return;
      }
      const decision = (route.rules ?? this.#rules).decide(error);
      const outOfAttempts =
        (this.#maxAttempts > 0 && item.attempts >= this.#maxAttempts) || (decision.maxAttempts !== undefined && item.attempts >= decision.maxAttempts);
      if (decision.dead || error instanceof DeadLetter || outOfAttempts) {
        if (await this.#settle({ held, kind: "retry", at: undefined, dead: true, error })) this.#dead(item, error);
        return;
      }
      const at = new Date(Date.now() + decision.backoff(item.attempts));
      if (await this.#settle({ held, kind: "retry", at, dead: false, error })) {
        this.stats.retried++;
        this.#hook("onRetry", item, error, at);
      }
    } finally {
      this.#held.delete(heldKey(item));
    }
  }

  /** A handler under its time limit. JavaScript cannot stop a promise: past the limit its
   * signal fires and the worker stops waiting for it; a handler that ignores the signal
   * runs on, its result ignored. */
  async #limited(route: Route, item: LeasedItem, timeoutMs: number): Promise<void> {
    const limit = new AbortController();
    const signal = AbortSignal.any([this.#handlerAbort.signal, limit.signal]);
    let call: Promise<unknown>;
    try {
      call = Promise.resolve(route.handler(item, signal));
    } catch (error) {
      call = Promise.reject(error);
    }
    let timer: NodeJS.Timeout | undefined;
    let expired: HandlerTimeout | undefined;
    const timeout = new Promise<never>((_, reject) => {
      timer = setTimeout(() => {
        expired = new HandlerTimeout(`the handler ran past handlerTimeoutMs (${timeoutMs} ms): its signal was aborted and it was given up`);
        limit.abort(expired);
        reject(expired);
      }, timeoutMs);
    });
    // Given up: what the handler does later is no one's to handle.
    call.catch(() => undefined);
    timeout.catch(() => undefined);
    try {
      await Promise.race([call, timeout]);
    } catch (error) {
      // A handler that gave up on its aborted signal threw its own error: the limit is why.
      throw expired ?? error;
    } finally {
      clearTimeout(timer);
    }
  }

  /** No handler for the item's kind: dead-lettered at once, as the Python worker does. */
  async #noHandler(held: Held): Promise<void> {
    const item = held.item;
    held.started = true;
    held.settling = true;
    const error = new DeadLetter(`no handler for kind '${item.kind}'`);
    try {
      this.#failed(item, error, undefined);
      if (await this.#settle({ held, kind: "retry", at: undefined, dead: true, error })) this.#dead(item, error);
    } finally {
      this.#held.delete(heldKey(item));
    }
  }

  /** Counts a handler's failure (stats, metrics); the hooks log it. */
  #failed(item: LeasedItem, error: unknown, elapsedMs: number | undefined): void {
    this.stats.failed++;
    const name = errorName(error);
    this.stats.failures[name] = (this.stats.failures[name] ?? 0) + 1;
    if (error instanceof HandlerTimeout) this.stats.timedOut++;
    this.#metrics?.failed(item.kind, error, elapsedMs);
  }

  #completed(item: LeasedItem, elapsedMs: number): void {
    this.stats.completed++;
    this.#hook("onComplete", item, elapsedMs);
    this.#metrics?.handled(item.kind, elapsedMs);
  }

  #dead(item: LeasedItem, error: unknown): void {
    this.stats.dead++;
    this.#hook("onDead", item, error);
    this.#metrics?.dead(item.kind);
  }

  #lost(held: Held, error: QueratorError): void {
    if (held.lost) return;
    held.lost = true;
    this.stats.lost++;
    this.#hook("onLeaseLost", held.item, error);
  }

  // -- settling: completes and retries in batches -----------------------------------------

  readonly #results = new Map<Settlement, (ok: boolean) => void>();

  /** Queue one settlement; what queued up while a call ran goes in the next one. */
  #settle(s: Settlement): Promise<boolean> {
    return new Promise((resolve) => {
      this.#results.set(s, resolve);
      this.#settlements.push(s);
      this.#kick();
    });
  }

  /** Start draining the settlements unless a drain runs; one that ends with more queued
   * (they came in after its last look) starts the next. */
  #kick(): void {
    if (this.#settling) return;
    this.#settling = new Promise<void>((r) => setImmediate(r))
      .then(() => this.#drain())
      .finally(() => {
        this.#settling = undefined;
        if (this.#settlements.length) this.#kick();
      });
  }

  async #drain(): Promise<void> {
    while (this.#settlements.length) {
      const batch = this.#settlements;
      this.#settlements = [];
      const groups = new Map<string, Settlement[]>();
      for (const s of batch) {
        const key = s.kind === "complete" ? `c\0${s.held.item.partition}` : `r\0${s.held.item.partition}\0${retryKey(this.#retryOrder(s))}`;
        const group = groups.get(key) ?? [];
        group.push(s);
        groups.set(key, group);
      }
      for (const group of groups.values()) {
        for (let start = 0; start < group.length; start += MAX_BATCH) await this.#apply(group.slice(start, start + MAX_BATCH), true);
      }
    }
  }

  /** The one place a failed item's Retry is built: when it comes back, or dead. Retries
   * with equal orders go in one call (retryKey). */
  #retryOrder(s: RetrySettlement): RetryOrder {
    const error = failureText(s.error);
    return s.at ? { at: s.at, dead: s.dead, error } : { dead: s.dead, error };
  }

  async #apply(group: Settlement[], split: boolean): Promise<void> {
    const done = (ok: boolean): void => {
      for (const s of group) {
        this.#results.get(s)?.(ok);
        this.#results.delete(s);
      }
    };
    try {
      const first = group[0]!;
      const items = group.map((s) => s.held.item);
      // A group is one order: completes, or retries with the same retryOrder.
      if (first.kind === "complete") await this.client.complete(items);
      else await this.client.retry(items, this.#retryOrder(first));
      done(true);
    } catch (error) {
      if (isLeaseLost(error)) {
        if (split && group.length > 1) {
          // All-or-nothing: find the lost ones.
          for (const s of group) await this.#apply([s], false);
          return;
        }
        for (const s of group) this.#lost(s.held, error);
      } else {
        this.#error(error);
      }
      done(false);
    }
  }

  // -- keep-alive -------------------------------------------------------------------------

  async #keepAlive(): Promise<void> {
    while (!this.#done) {
      const now = performance.now();
      const due = [...this.#held.values()].filter((h) => this.#keep(h) && h.extendAt <= now);
      if (due.length) await this.#extend(due);
      const upcoming = [...this.#held.values()].filter((h) => this.#keep(h)).map((h) => h.extendAt);
      const delay = Math.min(Math.max(Math.min(...upcoming, performance.now() + 1000) - performance.now(), 20), 1000);
      // New leases wake it early: their first extension may be due sooner than the delay.
      // It runs on through a stop, while running handlers finish.
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, delay);
        this.#newLeases = () => (clearTimeout(timer), resolve());
      });
      this.#newLeases = undefined;
    }
  }

  #keep(held: Held): boolean {
    return !(held.lost || held.settling || held.capped || held.item.settled);
  }

  /** `due` split by maxLeaseDurationMs: those extended by the usual length, those that
   * may only be extended by less (the room left to the cap), and the rest capped: their
   * leases run out. */
  #capped(due: Held[]): [Held[], [Held, number][]] {
    const full = this.#extensionMs ?? this.#leaseTimeoutMs;
    const now = performance.now();
    const whole: Held[] = [];
    const short: [Held, number][] = [];
    for (const h of due) {
      const left = h.leasedAt + this.#maxLeaseMs! - now;
      if (left >= full) whole.push(h);
      else if (left >= MIN_EXTENSION_MS) short.push([h, left]);
      else {
        h.capped = true;
        this.stats.leaseCapped++;
        this.#hook("onLeaseCapped", h.item);
      }
    }
    return [whole, short];
  }

  async #extend(due: Held[]): Promise<void> {
    if (this.#maxLeaseMs !== undefined) {
      const [whole, short] = this.#capped(due);
      for (const [h, left] of short) await this.#extendOne(h, Math.floor(left));
      due = whole;
    }
    const byPartition = new Map<number, Held[]>();
    for (const h of due) byPartition.set(h.item.partition, [...(byPartition.get(h.item.partition) ?? []), h]);
    const options = this.#extensionMs !== undefined ? { leaseTimeoutMs: this.#extensionMs } : {};
    for (const members of byPartition.values()) {
      for (let start = 0; start < members.length; start += MAX_BATCH) {
        const chunk = members.slice(start, start + MAX_BATCH);
        const sent = performance.now();
        try {
          await this.client.extend(chunk.map((h) => h.item), options);
          this.#extended(chunk, sent, this.#extensionMs ?? this.#leaseTimeoutMs);
        } catch (error) {
          if (!isLeaseLost(error)) {
            this.#error(error);
            for (const h of chunk) h.extendAt = sent + Math.min(1000, h.lengthMs / 10); // again soon, while it lasts
            continue;
          }
          for (const h of chunk) await this.#extendOne(h, this.#extensionMs);
        }
      }
    }
  }

  async #extendOne(h: Held, lengthMs: number | undefined): Promise<void> {
    const sent = performance.now();
    try {
      await this.client.extend(h.item, lengthMs !== undefined ? { leaseTimeoutMs: lengthMs } : {});
      this.#extended([h], sent, lengthMs ?? this.#leaseTimeoutMs);
    } catch (error) {
      if (isLeaseLost(error)) {
        if (this.#keep(h)) this.#lost(h, error); // else it was settled meanwhile: not lost
      } else {
        this.#error(error);
        h.extendAt = performance.now() + Math.min(1000, h.lengthMs / 10);
      }
    }
  }

  #extended(chunk: Held[], sent: number, lengthMs: number): void {
    for (const h of chunk) {
      h.lengthMs = lengthMs;
      h.extendAt = sent + lengthMs / 2;
    }
    this.stats.extended += chunk.length;
    this.#hook("onExtend", chunk.map((h) => h.item));
  }

  // -- shutdown ---------------------------------------------------------------------------

  /** Give items back at once (Retry now) so others can take them. */
  async #release(items: LeasedItem[]): Promise<void> {
    if (!items.length) return;
    try {
      await this.client.retry(items);
      this.stats.released += items.length;
    } catch {
      for (const item of items) {
        try {
          await this.client.retry(item);
          this.stats.released++;
        } catch (error) {
          if (!isLeaseLost(error)) this.#error(error);
        }
      }
    }
    this.#hook("onRelease", items);
  }

  async #shutdown(): Promise<void> {
    this.#stopping = true;
    // Leased but not started: give them back now.
    const waiting = this.#waiting.splice(0);
    for (const h of waiting) this.#held.delete(heldKey(h.item));
    await this.#release(waiting.map((h) => h.item));
    if (this.#running.size) {
      let timer: NodeJS.Timeout | undefined;
      const late = await Promise.race([
        Promise.all(this.#running).then(() => false),
        new Promise<boolean>((resolve) => (timer = setTimeout(() => resolve(true), this.#o.shutdownTimeoutMs))),
      ]);
      clearTimeout(timer);
      if (late) {
        this.#handlerAbort.abort();
        const stuck = [...this.#held.values()].filter((h) => h.started && !h.settling && !h.item.settled);
        for (const h of stuck) this.#held.delete(heldKey(h.item));
        await this.#release(stuck.map((h) => h.item));
      }
    }
    while (this.#settling) await this.#settling;
  }
}
