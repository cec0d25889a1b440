import { type MessageInitShape } from "@bufbuild/protobuf";
import { FieldMaskSchema } from "@bufbuild/protobuf/wkt";
import { create } from "@bufbuild/protobuf";
import { Code, ConnectError, type Interceptor, type Transport } from "@connectrpc/connect";
import { Http2SessionManager, createGrpcTransport } from "@connectrpc/connect-node";

import { fromDuration, fromMicros, fromTimestamp, payloadBytes, toDuration, toTimestamp } from "./convert.js";
import { NodeChannel } from "./channel.js";
import {
  Cancelled,
  type CallKind,
  InvalidRequest,
  QueratorError,
  QueueNotFound,
  Unauthenticated,
  Unavailable,
  fromConnectError,
  fromStatus,
} from "./errors.js";
import { ClusterMap, DOWN_CAP_MS, DOWN_FIRST_MS } from "./routing.js";
import { RequestStream, closedHere } from "./streams.js";
import { LeasedItem, type LeaseState, type Settler } from "./items.js";
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
import { type CallOptions, type ClientOptions, DEFAULT_ADDRESS, type TlsOptions } from "./options.js";
import { Pager } from "./paging.js";
import { RetryPolicy, sleep } from "./retry.js";
import { type ApiKey as ApiKeyMessage, Role as RoleEnum } from "./gen/querator/v1/keys_pb.js";
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
import { type StorageItem, StorageItemSchema } from "./gen/querator/v1/storage_pb.js";

/** The API's limits: items per request, and bytes per request (batches stay under). */
export const MAX_BATCH = 1000;
const BATCH_BYTES = 4_000_000;

export { DEFAULT_ADDRESS, type CallOptions, type ClientOptions, type TlsOptions } from "./options.js";

/** Where a call must or may go in a cluster. */
type Target =
  | { to: "any" }
  | { to: "produce"; queue: string }
  | { to: "lease"; queue: string }
  | { to: "home"; queue: string; partition: number }
  | { to: "key"; queue: string; key: string };

const ANY: Target = { to: "any" };

/** Connection errors that mean the request never left this process. */
const NOT_CONNECTED = new Set(["ECONNREFUSED", "EHOSTUNREACH", "ENETUNREACH", "ENOTFOUND", "EAI_AGAIN", "EADDRNOTAVAIL"]);

/** Errors a server answered on a stream (a status, not a broken connection). */
const answeredOnStream = new WeakSet<QueratorError>();

/**
 * Whether an UNAVAILABLE says the node itself is gone (no connection, a connection cut,
 * a stream broken, or the server shutting down) rather than something the node answered
 * about one queue or partition (storage failing, a faulty partition, etcd down): only the
 * first makes the client skip the node.
 */
function nodeGone(raw: unknown, error: QueratorError): boolean {
  if (closedHere(error)) return false;
  if (/shutting down/.test(error.rawMessage)) return true;
  if (answeredOnStream.has(error)) return false;
  // A status sent by a server comes as a ConnectError of its own, without a cause;
  // Connect's own errors for a failed connection or a reset stream carry the socket's
  // error or name the HTTP/2 reset.
  return !(raw instanceof ConnectError && raw.cause === undefined && !raw.rawMessage.startsWith("http/2"));
}

/** Whether `error` says the request was never sent: no connection to the node. */
function neverSent(error: unknown): boolean {
  for (let e: unknown = error, depth = 0; e instanceof Error && depth < 6; e = e.cause, depth++) {
    const code = (e as NodeJS.ErrnoException).code;
    if (typeof code === "string" && NOT_CONNECTED.has(code)) return true;
  }
  return false;
}

type Settings = Required<Pick<ClientOptions, "timeoutMs" | "leaseMarginMs" | "maxInFlight">>;

