"""Output: tables for people, JSON for scripts, progress on standard error."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, is_dataclass
from datetime import UTC, datetime, timedelta
from typing import IO, Any

from .._items import LeasedItem
from .._models import StoredItem

_PROGRESS_EVERY = 10_000


def plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if is_dataclass(value) and not isinstance(value, type):
        return {k: plain(v) for k, v in asdict(value).items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def emit_json(value: Any, out: IO[str]) -> None:
    json.dump(plain(value), out, separators=(",", ":"))
    out.write("\n")


def emit_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], out: IO[str]) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for row in [list(headers), *cells]:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"
    if isinstance(value, timedelta):
        return _human_duration(value)
    return str(value)


def _human_duration(value: timedelta) -> str:
    s = value.total_seconds()
    if s and s < 1:
        return f"{s * 1000:g}ms"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size and s % size == 0:
            return f"{s / size:g}{unit}"
    return f"{s:g}s"


def payload_fields(payload: bytes) -> dict[str, str]:
    """JSON form of a payload: ``payload`` when it is UTF-8 text, else ``payload_base64``."""
    try:
        return {"payload": payload.decode()}
    except UnicodeDecodeError:
        return {"payload_base64": base64.b64encode(payload).decode()}


def payload_cell(payload: bytes, width: int = 60) -> str:
    try:
        text = payload.decode().replace("\n", "\\n")
    except UnicodeDecodeError:
        text = ""
    if not text.isprintable() or not text and payload:
        text = "base64:" + base64.b64encode(payload).decode()
    return text if len(text) <= width else text[: width - 3] + "..."


def error_cell(text: str, width: int = 50) -> str | None:
    """The first line of a failure text (type and message), for a table cell."""
    if not text:
        return None
    line = text.splitlines()[0] if text.strip() else text.strip()
    return line if len(line) <= width else line[: width - 3] + "..."


def leased_json(item: LeasedItem) -> dict[str, Any]:
    return {
        "queue_name": item.queue_name,
        "partition": item.partition,
        "id": item.id,
        "attempts": item.attempts,
        "lease_deadline": item.lease_deadline.isoformat(),
        "created_at": item.created_at.isoformat(),
        "encoding": item.encoding,
        "kind": item.kind,
        "reference": item.reference,
        "metadata": dict(item.metadata),
        "message_id": item.message_id,
        "last_error": item.last_error,
        "last_error_at": item.last_error_at.isoformat() if item.last_error_at else None,
        "priority": item.priority,
        **payload_fields(item.payload),
    }


def stored_json(item: StoredItem) -> dict[str, Any]:
    out = plain(item)
    out.pop("payload")
    out.update(payload_fields(item.payload))
    return dict(out)


class Progress:
    """A count so far, on stderr: a live line on a terminal, a line per 10,000 otherwise.

    ``verb``: what the count is of, e.g. ``"produced"`` or ``"listed"``.
    """

    def __init__(self, stream: IO[str], verb: str = "produced") -> None:
        self.stream = stream
        self.verb = verb
        self.tty = stream.isatty()
        self.shown = 0
        self.count = 0

    def __call__(self, count: int) -> None:
        self.count = count
        if self.tty:
            self.stream.write(f"\r{self.verb} {count} items")
            self.stream.flush()
            self.shown = count
        elif count - self.shown >= _PROGRESS_EVERY:
            self.stream.write(f"{self.verb} {count} items\n")
            self.stream.flush()
            self.shown = count

    def finish(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\n")
        elif self.count >= 1000 and self.shown != self.count:
            self.stream.write(f"{self.verb} {self.count} items\n")
