"""The logical queue: one asyncio task per queue that owns all of its partitions.

gRPC handlers ``submit`` requests and await their futures. The actor wakes when
something is waiting, takes *everything* waiting, applies it in one LMDB write
transaction, which the queue's storage lane commits (so an fsync never stalls the
event loop; see queue_store.py for why the work itself stays on the loop), adopts the
new partition views, then answers every request of the cycle. Leases that found
nothing are parked and take part in later cycles until their wait runs out.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import lmdb

from ..clock import now_us
from ..errors import (
    DeadlineExceeded,
    FailedPrecondition,
    NoHealthyPartition,
    NotFound,
    QueratorError,
    ResourceExhausted,
    Unavailable,
)
from ..faults import (
    DEAD_LETTER_STORED,
    FAULT_FILE_ENV,
    MOVE_COPIED,
    MOVE_RECORDED,
    REDRIVE_STORED,
    REDRIVE_TAKEN,
    InjectedFault,
    InjectedPartitionFault,
    crash_point,
    faulty_call,
    partition_faults,
)
from ..logging import RepeatedFailure, get_logger
from ..model import PartitionStats, QueueConfig, QueueStats, QueueTotals
from ..storage import MAX_GROWTHS, Item, MapFull, QueueStore, StorageError, StorageFull
from ..storage.commit_group import HAND_OVER_AT, CommitGroup
from ..storage.keyed import KeyedIndex
from ..storage.lane import StorageLane
from ..storage.queue_store import disk_full, low_on_space
from .cycle import Cycle
from .cycle_base import StepFailed
from .handover import RETRY_S as HANDOVER_RETRY_S
from .handover import HandOver
from .leases import LeaseDeadlines
from .lifecycle import LIFECYCLE_BATCH
from .redrive import handed_over
from .requests import (
    ClearRequest,
    CompleteRequest,
    DeadLetterRequest,
    DeleteItemsRequest,
    ExtendRequest,
    GiveBackRequest,
    ImportItemsRequest,
    LeaseRequest,
    LeaseResult,
    ListItemsRequest,
    OutboxDoneRequest,
    ProduceRequest,
    RedriveDoneRequest,
    RedriveInRequest,
    RedriveRequest,
    RedriveResult,
    Request,
    RetryRequest,
)
from .view import PartitionView

T = TypeVar("T")

log = get_logger("queue")

DEFAULT_MAX_INBOX = 10_000
# After a failed lifecycle step, the next try waits this long (as a failed hand-over does).
OUTBOX_RETRY_S = HANDOVER_RETRY_S
# A faulty partition is probed this long after it failed, then ever less often: each
# probe that fails doubles the wait, up to PROBE_MAX_S. A probe reads the whole
# partition (as a start does), so a damaged one that stays damaged costs one read of it
# every half minute.
PROBE_FIRST_S = 0.5
PROBE_MAX_S = 30.0
# While the storage is failing (a commit failed), a cycle tries it again this long
# after the last failure, then ever less often, up to STORAGE_PROBE_MAX_S, so it is
# found working again (and reported so) with no call to wait for. A cycle that fails
# on a full disk costs next to nothing.
STORAGE_PROBE_MAX_S = 5.0
# A storage failure that goes on is logged again at most this often (with a count).
STORAGE_LOG_EVERY_S = 60.0


@dataclass(eq=False, slots=True)
class _Reconfigure(Request):
    config: QueueConfig
    # Moving out of the commit group: copies the queue's storage into an environment
    # of its own (on the group's lane), then ``persist`` records the move.
    move_out: Callable[[QueueStore], QueueStore] | None = None
    persist: Callable[[], Awaitable[None]] | None = None


@dataclass(eq=False, slots=True)
class _Delete(Request):
    force: bool


@dataclass(slots=True)
class _Batch:
    produces: list[ProduceRequest] = field(default_factory=list)
    leases: list[LeaseRequest] = field(default_factory=list)
    acks: list[Request] = field(default_factory=list)
    others: list[Request] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.produces) + len(self.leases) + len(self.acks) + len(self.others)


class LogicalQueue:
    """The actor owning one queue's storage and in-memory state."""

    def __init__(
        self,
        config: QueueConfig,
        store: QueueStore,
        lane: StorageLane,
        *,
        resolve: Callable[[str], LogicalQueue] | None = None,
        resolve_uid: Callable[[int], LogicalQueue | None] | None = None,
        max_inbox: int = DEFAULT_MAX_INBOX,
        group: CommitGroup | None = None,
        fail_after_s: float = 60.0,
        on_failed: Callable[[str, str], None] | None = None,
        on_partitions: Callable[[str, int], None] | None = None,
    ) -> None:
        self.config = config
        # Faulty partitions (cycle_base.py): partition -> why, and since when (wall µs).
        # Replaced, never changed in place, so a cycle may hold the one it was given.
        self._faulty: dict[int, str] = {}
        self._faulty_since: dict[int, int] = {}
        self._probe_at = 0  # when to probe them next (wall µs)
        self._probe_delay_s = PROBE_FIRST_S
        self._probing: list[int] = []  # the partitions the running cycle probes
        # Told the queue's name and its number of faulty partitions when that changes.
        self._on_partitions = on_partitions
        # Storage failing on every cycle for this long marks the queue failed (called
        # with its name and why) instead of failing calls in a loop.
        self._fail_after_us = int(fail_after_s * 1_000_000)
        self._on_failed = on_failed
        self._failing_since = 0  # wall µs of the first failed cycle in a row; 0: none
        self._failed_cycles = 0
        self.failed = False
        # The storage is failing: a commit failed (a full disk or map, an I/O error), why,
        # and since when (wall µs). That concerns the whole environment, not one
        # partition: every partition is reported faulty with it, but none is left out,
        # and every cycle tries the storage again until a commit proves it takes writes.
        self._storage_failure = ""
        self._storage_failing_since = 0
        self._storage_full = False  # the failure was a full file system or map
        self._storage_probe_at = 0  # when to try it again with no call waiting (wall µs)
        self._storage_probe_delay_s = PROBE_FIRST_S
        self._storage_failures: RepeatedFailure | None = None
        # Finds another queue's actor by name (for dead letters).
        self._resolve = resolve
        # Finds another queue's actor by storage uid (for redrives; None: no such queue).
        self._resolve_uid = resolve_uid
        self.store = store
        self._lane = lane
        # The commit group whose environment holds this queue's storage, if any.
        self.group = group
        self._max_inbox = max_inbox
        self._views: list[PartitionView] = []
        self._leases = LeaseDeadlines()
        self._inbox: list[Request] = []
        self._waiting: list[LeaseRequest] = []
        self._clients: set[str] = set()
        self._wake = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0  # when the armed timer fires (wall µs)
        self._task: asyncio.Task[None] | None = None
        self._closed: QueratorError | None = None
        self._in_flight = 0
        # Dead letters committed to the outbox but not yet stored by the DLQ.
        self._outbox: HandOver[Item] = HandOver(
            config.name,
            "dead_letter",
            self._send_dead_letters,
            closed=self._stopped,
            faulty=self._faulty_now,
            receiver=lambda: self.config.dead_queue,
            receiver_field="dead_queue",
        )
        # Items redriven out of this queue, committed to the redrive outbox but not yet
        # stored by their target: (partition, seq) -> (target uid, item as it was here).
        self._redrive: HandOver[tuple[int, Item]] = HandOver(
            config.name, "redrive", self._send_redriven, closed=self._stopped, faulty=self._faulty_now
        )
        # RedriveItems calls waiting for their entries to leave the outbox.
        self._redrive_waiters: list[tuple[list[tuple[int, int]], asyncio.Future[None]]] = []
        self._lifecycle_pending = False
        # After a lifecycle step failed: not before this time (wall µs; 0: no hold).
        self._lifecycle_after = 0
        self._keyed: KeyedIndex | None = None
        # When the oldest remembered idempotency key and lease key were taken (0: none).
        self._dedup_at = 0
        self._lease_keys_at = 0
        # Metrics hook (metrics.QueueProbe) when --metrics-address is set.
        self.observer: Any = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def partition_count(self) -> int:
        return len(self._views)

    @property
    def faulty_partitions(self) -> dict[int, str]:
        """The faulty partitions and why (read only: replaced, never changed in place)."""
        return self._faulty

    @property
    def keyed_index(self) -> KeyedIndex | None:
        return self._keyed

    # -- life ----------------------------------------------------------------------

    async def start(self, keyed: KeyedIndex | None = None) -> None:
        """Load the queue's state and start the actor; ``keyed`` reuses the handles of
        an earlier actor on the same (still open) storage, so no write is needed."""
        self._views, leases, self._outbox.entries, self._redrive.entries, faulty = await self._storage_job(self._load)
        if faulty:
            self._partitions_changed(faulty, {}, now_us())
        self._leases = LeaseDeadlines(leases)
        self._keyed = keyed or await self._storage_job(partial(KeyedIndex, self.store))
        self._dedup_at, self._lease_keys_at = await self._storage_job(self._load_key_times)
        # Everything that fell due while the server was down is handled at once.
        self._lifecycle_pending = True
        self._task = asyncio.create_task(self._run(), name=f"queue:{self.name}")

    def _load_key_times(self) -> tuple[int, int]:
        assert self._keyed is not None
        with self.store.env.begin() as txn:
            return self._keyed.first_dedup_at(txn), self._keyed.first_lease_key_at(txn)

    async def resume_dead_letters(self) -> None:
        """Hand over dead letters a crash left in the outbox, and wait until they are.

        The manager calls this once every queue is running and before the server
        accepts calls: the dead-letter queue deduplicates by source_id only while it
        still holds the first copy, so nobody may consume that copy before the resend.
        """
        for outbox in (self._outbox, self._redrive):
            outbox.kick()
        for outbox in (self._outbox, self._redrive):
            await outbox.wait()

    def _load(
        self,
    ) -> tuple[
        list[PartitionView],
        list[tuple[int, int, int]],
        dict[tuple[int, int], Item],
        dict[tuple[int, int], tuple[int, Item]],
        dict[int, str],
    ]:
        """Read every partition; one whose database is damaged is faulty (its view empty
        until a probe reads it), and the others serve. Each partition is read in a
        transaction of its own: an error ends the read transaction it happens in."""
        views: list[PartitionView] = []
        leases: list[tuple[int, int, int]] = []
        outbox: dict[tuple[int, int], Item] = {}
        redrive: dict[tuple[int, int], tuple[int, Item]] = {}
        faulty: dict[int, str] = {}
        broken = self._broken()
        for p in range(self.store.partitions):
            try:
                with self.store.env.begin() as txn:
                    if p in broken:
                        raise InjectedPartitionFault(f"partition {p} is damaged (injected fault)")
                    scan = self.store.scan(txn, p)
                    stored = self.store.outbox(txn, p)
                    moving = self.store.redrive_outbox(txn, p)
            except (lmdb.CorruptedError, lmdb.PageNotFoundError, InjectedPartitionFault) as exc:
                faulty[p] = f"its storage failed: {type(exc).__name__}: {exc}"
                views.append(PartitionView())
                continue
            views.append(PartitionView.from_scan(scan))
            leases.extend((deadline, p, seq) for deadline, seq in scan.leases)
            outbox.update(((p, seq), item) for seq, item in stored)
            redrive.update(((p, seq), (uid, item)) for seq, uid, item in moving)
        return views, leases, outbox, redrive, faulty

    def _broken(self) -> frozenset[int]:
        """The partitions the ``partition-error`` fault names now (tests; faults.py)."""
        if not os.environ.get(FAULT_FILE_ENV):
            return frozenset()
        names = partition_faults(self.store.path)
        if not names:
            return frozenset()
        return frozenset(p for p in range(self.store.partitions) if self.store.database_name(p) in names)

    async def stop(self) -> None:
        """Finish what was submitted, fail waiting leases with UNAVAILABLE, close storage."""
        if self._closed is None:
            self._closed = Unavailable(f"queue {self.name!r} is shutting down")
        self._wake.set()
        if self._task is not None:
            await self._task
        await self._cancel_outbox()
        await self._storage_job(self.store.close)

    def _storage_job(self, fn: Callable[[], T]) -> Awaitable[T]:
        """Run ``fn`` on the lane with no transaction of this queue held there."""
        if self.group is not None:
            return self.group.job(fn)
        return self._lane.run(fn)

    async def _cancel_outbox(self) -> None:
        for _entries, waiter in self._redrive_waiters:
            if not waiter.done():
                waiter.set_exception(Unavailable(f"queue {self.name!r} stopped; the moved items are handed over at start"))
        self._redrive_waiters = []
        await self._outbox.cancel()
        await self._redrive.cancel()

    async def delete(self, force: bool) -> None:
        """Stop the actor for good if the queue is empty (or ``force``); storage stays open."""
        await self.submit(_Delete(force=force))
        if self._task is not None:
            await self._task
        await self._cancel_outbox()
        await self._storage_job(self.store.abort_held)

    async def reconfigure(self, config: QueueConfig) -> None:
        await self.submit(_Reconfigure(config=config))

    async def move_out(
        self, config: QueueConfig, copy: Callable[[QueueStore], QueueStore], persist: Callable[[], Awaitable[None]]
    ) -> None:
        """Reconfigure to ``config`` in an environment of the queue's own: between two
        cycles, ``copy`` the storage out of the group, ``persist`` the move (the catalog),
        then drop the group's copy. Nothing changes if ``copy`` or ``persist`` fails."""
        await self.submit(_Reconfigure(config=config, move_out=copy, persist=persist))

    # -- requests --------------------------------------------------------------------

    def submit(self, request: Request) -> asyncio.Future[Any]:
        if self._closed is not None:
            raise self._closed
        if faulty_call.get():
            request.fault = True
        if len(self._inbox) >= self._max_inbox:
            raise ResourceExhausted(f"queue {self.name!r} is overloaded: {len(self._inbox)} requests waiting")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        request.future = future
        if isinstance(request, LeaseRequest) and request.client_id:
            client = request.client_id
            if client in self._clients:
                raise FailedPrecondition(f"client_id {client!r} already has a Lease waiting on queue {self.name!r}")
            self._clients.add(client)
            future.add_done_callback(lambda _f: self._clients.discard(client))
        self._inbox.append(request)
        self._wake.set()
        return future

    def stats(self) -> QueueStats:
        if faulty_call.get():
            raise InjectedFault("injected into GetQueueStats")
        now = now_us()
        parts: list[PartitionStats] = []
        for p, v in enumerate(self._views):
            total = v.ready + v.leased
            parts.append(
                PartitionStats(
                    partition=p,
                    total=total,
                    total_leased=v.leased,
                    scheduled=v.scheduled,
                    average_age_us=max(0, now - v.created_sum // total) if total else 0,
                    average_leased_age_us=max(0, now - v.leased_at_sum // v.leased) if v.leased else 0,
                    failure=self._faulty.get(p) or self._storage_failure,
                    faulty_since_us=self._faulty_since.get(p) or self._storage_failing_since,
                )
            )
        waiting, producing = self._waiting_calls()
        return QueueStats(parts, lease_waiting=waiting, produce_waiting=producing, in_flight=self._in_flight)

    def totals(self) -> QueueTotals:
        """The in-memory counts summed over the partitions; reads no storage. Safe to call
        from another thread (the metrics endpoint's): it only reads ints, and a view
        swapped meanwhile is read before or after the swap, never torn."""
        ready = leased = scheduled = created = 0
        views = list(self._views)
        for v in views:
            ready += v.ready
            leased += v.leased
            scheduled += v.scheduled
            created += v.created_sum
        waiting, producing = self._waiting_calls()
        return QueueTotals(len(views), ready, leased, scheduled, created, waiting, producing, faulty=self._faulty_count())

    def _faulty_count(self) -> int:
        """The partitions reported faulty: all of them while the storage is failing."""
        return len(self._views) if self._storage_failure else len(self._faulty)

    def ready_heads(self, partitions: Iterable[int]) -> dict[int, int | None]:
        """created_at (us) of the first ready item of each of ``partitions`` (0: none
        ready; None: not found within a bounded look past leased items). Reads storage:
        call it on the loop, between cycles, as the metrics hook is called."""
        views = self._views
        asked = [p for p in partitions if p not in self._faulty]
        out: dict[int, int | None] = {p: 0 for p in asked if not views[p].ready}
        starts = [(p, views[p].ready_hint) for p in asked if views[p].ready]
        if starts:
            out.update(self.store.ready_heads(starts))
        return out

    def map_usage(self) -> tuple[int, int]:
        """Bytes of the LMDB map in use, and its size (a commit group's, for a queue in one)."""
        return self.store.map_usage()

    def _waiting_calls(self) -> tuple[int, int]:
        """Lease calls waiting for items, Produce calls waiting for a cycle."""
        waiting = sum(1 for w in list(self._waiting) if not w.future.done())
        inbox = list(self._inbox)
        waiting += sum(1 for r in inbox if isinstance(r, LeaseRequest))
        producing = sum(1 for r in inbox if isinstance(r, ProduceRequest))
        return waiting, producing

    def waiting_requests(self) -> int:
        """Requests submitted and not yet taken by a cycle."""
        return len(self._inbox)

    def holds_items(self) -> bool:
        # What a faulty partition holds is not known for sure (nothing, if it failed at
        # start): deleting the queue then takes force.
        return bool(self._faulty or self._redrive.entries) or any(v.ready or v.leased or v.scheduled for v in self._views)

    # -- the loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                if not self._inbox and not self._lifecycle_due() and not self._probe_due() and not self._storage_probe_due():
                    if self._closed is not None:
                        break
                    self._arm_timer()
                    await self._wake.wait()
                self._wake.clear()
                if self._closed is not None and (not self._inbox or self.failed):
                    break
                inbox, self._inbox = self._inbox, []
                await self._cycle(inbox)
        finally:
            if self._timer is not None:
                self._timer.cancel()
            closed = self._closed or Unavailable(f"queue {self.name!r} stopped")
            for lease in self._waiting:
                _answer(lease, closed if not isinstance(closed, NotFound) else LeaseResult(0))
            self._waiting = []
            for request in self._inbox:
                _answer(request, closed)
            self._inbox = []

    def _next_lifecycle_us(self, *, exact: bool = True) -> int:
        """The earliest lease deadline, due time or expiry (0: none).

        Not ``exact``: possibly earlier, by the deadline of a lease that has already
        ended; skipping those costs a heap pop per ended lease, which only pays when
        the answer could be "due now".
        """
        views = self._views
        if self._faulty:  # nothing of theirs is due until they work again
            views = [v for p, v in enumerate(views) if p not in self._faulty]
        times = [v.first_due for v in views if v.first_due]
        times.extend(v.first_expiry for v in views if v.first_expiry)
        if self._dedup_at:
            times.append(self._dedup_at + self.config.dedup_window_us)
        if self._lease_keys_at:
            times.append(self._lease_keys_at + self.config.lease_key_ttl_us)
        first_lease_end = self._leases.first() if exact else self._leases.first_bound()
        if first_lease_end:
            times.append(first_lease_end)
        return min(times, default=0)

    def _lifecycle_due(self) -> bool:
        if self._lifecycle_after and now_us() < self._lifecycle_after:
            return False
        if self._lifecycle_pending:
            return True
        now = now_us()
        at = self._next_lifecycle_us(exact=False)
        if not at or at > now:
            return False
        at = self._next_lifecycle_us()
        return bool(at) and at <= now

    def _arm_timer(self) -> None:
        times = [w.wait_until_us for w in self._waiting]
        lifecycle = self._next_lifecycle_us(exact=False)  # an early wake finds nothing due
        if self._lifecycle_after and (lifecycle or self._lifecycle_pending):
            lifecycle = max(lifecycle, self._lifecycle_after)
        if lifecycle:
            times.append(lifecycle)
        if self._faulty:
            times.append(self._probe_at)
        if self._storage_failure:
            times.append(self._storage_probe_at)
        wake_at = min(times, default=0)
        if self._timer is not None:
            if wake_at == self._timer_at:
                return  # still armed for that time
            self._timer.cancel()
            self._timer = None
        if wake_at:
            delay = max(0.0, (wake_at - now_us()) / 1e6)
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)
            self._timer_at = wake_at

    def _on_timer(self) -> None:
        self._timer = None
        self._wake.set()

    async def _cycle(self, inbox: list[Request]) -> None:
        now = now_us()
        batch = _Batch()
        control: list[Request] = []
        parked, self._waiting = self._waiting, []
        for lease in parked:
            if lease.future.done():
                continue
            if lease.wait_until_us <= now:
                _answer(lease, LeaseResult(0))
            else:
                batch.leases.append(lease)
        for request in inbox:
            if request.future.done():
                continue
            if request.deadline_us and now >= request.deadline_us:
                _answer(request, DeadlineExceeded("the request's deadline passed before it could be applied"))
            elif isinstance(request, ProduceRequest):
                batch.produces.append(request)
            elif isinstance(request, LeaseRequest):
                batch.leases.append(request)
            elif isinstance(request, CompleteRequest | RetryRequest | ExtendRequest):
                batch.acks.append(request)
            elif isinstance(request, _Reconfigure | _Delete):
                control.append(request)
            else:
                batch.others.append(request)

        for request in control:
            if isinstance(request, _Reconfigure):
                await self._apply_config(request)
        lifecycle = self._lifecycle_due()
        self._probing = self._take_probes(now)
        # Taken whatever else the cycle does, so the next probe waits its turn (parked
        # leases in every cycle would otherwise keep one due).
        probe_storage = self._take_storage_probe(now)
        if len(batch) or lifecycle or self._probing or probe_storage:
            await self._apply(batch, now, lifecycle)
        for request in control:
            if isinstance(request, _Delete):
                self._apply_delete(request)

    def _probe_due(self) -> bool:
        return bool(self._faulty) and now_us() >= self._probe_at

    def _storage_probe_due(self) -> bool:
        return bool(self._storage_failure) and now_us() >= self._storage_probe_at

    def _take_storage_probe(self, now: int) -> bool:
        """Whether this cycle is to try the failing storage with no call waiting. Not on
        a file system still full: a small write may succeed there (LMDB reuses freed
        pages) while it proves nothing."""
        if not self._storage_failure or now < self._storage_probe_at:
            return False
        self._storage_probe_at = now + int(self._storage_probe_delay_s * 1_000_000)
        self._storage_probe_delay_s = min(self._storage_probe_delay_s * 2, STORAGE_PROBE_MAX_S)
        return not (self._storage_full and low_on_space(self.store.path))

    def _storage_failed(self, exc: StorageError) -> None:
        """A commit failed: every partition is reported faulty with why until a commit
        works again (``_storage_works``)."""
        now = now_us()
        first = not self._storage_failure
        self._storage_failure = f"its storage failed: {exc}"
        self._storage_full = disk_full(exc)
        self._storage_probe_at = now + int(PROBE_FIRST_S * 1_000_000)
        self._storage_probe_delay_s = PROBE_FIRST_S * 2
        if first:
            self._storage_failing_since = now
            self._storage_failures = RepeatedFailure(STORAGE_LOG_EVERY_S)
            if self._on_partitions is not None:
                self._on_partitions(self.name, self._faulty_count())
        assert self._storage_failures is not None
        reported = self._storage_failures.failed()
        if reported:
            log.error("storage_failed", queue=self.name, error=str(exc), failures=reported)

    def _storage_works(self, cycle: Cycle) -> None:
        """A cycle that wrote (changed a partition, or ``touch``) committed while the
        storage was failing: it works again, unless the disk is still full (a write LMDB
        fitted into freed pages proves nothing then: the next Produce would fail again)."""
        if not (cycle.views or cycle.touched) or (self._storage_full and low_on_space(self.store.path)):
            return
        failures = self._storage_failures.failures if self._storage_failures is not None else 0
        log.warning(
            "storage_recovered",
            queue=self.name,
            failing_s=round((cycle.now - self._storage_failing_since) / 1e6, 1),
            failures=failures,
        )
        self._storage_failure = ""
        self._storage_failing_since = 0
        self._storage_full = False
        self._storage_failures = None
        self._storage_probe_delay_s = PROBE_FIRST_S
        if self._on_partitions is not None:
            self._on_partitions(self.name, self._faulty_count())

    def _take_probes(self, now: int) -> list[int]:
        """The faulty partitions this cycle probes (all of them, when a probe is due)."""
        if not self._faulty or now < self._probe_at:
            return []
        self._probe_at = now + int(self._probe_delay_s * 1_000_000)
        self._probe_delay_s = min(self._probe_delay_s * 2, PROBE_MAX_S)
        return sorted(self._faulty)

    def _partitions_changed(self, faulty: dict[int, str], recovered: dict[int, object], now: int) -> None:
        """Adopt what a committed cycle found: partitions now faulty, and probed ones
        that work again (their views came with the cycle's)."""
        newly = [p for p in faulty if p not in self._faulty]
        self._faulty = {**{p: why for p, why in self._faulty.items() if p not in recovered}, **faulty}
        self._faulty_since = {p: self._faulty_since.get(p, now) for p in self._faulty}
        for p in newly:
            self._leases.drop_partition(p)  # read again from storage when it works again
            log.error("partition_faulty", queue=self.name, partition=p, reason=faulty[p])
        if newly and len(self._faulty) == len(newly):
            self._probe_at = now + int(PROBE_FIRST_S * 1_000_000)
            self._probe_delay_s = PROBE_FIRST_S * 2
        if not self._faulty:
            self._probe_delay_s = PROBE_FIRST_S
        if (newly or recovered) and self._on_partitions is not None:
            self._on_partitions(self.name, self._faulty_count())

    def _adopt_partitions(self, cycle: Cycle) -> None:
        for p, (scan, outbox, moving) in cycle.recovered.items():
            self._leases.add_all((deadline, p, seq) for deadline, seq in scan.leases)
            self._outbox.entries.update(((p, seq), item) for seq, item in outbox)
            self._redrive.entries.update(((p, seq), (uid, item)) for seq, uid, item in moving)
            since = self._faulty_since.get(p, 0)
            log.warning("partition_recovered", queue=self.name, partition=p, faulty_s=round((cycle.now - since) / 1e6, 1))
        self._partitions_changed({**cycle.still_faulty, **cycle.newly_faulty}, dict(cycle.recovered), cycle.now)
        if cycle.recovered:
            self._outbox.kick()
            self._redrive.kick()

    async def _apply(self, batch: _Batch, now: int, lifecycle: bool) -> None:
        self._in_flight = len(batch)
        expired: list[tuple[int, int, int]] = []
        if lifecycle:
            self._lifecycle_pending = False
            expired = self._leases.pop_due(now, LIFECYCLE_BATCH)
        started = time.perf_counter()
        failed_first = False
        try:
            try:
                cycle = await self._attempt(batch, now, lifecycle, expired)
            except StorageError as exc:
                if not disk_full(exc) or not _adds_items(batch):
                    raise
                # A full disk or map: what adds items cannot be stored and fails, while
                # leases, completions and the rest mostly rewrite or free pages LMDB
                # already has: they are tried again alone rather than fail with the
                # adds, so consumers still drain the queue (and free its space).
                failed_first = True
                self._storage_failed(exc)
                adding, batch = _split_adding(batch)
                for request in adding:
                    _answer(request, self._storage_error(exc, request))
                if not (len(batch) or lifecycle or self._probing):
                    return
                cycle = await self._attempt(batch, now, lifecycle, expired)
        except Exception as exc:
            self._leases.restore(expired)
            if lifecycle:
                self._lifecycle_pending = True
            if isinstance(exc, StorageError):
                self._storage_failed(exc)
                self._fail_batch(batch, self._storage_error(exc))
                if not disk_full(exc):
                    self._storage_failing(str(exc))
            else:  # a bug must not kill the actor; the cycle was rolled back
                log.exception("cycle_failed", queue=self.name, error=repr(exc))
                self._fail_batch(batch, Unavailable("internal error while applying the request; it was not applied"))
            if lifecycle:
                await asyncio.sleep(OUTBOX_RETRY_S)  # don't spin on a failing disk
            return
        finally:
            self._in_flight = 0
        if self._storage_failure and not failed_first:
            self._storage_works(cycle)
        for p, view in cycle.views.items():
            self._views[p] = view
        if cycle.newly_faulty or self._probing:
            self._adopt_partitions(cycle)
        if self._failed_cycles and cycle.writable and not any(r is None for r, _ in cycle.step_failures):
            # A committed write (a listing proves nothing of writes) ends a run of failures.
            self._failing_since = self._failed_cycles = 0
        if cycle.step_failures:
            self._report_step_failures(cycle, batch, expired)
        elif lifecycle:
            self._lifecycle_after = 0
        if self.observer is not None:
            self.observer.cycle_done(self, cycle, len(batch), time.perf_counter() - started)
        if cycle.dedup_next is not None:
            self._dedup_at = cycle.dedup_next
        if cycle.dedup_added and not self._dedup_at:
            self._dedup_at = cycle.now
        if cycle.lease_keys_next is not None:
            self._lease_keys_at = cycle.lease_keys_next
        if cycle.lease_keys_added and not self._lease_keys_at:
            self._lease_keys_at = cycle.now
        for lease in cycle.completed_by_lease:
            lease.complete_ids = []  # committed: a lease that keeps waiting must not repeat it
        self._leases.end_all(cycle.lease_ends)
        self._leases.add_all(cycle.lease_deadlines)
        if cycle.more_lifecycle or len(expired) >= LIFECYCLE_BATCH:
            self._lifecycle_pending = True
        for item_id, reason in cycle.dropped:
            log.warning("item_dropped", queue=self.name, item_id=item_id, reason=reason, dead_queue=None)
        if cycle.outbox_added:
            for p, seq, item in cycle.outbox_added:
                self._outbox.entries[(p, seq)] = item
            self._outbox.kick()
        if cycle.redrive_added:
            crash_point(REDRIVE_TAKEN)
            for p, seq, target, item in cycle.redrive_added:
                self._redrive.entries[(p, seq)] = (target, item)
            for _request, result in cycle.results:
                if isinstance(result, RedriveResult) and result.delivered is not None:
                    self._redrive_waiters.append((result.entries, result.delivered))
            self._redrive.kick()
        for request, result in cycle.results:
            _answer(request, result)
        later = now_us()
        for lease in cycle.unserved:
            if lease.future.done():
                continue
            if lease.wait_until_us > later and self._closed is None:
                self._waiting.append(lease)
            else:
                _answer(lease, LeaseResult(0))

    async def _attempt(self, batch: _Batch, now: int, lifecycle: bool, expired: list[tuple[int, int, int]]) -> Cycle:
        try:
            return await self._transaction(batch, now, lifecycle, expired)
        except StepFailed as failed:
            # One step failed half-way: run the cycle again with every step in a
            # nested transaction of its own, so that one fails alone (cycle_base.py).
            log.warning("cycle_isolated", queue=self.name, step=str(failed), requests=len(batch))
            return await self._transaction(batch, now, lifecycle, expired, isolated=True)

    def _storage_error(self, exc: StorageError, request: Request | None = None) -> QueratorError:
        """What a request that a failed commit did not apply answers."""
        if isinstance(exc, StorageFull):
            return ResourceExhausted(str(exc))
        if isinstance(request, ProduceRequest) and disk_full(exc):
            # Nothing of a commit that ran out of space was stored: in a cluster another
            # home may take the items (the router tries one for an unkeyed Produce).
            return NoHealthyPartition(f"storage failed, retry later: {exc}")
        return Unavailable(f"storage failed, retry later: {exc}")

    def _report_step_failures(self, cycle: Cycle, batch: _Batch, expired: list[tuple[int, int, int]]) -> None:
        """Log the steps that failed alone; a failed lifecycle is tried again in a second."""
        for request, error in cycle.step_failures:
            if request is not None:
                log.error(
                    "request_failed",
                    queue=self.name,
                    request=type(request).__name__.removesuffix("Request"),
                    cycle_requests=len(batch),
                    error=repr(error),
                    exc_info=error,
                )
                continue
            log.error("lifecycle_failed", queue=self.name, error=repr(error), exc_info=error)
            self._storage_failing(f"the lifecycle step failed: {error!r}")
            self._leases.restore(expired)
            self._lifecycle_pending = True
            self._lifecycle_after = now_us() + int(OUTBOX_RETRY_S * 1_000_000)

    def _storage_failing(self, reason: str) -> None:
        """Another cycle failed for the storage (not a full disk, which frees up): past
        ``fail_after_s`` of nothing but failures, the queue is marked failed."""
        if self.failed:
            return
        now = now_us()
        if not self._failing_since:
            self._failing_since = now
        self._failed_cycles += 1
        if self._failed_cycles < 3 or now - self._failing_since < self._fail_after_us:
            return
        seconds = (now - self._failing_since) / 1e6
        reason = f"its storage failed on every cycle for {seconds:.0f} s ({self._failed_cycles} cycles): {reason}"
        self.failed = True  # the loop answers what waits and stops
        self._closed = Unavailable(f"queue {self.name!r} has failed and is not served: {reason}")
        self._wake.set()
        if self._on_failed is not None:
            self._on_failed(self.name, reason)

    async def _transaction(
        self, batch: _Batch, now: int, lifecycle: bool, expired: list[tuple[int, int, int]], *, isolated: bool = False
    ) -> Cycle:
        """Apply the cycle on the loop in the store's held transaction; commit it on the
        queue's storage thread (see queue_store.py for why the work stays on the loop)."""
        body = self._body(batch, now, lifecycle, expired, isolated=isolated)
        if not self._writes(batch, lifecycle):
            # Only listings: a read transaction, no commit and no fsync.
            return self.store.read(body)
        if self.group is not None:
            return await self._group_transaction(self.group, body, len(batch))
        store = self.store
        for _ in range(MAX_GROWTHS):
            if not store.held:
                await self._lane.run(store.hold)
            try:
                cycle = store.run_held(body)
                committed = _committed(self._lane, store.commit_held, cycle)
                if len(batch) >= HAND_OVER_AT:
                    time.sleep(0)
                await committed
                return cycle
            except MapFull:
                await self._lane.run(store.grow)
            except Exception:
                await self._lane.run(store.abort_held)
                raise
        raise StorageFull("storage is full: the LMDB map could not grow enough")

    async def _group_transaction(
        self, group: CommitGroup, body: Callable[[lmdb.Transaction[bytes]], Cycle], requests: int
    ) -> Cycle:
        """``_transaction`` for a queue in a commit group: the cycle runs in a nested
        transaction on the loop and waits for the group's next commit."""
        for _ in range(MAX_GROWTHS):
            try:
                cycle, committed = await group.run(body, self.store.on_commit, requests, on_durable=_answer_results, member=self)
            except MapFull:
                await group.grow()
                continue
            await committed
            return cycle
        raise StorageFull("storage is full: the LMDB map could not grow enough")

    def _body(
        self, batch: _Batch, now: int, lifecycle: bool, expired: list[tuple[int, int, int]], *, isolated: bool = False
    ) -> Callable[[lmdb.Transaction[bytes]], Cycle]:
        forget_keys = bool(
            (self._dedup_at and self._dedup_at + self.config.dedup_window_us <= now)
            or (self._lease_keys_at and self._lease_keys_at + self.config.lease_key_ttl_us <= now)
        )
        probes = self._probing
        writable = self._writes(batch, lifecycle)
        touch = writable and bool(self._storage_failure)
        broken = self._broken()

        def body(txn: lmdb.Transaction[bytes]) -> Cycle:
            cycle = Cycle(
                self.store,
                self.config,
                self._views,
                now,
                self._keyed,
                isolated=isolated,
                writable=writable,
                faulty=self._faulty,
                broken=broken,
            )
            for produce in batch.produces:
                cycle.apply(txn, produce, partial(cycle.produce, request=produce))
            leases = batch.leases
            if any(lease.complete_ids for lease in leases):
                leases = cycle.complete_before_lease(txn, leases)
            if leases:
                cycle.lease(txn, leases)
            # Client acks come before the lifecycle: a Complete or Retry that arrives
            # after the lease deadline but before the re-queue still succeeds.
            for request in batch.acks:
                cycle.apply(txn, request, partial(_ACK[type(request)], cycle, request=request))
            for request in batch.others:
                cycle.apply(txn, request, partial(_OTHER[type(request)], cycle, request=request))
            if lifecycle:
                cycle.apply(txn, None, partial(cycle.lifecycle, expired_leases=expired, forget_keys=forget_keys))
            for p in probes:
                cycle.probe(txn, p)
            # Items that became ready in this cycle (retry, expiry, promotion, import,
            # dead letters) go to leases that found nothing, without waiting a cycle.
            if cycle.unserved and cycle.ready_total():
                waiting, cycle.unserved = cycle.unserved, []
                cycle.lease(txn, waiting)
            cycle.fence_leases(txn, now_us())
            if touch and not cycle.views:
                cycle.touch(txn)
            cycle.finish(txn)
            return cycle

        return body

    def _writes(self, batch: _Batch, lifecycle: bool) -> bool:
        """Whether a cycle runs in a write transaction: unless it only lists items (a
        read works on a full disk), or it is the probe of a failing storage."""
        if not _only_listings(batch, lifecycle or bool(self._probing)):
            return True
        return bool(self._storage_failure) and not len(batch)

    def _fail_batch(self, batch: _Batch, error: QueratorError) -> None:
        # Leases too: one that kept waiting through failing cycles would end with no
        # items while items are ready, and its caller would take the outage for an
        # empty queue.
        for request in batch.produces + batch.leases + batch.acks + batch.others:
            _answer(request, error)

    async def _apply_config(self, request: _Reconfigure) -> None:
        config = request.config
        if request.move_out is not None and self.group is not None:
            if not await self._move_out(request):
                return
        if config.partitions > len(self._views):
            try:
                await self._storage_job(partial(self.store.ensure_partitions, config.partitions))
            except StorageError as exc:
                _answer(request, Unavailable(f"storage failed, retry later: {exc}"))
                return
            self._views.extend(PartitionView() for _ in range(config.partitions - len(self._views)))
        self.config = config
        _answer(request, None)

    async def _move_out(self, request: _Reconfigure) -> bool:
        """Leave the commit group for an environment of the queue's own (see move_out)."""
        assert request.move_out is not None and request.persist is not None and self.group is not None
        group, old = self.group, self.store
        try:
            store = await group.job(partial(request.move_out, old))
        except (StorageError, OSError) as exc:
            _answer(request, Unavailable(f"storage failed, retry later: {exc}"))
            return False
        try:
            keyed = await self._lane.run(partial(KeyedIndex, store))
            crash_point(MOVE_COPIED)
            await request.persist()
            crash_point(MOVE_RECORDED)
        except Exception as exc:
            await self._lane.run(store.destroy)
            _answer(request, exc if isinstance(exc, QueratorError) else Unavailable(f"storage failed, retry later: {exc}"))
            return False
        store.on_commit = old.on_commit
        self.store, self.group, self._keyed = store, None, keyed
        try:
            await group.job(old.destroy)
        except StorageError as exc:  # start-up drops what the catalog no longer owns
            log.warning("group_storage_left", queue=self.name, error=str(exc))
        return True

    # -- hand-overs (handover.py) ----------------------------------------------------

    def _stopped(self) -> bool:
        return self._closed is not None

    def _faulty_now(self) -> dict[int, str]:
        return self._faulty

    async def _send_dead_letters(self, entries: list[tuple[tuple[int, int], Item]], done: Callable[[list[tuple[int, int]]], None]) -> None:
        """Dead letters to the dead-letter queue (dropped, logged, without one), then
        out of the outbox."""
        dead_queue = self.config.dead_queue
        if dead_queue:
            if self._resolve is None:
                raise Unavailable("no way to reach other queues")
            target = self._resolve(dead_queue)
            await target.submit(DeadLetterRequest([Item.decode(item.encode()) for _, item in entries]))
            crash_point(DEAD_LETTER_STORED)
        else:
            for _key, item in entries:
                log.warning("item_dropped", queue=self.name, item_id=item.source_id, reason="no dead_queue")
        keys = [key for key, _ in entries]
        await self.submit(OutboxDoneRequest(keys))
        done(keys)

    async def _send_redriven(
        self, entries: list[tuple[tuple[int, int], tuple[int, Item]]], done: Callable[[list[tuple[int, int]]], None]
    ) -> None:
        """Redriven items to their targets (redrive.py), then out of the outbox; those
        whose target queue is gone go back into this queue."""
        by_target: dict[int, list[tuple[tuple[int, int], Item]]] = {}
        for key, (target_uid, item) in entries:
            by_target.setdefault(target_uid, []).append((key, item))
        for target_uid, moved in by_target.items():
            target = self._resolve_uid(target_uid) if self._resolve_uid is not None else None
            keys = [key for key, _ in moved]
            if target is None:
                log.warning("redrive_target_gone", queue=self.name, items=len(keys), target_uid=target_uid)
                await self.submit(RedriveDoneRequest(keys, restore=True))
            else:
                await target.submit(RedriveInRequest([handed_over(self.config.uid, p, seq, item) for (p, seq), item in moved]))
                crash_point(REDRIVE_STORED)
                await self.submit(RedriveDoneRequest(keys))
            done(keys)
            self._settle_redrive_waiters()

    def _settle_redrive_waiters(self) -> None:
        still: list[tuple[list[tuple[int, int]], asyncio.Future[None]]] = []
        for entries, waiter in self._redrive_waiters:
            if waiter.done():
                continue
            if any(key in self._redrive.entries for key in entries):
                still.append((entries, waiter))
            else:
                waiter.set_result(None)
        self._redrive_waiters = still

    def _apply_delete(self, request: _Delete) -> None:
        if not request.force and self.holds_items():
            _answer(request, FailedPrecondition(f"queue {self.name!r} still holds items; set force to delete it"))
            return
        self._closed = NotFound(f"queue {self.name!r} was deleted")
        _answer(request, None)


# Each step takes (cycle, txn, request=...).
_ACK: dict[type, Callable[..., None]] = {
    CompleteRequest: Cycle.complete,
    RetryRequest: Cycle.retry,
    ExtendRequest: Cycle.extend,
}

_OTHER: dict[type, Callable[..., None]] = {
    ListItemsRequest: Cycle.list_items,
    ImportItemsRequest: Cycle.import_items,
    DeleteItemsRequest: Cycle.delete_items,
    ClearRequest: Cycle.clear,
    DeadLetterRequest: Cycle.receive_dead_letters,
    OutboxDoneRequest: Cycle.outbox_done,
    GiveBackRequest: Cycle.give_back,
    RedriveRequest: Cycle.redrive,
    RedriveInRequest: Cycle.receive_redriven,
    RedriveDoneRequest: Cycle.redrive_done,
}


def _adds_items(batch: _Batch) -> bool:
    return bool(batch.produces) or any(isinstance(r, _ADDING) for r in batch.others)


def _split_adding(batch: _Batch) -> tuple[list[Request], _Batch]:
    """The requests of ``batch`` that add items, and a batch of the others."""
    adding: list[Request] = list(batch.produces)
    others: list[Request] = []
    for request in batch.others:
        (adding if isinstance(request, _ADDING) else others).append(request)
    return adding, _Batch(leases=batch.leases, acks=batch.acks, others=others)


# The requests that store new items (the first to fail on a full disk or map).
_ADDING = (ImportItemsRequest, DeadLetterRequest, RedriveInRequest)


def _only_listings(batch: _Batch, lifecycle: bool) -> bool:
    return not lifecycle and not (batch.produces or batch.leases or batch.acks) and all(
        isinstance(r, ListItemsRequest) for r in batch.others
    )


def _answer_results(cycle: Cycle) -> None:
    """Answer a cycle's requests as its commit is known durable: one turn of the loop
    before the actor itself resumes (which answers whatever is left)."""
    for request, result in cycle.results:
        _answer(request, result)


def _committed(lane: StorageLane, commit: Callable[[], None], cycle: Cycle) -> asyncio.Future[None]:
    """Commit on ``lane``; the cycle's requests are answered as the commit returns."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def done(_result: None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
            return
        _answer_results(cycle)
        future.set_result(None)

    lane.run_then(commit, done)
    return future


def _answer(request: Request, result: object) -> None:
    future = request.future
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
