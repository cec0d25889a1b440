"""Ordered groups in a partition: one item of a group in play at a time, FIFO within it.

A group's *head* is its one item in play: ready or leased in the partition's FIFO
(``i`` keys, record.py), or held by a delayed retry among the scheduled items. The
other items of the group wait apart, in produce order, under keys of their own in the
partition's database:

- ``g`` + group + seq (8 bytes): an item waiting behind its group's head (its record).
  ``group`` is a length (2 bytes) and the key, so one group's keys never run into
  another's; keys longer than LMDB allows are stored by digest.
- ``h`` + group: the group has a head (empty value).
- ``k`` (partition 0 only): the partition count that places group keys, written by the
  first grouped produce and never changed (``group_partition``).

So a Lease walks only heads and items of no group: however many items wait behind a
busy group, it never looks at them. When a head leaves (completed, dead-lettered,
deleted) the group's next item moves into the FIFO under its own seq (its place in
produce order, and its id, are the ones it was given), or the group's ``h`` goes. A
head whose lease runs out, or that is retried, stays the head wherever the FIFO puts
it, so it comes again before the rest of its group.

A waiting item's expiry entry names its FIFO key (``i`` + seq), where nothing is until
it moves there: the expiry pass passes over it, and the item expires once it is its
group's head.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Any

import lmdb

from .record import (
    _HEADER,
    KEY_GROUP_PARTITIONS,
    TAG_GROUP_HEAD,
    TAG_WAITING,
    Item,
    expiry_key,
    item_key,
)

_LEN = struct.Struct(">H")
_U32 = struct.Struct(">I")
_SEQ = struct.Struct(">Q")
_MAX_RAW_KEY = 400
_LAST_SEQ = b"\xff" * 8
_CREATED_AT = struct.Struct("<q")
_CREATED_OFFSET = 5  # after flags (1) and attempts (4) in the record header
assert _HEADER.size > _CREATED_OFFSET + 8


def _group(key: str) -> bytes:
    raw = key.encode()
    if len(raw) > _MAX_RAW_KEY:
        raw = b"#" + hashlib.sha256(raw).digest()
    return _LEN.pack(len(raw)) + raw


def waiting_key(key: str, seq: int) -> bytes:
    return TAG_WAITING + _group(key) + _SEQ.pack(seq)


def head_key(key: str) -> bytes:
    return TAG_GROUP_HEAD + _group(key)


def seq_of_waiting_key(key: bytes) -> int:
    return int(_SEQ.unpack_from(key, len(key) - 8)[0])


def group_partition(key: str, partitions: int) -> int:
    """The partition of group ``key``: crc32 of its UTF-8 bytes modulo ``partitions``,
    the count ``recorded_partitions`` keeps (as the cluster places keys: placement.py)."""
    return zlib.crc32(key.encode()) % partitions


def recorded_partitions(txn: lmdb.Transaction[bytes], first_db: Any) -> int:
    """The partition count that places group keys (0: no grouped item yet)."""
    raw = txn.get(KEY_GROUP_PARTITIONS, db=first_db)
    return 0 if raw is None else int(_U32.unpack(raw)[0])


def record_partitions(txn: lmdb.Transaction[bytes], first_db: Any, count: int) -> None:
    """Keep ``count`` as the partition count that places group keys, if none is kept
    yet. Written by the first grouped produce and never changed: partitions added
    later must not move a group that has items."""
    if txn.get(KEY_GROUP_PARTITIONS, db=first_db) is None:
        txn.put(KEY_GROUP_PARTITIONS, _U32.pack(count), db=first_db)


def has_head(txn: lmdb.Transaction[bytes], db: Any, key: str) -> bool:
    return txn.get(head_key(key), db=db) is not None


def set_head(txn: lmdb.Transaction[bytes], db: Any, key: str) -> None:
    txn.put(head_key(key), b"", db=db)


def put_waiting(txn: lmdb.Transaction[bytes], db: Any, seq: int, item: Item) -> None:
    """Store ``item`` (of group ``item.group_key``) behind its group's head."""
    item.expiry_run = False
    txn.put(waiting_key(item.group_key, seq), item.encode(), db=db)
    txn.put(expiry_key(item.expire_deadline, item_key(seq)), b"", db=db)


def release(txn: lmdb.Transaction[bytes], db: Any, key: str) -> tuple[int, bytes] | None:
    """Group ``key``'s head left: move its next item into the FIFO as the new head
    and return (seq, record), or forget the group's head (None) when none waits."""
    return _release(txn, db, _group(key))


def created_at(raw: bytes) -> int:
    return int(_CREATED_AT.unpack_from(raw, _CREATED_OFFSET)[0])


def count_waiting(txn: lmdb.Transaction[bytes], db: Any) -> tuple[int, int]:
    """How many items wait behind their groups' heads, and the sum of their created_at."""
    cursor = txn.cursor(db=db)
    count = created = 0
    if cursor.set_range(TAG_WAITING):
        for key, raw in cursor:
            if key[:1] != TAG_WAITING:
                break
            count += 1
            created += created_at(raw)
    return count, created


def oldest_waiting(txn: lmdb.Transaction[bytes], db: Any, limit: int) -> int:
    """created_at of the item that has waited longest behind its group's head (0: none
    waits). Each group's first waiting item is its oldest: one lookup per group, for
    at most ``limit`` groups."""
    cursor = txn.cursor(db=db)
    oldest = 0
    if not cursor.set_range(TAG_WAITING):
        return 0
    for _ in range(limit):
        key = cursor.key()
        if key[:1] != TAG_WAITING:
            break
        at = created_at(cursor.value())
        oldest = at if not oldest else min(oldest, at)
        if not cursor.set_range(bytes(key[:-8]) + _LAST_SEQ):  # the next group's first
            break
    return oldest


def clear(txn: lmdb.Transaction[bytes], db: Any, heads: set[str], *, waiting: bool) -> None:
    """After a clear: with ``waiting``, delete every waiting item (with its expiry
    entry). Then each group whose head is gone (not in ``heads``, the groups whose head
    is still stored) takes its next waiting item as its head, or loses its head mark."""
    cursor = txn.cursor(db=db)
    doomed: list[bytes] = []
    if waiting and cursor.set_range(TAG_WAITING):
        for key, raw in cursor:
            if key[:1] != TAG_WAITING:
                break
            item = Item.decode(raw)
            doomed.append(bytes(key))
            doomed.append(expiry_key(item.expire_deadline, item_key(seq_of_waiting_key(key))))
    for key in doomed:
        txn.delete(key, db=db)
    kept = {head_key(key) for key in heads}
    headless: list[bytes] = []
    if cursor.set_range(TAG_GROUP_HEAD):
        for key in cursor.iternext(keys=True, values=False):
            if key[:1] != TAG_GROUP_HEAD:
                break
            if bytes(key) not in kept:
                headless.append(bytes(key))
    for key in headless:
        _release(txn, db, key[1:])


def _release(txn: lmdb.Transaction[bytes], db: Any, group: bytes) -> tuple[int, bytes] | None:
    prefix = TAG_WAITING + group
    cursor = txn.cursor(db=db)
    if cursor.set_range(prefix) and cursor.key().startswith(prefix):
        found = bytes(cursor.key())
        raw = bytes(cursor.value())
        cursor.delete()
        seq = seq_of_waiting_key(found)
        txn.put(item_key(seq), raw, db=db)
        return seq, raw
    txn.delete(TAG_GROUP_HEAD + group, db=db)
    return None
