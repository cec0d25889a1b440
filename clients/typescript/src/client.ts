import { create } from "@bufbuild/protobuf";
import { FieldMaskSchema } from "@bufbuild/protobuf/wkt";

import { toDuration } from "./convert.js";
import { Connection } from "./connection.js";
import { QueratorError, fromConnectError } from "./errors.js";
import { failureText } from "./failure.js";
import type { LeasedItem, RetryOptions, Settler } from "./items.js";
import type { ApiKey, ClusterView, CompleteResult, CreatedKey, ExtendResult, ItemRef, Page, ProduceInput, ProduceResult, QueueInfo, QueueSettings, QueueStats, RedriveResult, ReplicaSet, RetiredNode, RetryResult, Role, StoredItem } from "./models.js";
import {
  type LeaseOptions,
  MAX_BATCH,
  apiKey,
  chunks,
  clusterView,
  extendedDeadlines,
  groupRefs,
  leaseCall,
  leaseKeyChunks,
  leaseTimeout,
  leasedItems,
  markAll,
  produceBatches,
  produceInputs,
  produceRequest,
  queueInfo,
  queueInfoMessage,
  queueStats,
  type RedriveOptions,
  redriveProgress,
  redriveRequest,
  replicaSet,
  retiredNode,
  retryAt,
  retryItems,
  roleValue,
  storageItem,
  storedItem,
} from "./operations.js";
import type { CallOptions, ClientOptions } from "./options.js";
import type { ProduceResponse } from "./gen/querator/v1/queue_pb.js";
import { Pager } from "./paging.js";
import { targetOf } from "./routing.js";
import { type RetryPolicy, sleep } from "./retry.js";

export { DEFAULT_ADDRESS, type CallOptions, type ClientOptions, type TlsOptions } from "./options.js";
export { MAX_BATCH } from "./operations.js";

/**
 * A Querator client over one HTTP/2 connection (gRPC) per node. Every call of the v1
 * API; `close()` when done.
 *
 *     const client = new Client({ address: "127.0.0.1:2319" });
 *     await client.produce("emails", ["hello", "world"]);
 *     for (const item of await client.lease("emails", { batchSize: 10, waitMs: 5000 })) {
 *       console.log(item.text);
 *       await item.complete();
 *     }
 *
 * Each method builds its requests (operations.ts) and sends them through the client's
 * Connection, which routes, retries and maps errors.
 */
export class Client implements Settler {
  readonly #conn: Connection;
  readonly #leaseMarginMs: number;
  readonly #maxInFlight: number;
  readonly #retryProduce: boolean;
  readonly #retryComplete: boolean;