const ROLE_VALUES: Record<Role, RoleEnum> = { producer: RoleEnum.PRODUCER, consumer: RoleEnum.CONSUMER, admin: RoleEnum.ADMIN };

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
export class Client implements Settler {
  /** The (first) address the client was given. */
  readonly address: string;
  /** Every bootstrap address. */
  readonly addresses: readonly string[];
  /** Which failures are retried, how often, after how long: the client's calls and its
   * Workers' Lease loops back off by it. */
  readonly retryPolicy: RetryPolicy;
  readonly #settings: Settings;
  readonly #closing = new AbortController();
  /** The channel to the first address (or the caller's transport). */
  readonly #default: NodeChannel;
  /** A channel per node address, the first address's among them. */
  readonly #channels = new Map<string, NodeChannel>();
  readonly #makeChannel: ((address: string) => NodeChannel) | undefined;
  /** The cluster's map; `clustered` false for a single server (then every call goes
   * to #default, with no further look at it). */
  readonly #map: ClusterMap;
  readonly #refreshMs: number;
  readonly #retryProduce: boolean;
  #refreshing: Promise<void> | undefined;
  #refreshedAt = -Infinity;
  /** Queues to ask ClusterInfo about on the next refresh. */
  readonly #wanted = new Set<string>();
  /** No first ClusterInfo before this time (it failed). */
  #discoverAfter = -Infinity;
  #streams: boolean;

