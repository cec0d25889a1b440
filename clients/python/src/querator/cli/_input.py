"""Input: payload lines, JSON lines, ids (arguments or standard input)."""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import IO, Any

from .._models import DeadReason, Item, StoredItem
from ._common import UsageError, parse_time


def _payload_of(obj: dict[str, Any], where: str) -> bytes:
    if "payload_base64" in obj:
        try:
            return base64.b64decode(obj["payload_base64"], validate=True)
        except ValueError:
            raise UsageError(f"{where}: payload_base64 is not base64") from None
    value = obj.get("payload", obj.get("utf8", ""))
    if not isinstance(value, str):
        value = json.dumps(value, separators=(",", ":"))  # a JSON value as the payload
    return value.encode()


def _json_objects(lines: Iterable[str], name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: each line must be a JSON object")
        yield where, obj


def _metadata_of(obj: dict[str, Any], where: str) -> dict[str, str]:
    value = obj.get("metadata")
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise UsageError(f"{where}: metadata must be an object of strings, e.g. {{\"team\": \"billing\"}}")
    return value


def _time_field(obj: dict[str, Any], key: str, where: str) -> datetime | None:
    value = obj.get(key)
    if value in (None, ""):
        return None
    try:
        return parse_time(str(value))
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{where}: {key}: {exc}") from None


def _dead_reason_field(obj: dict[str, Any], where: str) -> DeadReason | None:
    value = obj.get("dead_reason")
    if not value:
        return None
    try:
        return DeadReason(str(value))
    except ValueError:
        known = ", ".join(reason.value for reason in DeadReason)
        raise UsageError(f"{where}: dead_reason: must be one of {known}, got {value!r}") from None


def produce_items(lines: Iterable[str], name: str, jsonl: bool) -> Iterator[Item | bytes]:
    if not jsonl:
        for line in lines:
            text = line.rstrip("\r\n")
            if text:
                yield text.encode()
        return
    for where, obj in _json_objects(lines, name):
        yield Item(
            _payload_of(obj, where),
            encoding=str(obj.get("encoding", "")),
            kind=str(obj.get("kind", "")),
            reference=str(obj.get("reference", "")),
            enqueue_at=_time_field(obj, "enqueue_at", where),
            idempotency_key=str(obj.get("idempotency_key", "")),
            metadata=_metadata_of(obj, where),
            priority=int(obj.get("priority", 0)),
        )


def import_items(lines: Iterable[str], name: str) -> Iterator[StoredItem]:
    for where, obj in _json_objects(lines, name):
        yield StoredItem(
            payload=_payload_of(obj, where),
            is_leased=bool(obj.get("is_leased", False)),
            lease_deadline=_time_field(obj, "lease_deadline", where),
            expire_deadline=_time_field(obj, "expire_deadline", where),
            enqueue_at=_time_field(obj, "enqueue_at", where),
            created_at=_time_field(obj, "created_at", where),
            attempts=int(obj.get("attempts", 0)),
            reference=str(obj.get("reference", "")),
            encoding=str(obj.get("encoding", "")),
            kind=str(obj.get("kind", "")),
            source_id=str(obj.get("source_id", "")),
            metadata=_metadata_of(obj, where),
            message_id=str(obj.get("message_id", "")),
            dead_reason=_dead_reason_field(obj, where),
            dead_at=_time_field(obj, "dead_at", where),
            dead_attempts=int(obj.get("dead_attempts", 0)),
            last_error=str(obj.get("last_error") or ""),
            last_error_at=_time_field(obj, "last_error_at", where),
            priority=int(obj.get("priority", 0)),
        )


def open_input(path: str) -> IO[str]:
    if path == "-":
        return sys.stdin
    try:
        return open(path, encoding="utf-8")  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def read_ids(ids: list[str]) -> list[str]:
    if not ids or ids == ["-"]:
        ids = sys.stdin.read().split()
    if not ids:
        raise UsageError("no ids given (as arguments or on standard input)")
    return ids
