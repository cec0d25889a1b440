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


_ID = re.compile(r"([0-9a-f]{1,16})\.([0-9a-f]{1,4})\.([0-9a-f]{1,16})(?:\.([0-9a-f]{1,16}))?")


def parse_id(text: str) -> ItemRef | None:
    """The parts of an id, or None when ``text`` is not exactly an id we issue.

    Only lowercase hex fields of at most 64 bits (16 bits for the partition) are
    accepted, so "-1", "0x1", "1_0" or an overflowing number never reach the
    storage key encoders.
    """
    match = _ID.fullmatch(text)
    if match is None:
        return None
    uid, partition, seq, due = match.groups()
    if due is None:
        # tuple.__new__: NamedTuple's generated __new__ is Python and costs a third of
        # this function, which runs for every id a Complete, Retry or Extend names.
        return _new_ref(ItemRef, (int(uid, 16), int(partition, 16), int(seq, 16), 0))
    due_us = int(due, 16)
    return ItemRef(int(uid, 16), int(partition, 16), int(seq, 16), due_us) if due_us else None


_new_ref = tuple.__new__
