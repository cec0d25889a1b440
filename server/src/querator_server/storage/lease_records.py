"""One record per lease: what a plain lease writes instead of rewriting every item it
hands out.

A lease of plain items (a payload and nothing else: no strings, no history, priority 0,
indexed by an expiry run; not under a lease key) leaves their records exactly as they
were, ready by their flag, and writes one record under the tag ``l``:

- ``l`` + first seq (8, big endian) -> a version byte, the lease deadline, the time of
  the lease, the sum of the items' created_at, then the items as segments: (first,
  last, expire deadline) of neighbouring seqs with one expire deadline.

Every item of an open lease record is leased, with one attempt more than its record
says. The actor keeps the open records of each partition in memory (actor/lease_book.py)
and the hot paths ask it: a lease walk passes over their items as over leased ones, the
expiry walk leaves them alone. The exact completion of a whole lease deletes the items
and the record without reading them (``complete``). Every other path that needs an
item's own state (completing some of a lease's items, retry, extend, give back, a
lease running out, delete, clear) first writes the lease out (``write_out``): each item
rewritten as leased, exactly as the leases before this record did, and the record
deleted; from there on it reads what it always read. So an item is never both flagged
leased and in a record, and a data directory of the older layout (leased flags only)
is read as it is.

The tag sorts after ``i``, so the walks over items end before reaching a record (and
the version byte is even: read as an item's flags, it is not leased).
"""

from __future__ import annotations

import struct
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import lmdb

from .expiry_runs import drop_empty_runs_over
from .record import (
    _FLAG_EXPIRY_RUN,
    _FLAG_LEASED,
    _LENGTHS,
    _NO_STRINGS,
    _STATE_FIXED,
    TAG_ITEM,
    item_key,
    seq_of_item_key,
)

TAG_LEASE = b"l"
_KEY = struct.Struct(">cQ")
_VERSION = 2
# version, lease deadline, leased at, sum of created_at, segment count
_HEAD = struct.Struct("<BqqqI")
_SEGMENT = struct.Struct("<QQq")

# A plain record is leased by a record only with exactly these flags: the expiry run
# (set by every batch produce), nothing else (no history, error, priority or lease).
_PLAIN_FLAGS = _FLAG_EXPIRY_RUN


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """One open lease of plain items of a partition."""

    first: int
    deadline: int
    leased_at: int
    created_sum: int
    # (first, last, expire deadline) of each run of neighbouring seqs, in seq order.
    segments: tuple[tuple[int, int, int], ...]

    @property
    def count(self) -> int:
        return sum(last - first + 1 for first, last, _expire in self.segments)

    @property
    def last(self) -> int:
        return self.segments[-1][1]

    @property
    def contiguous(self) -> bool:
        """Whether the lease holds exactly the seqs first..last."""
        return self.count == self.last - self.first + 1

    def seqs(self) -> Iterable[int]:
        for first, last, _expire in self.segments:
            yield from range(first, last + 1)


def key_of(first: int) -> bytes:
    return _KEY.pack(TAG_LEASE, first)


def encode(record: LeaseRecord) -> bytes:
    head = _HEAD.pack(_VERSION, record.deadline, record.leased_at, record.created_sum, len(record.segments))
    return head + b"".join(_SEGMENT.pack(*segment) for segment in record.segments)


def decode(first: int, value: bytes) -> LeaseRecord:
    version, deadline, leased_at, created_sum, count = _HEAD.unpack_from(value)
    if version != _VERSION:
        raise ValueError(f"lease record {first}: unknown version {version}")
    segments = cast(
        "tuple[tuple[int, int, int], ...]",
        tuple(_SEGMENT.unpack_from(value, _HEAD.size + i * _SEGMENT.size) for i in range(count)),
    )
    return LeaseRecord(first, deadline, leased_at, created_sum, segments)


