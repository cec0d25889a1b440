"""Item ids: opaque to callers, a fencing token to us.

An id names the queue's storage uid, the partition and the item's sequence number,
and for scheduled items also the due time (the key of a scheduled item). A seq is
never reused in a partition and a uid never reused in a data dir, so an id from an
expired lease, a completed item, another partition or a deleted queue of the same
name never matches a live item.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class ItemRef(NamedTuple):
    uid: int
    partition: int
    seq: int
    due: int  # 0 unless the id names a scheduled item


def item_id(uid: int, partition: int, seq: int) -> str:
    return f"{uid:x}.{partition:x}.{seq:x}"


def scheduled_id(uid: int, partition: int, seq: int, due: int) -> str:
    return f"{uid:x}.{partition:x}.{seq:x}.{due:x}"


_HEX = re.compile(r"[0-9a-f]{1,16}")
_MAX_PARTITION = 0xFFFF


def parse_id(text: str) -> ItemRef | None:
    """The parts of an id, or None when ``text`` is not exactly an id we issue.

    Only lowercase hex fields of at most 64 bits are accepted, so "-1", "0x1",
    "1_0" or an overflowing number never reach the storage key encoders.
    """
    if len(text) > 80:
        return None
    parts = text.split(".")
    if len(parts) not in (3, 4) or not all(_HEX.fullmatch(part) for part in parts):
        return None
    uid, partition, seq = (int(part, 16) for part in parts[:3])
    if partition > _MAX_PARTITION:
        return None
    due = int(parts[3], 16) if len(parts) == 4 else 0
    if len(parts) == 4 and due == 0:
        return None
    return ItemRef(uid, partition, seq, due)
