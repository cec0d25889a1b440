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
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any, TypeVar, cast

import lmdb

from ..clock import now_us
from ..errors import (
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    QueratorError,
    ResourceExhausted,
    Unavailable,
    holds_items,
)
from ..faults import (
    DEAD_LETTER_STORED,
    LEASE_COMPLETED,
    LEASE_RECORDED,
    LEASE_WRITTEN_OUT,
    REDRIVE_STORED,
    REDRIVE_TAKEN,
    InjectedFault,
    crash_point,
    faulty_call,
)
from ..logging import get_logger
from ..model import QueueConfig, QueueStats, QueueTotals
from ..storage import Item, QueueStore, StorageError, done_runs
from ..storage.change_set import Fenced
from ..storage.commit_group import CommitGroup
from ..storage.keyed import KeyedIndex
from ..storage.lane import StorageLane
from ..storage.queue_store import disk_full
from ..storage.replica_state import ReplicaState
from .batch import Batch, CycleWork, DeleteQueue, Reconfigure, cycle_body
from .cycle import Cycle
from .cycle_base import StepFailed
from .group_exit import leave_group
from .handover import RETRY_S as HANDOVER_RETRY_S
from .handover import HandOver
from .health import StorageHealth, storage_error
from .leases import LeaseDeadlines
from .lifecycle import DONE_SWEEP_GAP_US, LIFECYCLE_BATCH, done_retention_us
from .loading import broken_partitions, load
from .redrive import handed_over
from .replication import Replication, ReplicationGate
from .requests import (
    CompleteRequest,
    DeadLetterRequest,
    ExtendRequest,
    LeaseRequest,
    LeaseResult,
    ListItemsRequest,
    OutboxDoneRequest,
    ProduceRequest,
    RedriveDoneRequest,
    RedriveInRequest,
    RedriveResult,
    Request,
    RetryRequest,
)
from .transaction import Body, answer, run_grouped, run_own
from .view import PartitionView
from .wake import Wake

T = TypeVar("T")

log = get_logger("queue")

