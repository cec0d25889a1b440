/**
 * What a worker does with a handler's error: the retry rules (`retryOn`, `deadOn`,
 * RetryRule), and the failure log that keeps one broken dependency from flooding the
 * output. The Python SDK's FailureRules and FailureLog, for Node.
 */
import { DeadLetter } from "./errors.js";
import type { Logger } from "./routing.js";

/** A class of errors a rule names: any constructor whose instances are thrown. */
export type ErrorType = abstract new (...args: never[]) => unknown;

/** How errors of the given classes are retried (`retryOn`): after `backoff(attempt)`
 * ms (default: the worker's `retryBackoff`), dead-lettered after `maxAttempts` leases
 * (default: the queue's `maxAttempts`, which always holds). */
export class RetryRule {
  readonly errors: readonly ErrorType[];
  readonly backoff: ((attempt: number) => number) | undefined;
  readonly maxAttempts: number | undefined;

  constructor(errors: ErrorType | readonly ErrorType[], options: { backoff?: (attempt: number) => number; maxAttempts?: number } = {}) {
    const list = typeof errors === "function" ? [errors] : [...errors];
    if (!list.length || !list.every((e) => typeof e === "function")) throw new TypeError("RetryRule takes error classes");
    if (options.maxAttempts !== undefined && !(options.maxAttempts >= 1)) throw new RangeError("RetryRule maxAttempts must be at least 1");
    this.errors = list;
    this.backoff = options.backoff;
    this.maxAttempts = options.maxAttempts;
  }
}

/** What to do with a failed item: dead-letter it now, or retry it after `backoff`. */
export interface Decision {
  dead: boolean;
  backoff: (attempt: number) => number;
  maxAttempts: number | undefined;
}

export type RetryOn = readonly (ErrorType | RetryRule)[] | ErrorType | RetryRule;
export type DeadOn = readonly ErrorType[] | ErrorType;

const DEAD = Symbol("dead");

/** `retryOn` / `deadOn` looked up along the error's prototype chain: the most specific
 * class named wins (`retryOn: [TimeoutError]` with `deadOn: [SystemError]`, where
 * TimeoutError extends SystemError, retries timeouts and dead-letters the rest); errors
 * no rule names are retried with the default backoff, as without rules. */
export class FailureRules {
  readonly default: Decision;
  readonly #byClass = new Map<ErrorType, Decision | typeof DEAD>();
  readonly #dead: Decision;

