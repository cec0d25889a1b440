"""The stored form of an item and the key layout of a partition.

A partition is one named LMDB database whose keys start with a one-byte tag:

- ``i`` + seq (8 bytes, big endian): a ready or leased item; key order is FIFO order.
- ``s`` + due time (8) + seq (8): a scheduled item, ordered by due time then produce order.
- ``x`` + expire deadline (8) + item key: the expiry index. An empty value indexes that
  one item. An 8-byte value (a seq) indexes the *run* of ready items from the key's seq
  to that one, produced together with one deadline: one entry for a whole batch instead
  of one per item. The items of a run carry the ``expiry run`` flag, so leaving their
  place deletes no entry of their own; the entry goes once none of its items is stored.
- ``d`` + seq (8): an item on its way to the dead-letter queue (the outbox); it leaves
  once the dead-letter queue has durably taken it.
- ``r`` + seq (8): an item being redriven to another queue (the redrive outbox); the
  value is the target queue's uid (8) and the item record. It leaves once the target
  has durably taken the item.
- ``u`` + source id: the key of the item that came from that source item (dead-letter
  queues only), so a dead letter sent twice across a crash is stored once.
- ``o`` + (255 - priority) (1 byte) + seq (8): the priority index, empty values. One
  entry per *ready* item of priority 1 to 9 (its record at ``i`` + seq); key order is
  highest priority first, then FIFO. A lease takes from it first, and only when it
  holds entries; priority-0 items are never in it, so a queue that uses no priorities
  has no such key and leases exactly as before. An entry whose item is gone, leased or
  of another priority (left by an older server, which knows no priorities) is dropped
  by the lease that meets it.
- ``n``: the next sequence number, so a seq (and hence an id) is never reused.

Times are microseconds since the epoch; big-endian unsigned integers sort like numbers.

Record versions: a record is the header, the strings and the payload (catalog formats
1 to 3). An item that was re-queued, scheduled again, moved or dead-lettered also
carries its *history* (the id it was produced with; why, when and after how many
attempts it died): a block between the strings and the payload, marked by a flag bit,
so a record without the bit is read as before, and the records of fresh items (all but
a few) are as small and as cheap to lease as they were. Catalog format 4 marks a data
directory whose records may hold the block, which older servers would misread.

An item that failed with a text (RetryItem.error, or a lease that ran out) carries its
*last error* at the end of the history block, marked by a second flag bit: records
without it (all those written before format 5) read as before, with no error. Catalog
format 5 marks a data directory whose records may hold it.

An item of an ordered group (ProduceItem.group_key) carries its group key in its
history block, after the message id and before any error, marked by the top bit of the
block's dead-reason byte (reasons are below 128; the flags byte has no bit to spare):
records without it read as before. Catalog format 6 marks a data directory whose
records may hold it. Where a group's items wait is storage/ordered_groups.py.

An item's *priority* (0 to 9) is the top four bits of the flags byte: records written
before priorities have them clear and read as priority 0. An older server reading a
record with them set serves it as priority 0, FIFO (it ignores the ``o`` keys), so no
catalog format marks them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

TAG_ITEM = b"i"
TAG_SCHEDULED = b"s"
TAG_EXPIRY = b"x"
TAG_OUTBOX = b"d"
TAG_SOURCE = b"u"
TAG_REDRIVE = b"r"
TAG_PRIORITY = b"o"
KEY_NEXT_SEQ = b"n"
# Ordered groups (storage/ordered_groups.py): ``g`` + group + seq, an item waiting behind its
# group's head; ``h`` + group, a group that has a head (ready, leased or held by a
# delayed retry); ``k``, the partition count that places group keys (partition 0).
TAG_WAITING = b"g"
TAG_GROUP_HEAD = b"h"
KEY_GROUP_PARTITIONS = b"k"

_U64 = struct.Struct(">Q")
_ITEM_KEY = struct.Struct(">cQ")
_SCHED_KEY = struct.Struct(">cQQ")
_PRIORITY_KEY = struct.Struct(">cBQ")
_EXPIRY_PREFIX = struct.Struct(">cQ")

# flags, attempts, created_at, expire_deadline, lease_deadline, enqueue_at, leased_at,
# then the byte lengths of source_id, reference, encoding, kind, lease_key and the
# metadata (JSON, empty when there is none); the payload is the rest.
_HEADER = struct.Struct("<BIqqqqqIIIIII")
_FLAG_LEASED = 1
# Indexed by an expiry run (see the module docstring) rather than an entry of its own.
_FLAG_EXPIRY_RUN = 2
# A history block (_HISTORY and the message id) follows the metadata.
_FLAG_HISTORY = 4
# The history block ends with the last error (_ERROR and its text); set only with
# _FLAG_HISTORY, so every path that passes over history-less records skips it too.
_FLAG_ERROR = 8
# The item's priority, 0 to 9 (see the module docstring).
_PRIORITY_SHIFT = 4
_PRIORITY_MASK = 0xF0
# Flags a lease rewrite keeps as they were.
_KEPT_FLAGS = _FLAG_EXPIRY_RUN | _FLAG_HISTORY | _FLAG_ERROR | _PRIORITY_MASK
# In the history block's dead-reason byte: a group block (_GROUP_LEN and the group key)
# follows the message id.
_HISTORY_GROUP = 0x80
_GROUP_LEN = struct.Struct("<H")
# dead_reason, dead_at, dead_attempts, byte length of the message id.
_HISTORY = struct.Struct("<BqII")
# last_error_at, byte length of the last error's text.
_ERROR = struct.Struct("<qI")

# Why an item was dead-lettered (DeadReason in the API; 0: it was not).
DEAD_MAX_ATTEMPTS = 1
DEAD_EXPIRED = 2
DEAD_RETRIED = 3
# The fixed part of the header: what lease and extend rewrite without decoding the
# strings and payload behind it.
_STATE_FIXED = struct.Struct("<BIqqqqq")


def item_key(seq: int) -> bytes:
    return _ITEM_KEY.pack(TAG_ITEM, seq)


def outbox_key(seq: int) -> bytes:
    return _ITEM_KEY.pack(TAG_OUTBOX, seq)


def redrive_key(seq: int) -> bytes:
    return _ITEM_KEY.pack(TAG_REDRIVE, seq)


def source_key(source_id: str) -> bytes:
    return TAG_SOURCE + source_id.encode()


def scheduled_key(due_us: int, seq: int) -> bytes:
    return _SCHED_KEY.pack(TAG_SCHEDULED, due_us, seq)


def expiry_key(expire_deadline_us: int, key: bytes) -> bytes:
    return _EXPIRY_PREFIX.pack(TAG_EXPIRY, expire_deadline_us) + key


def expiry_prefix(expire_deadline_us: int) -> bytes:
    """The start of every expiry key with this deadline (``expiry_key`` minus the item key)."""
    return _EXPIRY_PREFIX.pack(TAG_EXPIRY, expire_deadline_us)


def priority_key(priority: int, seq: int) -> bytes:
    return _PRIORITY_KEY.pack(TAG_PRIORITY, 255 - priority, seq)


def parse_priority_key(key: bytes) -> tuple[int, int]:
    """(priority, seq) of a priority index key."""
    _, inverted, seq = _PRIORITY_KEY.unpack(key)
    return 255 - inverted, seq


def priority_of(raw: bytes) -> int:
    """The priority of a stored record, from its flags byte."""
    return raw[0] >> _PRIORITY_SHIFT


def seq_of_item_key(key: bytes) -> int:
    return int(_ITEM_KEY.unpack(key)[1])


def parse_scheduled_key(key: bytes) -> tuple[int, int]:
    _, due, seq = _SCHED_KEY.unpack(key)
    return due, seq


def parse_expiry_key(key: bytes) -> tuple[int, bytes]:
    _, deadline = _EXPIRY_PREFIX.unpack_from(key)
    return deadline, key[_EXPIRY_PREFIX.size :]


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)


def decode_u64(data: bytes) -> int:
    return int(_U64.unpack(data)[0])


@dataclass(slots=True)
class Item:
    """Every stored field of an item."""

    payload: bytes
    encoding: str = ""
    kind: str = ""
    reference: str = ""
    source_id: str = ""
    created_at: int = 0
    expire_deadline: int = 0
    enqueue_at: int = 0
    attempts: int = 0
    is_leased: bool = False
    lease_deadline: int = 0
    leased_at: int = 0
    # The idempotent lease (LeaseRequest.lease_key) the item was last leased under.
    lease_key: str = ""
    # String pairs given at produce (e.g. trace context), passed to consumers.
    metadata: dict[str, str] = field(default_factory=dict)
    # Indexed by an expiry run, not by an expiry entry of its own (storage detail).
    expiry_run: bool = False
    # The history (see the module docstring). The stable id the item was produced
    # with, "" while it still has that id (so fresh items store nothing).
    message_id: str = ""
    # Set when the item was dead-lettered: why (DEAD_*), when, and after how many
    # attempts in the queue it died in.
    dead_reason: int = 0
    dead_at: int = 0
    dead_attempts: int = 0
    # What went wrong the last time the item failed (model.cut_error applied), and when.
    last_error: str = ""
    last_error_at: int = 0
    # The ordered group the item belongs to ("" for none).
    group_key: str = ""
    # 0 to 9, higher leased first (stored in the flags byte).
    priority: int = 0

    def encode(self) -> bytes:
        history = b""
        error = bool(self.last_error or self.last_error_at)
        if self.message_id or self.dead_reason or self.dead_at or self.dead_attempts or error or self.group_key:
            message_id = self.message_id.encode()
            reason = self.dead_reason | (_HISTORY_GROUP if self.group_key else 0)
            history = _HISTORY.pack(reason, self.dead_at, self.dead_attempts, len(message_id)) + message_id
            if self.group_key:
                group = self.group_key.encode()
                history += _GROUP_LEN.pack(len(group)) + group
            if error:
                text = self.last_error.encode()
                history += _ERROR.pack(self.last_error_at, len(text)) + text
        fixed = (
            (_FLAG_LEASED if self.is_leased else 0)
            | (_FLAG_EXPIRY_RUN if self.expiry_run else 0)
            | (_FLAG_HISTORY if history else 0)
            | (_FLAG_ERROR if error else 0)
            | (self.priority << _PRIORITY_SHIFT),
            self.attempts,
            self.created_at,
            self.expire_deadline,
            self.lease_deadline,
            self.enqueue_at,
            self.leased_at,
        )
        if not (self.source_id or self.reference or self.encoding or self.kind or self.lease_key or self.metadata):
            # Most items carry only a payload: skip six encodes and an eight-part join.
            return _HEADER.pack(*fixed, 0, 0, 0, 0, 0, 0) + history + self.payload
        source = self.source_id.encode()
        reference = self.reference.encode()
        encoding = self.encoding.encode()
        kind = self.kind.encode()
        lease_key = self.lease_key.encode()
        metadata = json.dumps(self.metadata, separators=(",", ":")).encode() if self.metadata else b""
        header = _HEADER.pack(
            *fixed, len(source), len(reference), len(encoding), len(kind), len(lease_key), len(metadata)
        )
        return b"".join((header, source, reference, encoding, kind, lease_key, metadata, history, self.payload))

    @classmethod
    def decode(cls, data: bytes) -> Item:
        (
            flags,
            attempts,
            created_at,
            expire_deadline,
            lease_deadline,
            enqueue_at,
            leased_at,
            n_source,
            n_reference,
            n_encoding,
            n_kind,
            n_lease_key,
            n_metadata,
        ) = _HEADER.unpack_from(data)
        pos = _HEADER.size
        view = bytes(data)
        source = reference = encoding = kind = lease_key = ""
        metadata: dict[str, str] = {}
        if n_source or n_reference or n_encoding or n_kind or n_lease_key or n_metadata:
            # Most items carry only a payload and skip this.
            source = view[pos : pos + n_source].decode() if n_source else ""
            pos += n_source
            reference = view[pos : pos + n_reference].decode() if n_reference else ""
            pos += n_reference
            encoding = view[pos : pos + n_encoding].decode() if n_encoding else ""
            pos += n_encoding
            kind = view[pos : pos + n_kind].decode() if n_kind else ""
            pos += n_kind
            lease_key = view[pos : pos + n_lease_key].decode() if n_lease_key else ""
            pos += n_lease_key
            metadata = json.loads(view[pos : pos + n_metadata]) if n_metadata else {}
            pos += n_metadata
        if flags & _FLAG_HISTORY:
            return cls._with_history(view, pos, flags, (created_at, expire_deadline, enqueue_at, attempts),
                                     (lease_deadline, leased_at), (source, reference, encoding, kind, lease_key), metadata)
        return cls(
            payload=view[pos:],
            encoding=encoding,
            kind=kind,
            reference=reference,
            source_id=source,
            created_at=created_at,
            expire_deadline=expire_deadline,
            enqueue_at=enqueue_at,
            attempts=attempts,
            is_leased=bool(flags & _FLAG_LEASED),
            lease_deadline=lease_deadline,
            leased_at=leased_at,
            lease_key=lease_key,
            metadata=metadata,
            expiry_run=bool(flags & _FLAG_EXPIRY_RUN),
            priority=flags >> _PRIORITY_SHIFT,
        )

    @classmethod
    def _with_history(
        cls,
        view: bytes,
        pos: int,
        flags: int,
        times: tuple[int, int, int, int],
        lease: tuple[int, int],
        strings: tuple[str, str, str, str, str],
        metadata: dict[str, str],
    ) -> Item:
        """``decode`` of a record with a history block at ``pos`` (apart, so that the
        records without one pay no more than they did)."""
        dead_reason, dead_at, dead_attempts, n_message_id = _HISTORY.unpack_from(view, pos)
        pos += _HISTORY.size
        message_id = view[pos : pos + n_message_id].decode()
        pos += n_message_id
        group_key = ""
        if dead_reason & _HISTORY_GROUP:
            dead_reason &= ~_HISTORY_GROUP
            (n_group,) = _GROUP_LEN.unpack_from(view, pos)
            pos += _GROUP_LEN.size
            group_key = view[pos : pos + n_group].decode()
            pos += n_group
        last_error, last_error_at = "", 0
        if flags & _FLAG_ERROR:
            last_error_at, n_error = _ERROR.unpack_from(view, pos)
            pos += _ERROR.size
            last_error = view[pos : pos + n_error].decode()
            pos += n_error
        created_at, expire_deadline, enqueue_at, attempts = times
        source, reference, encoding, kind, lease_key = strings
        return cls(
            payload=view[pos:],
            encoding=encoding,
            kind=kind,
            reference=reference,
            source_id=source,
            created_at=created_at,
            expire_deadline=expire_deadline,
            enqueue_at=enqueue_at,
            attempts=attempts,
            is_leased=bool(flags & _FLAG_LEASED),
            lease_deadline=lease[0],
            leased_at=lease[1],
            lease_key=lease_key,
            metadata=metadata,
            expiry_run=bool(flags & _FLAG_EXPIRY_RUN),
            message_id=message_id,
            dead_reason=dead_reason,
            dead_at=dead_at,
            dead_attempts=dead_attempts,
            last_error=last_error,
            last_error_at=last_error_at,
            group_key=group_key,
            priority=flags >> _PRIORITY_SHIFT,
        )


class ItemState(NamedTuple):
    """The lease-related fields of a stored item, read from its header alone."""

    is_leased: bool
    attempts: int
    created_at: int
    expire_deadline: int
    lease_deadline: int
    enqueue_at: int
    leased_at: int
    source_id: str
    lease_key: str
    expiry_run: bool
    # The item's ordered group ("" for none).
    group_key: str = ""


def read_state(raw: bytes) -> ItemState:
    (
        flags,
        attempts,
        created,
        expire,
        lease_deadline,
        enqueue_at,
        leased_at,
        n_source,
        n_reference,
        n_encoding,
        n_kind,
        n_lease_key,
        n_metadata,
    ) = _HEADER.unpack_from(raw)
    pos = _HEADER.size
    source = bytes(raw[pos : pos + n_source]).decode() if n_source else ""
    lease_key = group_key = ""
    if n_lease_key:
        pos += n_source + n_reference + n_encoding + n_kind
        lease_key = bytes(raw[pos : pos + n_lease_key]).decode()
    if flags & _FLAG_HISTORY:
        group_key = group_of(raw)
    # tuple.__new__ directly: NamedTuple's generated __new__ is Python and doubles the cost
    # of this function, which runs for every item a lease or an ack touches.
    leased, run = bool(flags & _FLAG_LEASED), bool(flags & _FLAG_EXPIRY_RUN)
    return _new_tuple(
        ItemState,
        (leased, attempts, created, expire, lease_deadline, enqueue_at, leased_at, source, lease_key, run, group_key),
    )


def _history_at(raw: bytes) -> int:
    """Where a record's history block starts (after the header and the strings)."""
    return _HEADER.size + int(sum(_STRING_LENGTHS.unpack_from(raw, _STATE_FIXED.size)))


