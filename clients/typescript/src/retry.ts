/**
 * The one retry rule: which failures are tried again, how often, after how long. The
 * Client's calls and its `leased()` loop, and the Worker's Lease loop after UNAVAILABLE,
 * all ask the client's RetryPolicy; a loop only sleeps for the delay it is given.
 */
import { type QueratorError, Unavailable } from "./errors.js";

/** Exponential backoff with jitter: initialMs * multiplier^(attempt-1), at most
 * maximumMs, minus a random `jitter` fraction (0.2: 80-100 % of it). */
export function backoff(
  options: { initialMs?: number; maximumMs?: number; multiplier?: number; jitter?: number } = {},
): (attempt: number) => number {
  const { initialMs = 1000, maximumMs = 300_000, multiplier = 2, jitter = 0.2 } = options;
  if (initialMs < 0 || maximumMs < initialMs) throw new RangeError("backoff needs 0 <= initialMs <= maximumMs");
  if (multiplier < 1 || jitter < 0 || jitter > 1) throw new RangeError("backoff needs multiplier >= 1 and 0 <= jitter <= 1");
  return (attempt) => Math.min(initialMs * multiplier ** Math.max(0, attempt - 1), maximumMs) * (1 - jitter * Math.random());
}

/** A kind of error a policy retries: a QueratorError class. */
export type ErrorClass = abstract new (...args: never[]) => QueratorError;

/**
 * Retry a failure of a kind in `on` up to `retries` times, after `backoff(n)` ms.
 *
 * Only calls that are safe to repeat are retried at all (the caller decides which);
 * UNAVAILABLE is the default kind because the request then never reached the server
 * or its effect is idempotent.
 */
export class RetryPolicy {
  readonly retries: number;
  /** Milliseconds to wait before retry number `attempt` (1 for the first). */
  readonly backoff: (attempt: number) => number;
  readonly on: readonly ErrorClass[];

  constructor(options: { retries?: number; backoff?: (attempt: number) => number; on?: readonly ErrorClass[] } = {}) {
    this.retries = options.retries ?? 3;
    if (!(this.retries >= 0)) throw new RangeError("retries must not be negative");
    // 100 ms doubling to 2 s, jittered: clients that failed together do not come back together.
    this.backoff = options.backoff ?? backoff({ initialMs: 100, maximumMs: 2000 });
    this.on = options.on ?? [Unavailable];
  }

  /** Milliseconds to wait before retry number `attempt` (1 for the first) after `error`;
   * undefined: give up and throw it. */
  delay(attempt: number, error: unknown): number | undefined {
    if (attempt > this.retries || !this.on.some((kind) => error instanceof kind)) return undefined;
    return this.backoff(attempt);
  }
}

/** Wait `ms`, or less when `signal` aborts (already aborted: not at all). */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  if (signal?.aborted) return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(done, ms);
    function done(): void {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    }
    signal?.addEventListener("abort", done, { once: true });
  });
}
