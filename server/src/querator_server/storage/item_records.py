"""A queue's item records in a partition: appended (one at a time, or a produce's run
with one expiry entry), read, rewritten, deleted with their index entries (expiry,
source id, priority), a completed lease's run deleted in one pass; and the records of
ordered groups (ordered_groups.py) as the store exposes them."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable
from typing import Any

import lmdb

from . import ordered_groups
from .expiry_runs import drop_empty_runs
from .queue_env import QueueEnv
from .record import (
    _FLAG_EXPIRY_RUN,
    _FLAG_HISTORY,
    _FLAG_LEASED,
    _LENGTHS,
    _NO_STRINGS,
    _STATE_FIXED,
    TAG_ITEM,
    Item,
    ItemState,
    encode_u64,
    expiry_key,
    grouped,
    item_key,
    plain_header,
    priority_key,
    priority_of,
    read_state,
    seq_of_item_key,
    source_key,
)


def _by_seq(entry: tuple[int, ItemState]) -> int:
    return entry[0]


class ItemRecords(QueueEnv):
    def append(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item) -> None:
        """Store a ready or leased item at ``seq`` (the tail of the partition), with an
        expiry entry of its own."""
        db = self._dbs[p]
        key = item_key(seq)
        item.expiry_run = False
        txn.put(key, item.encode(), db=db)
        txn.put(expiry_key(item.expire_deadline, key), b"", db=db)
        if item.source_id:
            txn.put(source_key(item.source_id), key, db=db)
        if item.priority and not item.is_leased:
            txn.put(priority_key(item.priority, seq), b"", db=db)

    def append_new(self, txn: lmdb.Transaction[bytes], p: int, first_seq: int, items: list[Item], expire_deadline: int) -> None:
        """Store freshly produced items at first_seq, first_seq + 1, ... (no source ids),
        all expiring at ``expire_deadline``, indexed by one expiry run."""
        if not items:
            return
        db = self._dbs[p]
        put = txn.put
        self._put_run(txn, db, expire_deadline, first_seq, first_seq + len(items) - 1)
        for seq, item in enumerate(items, first_seq):
            item.expiry_run = True
            put(item_key(seq), item.encode(), db=db)
            if item.priority:
                put(priority_key(item.priority, seq), b"", db=db)

    def append_payloads(
        self, txn: lmdb.Transaction[bytes], p: int, first_seq: int, payloads: list[bytes], created_at: int, expire_deadline: int
    ) -> None:
        """``append_new`` for items that carry only a payload: one shared header, and
        every record written by one ``putmulti``."""
        if not payloads:
            return
        db = self._dbs[p]
        head = plain_header(created_at, expire_deadline, expiry_run=True)
        self._put_run(txn, db, expire_deadline, first_seq, first_seq + len(payloads) - 1)
        txn.cursor(db=db).putmulti([(item_key(seq), head + payload) for seq, payload in enumerate(payloads, first_seq)])

    @staticmethod
    def _put_run(txn: lmdb.Transaction[bytes], db: Any, expire_deadline: int, first: int, last: int) -> None:
        # Written before the records: the other way round, a fill of 1,000,000 items
        # left 223 MB of the file mapped in the process against 140 MB.
        txn.put(expiry_key(expire_deadline, item_key(first)), encode_u64(last), db=db)

    def get(self, txn: lmdb.Transaction[bytes], p: int, seq: int) -> Item | None:
        raw = txn.get(item_key(seq), db=self._dbs[p])
        return None if raw is None else Item.decode(raw)

    def put(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item) -> None:
        """Overwrite an item in place (same key, same expiry)."""
        txn.put(item_key(seq), item.encode(), db=self._dbs[p])

    def put_raw(self, txn: lmdb.Transaction[bytes], p: int, seq: int, raw: bytes) -> None:
        txn.put(item_key(seq), raw, db=self._dbs[p])

    def put_ready(self, txn: lmdb.Transaction[bytes], p: int, seq: int, raw: bytes) -> bool:
        """Store ``raw``, a record that is ready again (a lease undone), at ``seq`` and
        index its priority. True when it has one (one more entry in the index)."""
        db = self._dbs[p]
        txn.put(item_key(seq), raw, db=db)
        priority = priority_of(raw)
        if priority:
            txn.put(priority_key(priority, seq), b"", db=db)
        return bool(priority)

    def unrank(self, txn: lmdb.Transaction[bytes], p: int, seq: int, raw: bytes) -> None:
        """Take the item at ``seq`` (``raw``: its ready record) out of the priority index,
        as it is leased by another path than ``lease_ranked``."""
        priority = priority_of(raw)
        if priority:
            txn.delete(priority_key(priority, seq), db=self._dbs[p])

    def delete(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item | ItemState) -> None:
        self._forget(txn, p, item_key(seq), item)

    def delete_leased(self, txn: lmdb.Transaction[bytes], p: int, found: Iterable[tuple[int, ItemState]]) -> None:
        """``delete`` for many items of partition ``p`` (a completed batch) in one loop.

        Two cursors walk the items and their expiry keys in key order: a batch is
        mostly a run of neighbours (leased together, produced together), and a
        cursor's delete leaves it on the next key, so most deletes need no search.
        """
        db = self._dbs[p]
        items, expiries = txn.cursor(db=db), txn.cursor(db=db)
        runs: list[tuple[int, int]] = []
        for seq, state in sorted(found, key=_by_seq):
            key = item_key(seq)
            if items.key() == key or items.set_key(key):
                items.delete()
            if state.expiry_run:
                runs.append((state.expire_deadline, seq))
            else:
                expiry = expiry_key(state.expire_deadline, key)
                if expiries.key() == expiry or expiries.set_key(expiry):
                    expiries.delete()
            if state.source_id:
                self._forget_source(txn, db, key, state.source_id)
        if runs:
            self._drop_empty_runs(txn, db, runs)

    def complete_run(self, txn: lmdb.Transaction[bytes], p: int, first: int, last: int) -> tuple[int, int] | None:
        """Delete items ``first``..``last`` of partition ``p`` if every one of them is
        stored, leased, and tagged by no lease key and no source id: the batch a plain
        lease handed out, completed. Returns the sums of their created_at and leased_at.

        None, having changed nothing, when any of them is not so; the caller then takes
        the item-by-item path, which names each id that fails. One cursor pass checks
        the run and one deletes it, with no search per item.
        """
        db = self._dbs[p]
        cursor = txn.cursor(db=db)
        if not cursor.set_key(item_key(first)):
            return None
        count = last - first + 1
        unpack = _STATE_FIXED.unpack_from
        created = leased_at = 0
        runs: list[tuple[int, int]] = []
        singles: list[bytes] = []
        seq = first
        for raw in cursor.iternext(keys=False, values=True):
            if raw[_LENGTHS] != _NO_STRINGS or not raw[0] & _FLAG_LEASED:
                return None  # (a key past the items, e.g. ``n``, has a shorter value)
            if raw[0] & _FLAG_HISTORY and grouped(raw):
                return None  # its completion releases its group: the item-by-item path
            flags, _attempts, created_at, expire, _deadline, _enqueue_at, at = unpack(raw)
            created += created_at
            leased_at += at
            if flags & _FLAG_EXPIRY_RUN:
                runs.append((expire, seq))
            else:
                singles.append(expiry_key(expire, item_key(seq)))
            if seq == last:
                break
            seq += 1
        # count keys in order from first, the last of them last: exactly the run.
        if seq != last or cursor.key() != item_key(last):
            return None
        cursor.set_key(item_key(first))
        delete = cursor.delete
        for _ in range(count):
            delete()
        for key in singles:
            txn.delete(key, db=db)
        self._drop_empty_runs(txn, db, runs)
        return created, leased_at

    def leased_under(
        self, txn: lmdb.Transaction[bytes], p: int, seqs: Iterable[int], lease_key: str
    ) -> list[tuple[int, ItemState]]:
        """The items among ``seqs`` of partition ``p`` still leased under ``lease_key``."""
        cursor = txn.cursor(db=self._dbs[p])
        found: list[tuple[int, ItemState]] = []
        for seq in sorted(seqs):
            key = item_key(seq)
            if cursor.key() != key and not cursor.set_key(key):
                continue
            state = read_state(cursor.value())
            if state.is_leased and state.lease_key == lease_key:
                found.append((seq, state))
            cursor.next()
        return found

    def reader(self, txn: lmdb.Transaction[bytes], p: int) -> Callable[[int], bytes | None]:
        """``get_raw`` for many lookups in partition ``p``: one cursor, which finds a
        neighbour of its last key without a search from the root."""
        cursor = txn.cursor(db=self._dbs[p])
        set_key, value = cursor.set_key, cursor.value

        def read(seq: int) -> bytes | None:
            raw: bytes | None = value() if set_key(item_key(seq)) else None
            return raw

        return read

    def get_raw(self, txn: lmdb.Transaction[bytes], p: int, seq: int) -> bytes | None:
        raw: bytes | None = txn.get(item_key(seq), db=self._dbs[p])
        return raw

    def _forget(self, txn: lmdb.Transaction[bytes], p: int, key: bytes, item: Item | ItemState) -> None:
        db = self._dbs[p]
        txn.delete(key, db=db)
        if item.expiry_run:
            self._drop_empty_runs(txn, db, [(item.expire_deadline, seq_of_item_key(key))])
        else:
            txn.delete(expiry_key(item.expire_deadline, key), db=db)
        if item.source_id:
            self._forget_source(txn, db, key, item.source_id)
        if isinstance(item, Item) and item.priority and not item.is_leased and key[:1] == TAG_ITEM:
            txn.delete(priority_key(item.priority, seq_of_item_key(key)), db=db)

    _drop_empty_runs = staticmethod(drop_empty_runs)

    @staticmethod
    def _forget_source(txn: lmdb.Transaction[bytes], db: Any, key: bytes, source_id: str) -> None:
        if txn.get(source_key(source_id), db=db) == key:
            txn.delete(source_key(source_id), db=db)

    def has_source(self, txn: lmdb.Transaction[bytes], source_id: str, skip: Container[int] = ()) -> bool:
        """Whether any partition (but those in ``skip``) holds an item that came from
        ``source_id``."""
        key = source_key(source_id)
        if skip:
            return any(txn.get(key, db=db) is not None for p, db in enumerate(self._dbs) if p not in skip)
        return any(txn.get(key, db=db) is not None for db in self._dbs)

    # -- ordered groups (ordered_groups.py) -------------------------------------------

    def group_partitions(self, txn: lmdb.Transaction[bytes]) -> int:
        """The partition count that places group keys (0: none kept yet)."""
        return ordered_groups.recorded_partitions(txn, self._dbs[0])

    def record_group_partitions(self, txn: lmdb.Transaction[bytes], count: int) -> None:
        ordered_groups.record_partitions(txn, self._dbs[0], count)

    def has_group_head(self, txn: lmdb.Transaction[bytes], p: int, key: str) -> bool:
        return ordered_groups.has_head(txn, self._dbs[p], key)

    def set_group_head(self, txn: lmdb.Transaction[bytes], p: int, key: str) -> None:
        ordered_groups.set_head(txn, self._dbs[p], key)

    def put_waiting(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item) -> None:
        ordered_groups.put_waiting(txn, self._dbs[p], seq, item)

    def release_group(self, txn: lmdb.Transaction[bytes], p: int, key: str) -> tuple[int, bytes] | None:
        """``ordered_groups.release``; a next item of priority 1 to 9, ready now, also
        enters the priority index."""
        promoted = ordered_groups.release(txn, self._dbs[p], key)
        if promoted is not None and priority_of(promoted[1]):
            seq, raw = promoted
            txn.put(priority_key(priority_of(raw), seq), b"", db=self._dbs[p])
        return promoted

    def oldest_waiting(self, partitions: Iterable[int], limit: int) -> dict[int, int]:
        """created_at of the longest-waiting grouped item of each partition (0: none);
        one read transaction, for stats."""
        with self.env.begin() as txn:
            return {p: ordered_groups.oldest_waiting(txn, self._dbs[p], limit) for p in partitions}
