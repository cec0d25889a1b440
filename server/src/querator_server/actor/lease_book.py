"""The open lease records of one partition (storage/lease_records.py), in memory.

Part of the partition's view (view.py): a cycle changes a copy and the actor adopts it
after the commit, so a failed or retried transaction leaves the book as it was. The
dicts are shared between a view and its copies until one of them changes: a cycle
that opens or closes a lease copies them once, not every cycle that reads them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import repeat

from ..storage.lease_records import LeaseRecord


class LeaseBook:
    """Open lease records by first seq, and the record each held seq belongs to."""

    __slots__ = ("records", "held", "_own")

    def __init__(self, records: Iterable[LeaseRecord] = ()) -> None:
        self.records: dict[int, LeaseRecord] = {record.first: record for record in records}
        self.held: dict[int, int] = {seq: record.first for record in self.records.values() for seq in record.seqs()}
        self._own = True

    def __bool__(self) -> bool:
        return bool(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def copy(self) -> LeaseBook:
        """A book sharing these dicts until either side changes (both copy first)."""
        twin = LeaseBook.__new__(LeaseBook)
        twin.records, twin.held, twin._own = self.records, self.held, False
        self._own = False
        return twin

    def _writable(self) -> None:
        if not self._own:
            self.records, self.held, self._own = dict(self.records), dict(self.held), True

    def open(self, record: LeaseRecord) -> None:
        self._writable()
        self.records[record.first] = record
        held, first = self.held, record.first
        # A segment at a time, in C: a lease of 100 items is one or two calls.
        for low, high, _expire in record.segments:
            held.update(dict.fromkeys(range(low, high + 1), first))

    def close(self, first: int) -> LeaseRecord:
        """Forget the record at ``first`` (completed, written out or taken back)."""
        self._writable()
        record = self.records.pop(first)
        pop = self.held.pop
        for low, high, _expire in record.segments:
            deque(map(pop, range(low, high + 1), repeat(None)), maxlen=0)
        return record

    def holding(self, seqs: Iterable[int]) -> list[LeaseRecord]:
        """The records that hold any of ``seqs``, each once."""
        held = self.held
        firsts = dict.fromkeys(held[seq] for seq in seqs if seq in held)
        return [self.records[first] for first in firsts]