  constructor(options: ClientOptions = {}) {
    const addresses = options.addresses?.filter(Boolean) ?? [];
    if (!addresses.length) addresses.push(options.address || process.env["QUERATOR_ADDRESS"] || DEFAULT_ADDRESS);
    this.addresses = addresses;
    this.address = addresses[0]!;
    this.#settings = {
      timeoutMs: options.timeoutMs ?? 30_000,
      leaseMarginMs: options.leaseMarginMs ?? 5_000,
      maxInFlight: options.maxInFlight ?? 4,
    };
    this.#streams = options.streams ?? true;
    this.#refreshMs = options.clusterRefreshMs ?? 30_000;
    this.#retryProduce = options.retryProduce ?? false;
    this.retryPolicy = options.retryPolicy ?? new RetryPolicy(options.retries !== undefined ? { retries: options.retries } : {});
    this.#map = new ClusterMap(options.logger);
    if (this.#settings.maxInFlight < 1) throw new RangeError("maxInFlight must be at least 1");
    if (!(this.#refreshMs > 0)) throw new RangeError("clusterRefreshMs must be positive");
    const headers: [string, string][] = Object.entries(options.metadata ?? {});
    if (options.bearerToken) headers.push(["authorization", `Bearer ${options.bearerToken}`]);
    const addHeaders: Interceptor = (next) => (req) => {
      for (const [key, value] of headers) req.header.set(key, value);
      return next(req);
    };
    const interceptors = headers.length ? [addHeaders] : [];
    if (options.transport) {
      this.#default = new NodeChannel(this.address, options.transport);
      this.#map.clustered = false; // the caller's transport: one server as far as we know
    } else {
      this.#default = new NodeChannel(this.address, this.#makeTransport(this.address, options.tls, interceptors));
      this.#makeChannel = (address) => {
        const session = new Http2SessionManager(`${this.#secure(options.tls) ? "https" : "http"}://${address}`, {}, this.#nodeOptions(options.tls));
        return new NodeChannel(address, this.#makeTransport(address, options.tls, interceptors, session), session);
      };
    }
    this.#channels.set(this.address, this.#default);
  }

  #secure(tls: ClientOptions["tls"]): boolean {
    return tls !== undefined && tls !== false;
  }

  #nodeOptions(tls: ClientOptions["tls"]): Record<string, unknown> {
    if (!this.#secure(tls)) return {};
    const t: TlsOptions = typeof tls === "object" ? tls : {};
    return {
      ...(t.ca !== undefined ? { ca: t.ca } : {}),
      ...(t.cert !== undefined ? { cert: t.cert } : {}),
      ...(t.key !== undefined ? { key: t.key } : {}),
      ...(t.serverName !== undefined ? { servername: t.serverName } : {}),
    };
  }

  #makeTransport(address: string, tls: ClientOptions["tls"], interceptors: Interceptor[], sessionManager?: Http2SessionManager): Transport {
    return createGrpcTransport({
      baseUrl: `${this.#secure(tls) ? "https" : "http"}://${address}`,
      interceptors,
      nodeOptions: this.#nodeOptions(tls),
      ...(sessionManager ? { sessionManager } : {}),
      // A reply of 1,000 leased items may be large; requests stay under the API's 5 MB.
      readMaxBytes: 64 << 20,
    });
  }

  /** Cancel the calls in flight (they fail with Cancelled); the connections are closed
   * once idle. */
  close(): void {
    this.#closing.abort();
    for (const channel of this.#channels.values()) channel.close(new Cancelled("the client was closed", Code.Canceled));
  }

  /** Whether the server is a cluster node (undefined until the first data call asked). */
  get clustered(): boolean | undefined {
    return this.#map.clustered;
  }

  // -- the cluster's map -------------------------------------------------------------------

  #channel(address: string, node: string): NodeChannel {
    let channel = this.#channels.get(address);
    if (!channel) {
      channel = this.#makeChannel!(address);
      this.#channels.set(address, channel);
    }
    channel.node = node;
    return channel;
  }

  /** Ask ClusterInfo (about the queues the map places and those wanted) of the nodes in
   * turn: live ones first, then the bootstrap addresses. One at a time: a caller that
   * comes while one runs waits for it. */
  #refresh(queue?: string): Promise<void> {
    if (queue !== undefined) this.#wanted.add(queue);
    // A refresh that fails leaves the map as it was: callers go on with it.
    this.#refreshing ??= this.#askCluster()
      .catch(() => undefined)
      .finally(() => (this.#refreshing = undefined));
    return this.#refreshing;
  }

  async #askCluster(): Promise<void> {
    const now = performance.now();
    const known = this.#map.clustered ? this.#map.queues() : [];
    const asked = [...new Set([...known, ...this.#wanted])];
    this.#wanted.clear();
    const candidates = [...new Set([...this.#map.liveAddresses(now), ...this.addresses])];
    const timeoutMs = Math.min(this.#settings.timeoutMs, 5_000);
    let failure: unknown;
    for (const address of candidates) {
      if (this.#closing.signal.aborted) return;
      const channel = this.#channels.get(address) ?? (this.#makeChannel ? this.#channel(address, this.#map.nodeAt(address) ?? "") : this.#default);
      try {
        const answer = await channel.cluster.clusterInfo({ queueNames: asked }, { timeoutMs, signal: this.#closing.signal });
        const gone = this.#map.apply(answer, asked.length ? asked : undefined, performance.now());
        this.#refreshedAt = performance.now();
        for (const address of gone) {
          const old = this.#channels.get(address);
          if (!old || old === this.#default) continue;
          this.#channels.delete(address);
          old.close(new Unavailable(`node at ${address} left the cluster`, Code.Unavailable), true);
        }
        return;
      } catch (error) {
        const mapped = fromConnectError(error);
        if (mapped.code === Code.Unimplemented) {
          this.#map.clustered ??= false; // a server from before ClusterService: one server
          return;
        }
        failure = mapped;
        if (!(mapped instanceof Unavailable || mapped instanceof Cancelled)) break; // not a node problem
      }
    }
    if (this.#map.clustered === undefined) {
      // No answer yet: calls go to the first address meanwhile; ask again later.
      this.#discoverAfter = performance.now() + (failure instanceof Unavailable ? DOWN_FIRST_MS : this.#refreshMs);
    }
  }

  /** The channel a call for `target` goes to. */
  async #channelFor(target: Target): Promise<NodeChannel> {
    if (this.#map.clustered === undefined) {
      // Calls any node answers need no map, unless the first address may be down.
      if (performance.now() < this.#discoverAfter || (target.to === "any" && this.addresses.length === 1)) return this.#default;
      await this.#refresh("queue" in target ? target.queue : undefined);
      if (!this.#map.clustered) return this.#default;
    }
    const now = performance.now();
    // While a member is down the map is read more often, so calls go back to it soon
    // after it returns.
    const period = this.#map.allLive() ? this.#refreshMs : Math.min(this.#refreshMs, DOWN_CAP_MS / 2);
    if (now - this.#refreshedAt >= period) void this.#refresh();
    if (target.to === "any") return this.#anyChannel(now);
    for (let i = 0; i < 2 && this.#map.needsLookup(target.queue, now); i++) await this.#refresh(target.queue);
    if (target.to === "home" || target.to === "key") {
      let node = target.to === "home" ? this.#map.home(target.queue, target.partition) : this.#map.keyHome(target.queue, target.key);
      if (node !== undefined && this.#map.address(node) === "") {
        // The map says its home is down: once, in case the map is stale, read it again.
        await this.#refreshIfOlder(DOWN_FIRST_MS);
        node = target.to === "home" ? this.#map.home(target.queue, target.partition) : this.#map.keyHome(target.queue, target.key);
      }
      if (node === undefined) return this.#anyChannel(now); // a partition the map does not know: let a node answer
      const address = this.#map.address(node);
      if (address === "") {
        const what = target.to === "home" ? `partition ${target.partition}` : `the partition of lease key ${JSON.stringify(target.key)}`;
        throw new Unavailable(
          `${what} of queue ${target.queue} lives on node ${node}, which is down; its items are served again when it returns`,
          Code.Unavailable,
        );
      }
      return this.#channel(address, node);
    }
    if (this.#map.statsDue(target.queue, now)) {
      // The first count is awaited (once per queue), so the first calls already go where
      // the items are; later ones refresh it in the background.
      const counting = this.#count(target.queue, now);
      if (!this.#map.counted(target.queue)) await counting;
    }
    const node = target.to === "produce" ? this.#map.produceNode(target.queue, now) : this.#map.leaseNode(target.queue, now);
    if (node === undefined) return this.#anyChannel(now); // every home down as far as we know: a node says so
    return this.#channel(this.#map.address(node), node);
  }

  /** A node for a call any node answers: the first address while it is a member and
   * up, else a live member. */
  #anyChannel(now: number): NodeChannel {
    const node = this.#map.nodeAt(this.address);
    if (node !== undefined && this.#map.address(node) !== "" && !this.#map.isDown(node, now)) return this.#default;
    const address = this.#map.liveAddresses(now)[0];
    return address === undefined ? this.#default : this.#channel(address, this.#map.nodeAt(address) ?? "");
  }

  #refreshIfOlder(ms: number): Promise<void> {
    return performance.now() - this.#refreshedAt >= ms ? this.#refresh() : Promise.resolve();
  }

  /** Count what waits on each node's partitions of `queue` (GetQueueStats), for routing. */
  #count(queue: string, now: number): Promise<void> {
    this.#map.statsAsked(queue, now);
    return this.#counting(queue, now);
  }

  async #counting(queue: string, now: number): Promise<void> {
    try {
      const r = await this.#anyChannel(now).queues.getQueueStats({ queueName: queue }, { timeoutMs: 2_000, signal: this.#closing.signal });
      this.#map.applyStats(
        queue,
        r.partitions.map((p) => ({ partition: p.partition, ready: Number(p.total - p.totalLeased) })),
        performance.now(),
      );
    } catch {
      // the counts stay as they were; the next call asks again after a second
    }
  }

  /** After a call to `channel` failed with UNAVAILABLE: skip its node, read the map again. */
  async #nodeFailed(channel: NodeChannel, error: QueratorError): Promise<void> {
    const node = channel.node || this.#map.nodeAt(channel.address);
    if (node) this.#map.markDown(node, performance.now(), error.rawMessage);
    await this.#refreshIfOlder(DOWN_FIRST_MS);
  }

  // -- calling ----------------------------------------------------------------------------

  /**
   * One call, with the deadline, the signals, and retries under the RetryPolicy when `retry`.
   * In a cluster it goes to the node for `target`; a node that fails UNAVAILABLE is
   * skipped from then on and the call goes once, at once, to another node when that is
   * safe (`retry`, or it never reached the node).
   */
  async #call<T>(
    invoke: (channel: NodeChannel, options: { signal: AbortSignal; timeoutMs: number }) => Promise<T>,
    options: CallOptions | undefined,
    retry: boolean,
    kind: CallKind = {},
    timeoutMs?: number,
    target: Target = ANY,
  ): Promise<T> {
    if (this.#closing.signal.aborted) throw new QueratorError("the client is closed");
    const signal = options?.signal ? AbortSignal.any([options.signal, this.#closing.signal]) : this.#closing.signal;
    const deadline = timeoutMs ?? options?.timeoutMs ?? this.#settings.timeoutMs;
    let failedOver = false;
    for (let attempt = 1; ; attempt++) {
      let channel: NodeChannel | undefined;
      try {
        channel = this.#map.clustered === false ? this.#default : await this.#channelFor(target);
        const result = await invoke(channel, { signal, timeoutMs: deadline });
        if (channel.node) this.#map.markUp(channel.node);
        return result;
      } catch (error) {
        let mapped = fromConnectError(error, kind);
        if (mapped instanceof Cancelled && !signal.aborted) {
          // Cancelled without being asked to: the connection or the stream was cut.
          mapped = new Unavailable(mapped.rawMessage, Code.Unavailable, { cause: error });
        }
        if (this.#map.clustered && channel && !signal.aborted) {
          if (mapped instanceof Unavailable && nodeGone(error, mapped)) {
            await this.#nodeFailed(channel, mapped);
            if (!failedOver && (retry || neverSent(mapped)) && target.to !== "home" && target.to !== "key") {
              failedOver = true;
              attempt--;
              continue;
            }
          } else if (mapped instanceof Unavailable && (target.to === "produce" || target.to === "lease") && channel.node) {
            this.#map.markQueueDown(target.queue, channel.node, performance.now()); // retried (if at all) on another node
          } else if ("queue" in target && (mapped instanceof QueueNotFound || (mapped instanceof InvalidRequest && /partition/.test(mapped.rawMessage)))) {
            void this.#refreshIfOlder(DOWN_FIRST_MS); // the map may be stale: the queue or its partitions changed
          }
        }
        const delay = retry && !signal.aborted ? this.retryPolicy.delay(attempt, mapped) : undefined;
        if (delay === undefined) throw mapped;
        await sleep(delay, signal);
      }
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
      /** Retry after UNAVAILABLE even when a batch may have been stored (default: the
       * client's retryProduce). */
      retry?: boolean;
    } & CallOptions = {},
  ): Promise<ProduceResult> {
    const list: Iterable<ProduceInput> =
      typeof items === "string" || items instanceof Uint8Array || !(Symbol.iterator in items) ? [items as ProduceInput] : items;
    const batchSize = Math.max(1, Math.min(options.batchSize ?? MAX_BATCH, MAX_BATCH));
    const window = options.maxInFlight ?? this.#settings.maxInFlight;
    const retryProduce = options.retry ?? this.#retryProduce;
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
      return this.#produceCall(queueName, request, options, keyed || retryProduce).then(
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
   * without it) a unary call. In a cluster: to a node homing partitions of the queue
   * (the home of the first idempotency key's partition when the items carry keys). */
  #produceCall(queueName: string, request: ProduceRequest, options: CallOptions, retry: boolean): Promise<ProduceResponse> {
    const key = request.items.find((item) => item.idempotencyKey)?.idempotencyKey;
    const target: Target = key ? { to: "key", queue: queueName, key } : { to: "produce", queue: queueName };
    const count = request.payloads.length + request.items.length;
    const produced = (channel: NodeChannel, response: ProduceResponse): ProduceResponse => {
      if (channel.node) this.#map.produced(queueName, channel.node, count - response.duplicates);
      return response;
    };
    const unary = (): Promise<ProduceResponse> =>
      this.#call(async (c, o) => produced(c, await c.queue.produce(request, o)), options, retry, {}, undefined, target);
    const timeoutMs = options.timeoutMs ?? this.#settings.timeoutMs;
    const message: ProduceStreamRequest = { $typeName: "querator.v1.ProduceStreamRequest", request };
    const open = (c: NodeChannel, requests: AsyncIterable<ProduceStreamRequest>, signal: AbortSignal): AsyncIterable<ProduceStreamResponse> =>
      c.queue.produceStream(requests, { signal });
    return this.#streamCall(`produce\0${queueName}`, open, message, timeoutMs, options, retry, {}, false, unary, target, produced);
  }

  /** One request on the stream of `key` on the target's node (opened when missing or
   * broken), with the unary call's errors, retries and routing; `unary` for a server
   * without the streams. */
  async #streamCall<Req, V>(
    key: string,
    open: (channel: NodeChannel, requests: AsyncIterable<Req>, signal: AbortSignal) => AsyncIterable<StreamAnswer<V>>,
    message: Req,
    timeoutMs: number,
    options: CallOptions,
    retry: boolean,
    kind: CallKind,
    cancelAbandoned: boolean,
    unary: () => Promise<V>,
    target: Target,
    answered: (channel: NodeChannel, value: V) => V,
  ): Promise<V> {
    if (!this.#streams) return unary();
    let missing = false;
    const ask = async (channel: NodeChannel): Promise<V> => {
      let stream = channel.streams.get(key) as RequestStream<Req, StreamAnswer<V>> | undefined;
      if (!stream || stream.broken) {
        const opened: RequestStream<Req, StreamAnswer<V>> = new RequestStream(
          (requests, signal) => open(channel, requests, signal),
          () => {
            if (channel.streams.get(key) === opened) channel.streams.delete(key);
          },
          cancelAbandoned,
        );
        channel.streams.set(key, opened as RequestStream<unknown, unknown>);
        stream = opened;
      }
      let answer: StreamAnswer<V>;
      try {
        answer = await stream.ask(message, timeoutMs, options.signal);
      } catch (e) {
        const error = e instanceof QueratorError ? e : fromConnectError(e, kind);
        if (error.code === Code.Unimplemented) missing = true; // a server from before the streams
        throw error;
      }
      if (answer.result.case === "response") return answered(channel, answer.result.value);
      const e = answer.result.value ?? { code: Code.Unknown, message: "an empty answer", fields: [] };
      const error = fromStatus(e.code as Code, e.message, e.fields.map((field) => ({ field, description: "" })), kind);
      if (error instanceof Unauthenticated) stream.close(); // the next one opens with fresh credentials
      answeredOnStream.add(error);
      throw error;
    };
    try {
      return await this.#call(ask, options.signal ? { signal: options.signal } : undefined, retry, kind, timeoutMs, target);
    } catch (error) {
      if (!missing) throw error;
      this.#streams = false;
      return unary();
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
    // Completing items: at their home, which leases from its own partitions (or, empty,
    // from the others'), so the completion takes no hop.
    const target: Target = completing.length
      ? home(queueName, completing[0]!.partition)
      : request.leaseKey
        ? { to: "key", queue: queueName, key: request.leaseKey }
        : { to: "lease", queue: queueName };
    const leased = (channel: NodeChannel, response: LeaseResponse): LeaseResponse => {
      if (channel.node) this.#map.leased(queueName, channel.node, response.columns?.ids.length ?? response.items.length);
      return response;
    };
    const unary = (): Promise<LeaseResponse> =>
      this.#call(async (c, o) => leased(c, await c.queue.lease(request, o)), options, retry, kind, timeoutMs, target);
    const open = (c: NodeChannel, requests: AsyncIterable<LeaseStreamRequestInit>, signal: AbortSignal): AsyncIterable<LeaseStreamResponse> =>
      c.queue.leaseStream(requests, { signal });
    // A Lease that waits holds back the answers behind it on its stream: one stream per
    // client_id and queue, so only that consumer's own requests wait behind it.
    const key = `lease\0${queueName}\0${request.clientId}`;
    const response = await this.#streamCall(key, open, { request }, timeoutMs, options, retry, kind, true, unary, target, leased);
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
        const delay = this.retryPolicy.delay(++failures, error);
        if (delay === undefined) throw error;
        await sleep(delay, options.signal);
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
      await this.#call((c, o) => c.queue.complete(request, o), options, false, { itemCall: true }, undefined, home(queueName, partition));
      markAll(members, "completed");
    }
    for (const keys of leaseKeyChunks(options.leaseKeys, options.queueName)) {
      const request = { queueName: options.queueName!, leaseKeys: keys };
      await this.#call((c, o) => c.queue.complete(request, o), options, true, { itemCall: true }, undefined, byKey(request.queueName, keys));
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
      await this.#call((c, o) => c.queue.retry(request, o), options, false, { itemCall: true }, undefined, home(queueName, partition));
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
      const response = await this.#call((c, o) => c.queue.extend(request, o), options, true, { itemCall: true }, undefined, home(queueName, partition));
      response.leaseDeadlines.forEach((ts, i) => {
        const date = fromTimestamp(ts)!;
        deadlines.push(date);
        const member = members[i];
        if (member instanceof LeasedItem) member.leaseDeadline = date;
      });
    }
    for (const keys of leaseKeyChunks(options.leaseKeys, options.queueName)) {
      const request = { queueName: options.queueName!, leaseKeys: keys, ...leaseTimeout };
      const response = await this.#call((c, o) => c.queue.extend(request, o), options, true, { itemCall: true }, undefined, byKey(request.queueName, keys));
      keyItemsExtended += response.keyItemsExtended;
    }
    return { deadlines, keyItemsExtended };
  }

  // -- QueuesService ---------------------------------------------------------------------

  /** Create a queue; QueueExists when the name is taken. */
  async createQueue(name: string, settings: QueueSettings = {}, options?: CallOptions): Promise<QueueInfo> {
    const [queue] = queueInfoMessage(name, settings);
    const response = await this.#call((c, o) => c.queues.createQueue({ queue }, o), options, false);
    return queueInfo(response.queue);
  }

  async getQueue(name: string, options?: CallOptions): Promise<QueueInfo> {
    const response = await this.#call((c, o) => c.queues.getQueue({ queueName: name }, o), options, true);
    return queueInfo(response.queue);
  }

  /** All queues sorted by name: `for await (const queue of client.listQueues())`. */
  listQueues(options: { pageSize?: number; pageToken?: string } & CallOptions = {}): Pager<QueueInfo> {
    return new Pager(async (pageToken): Promise<Page<QueueInfo>> => {
      const request = { pageSize: options.pageSize ?? 0, pageToken };
      const response = await this.#call((c, o) => c.queues.listQueues(request, o), options, true);
      return { items: response.queues.map(queueInfo), nextPageToken: response.nextPageToken };
    }, options.pageToken);
  }

  /** Change exactly the settings given. */
  async updateQueue(name: string, settings: QueueSettings, options?: CallOptions): Promise<QueueInfo> {
    const [queue, paths] = queueInfoMessage(name, settings);
    if (!paths.length) throw new RangeError("updateQueue needs at least one setting to change");
    const request = { queue, updateMask: create(FieldMaskSchema, { paths }) };
    const response = await this.#call((c, o) => c.queues.updateQueue(request, o), options, true);
    return queueInfo(response.queue);
  }

  /** Delete a queue and its items (`force` when it still holds items). */
  async deleteQueue(name: string, options: { force?: boolean } & CallOptions = {}): Promise<void> {
    const request = { queueName: name, force: options.force ?? false };
    await this.#call((c, o) => c.queues.deleteQueue(request, o), options, false);
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
    await this.#call((c, o) => c.queues.clearQueue(request, o), options, true);
  }

  async queueStats(name: string, options?: CallOptions): Promise<QueueStats> {
    const r = await this.#call((c, o) => c.queues.getQueueStats({ queueName: name }, o), options, true);
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
      const r = await this.#call((c, o) => c.storage.listItems(request, o), options, true, {}, undefined, { to: "home", queue: queueName, partition });
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
      const r = await this.#call((c, o) => c.storage.listScheduledItems(request, o), options, true, {}, undefined, { to: "home", queue: queueName, partition });
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
      const r = await this.#call((c, o) => c.storage.importItems(request, o), options, false, {}, undefined, home(queueName, request.partition));
      ids.push(...r.ids);
    }
    return ids;
  }

  /** Delete items by id, whatever their state; unknown ids are ignored. */
  async deleteItems(queueName: string, ids: Iterable<string>, options: { partition?: number } & CallOptions = {}): Promise<void> {
    const all = [...ids];
    for (let start = 0; start < all.length; start += MAX_BATCH) {
      const request = { queueName, partition: options.partition ?? 0, ids: all.slice(start, start + MAX_BATCH) };
      await this.#call((c, o) => c.storage.deleteItems(request, o), options, true, {}, undefined, home(queueName, request.partition));
    }
  }

  // -- KeysService -----------------------------------------------------------------------

  /** Create an API key (needs an admin key for "*"); its token is shown only here. */
  async createKey(role: Role, queues: string | readonly string[], options: { description?: string } & CallOptions = {}): Promise<CreatedKey> {
    const value = ROLE_VALUES[role];
    if (value === undefined) throw new RangeError(`role must be one of ${Object.keys(ROLE_VALUES).join(", ")}`);
    const request = { role: value, queues: typeof queues === "string" ? [queues] : [...queues], description: options.description ?? "" };
    const r = await this.#call((c, o) => c.keys.createKey(request, o), options, false, { keyCall: true });
    return { key: apiKey(r.key), token: r.token };
  }

  /** Every key, sorted by id (never the tokens). */
  async listKeys(options?: CallOptions): Promise<ApiKey[]> {
    const r = await this.#call((c, o) => c.keys.listKeys({}, o), options, true, { keyCall: true });
    return r.keys.map((k) => apiKey(k));
  }

  /** Delete a key; calls with its token fail with Unauthenticated from then on. */
  async revokeKey(keyId: string, options?: CallOptions): Promise<void> {
    await this.#call((c, o) => c.keys.revokeKey({ keyId }, o), options, false, { keyCall: true });
  }
}

function home(queue: string, partition: number): Target {
  return { to: "home", queue, partition };
}

/** The node of the first key's partition: where the server sends a keys-only call. */
function byKey(queue: string, keys: readonly string[]): Target {
  return { to: "key", queue, key: keys[0] ?? "" };
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
