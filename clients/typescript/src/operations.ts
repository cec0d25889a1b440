/**
 * The client's operations without I/O: the request each call sends, where in a cluster
 * it goes (a Target), and its reply decoded into the client's plain values. The Client
 * composes these with its Connection, which does the sending; nothing here waits on
 * the network.
 */
import { type MessageInitShape, create } from "@bufbuild/protobuf";
import type { Duration } from "@bufbuild/protobuf/wkt";

import { fromDuration, fromMicros, fromTimestamp, payloadBytes, toDuration, toTimestamp } from "./convert.js";
import type { CallKind } from "./errors.js";
import { LeasedItem, type LeaseState, type Settler } from "./items.js";
import { type Target, targetOf } from "./routing.js";
import type {
  ApiKey,
  ClusterView,
  DeadReason,
  Item,
  ItemRef,
  PartitionStats,
  ProduceInput,
  QueueInfo,
  QueueSettings,
  QueueStats,
  RedriveResult,
  ReplicaSet,
  RetiredNode,
  Role,
  StoredItem,
} from "./models.js";
import type { ClusterInfoResponse, QueuePlacement, RetireNodeDiscardingDataResponse } from "./gen/querator/v1/cluster_pb.js";
import { type ApiKey as ApiKeyMessage, Role as RoleEnum } from "./gen/querator/v1/keys_pb.js";
import {
  DeadReason as DeadReasonEnum,
  type ExtendResponse,
  type LeaseRequestSchema,
  type LeaseResponse,
  type ProduceItem,
  type ProduceRequest,
  ProduceRequestSchema,
  QueueService,
} from "./gen/querator/v1/queue_pb.js";
import { type GetQueueStatsResponse, type QueueInfo as QueueInfoMessage, QueuesService } from "./gen/querator/v1/queues_pb.js";
import { type RedriveItemsResponse, type StorageItem, StorageItemSchema } from "./gen/querator/v1/storage_pb.js";

/** The API's limits: items per request, and bytes per request (batches stay under). */
export const MAX_BATCH = 1000;
export const BATCH_BYTES = 4_000_000;

// -- where a call goes --------------------------------------------------------------------

/** Where a call must or may go in a cluster. */
export const ANY: Target = { to: "any" };

/** The slices of `all` of at most `size` (MAX_BATCH) each. */
export function chunks<T>(all: readonly T[], size = MAX_BATCH): T[][] {
  const out: T[][] = [];
  for (let start = 0; start < all.length; start += size) out.push(all.slice(start, start + size));
  return out;
}

// -- Produce ------------------------------------------------------------------------------

export type ProduceItemInit = MessageInitShape<typeof QueueService.method.produce.input> extends { items?: (infer I)[] } ? I & Partial<ProduceItem> : never;
/** One item of a Produce batch: a bare payload (the compact form) or a whole item. */
export type ProduceEntry = Uint8Array | ProduceItemInit;

/** Fields produce() applies to items that do not set their own. */
export interface ProduceDefaults {
  encoding?: string;
  kind?: string;
  reference?: string;
  enqueueAt?: Date;
  priority?: number;
}

export function isItem(value: ProduceInput): value is Item {
  return typeof value === "object" && !(value instanceof Uint8Array);
}

/** What produce() accepts, as an iterable of items. */
export function produceInputs(items: Iterable<ProduceInput> | ProduceInput): Iterable<ProduceInput> {
  return typeof items === "string" || items instanceof Uint8Array || !(Symbol.iterator in items) ? [items as ProduceInput] : items;
}

export function produceItem(item: Item, defaults: ProduceDefaults): ProduceItemInit {
  const enqueueAt = item.enqueueAt ?? defaults.enqueueAt;
  return {
    payload: payloadBytes(item.payload),
    encoding: item.encoding ?? defaults.encoding ?? "",
    kind: item.kind ?? defaults.kind ?? "",
    reference: item.reference ?? defaults.reference ?? "",
    idempotencyKey: item.idempotencyKey ?? "",
    groupKey: item.groupKey ?? "",
    metadata: item.metadata ?? {},
    priority: item.priority ?? defaults.priority ?? 0,
    ...(enqueueAt ? { enqueueAt: toTimestamp(enqueueAt) } : {}),
  };
}

