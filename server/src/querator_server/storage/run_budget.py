"""The bytes a lease's walk may take: the rule both walks share (``LeaseWalks.lease_run``
rewriting records, ``lease_records.lease_walk`` leaving them as they are)."""

from __future__ import annotations


class RunBudget:
    """``quota`` records of at most ``small`` bytes stay within ``max_bytes``, so a walk
    tests only ``len(record) > small`` per item (most runs never meet a longer one) and
    calls ``full`` from the first longer record on; ``full`` then sets ``small`` to -1,
    and every later record is counted. Each record costs its length and
    ``item_overhead``; with ``take_first`` the first record is taken whatever its size."""

    __slots__ = ("item_overhead", "max_bytes", "size", "small", "take_first")

    def __init__(self, max_bytes: int, quota: int, item_overhead: int, *, take_first: bool) -> None:
        self.max_bytes = max_bytes
        self.item_overhead = item_overhead
        self.take_first = take_first
        self.small = max_bytes // max(quota, 1) - item_overhead
        self.size = -1  # not counted yet

    def full(self, length: int, taken: list[bytes]) -> bool:
        """Whether a record of ``length`` bytes would take the records ``taken`` so far
        past ``max_bytes``; if not, it is counted (a record declined after this ends the
        run: its count is not used)."""
        if self.size < 0:
            self.size = sum(map(len, taken)) + len(taken) * self.item_overhead
            self.small = -1
        cost = length + self.item_overhead
        if self.size + cost > self.max_bytes and (taken or not self.take_first):
            return True
        self.size += cost
        return False