def build(seqs: list[int], expires: list[int], created_sum: int, deadline: int, leased_at: int) -> LeaseRecord:
    """The record of a lease of ``seqs`` (ascending) with these expire deadlines."""
    if seqs[-1] - seqs[0] == len(seqs) - 1 and expires.count(expires[0]) == len(expires):
        return LeaseRecord(seqs[0], deadline, leased_at, created_sum, ((seqs[0], seqs[-1], expires[0]),))  # the usual one run
    segments: list[tuple[int, int, int]] = []
    first = last = seqs[0]
    expire = expires[0]
    for seq, deadline_of in zip(seqs[1:], expires[1:]):
        if seq == last + 1 and deadline_of == expire:
            last = seq
            continue
        segments.append((first, last, expire))
        first = last = seq
        expire = deadline_of
    segments.append((first, last, expire))
    return LeaseRecord(seqs[0], deadline, leased_at, created_sum, tuple(segments))


@dataclass(slots=True)
class RecordRun:
    """What ``lease_walk`` took for one lease record, oldest first, as parallel lists
    (the fields ``QueueStore.lease_run`` answers, so a lease reads either alike)."""

    seqs: list[int] = field(default_factory=list)
    expires: list[int] = field(default_factory=list)  # each item's expire deadline
    records: list[bytes] = field(default_factory=list)  # each item's record, unchanged
    payloads: list[bytes] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)  # once leased
    created_at: list[int] = field(default_factory=list)
    last_seq: int = 0  # the last ready seq looked at, 0 for none
    other: tuple[int, bytes] | None = None  # the ready item it stopped at, not plain
    size: int = 0  # the records taken, with the overhead per item
    full: bool = False  # stopped at an item that would have taken it past max_bytes


# flags, attempts, created_at, expire deadline: what a lease record needs of an item.
_PLAIN_HEAD = struct.Struct("<BIqq")


def lease_walk(
    txn: lmdb.Transaction[bytes],
    db: Any,
    from_seq: int,
    quota: int,
    *,
    now: int,
    max_attempts: int,
    max_bytes: int,
    item_overhead: int,
    take_first: bool,
    skip: Container[int],
) -> RecordRun:
    """The walk of ``QueueStore.lease_run`` for a lease record, with its items left as
    they are: up to ``quota`` ready items of the partition ``db`` from ``from_seq`` on
    that a lease record may hold (plain: a payload and nothing else, indexed by an
    expiry run, not expired, with attempts left under ``max_attempts``), stopping at the
    first other one (``other``, which takes the path that rewrites it) or at one that
    would take the records past ``max_bytes`` (each with ``item_overhead``; with
    ``take_first`` the first is taken whatever its size). Items flagged leased or held
    by a record (in ``skip``) are passed over. A drain leases every item through this
    loop, so the test of each item is inlined rather than a call per item."""
    run = RecordRun()
    cursor = txn.cursor(db=db)
    if not cursor.set_range(item_key(from_seq)):
        return run
    seqs, records, payloads, attempts, created_at, expires = (
        run.seqs,
        run.records,
        run.payloads,
        run.attempts,
        run.created_at,
        run.expires,
    )
    unpack, seq_of, lengths, no_strings = _PLAIN_HEAD.unpack_from, seq_of_item_key, _LENGTHS, _NO_STRINGS
    head = _STATE_FIXED.size + len(_NO_STRINGS)
    seq = 0
    # ``quota`` records of at most ``small`` bytes stay within ``max_bytes``: the sum is
    # kept item by item only from the first longer one on (most runs never see one).
    small = max_bytes // max(quota, 1) - item_overhead
    counting = False
    size = 0
    for key, raw in cursor:
        if key[:1] != TAG_ITEM:
            break
        flags = raw[0]
        if flags & _FLAG_LEASED:
            continue
        at = seq_of(key)
        if skip and at in skip:
            continue
        if counting or len(raw) > small:
            if not counting:
                counting = True
                size = sum(map(len, records)) + len(records) * item_overhead
            cost = len(raw) + item_overhead
            if size + cost > max_bytes and (seqs or not take_first):
                run.full = True
                break
            size += cost
        seq = at
        if flags != _PLAIN_FLAGS or raw[lengths] != no_strings:
            run.other = (seq, raw)
            break
        _flags, tries, created, expire = unpack(raw)
        if expire <= now or (max_attempts and tries >= max_attempts):
            run.other = (seq, raw)
            break
        seqs.append(seq)
        records.append(raw)
        payloads.append(raw[head:])
        attempts.append(tries + 1)
        created_at.append(created)
        expires.append(expire)
        if len(seqs) >= quota:
            break
    run.last_seq = seq
    run.size = sum(map(len, records)) + len(records) * item_overhead
    return run


