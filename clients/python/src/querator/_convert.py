"""Python values <-> protobuf values (times, durations, payloads)."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from google.protobuf import duration_pb2, timestamp_pb2

Seconds = timedelta | float | int | str
"""A duration: a :class:`~datetime.timedelta`, a number of seconds, or text such as
``"30s"``, ``"500ms"``, ``"5m"``, ``"1h30m"``, ``"2d"`` (:func:`parse_duration`)."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> timedelta:
    """``"1.5"`` (seconds), ``"500ms"``, ``"30s"``, ``"5m"``, ``"1h30m"``, ``"2d"``.

    The one parser behind every duration the SDK and the command line accept as text;
    ValueError names the text and gives examples.
    """
    value = text.strip()
    try:
        return timedelta(seconds=float(value))
    except ValueError:
        pass
    pos, total = 0, 0.0
    for match in _DURATION.finditer(value):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(value) or not value:
        raise ValueError(f"not a duration: {text!r} (e.g. 30s, 500ms, 5m, 1h30m)")
    return timedelta(seconds=total)


def as_timedelta(value: Seconds) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, str):
        return parse_duration(value)
    return timedelta(seconds=float(value))


def seconds(value: Seconds) -> float:
    """``value`` as float seconds; refuses negative durations."""
    out = as_timedelta(value).total_seconds()
    if out < 0:
        raise ValueError(f"a duration must not be negative, got {value!r}")
    return out


def to_duration(value: Seconds) -> duration_pb2.Duration:
    micros = round(seconds(value) * 1_000_000)
    return duration_pb2.Duration(seconds=micros // 1_000_000, nanos=(micros % 1_000_000) * 1000)


def from_duration(value: duration_pb2.Duration) -> timedelta:
    return timedelta(seconds=value.seconds, microseconds=value.nanos // 1000)


def utc(value: datetime) -> datetime:
    """``value`` in UTC; a naive datetime is refused (its zone would be a guess)."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"datetime values must be timezone-aware (e.g. datetime.now(UTC)), got {value!r}")
    return value.astimezone(UTC)


def to_timestamp(value: datetime) -> timestamp_pb2.Timestamp:
    delta = utc(value) - _EPOCH
    micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    return timestamp_pb2.Timestamp(seconds=micros // 1_000_000, nanos=(micros % 1_000_000) * 1000)


def from_timestamp(value: timestamp_pb2.Timestamp) -> datetime:
    return _EPOCH + timedelta(seconds=value.seconds, microseconds=value.nanos // 1000)


def from_micros(value: int) -> datetime:
    """Microseconds since the Unix epoch (LeaseColumns) as a UTC datetime."""
    return _EPOCH + timedelta(microseconds=value)


def optional_timestamp(message: object, name: str) -> datetime | None:
    """The timestamp field ``name`` of ``message``, or None when unset or zero."""
    if not message.HasField(name):  # type: ignore[attr-defined]
        return None
    ts: timestamp_pb2.Timestamp = getattr(message, name)
    if ts.seconds == 0 and ts.nanos == 0:
        return None
    return from_timestamp(ts)


def now() -> datetime:
    return datetime.now(UTC)


def payload_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
