"""What every step of a cycle shares: the views, the results, the lease-key bookkeeping.

A ``Cycle`` (cycle.py) runs in the store's held write transaction. It reads
the actor's partition views but only changes copies of them; the actor adopts the
copies once the transaction has committed. If LMDB's map is full the whole cycle
runs again from the start on a bigger map, so no step touches state outside the
transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import lmdb

from ..errors import QueratorError
from ..model import QueueConfig
from ..storage import Item, QueueStore
from ..storage.keyed import KeyedIndex
from ..storage.record import ItemState
from .requests import LeaseRequest, Request
from .view import PartitionView


class CycleBase:
    """The state of one cycle; the steps live in the mixins that build ``Cycle``."""

    def __init__(
        self,
        store: QueueStore,
        config: QueueConfig,
        views: Sequence[PartitionView],
        now: int,
        keyed: KeyedIndex | None = None,
    ) -> None:
        self.store = store
        self.keyed = keyed
        self.config = config
        self.uid = config.uid
        self.now = now
        self._base = views
        self.views: dict[int, PartitionView] = {}
        self.results: list[tuple[Request, object]] = []
        # Leases granted this cycle: (request, partition, [(seq, raw before lease)]).
        self._granted: list[tuple[LeaseRequest, int, list[tuple[int, bytes]]]] = []
        # Lease deadlines to track once committed: (deadline, partition, seq).
        self.lease_deadlines: list[tuple[int, int, int]] = []
        # Leases that ended before their deadline (completed, retried, deleted), so
        # the actor's lease timer forgets them: (partition, seq).
        self.lease_ends: list[tuple[int, int]] = []
        # Leases that found nothing and may keep waiting.
        self.unserved: list[LeaseRequest] = []
        # Items moved to the dead-letter outbox: (partition, seq, item with source_id).
        self.outbox_added: list[tuple[int, int, Item]] = []
        # Items deleted because the queue has no dead-letter queue: (id, reason).
        self.dropped: list[tuple[str, str]] = []
        # Whether lifecycle work was left for the next cycle.
        self.more_lifecycle = False
        # Leases whose complete_ids were applied in this cycle.
        self.completed_by_lease: list[LeaseRequest] = []
        # When the oldest remembered idempotency key / lease key was taken, as
        # found by this cycle's forgetting (None: not looked at), and whether the
        # cycle remembered new ones: the actor's timers for forgetting follow these.
        self.dedup_next: int | None = None
        self.lease_keys_next: int | None = None
        self.dedup_added = False
        self.lease_keys_added = False
        # Leases that ran out in this cycle's lifecycle (for metrics).
        self.lease_expirations = 0

    # -- views ---------------------------------------------------------------------

    def view(self, p: int) -> PartitionView:
        v = self.views.get(p)
        if v is None:
            v = self.views[p] = self._base[p].copy()
        return v

    def _peek(self, p: int) -> PartitionView:
        return self.views.get(p) or self._base[p]

    def ready_total(self) -> int:
        return sum(self._peek(p).ready for p in range(len(self._base)))

    # -- results -------------------------------------------------------------------

    def _ok(self, request: Request, result: object) -> None:
        self.results.append((request, result))

    def fail(self, request: Request, error: QueratorError) -> None:
        self.results.append((request, error))

    def finish(self, txn: lmdb.Transaction[bytes]) -> None:
        for p, v in self.views.items():
            if v.seq_dirty:
                self.store.write_next_seq(txn, p, v.next_seq)
                v.seq_dirty = False

    # -- shared item rules ----------------------------------------------------------

    def _death_reason(self, item: Item | ItemState) -> str:
        if item.expire_deadline <= self.now:
            return "expired"
        limit = self.config.max_attempts
        if limit and item.attempts >= limit:
            return "max_attempts reached"
        return ""

    def _remove_leased(self, txn: lmdb.Transaction[bytes], p: int, found: Iterable[tuple[int, ItemState]]) -> None:
        """Delete these leased items of partition ``p`` (completed)."""
        found = list(found)
        self.store.delete_leased(txn, p, found)
        ends = self.lease_ends
        count = created = leased_at = 0
        for seq, state in found:
            ends.append((p, seq))
            count += 1
            created += state.created_at
            leased_at += state.leased_at
        if count:
            v = self.view(p)
            v.leased -= count
            v.created_sum -= created
            v.leased_at_sum -= leased_at

    def _untag(self, txn: lmdb.Transaction[bytes], key: str, seq: int) -> None:
        """Take item ``seq`` out of lease key ``key`` (forgetting the key once empty)."""
        if self.keyed is None:
            return
        record = self.keyed.lease_key(txn, key)
        if record is not None and seq in record.seqs:
            seqs = tuple(s for s in record.seqs if s != seq)
            self.keyed.put_lease_key(txn, key, record._replace(seqs=seqs), new=False)

    def _follow(self, txn: lmdb.Transaction[bytes], key: str, old_seq: int, new_seq: int) -> None:
        """Item ``old_seq`` of lease key ``key`` re-entered its partition as ``new_seq``."""
        if self.keyed is None:
            return
        record = self.keyed.lease_key(txn, key)
        if record is not None and old_seq in record.seqs:
            seqs = tuple(new_seq if s == old_seq else s for s in record.seqs)
            self.keyed.put_lease_key(txn, key, record._replace(seqs=seqs), new=False)
