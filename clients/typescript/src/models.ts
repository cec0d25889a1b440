/** The client's values: plain objects in and out, no protobuf in sight. Durations are
 * milliseconds (numbers), points in time are Dates. */

/** A payload: bytes, or a string stored as UTF-8. */
export type Payload = Uint8Array | string;

/** An item to produce, with more than a payload. */
export interface Item {
  payload: Payload;
  /** A free-form label of the payload's encoding, e.g. "application/json". */
  encoding?: string;
  /** A free-form label for the type of work. */
  kind?: string;
  /** A free-form reference, e.g. the id of a record elsewhere. */
  reference?: string;
  /** At least 100 ms in the future: the item is scheduled and becomes leasable then. */
  enqueueAt?: Date;
  /** At most 512 bytes: a second produce with the same key within the queue's
   * dedupWindow stores nothing and answers the first item's id. */
  idempotencyKey?: string;
  /** String pairs handed to whoever leases the item (e.g. trace context); at most 64
   * pairs and 16 KB in all. */
  metadata?: Record<string, string>;
  /** An ordered group (at most 512 bytes; not with enqueueAt): the items of a group are
   * leased one at a time, in produce order, the next once the one before is completed,
   * dead-lettered or deleted. A group's items live in one partition: produce() sends
   * each group's items in requests of their own and a group's next request only once
   * the one before it is answered. */
  groupKey?: string;
  /** 0 (the default) to 9: a lease takes a partition's ready items highest priority
   * first, FIFO within a priority. No aging: lower priorities wait while higher ones
   * are ready. Outside 0 to 9: InvalidArgument naming items[i].priority. */
  priority?: number;
}

/** What produce accepts per item. */
export type ProduceInput = Payload | Item;

/** The ids of produced items, in the order given, and the partition each went to. */
export interface ProduceResult {
  ids: string[];
  partitions: number[];
  /** Items whose idempotencyKey had been seen before: they stored nothing. */
  duplicates: number;
}

/** Names a leased item: what Complete, Retry and Extend need. LeasedItems are ItemRefs. */
export interface ItemRef {
  readonly queueName: string;
  readonly partition: number;
  readonly id: string;
}

/** A queue's settings. `partitions` is the API's requested_partitions. */
export interface QueueInfo {
  name: string;
  deadQueue: string;
  reference: string;
  leaseTimeoutMs: number;
  expireTimeoutMs: number;
  maxAttempts: number;
  partitions: number;
  createdAt: Date | undefined;
  updatedAt: Date | undefined;
  dedupWindowMs: number;
  leaseKeyTtlMs: number;
  /** Set by pauseQueue: the queue hands out no items; leases wait until resumeQueue. */
  paused: boolean;
  /** pauseQueue with `produce`: produce is refused too (FailedPrecondition). */
  producePaused: boolean;
}

/** The settings createQueue and updateQueue take; what is left out defaults (create)
 * or stays as it is (update). */
export interface QueueSettings {
  deadQueue?: string;
  reference?: string;
  leaseTimeoutMs?: number;
  expireTimeoutMs?: number;
  maxAttempts?: number;
  partitions?: number;
  dedupWindowMs?: number;
  leaseKeyTtlMs?: number;
}

/** One partition's counts. `total` is ready plus leased; scheduled items are apart. */
export interface PartitionStats {
  partition: number;
  total: number;
  totalLeased: number;
  ready: number;
  scheduled: number;
  averageAgeMs: number;
  averageLeasedAgeMs: number;
  /** Its storage failed (calls it cannot apply throw Unavailable until the server finds
   * it working again), or, in a cluster, its node is down: its counts are then 0,
   * unknown rather than empty. Its items are kept and come back with it. */
  faulty: boolean;
  /** Why it is faulty; "" while it serves. */
  failure: string;
  /** Since when it is faulty; undefined while it serves. */
  faultySince: Date | undefined;
  /** Items produced into and completed in the partition since the server loaded the
   * queue: counters (0 at the server's start) whose growth over time is the rate. */
  produced: number;
  completed: number;
  /** Ordered groups whose first item is leased now. */
  groupsInFlight: number;
  /** How long the item that has waited longest behind the first item of its group has
   * been in the queue, in ms (undefined: none waits). Such items count in total. */
  oldestWaitingInGroupMs: number | undefined;
}

/** A queue's counts now, per partition and summed. */
export interface QueueStats {
  queueName: string;
  partitions: PartitionStats[];
  total: number;
  totalLeased: number;
  ready: number;
  scheduled: number;
  leaseWaiting: number;
  produceWaiting: number;
  inFlight: number;
}

/** Why an item was moved to a dead-letter queue (`deadReason` of a dead letter): its
 * lease ran out (or a lease found it) with the queue's maxAttempts reached; its
 * expireTimeout passed; a consumer gave it up (`retry({ dead: true })`, DeadLetter). */
export type DeadReason = "max_attempts" | "expired" | "retry_dead";

/** Where an item came from, for dead letters: the fields leased and stored items share. */
export interface ItemHistory {
  /** The item's stable id: the id it was produced with, kept when it is re-queued (lease
   * expired, Retry), promoted from scheduled, dead-lettered or redriven, while `id`
   * changes with each of these. Key idempotency on it (with the queue). */
  messageId: string;
  /** In a dead-letter queue (or redriven from one): the item's id in the queue it came
   * from; "" otherwise. */
  sourceId: string;
  /** Dead letters only: why the item died (undefined for other items). */
  deadReason: DeadReason | undefined;
  /** Dead letters only: when it was dead-lettered. */
  deadAt: Date | undefined;
  /** Dead letters only: how many times it had been leased in the queue it died in
   * (`attempts` counts its leases in the queue that holds it now); 0 otherwise. */
  deadAttempts: number;
}

