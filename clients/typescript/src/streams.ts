/**
 * Produce and Lease over ProduceStream / LeaseStream: one long-lived call per queue and
 * kind carrying many requests, as the Python SDK's AsyncClient does. Per request, a
 * stream costs the server about half the CPU of a unary call, and this client much less:
 * a unary call through Connect sets up an HTTP/2 stream, headers and an async-iterator
 * pipeline of its own (measured with bench/sdk_clients.py, W1: 18 µs of client CPU per
 * produced item in unary calls of 100 items, 7 µs on a stream; 27-31 µs per drained item
 * with unary Lease calls, 21 µs on a LeaseStream).
 *
 * The server answers each request once, in the order sent; a request that fails is
 * answered with its error and the stream goes on. A stream opens on first use and again
 * after it breaks; the requests in flight when it breaks fail with its error
 * (UNAVAILABLE when the server went away). A caller that stops waiting (deadline or
 * signal) cannot take its request back alone. A Produce is left to run, as a unary
 * Produce past its deadline may still be stored, and its answer is dropped when it
 * comes. A Lease would lease items nobody receives until their lease ran out, so its
 * stream is cancelled (`cancelAbandoned`), which the server treats as a cancelled call
 * for every request in flight on it; the others fail UNAVAILABLE and are retried on a
 * new stream as after any UNAVAILABLE.
 *
 * A stream with nothing in flight for IDLE_MS is closed (and opened again by the next
 * request): an open stream keeps Node's event loop alive, so a program that forgot
 * client.close() would otherwise never exit.
 */
import { Code } from "@connectrpc/connect";

import { Cancelled, DeadlineExceeded, type QueratorError, Unavailable, fromConnectError } from "./errors.js";

/** An async iterable fed by push(): the request side of a stream. */
class Outbox<T> implements AsyncIterable<T> {
  #items: T[] = [];
  #wake: (() => void) | undefined;
  #ended = false;

  push(item: T): void {
    this.#items.push(item);
    this.#wake?.();
  }

  end(): void {
    this.#ended = true;
    this.#wake?.();
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<T, void, undefined> {
    for (;;) {
      if (this.#items.length) {
        const items = this.#items;
        this.#items = [];
        yield* items;
        continue;
      }
      if (this.#ended) return;
      await new Promise<void>((resolve) => (this.#wake = resolve));
      this.#wake = undefined;
    }
  }
}

/** Errors of streams this client closed itself (not a node failing). */
const closedByUs = new WeakSet<QueratorError>();

/** Whether the stream failed because this client closed it (an abandoned Lease, fresh
 * credentials), not because its node failed. */
export function closedHere(error: QueratorError): boolean {
  return closedByUs.has(error);
}

function local(error: QueratorError): QueratorError {
  closedByUs.add(error);
  return error;
}

/** How long a stream with nothing in flight stays open. */
export const IDLE_MS = 1000;

interface Waiter<Res> {
  resolve(answer: Res): void;
  reject(error: QueratorError): void;
  /** The caller stopped waiting: the answer is dropped. */
  gone: boolean;
}

/** One open stream: requests written in order, answers handed out in order. */
export class RequestStream<Req, Res> {
  readonly #outbox = new Outbox<Req>();
  readonly #waiting: Waiter<Res>[] = [];
  readonly #abort = new AbortController();
  #broken: QueratorError | undefined;
  #idle: NodeJS.Timeout | undefined;
  readonly #onBroken: () => void;
  readonly #cancelAbandoned: boolean;

  constructor(
    open: (requests: AsyncIterable<Req>, signal: AbortSignal) => AsyncIterable<Res>,
    onBroken: () => void,
    cancelAbandoned = false,
  ) {
    this.#onBroken = onBroken;
    this.#cancelAbandoned = cancelAbandoned;
    void this.#read(open(this.#outbox, this.#abort.signal));
  }

  get broken(): boolean {
    return this.#broken !== undefined;
  }

  /** Send `request`; its answer, or the stream's error. */
  ask(request: Req, timeoutMs: number, signal?: AbortSignal): Promise<Res> {
    if (this.#broken) return Promise.reject(this.#broken);
    return new Promise<Res>((resolve, reject) => {
      let timer: NodeJS.Timeout | undefined;
      const stop = (error: QueratorError): void => {
        if (waiter.gone) return;
        waiter.gone = true;
        clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
        reject(error);
      };
      const abandon = (error: QueratorError): void => {
        const sent = !waiter.gone;
        stop(error);
        if (sent && this.#cancelAbandoned) this.close(local(new Unavailable("the stream was cancelled for a request its caller gave up on", Code.Unavailable)));
      };
      const onAbort = (): void => abandon(new Cancelled("the call was cancelled", Code.Canceled));
      const waiter: Waiter<Res> = {
        gone: false,
        resolve: (answer) => {
          if (waiter.gone) return;
          waiter.gone = true;
          clearTimeout(timer);
          signal?.removeEventListener("abort", onAbort);
          resolve(answer);
        },
        reject: stop,
      };
      if (signal?.aborted) return onAbort();
      signal?.addEventListener("abort", onAbort, { once: true });
      timer = setTimeout(() => abandon(new DeadlineExceeded(`no answer within ${timeoutMs} ms`, Code.DeadlineExceeded)), timeoutMs);
      clearTimeout(this.#idle);
      this.#waiting.push(waiter);
      this.#outbox.push(request);
    });
  }

  /** Close the stream: the requests in flight on it fail with `error`. */
  close(error: QueratorError = local(new Unavailable("the stream was closed", Code.Unavailable))): void {
    clearTimeout(this.#idle);
    if (this.#broken) return;
    this.#broken = error;
    this.#outbox.end();
    this.#abort.abort();
    for (const waiter of this.#waiting.splice(0)) waiter.reject(error);
  }

  async #read(answers: AsyncIterable<Res>): Promise<void> {
    let error: QueratorError;
    try {
      for await (const answer of answers) {
        const waiter = this.#waiting.shift();
        if (waiter === undefined) throw new Error("an answer nobody asked for");
        waiter.resolve(answer);
        if (this.#waiting.length === 0) {
          // unref: the timer itself does not keep the program running.
          this.#idle = setTimeout(() => this.close(), IDLE_MS).unref();
        }
      }
      error = new Unavailable("the stream ended", Code.Unavailable);
    } catch (e) {
      error = fromConnectError(e);
      if (error instanceof Cancelled && !this.#abort.signal.aborted) error = new Unavailable(error.rawMessage, Code.Unavailable, { cause: e });
    }
    this.#broken ??= error;
    this.#outbox.end();
    for (const waiter of this.#waiting.splice(0)) waiter.reject(this.#broken);
    this.#onBroken();
  }
}
