"""Where a queue's partitions live: the catalog entry of a queue and its placement.

A partition's home is the node whose local LMDB holds it, named in the catalog as
(node id, local index): the node keeps the queue as a local queue whose partition
``local index`` is that global partition. Local indexes of a node only grow (a new
partition takes the next free one), so the partitions a node already holds never
change index when partitions are added or a retired node's are recreated.

Where a keyed request goes (an idempotency key, a lease key) is ``home_of_key``: the
key's partition is ``crc32(key) % key_partitions``, where ``key_partitions`` is the
partition count the queue was created with, recorded in its entry and never changed.
Not the current count: dedup is a check-then-store that is exact only in one node's
LMDB transaction, so a key must reach the same home for as long as the queue keeps
it; a count that grows with UpdateQueue sent a key produced again after the update to
another home, which stored it twice. Looking in every home a key could have had
within the dedup window would need a cross-node check that races with a produce
still arriving at the old home. The price: keyed requests use the partitions the
queue was created with (their homes spread them over their own partitions).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..model import QueueConfig

# QueueConfig fields that belong to the cluster-wide queue; uid and group say where
# one node keeps its part and are the node's own.
SHARED_FIELDS = (
    "dead_queue",
    "reference",
    "lease_timeout_us",
    "expire_timeout_us",
    "max_attempts",
    "created_at_us",
    "updated_at_us",
    "dedup_window_us",
    "lease_key_ttl_us",
    "paused",
    "produce_paused",
)
# Shared fields an entry holds only when set (true), so that an entry of a queue never
# paused reads the same to a node from before pausing existed.
_WRITTEN_WHEN_SET = frozenset({"paused", "produce_paused"})


# The reference of a node's local copy of a cluster queue starts with this.
GENERATION_MARK = "cluster-generation:"


@dataclass(frozen=True, slots=True)
class Home:
    node: str
    index: int  # the partition's index in the node's local queue


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """A queue as the catalog holds it: its settings and each partition's home."""

    config: QueueConfig  # partitions == len(homes); uid and group unset
    homes: tuple[Home, ...]
    # The span of keyed requests' partitions (module docstring): the partition count
    # at creation. Change homes with dataclasses.replace, which keeps it.
    key_partitions: int
    mod_revision: int = 0  # of its etcd key; updates compare it
    # The create revision of its etcd key: tells this queue from an earlier one of the
    # same name (deleted while a node was away), whose local copy must not be reused.
    generation: int = 0
    # A replicated queue (config.replicas > 1): the uid of its one shard
    # (shard_record.py), whose record names the primary homing every partition (at
    # local index = partition on every copy). 0: one copy, homes as placed.
    shard: int = 0
    # A replicated queue as routed (served_by): its primary's epoch, which a "not
    # primary" answer names so that a client can tell a newer map from an older one.
    epoch: int = 0

    @property
    def local_reference(self) -> str:
        """What a node's local copy of the queue holds as its reference (never shown:
        API answers come from the catalog): the generation it belongs to."""
        return f"{GENERATION_MARK}{self.generation}"

    def encode(self) -> bytes:
        settings = {
            field: getattr(self.config, field)
            for field in SHARED_FIELDS
            if field not in _WRITTEN_WHEN_SET or getattr(self.config, field)
        }
        doc: dict[str, object] = {
            "settings": settings,
            "homes": [[h.node, h.index] for h in self.homes],
            "key_partitions": self.key_partitions,
        }
        if self.shard:  # absent for one copy: such entries read as before replication
            doc.update(replicas=self.config.replicas, min_isr=self.config.min_in_sync, shard=self.shard)
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, name: str, data: bytes, mod_revision: int, generation: int) -> QueueEntry:
        doc = json.loads(data)
        homes = tuple(Home(str(node), int(index)) for node, index in doc["homes"])
        config = QueueConfig(
            name=name,
            partitions=len(homes),
            replicas=int(doc.get("replicas", 1)),
            min_in_sync=int(doc.get("min_isr", 0)),
        ).replace(**doc["settings"])
        # An entry written before key_partitions was recorded: its keys went by the count
        # it had then, the current one.
        key_partitions = int(doc.get("key_partitions") or len(homes))
        return cls(config, homes, key_partitions, mod_revision, generation, int(doc.get("shard", 0)))

    def served_by(self, primary: str, epoch: int) -> QueueEntry:
        """A replicated queue's entry with every partition homed at ``primary`` under
        ``epoch`` (its shard record's): where its calls go. The catalog keeps the
        placement-time homes; routing always reads them through the record."""
        homes = tuple(Home(primary, p) for p in range(len(self.homes)))
        return dataclasses.replace(self, homes=homes, epoch=epoch)

    def home_of(self, partition: int) -> Home:
        """The home of cluster-wide ``partition`` (policy.py checks the range first)."""
        return self.homes[partition]

    def key_partition(self, key: str) -> int:
        """The partition a keyed request (idempotency or lease key) belongs to; the
        same for as long as the queue exists (module docstring)."""
        return key_partition(key, self.key_partitions)

    def home_of_key(self, key: str) -> Home:
        return self.homes[self.key_partition(key)]

    def local_partitions(self, node: str) -> dict[int, int]:
        """``node``'s local index -> global partition, for the partitions it homes."""
        return {h.index: p for p, h in enumerate(self.homes) if h.node == node}

    def local_count(self, node: str) -> int:
        """How many partitions ``node``'s local queue needs (its highest index + 1)."""
        return max((h.index + 1 for h in self.homes if h.node == node), default=0)

    def nodes(self) -> list[str]:
        return sorted({h.node for h in self.homes})


