"""Items a queue took from another queue's outbox (dead letters, redriven items) in the
last ``WINDOW_US``, by source id: what makes a hand-over sent again safe after the item
it stored is gone.

A sender drops its outbox entry only after the receiver answered, so a sender that
fails in between sends the entry again: on a single server at its start, before it
serves (the receiver still holds the item then, ``u`` + source id finds it), but in a
cluster from the new primary of a replicated source, seconds after a failover, while
the receiver has gone on serving: the item may be completed, and only this record
still says it came.

Kept in the partition's own database (record.py's layout), next to the item stored:

- ``a`` + source id -> accepted_at (8, big endian): the source id was taken then.
- ``b`` + accepted_at (8) + source id -> empty: the same, in time order, to forget.

Both tags sort before every other (``c``, ``d``, ``i``, ...), and each walk over them
stops at the first key of another tag. A partition written before these records
existed has none. They are written in the cycle's transaction, so a replicated queue's
copies hold them too (a failover of the receiving queue keeps them).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import lmdb

TAG_ACCEPTED = b"a"
TAG_ACCEPTED_AT = b"b"
_U64 = struct.Struct(">Q")
_AT_KEY = struct.Struct(">cQ")

# How long a taken source id is remembered: far longer than a failover of the sender
# (its lease TTL + a few seconds), so a new primary's resend is recognised; a sender
# whose every copy is down longer than this may, when it is back, hand over again an
# item the receiver has completed since.
WINDOW_US = 15 * 60 * 1_000_000


def note(txn: lmdb.Transaction[bytes], db: Any, source_id: str, at_us: int) -> None:
    """Remember that the item from ``source_id`` was taken at ``at_us``."""
    source = source_id.encode()
    txn.put(TAG_ACCEPTED + source, _U64.pack(at_us), db=db)
    txn.put(_AT_KEY.pack(TAG_ACCEPTED_AT, at_us) + source, b"", db=db)


def seen(txn: lmdb.Transaction[bytes], dbs: Iterable[Any], source_id: str) -> bool:
    """Whether any of ``dbs`` remembers taking the item from ``source_id``."""
    key = TAG_ACCEPTED + source_id.encode()
    return any(txn.get(key, db=db) is not None for db in dbs)


def forget_before(txn: lmdb.Transaction[bytes], db: Any, before_us: int, limit: int) -> int:
    """Forget up to ``limit`` source ids taken before ``before_us``; how many went."""
    cursor = txn.cursor(db=db)
    gone = 0
    if not cursor.set_range(TAG_ACCEPTED_AT):
        return 0
    doomed: list[bytes] = []
    for key in cursor.iternext(keys=True, values=False):
        if key[:1] != TAG_ACCEPTED_AT or gone >= limit:
            break
        at = _U64.unpack_from(key, 1)[0]
        if at >= before_us:
            break
        doomed.append(bytes(key))
        gone += 1
    for key in doomed:
        source = key[_AT_KEY.size :]
        # Taken again since (a later record): that one forgets it.
        if txn.get(TAG_ACCEPTED + source, db=db) == key[1 : _AT_KEY.size]:
            txn.delete(TAG_ACCEPTED + source, db=db)
        txn.delete(key, db=db)
    return gone