/** A bound on an item's encoded size, for batching under the request byte limit. */
function approxItemBytes(item: ProduceItemInit): number {
  let n = (item.payload?.length ?? 0) + 3 * ((item.encoding?.length ?? 0) + (item.kind?.length ?? 0) + (item.reference?.length ?? 0)) + 3 * ((item.idempotencyKey?.length ?? 0) + (item.groupKey?.length ?? 0)) + 40;
  for (const [k, v] of Object.entries(item.metadata ?? {})) n += 3 * (k.length + v.length) + 8;
  return n;
}

/**
 * The items in batches of at most `batchSize` and under BATCH_BYTES, read from `inputs`
 * only as batches are taken. Bare payloads with no shared fields stay bare (the compact
 * form, ProduceRequest.payloads).
 */
export function* produceBatches(inputs: Iterable<ProduceInput>, batchSize: number, defaults: ProduceDefaults): Generator<ProduceEntry[], void, undefined> {
  const shared = Boolean(defaults.encoding || defaults.kind || defaults.reference || defaults.enqueueAt || defaults.priority);
  let batch: ProduceEntry[] = [];
  let size = 0;
  let group = ""; // the batch's ordered group: at most one per request
  for (const value of inputs) {
    let entry: ProduceEntry;
    let cost: number;
    if (!shared && !isItem(value)) {
      entry = payloadBytes(value);
      cost = entry.length + 6;
    } else {
      entry = produceItem(isItem(value) ? value : { payload: value }, defaults);
      cost = approxItemBytes(entry) + 6;
    }
    const itsGroup = entry instanceof Uint8Array ? "" : (entry.groupKey ?? "");
    if (batch.length && (batch.length >= batchSize || size + cost > BATCH_BYTES || (itsGroup && group && itsGroup !== group))) {
      yield batch;
      batch = [];
      size = 0;
      group = "";
    }
    batch.push(entry);
    size += cost;
    group ||= itsGroup;
  }
  if (batch.length) yield batch;
}

/** The Produce request of one batch, and whether every item carries an idempotency key
 * (then it is safe to send again). */
export function produceRequest(queueName: string, requestTimeout: Duration, batch: ProduceEntry[]): { request: ProduceRequest; keyed: boolean } {
  const compact = batch.every((e) => e instanceof Uint8Array);
  // The compact form is built as the message itself (protobuf-es messages are plain
  // objects): no per-request copy of the payload list by create(), which the profile
  // of bench/sdk_clients.py showed among the client's largest costs per request.
  const request: ProduceRequest = compact
    ? { $typeName: "querator.v1.ProduceRequest", queueName, requestTimeout, items: [], payloads: batch as Uint8Array[] }
    : create(ProduceRequestSchema, { queueName, requestTimeout, items: batch.map((e) => (e instanceof Uint8Array ? { payload: e } : e)) });
  const keyed = !compact && batch.every((e) => !(e instanceof Uint8Array) && Boolean(e.idempotencyKey));
  return { request, keyed };
}

/** Where a Produce goes (routing.ts, targetOf): a node homing partitions of the queue,
 * or the home of the first idempotency key's partition when the items carry keys. */
export function produceTarget(request: ProduceRequest): Target {
  return targetOf("Produce", request);
}

// -- Lease --------------------------------------------------------------------------------

export interface LeaseOptions {
  batchSize?: number;
  waitMs?: number;
  clientId?: string;
  complete?: readonly ItemRef[];
  leaseKey?: string;
}

/** A Lease as sent: its request, deadline, routing and what it completes. */
export interface LeaseCall {
  request: MessageInitShape<typeof LeaseRequestSchema> & { queueName: string; clientId: string; leaseKey: string };
  timeoutMs: number;
  retry: boolean;
  kind: CallKind;
  target: Target;
  completing: readonly ItemRef[];
}

