"""When each lease of a queue ends: the actor's lease timer.

A heap alone would keep an entry for every lease ever granted until its deadline
passed, completed or not: at 60,000 completions a second and a 60 s lease timeout that
is millions of entries (about 150 bytes each), every one of them looked up in storage
when it falls due. So the live leases are also kept in a dict: a heap entry the dict
disagrees with (completed, retried, extended since) is stale and dropped without a
lookup, and the heap is rebuilt from the dict whenever stale entries outnumber live
ones by more than ``STALE_SLACK``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

# Stale heap entries tolerated beyond the number of live leases before a rebuild.
STALE_SLACK = 10_000


class LeaseDeadlines:
    """Live leases by (partition, seq), and their deadlines in order."""

    def __init__(self, leases: Iterable[tuple[int, int, int]] = ()) -> None:
        self._live: dict[tuple[int, int], int] = {(p, seq): deadline for deadline, p, seq in leases}
        self._heap: list[tuple[int, int, int]] = []
        self._rebuild()

    def __len__(self) -> int:
        return len(self._live)

    @property
    def heap_size(self) -> int:
        """Entries in the heap, stale ones included (bounded by the rebuilds)."""
        return len(self._heap)

    def add(self, deadline: int, p: int, seq: int) -> None:
        """A lease was granted or extended: it now ends at ``deadline``."""
        self.add_all(((deadline, p, seq),))

    def add_all(self, leases: Iterable[tuple[int, int, int]]) -> None:
        """Leases granted or extended: (deadline, partition, seq) each."""
        live, heap, push = self._live, self._heap, heapq.heappush
        # Deadlines mostly grow (now + the lease timeout), so each push stops at once.
        for entry in leases:
            live[(entry[1], entry[2])] = entry[0]
            push(heap, entry)

    def end(self, p: int, seq: int) -> None:
        """A lease ended before its deadline (completed, retried, deleted)."""
        self.end_all(((p, seq),))

    def end_all(self, ended: Iterable[tuple[int, int]]) -> None:
        """Leases that ended before their deadline: (partition, seq) each."""
        pop = self._live.pop
        for key in ended:
            pop(key, None)
        if len(self._heap) > 2 * len(self._live) + STALE_SLACK:
            self._rebuild()

    def first(self) -> int:
        """The earliest live deadline (0: no leases)."""
        heap, live = self._heap, self._live
        while heap and live.get((heap[0][1], heap[0][2])) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else 0

    def first_bound(self) -> int:
        """A lower bound of ``first``, without dropping stale entries (0: no entries)."""
        heap = self._heap
        return heap[0][0] if heap else 0

    def pop_due(self, now: int, limit: int) -> list[tuple[int, int, int]]:
        """Take out up to ``limit`` live leases whose deadline is ``now`` or earlier."""
        heap, live = self._heap, self._live
        due: list[tuple[int, int, int]] = []
        while heap and heap[0][0] <= now and len(due) < limit:
            deadline, p, seq = heapq.heappop(heap)
            if live.get((p, seq)) == deadline:
                del live[(p, seq)]
                due.append((deadline, p, seq))
        return due

    def drop_partition(self, p: int) -> None:
        """Forget the leases of partition ``p`` (faulty: read again once it works)."""
        self._live = {key: deadline for key, deadline in self._live.items() if key[0] != p}
        self._rebuild()

    def restore(self, leases: Iterable[tuple[int, int, int]]) -> None:
        """Put back leases taken by ``pop_due`` whose cycle failed."""
        self.add_all(leases)

    def _rebuild(self) -> None:
        self._heap = [(deadline, p, seq) for (p, seq), deadline in self._live.items()]
        heapq.heapify(self._heap)
