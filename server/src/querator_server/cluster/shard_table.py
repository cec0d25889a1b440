"""The shard records (shard_record.py) as this node's catalog cache holds them, and
the changes a node makes to them (shard_cas.py).

The cache follows the catalog's watch like queue entries do, so routing reads it with
no etcd call; a change is made against the version the caller read and answers the
version written, or raises ``Deposed`` (another writer won) or ``BelowMinIsr``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from . import shard_cas
from .etcd import Etcd, KeyValue
from .shard_cas import BelowMinIsr, Deposed, Writer
from .shard_record import Move, ShardRecord

__all__ = ["BelowMinIsr", "Deposed", "ShardGauges", "ShardRecord", "ShardTable", "Writer"]


class ShardGauges(NamedTuple):
    """One replicated queue as a node's metrics show it."""

    queue: str
    epoch: int
    in_sync: int
    min_in_sync: int
    primary: bool  # this node is the primary
    elections: int  # elections this node has seen since it started


class ShardTable:
    def __init__(self, etcd: Etcd, prefix: bytes, writer: Writer | None = None) -> None:
        self._etcd = etcd
        self._prefix = prefix
        # Who changes records from this node (its membership); set by the coordinator.
        self.writer = writer
        self._records: dict[int, ShardRecord] = {}
        self._by_queue: dict[str, int] = {}
        # Elections this node has seen per shard (each epoch a record moved past the one
        # held before counts one), and the epoch last seen; kept across a re-list.
        self.elections: dict[int, int] = {}
        self._epochs: dict[int, int] = {}

    def key(self, uid: int) -> bytes:
        return self._prefix + b"shards/" + str(uid).encode()

    @property
    def counter_key(self) -> bytes:
        """The next shard uid to hand out (shard_cas.next_uid)."""
        return self._prefix + b"next-shard-uid"

    # -- the cache (fed by the catalog's watch) -----------------------------------------

    def apply(self, uid: int, kv: KeyValue, deleted: bool) -> None:
        old = self._records.pop(uid, None)
        if old is not None and self._by_queue.get(old.queue) == uid:
            del self._by_queue[old.queue]
        if deleted:
            self.elections.pop(uid, None)
            self._epochs.pop(uid, None)
            return
        record = ShardRecord.decode(uid, kv.value, kv.mod_revision, kv.create_revision)
        self._records[uid] = record
        self._by_queue[record.queue] = uid
        seen = self._epochs.get(uid)
        if seen is not None and record.epoch > seen:
            self.elections[uid] = self.elections.get(uid, 0) + record.epoch - seen
        self._epochs[uid] = max(record.epoch, seen or 0)

    def clear(self) -> None:
        """Before a re-list: the records go (deleted ones must not linger); the epochs
        seen stay, so an election made meanwhile still counts."""
        self._records.clear()
        self._by_queue.clear()

    def prune(self) -> None:
        """After a re-list: forget the elections of shards that are gone."""
        for uid in [u for u in self._epochs if u not in self._records]:
            self._epochs.pop(uid, None)
            self.elections.pop(uid, None)

    def gauges(self, node: str) -> list[ShardGauges]:
        """What ``node``'s metrics say of each shard it keeps a copy of."""
        return [
            ShardGauges(r.queue, r.epoch, len(r.isr), r.min_isr, r.primary == node, self.elections.get(r.uid, 0))
            for r in self._records.values()
            if node in r.replicas
        ]

    def get(self, uid: int) -> ShardRecord | None:
        return self._records.get(uid)

    def of_queue(self, name: str) -> ShardRecord | None:
        uid = self._by_queue.get(name)
        return None if uid is None else self._records.get(uid)

    def records(self) -> list[ShardRecord]:
        return list(self._records.values())

    # -- changes (each a CAS in etcd) ---------------------------------------------------

    async def fetch(self, uid: int) -> ShardRecord | None:
        """The record as etcd holds it now (after an Unavailable of unknown outcome)."""
        return await shard_cas.read(self._etcd, self.key(uid), uid)

    async def _swap(self, old: ShardRecord, new: ShardRecord, absent: bytes | None = None) -> ShardRecord:
        writer = self._writer()
        member = self._prefix + b"members/" + writer.node.encode()
        return await shard_cas.swap(self._etcd, self.key(old.uid), member, writer, old, new, absent)

    def _writer(self) -> Writer:
        if self.writer is None:
            raise RuntimeError("the shard table has no writer")
        return self.writer

    async def shrink_isr(self, record: ShardRecord, drop: str) -> ShardRecord:
        """Drop node ``drop`` from the ISR (the primary, when a copy stopped answering);
        refused below ``min_isr`` (BelowMinIsr)."""
        return await self._swap(record, shard_cas.shrunk(record, drop))

    async def expand_isr(self, record: ShardRecord, add: tuple[str, str]) -> ShardRecord:
        """Count copy ``add`` = (node, incarnation) in the ISR (caught up, or claiming its
        entry with its incarnation)."""
        return await self._swap(record, shard_cas.expanded(record, add))

    async def elect(
        self, record: ShardRecord, primary: str, isr: Sequence[tuple[str, str]], primary_gone: bool = False
    ) -> ShardRecord:
        """Epoch + 1 with ``primary`` serving and ``isr`` in sync. ``primary_gone``: only
        while the record's primary holds no membership (a failover): one that registered
        again meanwhile may be acknowledging under its own epoch, which its membership
        lease lets it do only while no failover can have happened (shipper.py)."""
        absent = self._prefix + b"members/" + record.primary.encode() if primary_gone else None
        return await self._swap(record, shard_cas.elected(record, primary, isr), absent)

    async def drop_copy(self, record: ShardRecord, node: str) -> ShardRecord:
        """Remove ``node``'s copy (a node retired for good); never the primary's."""
        return await self._swap(record, shard_cas.without_copy(record, node))

    async def add_copy(self, record: ShardRecord, node: str, move: Move | None = None) -> ShardRecord:
        """Add an empty copy on ``node`` (out of the ISR until the primary caught it up);
        ``move``: the move it is the target of."""
        return await self._swap(record, shard_cas.with_copy(record, node, move))

    async def let_go(self, record: ShardRecord) -> ShardRecord:
        """Leave the record's move to the queue's primary (its node stopped running it)."""
        if record.move is None:
            raise ValueError(f"shard {record.uid}: no move under way")
        return await self._swap(record, dataclasses.replace(record, move=dataclasses.replace(record.move, by="")))

    async def raise_min_isr(self, record: ShardRecord, min_isr: int) -> ShardRecord:
        """Raise the minimum back (a retire capped it at the copies left), once the
        in-sync set holds that many claimed copies again."""
        claimed = sum(1 for _, incarnation in record.isr if incarnation)
        if not record.min_isr < min_isr <= claimed:
            raise ValueError(f"shard {record.uid}: a minimum of {min_isr} needs that many claimed in-sync copies ({claimed})")
        return await self._swap(record, dataclasses.replace(record, min_isr=min_isr))

    async def next_uid(self) -> int:
        return await shard_cas.next_uid(self._etcd, self.counter_key)