/** An item as StorageService stores it. Build one to import items (`id` is ignored;
 * `messageId`, `deadReason`, `deadAt` and `deadAttempts` are kept as given). */
export interface StoredItem extends ItemHistory {
  id: string;
  partition: number;
  payload: Uint8Array;
  isLeased: boolean;
  leaseDeadline: Date | undefined;
  expireDeadline: Date | undefined;
  enqueueAt: Date | undefined;
  createdAt: Date | undefined;
  attempts: number;
  reference: string;
  encoding: string;
  kind: string;
  sourceId: string;
  metadata: Record<string, string>;
  /** What went wrong the last time the item failed (see LeasedItem.lastError); for a
   * dead letter, the error that killed it. "" when it never failed with a text. */
  lastError: string;
  lastErrorAt: Date | undefined;
  /** The item's ordered group ("" for none); not imported. */
  groupKey?: string;
  /** 0 to 9, as given at produce (importItems keeps it). */
  priority: number;
}

/** What redriveItems did: how many items it moved, their message ids, and how many
 * matching items stayed (their source queue is gone or not visible). */
export interface RedriveResult {
  moved: number;
  messageIds: string[];
  skipped: number;
}

/** What complete() resolves to. `alreadyCompleted`: the ids (as sent) an earlier send
 * of the same request had completed already; empty on a first send, not empty when the
 * client sent the request again after a lost answer (UNAVAILABLE, `retryComplete`):
 * those items are done, not lost. `keyItemsCompleted`: how many items `leaseKeys`
 * completed (0 when every key was done or forgotten already). */
export interface CompleteResult {
  alreadyCompleted: string[];
  keyItemsCompleted: number;
}

/** What retry() resolves to. `deadIds`: the ids dead-lettered (sent with `dead`, out of
 * attempts or past their expiry; empty when every item went back). `alreadyRetried`:
 * the ids (as sent) an earlier send of the same request had retried already (the client
 * sent it again after a lost answer): they were not retried twice. */
export interface RetryResult {
  deadIds: string[];
  alreadyRetried: string[];
}

/** The new deadline of each extended item, in order, and how many items were extended
 * through lease keys. */
export interface ExtendResult {
  deadlines: Date[];
  keyItemsExtended: number;
}

/** An API key's role: what it may do on the queues its patterns match. */
export type Role = "producer" | "consumer" | "admin";

/** An API key as the server describes it (never its token). */
export interface ApiKey {
  keyId: string;
  role: Role;
  queues: string[];
  description: string;
  createdAt: Date | undefined;
}

/** A new key and its token (send it as bearerToken). Shown only once. */
export interface CreatedKey {
  key: ApiKey;
  token: string;
}

/** A member of a cluster as a node sees it. `fenced` and `checkError` are filled only
 * by `clusterInfo({ checkMembers: true })`. */
export interface ClusterMember {
  nodeId: string;
  address: string;
  live: boolean;
  fenced: boolean;
  checkError: string;
}

/** Where a replicated queue (replicas > 1) is kept: `primary` serves every partition
 * under `epoch` (one more with each election); `replicas`, every copy's node, the
 * primary included; `inSync`, the copies every acknowledged change is durable on;
 * writes need at least `minInSync` of them. `failoverBlocked`: why no live copy can
 * take over from a primary that is not live (asked with `clusterInfo({ checkMembers:
 * true })`; empty otherwise). `movingFrom` and `movingTo`: a move of a copy under way,
 * the node whose copy leaves and the node of the copy taking its place (empty when none). */
export interface ReplicaSet {
  primary: string;
  epoch: number;
  replicas: string[];
  inSync: string[];
  minInSync: number;
  failoverBlocked: string;
  movingFrom: string;
  movingTo: string;
}

/** A node's view of its cluster at catalog `revision` (a single server: one member,
 * `clustered` false). `homes[queue][p]` is the node id homing partition `p`;
 * `replicated` lists the replicated queues' copies (a queue of one copy is not in it). */
export interface ClusterView {
  clustered: boolean;
  nodeId: string;
  revision: number;
  members: ClusterMember[];
  homes: Record<string, string[]>;
  adminWritable: boolean;
  replicated: Record<string, ReplicaSet>;
}

/** A copy out of the in-sync set that a retire made its queue's primary (`retireNode(id,
 * { promoteCopiesBehind: true })`): every change acknowledged after its position
 * (`epoch`, `lsn`) is lost; `newEpoch` is the queue's epoch since. */
export interface PromotedCopy {
  queueName: string;
  nodeId: string;
  epoch: number;
  lsn: number;
  newEpoch: number;
}

/** What a retire did: partitions recreated empty (their items lost: a dead node's
 * partitions of queues of one copy, and every partition of a replicated queue re-made
 * empty because no live node kept a copy), copies of replicated queues made again from
 * their other copies (nothing lost), and the copies made primaries although behind. */
export interface RetiredNode {
  partitionsRecreated: number;
  copiesRecreated: number;
  copiesPromoted: PromotedCopy[];
}

/** One page of a listing; `nextPageToken` is empty on the last page. */
export interface Page<T> {
  items: T[];
  nextPageToken: string;
}
