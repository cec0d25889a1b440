/**
 * The I/O of a Client: a channel per node, the cluster's map and its refresh, and calls
 * made under the client's RetryPolicy, unary or on a Produce/Lease stream. The Client's
 * methods build requests (operations.ts) and hand them here with their Target; this
 * picks the node, sends, retries, fails over, and maps errors.
 */
import type { MessageInitShape } from "@bufbuild/protobuf";
import { Code, ConnectError, type Interceptor, type Transport } from "@connectrpc/connect";
import { Http2SessionManager, createGrpcTransport } from "@connectrpc/connect-node";

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
import type { LeaseResponse, LeaseStreamResponse, ProduceRequest, ProduceResponse, ProduceStreamRequest, ProduceStreamResponse, QueueService, StreamError } from "./gen/querator/v1/queue_pb.js";
import { ANY, type LeaseCall, leasedCount, produceTarget } from "./operations.js";
import { type CallOptions, type ClientOptions, DEFAULT_ADDRESS, type TlsOptions } from "./options.js";
import { RetryPolicy, sleep } from "./retry.js";
import { ClusterMap, DOWN_CAP_MS, DOWN_FIRST_MS, type Target } from "./routing.js";
import { RequestStream, closedHere } from "./streams.js";

/** How a call is made: whether it is safe to repeat, how its errors read, its deadline
 * (default: the call's or the client's) and where it goes (default: any node). */
export interface CallHow {
  retry: boolean;
  kind?: CallKind;
  timeoutMs?: number;
  target?: Target;
}

type Invoke<T> = (channel: NodeChannel, options: { signal: AbortSignal; timeoutMs: number }) => Promise<T>;
type LeaseStreamRequestInit = MessageInitShape<typeof QueueService.method.leaseStream.input>;
/** What ProduceStream and LeaseStream answer: the unary call's response, or its error. */
type StreamAnswer<V> = {
  result: { case: "response"; value: V } | { case: "error"; value: StreamError } | { case: undefined; value?: undefined };
};

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

/**
 * Whether an UNAVAILABLE is a node's "not primary: <node> epoch <e>": it can neither
 * serve nor forward a call about a replicated queue (another node is its primary, or is
 * about to be), and did nothing with it.
 */
function notPrimary(error: QueratorError): boolean {
  return error.rawMessage.includes("not primary: ");
}

/** Whether `error` says the request was never sent: no connection to the node. */
function neverSent(error: unknown): boolean {
  for (let e: unknown = error, depth = 0; e instanceof Error && depth < 6; e = e.cause, depth++) {
    const code = (e as NodeJS.ErrnoException).code;
    if (typeof code === "string" && NOT_CONNECTED.has(code)) return true;
  }
  return false;
}

function secure(tls: ClientOptions["tls"]): boolean {
  return tls !== undefined && tls !== false;
}

function nodeOptions(tls: ClientOptions["tls"]): Record<string, unknown> {
  if (!secure(tls)) return {};
  const t: TlsOptions = typeof tls === "object" ? tls : {};
  return {
    ...(t.ca !== undefined ? { ca: t.ca } : {}),
    ...(t.cert !== undefined ? { cert: t.cert } : {}),
    ...(t.key !== undefined ? { key: t.key } : {}),
    ...(t.serverName !== undefined ? { servername: t.serverName } : {}),
  };
}

function makeTransport(address: string, tls: ClientOptions["tls"], interceptors: Interceptor[], sessionManager?: Http2SessionManager): Transport {
  return createGrpcTransport({
    baseUrl: `${secure(tls) ? "https" : "http"}://${address}`,
    interceptors,
    nodeOptions: nodeOptions(tls),
    ...(sessionManager ? { sessionManager } : {}),
    // A reply of 1,000 leased items may be large; requests stay under the API's 5 MB.
    readMaxBytes: 64 << 20,
  });
}

