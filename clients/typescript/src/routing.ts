/**
 * Where each call goes in a cluster: the map read from ClusterInfo (members, each
 * queue's partition homes, at a catalog revision), which nodes are down, and what is
 * waiting on each node. No I/O here: the Client asks ClusterInfo and GetQueueStats and
 * feeds the answers in; this decides. The rules are those of docs/typescript.md § Clusters.
 *
 * - Produce goes to a live node homing partitions of the queue, weighted by how many it
 *   homes and against the items waiting there per partition (the node then spreads the
 *   batch over its own partitions), so producers fill the emptiest nodes first.
 * - Lease goes to a node whose partitions have ready items, weighted by them; with none
 *   known, it stays on one node until a Lease comes back empty, then moves on, so no
 *   consumer keeps asking an empty node while another holds ready items.
 * - A call with a key goes to the key's home: a Produce by its first item's idempotency
 *   key, a Lease by its lease key, a Complete or Extend by lease keys alone by its first
 *   key (that node sends the other keys to their homes). A key's home is
 *   `homes[crc32(key) % keyPartitions]` (the partition count at creation: adding
 *   partitions never moves a key).
 * - Complete, Retry, Extend and the storage calls about one partition go to
 *   `homes[partition]`, the only node that can serve them without a hop; a Lease
 *   completing items goes to their home.
 * - The cases of testdata/routing/cases.json pin these rules for the server and both
 *   clients alike (test/routing_table.test.ts).
 * - A node that fails is skipped for backoff (0.5 s doubling to 10 s), then tried again.
 */
import * as zlib from "node:zlib";

// zlib.crc32 came with Node 20.15; before it, keyed calls go to any node, which forwards
// them to the key's home (one hop).
const crc32 = (zlib as { crc32?: (data: Uint8Array) => number }).crc32;

/** What the client logs through: `console` fits. Every method optional. */
export interface Logger {
  debug?(message: string): void;
  info?(message: string): void;
  warn?(message: string): void;
  error?(message: string): void;
}

/** The parts of a ClusterInfoResponse routing uses. */
export interface ClusterAnswer {
  clustered: boolean;
  revision: bigint;
  members: readonly { nodeId: string; address: string; live: boolean }[];
  queues: readonly { queueName: string; homes: readonly string[]; keyPartitions?: number }[];
}

/** Where a call goes: any node, by the counts (produce, lease), a partition's home, or a key's home. */
export type Target =
  | { to: "any" }
  | { to: "produce"; queue: string }
  | { to: "lease"; queue: string }
  | { to: "home"; queue: string; partition: number }
  | { to: "key"; queue: string; key: string };

/** The fields of a request that say where it goes. */
export interface RoutedRequest {
  queueName?: string;
  partition?: number;
  ids?: readonly string[];
  items?: readonly ({ idempotencyKey?: string; groupKey?: string } | object)[];
  leaseKey?: string;
  leaseKeys?: readonly string[];
  completeIds?: readonly string[];
  completePartition?: number;
}

/** The calls about one partition: to its home. */
const HOME_CALLS = new Set(["Complete", "Retry", "Extend", "ListItems", "ListScheduledItems", "ImportItems", "DeleteItems"]);

/** Where a `method` call with `request` goes (the rules at the top of this file). */
export function targetOf(method: string, request: RoutedRequest): Target {
  const queue = request.queueName ?? "";
  if (method === "Produce") {
    // A group lives at its key's home (the server refuses groups of two homes); else
    // dedup is exact at the first idempotency key's home.
    const group = request.items?.map((i) => ("groupKey" in i ? i.groupKey : "")).find(Boolean);
    const key = group || request.items?.map((i) => ("idempotencyKey" in i ? i.idempotencyKey : "")).find(Boolean);
    return key ? { to: "key", queue, key } : { to: "produce", queue };
  }
  if (method === "Lease") {
    if (request.leaseKey) return { to: "key", queue, key: request.leaseKey };
    if (request.completeIds?.length) return { to: "home", queue, partition: request.completePartition ?? 0 };
    return { to: "lease", queue };
  }
  if (HOME_CALLS.has(method)) {
    const byKeys = request.leaseKeys?.length && !(request.ids?.length || request.items?.length);
    return byKeys ? { to: "key", queue, key: request.leaseKeys![0]! } : { to: "home", queue, partition: request.partition ?? 0 };
  }
  return { to: "any" };
}

