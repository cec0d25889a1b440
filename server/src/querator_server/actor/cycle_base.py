"""What every step of a cycle shares: the views, the results, the lease-key bookkeeping.

A ``Cycle`` (cycle.py) runs in the store's held write transaction. It reads
the actor's partition views but only changes copies of them; the actor adopts the
copies once the transaction has committed. If LMDB's map is full the whole cycle
runs again from the start on a bigger map, so no step touches state outside the
transaction.

One request's failure is its own (``apply``). A domain error (``QueratorError``) is
raised before the step writes anything, so the step's request fails and the cycle goes
on. Anything else (a bug, a value LMDB refuses) may come half-way through a step: in a
cycle's first run it aborts the whole transaction with ``StepFailed``, and the actor
runs the cycle again *isolated*, each step in a nested transaction of its own with the
cycle's state saved before it, so the failing step is rolled back and fails alone. The
first run pays nothing for this: a nested transaction per request would cost 7-8 µs
each at a commit group's 1,016 databases, 15% of a cycle of 500 produces of 100 items
(bench/RESULTS.md, "Isolating a failing request").

A partition's storage can fail alone: a damaged database (LMDB's MDB_CORRUPTED or
MDB_PAGE_NOTFOUND met while a step works on one partition, or the ``partition-error``
fault) is that partition's, once a read of the whole partition in a nested transaction
fails too (``_confirm_faulty``; if that read works, the error was not the partition's
and fails the cycle as any storage error does). The isolated run then marks the
partition *faulty*: the step is rolled back, a Produce or Lease (or the lifecycle) runs
again without that partition, and anything naming it answers ``UNAVAILABLE``. Faulty
partitions are left out of every later cycle until a probe (``probe``) reads and writes
them again. A failed commit, by contrast, is the whole environment's: nothing in it
says which database it was, so it stays the queue's (and its commit group's) failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import lmdb

from ..errors import Internal, NoHealthyPartition, QueratorError, Unavailable
from ..faults import InjectedFault, InjectedPartitionFault
from ..logging import get_logger
from ..model import QueueConfig
from ..storage import Item, PartitionScan, QueueStore, lease_records
from ..storage.capture import begin_child
from ..storage.change_set import ChangeSet
from ..storage.keyed import KeyedIndex
from ..storage.lease_records import LeaseRecord
from ..storage.record import DEAD_EXPIRED, DEAD_MAX_ATTEMPTS, ItemState, priority_of, read_state
from .requests import LeaseRequest, Request
from .view import PartitionView

log = get_logger("queue")


class StepFailed(Exception):
    """A step failed with something other than a domain error in a cycle's first run:
    the transaction is thrown away and the cycle runs again isolated."""

    def __init__(self, request: Request | None, error: BaseException) -> None:
        super().__init__(f"{type(request).__name__ if request else 'lifecycle'} failed: {error!r}")
        self.request = request
        self.error = error


def _storage_wide(exc: BaseException) -> bool:
    """Whether ``exc`` concerns the whole transaction or environment (a full map, an I/O
    error, a damaged page) rather than the step that met it: that fails the cycle. LMDB
    refusing a key or value of a bad size is the step's own."""
    return isinstance(exc, lmdb.Error) and not isinstance(exc, lmdb.BadValsizeError)


def _partition_error(exc: BaseException) -> bool:
    """Whether ``exc`` may be the failure of the database the step was working on: a
    damaged B-tree page of it. Anything else LMDB raises concerns the transaction."""
    return isinstance(exc, lmdb.CorruptedError | lmdb.PageNotFoundError | InjectedPartitionFault)


class _Appended:
    """A list as a step found it: what it appends is cut off again on a rollback."""

    __slots__ = ("items", "length")

    def __init__(self, items: list[Any], length: int) -> None:
        self.items = items
        self.length = length
# What _death_reason answers, and the DeadReason each stands for.
EXPIRED = "expired"
MAX_ATTEMPTS = "max_attempts reached"
DEATH_CODES = {EXPIRED: DEAD_EXPIRED, MAX_ATTEMPTS: DEAD_MAX_ATTEMPTS}


