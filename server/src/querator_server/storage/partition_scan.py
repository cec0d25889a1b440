"""Reads and writes of a whole partition: the scan that rebuilds the actor's view of
it at start (and when a faulty partition works again), clearing it (PurgeQueue), the
listing pages of its items and scheduled items, and the created_at of its ready head
(for the metrics)."""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import Any

import lmdb

from . import lease_records, ordered_groups
from .due_records import DueRecords
from .lease_records import LeaseRecord
from .outboxes import Outboxes
from .record import (
    _FLAG_HISTORY,
    _FLAG_LEASED,
    _HEADER,
    TAG_GROUP_HEAD,
    TAG_ITEM,
    TAG_PRIORITY,
    TAG_SCHEDULED,
    TAG_WAITING,
    Item,
    expiry_key,
    group_of,
    grouped,
    item_key,
    parse_scheduled_key,
    priority_key,
    read_state,
    scheduled_key,
    seq_of_item_key,
    source_key,
)

# The largest seq or time a key can hold (8 bytes, unsigned).
_LAST_KEY = (1 << 64) - 1


@dataclass(slots=True)
class PartitionScan:
    """What a full read of a partition finds: the basis of the actor's counters."""

    ready: int = 0
    leased: int = 0
    scheduled: int = 0
    created_sum: int = 0
    leased_at_sum: int = 0
    next_seq: int = 1
    first_ready_seq: int = 0
    leases: list[tuple[int, int]] = field(default_factory=list)  # (deadline, seq)
    first_due: int = 0
    first_expiry: int = 0
    # Ordered groups: items waiting behind their group's head (their created_at are in
    # created_sum), and groups whose head is leased.
    waiting: int = 0
    groups_in_flight: int = 0
    # Entries of the priority index (ready items of priority 1 to 9).
    ranked: int = 0
    # The open lease records (lease_records.py).
    lease_records: list[LeaseRecord] = field(default_factory=list)