DEFAULT_MAX_INBOX = 10_000
# Request kinds a cycle sorts into its batch (tuples: a union would be built per request).
_ACKS = (CompleteRequest, RetryRequest, ExtendRequest)
_CONTROL = (Reconfigure, DeleteQueue)
# GetQueueStats looks at the first waiting item of this many ordered groups per
# partition at most (one lookup each) for the oldest waiting item's age.
OLDEST_WAITING_GROUPS = 10_000
# How long a primary stepping down waits for its replicas to acknowledge what it committed.
STEP_DOWN_GRACE_S = 2.0
# After a failed lifecycle step, the next try waits this long (as a failed hand-over does).
OUTBOX_RETRY_S = HANDOVER_RETRY_S


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
        replication: Replication | None = None,
        epoch: int = 0,
        on_deposed: Callable[[str, str], None] | None = None,
    ) -> None:
        self.config = config
        # Faulty partitions, a failing storage, a run of failed cycles (health.py).
        self._health = StorageHealth(
            config.name, store.path, lambda: len(self._views), fail_after_s=fail_after_s, on_partitions=on_partitions
        )
        # Told the queue's name and why when it has failed for good.
        self._on_failed = on_failed
        self.failed = False
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
        self._wake = Wake()
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
        self._lifecycle_pending = False
        # After a lifecycle step failed: not before this time (wall µs; 0: no hold).
        self._lifecycle_after = 0
        self._keyed: KeyedIndex | None = None
        # When the oldest remembered idempotency key and lease key were taken (0: none).
        self._dedup_at = 0
        self._lease_keys_at = 0
        self._done_at = 0  # done_at of the first record of completed items (done_runs.py)
        # Metrics hook (metrics.QueueProbe) when --metrics-address is set.
        self.observer: Any = None
        # A replicated queue's primary: its cycles are recorded as change sets under
        # ``epoch`` and answered once ``replication`` has them on every in-sync copy
        # (replication.py). None (one copy): no recording, answers at the commit.
        self.epoch = epoch
        self.replica: ReplicaState | None = None
        self._gate = None if replication is None else ReplicationGate(config.name, replication, self._replication_lost)
        # Told the queue's name and why when it stopped serving as primary.
        self._on_deposed = on_deposed
        self.deposed = False

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def partition_count(self) -> int:
        return len(self._views)

    @property
    def faulty_partitions(self) -> dict[int, str]:
        """The faulty partitions and why (read only: replaced, never changed in place)."""
        return self._health.faulty

    @property
    def keyed_index(self) -> KeyedIndex | None:
        return self._keyed

    # -- life ----------------------------------------------------------------------

    async def start(self, keyed: KeyedIndex | None = None, replica: ReplicaState | None = None) -> None:
        """Load the queue's state and start the actor; ``keyed`` (and ``replica``)
        reuse the handles of an earlier actor or copy on the same (still open) storage."""
        loaded = await self._storage_job(partial(load, self.store))
        self._views, self._outbox.entries, self._redrive.entries = loaded.views, loaded.outbox, loaded.redrive
        if loaded.faulty:
            self._partitions_changed(loaded.faulty, {}, now_us())
        self._leases = LeaseDeadlines(loaded.leases)
        self._keyed = keyed or await self._storage_job(partial(KeyedIndex, self.store))
        self._dedup_at, self._lease_keys_at = await self._storage_job(self._load_key_times)
        self._done_at = await self._storage_job(self._load_done_time)
        if self._gate is not None:
            keyed_index = self._keyed
            self.replica = replica or await self._storage_job(lambda: ReplicaState(self.store, keyed_index, self.config.uid))
        # Everything that fell due while the server was down is handled at once.
        self._lifecycle_pending = True
        self._task = asyncio.create_task(self._run(), name=f"queue:{self.name}")

    def _load_key_times(self) -> tuple[int, int]:
        assert self._keyed is not None
        with self.store.env.begin() as txn:
            return self._keyed.first_dedup_at(txn), self._keyed.first_lease_key_at(txn)

    def _load_done_time(self) -> int:
        with self.store.env.begin() as txn:
            times = [done_runs.first_at(txn, self.store.db(p)) for p in range(len(self._views))]
        return min((t for t in times if t), default=0)

    def kick_outboxes(self) -> None:
        """Start handing over what the outboxes hold (a promoted copy's, left by the
        primary before it)."""
        self._outbox.kick()
        self._redrive.kick()

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

    async def stop(self) -> None:
        """Finish what was submitted, fail waiting leases with UNAVAILABLE, close storage."""
        if self._closed is None:
            self._closed = Unavailable(f"queue {self.name!r} is shutting down")
        self._wake.set()
        if self._task is not None:
            await self._task
        await self._settle_gate("the server is stopping", STEP_DOWN_GRACE_S)
        await self._cancel_outbox()
        await self._storage_job(self.store.close)

    def _storage_job(self, fn: Callable[[], T]) -> Awaitable[T]:
        """Run ``fn`` on the lane with no transaction of this queue held there."""
        if self.group is not None:
            return self.group.job(fn)
        return self._lane.run(fn)

    async def _cancel_outbox(self) -> None:
        stopped = Unavailable(f"queue {self.name!r} stopped; the moved items are handed over at start")
        await self._outbox.cancel(stopped)
        await self._redrive.cancel(stopped)

    async def delete(self, force: bool) -> None:
        """Stop the actor for good if the queue is empty (or ``force``); storage stays open."""
        await self.submit(DeleteQueue(force=force))
        if self._task is not None:
            await self._task
        await self._cancel_outbox()
        await self._storage_job(self.store.abort_held)

    async def reconfigure(self, config: QueueConfig) -> None:
        await self.submit(Reconfigure(config=config))

    async def move_out(
        self, config: QueueConfig, copy: Callable[[QueueStore], QueueStore], persist: Callable[[], Awaitable[None]]
    ) -> None:
        """Reconfigure to ``config`` in an environment of the queue's own: between two
        cycles, ``copy`` the storage out of the group, ``persist`` the move (the catalog),
        then drop the group's copy. Nothing changes if ``copy`` or ``persist`` fails."""
        await self.submit(Reconfigure(config=config, move_out=copy, persist=persist))

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
        parts = [v.stats(p, now_us(), *self._health.failure_of(p)) for p, v in enumerate(self._views)]
        grouped = [p for p, v in enumerate(self._views) if v.waiting and p not in self._health.faulty]
        if grouped:  # read only for partitions where items wait in groups
            for p, at in self.store.oldest_waiting(grouped, OLDEST_WAITING_GROUPS).items():
                parts[p].oldest_waiting_at_us = at
        waiting, producing = self._waiting_calls()
        return QueueStats(parts, lease_waiting=waiting, produce_waiting=producing, in_flight=self._in_flight)

    def totals(self) -> QueueTotals:
        """The in-memory counts summed over the partitions; reads no storage. Safe to call
        from another thread (the metrics endpoint's): it only reads ints, and a view
        swapped meanwhile is read before or after the swap, never torn."""
        ready = leased = scheduled = created = in_groups = in_flight = 0
        views = list(self._views)
        for v in views:
            ready += v.ready
            leased += v.leased
            scheduled += v.scheduled
            created += v.created_sum
            in_groups += v.waiting
            in_flight += v.groups_in_flight
        waiting, producing = self._waiting_calls()
        return QueueTotals(
            len(views),
            ready,
            leased,
            scheduled,
            created,
            waiting,
            producing,
            faulty=self._health.faulty_count(),
            waiting=in_groups,
            groups_in_flight=in_flight,
        )

    def ready_heads(self, partitions: Iterable[int]) -> dict[int, int | None]:
        """created_at (us) of the first ready item of each of ``partitions`` (0: none
        ready; None: not found within a bounded look past leased items). Reads storage:
        call it on the loop, between cycles, as the metrics hook is called."""
        views = self._views
        asked = [p for p in partitions if p not in self._health.faulty]
        out: dict[int, int | None] = {p: 0 for p in asked if not views[p].ready}
        starts = [(p, views[p].ready_hint, views[p].leases.held) for p in asked if views[p].ready]
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
        return bool(self._health.faulty or self._redrive.entries) or any(
            v.ready or v.leased or v.scheduled or v.waiting for v in self._views
        )

    # -- the loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                if not self._inbox and not self._lifecycle_due() and not self._health.probe_due():
                    if self._closed is not None:
                        break
                    self._arm_timer()
                    await self._wake.wait()
                self._wake.clear()
                if self._closed is not None and (not self._inbox or self.failed or self.deposed):
                    break
                if self._gate is not None:
                    await self._gate.room()
                inbox, self._inbox = self._inbox, []
                await self._cycle(inbox)
        finally:
            if self._timer is not None:
                self._timer.cancel()
            closed = self._closed or Unavailable(f"queue {self.name!r} stopped")
            for lease in self._waiting:
                answer(lease, closed if not isinstance(closed, NotFound) else LeaseResult(0))
            self._waiting = []
            for request in self._inbox:
                answer(request, closed)
            self._inbox = []

    def _next_lifecycle_us(self, *, exact: bool = True) -> int:
        """The earliest lease deadline, due time or expiry (0: none).

        Not ``exact``: possibly earlier, by the deadline of a lease that has already
        ended; skipping those costs a heap pop per ended lease, which only pays when
        the answer could be "due now".
        """
        views = self._views
        if self._health.faulty:  # nothing of theirs is due until they work again
            views = [v for p, v in enumerate(views) if p not in self._health.faulty]
        # One pass and no list: a queue of one request per cycle asks this two or three
        # times per request (before it sleeps, for its timer, and in the cycle).
        first = 0
        for v in views:
            at = v.first_due
            if at and (not first or at < first):
                first = at
            at = v.first_expiry
            if at and (not first or at < first):
                first = at
        at = self._dedup_at and self._dedup_at + self.config.dedup_window_us
        if at and (not first or at < first):
            first = at
        at = self._lease_keys_at and self._lease_keys_at + self.config.lease_key_ttl_us
        if at and (not first or at < first):
            first = at
        at = self._done_at and self._done_at + done_retention_us(self.config.lease_timeout_us)
        if at and (not first or at < first):
            first = at
        at = self._leases.first() if exact else self._leases.first_bound()
        if at and (not first or at < first):
            first = at
        return first

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
        times.extend(self._health.wake_times())
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
        batch = Batch()
        control: list[Request] = []
        parked, self._waiting = self._waiting, []
        for lease in parked:
            if lease.future.done():
                continue
            if lease.wait_until_us <= now:
                answer(lease, LeaseResult(0))
            else:
                batch.leases.append(lease)
        for request in inbox:
            if request.future.done():
                continue
            if request.deadline_us and now >= request.deadline_us:
                answer(request, DeadlineExceeded("the request's deadline passed before it could be applied"))
            elif isinstance(request, ProduceRequest):
                batch.produces.append(request)
            elif isinstance(request, LeaseRequest):
                batch.leases.append(request)
            elif isinstance(request, _ACKS):
                batch.acks.append(request)
            elif isinstance(request, _CONTROL):
                control.append(request)
            else:
                batch.others.append(request)

        for request in control:
            if isinstance(request, Reconfigure):
                await self._apply_config(request)
        if self._gate is not None and len(batch):
            batch = self._refuse_writes(batch, self._gate.refusal())
        lifecycle = self._lifecycle_due()
        probing = self._health.take_probes(now)
        # Taken whatever else the cycle does, so the next probe waits its turn (parked
        # leases in every cycle would otherwise keep one due).
        probe_storage = self._health.take_storage_probe(now)
        if len(batch) or lifecycle or probing or probe_storage:
            await self._apply(batch, now, lifecycle)
        for request in control:
            if isinstance(request, DeleteQueue):
                self._apply_delete(request)

    def _partitions_changed(self, faulty: dict[int, str], recovered: dict[int, object], now: int) -> None:
        for p in self._health.partitions_changed(faulty, recovered, now):
            self._leases.drop_partition(p)  # read again from storage when it works again

    def _adopt_partitions(self, cycle: Cycle) -> None:
        for p, (scan, outbox, moving) in cycle.recovered.items():
            self._leases.add_all((deadline, p, seq) for deadline, seq in scan.leases)
            self._outbox.entries.update(((p, seq), item) for seq, item in outbox)
            self._redrive.entries.update(((p, seq), (uid, item)) for seq, uid, item in moving)
            self._health.recovered(p, cycle.now)
        self._partitions_changed({**cycle.still_faulty, **cycle.newly_faulty}, dict(cycle.recovered), cycle.now)
        if cycle.recovered:
            self._outbox.kick()
            self._redrive.kick()

    async def _apply(self, batch: Batch, now: int, lifecycle: bool) -> None:
        self._in_flight = len(batch)
        expired: list[tuple[int, int, int]] = []
        if lifecycle:
            self._lifecycle_pending = False
            expired = self._leases.pop_due(now, LIFECYCLE_BATCH)
        started = time.perf_counter()
        try:
            committed = await self._commit(batch, now, lifecycle, expired)
        finally:
            self._in_flight = 0
        if committed is None:
            return
        cycle, batch, adds_refused = committed
        if self._health.failure and not adds_refused:
            self._health.storage_works(cycle)
        for p, view in cycle.views.items():
            self._views[p] = view
        if cycle.newly_faulty or self._health.probing:
            self._adopt_partitions(cycle)
        self._health.cycle_wrote(cycle)
        if cycle.step_failures:
            self._report_step_failures(cycle, batch, expired)
        elif lifecycle:
            self._lifecycle_after = 0
        if self.observer is not None:
            self.observer.cycle_done(self, cycle, len(batch), time.perf_counter() - started)
        self._adopt_keys_and_leases(cycle, expired)
        if self._gate is not None:
            if cycle.change is not None and self.replica is not None:
                self.replica.committed(cycle.change)
            # Nothing leaves for another queue before the copies hold the move: a new
            # primary without it would move the items again.
            outboxes = (
                partial(self._adopt_outboxes, cycle) if cycle.outbox_added or cycle.redrive_added or cycle.dropped else None
            )
            self._gate.release(cycle.change, cycle.results, outboxes)
        else:
            self._adopt_outboxes(cycle)
            for request, result in cycle.results:
                answer(request, result)
        later = now_us()
        for lease in cycle.unserved:
            if lease.future.done():
                continue
            if lease.wait_until_us > later and self._closed is None:
                self._waiting.append(lease)
            else:
                answer(lease, LeaseResult(0))

    async def _commit(
        self, batch: Batch, now: int, lifecycle: bool, expired: list[tuple[int, int, int]]
    ) -> tuple[Cycle, Batch, bool] | None:
        """The committed cycle, the batch it applied, and whether a full disk refused the
        requests that add items first; None when it failed (every request answered)."""
        adds_refused = False
        try:
            try:
                cycle = await self._attempt(batch, now, lifecycle, expired)
            except StorageError as exc:
                if not disk_full(exc) or not batch.adds_items():
                    raise
                # A full disk or map: what adds items cannot be stored and fails, while
                # leases, completions and the rest mostly rewrite or free pages LMDB
                # already has: they are tried again alone rather than fail with the
                # adds, so consumers still drain the queue (and free its space).
                adds_refused = True
                self._health.storage_failed(exc)
                adding, batch = batch.split_adding()
                for request in adding:
                    answer(request, storage_error(exc, request))
                if not (len(batch) or lifecycle or self._health.probing):
                    return None
                cycle = await self._attempt(batch, now, lifecycle, expired)
        except Exception as exc:
            await self._cycle_failed(exc, batch, lifecycle, expired)
            return None
        return cycle, batch, adds_refused

    async def _cycle_failed(self, exc: Exception, batch: Batch, lifecycle: bool, expired: list[tuple[int, int, int]]) -> None:
        """Nothing of the cycle was applied: every request fails, the leases that ran out
        wait for the next cycle."""
        self._leases.restore(expired)
        if lifecycle:
            self._lifecycle_pending = True
        if isinstance(exc, Fenced):
            self._replication_lost(str(exc))
            self._fail_batch(batch, Unavailable(f"queue {self.name!r} is no longer primary here ({exc}); retry"))
            return
        if isinstance(exc, StorageError):
            self._health.storage_failed(exc)
            self._fail_batch(batch, storage_error(exc))
            if not disk_full(exc):
                self._storage_failing(str(exc))
        else:  # a bug must not kill the actor; the cycle was rolled back
            log.exception("cycle_failed", queue=self.name, error=repr(exc))
            self._fail_batch(batch, Unavailable("internal error while applying the request; it was not applied"))
        if lifecycle:
            await asyncio.sleep(OUTBOX_RETRY_S)  # don't spin on a failing disk

    def _adopt_keys_and_leases(self, cycle: Cycle, expired: list[tuple[int, int, int]]) -> None:
        if cycle.dedup_next is not None:
            self._dedup_at = cycle.dedup_next
        if cycle.dedup_added and not self._dedup_at:
            self._dedup_at = cycle.now
        if cycle.lease_keys_next is not None:
            self._lease_keys_at = cycle.lease_keys_next
        if cycle.lease_keys_added and not self._lease_keys_at:
            self._lease_keys_at = cycle.now
        if cycle.done_next is not None:
            # Not due again within the gap: a drain's records expire one by one, and a
            # sweep per cycle would cost a seek per partition each time.
            retention = done_retention_us(self.config.lease_timeout_us)
            self._done_at = max(cycle.done_next, cycle.now + DONE_SWEEP_GAP_US - retention) if cycle.done_next else 0
        if cycle.done_added and not self._done_at:
            self._done_at = cycle.now
        for lease in cycle.completed_by_lease:
            lease.complete_ids = []  # committed: a lease that keeps waiting must not repeat it
        if cycle.records_written or cycle.records_completed or cycle.records_written_out:
            _lease_record_crash_points(cycle)
        self._leases.end_all(cycle.lease_ends)
        self._leases.end_runs(cycle.lease_end_runs)
        self._leases.add_all(cycle.lease_deadlines)
        self._leases.add_runs(cycle.lease_deadline_runs)
        if cycle.more_lifecycle or len(expired) >= LIFECYCLE_BATCH:
            self._lifecycle_pending = True

    def _adopt_outboxes(self, cycle: Cycle) -> None:
        """Dead letters and redriven items the cycle committed to its outboxes: handed over."""
        for item_id, reason, error in cycle.dropped:
            # The log line is all that is left of the item: it says what went wrong too.
            log.warning("item_dropped", queue=self.name, item_id=item_id, reason=reason, dead_queue=None, error=error)
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
                    self._redrive.wait_for(result.entries, result.delivered)
            self._redrive.kick()

    async def _attempt(self, batch: Batch, now: int, lifecycle: bool, expired: list[tuple[int, int, int]]) -> Cycle:
        try:
            return await self._transaction(batch, now, lifecycle, expired)
        except StepFailed as failed:
            # One step failed half-way: run the cycle again with every step in a
            # nested transaction of its own, so that one fails alone (cycle_base.py).
            log.warning("cycle_isolated", queue=self.name, step=str(failed), requests=len(batch))
            return await self._transaction(batch, now, lifecycle, expired, isolated=True)

    def _report_step_failures(self, cycle: Cycle, batch: Batch, expired: list[tuple[int, int, int]]) -> None:
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
        """Another cycle failed for the storage: past ``fail_after_s`` of nothing but
        failures, the queue is marked failed (health.py)."""
        if self.failed or not (why := self._health.cycle_failed(reason)):
            return
        self.failed = True  # the loop answers what waits and stops
        self._closed = Unavailable(f"queue {self.name!r} has failed and is not served: {why}")
        self._wake.set()
        if self._on_failed is not None:
            self._on_failed(self.name, why)

    async def _transaction(
        self, batch: Batch, now: int, lifecycle: bool, expired: list[tuple[int, int, int]], *, isolated: bool = False
    ) -> Cycle:
        writable = self._writes(batch, lifecycle)
        body = self._body(batch, now, lifecycle, expired, writable, isolated=isolated)
        if not writable:
            # Only listings: a read transaction, no commit and no fsync.
            return self.store.read(body)
        early = self._gate is None
        if not early:
            body = self._recorded(body)
        if self.group is not None:
            return await run_grouped(self.group, self.store, body, len(batch), self, answer_early=early)
        return await run_own(self.store, self._lane, body, len(batch), answer_early=early)

    def _recorded(self, body: Body) -> Body:
        """``body`` with its writes recorded as the cycle's change set (a replicated
        queue), the position written with them."""
        replica, epoch = self.replica, self.epoch
        assert replica is not None

        def recorded(txn: lmdb.Transaction[bytes]) -> Cycle:
            recording = replica.record(txn)
            cycle = body(cast("lmdb.Transaction[bytes]", recording))
            cycle.change = replica.seal(txn, recording, epoch)
            return cycle

        return recorded

    async def step_down(self, reason: str, grace_s: float = STEP_DOWN_GRACE_S) -> None:
        """Stop serving as a replicated queue's primary, leaving the storage open (the
        manager keeps it as a passive copy): calls not yet applied fail UNAVAILABLE;
        changes already handed to the replicas get ``grace_s`` to be acknowledged (so
        a hand-over leaves the copies alike), then their calls fail UNAVAILABLE too."""
        if self._closed is None:
            self._closed = Unavailable(f"queue {self.name!r} is no longer served on this node ({reason}); retry")
        self.deposed = True
        self._wake.set()
        if self._task is not None:
            await self._task
        await self._settle_gate(reason, grace_s)
        await self._cancel_outbox()
        await self._storage_job(self.store.abort_held)

    async def _settle_gate(self, reason: str, grace_s: float) -> None:
        """Give the answers waiting for the replicas ``grace_s`` to be released, then
        fail the rest UNAVAILABLE (a replica that never answers must not hold a stop)."""
        if self._gate is None:
            return
        if not self._gate.lost:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._gate.drain()), grace_s)
        self._gate.abandon(reason)
        await self._gate.drain()

    def _replication_lost(self, reason: str) -> None:
        """Stop serving as primary: what waits fails UNAVAILABLE, the loop ends."""
        if self.deposed:
            return
        self.deposed = True
        self._closed = Unavailable(f"queue {self.name!r} stopped serving here: {reason}; retry")
        self._wake.set()
        if self._on_deposed is not None:
            self._on_deposed(self.name, reason)

    def _body(
        self,
        batch: Batch,
        now: int,
        lifecycle: bool,
        expired: list[tuple[int, int, int]],
        writable: bool,
        *,
        isolated: bool = False,
    ) -> Body:
        work = CycleWork(
            lifecycle=lifecycle,
            expired=expired,
            forget_keys=bool(
                (self._dedup_at and self._dedup_at + self.config.dedup_window_us <= now)
                or (self._lease_keys_at and self._lease_keys_at + self.config.lease_key_ttl_us <= now)
            ),
            forget_done=bool(self._done_at and self._done_at + done_retention_us(self.config.lease_timeout_us) <= now),
            probes=self._health.probing,
            touch=writable and bool(self._health.failure),
        )
        new_cycle = partial(
            Cycle,
            self.store,
            self.config,
            self._views,
            now,
            self._keyed,
            isolated=isolated,
            writable=writable,
            faulty=self._health.faulty,
            broken=broken_partitions(self.store),
        )
        return cycle_body(batch, new_cycle, work)

    def _writes(self, batch: Batch, lifecycle: bool) -> bool:
        """Whether a cycle runs in a write transaction: unless it only lists items (a
        read works on a full disk), or it is the probe of a failing storage."""
        if not batch.only_listings(lifecycle or bool(self._health.probing)):
            return True
        return bool(self._health.failure) and not len(batch)

    @staticmethod
    def _refuse_writes(batch: Batch, refusal: Unavailable | None) -> Batch:
        """``batch`` without its writes, each answered ``refusal`` (None: all of it)."""
        if refusal is None:
            return batch
        listings: list[Request] = [r for r in batch.others if isinstance(r, ListItemsRequest)]
        for request in batch.produces + batch.leases + batch.acks + batch.others:
            if not isinstance(request, ListItemsRequest):
                answer(request, refusal)
        return Batch(others=listings)

    def _fail_batch(self, batch: Batch, error: QueratorError) -> None:
        # Leases too: one that kept waiting through failing cycles would end with no
        # items while items are ready, and its caller would take the outage for an
        # empty queue.
        for request in batch.produces + batch.leases + batch.acks + batch.others:
            answer(request, error)

    async def _apply_config(self, request: Reconfigure) -> None:
        config = request.config
        if request.move_out is not None and self.group is not None:
            if not await leave_group(self.name, self.group, self.store, self._lane, request, self._adopt_store):
                return
        if config.partitions > len(self._views):
            try:
                await self._storage_job(partial(self.store.ensure_partitions, config.partitions))
            except StorageError as exc:
                answer(request, Unavailable(f"storage failed, retry later: {exc}"))
                return
            self._views.extend(PartitionView() for _ in range(config.partitions - len(self._views)))
        self.config = config
        answer(request, None)

    def _adopt_store(self, store: QueueStore, keyed: KeyedIndex) -> None:
        """The queue's storage now has an environment of its own (group_exit.py)."""
        self.store, self.group, self._keyed = store, None, keyed

    # -- hand-overs (handover.py) ----------------------------------------------------

    def _stopped(self) -> bool:
        return self._closed is not None

    def _faulty_now(self) -> dict[int, str]:
        return self._health.faulty

    async def _send_dead_letters(
        self, entries: list[tuple[tuple[int, int], Item]], done: Callable[[list[tuple[int, int]]], None]
    ) -> None:
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
                log.warning(
                    "item_dropped", queue=self.name, item_id=item.source_id, reason="no dead_queue", error=item.last_error
                )
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

    def _apply_delete(self, request: DeleteQueue) -> None:
        if not request.force and self.holds_items():
            answer(request, holds_items(self.name))
            return
        self._closed = NotFound(f"queue {self.name!r} was deleted")
        answer(request, None)


def _lease_record_crash_points(cycle: Cycle) -> None:
    """The kill -9 points of lease records (faults.py), once the cycle committed."""
    if cycle.records_written:
        crash_point(LEASE_RECORDED)
    if cycle.records_completed:
        crash_point(LEASE_COMPLETED)
    if cycle.records_written_out:
        crash_point(LEASE_WRITTEN_OUT)