def place(count: int, live: Sequence[str], existing: Iterable[Home] = (), load: Mapping[str, int] | None = None) -> list[Home]:
    """Homes for ``count`` new partitions over the ``live`` nodes.

    Each goes to the live node holding the fewest partitions of the queue so far, so a
    queue with at least as many partitions as nodes has some on every node, and
    partitions added later even it out. Ties go to the node homing the fewest partitions
    of all queues (``load``), then node id order: without that, every queue of one
    partition landed on the same node and a second node carried none of their work.
    """
    if not live:
        raise ValueError("no live node to place partitions on")
    existing = list(existing)
    load = Counter(load or {})
    held = Counter(h.node for h in existing)
    next_index: dict[str, int] = {}
    for h in existing:
        next_index[h.node] = max(next_index.get(h.node, 0), h.index + 1)
    out: list[Home] = []
    for _ in range(count):
        node = min(sorted(live), key=lambda n: (held[n], load[n]))
        index = next_index.get(node, 0)
        out.append(Home(node, index))
        held[node] += 1
        load[node] += 1
        next_index[node] = index + 1
    return out


def place_shard(replicas: int, live: Sequence[str], primaries: Mapping[str, int], copies: Mapping[str, int]) -> list[str]:
    """The nodes of a new replicated queue's copies, its primary first.

    The primary goes to the live node serving the fewest primaries (``primaries``:
    replicated queues it is primary of, plus partitions of one copy it homes, each of
    which it serves alone), then the one with the fewest copies; the other copies to
    the ``replicas - 1`` next least loaded distinct live nodes, by copies held, then
    primaries. Ties: node id order.
    """
    if len(live) < replicas:
        raise ValueError(f"{replicas} copies need {replicas} live nodes, {len(live)} live")
    nodes = sorted(live)
    primary = min(nodes, key=lambda n: (primaries.get(n, 0), copies.get(n, 0)))
    rest = sorted((n for n in nodes if n != primary), key=lambda n: (copies.get(n, 0), primaries.get(n, 0)))
    return [primary, *rest[: replicas - 1]]


def key_partition(key: str, partitions: int) -> int:
    """``key``'s partition among ``partitions`` (QueueEntry.key_partition gives the count).

    crc32 of the UTF-8 bytes, not hash(): every node and client must pick the same one.
    """
    return zlib.crc32(key.encode()) % partitions
