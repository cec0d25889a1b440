"""Items a partition recently completed or retried: what makes Complete and Retry safe
to send again after a lost answer.

Kept in the partition's own database (record.py's layout) under the tag ``c``:

- ``c`` + last seq (8, big endian) -> first seq (8) + done_at (8) + how (1): the items
  ``first``..``last`` were completed (or retried, or retried into the dead letters) by
  one request at ``done_at``.

One record per run of neighbouring seqs, not per item: a plain lease hands out a run and
its Complete ends it whole, so the drain writes one small record per Complete. A seq
is never reused in a partition (``n``), so a record can only ever speak of the one
placement of an item that id named: an id given out again after a re-queue has a new
seq, and an id of a queue deleted and made again has another uid. Records sort by
their last seq, so the run that holds a seq is the first record at or after it.

The tag sorts before every other (``d``, ``i``, ``n``, ...), so the walks over items,
scheduled items and outboxes never meet a record, and a partition written before these
records existed simply has none. Records go in seq order once they are older than the
queue's lease timeout (see ``forget_before``).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import lmdb

TAG_DONE = b"c"
_KEY = struct.Struct(">cQ")
_VALUE = struct.Struct(">QQB")

# How a run of items ended.
COMPLETED = 1
RETRIED = 2  # back in the partition (a new id) or scheduled
RETRIED_DEAD = 3  # to the dead-letter queue, or dropped when there is none


def runs(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted ``seqs`` as (first, last) runs of neighbours."""
    out: list[tuple[int, int]] = []
    for seq in sorted(seqs):
        if out and out[-1][1] + 1 == seq:
            out[-1] = (out[-1][0], seq)
        else:
            out.append((seq, seq))
    return out


def put(txn: lmdb.Transaction[bytes], db: Any, first: int, last: int, at_us: int, how: int) -> None:
    txn.put(_KEY.pack(TAG_DONE, last), _VALUE.pack(first, at_us, how), db=db)


def find(txn: lmdb.Transaction[bytes], db: Any, seqs: Iterable[int]) -> dict[int, int]:
    """How each of ``seqs`` that a record holds ended (seq -> COMPLETED, ...)."""
    cursor = txn.cursor(db=db)
    found: dict[int, int] = {}
    for seq in sorted(set(seqs)):
        if not cursor.set_range(_KEY.pack(TAG_DONE, seq)):
            break
        key = cursor.key()
        if key[:1] != TAG_DONE:
            break
        first, _at, how = _VALUE.unpack(cursor.value())
        if first <= seq:
            found[seq] = how
    return found


def forget_before(txn: lmdb.Transaction[bytes], db: Any, before_us: int, limit: int) -> tuple[int, int]:
    """Delete records made before ``before_us``, in seq order, stopping at the first
    one that is not (or after ``limit``): (how many, that record's done_at or 0).

    Items are leased in seq order and completed within about a lease, so seq order is
    close to time order; a record completed late (a long-extended lease) keeps the
    ones after it at most one lease timeout longer, and no record is forgotten early.
    """
    cursor = txn.cursor(db=db)
    deleted = 0
    if not cursor.set_range(TAG_DONE):
        return 0, 0
    while cursor.key()[:1] == TAG_DONE:
        _first, at, _how = _VALUE.unpack(cursor.value())
        if at >= before_us or deleted >= limit:
            return deleted, int(at)
        deleted += 1
        if not cursor.delete():
            break
    return deleted, 0


def first_at(txn: lmdb.Transaction[bytes], db: Any) -> int:
    """The done_at of the partition's first record in seq order (0: none)."""
    cursor = txn.cursor(db=db)
    if cursor.set_range(TAG_DONE) and cursor.key()[:1] == TAG_DONE:
        return int(_VALUE.unpack(cursor.value())[1])
    return 0
