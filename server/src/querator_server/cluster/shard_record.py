"""A replicated queue's shard as the catalog holds it: ``shards/<uid>`` in etcd.

A queue created with replicas R > 1 has one shard: all its partitions, kept in full
by each of R nodes under the queue's own name and the shard's uid. The record says
which copy is the primary (the only one that serves), under which epoch, which copies
exist, and which of them are in sync (the in-sync set, ISR: the copies every
acknowledged change is durable on). Each ISR entry names a copy by node and
incarnation (a random id the copy's storage made when it was created), so a node
whose disk was wiped comes back as another incarnation, outside the ISR.

The record has no lease: it outlives every node. Every change to it is a compare-
and-swap on its mod revision (shard_cas.py), so two writers that read one version
cannot both change it.

The uid is cluster-wide, from ``SHARD_UID_BASE`` up (a counter key in etcd): every
copy uses it as its local queue's storage uid, so item ids (``uid.partition.seq``)
held by workers stay valid on whichever copy is primary, and it never meets the uids
a data directory hands out to its own queues (1, 2, 3, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# Where cluster-wide shard uids start: far above any data directory's own counter.
SHARD_UID_BASE = 1 << 40

# An ISR entry whose copy has not yet said its incarnation: the empty copy each node
# makes when the queue is created. The primary replaces it with the copy's own
# incarnation (expand_isr) before it counts that copy's acknowledgements.
UNCLAIMED = ""


def default_min_in_sync(replicas: int) -> int:
    """The minimum in-sync count a queue of ``replicas`` copies gets when none is asked
    for: R - 1, at least 1 (R=2: 1, so one node loss keeps the queue writable; R=3: 2)."""
    return max(1, replicas - 1)


@dataclass(frozen=True, slots=True)
class ShardRecord:
    uid: int
    queue: str
    # The queue entry's create revision (the same Txn creates both keys, so it is also
    # this key's): which queue of that name the shard belongs to.
    generation: int
    epoch: int
    primary: str
    replicas: tuple[str, ...]  # every copy's node, the primary included
    isr: tuple[tuple[str, str], ...]  # (node, incarnation), the primary included
    min_isr: int
    mod_revision: int = 0  # of its etcd key; every change compares it

    def encode(self) -> bytes:
        return json.dumps(
            {
                "queue": self.queue,
                "generation": self.generation,
                "epoch": self.epoch,
                "primary": self.primary,
                "replicas": list(self.replicas),
                "isr": [list(entry) for entry in self.isr],
                "min_isr": self.min_isr,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, uid: int, data: bytes, mod_revision: int, create_revision: int) -> ShardRecord:
        doc = json.loads(data)
        return cls(
            uid=uid,
            queue=str(doc["queue"]),
            # 0 until a change rewrites it: the creating Txn cannot know its revision.
            generation=int(doc["generation"]) or create_revision,
            epoch=int(doc["epoch"]),
            primary=str(doc["primary"]),
            replicas=tuple(str(n) for n in doc["replicas"]),
            isr=tuple((str(node), str(incarnation)) for node, incarnation in doc["isr"]),
            min_isr=int(doc["min_isr"]),
            mod_revision=mod_revision,
        )

    def in_sync(self) -> tuple[str, ...]:
        """The nodes of the in-sync set, in its order."""
        return tuple(node for node, _ in self.isr)

    @classmethod
    def new(cls, uid: int, queue: str, copies: list[str], min_isr: int) -> ShardRecord:
        """The record of a new queue: epoch 1, ``copies[0]`` primary, every (empty)
        copy in sync and unclaimed."""
        return cls(uid, queue, 0, 1, copies[0], tuple(copies), tuple((n, UNCLAIMED) for n in copies), min_isr)