export class Connection {
  /** The (first) address the client was given. */
  readonly address: string;
  /** Every bootstrap address. */
  readonly addresses: readonly string[];
  /** The default deadline of a call. */
  readonly timeoutMs: number;
  readonly retryPolicy: RetryPolicy;
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
  #refreshing: Promise<void> | undefined;
  #refreshedAt = -Infinity;
  /** A node answered "not primary": read the map before the next call goes anywhere. */
  #stale = false;
  /** Queues to ask ClusterInfo about on the next refresh. */
  readonly #wanted = new Set<string>();
  /** No first ClusterInfo before this time (it failed). */
  #discoverAfter = -Infinity;
  #streams: boolean;

  constructor(options: ClientOptions) {
    const addresses = options.addresses?.filter(Boolean) ?? [];
    if (!addresses.length) addresses.push(options.address || process.env["QUERATOR_ADDRESS"] || DEFAULT_ADDRESS);
    this.addresses = addresses;
    this.address = addresses[0]!;
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.retryPolicy = options.retryPolicy ?? new RetryPolicy(options.retries !== undefined ? { retries: options.retries } : {});
    this.#streams = options.streams ?? true;
    this.#refreshMs = options.clusterRefreshMs ?? 30_000;
    this.#map = new ClusterMap(options.logger);
    if (!(this.#refreshMs > 0)) throw new RangeError("clusterRefreshMs must be positive");
    const headers: [string, string][] = Object.entries(options.metadata ?? {});
    if (options.bearerToken) headers.push(["authorization", `Bearer ${options.bearerToken}`]);
    const addHeaders: Interceptor = (next) => (req) => {
      for (const [key, value] of headers) req.header.set(key, value);
      return next(req);
    };
    const interceptors = headers.length ? [addHeaders] : [];
    const tls = options.tls;
    if (options.transport) {
      this.#default = new NodeChannel(this.address, options.transport);
      this.#map.clustered = false; // the caller's transport: one server as far as we know
    } else {
      this.#default = new NodeChannel(this.address, makeTransport(this.address, tls, interceptors));
      this.#makeChannel = (address) => {
        const session = new Http2SessionManager(`${secure(tls) ? "https" : "http"}://${address}`, {}, nodeOptions(tls));
        return new NodeChannel(address, makeTransport(address, tls, interceptors, session), session);
      };
    }
    this.#channels.set(this.address, this.#default);
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
    const timeoutMs = Math.min(this.timeoutMs, 5_000);
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
    if (this.#stale) {
      this.#stale = false;
      await this.#refresh();
    }
    const now = performance.now();
    // While a member is down the map is read more often, so calls go back to it soon
    // after it returns.
    const period = this.#map.allLive() ? this.#refreshMs : Math.min(this.#refreshMs, DOWN_CAP_MS / 2);
    if (now - this.#refreshedAt >= period) void this.#refresh();
    if (target.to === "any") return this.#anyChannel(now);
    for (let i = 0; i < 2 && this.#map.needsLookup(target.queue, now); i++) await this.#refresh(target.queue);
    if (target.to === "home" || target.to === "key") {
      let node = this.#map.nodeFor(target, now);
      if (node !== "" && this.#map.address(node) === "") {
        // The map says its home is down: once, in case the map is stale, read it again.
        await this.#refreshIfOlder(DOWN_FIRST_MS);
        node = this.#map.nodeFor(target, now);
      }
      if (node === "") return this.#anyChannel(now); // a partition the map does not know: let a node answer
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
   * One call, with the deadline, the signals, and retries under the RetryPolicy when
   * `how.retry`. In a cluster it goes to the node for `how.target`; a node that fails
   * UNAVAILABLE is skipped from then on and the call goes once, at once, to another
   * node when that is safe (`retry`, or it never reached the node).
   */
  async call<T>(invoke: Invoke<T>, options: CallOptions | undefined, how: CallHow): Promise<T> {
    if (this.#closing.signal.aborted) throw new QueratorError("the client is closed");
    const { retry, kind = {}, target = ANY } = how;
    const signal = options?.signal ? AbortSignal.any([options.signal, this.#closing.signal]) : this.#closing.signal;
    const deadline = how.timeoutMs ?? options?.timeoutMs ?? this.timeoutMs;
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
          if (mapped instanceof Unavailable && notPrimary(mapped)) {
            // Nothing was done: the map is read again before the next call or attempt,
            // which goes (once at once) to the primary it names.
            this.#stale = true;
            if (!failedOver) {
              failedOver = true;
              attempt--;
              continue;
            }
          } else if (mapped instanceof Unavailable && nodeGone(error, mapped)) {
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

  /** One Produce: over the queue's ProduceStream, else (streams off, or a server
   * without it) a unary call. In a cluster: where produceTarget says. */
  produce(request: ProduceRequest, options: CallOptions, retry: boolean): Promise<ProduceResponse> {
    const queueName = request.queueName;
    const target = produceTarget(request);
    const count = request.payloads.length + request.items.length;
    const produced = (channel: NodeChannel, response: ProduceResponse): ProduceResponse => {
      if (channel.node) this.#map.produced(queueName, channel.node, count - response.duplicates);
      return response;
    };
    const timeoutMs = options.timeoutMs ?? this.timeoutMs;
    const unary = (): Promise<ProduceResponse> => this.call(async (c, o) => produced(c, await c.queue.produce(request, o)), options, { retry, target });
    const message: ProduceStreamRequest = { $typeName: "querator.v1.ProduceStreamRequest", request };
    const open = (c: NodeChannel, requests: AsyncIterable<ProduceStreamRequest>, signal: AbortSignal): AsyncIterable<ProduceStreamResponse> =>
      c.queue.produceStream(requests, { signal });
    return this.#streamCall(`produce\0${queueName}`, open, message, options, { retry, timeoutMs, target }, false, unary, produced);
  }

  /** One Lease: over the LeaseStream of its queue and client_id, else a unary call. */
  lease(call: LeaseCall, options: CallOptions): Promise<LeaseResponse> {
    const { request, timeoutMs, retry, kind, target } = call;
    const queueName = request.queueName;
    const leased = (channel: NodeChannel, response: LeaseResponse): LeaseResponse => {
      if (channel.node) this.#map.leased(queueName, channel.node, leasedCount(response));
      return response;
    };
    const how = { retry, kind, timeoutMs, target };
    const unary = (): Promise<LeaseResponse> => this.call(async (c, o) => leased(c, await c.queue.lease(request, o)), options, how);
    const open = (c: NodeChannel, requests: AsyncIterable<LeaseStreamRequestInit>, signal: AbortSignal): AsyncIterable<LeaseStreamResponse> =>
      c.queue.leaseStream(requests, { signal });
    // A Lease that waits holds back the answers behind it on its stream: one stream per
    // client_id and queue, so only that consumer's own requests wait behind it.
    const key = `lease\0${queueName}\0${request.clientId}`;
    return this.#streamCall(key, open, { request }, options, how, true, unary, leased);
  }

  /** One request on the stream of `key` on the target's node (opened when missing or
   * broken), with the unary call's errors, retries and routing; `unary` for a server
   * without the streams. */
  async #streamCall<Req, V>(
    key: string,
    open: (channel: NodeChannel, requests: AsyncIterable<Req>, signal: AbortSignal) => AsyncIterable<StreamAnswer<V>>,
    message: Req,
    options: CallOptions,
    how: CallHow & { timeoutMs: number },
    cancelAbandoned: boolean,
    unary: () => Promise<V>,
    answered: (channel: NodeChannel, value: V) => V,
  ): Promise<V> {
    if (!this.#streams) return unary();
    const kind = how.kind ?? {};
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
        answer = await stream.ask(message, how.timeoutMs, options.signal);
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
      return await this.call(ask, options.signal ? { signal: options.signal } : undefined, how);
    } catch (error) {
      if (!missing) throw error;
      this.#streams = false;
      return unary();
    }
  }
}