/** Node backoff after a failure: doubling from the first to the cap. */
export const DOWN_FIRST_MS = 500;
export const DOWN_CAP_MS = 10_000;
/** Counts of a queue's partitions are asked at most this often while the queue is used. */
export const STATS_EVERY_MS = 1000;
/** A queue the cluster did not know is asked about again after this long. */
const ABSENT_RECHECK_MS = 1000;

interface Placement {
  homes: readonly string[];
  revision: bigint;
  /** The partitions keys are spread over (the count at creation). */
  keyPartitions: number;
}

interface Down {
  until: number;
  delayMs: number;
}

/** What is waiting on one node's partitions of a queue, as last counted, plus what this
 * client sent (produced) or took (leased) there since. */
interface NodeLoad {
  partitions: number;
  ready: number;
}

interface QueueLoad {
  countedAt: number;
  nodes: Map<string, NodeLoad>;
  /** The node Leases stick to while it has items (when the counts show none anywhere). */
  leaseTurn: number;
}

/** The partition a key (idempotency or lease key) belongs to, as the server computes it
 * (undefined on a Node without zlib.crc32). */
export function keyPartition(key: string, partitions: number): number | undefined {
  return crc32 ? crc32(Buffer.from(key, "utf8")) % partitions : undefined;
}

function weightedPick<T>(entries: readonly [T, number][], random: number): T | undefined {
  const total = entries.reduce((sum, [, w]) => sum + w, 0);
  if (!(total > 0)) return undefined;
  let point = random * total;
  for (const [value, weight] of entries) {
    point -= weight;
    if (point < 0) return value;
  }
  return entries[entries.length - 1]?.[0];
}

export class ClusterMap {
  /** undefined until the first answer; false for a single server. */
  clustered: boolean | undefined;
  /** The highest revision of the members list applied. */
  revision = -1n;
  readonly #members = new Map<string, { address: string; live: boolean }>();
  readonly #placements = new Map<string, Placement>();
  readonly #absent = new Map<string, number>();
  readonly #down = new Map<string, Down>();
  readonly #queueDown = new Map<string, Down>();
  readonly #loads = new Map<string, QueueLoad>();
  readonly #logger: Logger | undefined;

  constructor(logger?: Logger) {
    this.#logger = logger;
  }

