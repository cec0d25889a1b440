"""When each lease of a queue ends: the actor's lease timer.

A heap alone would keep an entry for every lease ever granted until its deadline
passed, completed or not: at 60,000 completions a second and a 60 s lease timeout that
is millions of entries (about 150 bytes each), every one of them looked up in storage
when it falls due. So the live leases are also kept in a dict: a heap entry the dict
disagrees with (completed, retried, extended since) is stale and dropped without a
lookup, and the heap is rebuilt from the dict whenever stale entries outnumber live
ones by more than ``STALE_SLACK``.

A lease of many items is one heap entry for all of them (a run: the seqs of one
partition sharing a deadline), and the dict is one per partition keyed by seq, so
granting or ending a lease of 100 items is a few dict calls run in C rather than 100
tuples, pushes and lookups in Python (bench/RESULTS.md: 4-5 % of a drain's loop).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Sequence

# Stale heap entries tolerated beyond the number of live leases before a rebuild.
STALE_SLACK = 10_000

# (deadline, partition, first seq, tie-breaker, seqs ascending): leases fall due in
# (deadline, partition, seq) order, as they did with an entry per lease; the
# tie-breaker keeps tuples from comparing seqs.
_Entry = tuple[int, int, int, int, Sequence[int]]


class LeaseDeadlines:
    """Live leases by partition and seq, and their deadlines in order."""

    def __init__(self, leases: Iterable[tuple[int, int, int]] = ()) -> None:
        self._live: dict[int, dict[int, int]] = {}
        for deadline, p, seq in leases:
            self._live.setdefault(p, {})[seq] = deadline
        self._heap: list[_Entry] = []
        self._queued = 0  # seqs in the heap's entries, stale ones included
        self._ties = itertools.count()
        self._rebuild()

    def __len__(self) -> int:
        return sum(map(len, self._live.values()))

    @property
    def heap_size(self) -> int:
        """Seqs in the heap, stale ones included (bounded by the rebuilds)."""
        return self._queued

    def add(self, deadline: int, p: int, seq: int) -> None:
        """A lease was granted or extended: it now ends at ``deadline``."""
        self.add_all(((deadline, p, seq),))

    def add_all(self, leases: Iterable[tuple[int, int, int]]) -> None:
        """Leases granted or extended: (deadline, partition, seq) each."""
        for deadline, p, seq in leases:
            self.add_runs(((deadline, p, (seq,)),))

    def add_runs(self, runs: Iterable[tuple[int, int, Sequence[int]]]) -> None:
        """Leases granted or extended by runs: (deadline, partition, seqs) each. A run's
        seqs are kept as they are: the caller does not change them afterwards."""
        live, heap, ties = self._live, self._heap, self._ties
        for deadline, p, seqs in runs:
            if not seqs:
                continue
            if not isinstance(seqs, range):
                seqs = sorted(seqs)  # in C, and linear for the ascending runs of a FIFO walk
            by_seq = live.get(p)
            if by_seq is None:
                by_seq = live[p] = {}
            by_seq.update(dict.fromkeys(seqs, deadline))
            # Deadlines mostly grow (now + the lease timeout), so each push stops at once.
            heapq.heappush(heap, (deadline, p, seqs[0], next(ties), seqs))
            self._queued += len(seqs)

    def end(self, p: int, seq: int) -> None:
        """A lease ended before its deadline (completed, retried, deleted)."""
        self.end_all(((p, seq),))

    def end_all(self, ended: Iterable[tuple[int, int]]) -> None:
        """Leases that ended before their deadline: (partition, seq) each."""
        live = self._live
        for p, seq in ended:
            by_seq = live.get(p)
            if by_seq is not None:
                by_seq.pop(seq, None)
        self._bound()

    def end_runs(self, runs: Iterable[tuple[int, Sequence[int]]]) -> None:
        """Leases that ended before their deadline, by runs: (partition, seqs) each."""
        live = self._live
        for p, seqs in runs:
            by_seq = live.get(p)
            if by_seq is not None:
                deque(map(by_seq.pop, seqs, itertools.repeat(None)), maxlen=0)
        self._bound()

    def _bound(self) -> None:
        if self._queued > 2 * len(self) + STALE_SLACK:
            self._rebuild()

    def first(self) -> int:
        """The earliest live deadline (0: no leases)."""
        heap, live = self._heap, self._live
        while heap:
            deadline, p, _first, _tie, seqs = heap[0]
            by_seq = live.get(p)
            if by_seq and any(by_seq.get(seq) == deadline for seq in seqs):
                return deadline
            heapq.heappop(heap)
            self._queued -= len(seqs)
        return 0

    def first_bound(self) -> int:
        """A lower bound of ``first``, without dropping stale entries (0: no entries)."""
        heap = self._heap
        return heap[0][0] if heap else 0

    def pop_due(self, now: int, limit: int) -> list[tuple[int, int, int]]:
        """Take out up to ``limit`` live leases whose deadline is ``now`` or earlier."""
        heap, live = self._heap, self._live
        due: list[tuple[int, int, int]] = []
        while heap and heap[0][0] <= now and len(due) < limit:
            deadline, p, _first, _tie, seqs = heapq.heappop(heap)
            self._queued -= len(seqs)
            by_seq = live.get(p, {})
            for index, seq in enumerate(seqs):
                # The rest of the run waits for the next call, or for another run of the
                # same deadline and partition holding an earlier seq (a merge of runs).
                if len(due) >= limit or (heap and heap[0][:3] < (deadline, p, seq)):
                    rest = seqs[index:]
                    heapq.heappush(heap, (deadline, p, seq, next(self._ties), rest))
                    self._queued += len(rest)
                    break
                if by_seq.get(seq) == deadline:
                    del by_seq[seq]
                    due.append((deadline, p, seq))
        return due

    def drop_partition(self, p: int) -> None:
        """Forget the leases of partition ``p`` (faulty: read again once it works)."""
        self._live.pop(p, None)
        self._rebuild()

    def restore(self, leases: Iterable[tuple[int, int, int]]) -> None:
        """Put back leases taken by ``pop_due`` whose cycle failed."""
        self.add_all(leases)

    def _rebuild(self) -> None:
        """The heap again from the live leases: one run per partition and deadline."""
        runs: dict[tuple[int, int], list[int]] = {}
        for p, by_seq in self._live.items():
            for seq, deadline in by_seq.items():
                runs.setdefault((deadline, p), []).append(seq)
        ties = self._ties
        for seqs in runs.values():
            seqs.sort()
        self._heap = [(deadline, p, seqs[0], next(ties), seqs) for (deadline, p), seqs in runs.items()]
        heapq.heapify(self._heap)
        self._queued = sum(map(len, runs.values()))