export function leaseCall(
  queueName: string,
  options: LeaseOptions & { timeoutMs?: number },
  leaseMarginMs: number,
  retryComplete = true,
): LeaseCall {
  const timeoutMs = options.timeoutMs ?? (options.waitMs ?? 30_000) + leaseMarginMs;
  // A call deadline shorter than the wait bounds it: the answer (OK, maybe no items)
  // comes a little before the deadline. The server does this itself for a unary call;
  // a request on a stream has only its request_timeout.
  const waitMs = Math.min(options.waitMs ?? 30_000, Math.max(0, timeoutMs - Math.min(leaseMarginMs, timeoutMs / 5)));
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
  // Completing items: at their home, which leases from its own partitions (or, empty,
  // from the others'), so the completion takes no hop; with a lease key, at its home.
  const target = targetOf("Lease", request);
  // Completing too, sent again: the server answers the ids it completed the first time as done.
  return { request, timeoutMs, retry: retryComplete || completing.length === 0, kind: { itemCall: completing.length > 0 }, target, completing };
}

/** How many items a Lease reply holds. */
export function leasedCount(response: LeaseResponse): number {
  return response.columns?.ids.length ?? response.items.length;
}

/** A Lease reply's items, settled through `settler`. */
export function leasedItems(settler: Settler, response: LeaseResponse): LeasedItem[] {
  const { queueName, partition } = response;
  const columns = response.columns;
  if (columns && columns.ids.length) {
    // message_ids is empty when every item's equals its id; the dead-letter lists are
    // empty when no item of the batch is a dead letter.
    return columns.ids.map(
      (id, i) =>
        new LeasedItem(settler, {
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
          messageId: columns.messageIds[i] || id,
          sourceId: columns.sourceIds[i] ?? "",
          deadReason: deadReason(columns.deadReasons[i]),
          deadAt: columns.deadAtUs[i] ? fromMicros(columns.deadAtUs[i]!) : undefined,
          deadAttempts: columns.deadAttempts[i] ?? 0,
          lastError: columns.lastErrors[i] ?? "",
          lastErrorAt: columns.lastErrorAtUs[i] ? fromMicros(columns.lastErrorAtUs[i]!) : undefined,
          groupKey: columns.groupKeys[i] ?? "",
          priority: columns.priorities[i] ?? 0,
        }),
    );
  }
  return response.items.map(
    (item) =>
      new LeasedItem(settler, {
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
        messageId: item.messageId || item.id,
        sourceId: item.sourceId,
        deadReason: deadReason(item.deadReason),
        deadAt: fromTimestamp(item.deadAt),
        deadAttempts: item.deadAttempts,
        lastError: item.lastError,
        lastErrorAt: fromTimestamp(item.lastErrorAt),
        groupKey: item.groupKey,
        priority: item.priority,
      }),
  );
}

const DEAD_REASONS: Record<DeadReason, DeadReasonEnum> = {
  max_attempts: DeadReasonEnum.MAX_ATTEMPTS,
  expired: DeadReasonEnum.EXPIRED,
  retry_dead: DeadReasonEnum.RETRY_DEAD,
};

/** The client's DeadReason of an API value (undefined: not a dead letter, or a reason
 * this client does not know yet). */
export function deadReason(value: DeadReasonEnum | undefined): DeadReason | undefined {
  return (Object.keys(DEAD_REASONS) as DeadReason[]).find((r) => DEAD_REASONS[r] === value);
}

export function deadReasonValue(reason: DeadReason | undefined): DeadReasonEnum {
  if (reason === undefined) return DeadReasonEnum.UNSPECIFIED;
  const value = DEAD_REASONS[reason];
  if (value === undefined) throw new RangeError(`deadReason must be one of ${Object.keys(DEAD_REASONS).join(", ")}, not ${String(reason)}`);
  return value;
}

// -- Complete, Retry, Extend ----------------------------------------------------------------

export function markAll(items: readonly ItemRef[], state: LeaseState): void {
  for (const item of items) if (item instanceof LeasedItem) item.markSettled(state);
}

/** Items grouped by (queue, partition) in first-seen order, in chunks of at most 1,000. */
export function groupRefs(items: ItemRef | readonly ItemRef[]): [string, number, ItemRef[]][] {
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
    for (const chunk of chunks(members)) out.push([queue, partition, chunk]);
  }
  return out;
}