def put(txn: lmdb.Transaction[bytes], db: Any, record: LeaseRecord) -> None:
    txn.put(key_of(record.first), encode(record), db=db)


def delete(txn: lmdb.Transaction[bytes], db: Any, first: int) -> None:
    txn.delete(key_of(first), db=db)


def read_all(txn: lmdb.Transaction[bytes], db: Any) -> list[LeaseRecord]:
    """Every open lease record of a partition, by first seq."""
    cursor = txn.cursor(db=db)
    out: list[LeaseRecord] = []
    if not cursor.set_range(TAG_LEASE):
        return out
    for key, value in cursor:
        if key[:1] != TAG_LEASE:
            break
        out.append(decode(_KEY.unpack(key)[1], value))
    return out


class BrokenLease(RuntimeError):
    """A lease record's item is missing or flagged leased: a bug, never a client error."""


_LEASED_FIXED = struct.Struct("<BI")
_TIMES = struct.Struct("<q")


def write_out(txn: lmdb.Transaction[bytes], db: Any, record: LeaseRecord) -> None:
    """Rewrite each item of ``record`` as leased (one attempt more, the lease's deadline
    and time), exactly as a lease that rewrites its items leaves them, and delete the
    record."""
    cursor = txn.cursor(db=db)
    deadline, at = _TIMES.pack(record.deadline), _TIMES.pack(record.leased_at)
    unpack = _STATE_FIXED.unpack_from
    for seq in record.seqs():
        key = item_key(seq)
        if not cursor.set_key(key):
            raise BrokenLease(f"item {seq} of the lease record at {record.first} is not stored")
        raw = cursor.value()
        if raw[0] & _FLAG_LEASED:
            raise BrokenLease(f"item {seq} of the lease record at {record.first} is flagged leased")
        flags, attempts = unpack(raw)[:2]
        # flags, attempts | created_at, expire kept | lease deadline | enqueue_at kept | leased_at
        cursor.put(
            key, b"".join((_LEASED_FIXED.pack(flags | _FLAG_LEASED, attempts + 1), raw[5:21], deadline, raw[29:37], at, raw[45:]))
        )
    delete(txn, db, record.first)


def complete(txn: lmdb.Transaction[bytes], db: Any, record: LeaseRecord) -> None:
    """Delete the items of ``record`` (all of them: its lease completed whole), their
    expiry runs once empty, and the record, without reading the items."""
    cursor = txn.cursor(db=db)
    remove = cursor.delete
    for first, last, _expire in record.segments:
        if not cursor.set_key(item_key(first)):
            raise BrokenLease(f"item {first} of the lease record at {record.first} is not stored")
        # Keys between two item keys are item keys, at most one per seq: if the one left
        # after deleting all but one is ``last``, every seq was stored and nothing past
        # the segment was touched (else the step fails and its transaction is dropped).
        for _ in range(last - first):
            remove()
        if cursor.key() != item_key(last):
            raise BrokenLease(f"an item of the lease record at {record.first} ({first}..{last}) is not stored")
        remove()
    delete(txn, db, record.first)
    for first, last, expire in record.segments:
        drop_empty_runs_over(txn, db, expire, first, last)
