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
class Move:
    """A move under way (copy_moves.py, move_finish.py): ``source``'s copy goes to
    ``target``, written in the compare-and-swap that adds the target's copy and gone
    with the one that drops either copy. ``lead``: the target is to serve (the moved
    copy was the primary's). ``by`` / ``by_revision``: the node running it and the
    create revision of its member key; ``until_us``: the wall-clock time (microseconds)
    by which that node is done with it. A move whose node is gone (not a member under
    that revision), that its node let go (``by`` empty) or past ``until_us`` is no
    longer in progress: the queue's primary finishes it, or undoes it."""

    source: str
    target: str
    lead: bool
    by: str
    by_revision: int
    until_us: int

    def encode(self) -> dict[str, object]:
        return {
            "source": self.source,
            "target": self.target,
            "lead": self.lead,
            "by": self.by,
            "by_revision": self.by_revision,
            "until_us": self.until_us,
        }

    @classmethod
    def decode(cls, doc: dict[str, object]) -> Move:
        return cls(
            source=str(doc["source"]),
            target=str(doc["target"]),
            lead=bool(doc["lead"]),
            by=str(doc["by"]),
            by_revision=int(str(doc["by_revision"])),
            until_us=int(str(doc["until_us"])),
        )


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
    move: Move | None = None  # a move under way (absent from the key when None)

    def encode(self) -> bytes:
        doc: dict[str, object] = {
            "queue": self.queue,
            "generation": self.generation,
            "epoch": self.epoch,
            "primary": self.primary,
            "replicas": list(self.replicas),
            "isr": [list(entry) for entry in self.isr],
            "min_isr": self.min_isr,
        }
        if self.move is not None:
            doc["move"] = self.move.encode()
        return json.dumps(doc, sort_keys=True).encode()

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
            move=Move.decode(doc["move"]) if doc.get("move") else None,
        )

    def in_sync(self) -> tuple[str, ...]:
        """The nodes of the in-sync set, in its order."""
        return tuple(node for node, _ in self.isr)

    def claimed_in_sync(self, node: str) -> bool:
        """Whether ``node``'s copy is in the in-sync set under its own incarnation (the
        primary caught it up and counts its acknowledgements)."""
        return any(n == node and incarnation for n, incarnation in self.isr)

    @classmethod
    def new(cls, uid: int, queue: str, copies: list[str], min_isr: int) -> ShardRecord:
        """The record of a new queue: epoch 1, ``copies[0]`` primary, every (empty)
        copy in sync and unclaimed."""
        return cls(uid, queue, 0, 1, copies[0], tuple(copies), tuple((n, UNCLAIMED) for n in copies), min_isr)
