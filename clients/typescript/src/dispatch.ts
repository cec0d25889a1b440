/**
 * Which handler an item goes to: one for every item, or one per `kind`, each with the
 * options of its kind (time limit, concurrency, retry rules). The Python SDK's Dispatch
 * and KindOptions, for Node.
 */
import { type DeadOn, FailureRules, KindRules, type RetryOn } from "./failures.js";
import type { LeasedItem } from "./items.js";

/** The handler: may return a promise. `signal` fires when the worker gives up on it: past
 * its `handlerTimeoutMs`, or at shutdown (after `shutdownTimeoutMs`). */
export type Handler = (item: LeasedItem, signal: AbortSignal) => unknown;

/** What one kind's handler may set for itself; what it leaves out takes the worker's. */
export interface KindOptions {
  /** Give up the handler after this long: its signal fires and the item is retried as
   * if it threw HandlerTimeout (soft: a handler that ignores its signal runs on). */
  handlerTimeoutMs?: number;
  /** Handlers of this kind running at once (within the worker's `concurrency`). */
  concurrency?: number;
  /** Rules for this kind's errors, looked up before the worker's. */
  retryOn?: RetryOn;
  deadOn?: DeadOn;
  /** Delay before a failed item of this kind comes back, by its attempt number. */
  retryBackoff?: (attempt: number) => number;
  /** Dead-letter an item of this kind after this many leases (the queue's maxAttempts
   * always holds too). */
  maxAttempts?: number;
}

/** A kind's handler with its options (`WorkerOptions.handlers`). */
export interface KindHandler extends KindOptions {
  handler: Handler;
}

export function checkKindOptions(where: string, o: KindOptions): void {
  if (o.concurrency !== undefined && !(Number.isInteger(o.concurrency) && o.concurrency >= 1)) throw new RangeError(`${where}concurrency must be at least 1`);
  if (o.maxAttempts !== undefined && !(o.maxAttempts >= 1)) throw new RangeError(`${where}maxAttempts must be at least 1`);
  if (o.handlerTimeoutMs !== undefined && !(o.handlerTimeoutMs > 0)) throw new RangeError(`${where}handlerTimeoutMs must be positive, got ${o.handlerTimeoutMs}`);
  new FailureRules(o.retryOn ?? [], o.deadOn ?? [], () => 0); // rejects bad rules now, not at the first failure
}

/** A handler and how it runs: its kind's time limit, slots and rules, if it has any. */
export class Route {
  readonly handler: Handler;
  readonly options: KindOptions;
  /** Handlers of this route running now (counted against options.concurrency). */
  running = 0;
  /** Its rules in front of the worker's; made as the worker starts. */
  rules: KindRules | undefined;

  constructor(handler: Handler, options: KindOptions = {}, kind?: string) {
    if (typeof handler !== "function") throw new TypeError(`a handler must be a function, not ${String(handler)}`);
    checkKindOptions(kind === undefined ? "" : `kind '${kind}': `, options);
    this.handler = handler;
    this.options = options;
  }

  get hasRoom(): boolean {
    return this.options.concurrency === undefined || this.running < this.options.concurrency;
  }

  start(workerRules: FailureRules): void {
    const o = this.options;
    const own = o.retryOn !== undefined || o.deadOn !== undefined || o.retryBackoff !== undefined || o.maxAttempts !== undefined;
    this.rules = own ? new KindRules(o, workerRules) : undefined;
  }
}

/** The handlers of a worker: `default` for every item, or by the item's `kind`, the
 * default then taking the kinds not named. An item with neither goes to the dead-letter
 * queue. */
export class Dispatch {
  readonly default: Route | undefined;
  readonly byKind = new Map<string, Route>();
  #frozen = false;

  constructor(handler: Handler | undefined, handlers: Record<string, Handler | KindHandler> = {}) {
    this.default = handler === undefined ? undefined : new Route(handler);
    for (const [kind, entry] of Object.entries(handlers)) {
      if (typeof entry === "function") this.add(kind, entry);
      else {
        const { handler: fn, ...options } = entry;
        this.add(kind, fn, options);
      }
    }
  }

  add(kind: string, handler: Handler, options: KindOptions = {}): void {
    if (this.#frozen) throw new Error("handlers are registered before the worker runs");
    if (typeof kind !== "string") throw new TypeError(`a kind is a string, not ${String(kind)}`);
    if (this.byKind.has(kind)) throw new RangeError(`a handler for kind '${kind}' is registered already`);
    this.byKind.set(kind, new Route(handler, options, kind));
  }

  route(kind: string): Route | undefined {
    return this.byKind.get(kind) ?? this.default;
  }

  /** Called as the worker starts: from then on the handlers are fixed. */
  start(workerRules: FailureRules): void {
    if (!this.default && !this.byKind.size) throw new Error("the worker has no handler: pass one, or register some with worker.handler(kind, fn) or the handlers option");
    this.#frozen = true;
    this.default?.start(workerRules);
    for (const route of this.byKind.values()) route.start(workerRules);
  }
}