  /**
   * Take a ClusterInfo answer (asked for `asked` queues, or all when undefined). A view
   * older than the one held is ignored, whole (members) and per queue. Returns the
   * addresses that are no longer members, whose channels can be closed.
   */
  apply(answer: ClusterAnswer, asked: readonly string[] | undefined, now: number): string[] {
    this.clustered = answer.clustered;
    if (!answer.clustered) return [];
    const gone: string[] = [];
    if (answer.revision >= this.revision) {
      this.revision = answer.revision;
      const before = new Set([...this.#members.values()].map((m) => m.address));
      this.#members.clear();
      for (const m of answer.members) this.#members.set(m.nodeId, { address: m.address, live: m.live });
      const after = new Set([...this.#members.values()].map((m) => m.address));
      for (const address of before) if (address && !after.has(address)) gone.push(address);
    }
    const seen = new Set<string>();
    for (const q of answer.queues) {
      seen.add(q.queueName);
      this.#absent.delete(q.queueName);
      const held = this.#placements.get(q.queueName);
      if (held && held.revision > answer.revision) continue;
      // 0 from a server before the field: every partition.
      this.#placements.set(q.queueName, { homes: [...q.homes], revision: answer.revision, keyPartitions: q.keyPartitions || q.homes.length });
    }
    for (const name of asked ?? [...this.#placements.keys()]) {
      if (seen.has(name)) continue;
      const held = this.#placements.get(name);
      if (held && held.revision > answer.revision) continue;
      this.#placements.delete(name);
      this.#loads.delete(name);
      this.#absent.set(name, now);
    }
    return gone;
  }

  /** Whether ClusterInfo should be asked about `queue` before routing a call for it. */
  needsLookup(queue: string, now: number): boolean {
    if (this.#placements.has(queue)) return false;
    const checked = this.#absent.get(queue);
    return checked === undefined || now - checked >= ABSENT_RECHECK_MS;
  }

  /** The queues this map places (asked again on each periodic refresh). */
  queues(): string[] {
    return [...this.#placements.keys()];
  }

  homes(queue: string): readonly string[] | undefined {
    return this.#placements.get(queue)?.homes;
  }

  /** The address of a member that is live by the map (empty when unknown or not live). */
  address(node: string): string {
    const m = this.#members.get(node);
    return m && m.live ? m.address : "";
  }

  /** Every live member's address, for calls any node can answer, nodes not down first. */
  liveAddresses(now: number): string[] {
    const up: string[] = [];
    const down: string[] = [];
    for (const [node, m] of this.#members) {
      if (!m.live || !m.address) continue;
      (this.isDown(node, now) ? down : up).push(m.address);
    }
    return [...up, ...down];
  }

  /** Whether every member is live by the map. */
  allLive(): boolean {
    for (const m of this.#members.values()) if (!m.live) return false;
    return true;
  }

  nodeAt(address: string): string | undefined {
    for (const [node, m] of this.#members) if (m.address === address) return node;
    return undefined;
  }

  // -- nodes that fail -----------------------------------------------------------------

  isDown(node: string, now: number): boolean {
    const d = this.#down.get(node);
    return d !== undefined && now < d.until;
  }

  /** A call to `node` failed for want of the node: skip it for a while (longer each time
   * it fails again). Logged once, when the node goes from up to down. */
  markDown(node: string, now: number, reason: string): void {
    const d = this.#down.get(node);
    if (d === undefined) {
      this.#down.set(node, { until: now + DOWN_FIRST_MS, delayMs: DOWN_FIRST_MS });
      this.#logger?.warn?.(`querator: node ${node} is down (${reason}); its partitions are skipped until it answers again`);
    } else if (now >= d.until) {
      const delayMs = Math.min(d.delayMs * 2, DOWN_CAP_MS);
      this.#down.set(node, { until: now + delayMs, delayMs });
    }
  }

  /** `node` answered UNAVAILABLE about `queue` (its storage failing, its partitions
   * faulty): leave it out of that queue's Produce and Lease for a while, not logged as
   * the node going down. */
  markQueueDown(queue: string, node: string, now: number): void {
    const key = `${queue}\0${node}`;
    const d = this.#queueDown.get(key);
    const delayMs = d === undefined ? DOWN_FIRST_MS : now >= d.until ? Math.min(d.delayMs * 2, DOWN_CAP_MS) : d.delayMs;
    this.#queueDown.set(key, { until: Math.max(d?.until ?? 0, now + delayMs), delayMs });
  }

  /** A call to `node` succeeded. */
  markUp(node: string): void {
    if (this.#down.delete(node)) this.#logger?.info?.(`querator: node ${node} answers again`);
  }

  #usable(node: string, now: number): boolean {
    return this.address(node) !== "" && !this.isDown(node, now);
  }

  // -- choosing nodes --------------------------------------------------------------------

  /** The node homing `partition` of `queue` (whether up or not), undefined when unknown. */
  home(queue: string, partition: number): string | undefined {
    const homes = this.homes(queue);
    return homes && partition >= 0 && partition < homes.length ? homes[partition] : undefined;
  }

  /** The node homing a key's partition. */
  keyHome(queue: string, key: string): string | undefined {
    const placement = this.#placements.get(queue);
    const partition = placement && placement.homes.length ? keyPartition(key, placement.keyPartitions) : undefined;
    return partition === undefined ? undefined : placement!.homes[partition];
  }

  /** The node a call for `target` goes to now ("" for any node; a home whether up or not). */
  nodeFor(target: Target, now: number, random = Math.random()): string {
    switch (target.to) {
      case "any":
        return "";
      case "home":
        return this.home(target.queue, target.partition) ?? "";
      case "key":
        return this.keyHome(target.queue, target.key) ?? "";
      case "produce":
        return this.produceNode(target.queue, now, random) ?? "";
      case "lease":
        return this.leaseNode(target.queue, now, random) ?? "";
    }
  }

  /** The usable nodes homing partitions of `queue`, with how many each homes. */
  #homing(queue: string, now: number): Map<string, number> {
    const out = new Map<string, number>();
    for (const node of this.homes(queue) ?? []) {
      if (this.#usable(node, now)) out.set(node, (out.get(node) ?? 0) + 1);
    }
    if (this.#queueDown.size && out.size > 1) {
      for (const node of [...out.keys()]) {
        const d = this.#queueDown.get(`${queue}\0${node}`);
        if (d && now < d.until && out.size > 1) out.delete(node);
      }
    }
    return out;
  }

  /** Where a Produce of `queue` goes: weighted by partitions, against the items already
   * waiting per partition. undefined when no usable node homes any. */
  produceNode(queue: string, now: number, random = Math.random()): string | undefined {
    const homing = this.#homing(queue, now);
    if (homing.size === 0) return undefined;
    const load = this.#loads.get(queue);
    const perPartition = new Map<string, number>();
    for (const [node, partitions] of homing) {
      const counted = load?.nodes.get(node);
      perPartition.set(node, counted && counted.partitions ? counted.ready / counted.partitions : 0);
    }
    const mean = [...perPartition.values()].reduce((a, b) => a + b, 0) / perPartition.size;
    // A node holding the mean gets its share by partitions; one holding ten times the
    // mean about a tenth of it; an empty one up to (mean + 1) times it.
    const entries: [string, number][] = [...homing].map(([node, partitions]) => [
      node,
      (partitions * (mean + 1)) / ((perPartition.get(node) ?? 0) + 1),
    ]);
    return weightedPick(entries, random);
  }

  /** Where a Lease of `queue` goes: a node whose partitions hold ready items (weighted by
   * them), else the node of the queue's turn. */
  leaseNode(queue: string, now: number, random = Math.random()): string | undefined {
    const homing = this.#homing(queue, now);
    if (homing.size === 0) return undefined;
    const load = this.#loads.get(queue);
    if (load) {
      const entries: [string, number][] = [...homing.keys()].map((node) => [node, Math.max(0, load.nodes.get(node)?.ready ?? 0)]);
      const picked = weightedPick(entries, random);
      if (picked !== undefined) return picked;
    }
    const nodes = [...homing.keys()].sort();
    return nodes[(load?.leaseTurn ?? 0) % nodes.length];
  }

  // -- what is waiting -----------------------------------------------------------------

  /** Whether the queue's counts are due for a refresh (at most once a second, and only
   * in a cluster with more than one node homing the queue: otherwise there is no choice). */
  statsDue(queue: string, now: number): boolean {
    const homes = this.homes(queue);
    if (!homes || new Set(homes).size < 2) return false;
    const load = this.#loads.get(queue);
    return load === undefined || now - load.countedAt >= STATS_EVERY_MS;
  }

  /** Whether the queue's partitions were counted at least once. */
  counted(queue: string): boolean {
    return (this.#loads.get(queue)?.nodes.size ?? 0) > 0;
  }

  /** Mark a count in flight, so concurrent callers do not ask again. */
  statsAsked(queue: string, now: number): void {
    this.#load(queue).countedAt = now;
  }

  #load(queue: string): QueueLoad {
    let load = this.#loads.get(queue);
    if (!load) this.#loads.set(queue, (load = { countedAt: -Infinity, nodes: new Map(), leaseTurn: 0 }));
    return load;
  }

  /** GetQueueStats' per-partition ready counts (cluster-wide partition numbers). */
  applyStats(queue: string, partitions: readonly { partition: number; ready: number }[], now: number): void {
    const homes = this.homes(queue);
    if (!homes) return;
    const load = this.#load(queue);
    load.countedAt = now;
    load.nodes.clear();
    for (const p of partitions) {
      const node = homes[p.partition];
      if (node === undefined) continue;
      const entry = load.nodes.get(node) ?? { partitions: 0, ready: 0 };
      entry.partitions++;
      entry.ready += p.ready;
      load.nodes.set(node, entry);
    }
  }

  /** `count` items were produced on `node`: they wait there now. */
  produced(queue: string, node: string, count: number): void {
    const entry = this.#loads.get(queue)?.nodes.get(node);
    if (entry) entry.ready += count;
  }

  /** A Lease on `node` answered `count` items (0: it found none, so the next Lease of
   * this queue goes to another node). */
  leased(queue: string, node: string, count: number): void {
    const load = this.#load(queue);
    const entry = load.nodes.get(node);
    if (entry) entry.ready = count === 0 ? 0 : Math.max(0, entry.ready - count);
    if (count === 0) {
      const nodes = [...new Set(this.homes(queue) ?? [])].sort();
      const at = nodes.indexOf(node);
      if (at >= 0 && nodes[load.leaseTurn % nodes.length] === node) load.leaseTurn = at + 1;
    }
  }
}
