"""Item ids: opaque to callers, a fencing token to us.

An id names the queue's storage uid, the partition and the item's sequence number,
and for scheduled items also the due time (the key of a scheduled item). A seq is
never reused in a partition and a uid never reused in a data dir, so an id from an
expired lease, a completed item, another partition or a deleted queue of the same
name never matches a live item.
"""

from __future__ import annotations

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


def parse_id(text: str) -> ItemRef | None:
    """The parts of an id, or None when ``text`` is not one of ours."""
    if len(text) > 80:
        return None
    parts = text.split(".")
    try:
        if len(parts) == 3:
            return ItemRef(int(parts[0], 16), int(parts[1], 16), int(parts[2], 16), 0)
        if len(parts) == 4:
            due = int(parts[3], 16)
            if due > 0:
                return ItemRef(int(parts[0], 16), int(parts[1], 16), int(parts[2], 16), due)
    except ValueError:
        return None
    return None
