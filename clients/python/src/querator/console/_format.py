"""How the pages show values: payload previews, ages, durations, the depth chart."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from ._sampler import Sample

# A preview shows at most this much of a payload; the rest is counted, not sent.
PREVIEW_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Preview:
    form: str  # "json", "text", "hex" or "empty"
    text: str
    size: int
    cut: bool


def preview(payload: bytes, encoding: str = "") -> Preview:
    """JSON pretty-printed when the payload parses as JSON, UTF-8 text when it decodes,
    else a hex dump; the first PREVIEW_BYTES only."""
    size = len(payload)
    if not size:
        return Preview("empty", "", 0, False)
    head = payload[:PREVIEW_BYTES]
    cut = size > PREVIEW_BYTES
    if not cut:
        try:
            value = json.loads(payload)
        except (ValueError, RecursionError):
            pass
        else:
            if isinstance(value, (dict, list)) or "json" in encoding:
                return Preview("json", json.dumps(value, indent=2, ensure_ascii=False)[:PREVIEW_BYTES * 2], size, False)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A multi-byte character cut at the end of the preview is still text.
        if cut and exc.start >= len(head) - 3:
            text = head[: exc.start].decode("utf-8")
        else:
            return Preview("hex", hexdump(head), size, cut)
    if any(ord(ch) < 32 and ch not in "\t\r\n" for ch in text):
        return Preview("hex", hexdump(head), size, cut)
    return Preview("text", text, size, cut)


def hexdump(data: bytes, width: int = 16) -> str:
    lines = []
    for at in range(0, len(data), width):
        chunk = data[at : at + width]
        shown = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{at:08x}  {chunk.hex(' '):<{width * 3}} {shown}")
    return "\n".join(lines)


def seconds_text(seconds: float) -> str:
    """``850ms``, ``42s``, ``7m 5s``, ``3h 20m``, ``2d 4h``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        big, small = f"{s // 60}m", f" {s % 60}s" if s % 60 else ""
    elif s < 86400:
        big, small = f"{s // 3600}h", f" {s % 3600 // 60}m" if s % 3600 // 60 else ""
    else:
        big, small = f"{s // 86400}d", f" {s % 86400 // 3600}h" if s % 86400 // 3600 else ""
    return big + small


def duration(value: Duration) -> str:
    total = value.seconds + value.nanos / 1e9
    return seconds_text(total) if total else "0"


def when(value: Timestamp) -> str:
    """A time as UTC text; empty when unset."""
    if not value.seconds and not value.nanos:
        return ""
    return value.ToDatetime().strftime("%Y-%m-%d %H:%M:%S UTC")


def age(value: Timestamp) -> str:
    if not value.seconds and not value.nanos:
        return ""
    return seconds_text(max(0.0, time.time() - (value.seconds + value.nanos / 1e9)))


@dataclass(frozen=True, slots=True)
class Chart:
    """A depth chart as SVG path data (drawn by the template, no script)."""

    width: int
    height: int
    line: str
    area: str
    top: int
    minutes: float
    points: int


def depth_chart(samples: Sequence[Sample], width: int = 600, height: int = 120) -> Chart | None:
    if len(samples) < 2:
        return None
    start, end = samples[0].at, samples[-1].at
    span = max(end - start, 1e-6)
    top = max(max(s.depth for s in samples), 1)
    points = [
        (round((s.at - start) / span * width, 1), round(height - s.depth / top * (height - 4) - 2, 1)) for s in samples
    ]
    line = "M" + " L".join(f"{x},{y}" for x, y in points)
    area = f"{line} L{width},{height} L0,{height} Z"
    return Chart(width, height, line, area, top, span / 60, len(samples))


def field(message: Any, name: str) -> Any:
    """A message's field, or None when this generated code does not have it (a field a
    newer proto adds, such as an item's ``last_error``, shows once it is there)."""
    if name not in message.DESCRIPTOR.fields_by_name:
        return None
    return getattr(message, name)