def grouped(raw: bytes) -> bool:
    """Whether a record is of an ordered group."""
    return bool(raw[0] & _FLAG_HISTORY and raw[_history_at(raw)] & _HISTORY_GROUP)


def group_of(raw: bytes) -> str:
    """The group key of a record ("" for an item of no group)."""
    if not raw[0] & _FLAG_HISTORY:
        return ""
    pos = _history_at(raw)
    if not raw[pos] & _HISTORY_GROUP:
        return ""
    pos += _HISTORY.size + _HISTORY.unpack_from(raw, pos)[3]
    (n_group,) = _GROUP_LEN.unpack_from(raw, pos)
    pos += _GROUP_LEN.size
    return bytes(raw[pos : pos + n_group]).decode()


_new_tuple = tuple.__new__


def with_lease(raw: bytes, state: ItemState, *, attempts: int, deadline: int, leased_at: int) -> bytes:
    """``raw`` rewritten as leased with these lease fields; everything else kept."""
    flags = _FLAG_LEASED | (raw[0] & _KEPT_FLAGS)
    head = _STATE_FIXED.pack(
        flags, attempts, state.created_at, state.expire_deadline, deadline, state.enqueue_at, leased_at
    )
    return head + raw[_STATE_FIXED.size :]


def without_lease(raw: bytes, state: ItemState, *, attempts: int) -> bytes:
    """``raw`` rewritten as ready (not leased) with ``attempts``; everything else kept."""
    flags = raw[0] & _KEPT_FLAGS
    head = _STATE_FIXED.pack(flags, attempts, state.created_at, state.expire_deadline, 0, state.enqueue_at, 0)
    return head + raw[_STATE_FIXED.size :]


