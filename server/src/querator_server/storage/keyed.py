"""Queue-wide indexes for data pipelines: idempotency keys and lease keys.

Four named databases in the queue's environment (beside the partitions):

- ``dedup``: idempotency key -> produced_at (8 bytes) + the first item's id.
- ``dedup_by_time``: produced_at + key -> empty, to forget keys past the window.
- ``lease_keys``: lease key -> taken_at (8) + partition (4) + the items' seqs (8 each).
- ``lease_keys_by_time``: taken_at + key -> empty, to forget keys past their TTL.

Keys longer than LMDB allows are stored by digest.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, NamedTuple

import lmdb

from .queue_store import QueueStore

_U64 = struct.Struct(">Q")
_LEASE_HEAD = struct.Struct(">QI")
_MAX_RAW_KEY = 400


class LeaseKeyRecord(NamedTuple):
    taken_at: int
    partition: int
    seqs: tuple[int, ...]


def _key(text: str) -> bytes:
    raw = text.encode()
    return raw if len(raw) <= _MAX_RAW_KEY else b"#" + hashlib.sha256(raw).digest()


class KeyedIndex:
    """Idempotency keys and lease keys of one queue."""

    def __init__(self, store: QueueStore) -> None:
        env = store.env
        names = [store.prefix + n for n in (b"dedup", b"dedup_by_time", b"lease_keys", b"lease_keys_by_time")]
        dbs: list[Any] = store.write(lambda txn: [env.open_db(n, txn=txn, create=True) for n in names])
        self._dedup, self._dedup_time, self._leases, self._leases_time = dbs

    def databases(self) -> dict[str, Any]:
        """Each database by its role in the queue (storage/replica_state.py)."""
        return {
            "dedup": self._dedup,
            "dedup_by_time": self._dedup_time,
            "lease_keys": self._leases,
            "lease_keys_by_time": self._leases_time,
        }

    # -- idempotency keys ------------------------------------------------------------

    def check(self, txn: lmdb.Transaction[bytes], key: str, since_us: int) -> tuple[str | None, int]:
        """The first item's id if ``key`` was produced at or after ``since_us``, and when
        the key was last remembered (0: never, or forgotten), to hand to ``remember``
        so that it need not look the key up again."""
        raw = txn.get(_key(key), db=self._dedup)
        if raw is None:
            return None, 0
        at = int(_U64.unpack_from(raw)[0])
        return (None if at < since_us else bytes(raw[_U64.size :]).decode()), at

    def remember(
        self, txn: lmdb.Transaction[bytes], key: str, at_us: int, item_id: str, *, last_at: int | None = None
    ) -> None:
        """Remember ``key`` as produced at ``at_us`` as ``item_id``. ``last_at``: what
        ``check`` said of the key in this transaction (None: look it up)."""
        k = _key(key)
        if last_at is None:
            old = txn.get(k, db=self._dedup)
            last_at = int(_U64.unpack_from(old)[0]) if old is not None else 0
        if last_at:
            txn.delete(_U64.pack(last_at) + k, db=self._dedup_time)
        txn.put(k, _U64.pack(at_us) + item_id.encode(), db=self._dedup)
        txn.put(_U64.pack(at_us) + k, b"", db=self._dedup_time)

    def remember_all(self, txn: lmdb.Transaction[bytes], at_us: int, entries: list[tuple[str, str, int]]) -> None:
        """``remember`` for many keys produced together: (key, item id, ``last_at`` from
        ``check``) each. The records go in key order through one cursor per database,
        which finds each place from the last one instead of from the root."""
        at = _U64.pack(at_us)
        forgotten = [_U64.pack(last_at) + _key(key) for key, _, last_at in entries if last_at]
        records = sorted((_key(key), at + item_id.encode()) for key, item_id, _ in entries)
        if forgotten:
            cursor = txn.cursor(db=self._dedup_time)
            for old in sorted(forgotten):
                if cursor.set_key(old):
                    cursor.delete()
        txn.cursor(db=self._dedup).putmulti(records)
        txn.cursor(db=self._dedup_time).putmulti([(at + k, b"") for k, _ in records])

    def forget_dedup_before(self, txn: lmdb.Transaction[bytes], before_us: int, limit: int) -> tuple[int, int]:
        """Forget keys produced before ``before_us``; (how many, first time left or 0)."""
        return self._expire(txn, self._dedup_time, self._dedup, before_us, limit)

    def first_dedup_at(self, txn: lmdb.Transaction[bytes]) -> int:
        return self._first(txn, self._dedup_time)

    # -- lease keys --------------------------------------------------------------------

    def lease_key(self, txn: lmdb.Transaction[bytes], key: str) -> LeaseKeyRecord | None:
        raw = txn.get(_key(key), db=self._leases)
        if raw is None:
            return None
        taken_at, partition = _LEASE_HEAD.unpack_from(raw)
        body = bytes(raw[_LEASE_HEAD.size :])
        seqs = struct.unpack(f">{len(body) // 8}Q", body)
        return LeaseKeyRecord(taken_at, partition, seqs)

    def put_lease_key(self, txn: lmdb.Transaction[bytes], key: str, record: LeaseKeyRecord, *, new: bool) -> None:
        k = _key(key)
        if not record.seqs and not new:  # all its items left: the key is forgotten
            self.drop_lease_key(txn, key)
            return
        value = _LEASE_HEAD.pack(record.taken_at, record.partition) + struct.pack(
            f">{len(record.seqs)}Q", *record.seqs
        )
        txn.put(k, value, db=self._leases)
        if new:
            txn.put(_U64.pack(record.taken_at) + k, b"", db=self._leases_time)

    def drop_lease_key(self, txn: lmdb.Transaction[bytes], key: str) -> None:
        k = _key(key)
        raw = txn.get(k, db=self._leases)
        if raw is not None:
            txn.delete(bytes(raw[: _U64.size]) + k, db=self._leases_time)
            txn.delete(k, db=self._leases)

    def forget_lease_keys_before(self, txn: lmdb.Transaction[bytes], before_us: int, limit: int) -> tuple[int, int]:
        return self._expire(txn, self._leases_time, self._leases, before_us, limit)

    def first_lease_key_at(self, txn: lmdb.Transaction[bytes]) -> int:
        return self._first(txn, self._leases_time)

    # -- shared ------------------------------------------------------------------------

    @staticmethod
    def _first(txn: lmdb.Transaction[bytes], by_time: Any) -> int:
        cursor = txn.cursor(db=by_time)
        return int(_U64.unpack_from(cursor.key())[0]) if cursor.first() else 0

    @staticmethod
    def _expire(txn: lmdb.Transaction[bytes], by_time: Any, main: Any, before_us: int, limit: int) -> tuple[int, int]:
        cursor = txn.cursor(db=by_time)
        doomed: list[bytes] = []
        next_at = 0
        if cursor.first():
            for entry in cursor.iternext(keys=True, values=False):
                at = _U64.unpack_from(entry)[0]
                if at >= before_us or len(doomed) >= limit:
                    next_at = at
                    break
                doomed.append(bytes(entry))
        for entry in doomed:
            txn.delete(entry, db=by_time)
            txn.delete(entry[_U64.size :], db=main)
        return len(doomed), next_at