export function leaseKeyChunks(keys: readonly string[] | undefined, queueName: string | undefined): string[][] {
  if (!keys || keys.length === 0) return [];
  if (!queueName) throw new RangeError("leaseKeys need queueName");
  return chunks(keys);
}

/** When retried items come back: `at`, or `inMs` from now, or now (undefined). */
export function retryAt(options: { at?: Date; inMs?: number }): Date | undefined {
  return options.at ?? (options.inMs !== undefined ? new Date(Date.now() + options.inMs) : undefined);
}

export function retryItems(
  members: readonly ItemRef[],
  at: Date | undefined,
  dead: boolean,
  error = "",
): { id: string; dead: boolean; error: string; retryAt?: ReturnType<typeof toTimestamp> }[] {
  return members.map((m) => ({ id: m.id, dead, error, ...(at ? { retryAt: toTimestamp(at) } : {}) }));
}

export function leaseTimeout(ms: number | undefined): { leaseTimeout?: Duration } {
  return ms !== undefined ? { leaseTimeout: toDuration(ms) } : {};
}

/** An Extend reply's new deadlines, in order; leased items among `members` take theirs. */
export function extendedDeadlines(members: readonly ItemRef[], response: ExtendResponse): Date[] {
  return response.leaseDeadlines.map((ts, i) => {
    const date = fromTimestamp(ts)!;
    const member = members[i];
    if (member instanceof LeasedItem) member.leaseDeadline = date;
    return date;
  });
}

// -- queues ---------------------------------------------------------------------------------

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

/** The QueueInfo message of `name` with settings `s`, and the field-mask paths of the
 * settings given. */
export function queueInfoMessage(name: string, s: QueueSettings): [MessageInitShape<typeof QueuesService.method.createQueue.input>["queue"], string[]] {
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

export function queueInfo(info: QueueInfoMessage | undefined): QueueInfo {
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
    paused: info?.paused ?? false,
    producePaused: info?.producePaused ?? false,
  };
}

