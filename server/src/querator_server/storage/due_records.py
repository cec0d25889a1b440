"""What comes due by time in a partition: scheduled items (kept by due time until they
become ready), and the expiry index, whose walk finds the items that expired."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import lmdb

from .item_records import ItemRecords
from .record import (
    TAG_EXPIRY,
    TAG_ITEM,
    TAG_SCHEDULED,
    Item,
    decode_u64,
    expiry_key,
    item_key,
    parse_expiry_key,
    parse_scheduled_key,
    scheduled_key,
    seq_of_item_key,
    source_key,
)


class DueRecords(ItemRecords):
    # -- scheduled items ---------------------------------------------------------

    def put_scheduled(self, txn: lmdb.Transaction[bytes], p: int, due: int, seq: int, item: Item) -> None:
        db = self._dbs[p]
        key = scheduled_key(due, seq)
        item.expiry_run = False
        txn.put(key, item.encode(), db=db)
        txn.put(expiry_key(item.expire_deadline, key), b"", db=db)
        if item.source_id:
            txn.put(source_key(item.source_id), key, db=db)

    def get_scheduled(self, txn: lmdb.Transaction[bytes], p: int, due: int, seq: int) -> Item | None:
        raw = txn.get(scheduled_key(due, seq), db=self._dbs[p])
        return None if raw is None else Item.decode(raw)

    def delete_scheduled(self, txn: lmdb.Transaction[bytes], p: int, due: int, seq: int, item: Item) -> None:
        self._forget(txn, p, scheduled_key(due, seq), item)

    def first_due(self, txn: lmdb.Transaction[bytes], p: int) -> int:
        cursor = txn.cursor(db=self._dbs[p])
        if cursor.set_range(TAG_SCHEDULED) and cursor.key()[:1] == TAG_SCHEDULED:
            return parse_scheduled_key(cursor.key())[0]
        return 0

    # -- expiry index ------------------------------------------------------------

    def expired(
        self, txn: lmdb.Transaction[bytes], p: int, now: int, limit: int, held: Container[int] = ()
    ) -> tuple[list[tuple[bytes, Item]], int]:
        """Up to ``limit`` expired items that are not leased, and the next deadline to check.

        Leased items are skipped: they are dead-lettered when their lease ends (those
        of lease records, ``held``, as well as those flagged leased). The
        next deadline is 0 when nothing else is indexed, or ``now`` when more expired
        items remain than ``limit``.
        """
        db = self._dbs[p]
        cursor, items = txn.cursor(db=db), txn.cursor(db=db)
        out: list[tuple[bytes, Item]] = []
        empty_runs: list[bytes] = []
        try:
            if not cursor.set_range(TAG_EXPIRY):
                return out, 0
            for key, value in cursor:
                if key[:1] != TAG_EXPIRY:
                    break
                deadline, target = parse_expiry_key(key)
                if deadline > now:
                    return out, deadline
                if len(out) >= limit:
                    return out, now
                if value:
                    if self._expired_in_run(items, target, decode_u64(value), now, out, limit, held):
                        empty_runs.append(key)
                    elif len(out) >= limit:
                        return out, now  # the rest of this run, next time
                    continue
                raw = txn.get(target, db=db)
                if raw is None or (target[:1] == TAG_ITEM and (raw[0] & 1 or seq_of_item_key(target) in held)):
                    continue
                out.append((target, Item.decode(raw)))
            return out, 0
        finally:
            for key in empty_runs:
                txn.delete(key, db=db)

    @staticmethod
    def _expired_in_run(
        items: Any, first_key: bytes, last: int, now: int, out: list[tuple[bytes, Item]], limit: int, held: Container[int]
    ) -> bool:
        """Add the run's expired ready items to ``out`` (up to ``limit`` in all); True
        when the run holds no item at all any more (its entry can go)."""
        last_key = item_key(last)
        if not (items.set_range(first_key) and items.key() <= last_key):
            return True
        for key, raw in items:
            if key > last_key or len(out) >= limit:
                break
            if raw[0] & 1 or (held and seq_of_item_key(key) in held):
                continue  # leased: dead-lettered when its lease ends
            item = Item.decode(raw)
            if item.expire_deadline <= now:
                out.append((key, item))
        return False

    def first_expiry(self, txn: lmdb.Transaction[bytes], p: int) -> int:
        cursor = txn.cursor(db=self._dbs[p])
        if cursor.set_range(TAG_EXPIRY) and cursor.key()[:1] == TAG_EXPIRY:
            return parse_expiry_key(cursor.key())[0]
        return 0
