"""The recent change sets of one shard on this node, encoded, for catch-up by tail.

Bounded by count and bytes: a copy whose position fell out of it catches up from a
snapshot instead. Both a primary (the change sets its cycles made) and a passive copy
(those it applied) fill it, so a copy promoted by a failover can bring the other
copies up to its own position without a snapshot.

Positions are compared qualified by epoch, never as bare lsns: a copy at (e, n) is
on this node's history when the change this ring holds at lsn n has epoch e, or when
(e, n) is this node's own last position.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum

RING_CHANGES = 20_000
RING_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    epoch: int
    lsn: int
    data: bytes


class Path(Enum):
    IN_STEP = "in_step"  # nothing to send
    TAIL = "tail"  # send the ring's entries after its position
    SNAPSHOT = "snapshot"  # older than the ring, ahead, or on another history


class ChangeRing:
    def __init__(self, max_changes: int = RING_CHANGES, max_bytes: int = RING_BYTES) -> None:
        self._entries: deque[Entry] = deque()
        self._bytes = 0
        self._max_changes = max_changes
        self._max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def add(self, epoch: int, lsn: int, data: bytes) -> None:
        """The next change of this node's history; a gap (after a snapshot installed
        here, say) starts the ring again, so it never holds a history with holes."""
        if self._entries and lsn != self._entries[-1].lsn + 1:
            self.clear()
        self._entries.append(Entry(epoch, lsn, data))
        self._bytes += len(data)
        while self._entries and (len(self._entries) > self._max_changes or self._bytes > self._max_bytes):
            self._bytes -= len(self._entries.popleft().data)

    @property
    def last(self) -> Entry | None:
        return self._entries[-1] if self._entries else None

    @property
    def first_lsn(self) -> int:
        return self._entries[0].lsn if self._entries else 0

    def path(self, copy: tuple[int, int], here: tuple[int, int]) -> Path:
        """How a copy at position ``copy`` catches up with this node at ``here``."""
        if copy == here:
            return Path.IN_STEP
        epoch, lsn = copy
        if lsn >= here[1] or not self._entries:
            return Path.SNAPSHOT  # ahead of this node, or level on another history
        first = self._entries[0].lsn
        if lsn == first - 1:
            # Its next change is the ring's first: an empty copy is on every history;
            # else trust it only when the ring's first change is of its epoch.
            return Path.TAIL if lsn == 0 or self._entries[0].epoch == epoch else Path.SNAPSHOT
        if lsn < first:
            return Path.SNAPSHOT
        entry = self._entries[lsn - first]
        return Path.TAIL if entry.epoch == epoch else Path.SNAPSHOT

    def after(self, lsn: int, limit_bytes: int) -> list[Entry]:
        """Entries after ``lsn``, in order, up to about ``limit_bytes`` (at least one)."""
        if not self._entries:
            return []
        start = max(0, lsn + 1 - self._entries[0].lsn)
        out: list[Entry] = []
        size = 0
        for i in range(start, len(self._entries)):
            entry = self._entries[i]
            if out and size + len(entry.data) > limit_bytes:
                break
            out.append(entry)
            size += len(entry.data)
        return out