export function queueStats(r: GetQueueStatsResponse): QueueStats {
  const partitions: PartitionStats[] = r.partitions.map((p) => ({
    partition: p.partition,
    total: Number(p.total),
    totalLeased: Number(p.totalLeased),
    ready: Number(p.total - p.totalLeased),
    scheduled: Number(p.scheduled),
    averageAgeMs: fromDuration(p.averageAge),
    averageLeasedAgeMs: fromDuration(p.averageLeasedAge),
    faulty: p.faulty,
    failure: p.faulty ? p.failure || "faulty" : "",
    faultySince: p.faulty ? fromTimestamp(p.faultySince) : undefined,
    produced: Number(p.produced),
    completed: Number(p.completed),
    groupsInFlight: Number(p.groupsInFlight),
    oldestWaitingInGroupMs: p.oldestWaitingInGroup ? fromDuration(p.oldestWaitingInGroup) : undefined,
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

// -- storage --------------------------------------------------------------------------------

export function storedItem(i: StorageItem, partition: number): StoredItem {
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
    messageId: i.messageId || i.id,
    deadReason: deadReason(i.deadReason),
    deadAt: fromTimestamp(i.deadAt),
    deadAttempts: i.deadAttempts,
    lastError: i.lastError,
    lastErrorAt: fromTimestamp(i.lastErrorAt),
    groupKey: i.groupKey,
    priority: i.priority,
  };
}

export function storageItem(i: Partial<StoredItem>): StorageItem {
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
    messageId: i.messageId ?? "",
    deadReason: deadReasonValue(i.deadReason),
    deadAttempts: i.deadAttempts ?? 0,
    ...(i.deadAt ? { deadAt: ts(i.deadAt)!.timestamp } : {}),
    lastError: i.lastError ?? "",
    priority: i.priority ?? 0,
    ...(i.lastErrorAt ? { lastErrorAt: ts(i.lastErrorAt)!.timestamp } : {}),
    ...(i.leaseDeadline ? { leaseDeadline: ts(i.leaseDeadline)!.timestamp } : {}),
    ...(i.expireDeadline ? { expireDeadline: ts(i.expireDeadline)!.timestamp } : {}),
    ...(i.enqueueAt ? { enqueueAt: ts(i.enqueueAt)!.timestamp } : {}),
    ...(i.createdAt ? { createdAt: ts(i.createdAt)!.timestamp } : {}),
  });
}

/** What a redrive asks for: the target (default: each item's source queue), the
 * filters, and at most how many items in all (default: every matching one). */
export interface RedriveOptions {
  to?: string;
  kind?: string;
  deadReason?: DeadReason;
  limit?: number;
}

/** The next RedriveItems request of a redrive that moved `done.moved` items so far, or
 * undefined once `limit` items moved. */
export function redriveRequest(queueName: string, options: RedriveOptions, done: RedriveResult, pageToken: string) {
  if (options.limit !== undefined && !(options.limit >= 1)) throw new RangeError(`limit must be at least 1, got ${options.limit}`);
  const remaining = options.limit === undefined ? MAX_BATCH : Math.min(MAX_BATCH, options.limit - done.moved);
  if (remaining <= 0) return undefined;
  return {
    queueName,
    targetQueue: options.to ?? "",
    kind: options.kind ?? "",
    deadReason: deadReasonValue(options.deadReason),
    maxItems: remaining,
    pageToken,
  };
}

export function redriveProgress(done: RedriveResult, r: RedriveItemsResponse): RedriveResult {
  return { moved: done.moved + r.moved, messageIds: [...done.messageIds, ...r.messageIds], skipped: done.skipped + r.skipped };
}

// -- keys -----------------------------------------------------------------------------------

const ROLE_VALUES: Record<Role, RoleEnum> = { producer: RoleEnum.PRODUCER, consumer: RoleEnum.CONSUMER, admin: RoleEnum.ADMIN };

export function roleValue(role: Role): RoleEnum {
  const value = ROLE_VALUES[role];
  if (value === undefined) throw new RangeError(`role must be one of ${Object.keys(ROLE_VALUES).join(", ")}`);
  return value;
}

export function apiKey(k: ApiKeyMessage | undefined): ApiKey {
  const role = (Object.keys(ROLE_VALUES) as Role[]).find((r) => ROLE_VALUES[r] === k?.role) ?? "producer";
  return {
    keyId: k?.keyId ?? "",
    role,
    queues: k?.queues ?? [],
    description: k?.description ?? "",
    createdAt: fromTimestamp(k?.createdAt),
  };
}

// -- ClusterService ---------------------------------------------------------------------

export function replicaSet(q: QueuePlacement | undefined): ReplicaSet {
  return {
    primary: q?.primary ?? "",
    epoch: Number(q?.epoch ?? 0),
    replicas: [...(q?.replicas ?? [])],
    inSync: [...(q?.inSync ?? [])],
    minInSync: q?.minInSync ?? 0,
    failoverBlocked: q?.failoverBlocked ?? "",
    movingFrom: q?.movingFrom ?? "",
    movingTo: q?.movingTo ?? "",
  };
}

export function clusterView(r: ClusterInfoResponse): ClusterView {
  return {
    clustered: r.clustered,
    nodeId: r.nodeId,
    revision: Number(r.revision),
    members: r.members.map((m) => ({ nodeId: m.nodeId, address: m.address, live: m.live, fenced: m.fenced, checkError: m.checkError })),
    homes: Object.fromEntries(r.queues.map((q) => [q.queueName, [...q.homes]])),
    adminWritable: r.adminWritable,
    replicated: Object.fromEntries(r.queues.filter((q) => q.replicas.length).map((q) => [q.queueName, replicaSet(q)])),
  };
}

export function retiredNode(r: RetireNodeDiscardingDataResponse): RetiredNode {
  return {
    partitionsRecreated: r.partitionsRecreated,
    copiesRecreated: r.copiesRecreated,
    copiesPromoted: r.copiesPromoted.map((c) => ({ queueName: c.queueName, nodeId: c.nodeId, epoch: Number(c.epoch), lsn: Number(c.lsn), newEpoch: Number(c.newEpoch) })),
  };
}