def with_lease_key(raw: bytes, *, attempts: int, deadline: int, leased_at: int, lease_key: str) -> bytes:
    """``raw`` rewritten as leased under ``lease_key`` ("" for none), strings and payload
    copied as bytes rather than decoded and encoded again."""
    header = list(_HEADER.unpack_from(raw))
    n_source, n_reference, n_encoding, n_kind, n_lease_key = header[7:12]
    start = _HEADER.size + n_source + n_reference + n_encoding + n_kind
    key = lease_key.encode()
    header[0] = _FLAG_LEASED | (header[0] & _KEPT_FLAGS)
    header[1] = attempts
    header[4] = deadline
    header[6] = leased_at
    header[11] = len(key)
    return b"".join((_HEADER.pack(*header), raw[_HEADER.size : start], key, raw[start + n_lease_key :]))


def plain_header(created_at: int, expire_deadline: int, *, expiry_run: bool = False) -> bytes:
    """The header of a fresh item that carries only a payload: ``Item(payload,
    created_at=..., expire_deadline=..., expiry_run=...).encode()`` is this plus the payload."""
    flags = _FLAG_EXPIRY_RUN if expiry_run else 0
    return _HEADER.pack(flags, 0, created_at, expire_deadline, 0, 0, 0, 0, 0, 0, 0, 0, 0)


