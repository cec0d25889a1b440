"""Protobuf values to domain values and back, with the contract's validation."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import duration_pb2, timestamp_pb2

from ..clock import now_us
from ..errors import InvalidArgument, quote
from ..model import (
    DEFAULT_PAGE_SIZE,
    MAX_BATCH,
    MAX_LABEL_BYTES,
    MAX_METADATA_BYTES,
    MAX_METADATA_PAIRS,
    MAX_PAGE_SIZE,
    MAX_PRIORITY,
    MAX_QUEUE_NAME,
    MAX_REFERENCE_BYTES,
    MAX_SOURCE_ID_BYTES,
    check_key,
)

# 0001-01-01 .. 9999-12-31 as protobuf allows; we also refuse times before 1970.
_MAX_SECONDS = 253_402_300_799


def queue_name(value: str, field: str = "queue_name") -> str:
    if not value:
        raise InvalidArgument(field, "is required")
    if len(value) > MAX_QUEUE_NAME:
        raise InvalidArgument(field, f"must be at most {MAX_QUEUE_NAME} characters, got {len(value)}")
    for ch in value:
        if ch.isspace():
            raise InvalidArgument(field, f"must not contain whitespace: {quote(value)}")
        if ch in "~/":
            raise InvalidArgument(field, f"must not contain {ch!r}: {quote(value)}")
        if not ch.isprintable():
            raise InvalidArgument(field, f"must not contain control characters: {quote(value)}")
    return value


def timestamp_us(ts: timestamp_pb2.Timestamp, field: str) -> int:
    if not 0 <= ts.seconds <= _MAX_SECONDS or not 0 <= ts.nanos <= 999_999_999:
        raise InvalidArgument(field, "must be a valid time between 1970 and 9999")
    return ts.seconds * 1_000_000 + ts.nanos // 1000


def optional_timestamp_us(msg: object, name: str, field: str) -> int:
    if not msg.HasField(name):  # type: ignore[attr-defined]
        return 0
    return timestamp_us(getattr(msg, name), field)


def duration_us(d: duration_pb2.Duration, field: str, *, maximum_us: int) -> int:
    """A duration of 0, or of 1 µs (the server's resolution) to ``maximum_us``."""
    if d.seconds < 0 or d.nanos < 0 or d.nanos > 999_999_999:
        raise InvalidArgument(field, "must not be negative")
    if d.seconds > maximum_us // 1_000_000 + 1:
        raise InvalidArgument(field, f"must be at most {_spoken(maximum_us)}")
    value = d.seconds * 1_000_000 + d.nanos // 1000
    if value > maximum_us:
        raise InvalidArgument(field, f"must be at most {_spoken(maximum_us)}")
    if not value and d.nanos:
        # Truncated to 0 it would mean "the default" (or "no limit"), not "very short".
        raise InvalidArgument(field, "must be 0 or at least 1 microsecond, the server's resolution")
    return value


def optional_duration_us(msg: object, name: str, field: str, *, maximum_us: int) -> int:
    if not msg.HasField(name):  # type: ignore[attr-defined]
        return 0
    return duration_us(getattr(msg, name), field, maximum_us=maximum_us)


def future_timestamp_us(msg: object, name: str, field: str, *, within_us: int, now: int) -> int:
    """An optional time (0 when unset) no later than ``within_us`` from ``now``."""
    value = optional_timestamp_us(msg, name, field)
    if value > now + within_us:
        raise InvalidArgument(field, f"must be at most {_spoken(within_us)} from now")
    return value


def _spoken(us: int) -> str:
    for unit, size in (("years", 365 * 86_400_000_000), ("hours", 3_600_000_000), ("minutes", 60_000_000)):
        if us >= size and us % size == 0:
            return f"{us // size} {unit}"
    return f"{us / 1_000_000:g} seconds"


def to_timestamp(us: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=us // 1_000_000, nanos=(us % 1_000_000) * 1000)


def to_duration(us: int) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=us // 1_000_000, nanos=(us % 1_000_000) * 1000)


def count(values: Sequence[object], field: str, *, noun: str = "items") -> None:
    if not values:
        raise InvalidArgument(field, f"must hold at least one of the {noun}")
    if len(values) > MAX_BATCH:
        raise InvalidArgument(field, f"must hold at most {MAX_BATCH} {noun}, got {len(values)}")


def ids(values: Sequence[str], field: str = "ids", *, template: str = "{field}[{index}]") -> list[str]:
    """Check a list of ids; ``template`` names one entry in errors (e.g. ``items[{index}].id``)."""
    count(values, field, noun="ids")
    checked = list(values)
    if "" not in checked and len(set(checked)) == len(checked):
        return checked  # the common case, checked in C; the loop below names the culprit
    seen: set[str] = set()
    for index, value in enumerate(values):
        if not value:
            raise InvalidArgument(template.format(field=field, index=index), "must not be empty")
        if value in seen:
            raise InvalidArgument(template.format(field=field, index=index), f"repeats id {quote(value)}")
        seen.add(value)
    return list(values)


key = check_key


def source_id(value: str, field: str) -> str:
    """An imported item's source_id: at most MAX_SOURCE_ID_BYTES bytes of UTF-8 (a storage key)."""
    if len(value) > MAX_SOURCE_ID_BYTES // 4 and len(value.encode()) > MAX_SOURCE_ID_BYTES:
        raise InvalidArgument(field, f"must be at most {MAX_SOURCE_ID_BYTES} bytes, got {len(value.encode())}")
    return value


def group_key(item: Any, field: str) -> str:
    """A ProduceItem's group_key: a key as idempotency keys are, never with enqueue_at
    (a group's order is produce order; a scheduled item would have to jump its queue)."""
    value = str(item.group_key)
    if not value:
        return ""
    check_key(value, field)
    if item.HasField("enqueue_at"):
        raise InvalidArgument(field, "cannot be combined with enqueue_at (a group's items go in produce order)")
    return value


def text(value: str, field: str, limit: int) -> str:
    """Free text of at most ``limit`` bytes of UTF-8."""
    if value and (len(value) > limit or len(value.encode()) > limit):
        raise InvalidArgument(field, f"must be at most {limit} bytes of UTF-8, got {len(value.encode())}")
    return value


def item_labels(item: object, field: str) -> None:
    """Check an item's encoding, kind and reference (``field`` names the item)."""
    for name, limit in (("encoding", MAX_LABEL_BYTES), ("kind", MAX_LABEL_BYTES), ("reference", MAX_REFERENCE_BYTES)):
        text(getattr(item, name), f"{field}.{name}", limit)


def priority(value: int, field: str) -> int:
    """An item's priority: 0 to MAX_PRIORITY."""
    if not 0 <= value <= MAX_PRIORITY:
        raise InvalidArgument(field, f"must be 0 to {MAX_PRIORITY}, got {value}")
    return value


def metadata(pairs: Mapping[str, str], field: str) -> dict[str, str]:
    """Item metadata: at most MAX_METADATA_PAIRS pairs, MAX_METADATA_BYTES in all."""
    if not pairs:
        return {}
    if len(pairs) > MAX_METADATA_PAIRS:
        raise InvalidArgument(field, f"must hold at most {MAX_METADATA_PAIRS} pairs, got {len(pairs)}")
    size = 0
    for name, value in pairs.items():
        if not 1 <= len(name) <= 256:
            raise InvalidArgument(field, f"keys must be 1 to 256 characters, got {quote(name)}")
        size += len(name.encode()) + len(value.encode())
    if size > MAX_METADATA_BYTES:
        raise InvalidArgument(field, f"must be at most {MAX_METADATA_BYTES} bytes in all, got {size}")
    return dict(pairs)


def partition(value: int, partitions: int, field: str = "partition") -> int:
    if not 0 <= value < partitions:
        raise InvalidArgument(field, f"must be between 0 and {partitions - 1}, got {value}")
    return value


def page_size(value: int, field: str = "page_size") -> int:
    if value < 0:
        raise InvalidArgument(field, "must not be negative")
    if value == 0:
        return DEFAULT_PAGE_SIZE
    return min(value, MAX_PAGE_SIZE)


# -- page tokens: opaque, signed, bound to what they page over ------------------------

# 2: signed with HMAC-SHA256 under the data directory's secret (storage/local_catalog.py),
# cut to 16 bytes. Format 1 carried a CRC, which anyone can compute: a made-up cursor
# reached storage (a seq of 2**64 - 1 overflowed in the middle of the queue's cycle).
_TOKEN_FORMAT = 2
_MAC_BYTES = 16
_NOT_OURS = "is not a page token this server issued for this listing"


def _mac(secret: bytes, data: bytes) -> bytes:
    return hmac.new(secret, data, hashlib.sha256).digest()[:_MAC_BYTES]


def encode_token(secret: bytes, kind: bytes, payload: bytes) -> str:
    data = bytes([_TOKEN_FORMAT]) + kind + payload
    return base64.urlsafe_b64encode(data + _mac(secret, data)).decode().rstrip("=")


def decode_token(secret: bytes, token: str, kind: bytes, field: str = "page_token") -> bytes:
    """The payload of a token this server issued for a listing of ``kind``."""
    try:
        data = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (ValueError, TypeError):
        data = b""
    body, check = data[:-_MAC_BYTES], data[-_MAC_BYTES:]
    if (
        len(data) < 2 + len(kind) + _MAC_BYTES
        or not hmac.compare_digest(_mac(secret, body), check)
        or body[0] != _TOKEN_FORMAT
        or body[1 : 1 + len(kind)] != kind
    ):
        raise InvalidArgument(field, _NOT_OURS)
    return body[1 + len(kind) :]


__all__ = ["now_us"]