  constructor(options: ClientOptions = {}) {
    this.#leaseMarginMs = options.leaseMarginMs ?? 5_000;
    this.#maxInFlight = options.maxInFlight ?? 4;
    this.#retryProduce = options.retryProduce ?? false;
    this.#retryComplete = options.retryComplete ?? true;
    if (this.#maxInFlight < 1) throw new RangeError("maxInFlight must be at least 1");
    this.#conn = new Connection(options);
  }

  /** The (first) address the client was given. */
  get address(): string {
    return this.#conn.address;
  }

  /** Every bootstrap address. */
  get addresses(): readonly string[] {
    return this.#conn.addresses;
  }

  /** Which failures are retried, how often, after how long: the client's calls and its
   * Workers' Lease loops back off by it. */
  get retryPolicy(): RetryPolicy {
    return this.#conn.retryPolicy;
  }

  /** Cancel the calls in flight (they fail with Cancelled); the connections are closed
   * once idle. */
  close(): void {
    this.#conn.close();
  }

  /** Whether the server is a cluster node (undefined until the first data call asked). */
  get clustered(): boolean | undefined {
    return this.#conn.clustered;
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
      /** 0 to 9, for items that set none (see Item.priority). */
      priority?: number;
      batchSize?: number;
      maxInFlight?: number;
      /** Retry after UNAVAILABLE even when a batch may have been stored (default: the
       * client's retryProduce). */
      retry?: boolean;
    } & CallOptions = {},
  ): Promise<ProduceResult> {
    const batchSize = Math.max(1, Math.min(options.batchSize ?? MAX_BATCH, MAX_BATCH));
    const window = options.maxInFlight ?? this.#maxInFlight;
    const retryProduce = options.retry ?? this.#retryProduce;
    // The server's own limit for each request: the call's deadline.
    const requestTimeout = toDuration(options.timeoutMs ?? this.#conn.timeoutMs);
    const ids: string[][] = [];
    const partitions: number[][] = [];
    let duplicates = 0;
    let failure: QueratorError | undefined;
    const pending = new Set<Promise<void>>();
    // Each ordered group's last request: the group's next one is sent after its answer,
    // so the server stores a group's items in the order given.
    const groupTail = new Map<string, Promise<void>>();
    let index = 0;
    for (const batch of produceBatches(produceInputs(items), batchSize, options)) {
      while (pending.size >= window) await Promise.race(pending);
      if (failure) break;
      const at = index++;
      const { request, keyed } = produceRequest(queueName, requestTimeout, batch);
      ids[at] = new Array<string>(batch.length).fill("");
      const group = request.items.find((i) => i.groupKey)?.groupKey ?? "";
      const before = group ? groupTail.get(group) : undefined;
      const send = (): Promise<ProduceResponse> => {
        if (failure) throw failure; // a group's items after a failed request are not sent
        return this.#conn.produce(request, options, keyed || retryProduce);
      };
      const sent: Promise<void> = (before ? before.then(send) : send())
        .then(
          (response) => {
            ids[at] = response.ids;
            partitions[at] = new Array<number>(batch.length).fill(response.partition);
            duplicates += response.duplicates;
          },
          (error: unknown) => {
            failure ??= error instanceof QueratorError ? error : fromConnectError(error);
          },
        )
        .finally(() => {
          pending.delete(sent);
          if (groupTail.get(group) === sent) groupTail.delete(group);
        });
      pending.add(sent);
      if (group) groupTail.set(group, sent);
    }
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

  /**
   * Lease up to `batchSize` ready items (oldest first, one partition), waiting up to
   * `waitMs` for some; after completing `complete` (items of one earlier lease of this
   * queue) in the same call.
   */
  async lease(queueName: string, options: LeaseOptions & CallOptions = {}): Promise<LeasedItem[]> {
    const call = leaseCall(queueName, options, this.#leaseMarginMs, this.#retryComplete);
    const response = await this.#conn.lease(call, options);
    markAll(call.completing, "completed");
    return leasedItems(this, response);
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

  /** Complete leased items (any mix of queues and partitions: one call per partition),
   * or every item still leased under `leaseKeys` of `queueName`. Resolves to which ids
   * an earlier send had completed already (the request was sent again after a lost
   * answer) and how many items the lease keys completed. */
  async complete(
    items: ItemRef | readonly ItemRef[] = [],
    options: { leaseKeys?: readonly string[]; queueName?: string } & CallOptions = {},
  ): Promise<CompleteResult> {
    const result: CompleteResult = { alreadyCompleted: [], keyItemsCompleted: 0 };
    // Sent again, the ids a first send completed are answered as done (alreadyCompleted).
    const how = { retry: this.#retryComplete, kind: { itemCall: true } };
    for (const [queueName, partition, members] of groupRefs(items)) {
      const request = { queueName, partition, ids: members.map((m) => m.id) };
      const response = await this.#conn.call((c, o) => c.queue.complete(request, o), options, { ...how, target: targetOf("Complete", request) });
      markAll(members, "completed");
      result.alreadyCompleted.push(...response.alreadyCompleted);
    }
    for (const keys of leaseKeyChunks(options.leaseKeys, options.queueName)) {
      const request = { queueName: options.queueName!, leaseKeys: keys };
      const response = await this.#conn.call((c, o) => c.queue.complete(request, o), options, { ...how, retry: true, target: targetOf("Complete", request) });
      result.keyItemsCompleted += response.keyItemsCompleted;
    }
    return result;
  }

  /** Give leased items back: to the queue now, at `at` / in `inMs`, or to the
   * dead-letter queue with `dead`; `error` (text, or a thrown value) becomes each
   * item's `lastError`. Resolves to the ids dead-lettered and those an earlier send
   * had retried already (the request was sent again after a lost answer). */
  async retry(
    items: ItemRef | readonly ItemRef[],
    options: RetryOptions & CallOptions = {},
  ): Promise<RetryResult> {
    const result: RetryResult = { deadIds: [], alreadyRetried: [] };
    const at = retryAt(options);
    const dead = options.dead ?? false;
    const error = options.error === undefined || typeof options.error === "string" ? (options.error ?? "") : failureText(options.error);
    for (const [queueName, partition, members] of groupRefs(items)) {
      const request = { queueName, partition, items: retryItems(members, at, dead, error) };
      // Sent again, the ids a first send retried are answered as done (alreadyRetried).
      const how = { retry: this.#retryComplete, kind: { itemCall: true }, target: targetOf("Retry", request) };
      const response = await this.#conn.call((c, o) => c.queue.retry(request, o), options, how);
      // The server's answer decides: an item out of attempts is dead-lettered even
      // though it was not sent with `dead`.
      const deadIds = new Set(response.deadIds);
      for (const member of members) markAll([member], deadIds.has(member.id) ? "dead" : "retried");
      result.deadIds.push(...response.deadIds);
      result.alreadyRetried.push(...response.alreadyRetried);
    }
    return result;
  }

  /** Push lease deadlines of items (or of everything leased under `leaseKeys`) to
   * `leaseTimeoutMs` from now (default: the queue's lease timeout). */
  async extend(
    items: ItemRef | readonly ItemRef[] = [],
    options: { leaseTimeoutMs?: number; leaseKeys?: readonly string[]; queueName?: string } & CallOptions = {},
  ): Promise<ExtendResult> {
    const timeout = leaseTimeout(options.leaseTimeoutMs);
    const how = { retry: true, kind: { itemCall: true } };
    const deadlines: Date[] = [];
    let keyItemsExtended = 0;
    for (const [queueName, partition, members] of groupRefs(items)) {
      const request = { queueName, partition, ids: members.map((m) => m.id), ...timeout };
      const response = await this.#conn.call((c, o) => c.queue.extend(request, o), options, { ...how, target: targetOf("Extend", request) });
      deadlines.push(...extendedDeadlines(members, response));
    }
    for (const keys of leaseKeyChunks(options.leaseKeys, options.queueName)) {
      const request = { queueName: options.queueName!, leaseKeys: keys, ...timeout };
      const response = await this.#conn.call((c, o) => c.queue.extend(request, o), options, { ...how, target: targetOf("Extend", request) });
      keyItemsExtended += response.keyItemsExtended;
    }
    return { deadlines, keyItemsExtended };
  }

  // -- QueuesService ---------------------------------------------------------------------

  /** Create a queue; QueueExists when the name is taken. */
  async createQueue(name: string, settings: QueueSettings = {}, options?: CallOptions): Promise<QueueInfo> {
    const [queue] = queueInfoMessage(name, settings);
    const response = await this.#conn.call((c, o) => c.queues.createQueue({ queue }, o), options, { retry: false });
    return queueInfo(response.queue);
  }

  async getQueue(name: string, options?: CallOptions): Promise<QueueInfo> {
    const response = await this.#conn.call((c, o) => c.queues.getQueue({ queueName: name }, o), options, { retry: true });
    return queueInfo(response.queue);
  }

  /** All queues sorted by name: `for await (const queue of client.listQueues())`. */
  listQueues(options: { pageSize?: number; pageToken?: string } & CallOptions = {}): Pager<QueueInfo> {
    return new Pager(async (pageToken): Promise<Page<QueueInfo>> => {
      const request = { pageSize: options.pageSize ?? 0, pageToken };
      const response = await this.#conn.call((c, o) => c.queues.listQueues(request, o), options, { retry: true });
      return { items: response.queues.map(queueInfo), nextPageToken: response.nextPageToken };
    }, options.pageToken);
  }

  /** Change exactly the settings given. */
  async updateQueue(name: string, settings: QueueSettings, options?: CallOptions): Promise<QueueInfo> {
    const [queue, paths] = queueInfoMessage(name, settings);
    if (!paths.length) throw new RangeError("updateQueue needs at least one setting to change");
    const request = { queue, updateMask: create(FieldMaskSchema, { paths }) };
    const response = await this.#conn.call((c, o) => c.queues.updateQueue(request, o), options, { retry: true });
    return queueInfo(response.queue);
  }

  /** Delete a queue and its items (`force` when it still holds items). */
  async deleteQueue(name: string, options: { force?: boolean } & CallOptions = {}): Promise<void> {
    const request = { queueName: name, force: options.force ?? false };
    await this.#conn.call((c, o) => c.queues.deleteQueue(request, o), options, { retry: false });
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
    await this.#conn.call((c, o) => c.queues.clearQueue(request, o), options, { retry: true });
  }

  /** Stop the queue handing out items until resumeQueue: leases wait (and answer
   * empty at their wait), while produce, completions, retries, lease expiry, scheduled
   * items and dead-lettering go on. `produce: true` refuses produce too
   * (FailedPrecondition). Stored with the queue: it outlives restarts and holds on
   * every node of a cluster. Admin key; retried after UNAVAILABLE (pausing twice is
   * pausing once). */
  async pauseQueue(name: string, options: { produce?: boolean } & CallOptions = {}): Promise<QueueInfo> {
    const request = { queueName: name, produce: options.produce ?? false };
    const response = await this.#conn.call((c, o) => c.queues.pauseQueue(request, o), options, { retry: true });
    return queueInfo(response.queue);
  }

  /** End a pause: waiting leases get items again. A queue not paused is left as is. */
  async resumeQueue(name: string, options?: CallOptions): Promise<QueueInfo> {
    const response = await this.#conn.call((c, o) => c.queues.resumeQueue({ queueName: name }, o), options, { retry: true });
    return queueInfo(response.queue);
  }

  async queueStats(name: string, options?: CallOptions): Promise<QueueStats> {
    return queueStats(await this.#conn.call((c, o) => c.queues.getQueueStats({ queueName: name }, o), options, { retry: true }));
  }

  // -- StorageService --------------------------------------------------------------------

  /** Ready and leased items of one partition in FIFO order (`for await`). */
  listItems(queueName: string, options: { partition?: number; pageSize?: number; pageToken?: string } & CallOptions = {}): Pager<StoredItem> {
    const partition = options.partition ?? 0;
    return new Pager(async (pageToken) => {
      const request = { queueName, partition, pageSize: options.pageSize ?? 0, pageToken };
      const r = await this.#conn.call((c, o) => c.storage.listItems(request, o), options, { retry: true, target: targetOf("ListItems", request) });
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
      const r = await this.#conn.call((c, o) => c.storage.listScheduledItems(request, o), options, { retry: true, target: targetOf("ListScheduledItems", request) });
      return { items: r.items.map((i) => storedItem(i, partition)), nextPageToken: r.nextPageToken };
    }, options.pageToken);
  }

  /** Store items as given (attempts, deadlines, sourceId kept); returns their new ids. */
  async importItems(queueName: string, items: Iterable<Partial<StoredItem>>, options: { partition?: number } & CallOptions = {}): Promise<string[]> {
    const partition = options.partition ?? 0;
    const ids: string[] = [];
    for (const chunk of chunks([...items].map(storageItem))) {
      const request = { queueName, partition, items: chunk };
      const r = await this.#conn.call((c, o) => c.storage.importItems(request, o), options, { retry: false, target: targetOf("ImportItems", request) });
      ids.push(...r.ids);
    }
    return ids;
  }

  /** Delete items by id, whatever their state; unknown ids are ignored. */
  async deleteItems(queueName: string, ids: Iterable<string>, options: { partition?: number } & CallOptions = {}): Promise<void> {
    const partition = options.partition ?? 0;
    for (const chunk of chunks([...ids])) {
      const request = { queueName, partition, ids: chunk };
      await this.#conn.call((c, o) => c.storage.deleteItems(request, o), options, { retry: true, target: targetOf("DeleteItems", request) });
    }
  }

  /**
   * Move ready items out of `queueName` (a dead-letter queue): each back to the queue it
   * died in, or all `to` one queue; only those of `kind`, or that died for `deadReason`,
   * when given; at most `limit` (default: every matching one). RedriveItems page by page.
   *
   * Each item is moved exactly once, also if the server crashes mid-move; the calls are
   * not retried (a repeat would move further items): an error after earlier calls moved
   * items carries them as `error.redriven`. Items whose source queue is gone stay,
   * counted in `skipped`.
   */
  async redriveItems(queueName: string, options: RedriveOptions & CallOptions = {}): Promise<RedriveResult> {
    let done: RedriveResult = { moved: 0, messageIds: [], skipped: 0 };
    let pageToken = "";
    for (;;) {
      const request = redriveRequest(queueName, options, done, pageToken);
      if (!request) return done;
      let r;
      try {
        r = await this.#conn.call((c, o) => c.storage.redriveItems(request, o), options, { retry: false });
      } catch (error) {
        if (error instanceof QueratorError && done.moved) error.redriven = done;
        throw error;
      }
      done = redriveProgress(done, r);
      pageToken = r.nextPageToken;
      if (!pageToken) return done;
    }
  }

  // -- KeysService -----------------------------------------------------------------------

  /** Create an API key (needs an admin key for "*"); its token is shown only here. */
  async createKey(role: Role, queues: string | readonly string[], options: { description?: string } & CallOptions = {}): Promise<CreatedKey> {
    const request = { role: roleValue(role), queues: typeof queues === "string" ? [queues] : [...queues], description: options.description ?? "" };
    const r = await this.#conn.call((c, o) => c.keys.createKey(request, o), options, { retry: false, kind: { keyCall: true } });
    return { key: apiKey(r.key), token: r.token };
  }

  /** Every key, sorted by id (never the tokens). */
  async listKeys(options?: CallOptions): Promise<ApiKey[]> {
    const r = await this.#conn.call((c, o) => c.keys.listKeys({}, o), options, { retry: true, kind: { keyCall: true } });
    return r.keys.map((k) => apiKey(k));
  }

  /** Delete a key; calls with its token fail with Unauthenticated from then on. */
  async revokeKey(keyId: string, options?: CallOptions): Promise<void> {
    await this.#conn.call((c, o) => c.keys.revokeKey({ keyId }, o), options, { retry: false, kind: { keyCall: true } });
  }

  // -- ClusterService --------------------------------------------------------------------

  /** The cluster as the first address's node sees it: members, each queue's homes, and
   * the replicated queues' copies. `checkMembers`: also ask each live member whether it
   * is fenced, and each replicated queue whose primary is not live why no copy can take
   * over (`ReplicaSet.failoverBlocked`). A single server answers as one node. */
  async clusterInfo(options: { checkMembers?: boolean; queueNames?: readonly string[] } & CallOptions = {}): Promise<ClusterView> {
    const request = { checkMembers: options.checkMembers ?? false, queueNames: [...(options.queueNames ?? [])] };
    return clusterView(await this.#conn.call((c, o) => c.cluster.clusterInfo(request, o), options, { retry: true }));
  }

  /** Retire a dead node for good (admin key for "*"): its partitions of queues of one
   * copy are recreated, empty, on the live nodes (their items lost), its copies of
   * replicated queues made again from their other copies. `promoteCopiesBehind` (the
   * CLI's --discard-data) also accepts losing what only the node had: a queue whose only
   * in-sync copy it held gets its most advanced other copy as primary (`copiesPromoted`),
   * and one it was the primary of with no live copy anywhere is re-made empty; without
   * it such a retire fails with FailedPrecondition naming the queue, retiring nothing. */
  async retireNode(nodeId: string, options: { promoteCopiesBehind?: boolean } & CallOptions = {}): Promise<RetiredNode> {
    const request = { nodeId, promoteCopiesBehind: options.promoteCopiesBehind ?? false };
    return retiredNode(await this.#conn.call((c, o) => c.cluster.retireNodeDiscardingData(request, o), options, { retry: false }));
  }

  /** Make `nodeId` serve replicated queue `queueName` (`fromNodeId`: move that node's copy
   * there instead); the queue's copies once done. Admin key for "*". */
  async moveQueue(queueName: string, nodeId: string, options: { fromNodeId?: string } & CallOptions = {}): Promise<ReplicaSet> {
    const request = { queueName, nodeId, fromNodeId: options.fromNodeId ?? "" };
    return replicaSet((await this.#conn.call((c, o) => c.cluster.moveQueue(request, o), options, { retry: false })).placement);
  }

  /** Move every primary and copy of replicated queues off `nodeId`: the queues moved,
   * and those kept with why. Admin key for "*". */
  async drainNode(nodeId: string, options?: CallOptions): Promise<{ moved: string[]; kept: string[] }> {
    const r = await this.#conn.call((c, o) => c.cluster.drainNode({ nodeId }, o), options, { retry: false });
    return { moved: [...r.moved], kept: [...r.kept] };
  }
}