  constructor(retryOn: RetryOn, deadOn: DeadOn, defaultBackoff: (attempt: number) => number) {
    this.default = { dead: false, backoff: defaultBackoff, maxAttempts: undefined };
    this.#dead = { dead: true, backoff: defaultBackoff, maxAttempts: undefined };
    const rules = typeof retryOn === "function" || retryOn instanceof RetryRule ? [retryOn] : retryOn;
    for (const entry of rules) {
      const rule = entry instanceof RetryRule ? entry : new RetryRule(entry);
      const decision: Decision = { dead: false, backoff: rule.backoff ?? defaultBackoff, maxAttempts: rule.maxAttempts };
      for (const cls of rule.errors) this.#byClass.set(cls, decision);
    }
    for (const cls of typeof deadOn === "function" ? [deadOn] : deadOn) {
      if (typeof cls !== "function") throw new TypeError(`deadOn takes error classes, not ${String(cls)}`);
      if (this.#byClass.has(cls)) throw new RangeError(`${cls.name} is in both retryOn and deadOn`);
      this.#byClass.set(cls, DEAD);
    }
  }

  decide(error: unknown): Decision {
    return this.named(error) ?? this.default;
  }

  /** The decision of the most specific class named for `error`; undefined if none is. */
  named(error: unknown): Decision | undefined {
    if (!this.#byClass.size || (typeof error !== "object" && typeof error !== "function") || error === null) return undefined;
    for (let proto = Object.getPrototypeOf(error) as object | null; proto && proto !== Object.prototype; proto = Object.getPrototypeOf(proto) as object | null) {
      const found = this.#byClass.get((proto as { constructor: ErrorType }).constructor);
      if (found === DEAD) return this.#dead;
      if (found) return found;
    }
    return undefined;
  }
}

/** A kind's rules in front of the worker's: the kind's named classes first, then the
 * worker's, then the kind's backoff (or the worker's) for errors nobody named. */
export class KindRules {
  readonly default: Decision;
  readonly #own: FailureRules;
  readonly #worker: FailureRules;
  readonly #maxAttempts: number | undefined;

  constructor(
    options: { retryOn?: RetryOn; deadOn?: DeadOn; retryBackoff?: (attempt: number) => number; maxAttempts?: number },
    worker: FailureRules,
  ) {
    const backoff = options.retryBackoff ?? worker.default.backoff;
    this.#own = new FailureRules(options.retryOn ?? [], options.deadOn ?? [], backoff);
    this.#worker = worker;
    this.#maxAttempts = options.maxAttempts;
    this.default = { dead: false, backoff, maxAttempts: options.maxAttempts };
  }

  decide(error: unknown): Decision {
    const found = this.#own.named(error) ?? this.#worker.named(error);
    if (!found) return this.default;
    if (found.maxAttempts === undefined && this.#maxAttempts !== undefined) return { ...found, maxAttempts: this.#maxAttempts };
    return found;
  }
}

/** The name an error is counted and rate-limited by (stats.failures, the metrics'
 * `error` label): its class's name, as the Python worker uses the exception's type. */
export function errorName(error: unknown): string {
  if (typeof error === "object" && error !== null) {
    const ctor = (error as { constructor?: { name?: unknown } }).constructor;
    if (typeof ctor?.name === "string" && ctor.name) return ctor.name;
    return "Object";
  }
  return typeof error;
}

/** A stack trace per error class for the first few failures of each minute, then a
 * count: one broken dependency otherwise writes a line per failed item (400 lines for
 * 400 failures), hiding the one that differs. */
export const LOG_BURST = 3;
export const LOG_WINDOW_MS = 60_000;

/** Rate-limits failure logs per error class (`burst` per `windowMs`). */
export class FailureLog {
  readonly burst: number;
  readonly windowMs: number;
  /** class name -> [window start, logged in window, not logged since the last line] */
  readonly #seen = new Map<string, [number, number, number]>();

  constructor(options: { burst?: number; windowMs?: number } = {}) {
    this.burst = options.burst ?? LOG_BURST;
    this.windowMs = options.windowMs ?? LOG_WINDOW_MS;
  }

  /** Whether to log this failure, and how many of its class were not logged before it. */
  admit(error: unknown): [boolean, number] {
    const key = errorName(error);
    const now = performance.now();
    const entry = this.#seen.get(key);
    if (!entry || now - entry[0] >= this.windowMs) {
      this.#seen.set(key, [now, 1, 0]);
      return [true, entry ? entry[2] : 0];
    }
    if (entry[1] < this.burst) {
      entry[1]++;
      const skipped = entry[2];
      entry[2] = 0;
      return [true, skipped];
    }
    entry[2]++;
    return [false, 0];
  }

  /** `logger.warn(message)` if admitted, with the error's stack (not for DeadLetter,
   * the handler's decision, nor for an error the worker made itself, e.g. an unknown
   * kind) and the count of those of its class left out since the last line. */
  warn(logger: Logger, message: string, error: unknown): void {
    const [logged, skipped] = this.admit(error);
    if (!logged) return;
    let line = message;
    if (skipped) line += ` (${skipped} more ${errorName(error)} not logged)`;
    if (error instanceof Error && !(error instanceof DeadLetter) && error.stack) line += `\n${error.stack}`;
    logger.warn?.(line);
  }
}