class PartitionScans(DueRecords, Outboxes):
    def ready_heads(self, starts: Iterable[tuple[int, int, Container[int]]]) -> dict[int, int | None]:
        """For each (partition, seq, seqs held by lease records): created_at (us) of its
        first ready item at or after that seq (0: none), or None when more than
        ``HEAD_SCAN_LIMIT`` leased items come first. One read transaction; for the
        metrics' oldest-ready age."""
        out: dict[int, int | None] = {}
        with self.env.begin() as txn:
            for p, from_seq, held in starts:
                out[p] = _ready_head(txn.cursor(db=self.db(p)), from_seq, held)
        return out

    def page_items(self, txn: lmdb.Transaction[bytes], p: int, after_seq: int, limit: int) -> list[tuple[int, Item]]:
        cursor = txn.cursor(db=self._dbs[p])
        out: list[tuple[int, Item]] = []
        if not 0 <= after_seq < _LAST_KEY or not cursor.set_range(item_key(after_seq + 1)):
            return out
        for key, raw in cursor:
            if key[:1] != TAG_ITEM or len(out) >= limit:
                break
            out.append((seq_of_item_key(key), Item.decode(raw)))
        return out

    def page_scheduled(
        self, txn: lmdb.Transaction[bytes], p: int, after: tuple[int, int], limit: int
    ) -> list[tuple[int, int, Item]]:
        cursor = txn.cursor(db=self._dbs[p])
        out: list[tuple[int, int, Item]] = []
        due, seq = after
        if not (0 <= due <= _LAST_KEY and -1 <= seq < _LAST_KEY) or not cursor.set_range(scheduled_key(due, seq + 1)):
            return out
        for key, raw in cursor:
            if key[:1] != TAG_SCHEDULED or len(out) >= limit:
                break
            d, s = parse_scheduled_key(key)
            out.append((d, s, Item.decode(raw)))
        return out

    # -- whole-partition operations ------------------------------------------------

    def clear(self, txn: lmdb.Transaction[bytes], p: int, *, ready: bool, leased: bool, scheduled: bool) -> list[int]:
        """Delete the chosen kinds of items; return the seqs of deleted leased items.
        Lease records are written out first, so their items are leased ones here."""
        db = self._dbs[p]
        for record in lease_records.read_all(txn, db):
            lease_records.write_out(txn, db, record)
        removed_leases: list[int] = []
        cursor = txn.cursor(db=db)
        doomed: list[bytes] = []
        runs: list[tuple[int, int]] = []
        if ready or leased:
            if cursor.set_range(TAG_ITEM):
                for key, raw in cursor:
                    if key[:1] != TAG_ITEM:
                        break
                    is_leased = bool(raw[0] & 1)
                    if (is_leased and leased) or (not is_leased and ready):
                        doomed.append(key)
                        doomed.extend(self._index_keys(key, raw, db, txn, runs))
                        if is_leased:
                            removed_leases.append(seq_of_item_key(key))
        if scheduled and cursor.set_range(TAG_SCHEDULED):
            for key, raw in cursor:
                if key[:1] != TAG_SCHEDULED:
                    break
                doomed.append(key)
                doomed.extend(self._index_keys(key, raw, db, txn, runs))
        for key in doomed:
            txn.delete(key, db=db)
        self._drop_empty_runs(txn, db, runs)
        if (ready or scheduled) and cursor.set_range(TAG_WAITING) and cursor.key()[:1] in (TAG_WAITING, TAG_GROUP_HEAD):
            ordered_groups.clear(txn, db, self._group_heads(txn, p), waiting=ready)
        return removed_leases

    def _group_heads(self, txn: lmdb.Transaction[bytes], p: int) -> set[str]:
        """The groups whose head is stored in partition ``p`` (ready, leased or scheduled)."""
        cursor = txn.cursor(db=self._dbs[p])
        heads: set[str] = set()
        for tag in (TAG_ITEM, TAG_SCHEDULED):
            if cursor.set_range(tag):
                for key, raw in cursor:
                    if key[:1] != tag:
                        break
                    key_of_group = group_of(raw)
                    if key_of_group:
                        heads.add(key_of_group)
        return heads

    def _index_keys(
        self, key: bytes, raw: bytes, db: Any, txn: lmdb.Transaction[bytes], runs: list[tuple[int, int]]
    ) -> list[bytes]:
        """The index entries of the item at ``key`` to delete with it; its expiry run,
        if it has one, goes to ``runs`` to be checked once the items are gone."""
        item = Item.decode(raw)
        if item.expiry_run:
            runs.append((item.expire_deadline, seq_of_item_key(key)))
            keys = []
        else:
            keys = [expiry_key(item.expire_deadline, key)]
        if item.source_id and txn.get(source_key(item.source_id), db=db) == key:
            keys.append(source_key(item.source_id))
        if item.priority and not item.is_leased and key[:1] == TAG_ITEM:
            keys.append(priority_key(item.priority, seq_of_item_key(key)))
        return keys

    def scan(self, txn: lmdb.Transaction[bytes], p: int) -> PartitionScan:
        """Read a whole partition once to rebuild the actor's in-memory view of it."""
        result = PartitionScan(next_seq=self.read_next_seq(txn, p))
        result.lease_records = lease_records.read_all(txn, self._dbs[p])
        held = {seq: record for record in result.lease_records for seq in record.seqs()}
        cursor = txn.cursor(db=self._dbs[p])
        unpack = _HEADER.unpack_from
        max_seq = 0
        if cursor.set_range(TAG_ITEM):
            for key, raw in cursor:
                if key[:1] != TAG_ITEM:
                    break
                seq = seq_of_item_key(key)
                max_seq = seq
                flags, _att, created, _exp, lease_deadline, _enq, leased_at = unpack(raw)[:7]
                result.created_sum += created
                record = held.get(seq) if held else None
                if record is not None:  # as the lease would have rewritten it
                    result.leased += 1
                    result.leased_at_sum += record.leased_at
                    result.leases.append((record.deadline, seq))
                elif flags & 1:
                    result.leased += 1
                    if flags & _FLAG_HISTORY and grouped(raw):
                        result.groups_in_flight += 1
                    result.leased_at_sum += leased_at
                    result.leases.append((lease_deadline, seq))
                else:
                    result.ready += 1
                    if not result.first_ready_seq:
                        result.first_ready_seq = seq
        if cursor.set_range(TAG_SCHEDULED):
            for key in cursor.iternext(keys=True, values=False):
                if key[:1] != TAG_SCHEDULED:
                    break
                _due, seq = parse_scheduled_key(key)
                max_seq = max(max_seq, seq)
                result.scheduled += 1
        result.waiting, waiting_created = ordered_groups.count_waiting(txn, self._dbs[p])
        result.created_sum += waiting_created
        if result.waiting and cursor.set_range(TAG_WAITING):
            for key in cursor.iternext(keys=True, values=False):
                if key[:1] != TAG_WAITING:
                    break
                max_seq = max(max_seq, ordered_groups.seq_of_waiting_key(key))
        for seq, _item in self.outbox(txn, p):
            max_seq = max(max_seq, seq)
        for seq, _uid, _item in self.redrive_outbox(txn, p):
            max_seq = max(max_seq, seq)
        result.next_seq = max(result.next_seq, max_seq + 1)
        if not result.first_ready_seq:
            result.first_ready_seq = result.next_seq
        result.first_due = self.first_due(txn, p)
        result.first_expiry = self.first_expiry(txn, p)
        if cursor.set_range(TAG_PRIORITY):
            for key in cursor.iternext(keys=True, values=False):
                if key[:1] != TAG_PRIORITY:
                    break
                result.ranked += 1
        return result


# How far the head-of-partition lookup walks past leased items before giving up (the
# caller keeps what it knew; the lease scan moves the ready hint on soon after).
HEAD_SCAN_LIMIT = 1000


def _ready_head(cursor: Any, from_seq: int, held: Container[int]) -> int | None:
    if not cursor.set_range(item_key(from_seq)):
        return 0
    for n, (key, raw) in enumerate(cursor):
        if key[:1] != TAG_ITEM:
            return 0
        if not raw[0] & _FLAG_LEASED and not (held and seq_of_item_key(key) in held):
            return int(read_state(raw).created_at)
        if n >= HEAD_SCAN_LIMIT:
            return None
    return 0