class CycleBase:
    """The state of one cycle; the steps live in the mixins that build ``Cycle``."""

    def __init__(
        self,
        store: QueueStore,
        config: QueueConfig,
        views: Sequence[PartitionView],
        now: int,
        keyed: KeyedIndex | None = None,
        *,
        isolated: bool = False,
        writable: bool = True,
        faulty: dict[int, str] | None = None,
        broken: frozenset[int] = frozenset(),
    ) -> None:
        self.store = store
        # Faulty partitions (partition -> why), left out of this cycle; empty, the common
        # case, costs one truth test where a step picks its partition. Replaced, never
        # changed in place: it is the actor's until the cycle commits.
        self.faulty: dict[int, str] = faulty or {}
        # Partitions found faulty by this cycle, and probed partitions that work again
        # (partition -> what a read of it found); the actor adopts both after the commit.
        self.newly_faulty: dict[int, str] = {}
        self.recovered: dict[int, tuple[PartitionScan, list[tuple[int, Item]], list[tuple[int, int, Item]]]] = {}
        self.still_faulty: dict[int, str] = {}
        # Partitions that the partition-error fault breaks in this cycle (faults.py).
        self.broken = broken
        # The partition the running step works on (-1: none yet): a damaged page it
        # meets is that partition's.
        self.at = -1
        # Each step in a nested transaction of its own (see the module docstring);
        # ``writable``: the cycle runs in a write transaction (not only listings).
        self.isolated = isolated
        self.writable = writable
        # Steps that failed alone (isolated): (request or None for the lifecycle, error).
        self.step_failures: list[tuple[Request | None, BaseException]] = []
        self.keyed = keyed
        self.config = config
        self.uid = config.uid
        self.now = now
        self._base = views
        self.views: dict[int, PartitionView] = {}
        self.results: list[tuple[Request, object]] = []
        # Leases granted this cycle: (request, partition, [(seq, raw before lease)], the
        # lease record written for its plain items or None).
        self._granted: list[tuple[LeaseRequest, int, list[tuple[int, bytes]], LeaseRecord | None]] = []
        # Lease deadlines to track once committed: (deadline, partition, seq), and by
        # runs (deadline, partition, seqs) for a lease's items (leases.py).
        self.lease_deadlines: list[tuple[int, int, int]] = []
        self.lease_deadline_runs: list[tuple[int, int, Sequence[int]]] = []
        # Leases that ended before their deadline (completed, retried, deleted), so
        # the actor's lease timer forgets them: (partition, seq), and by runs
        # (partition, seqs).
        self.lease_ends: list[tuple[int, int]] = []
        self.lease_end_runs: list[tuple[int, Sequence[int]]] = []
        # Leases that found nothing and may keep waiting.
        self.unserved: list[LeaseRequest] = []
        # Items moved to the dead-letter outbox: (partition, seq, item with source_id).
        self.outbox_added: list[tuple[int, int, Item]] = []
        # Items moved to the redrive outbox: (partition, seq, target uid, item).
        self.redrive_added: list[tuple[int, int, int, Item]] = []
        # Items deleted because the queue has no dead-letter queue: (id, reason).
        self.dropped: list[tuple[str, str, str]] = []  # (item id, why, its last error)
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
        # The same for the records of completed and retried items (done_runs.py).
        self.done_next: int | None = None
        self.done_added = False
        # Lease records written, completed whole and written out by this cycle.
        self.records_written = self.records_completed = self.records_written_out = 0
        # Leases that ran out in this cycle's lifecycle (for metrics).
        self.lease_expirations = 0
        # Whether ``touch`` wrote.
        self.touched = False
        # What the cycle wrote, for a replicated queue's copies (None: not replicated,
        # or nothing written).
        self.change: ChangeSet | None = None

    # -- views ---------------------------------------------------------------------

    def view(self, p: int) -> PartitionView:
        v = self.views.get(p)
        if v is None:
            v = self.views[p] = self._base[p].copy()
        return v

    def _peek(self, p: int) -> PartitionView:
        return self.views.get(p) or self._base[p]

    def ready_total(self) -> int:
        if self.faulty:
            return sum(self._peek(p).ready for p in self.healthy())
        return sum(self._peek(p).ready for p in range(len(self._base)))

    # -- faulty partitions ------------------------------------------------------------

    def healthy(self) -> list[int]:
        """The partitions not faulty, for the steps that pick one (only when some are)."""
        return [p for p in range(len(self._base)) if p not in self.faulty]

    def some_healthy(self) -> list[int]:
        """``healthy``, for a step that must put items somewhere: none answers UNAVAILABLE."""
        healthy = self.healthy()
        if not healthy:
            reasons = "; ".join(f"partition {p}: {why}" for p, why in sorted(self.faulty.items()))
            raise NoHealthyPartition(f"every partition of queue {self.config.name!r} is faulty ({reasons}); retry later")
        return healthy

    def enter(self, p: int) -> None:
        """The step works on partition ``p`` from here on: a faulty one answers
        ``UNAVAILABLE`` before anything is written, and a damaged page met from here on
        is ``p``'s."""
        self.at = p
        if self.faulty or self.broken:
            self.refuse(p)

    def refuse(self, p: int) -> None:
        """``enter``'s checks, for the hot steps that inline the rest (a call less)."""
        if p in self.faulty:
            raise self.faulty_error(p, self.faulty[p])
        if p in self.broken:
            raise InjectedPartitionFault(f"partition {p} is damaged (injected fault)")

    def faulty_error(self, p: int, reason: str) -> Unavailable:
        return Unavailable(
            f"partition {p} of queue {self.config.name!r} is faulty and not served ({reason}); "
            "its items are kept and come back when its storage works again; retry later"
        )

    def _confirm_faulty(self, txn: lmdb.Transaction[bytes], p: int, exc: BaseException) -> str:
        """Why partition ``p`` is faulty, "" if a full read of it works after all (the
        error that a step met there was not the partition's)."""
        reason = f"its storage failed: {type(exc).__name__}: {exc}"
        if self.broken and p in self.broken:
            return reason
        if not self.writable:  # a failed read ends a read transaction: no second try
            return ""
        child = begin_child(self.store.env, txn)
        try:
            self.store.scan(child, p)
        except lmdb.Error as again:
            return f"its storage failed: {type(again).__name__}: {again}" if _partition_error(again) else ""
        finally:
            child.abort()
        return ""

    def probe(self, txn: lmdb.Transaction[bytes], p: int) -> None:
        """Whether faulty partition ``p`` works again: read all of it and write its next
        seq, in a nested transaction of their own. If so, its view is rebuilt from the
        read (``recovered``), else it stays faulty (``still_faulty``, with why)."""
        child = begin_child(self.store.env, txn)
        try:
            if self.broken and p in self.broken:
                raise InjectedPartitionFault(f"partition {p} is damaged (injected fault)")
            scan = self.store.scan(child, p)
            scan.next_seq = max(scan.next_seq, self._base[p].next_seq)
            self.store.write_next_seq(child, p, scan.next_seq)
            outbox = self.store.outbox(child, p)
            moving = self.store.redrive_outbox(child, p)
        except Exception as exc:
            child.abort()
            self.still_faulty[p] = f"its storage failed: {type(exc).__name__}: {exc}"
            return
        child.commit()
        fresh = PartitionView.from_scan(scan)
        fresh.produced, fresh.completed = self._base[p].produced, self._base[p].completed
        self.views[p] = fresh
        self.recovered[p] = (scan, outbox, moving)

    def touch(self, txn: lmdb.Transaction[bytes]) -> None:
        """Write a serving partition's next seq again, so that the commit of a cycle that
        changed nothing else proves the storage takes writes (while it is failing; LMDB
        commits an empty transaction without writing). Only then: on a nearly full disk
        the pages it takes may be the ones a lease needed."""
        for p in self.healthy() if self.faulty else range(len(self._base)):
            if p not in self.broken:
                self.store.write_next_seq(txn, p, self._peek(p).next_seq)
                self.touched = True
                return

    # -- results -------------------------------------------------------------------

    def _ok(self, request: Request, result: object) -> None:
        self.results.append((request, result))

    def fail(self, request: Request, error: QueratorError) -> None:
        self.results.append((request, error))

    # -- one request's failure is its own ------------------------------------------------

    def apply(
        self, txn: lmdb.Transaction[bytes], request: Request | None, step: Callable[[lmdb.Transaction[bytes]], object]
    ) -> bool:
        """Run ``step`` for ``request`` (None: the lifecycle); a failure is the request's
        alone. False when the step failed (the request is answered with the error)."""
        self.at = -1
        if not self.isolated:
            try:
                step(txn)
                if request is not None and request.fault:
                    raise InjectedFault("injected into this request's apply step")
            except QueratorError as exc:
                if request is None:
                    raise
                self.fail(request, exc)
                return False
            except Exception as exc:
                if _storage_wide(exc) and not (self.at >= 0 and _partition_error(exc)):
                    raise
                raise StepFailed(request, exc) from exc
            return True
        while True:
            saved = self._save()
            child = begin_child(self.store.env, txn) if self.writable else txn
            try:
                step(child)
                if request is not None and request.fault:
                    raise InjectedFault("injected into this request's apply step")
            except Exception as exc:
                if self.writable:
                    child.abort()
                at = self.at
                reason = self._confirm_faulty(txn, at, exc) if at >= 0 and _partition_error(exc) else ""
                if _storage_wide(exc) and not reason:
                    raise
                self._restore(saved)
                if reason:
                    # The step runs again: a Produce, a Lease or the lifecycle picks among
                    # the other partitions (each failure marks one more, so this ends); a
                    # step on this partition itself now answers UNAVAILABLE in ``enter``.
                    self.faulty = {**self.faulty, at: reason}
                    self.newly_faulty[at] = reason
                    self.at = -1
                    continue
                if isinstance(exc, QueratorError) and request is not None:
                    self.fail(request, exc)
                    return False
                self.step_failures.append((request, exc))
                if request is not None:
                    kind = type(request).__name__.removesuffix("Request")
                    self.fail(
                        request,
                        Internal(f"internal error while applying this {kind} request ({type(exc).__name__}); it was not applied"),
                    )
                return False
            if self.writable:
                child.commit()
            return True

    def _save(self) -> dict[str, Any]:
        """What ``_restore`` needs to undo a step: every list's length (steps only
        append), a copy of every view changed so far, and every other value."""
        saved: dict[str, Any] = {}
        for name, value in vars(self).items():
            if isinstance(value, list):
                saved[name] = _Appended(value, len(value))
            elif name == "views":
                saved[name] = {p: v.copy() for p, v in value.items()}
            else:
                saved[name] = value
        return saved

    def _restore(self, saved: dict[str, Any]) -> None:
        for name, value in saved.items():
            if isinstance(value, _Appended):
                del value.items[value.length :]
                setattr(self, name, value.items)
            else:
                setattr(self, name, value)

    def finish(self, txn: lmdb.Transaction[bytes]) -> None:
        for p, v in self.views.items():
            if v.seq_dirty:
                self.store.write_next_seq(txn, p, v.next_seq)
                v.seq_dirty = False

    # -- lease records (storage/lease_records.py) ---------------------------------------

    def _write_out(self, txn: lmdb.Transaction[bytes], p: int, seqs: Iterable[int]) -> None:
        """Write out the lease records holding any of ``seqs`` into their items' records,
        so that a path reading those items finds them as a rewriting lease left them.
        A write-out changes how a lease is stored, not what a request sees, so a step
        may still fail with a domain error after it (storage and book stay alike)."""
        if not self._peek(p).leases:
            return
        records = self._peek(p).leases.holding(seqs)
        if not records:
            return
        book, db = self.view(p).leases, self.store.db(p)
        for record in records:
            lease_records.write_out(txn, db, record)
            book.close(record.first)
        self.records_written_out += len(records)

    def _as_leased(self, p: int, page: list[tuple[int, Item]]) -> list[tuple[int, Item]]:
        """``page`` (items of partition ``p`` as stored) with the items of lease records
        shown as their written-out records would show them (a listing writes nothing)."""
        book = self._peek(p).leases
        if not book:
            return page
        for seq, item in page:
            first = book.held.get(seq)
            if first is not None:
                record = book.records[first]
                item.is_leased = True
                item.attempts += 1
                item.lease_deadline = record.deadline
                item.leased_at = record.leased_at
        return page

    # -- shared item rules ----------------------------------------------------------

    def _death_reason(self, item: Item | ItemState) -> str:
        if item.expire_deadline <= self.now:
            return EXPIRED
        limit = self.config.max_attempts
        if limit and item.attempts >= limit:
            return MAX_ATTEMPTS
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
            v.completed += count
            v.created_sum -= created
            v.leased_at_sum -= leased_at
            for _seq, state in found:
                if state.group_key:
                    v.groups_in_flight -= 1
                    self._release_group(txn, p, state.group_key)

    def _release_group(self, txn: lmdb.Transaction[bytes], p: int, key: str) -> None:
        """Group ``key``'s head left partition ``p`` (completed, dead-lettered, deleted):
        its next item, if one waits, becomes ready where produce order puts it."""
        promoted = self.store.release_group(txn, p, key)
        if promoted is None:
            return
        seq, raw = promoted
        v = self.view(p)
        v.waiting -= 1
        v.ready += 1
        if priority_of(raw):
            v.ranked += 1  # the store indexed it (QueueStore.release_group)
        v.ready_hint = min(v.ready_hint, seq)
        v.note_expiry(read_state(raw).expire_deadline)

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
