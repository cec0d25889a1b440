import type { CompleteResult, DeadReason, ExtendResult, ItemHistory, ItemRef, RetryResult } from "./models.js";
import type { CallOptions } from "./options.js";

export type LeaseState = "leased" | "completed" | "retried" | "dead";

/** How to give an item back: now, later (`at` / `inMs`) or to the dead-letter queue
 * (`dead`); `error` (text, or a thrown value sent as failureText makes it) becomes the
 * item's `lastError`, which the next lease and the dead letter show. The server keeps
 * at most 2,048 bytes of it; none keeps the error the item had. */
export interface RetryOptions {
  at?: Date;
  inMs?: number;
  dead?: boolean;
  error?: unknown;
}

/** What finishes a lease: the Client's complete, retry and extend. A LeasedItem holds
 * this rather than the Client, so items.ts does not import the client. */
export interface Settler {
  complete(items: ItemRef, options?: CallOptions): Promise<CompleteResult>;
  retry(items: ItemRef, options?: RetryOptions & CallOptions): Promise<RetryResult>;
  extend(items: ItemRef, options?: { leaseTimeoutMs?: number } & CallOptions): Promise<ExtendResult>;
}

const decoder = new TextDecoder();

/** A leased item: its content, and the calls that finish its lease. */
export class LeasedItem implements ItemRef, ItemHistory {
  readonly queueName: string;
  readonly partition: number;
  readonly id: string;
  readonly payload: Uint8Array;
  readonly encoding: string;
  readonly kind: string;
  readonly reference: string;
  /** How many times the item has been leased, this lease included. */
  readonly attempts: number;
  /** When the lease ends unless completed, retried or extended first (moved by extend). */
  leaseDeadline: Date;
  readonly createdAt: Date;
  readonly metadata: Readonly<Record<string, string>>;
  /** The item's stable id, the same through every re-queue, retry, dead-lettering and
   * redrive (`id` is this lease's: use `messageId` to follow the item in logs and to key
   * idempotency). */
  readonly messageId: string;
  /** In a dead-letter queue (or redriven from one): the item's id in the queue it came
   * from; "" otherwise. */
  readonly sourceId: string;
  /** Dead letters only: why it died (undefined for other items), when, and how many
   * times it had been leased there (`attempts` counts the leases here). */
  readonly deadReason: DeadReason | undefined;
  readonly deadAt: Date | undefined;
  readonly deadAttempts: number;
  /** What went wrong the last time the item failed (an earlier attempt's Retry error,
   * or "lease expired after N attempts"); "" when it never failed with a text. For a
   * dead letter: the error that killed it. */
  readonly lastError: string;
  /** When lastError was recorded (undefined without one). */
  readonly lastErrorAt: Date | undefined;
  /** The item's ordered group ("" for none): no other item of the group is leased until
   * this one is completed, dead-lettered or deleted. */
  readonly groupKey: string;
  /** 0 to 9, as given at produce: leases hand out higher priorities first. */
  readonly priority: number;
  #state: LeaseState = "leased";
  readonly #settler: Settler;

  /** @internal built by the client from a Lease reply */
  constructor(settler: Settler, fields: Omit<LeasedItem, "text" | "json" | "state" | "settled" | "complete" | "retry" | "extend" | "markSettled">) {
    this.#settler = settler;
    this.queueName = fields.queueName;
    this.partition = fields.partition;
    this.id = fields.id;
    this.payload = fields.payload;
    this.encoding = fields.encoding;
    this.kind = fields.kind;
    this.reference = fields.reference;
    this.attempts = fields.attempts;
    this.leaseDeadline = fields.leaseDeadline;
    this.createdAt = fields.createdAt;
    this.metadata = fields.metadata;
    this.messageId = fields.messageId || fields.id;
    this.sourceId = fields.sourceId;
    this.deadReason = fields.deadReason;
    this.deadAt = fields.deadAt;
    this.deadAttempts = fields.deadAttempts;
    this.lastError = fields.lastError;
    this.lastErrorAt = fields.lastErrorAt;
    this.groupKey = fields.groupKey;
    this.priority = fields.priority;
  }

  /** The payload decoded as UTF-8. */
  get text(): string {
    return decoder.decode(this.payload);
  }

  /** The payload parsed as JSON. */
  json<T = unknown>(): T {
    return JSON.parse(this.text) as T;
  }

  /** "leased" until completed, retried or dead-lettered through its client. */
  get state(): LeaseState {
    return this.#state;
  }

  get settled(): boolean {
    return this.#state !== "leased";
  }

  /** @internal */
  markSettled(state: LeaseState): void {
    this.#state = state;
  }

  /** Remove the item for good. The result's `alreadyCompleted` holds the id when a
   * send the client repeated had completed it already. */
  complete(options?: CallOptions): Promise<CompleteResult> {
    return this.#settler.complete(this, options);
  }

  /** Give the item back: now, later (`at` / `inMs`) or to the dead-letter queue
   * (`dead`), with what went wrong (`error`); resolves as the client's retry() does. */
  retry(options?: RetryOptions & CallOptions): Promise<RetryResult> {
    return this.#settler.retry(this, options);
  }

  /** Push the lease deadline (default: the queue's lease timeout from now). */
  async extend(options?: { leaseTimeoutMs?: number } & CallOptions): Promise<Date> {
    const result: ExtendResult = await this.#settler.extend(this, options);
    return result.deadlines[0] ?? this.leaseDeadline;
  }
}
