import { type MessageInitShape } from "@bufbuild/protobuf";
import { FieldMaskSchema } from "@bufbuild/protobuf/wkt";
import { create } from "@bufbuild/protobuf";
import { Code, type Client as ConnectClient, type Interceptor, type Transport, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";

import { fromDuration, fromMicros, fromTimestamp, payloadBytes, toDuration, toTimestamp } from "./convert.js";
import { Cancelled, type CallKind, QueratorError, Unauthenticated, Unavailable, fromConnectError, fromStatus } from "./errors.js";
import { RequestStream } from "./streams.js";
import { LeasedItem, type LeaseState } from "./items.js";
import type {
  ApiKey,
  CreatedKey,
  ExtendResult,
  Item,
  ItemRef,
  Page,
  PartitionStats,
  ProduceInput,
  ProduceResult,
  QueueInfo,
  QueueSettings,
  QueueStats,
  Role,
  StoredItem,
} from "./models.js";
import { Pager } from "./paging.js";
import { type ApiKey as ApiKeyMessage, KeysService, Role as RoleEnum } from "./gen/querator/v1/keys_pb.js";
import {
  type LeaseResponse,
  type LeaseStreamResponse,
  type ProduceItem,
  type ProduceRequest,
  ProduceRequestSchema,
  type ProduceStreamRequest,
  type StreamError,
  type ProduceResponse,
  type ProduceStreamResponse,
  QueueService,
} from "./gen/querator/v1/queue_pb.js";
import { type QueueInfo as QueueInfoMessage, QueuesService } from "./gen/querator/v1/queues_pb.js";
import { type StorageItem, StorageItemSchema, StorageService } from "./gen/querator/v1/storage_pb.js";

export const DEFAULT_ADDRESS = "127.0.0.1:2319";
/** The API's limits: items per request, and bytes per request (batches stay under). */
export const MAX_BATCH = 1000;
const BATCH_BYTES = 4_000_000;

/** Options every call takes: a deadline through an AbortSignal, and/or a timeout. */
export interface CallOptions {
  /** Abort the call (it then fails with Cancelled). `AbortSignal.timeout(ms)` is a deadline. */
  signal?: AbortSignal;
  /** The call's gRPC deadline in milliseconds (default: the client's timeoutMs). */
  timeoutMs?: number;
}

/** TLS settings: PEM strings or buffers. */
export interface TlsOptions {
  /** Root certificates to trust (default: Node's bundled roots). */
  ca?: string | Buffer;
  /** Client certificate chain and key, for mutual TLS. */
  cert?: string | Buffer;
  key?: string | Buffer;
  /** The name to check the server's certificate against (default: the host). */
  serverName?: string;
}

export interface ClientOptions {
  /** host:port of the server; default: $QUERATOR_ADDRESS, else 127.0.0.1:2319. */
  address?: string;
  /** Deadline of each call in milliseconds (Lease: its wait plus leaseMarginMs). Default 30 s. */
  timeoutMs?: number;
  /** Extra time a Lease call gets over its wait before the client gives up. Default 5 s. */
  leaseMarginMs?: number;
  /** Use TLS: `true` for Node's default roots, or the certificates to use. */
  tls?: boolean | TlsOptions;
  /** Sent as `authorization: Bearer <token>` on every call. */
  bearerToken?: string;
  /** Metadata (headers) sent on every call. */
  metadata?: Record<string, string>;
  /** How many times a call that is safe to repeat is retried after UNAVAILABLE. Default 3. */
  retries?: number;
  /** Produce requests one produce() keeps in flight. Default 4. */
  maxInFlight?: number;
  /** Send Produce and Lease requests over a ProduceStream / LeaseStream per queue
   * (default true), as the Python SDK does; unary calls with servers that lack them. */
  streams?: boolean;
  /** Full control: a Connect transport built by the caller (address and tls then unused). */
  transport?: Transport;
}

type Settings = Required<Pick<ClientOptions, "timeoutMs" | "leaseMarginMs" | "retries" | "maxInFlight">>;

const ROLE_VALUES: Record<Role, RoleEnum> = { producer: RoleEnum.PRODUCER, consumer: RoleEnum.CONSUMER, admin: RoleEnum.ADMIN };

function backoffMs(attempt: number): number {
  // 100 ms doubling to 2 s, minus up to 20 % jitter: clients that failed together
  // do not come back together.
  return Math.min(100 * 2 ** (attempt - 1), 2000) * (1 - 0.2 * Math.random());
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
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

function isItem(value: ProduceInput): value is Item {
  return typeof value === "object" && !(value instanceof Uint8Array);
}

/**
 * A Querator client over one HTTP/2 connection (gRPC). Every call of the v1 API;
 * `close()` when done.
 *
 *     const client = new Client({ address: "127.0.0.1:2319" });
 *     await client.produce("emails", ["hello", "world"]);
 *     for (const item of await client.lease("emails", { batchSize: 10, waitMs: 5000 })) {
 *       console.log(item.text);
 *       await item.complete();
 *     }
 */
export class Client {
  readonly address: string;
  readonly #settings: Settings;
  readonly #transport: Transport;
  readonly #queue: ConnectClient<typeof QueueService>;
  readonly #queues: ConnectClient<typeof QueuesService>;
  readonly #storage: ConnectClient<typeof StorageService>;
  readonly #keys: ConnectClient<typeof KeysService>;
  readonly #closing = new AbortController();
  /** The open ProduceStream and LeaseStream of each queue (key: kind and queue). */
  readonly #openStreams = new Map<string, RequestStream<unknown, unknown>>();
  #streams: boolean;

  constructor(options: ClientOptions = {}) {
    this.address = options.address || process.env["QUERATOR_ADDRESS"] || DEFAULT_ADDRESS;
    this.#settings = {
      timeoutMs: options.timeoutMs ?? 30_000,
      leaseMarginMs: options.leaseMarginMs ?? 5_000,
      retries: options.retries ?? 3,
      maxInFlight: options.maxInFlight ?? 4,
    };
    this.#streams = options.streams ?? true;
    if (this.#settings.retries < 0) throw new RangeError("retries must not be negative");
    if (this.#settings.maxInFlight < 1) throw new RangeError("maxInFlight must be at least 1");
    const headers: [string, string][] = Object.entries(options.metadata ?? {});
    if (options.bearerToken) headers.push(["authorization", `Bearer ${options.bearerToken}`]);
    const addHeaders: Interceptor = (next) => (req) => {
      for (const [key, value] of headers) req.header.set(key, value);
      return next(req);
    };
    this.#transport = options.transport ?? this.#makeTransport(options.tls, headers.length ? [addHeaders] : []);
    this.#queue = createClient(QueueService, this.#transport);
    this.#queues = createClient(QueuesService, this.#transport);
    this.#storage = createClient(StorageService, this.#transport);
    this.#keys = createClient(KeysService, this.#transport);
  }

  #makeTransport(tls: ClientOptions["tls"], interceptors: Interceptor[]): Transport {
    const secure = tls !== undefined && tls !== false;
    const t: TlsOptions = typeof tls === "object" ? tls : {};
    const nodeOptions = secure
      ? {
          ...(t.ca !== undefined ? { ca: t.ca } : {}),
          ...(t.cert !== undefined ? { cert: t.cert } : {}),
          ...(t.key !== undefined ? { key: t.key } : {}),
          ...(t.serverName !== undefined ? { servername: t.serverName } : {}),
        }
      : {};
    return createGrpcTransport({
      baseUrl: `${secure ? "https" : "http"}://${this.address}`,
      interceptors,
      nodeOptions,
      // A reply of 1,000 leased items may be large; requests stay under the API's 5 MB.
      readMaxBytes: 64 << 20,
    });
  }

  /** Cancel the calls in flight (they fail with Cancelled); the connection is closed
   * once idle. */
  close(): void {
    this.#closing.abort();
    for (const stream of this.#openStreams.values()) stream.close(new Cancelled("the client was closed", Code.Canceled));
    this.#openStreams.clear();
  }

  // -- calling ----------------------------------------------------------------------------

  /** One call, with the deadline, the signals, and retries after UNAVAILABLE when `retry`. */
  async #call<T>(
    invoke: (options: { signal: AbortSignal; timeoutMs: number }) => Promise<T>,
    options: CallOptions | undefined,
    retry: boolean,
    kind: CallKind = {},
    timeoutMs?: number,
  ): Promise<T> {
    if (this.#closing.signal.aborted) throw new QueratorError("the client is closed");
    const signal = options?.signal ? AbortSignal.any([options.signal, this.#closing.signal]) : this.#closing.signal;
    const deadline = timeoutMs ?? options?.timeoutMs ?? this.#settings.timeoutMs;
    for (let attempt = 1; ; attempt++) {
      try {
        return await invoke({ signal, timeoutMs: deadline });
      } catch (error) {
        let mapped = fromConnectError(error, kind);
        if (mapped instanceof Cancelled && !signal.aborted) {
          // Cancelled without being asked to: the connection or the stream was cut.
          mapped = new Unavailable(mapped.rawMessage, Code.Unavailable, { cause: error });
        }
        if (!(retry && mapped instanceof Unavailable && attempt <= this.#settings.retries && !signal.aborted)) throw mapped;
      }
      await sleep(backoffMs(attempt), signal);
    }
  }

  // -- QueueService ----------------------------------------------------------------------

  /**
   * Add items to a queue, in requests of up to `batchSize` items (and under 4 MB),
   * `maxInFlight` at a time. Bare payloads with no shared fields go in the compact form
   * (ProduceRequest.payloads). Ids come back in the order given.
   *
   * After a failed request no new one is sent and the error is thrown with `produced`
   * set on it: what was stored (ids "" for the items that were not).
   */
  async produce(
    queueName: string,
    items: Iterable<ProduceInput> | ProduceInput,
    options: {
      encoding?: string;
      kind?: string;
      reference?: string;
      enqueueAt?: Date;
      batchSize?: number;
      maxInFlight?: number;
    } & CallOptions = {},
  ): Promise<ProduceResult> {
    const list: Iterable<ProduceInput> =
      typeof items === "string" || items instanceof Uint8Array || !(Symbol.iterator in items) ? [items as ProduceInput] : items;
    const batchSize = Math.max(1, Math.min(options.batchSize ?? MAX_BATCH, MAX_BATCH));
    const window = options.maxInFlight ?? this.#settings.maxInFlight;
    const shared = Boolean(options.encoding || options.kind || options.reference || options.enqueueAt);
    const ids: string[][] = [];
    const partitions: number[][] = [];
    let duplicates = 0;
    let failure: QueratorError | undefined;
    const pending = new Set<Promise<void>>();

    // The server's own limit for each request: the call's deadline.
    const requestTimeout = toDuration(options.timeoutMs ?? this.#settings.timeoutMs);
    const send = (index: number, batch: (Uint8Array | ProduceItemInit)[]): Promise<void> => {
      const compact = batch.every((e) => e instanceof Uint8Array);
      // The compact form is built as the message itself (protobuf-es messages are plain
      // objects): no per-request copy of the payload list by create(), which the profile
      // of bench/sdk_clients.py showed among the client's largest costs per request.
      const request: ProduceRequest = compact
        ? { $typeName: "querator.v1.ProduceRequest", queueName, requestTimeout, items: [], payloads: batch as Uint8Array[] }
        : create(ProduceRequestSchema, { queueName, requestTimeout, items: batch.map((e) => (e instanceof Uint8Array ? { payload: e } : e)) });
      const keyed = !compact && batch.every((e) => !(e instanceof Uint8Array) && Boolean(e.idempotencyKey));
      ids[index] = new Array<string>(batch.length).fill("");
      return this.#produceCall(queueName, request, options, keyed).then(
        (response) => {
          ids[index] = response.ids;
          partitions[index] = new Array<number>(batch.length).fill(response.partition);
          duplicates += response.duplicates;
        },
        (error: unknown) => {
          failure ??= error instanceof QueratorError ? error : fromConnectError(error);
        },
      );
    };

    let batch: (Uint8Array | ProduceItemInit)[] = [];
    let size = 0;
    let index = 0;
    const flush = async (): Promise<void> => {
      while (pending.size >= window) await Promise.race(pending);
      if (failure) return;
      const p: Promise<void> = send(index++, batch).finally(() => pending.delete(p));
      pending.add(p);
      batch = [];
      size = 0;
    };
    for (const value of list) {
      let entry: Uint8Array | ProduceItemInit;
      let cost: number;
      if (!shared && !isItem(value)) {
        entry = payloadBytes(value);
        cost = entry.length + 6;
      } else {
        entry = produceItem(isItem(value) ? value : { payload: value }, options);
        cost = approxItemBytes(entry) + 6;
      }
      if (batch.length && (batch.length >= batchSize || size + cost > BATCH_BYTES)) {
        await flush();
        if (failure) break;
      }
      batch.push(entry);
      size += cost;
    }
    if (batch.length && !failure) await flush();
    await Promise.all(pending);
    const result: ProduceResult = {
      ids: ids.flat(),
      partitions: ids.flatMap((batchIds, i) => partitions[i] ?? new Array<number>(batchIds.length).fill(-1)),
      duplicates,
    };
    if (failure) {
      failure.produced = result.ids.some(Boolean) ? result : undefined;
      throw failure;
    }
    return result;
  }

  /** One Produce: over the queue's ProduceStream, else (streams off, or a server
   * without it) a unary call. */
  #produceCall(queueName: string, request: ProduceRequest, options: CallOptions, retry: boolean): Promise<ProduceResponse> {
    const unary = (): Promise<ProduceResponse> => this.#call((o) => this.#queue.produce(request, o), options, retry);
    const timeoutMs = options.timeoutMs ?? this.#settings.timeoutMs;
    const message: ProduceStreamRequest = { $typeName: "querator.v1.ProduceStreamRequest", request };
    const open = (requests: AsyncIterable<ProduceStreamRequest>, signal: AbortSignal): AsyncIterable<ProduceStreamResponse> =>
      this.#queue.produceStream(requests, { signal });
    return this.#streamCall(`produce\0${queueName}`, open, message, timeoutMs, options, retry, {}, false, unary);
  }

  /** One request on the stream of `key` (opened when missing or broken), with the
   * unary call's errors and retries; `unary` for a server without the streams. */
  async #streamCall<Req, V>(
    key: string,
    open: (requests: AsyncIterable<Req>, signal: AbortSignal) => AsyncIterable<StreamAnswer<V>>,
    message: Req,
    timeoutMs: number,
    options: CallOptions,
    retry: boolean,
    kind: CallKind,
    cancelAbandoned: boolean,
    unary: () => Promise<V>,
  ): Promise<V> {
    if (!this.#streams) return unary();
    for (let attempt = 1; ; attempt++) {
      if (this.#closing.signal.aborted) throw new QueratorError("the client is closed");
      let stream = this.#openStreams.get(key) as RequestStream<Req, StreamAnswer<V>> | undefined;
      if (!stream || stream.broken) {
        const opened: RequestStream<Req, StreamAnswer<V>> = new RequestStream(
          open,
          () => {
            if (this.#openStreams.get(key) === opened) this.#openStreams.delete(key);
          },
          cancelAbandoned,
        );
        this.#openStreams.set(key, opened as RequestStream<unknown, unknown>);
        stream = opened;
      }
      let error: QueratorError;
      try {
        const answer = await stream.ask(message, timeoutMs, options.signal);
        if (answer.result.case === "response") return answer.result.value;
        const e = answer.result.value ?? { code: Code.Unknown, message: "an empty answer", fields: [] };
        error = fromStatus(e.code as Code, e.message, e.fields.map((field) => ({ field, description: "" })), kind);
        if (error instanceof Unauthenticated) stream.close(); // the next one opens with fresh credentials
      } catch (e) {
        error = e instanceof QueratorError ? e : fromConnectError(e, kind);
        if (error.code === Code.Unimplemented) {
          this.#streams = false; // a server from before the streams
          return unary();
        }
      }
      if (!(retry && error instanceof Unavailable && attempt <= this.#settings.retries && !options.signal?.aborted)) throw error;
      await sleep(backoffMs(attempt), options.signal);
    }
  }

  /**
   * Lease up to `batchSize` ready items (oldest first, one partition), waiting up to
   * `waitMs` for some; after completing `complete` (items of one earlier lease of this
   * queue) in the same call.
   */
  async lease(
    queueName: string,
    options: {
      batchSize?: number;
      waitMs?: number;
      clientId?: string;
      complete?: readonly ItemRef[];
      leaseKey?: string;
    } & CallOptions = {},
  ): Promise<LeasedItem[]> {
    const timeoutMs = options.timeoutMs ?? (options.waitMs ?? 30_000) + this.#settings.leaseMarginMs;
    // A call deadline shorter than the wait bounds it: the answer (OK, maybe no items)
    // comes a little before the deadline. The server does this itself for a unary call;
    // a request on a stream has only its request_timeout.
    const waitMs = Math.min(options.waitMs ?? 30_000, Math.max(0, timeoutMs - Math.min(this.#settings.leaseMarginMs, timeoutMs / 5)));
    const completing = options.complete ?? [];
    if (completing.length > MAX_BATCH) throw new RangeError(`a Lease completes at most ${MAX_BATCH} items`);
    for (const ref of completing) {
      if (ref.queueName !== queueName) throw new RangeError(`complete names an item of queue ${ref.queueName}, not ${queueName}`);
      if (ref.partition !== completing[0]!.partition) throw new RangeError("complete items must all come from one partition");
    }
    const request = {
      queueName,
      batchSize: options.batchSize ?? 1,
      clientId: options.clientId ?? "",
      requestTimeout: toDuration(waitMs),
      leaseKey: options.leaseKey ?? "",
      completeIds: completing.map((r) => r.id),
      completePartition: completing[0]?.partition ?? 0,
      columnar: true,
    };
    const retry = completing.length === 0;
    const kind = { itemCall: completing.length > 0 };
    const unary = (): Promise<LeaseResponse> => this.#call((o) => this.#queue.lease(request, o), options, retry, kind, timeoutMs);
    const open = (requests: AsyncIterable<LeaseStreamRequestInit>, signal: AbortSignal): AsyncIterable<LeaseStreamResponse> =>
      this.#queue.leaseStream(requests, { signal });
    // A Lease that waits holds back the answers behind it on its stream: one stream per
    // client_id and queue, so only that consumer's own requests wait behind it.
    const key = `lease\0${queueName}\0${request.clientId}`;
    const response = await this.#streamCall(key, open, { request }, timeoutMs, options, retry, kind, true, unary);
    markAll(completing, "completed");
    return this.#leased(response);
  }

  /**
   * Lease items as they come, for as long as the loop runs: `for await (const item of
   * client.leased("jobs"))`. Leaving the loop (break, throw, or `signal`) gives the
   * items of the last batch that were not handed out back to the queue.
   */
  async *leased(
    queueName: string,
    options: { batchSize?: number; waitMs?: number; clientId?: string; signal?: AbortSignal } = {},
  ): AsyncGenerator<LeasedItem, void, undefined> {
    let failures = 0;
    while (!options.signal?.aborted) {
      let batch: LeasedItem[];
      try {
        batch = await this.lease(queueName, options);
        failures = 0;
      } catch (error) {
        if (options.signal?.aborted) return;
        if (!(error instanceof Unavailable) || ++failures > this.#settings.retries) throw error;
        await sleep(backoffMs(failures), options.signal);
        continue;
      }
      let given = 0;
      try {
        for (const item of batch) {
          given++;
          yield item;
        }
      } finally {
        const rest = batch.slice(given);
        if (rest.length) await this.retry(rest).catch(() => undefined); // the leases run out anyway
      }
    }
  }

  #leased(response: LeaseResponse): LeasedItem[] {
    const { queueName, partition } = response;
    const columns = response.columns;
    if (columns && columns.ids.length) {
      return columns.ids.map(
        (id, i) =>
          new LeasedItem(this, {
            queueName,
            partition,
            id,
            payload: columns.payloads[i]!,
            encoding: columns.encodings[i] ?? "",
            kind: columns.kinds[i] ?? "",
            reference: columns.references[i] ?? "",
            attempts: columns.attempts[i]!,
            leaseDeadline: fromMicros(columns.leaseDeadlinesUs[i]!),
            createdAt: fromMicros(columns.createdAtUs[i]!),
            metadata: columns.metadata[i]?.entries ?? {},
          }),
      );
    }
    return response.items.map(
      (item) =>
        new LeasedItem(this, {
          queueName,
          partition,
          id: item.id,
          payload: item.payload,
          encoding: item.encoding,
          kind: item.kind,
          reference: item.reference,
          attempts: item.attempts,
          leaseDeadline: fromTimestamp(item.leaseDeadline) ?? new Date(0),
          createdAt: fromTimestamp(item.createdAt) ?? new Date(0),
          metadata: item.metadata,
        }),
    );
  }

  /** Complete leased items (any mix of queues and partitions: one call per partition),
   * or every item still leased under `leaseKeys` of `queueName`. */
  async complete(
    items: ItemRef | readonly ItemRef[] = [],
    options: { leaseKeys?: readonly string[]; queueName?: string } & CallOptions = {},
  ): Promise<void> {
    for (const [queueName, partition, members] of groupRefs(items)) {
      const request = { queueName, partition, ids: members.map((m) => m.id) };
      await this.#call((o) => this.#queue.complete(request, o), options, false, { itemCall: true });
      markAll(members, "completed");
    }
    for (const keys of leaseKeyChunks(options.leaseKeys, options.queueName)) {
      const request = { queueName: options.queueName!, leaseKeys: keys };
      await this.#call((o) => this.#queue.complete(request, o), options, true, { itemCall: true });
    }
  }

  /** Give leased items back: to the queue now, at `at` / in `inMs`, or to the
   * dead-letter queue with `dead`. */
  async retry(
    items: ItemRef | readonly ItemRef[],
    options: { at?: Date; inMs?: number; dead?: boolean } & CallOptions = {},
  ): Promise<void> {
    const at = options.at ?? (options.inMs !== undefined ? new Date(Date.now() + options.inMs) : undefined);
    const dead = options.dead ?? false;
    for (const [queueName, partition, members] of groupRefs(items)) {
      const request = {
        queueName,
        partition,
        items: members.map((m) => ({ id: m.id, dead, ...(at ? { retryAt: toTimestamp(at) } : {}) })),
      };
      await this.#call((o) => this.#queue.retry(request, o), options, false, { itemCall: true });
      markAll(members, dead ? "dead" : "retried");
    }
  }

  /** Push lease deadlines of items (or of everything leased under `leaseKeys`) to
   * `leaseTimeoutMs` from now (default: the queue's lease timeout). */
  async extend(
    items: ItemRef | readonly ItemRef[] = [],
    options: { leaseTimeoutMs?: number; leaseKeys?: readonly string[]; queueName?: string } & CallOptions = {},
  ): Promise<ExtendResult> {
    const leaseTimeout = options.leaseTimeoutMs !== undefined ? { leaseTimeout: toDuration(options.leaseTimeoutMs) } : {};
    const deadlines: Date[] = [];
    let keyItemsExtended = 0;
    for (const [queueName, partition, members] of groupRefs(items)) {
      const request = { queueName, partition, ids: members.map((m) => m.id), ...leaseTimeout };
      const response = await this.#call((o) => this.#queue.extend(request, o), options, true, { itemCall: true });
      response.leaseDeadlines.forEach((ts, i) => {
        const date = fromTimestamp(ts)!;
        deadlines.push(date);
        const member = members[i];
        if (member instanceof LeasedItem) member.leaseDeadline = date;
      });
    }
    for (const keys of leaseKeyChunks(options.leaseKeys, options.queueName)) {
      const request = { queueName: options.queueName!, leaseKeys: keys, ...leaseTimeout };
      const response = await this.#call((o) => this.#queue.extend(request, o), options, true, { itemCall: true });
      keyItemsExtended += response.keyItemsExtended;
    }
    return { deadlines, keyItemsExtended };
  }

  // -- QueuesService ---------------------------------------------------------------------

  /** Create a queue; QueueExists when the name is taken. */
  async createQueue(name: string, settings: QueueSettings = {}, options?: CallOptions): Promise<QueueInfo> {
    const [queue] = queueInfoMessage(name, settings);
    const response = await this.#call((o) => this.#queues.createQueue({ queue }, o), options, false);
    return queueInfo(response.queue);
  }

  async getQueue(name: string, options?: CallOptions): Promise<QueueInfo> {
    const response = await this.#call((o) => this.#queues.getQueue({ queueName: name }, o), options, true);
    return queueInfo(response.queue);
  }

  /** All queues sorted by name: `for await (const queue of client.listQueues())`. */
  listQueues(options: { pageSize?: number; pageToken?: string } & CallOptions = {}): Pager<QueueInfo> {
    return new Pager(async (pageToken): Promise<Page<QueueInfo>> => {
      const request = { pageSize: options.pageSize ?? 0, pageToken };
      const response = await this.#call((o) => this.#queues.listQueues(request, o), options, true);
      return { items: response.queues.map(queueInfo), nextPageToken: response.nextPageToken };
    }, options.pageToken);
  }

  /** Change exactly the settings given. */
  async updateQueue(name: string, settings: QueueSettings, options?: CallOptions): Promise<QueueInfo> {
    const [queue, paths] = queueInfoMessage(name, settings);
    if (!paths.length) throw new RangeError("updateQueue needs at least one setting to change");
    const request = { queue, updateMask: create(FieldMaskSchema, { paths }) };
    const response = await this.#call((o) => this.#queues.updateQueue(request, o), options, true);
    return queueInfo(response.queue);
  }

  /** Delete a queue and its items (`force` when it still holds items). */
  async deleteQueue(name: string, options: { force?: boolean } & CallOptions = {}): Promise<void> {
    const request = { queueName: name, force: options.force ?? false };
    await this.#call((o) => this.#queues.deleteQueue(request, o), options, false);
  }

  /** Remove items without deleting the queue: ready ones (default), scheduled ones,
   * and with `destructive` the leased ones too. */
  async clearQueue(
    name: string,
    options: { ready?: boolean; scheduled?: boolean; destructive?: boolean } & CallOptions = {},
  ): Promise<void> {
    const request = {
      queueName: name,
      queue: options.ready ?? true,
      scheduled: options.scheduled ?? false,
      destructive: options.destructive ?? false,
    };
    await this.#call((o) => this.#queues.clearQueue(request, o), options, true);
  }

  async queueStats(name: string, options?: CallOptions): Promise<QueueStats> {
    const r = await this.#call((o) => this.#queues.getQueueStats({ queueName: name }, o), options, true);
    const partitions: PartitionStats[] = r.partitions.map((p) => ({
      partition: p.partition,
      total: Number(p.total),
      totalLeased: Number(p.totalLeased),
      ready: Number(p.total - p.totalLeased),
      scheduled: Number(p.scheduled),
      averageAgeMs: fromDuration(p.averageAge),
      averageLeasedAgeMs: fromDuration(p.averageLeasedAge),
    }));
    const sum = (f: (p: PartitionStats) => number): number => partitions.reduce((n, p) => n + f(p), 0);
    return {
      queueName: r.queueName,
      partitions,
      total: sum((p) => p.total),
      totalLeased: sum((p) => p.totalLeased),
      ready: sum((p) => p.ready),
      scheduled: sum((p) => p.scheduled),
      leaseWaiting: r.leaseWaiting,
      produceWaiting: r.produceWaiting,
      inFlight: r.inFlight,
    };
  }

  // -- StorageService --------------------------------------------------------------------

  /** Ready and leased items of one partition in FIFO order (`for await`). */
  listItems(
    queueName: string,
    options: { partition?: number; pageSize?: number; pageToken?: string } & CallOptions = {},
  ): Pager<StoredItem> {
    const partition = options.partition ?? 0;
    return new Pager(async (pageToken) => {
      const request = { queueName, partition, pageSize: options.pageSize ?? 0, pageToken };
      const r = await this.#call((o) => this.#storage.listItems(request, o), options, true);
      return { items: r.items.map((i) => storedItem(i, partition)), nextPageToken: r.nextPageToken };
    }, options.pageToken);
  }

  /** Scheduled items of one partition, by due time (`for await`). */
  listScheduledItems(
    queueName: string,
    options: { partition?: number; pageSize?: number; pageToken?: string } & CallOptions = {},
  ): Pager<StoredItem> {
    const partition = options.partition ?? 0;
    return new Pager(async (pageToken) => {
      const request = { queueName, partition, pageSize: options.pageSize ?? 0, pageToken };
      const r = await this.#call((o) => this.#storage.listScheduledItems(request, o), options, true);
      return { items: r.items.map((i) => storedItem(i, partition)), nextPageToken: r.nextPageToken };
    }, options.pageToken);
  }

  /** Store items as given (attempts, deadlines, sourceId kept); returns their new ids. */
  async importItems(
    queueName: string,
    items: Iterable<Partial<StoredItem>>,
    options: { partition?: number } & CallOptions = {},
  ): Promise<string[]> {
    const all = [...items].map(storageItem);
    const ids: string[] = [];
    for (let start = 0; start < all.length; start += MAX_BATCH) {
      const request = { queueName, partition: options.partition ?? 0, items: all.slice(start, start + MAX_BATCH) };
      const r = await this.#call((o) => this.#storage.importItems(request, o), options, false);
      ids.push(...r.ids);
    }
    return ids;
  }

  /** Delete items by id, whatever their state; unknown ids are ignored. */
  async deleteItems(queueName: string, ids: Iterable<string>, options: { partition?: number } & CallOptions = {}): Promise<void> {
    const all = [...ids];
    for (let start = 0; start < all.length; start += MAX_BATCH) {
      const request = { queueName, partition: options.partition ?? 0, ids: all.slice(start, start + MAX_BATCH) };
      await this.#call((o) => this.#storage.deleteItems(request, o), options, true);
    }
  }

  // -- KeysService -----------------------------------------------------------------------

  /** Create an API key (needs an admin key for "*"); its token is shown only here. */
  async createKey(role: Role, queues: string | readonly string[], options: { description?: string } & CallOptions = {}): Promise<CreatedKey> {
    const value = ROLE_VALUES[role];
    if (value === undefined) throw new RangeError(`role must be one of ${Object.keys(ROLE_VALUES).join(", ")}`);
    const request = { role: value, queues: typeof queues === "string" ? [queues] : [...queues], description: options.description ?? "" };
    const r = await this.#call((o) => this.#keys.createKey(request, o), options, false, { keyCall: true });
    return { key: apiKey(r.key), token: r.token };
  }

  /** Every key, sorted by id (never the tokens). */
  async listKeys(options?: CallOptions): Promise<ApiKey[]> {
    const r = await this.#call((o) => this.#keys.listKeys({}, o), options, true, { keyCall: true });
    return r.keys.map((k) => apiKey(k));
  }

  /** Delete a key; calls with its token fail with Unauthenticated from then on. */
  async revokeKey(keyId: string, options?: CallOptions): Promise<void> {
    await this.#call((o) => this.#keys.revokeKey({ keyId }, o), options, false, { keyCall: true });
  }
}

// -- conversions ---------------------------------------------------------------------------

type LeaseStreamRequestInit = MessageInitShape<typeof QueueService.method.leaseStream.input>;
/** What ProduceStream and LeaseStream answer: the unary call's response, or its error. */
type StreamAnswer<V> = {
  result: { case: "response"; value: V } | { case: "error"; value: StreamError } | { case: undefined; value?: undefined };
};

type ProduceItemInit = MessageInitShape<typeof QueueService.method.produce.input> extends { items?: (infer I)[] } ? I & Partial<ProduceItem> : never;

function produceItem(item: Item, defaults: { encoding?: string; kind?: string; reference?: string; enqueueAt?: Date }): ProduceItemInit {
  const enqueueAt = item.enqueueAt ?? defaults.enqueueAt;
  return {
    payload: payloadBytes(item.payload),
    encoding: item.encoding ?? defaults.encoding ?? "",
    kind: item.kind ?? defaults.kind ?? "",
    reference: item.reference ?? defaults.reference ?? "",
    idempotencyKey: item.idempotencyKey ?? "",
    metadata: item.metadata ?? {},
    ...(enqueueAt ? { enqueueAt: toTimestamp(enqueueAt) } : {}),
  };
}

/** A bound on an item's encoded size, for batching under the request byte limit. */
function approxItemBytes(item: ProduceItemInit): number {
  let n = (item.payload?.length ?? 0) + 3 * ((item.encoding?.length ?? 0) + (item.kind?.length ?? 0) + (item.reference?.length ?? 0)) + 3 * (item.idempotencyKey?.length ?? 0) + 40;
  for (const [k, v] of Object.entries(item.metadata ?? {})) n += 3 * (k.length + v.length) + 8;
  return n;
}

function markAll(items: readonly ItemRef[], state: LeaseState): void {
  for (const item of items) if (item instanceof LeasedItem) item.markSettled(state);
}

/** Items grouped by (queue, partition) in first-seen order, in chunks of at most 1,000. */
function groupRefs(items: ItemRef | readonly ItemRef[]): [string, number, ItemRef[]][] {
  const list: readonly ItemRef[] = Array.isArray(items) ? items : [items as ItemRef];
  const groups = new Map<string, [string, number, ItemRef[]]>();
  for (const ref of list) {
    const key = `${ref.partition}\0${ref.queueName}`;
    let group = groups.get(key);
    if (!group) groups.set(key, (group = [ref.queueName, ref.partition, []]));
    group[2].push(ref);
  }
  const out: [string, number, ItemRef[]][] = [];
  for (const [queue, partition, members] of groups.values()) {
    for (let start = 0; start < members.length; start += MAX_BATCH) out.push([queue, partition, members.slice(start, start + MAX_BATCH)]);
  }
  return out;
}

function leaseKeyChunks(keys: readonly string[] | undefined, queueName: string | undefined): string[][] {
  if (!keys || keys.length === 0) return [];
  if (!queueName) throw new RangeError("leaseKeys need queueName");
  const out: string[][] = [];
  for (let start = 0; start < keys.length; start += MAX_BATCH) out.push(keys.slice(start, start + MAX_BATCH));
  return out;
}

const SETTINGS: Record<keyof QueueSettings, string> = {
  deadQueue: "dead_queue",
  reference: "reference",
  leaseTimeoutMs: "lease_timeout",
  expireTimeoutMs: "expire_timeout",
  maxAttempts: "max_attempts",
  partitions: "requested_partitions",
  dedupWindowMs: "dedup_window",
  leaseKeyTtlMs: "lease_key_ttl",
};

function queueInfoMessage(name: string, s: QueueSettings): [MessageInitShape<typeof QueuesService.method.createQueue.input>["queue"], string[]] {
  const paths = (Object.keys(SETTINGS) as (keyof QueueSettings)[]).filter((k) => s[k] !== undefined).map((k) => SETTINGS[k]);
  const duration = (ms: number | undefined): { seconds: bigint; nanos: number } | undefined => (ms === undefined ? undefined : toDuration(ms));
  const queue = {
    queueName: name,
    deadQueue: s.deadQueue ?? "",
    reference: s.reference ?? "",
    maxAttempts: s.maxAttempts ?? 0,
    requestedPartitions: s.partitions ?? 0,
    ...(s.leaseTimeoutMs !== undefined ? { leaseTimeout: duration(s.leaseTimeoutMs) } : {}),
    ...(s.expireTimeoutMs !== undefined ? { expireTimeout: duration(s.expireTimeoutMs) } : {}),
    ...(s.dedupWindowMs !== undefined ? { dedupWindow: duration(s.dedupWindowMs) } : {}),
    ...(s.leaseKeyTtlMs !== undefined ? { leaseKeyTtl: duration(s.leaseKeyTtlMs) } : {}),
  };
  return [queue, paths];
}

function queueInfo(info: QueueInfoMessage | undefined): QueueInfo {
  return {
    name: info?.queueName ?? "",
    deadQueue: info?.deadQueue ?? "",
    reference: info?.reference ?? "",
    leaseTimeoutMs: fromDuration(info?.leaseTimeout),
    expireTimeoutMs: fromDuration(info?.expireTimeout),
    maxAttempts: info?.maxAttempts ?? 0,
    partitions: info?.requestedPartitions ?? 0,
    createdAt: fromTimestamp(info?.createdAt),
    updatedAt: fromTimestamp(info?.updatedAt),
    dedupWindowMs: fromDuration(info?.dedupWindow),
    leaseKeyTtlMs: fromDuration(info?.leaseKeyTtl),
  };
}

function storedItem(i: StorageItem, partition: number): StoredItem {
  return {
    id: i.id,
    partition,
    payload: i.payload,
    isLeased: i.isLeased,
    leaseDeadline: fromTimestamp(i.leaseDeadline),
    expireDeadline: fromTimestamp(i.expireDeadline),
    enqueueAt: fromTimestamp(i.enqueueAt),
    createdAt: fromTimestamp(i.createdAt),
    attempts: i.attempts,
    reference: i.reference,
    encoding: i.encoding,
    kind: i.kind,
    sourceId: i.sourceId,
    metadata: i.metadata,
  };
}

function storageItem(i: Partial<StoredItem>): StorageItem {
  const ts = (d: Date | undefined): { timestamp: ReturnType<typeof toTimestamp> } | undefined => (d ? { timestamp: toTimestamp(d) } : undefined);
  return create(StorageItemSchema, {
    payload: i.payload ?? new Uint8Array(),
    isLeased: i.isLeased ?? false,
    attempts: i.attempts ?? 0,
    reference: i.reference ?? "",
    encoding: i.encoding ?? "",
    kind: i.kind ?? "",
    sourceId: i.sourceId ?? "",
    metadata: i.metadata ?? {},
    ...(i.leaseDeadline ? { leaseDeadline: ts(i.leaseDeadline)!.timestamp } : {}),
    ...(i.expireDeadline ? { expireDeadline: ts(i.expireDeadline)!.timestamp } : {}),
    ...(i.enqueueAt ? { enqueueAt: ts(i.enqueueAt)!.timestamp } : {}),
    ...(i.createdAt ? { createdAt: ts(i.createdAt)!.timestamp } : {}),
  });
}

function apiKey(k: ApiKeyMessage | undefined): ApiKey {
  const role = (Object.keys(ROLE_VALUES) as Role[]).find((r) => ROLE_VALUES[r] === k?.role) ?? "producer";
  return {
    keyId: k?.keyId ?? "",
    role,
    queues: k?.queues ?? [],
    description: k?.description ?? "",
    createdAt: fromTimestamp(k?.createdAt),
  };
}
