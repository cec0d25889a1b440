"""The actor's in-memory view of one partition: exact counts, never estimates.

Rebuilt from storage at start; afterwards changed only by committed cycles. A cycle
works on copies and the actor swaps them in after the commit, so a failed or retried
transaction leaves the view untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model import NEVER_US, PartitionStats
from ..storage import PartitionScan
from .lease_book import LeaseBook


@dataclass(slots=True)
class PartitionView:
    ready: int = 0
    leased: int = 0
    scheduled: int = 0
    # Sums of created_at (ready + leased) and leased_at (leased), for average ages.
    created_sum: int = 0
    leased_at_sum: int = 0
    next_seq: int = 1
    # No ready item has a seq below this: the lease scan starts here, so leased items
    # ahead of the ready ones cost nothing.
    ready_hint: int = 1
    seq_dirty: bool = False
    # The earliest due time of a scheduled item and the earliest expire deadline
    # indexed (0: none). They may be early, never late: the lifecycle re-reads them.
    first_due: int = 0
    first_expiry: int = 0
    # Items produced and completed since the view was built (GetQueueStats' counters).
    produced: int = 0
    completed: int = 0
    # Ordered groups (storage/ordered_groups.py): items waiting behind their group's
    # head (not ready: a Lease never sees them; in created_sum), and groups whose head
    # is leased.
    waiting: int = 0
    groups_in_flight: int = 0
    # At least the entries of the priority index (ready items of priority 1 to 9):
    # while 0, a lease does not look at it. Counted up as entries go in, down as a
    # lease takes them, and set to 0 by a lease that finds the index empty; entries
    # deleted otherwise (expiry, deletion) leave it high until then.
    ranked: int = 0
    # The partition's open lease records (lease_book.py).
    leases: LeaseBook = field(default_factory=LeaseBook)

    @classmethod
    def from_scan(cls, scan: PartitionScan) -> PartitionView:
        return cls(
            ready=scan.ready,
            leased=scan.leased,
            scheduled=scan.scheduled,
            created_sum=scan.created_sum,
            leased_at_sum=scan.leased_at_sum,
            next_seq=scan.next_seq,
            ready_hint=scan.first_ready_seq,
            first_due=scan.first_due,
            first_expiry=scan.first_expiry,
            waiting=scan.waiting,
            groups_in_flight=scan.groups_in_flight,
            ranked=scan.ranked,
            leases=LeaseBook(scan.lease_records),
        )

    def copy(self) -> PartitionView:
        return PartitionView(
            self.ready,
            self.leased,
            self.scheduled,
            self.created_sum,
            self.leased_at_sum,
            self.next_seq,
            self.ready_hint,
            self.seq_dirty,
            self.first_due,
            self.first_expiry,
            self.produced,
            self.completed,
            self.waiting,
            self.groups_in_flight,
            self.ranked,
            self.leases.copy(),
        )

    def stats(self, p: int, now: int, failure: str, faulty_since_us: int) -> PartitionStats:
        """Partition ``p``'s counts and ages at ``now`` (wall µs), and why it is faulty."""
        total = self.ready + self.leased + self.waiting
        return PartitionStats(
            partition=p,
            total=total,
            total_leased=self.leased,
            scheduled=self.scheduled,
            average_age_us=max(0, now - self.created_sum // total) if total else 0,
            average_leased_age_us=max(0, now - self.leased_at_sum // self.leased) if self.leased else 0,
            failure=failure,
            faulty_since_us=faulty_since_us,
            produced=self.produced,
            completed=self.completed,
            groups_in_flight=self.groups_in_flight,
        )

    def take_seq(self) -> int:
        return self.take_seqs(1)

    def take_seqs(self, count: int) -> int:
        """Reserve ``count`` consecutive seqs; the first of them."""
        seq = self.next_seq
        self.next_seq += count
        self.seq_dirty = True
        return seq

    def note_due(self, due: int) -> None:
        if not self.first_due or due < self.first_due:
            self.first_due = due

    def note_expiry(self, deadline: int) -> None:
        if deadline >= NEVER_US:
            return  # (dead letters) nothing to wake up for
        if not self.first_expiry or deadline < self.first_expiry:
            self.first_expiry = deadline