_NO_STRINGS = bytes(24)  # the six string lengths of a payload-only item, all zero
_LENGTHS = slice(_STATE_FIXED.size, _HEADER.size)


# What a plain lease writes over the fixed header: flags and attempts, then created_at and
# the expire deadline kept, the lease deadline, enqueue_at kept, leased_at.
_FLAGS_ATTEMPTS = struct.Struct("<BI")
_I64 = struct.Struct("<q")
_STRING_LENGTHS = struct.Struct("<IIIIII")
_CREATED_EXPIRE = slice(_FLAGS_ATTEMPTS.size, _FLAGS_ATTEMPTS.size + 16)
_ENQUEUE_AT = slice(_CREATED_EXPIRE.stop + 8, _CREATED_EXPIRE.stop + 16)
assert _ENQUEUE_AT.stop + 8 == _STATE_FIXED.size and _STRING_LENGTHS.size == _HEADER.size - _STATE_FIXED.size

# Flags a plain lease keeps (a plain record has no history or error).
_PLAIN_KEPT = _FLAG_EXPIRY_RUN | _PRIORITY_MASK

PlainLeaser = Callable[[bytes], "tuple[bytes, bytes, int, int] | None"]


def plain_leaser(*, now: int, max_attempts: int, deadline: int, key_bytes: bytes) -> PlainLeaser:
    """The rewrite of one lease (at ``now``, until ``deadline``, under the lease key
    ``key_bytes``) for the common item: a payload and nothing else, not tagged by a
    lease key, with no history, not due to die. It maps a record to (the leased record, its payload,
    attempts, created_at), or to None for every other item, which takes the general
    path (``read_state``, ``with_lease_key``, ``Item.decode``).

    A lease touches every item it hands out: the parts all of them share are packed
    once here, and each record is unpacked once and copied in slices.
    """
    unpack = _STATE_FIXED.unpack_from
    head = _FLAGS_ATTEMPTS.pack
    deadline_bytes, at_bytes = _I64.pack(deadline), _I64.pack(now)
    tail = _STRING_LENGTHS.pack(0, 0, 0, 0, len(key_bytes), 0) + key_bytes
    join = b"".join

    def lease(raw: bytes) -> tuple[bytes, bytes, int, int] | None:
        if raw[_LENGTHS] != _NO_STRINGS:
            return None
        flags, attempts, created, expire, _deadline, _enqueue_at, _leased_at = unpack(raw)
        if expire <= now or flags & _FLAG_HISTORY or (max_attempts and attempts >= max_attempts):
            return None
        attempts += 1
        payload = raw[_HEADER.size :]
        flags = _FLAG_LEASED | (flags & _PLAIN_KEPT)
        parts = (head(flags, attempts), raw[_CREATED_EXPIRE], deadline_bytes, raw[_ENQUEUE_AT], at_bytes, tail, payload)
        return join(parts), payload, attempts, created

    return lease
