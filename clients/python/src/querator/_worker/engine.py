"""The asyncio machinery behind both Worker and AsyncWorker.

Delivery is at least once. An item is completed only after its handler returned; an
item whose worker crashed (or lost its lease) comes back by lease expiry and is
handled again, with ``attempts`` one higher. Handlers must therefore be idempotent.

Calls per batch: one Lease call is in flight at a time, or a few while the queue has a
backlog (the last Lease came back full) and the worker has room for their batches;
never one behind a long poll. Items whose handler returned wait for the next Lease and
are completed by it (``LeaseRequest.complete_ids``: one call completes a batch and
leases the next); such a Lease does not wait on the server (``wait=0``), so a
completion is confirmed within one round trip. Items the next Lease cannot carry
(another partition, no room to lease, nothing sent within a short linger) are completed
by Complete calls, batched (settler.py). Retries and dead-letters always go by Retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from .. import tracing as _tracing
from .._config import MAX_BATCH
from .._convert import seconds
from .._failure import failure_text
from .._items import COMPLETED, DEAD, _LeasedBase
from ..errors import DeadLetter, HandlerTimeout, LeaseLost, QueratorError, Unavailable
from .calls import WorkerCalls
from .dispatch import Dispatch, Route
from .keepalive import KeepAlive
from .options import WorkerHooks, WorkerOptions, WorkerStats
from .processes import HandlerProcesses
from .settler import Settler
from .state import Held, HeldKey
from .threads import HandlerThreads

if TYPE_CHECKING:
    from .._client import Client
    from .._models import PartitionStats
    from .metrics import WorkerMetrics

log = logging.getLogger("querator.worker")


@dataclass(eq=False)
class _LeaseCall:
    task: asyncio.Task[list[_LeasedBase]]
    #: The completions it carries, resolved when it answers.
    completing: list[tuple[Held, asyncio.Future[bool | None]]]
    sent: float
    asked: int
    #: A long poll: no Lease is sent behind it.
    waits: bool
    #: Which of the worker's client_ids it uses (0: ``client_id`` itself).
    slot: int


# Leases in flight at once while the queue has a backlog. Each costs a round trip in
# which the handlers of the last batch may run dry; more than a few gain nothing.
_MAX_LEASES_IN_FLIGHT = 4

# How long a handled item may wait for the next Lease to complete it before a Complete
# call does: a few Lease round trips, within these bounds.
_LINGER_MIN = 0.02
_LINGER_MAX = 0.5

# Burst mode: the longest a Lease waits, so that the worker notices soon that the
# queue ran dry (items leased by others or scheduled may still come back).
_BURST_WAIT = 1.0

# Burst mode, the readable partitions empty but others faulty: how often to log that
# the worker still waits for them.
_FAULTY_LOG_EVERY = 60.0


class Engine:
    """The asyncio machinery behind both Worker and AsyncWorker."""

    def __init__(
        self,
        calls: WorkerCalls,
        queue_name: str,
        dispatch: Dispatch,
        options: WorkerOptions,
        make_sync_client: Callable[[], Client] | None,
    ) -> None:
        self.calls = calls
        self.queue_name = queue_name
        self.dispatch = dispatch
        self.o = options
        self.hooks = options.hooks or WorkerHooks()
        self.stats = WorkerStats()
        self.policy = options.failure_rules()
        self.tracing = calls.config.tracing
        self._make_sync_client = make_sync_client
        self._sync_client: Client | None = None
        self._owns_sync_client = False
        self.batch_size = min(options.batch_size or options.concurrency, MAX_BATCH)
        buffered = self.batch_size if options.max_buffered is None else options.max_buffered
        self.max_held = options.concurrency + buffered
        self.client_id = options.client_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.handler_timeout = seconds(options.handler_timeout) if options.handler_timeout is not None else None
        self.max_lease = seconds(options.max_lease_duration) if options.max_lease_duration is not None else None
        self.metrics: WorkerMetrics | None = None
        self.held: dict[HeldKey, Held] = {}
        self.n_waiting = 0  # held items not started yet
        self.n_finished = 0  # held items whose handler returned, waiting for completion
        # Completions for the next Lease call: (held, future of True = completed by the
        # Lease, None = not sent with a Lease, complete it with Complete).
        self.to_complete: list[tuple[Held, asyncio.Future[bool | None]]] = []
        self.accepting = False  # the lease loop takes completions
        self.linger: asyncio.TimerHandle | None = None
        self.lease_rtt = 0.01
        # The last Lease came back full: the queue has a backlog, so further Leases may
        # be in flight at once.
        self.backlog = False
        self.failures = 0  # Lease calls failed in a row
        self.until_empty = False
        self.faulty_timeout = seconds(options.faulty_timeout) if options.faulty_timeout is not None else None
        # Burst mode: since when every readable partition is empty while others are
        # faulty (monotonic; None: not so), when that was last logged, and the error
        # run() raises once faulty_timeout has passed.
        self.faulty_since: float | None = None
        self.faulty_logged = 0.0
        self.burst_error: QueratorError | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: asyncio.Event | None = None
        self.started = threading.Event()

    # -- plumbing ---------------------------------------------------------------------------

    def hook(self, name: str, *args: Any) -> None:
        try:
            getattr(self.hooks, name)(*args)
        except Exception:
            log.exception("worker hook %s failed", name)

    def request_stop(self) -> None:
        """Ask the worker to stop; safe from any thread."""
        loop, stopping = self.loop, self.stopping
        if loop is None or stopping is None:
            return
        if threading.get_ident() == getattr(self, "_loop_thread", None):
            stopping.set()
        else:
            loop.call_soon_threadsafe(stopping.set)

    async def _sleep(self, delay: float) -> None:
        """Sleep, but wake up at once when stopping."""
        assert self.stopping is not None
        try:
            await asyncio.wait_for(self.stopping.wait(), delay)
        except TimeoutError:
            pass

    # -- run --------------------------------------------------------------------------------

    async def run(self, until_empty: bool = False) -> None:
        self.dispatch.check()
        self.until_empty = until_empty
        # One handler for every item (the common case) skips the lookup by kind.
        self.single: Route | None = self.dispatch.default if not self.dispatch.by_kind else None
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.stopping = asyncio.Event()
        self.room = asyncio.Event()
        self.new_leases = asyncio.Event()
        self.slots = asyncio.Semaphore(self.o.concurrency)
        info = await self.calls.queue_info(self.queue_name)
        self.lease_timeout = info.lease_timeout.total_seconds()
        self.max_attempts = info.max_attempts
        self.extension = seconds(self.o.lease_extension) if self.o.lease_extension is not None else None
        if self.o.metrics or self.o.metrics_port is not None:
            from .metrics import WorkerMetrics

            self.metrics = WorkerMetrics(self.queue_name, self.o.metrics_port, self.o.metrics_host)
        for route in self.dispatch.routes():
            route.start(self.policy)
        self.processes: HandlerProcesses | None = None
        if any(route.in_process is not None for route in self.dispatch.routes()):
            self.processes = HandlerProcesses()
        self.threads: HandlerThreads | None = None
        if not all(route.is_async or route.in_process is not None for route in self.dispatch.routes()):
            self.threads = HandlerThreads(self.loop, self.o.concurrency)
            if self._make_sync_client is not None:
                self._sync_client = self._make_sync_client()
        self.settler = Settler(self)
        installed = self._install_signals()
        lease_loop = asyncio.create_task(self._lease_loop())
        keep_alive = asyncio.create_task(KeepAlive(self).run()) if self.o.keep_alive else None
        settler = asyncio.create_task(self.settler.run())
        self.started.set()
        try:
            await self.stopping.wait()
        finally:
            self.stopping.set()
            try:
                await self._shutdown(lease_loop)
            finally:
                for task in (keep_alive, settler):
                    if task is not None:
                        task.cancel()
                await asyncio.gather(*(t for t in (keep_alive, settler) if t is not None), return_exceptions=True)
                for sig in installed:
                    self.loop.remove_signal_handler(sig)
                if self.threads is not None:
                    self.threads.close()
                if self.processes is not None:
                    self.processes.close()
                if self._owns_sync_client and self._sync_client is not None:
                    self._sync_client.close()
        if self.burst_error is not None:
            raise self.burst_error

    def _install_signals(self) -> list[signal.Signals]:
        if not self.o.handle_signals or threading.current_thread() is not threading.main_thread():
            return []
        assert self.loop is not None and self.stopping is not None
        installed = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.loop.add_signal_handler(sig, self.stopping.set)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):  # pragma: no cover - platform
                pass
        return installed

    # -- leasing ----------------------------------------------------------------------------

    async def _lease_loop(self) -> None:
        self.accepting = self.o.complete_with_lease
        try:
            await self._leasing()
        finally:
            self.accepting = False
            self._flush_completions()

    async def _leasing(self) -> None:
        assert self.stopping is not None
        calls: list[_LeaseCall] = []
        try:
            while not self.stopping.is_set():
                if self._may_lease(calls):
                    if self.until_empty and not calls and not self.held and await self._drained():
                        self.stopping.set()
                        break
                    calls.append(self._send_lease(calls))
                    continue
                self.room.clear()
                # Answers are taken in the order sent, as a stream gives them.
                await _first(*(c.task for c in calls[:1]), self.room.wait(), self.stopping.wait())
                while calls and calls[0].task.done() and not self.stopping.is_set():
                    await self._received(calls.pop(0))
            if calls:
                # Stopping with Leases in flight: let them answer briefly (their items are
                # then released at once) rather than cut them off while they may commit.
                await asyncio.wait({c.task for c in calls}, timeout=seconds(self.o.lease_grace))
                for call in calls:
                    if not call.task.done():
                        call.task.cancel()
                await asyncio.gather(*(c.task for c in calls), return_exceptions=True)
                while calls:
                    await self._received(calls.pop(0))
        finally:
            for call in calls:
                call.task.cancel()
                _resolve_all(call.completing, None)

    async def _drained(self) -> bool:
        """Burst mode, with nothing held or in flight: whether the queue has nothing
        ready, leased (by anyone) or scheduled. ``total`` counts ready and leased items,
        not scheduled ones: those are counted apart. A faulty partition (its node down,
        its storage failing) may hold items that its counts do not show: the queue is
        not empty until it is back and empty too."""
        try:
            stats = await self.calls.queue_stats(self.queue_name)
        except QueratorError as error:
            self.stats.errors += 1
            self.hook("on_error", error)
            return False
        if stats.total or stats.scheduled:
            self.faulty_since = None
            return False
        faulty = [p for p in stats.partitions if p.faulty]
        if not faulty:
            return True
        self._wait_for_faulty(faulty)
        return False

    def _wait_for_faulty(self, faulty: Sequence[PartitionStats]) -> None:
        """Every readable partition is empty, ``faulty`` are not readable: wait for them
        (logged at most once a minute), up to ``faulty_timeout``."""
        now = time.monotonic()
        if self.faulty_since is None:
            self.faulty_since = now
        waited = now - self.faulty_since
        what = "; ".join(f"partition {p.partition}: {p.failure}" for p in faulty[:5])
        if len(faulty) > 5:
            what += f"; and {len(faulty) - 5} more"
        if self.faulty_timeout is not None and waited >= self.faulty_timeout:
            assert self.stopping is not None
            self.burst_error = Unavailable(
                f"queue {self.queue_name!r} is empty where it can be read, but {len(faulty)} of its partitions "
                f"stayed faulty for {waited:.0f} s (faulty_timeout), so it may still hold items: {what}"
            )
            self.stopping.set()
            return
        if self.faulty_logged and now - self.faulty_logged < _FAULTY_LOG_EVERY:
            return
        self.faulty_logged = now
        log.warning(
            "burst mode: queue %r is empty where it can be read, waiting for %d faulty partitions "
            "(for %.0f s so far): %s",
            self.queue_name, len(faulty), waited, what,
        )  # fmt: skip

    def _may_lease(self, calls: list[_LeaseCall]) -> bool:
        """Whether to send another Lease now, ``calls`` being those in flight."""
        room = self._room(calls)
        if room <= 0:
            self._flush_completions()  # no Lease soon: complete them on their own
            return False
        # Lease a full batch, or whatever fits once no leased item waits for a handler
        # (the handlers would run dry): few, large Lease calls.
        if room < self.batch_size and self.n_waiting > 0:
            return False
        if not calls:
            return True
        # Another in flight only while the queue has a backlog (the last answer was a
        # full batch), for a full batch, and never behind a long poll, which would hold
        # back its answer (a stream answers in order).
        return (
            self.backlog
            and len(calls) < _MAX_LEASES_IN_FLIGHT
            and room >= self.batch_size
            and not any(c.waits for c in calls)
        )

    def _room(self, calls: list[_LeaseCall]) -> int:
        """Items the worker may still ask for: held ones not yet handled, and those the
        Leases in flight asked for, count against ``max_held``."""
        return self.max_held - (len(self.held) - self.n_finished) - sum(c.asked for c in calls)

    def _send_lease(self, calls: list[_LeaseCall]) -> _LeaseCall:
        asked = min(self.batch_size, self._room(calls))
        completing = self._take_completions()
        # A Lease that completes, or that follows another, answers at once: a completion
        # is confirmed within a round trip, never held up by a long poll.
        waits = not completing and not calls
        wait = self.o.lease_wait if waits else 0
        if waits and self.until_empty:
            wait = min(seconds(wait), _BURST_WAIT)
        # The server takes one Lease at a time per client_id: each one in flight has its own.
        used = {c.slot for c in calls}
        slot = min(n for n in range(len(calls) + 1) if n not in used)
        task = asyncio.create_task(
            self.calls.lease(
                self._make_item,
                self.queue_name,
                asked,
                wait,
                self.client_id if slot == 0 else f"{self.client_id}/{slot}",
                [h.item for h, _ in completing] or None,
            )
        )
        return _LeaseCall(task, completing, time.monotonic(), asked, waits, slot)

    async def _received(self, call: _LeaseCall) -> None:
        """Take a Lease's answer: its completions confirmed, its items handed to handlers
        (or given back when stopping)."""
        assert self.stopping is not None
        if call.task.cancelled():
            _resolve_all(call.completing, None)
            return
        try:
            items = call.task.result()
        except QueratorError as error:
            # Nothing was completed (all-or-nothing): Complete calls take over and find
            # any lost lease among them.
            _resolve_all(call.completing, None)
            self.backlog = False
            if call.completing and isinstance(error, LeaseLost):
                return
            self.failures += 1
            self.stats.errors += 1
            self.hook("on_error", error)
            if not self.stopping.is_set():
                backoff = self.calls.backoff(self.failures) if isinstance(error, Unavailable) else min(5.0, 0.2 * 2**self.failures)
                await self._sleep(backoff)
            return
        if call.completing:
            self.lease_rtt = 0.8 * self.lease_rtt + 0.2 * (time.monotonic() - call.sent)
            _resolve_all(call.completing, True)
            if self.until_empty:
                # Let the handlers' tasks forget the items just completed, so that
                # burst mode sees an empty worker now rather than after another poll.
                await asyncio.sleep(0)
        self.failures = 0
        self.backlog = len(items) >= call.asked
        if not items:
            return
        self.stats.leased += len(items)
        self.hook("on_lease", items)
        if self.metrics is not None:
            self.metrics.leased([i.created_at for i in items])
        if self.stopping.is_set():
            await self._release(items)
            return
        length = self.lease_timeout
        for obj in items:
            held = Held(obj, extend_at=call.sent + length / 2, length=length, leased_at=call.sent)
            self.held[held.key] = held
            self.n_waiting += 1
            held.task = asyncio.create_task(self._process(held))
        self.new_leases.set()

    # -- completing with the next Lease ---------------------------------------------------

    async def _complete(self, held: Held) -> bool:
        """Complete a handled item: with the next Lease when one is coming, else by Complete."""
        held.finished = True
        self.n_finished += 1
        self.room.set()
        if self.accepting:
            assert self.loop is not None
            future: asyncio.Future[bool | None] = self.loop.create_future()
            self.to_complete.append((held, future))
            if self.linger is None:
                linger = min(max(_LINGER_MIN, 3 * self.lease_rtt), _LINGER_MAX)
                self.linger = self.loop.call_later(linger, self._flush_completions)
            done = await future
            if done is not None:
                return done
        return await self.settler.submit(held, "complete", None, False)

    def _take_completions(self) -> list[tuple[Held, asyncio.Future[bool | None]]]:
        """Up to 1,000 waiting completions of one partition (the one with most) for a Lease."""
        if not self.to_complete:
            return []
        counts: dict[int, int] = {}
        for held, _ in self.to_complete:
            counts[held.item.partition] = counts.get(held.item.partition, 0) + 1
        partition = max(counts, key=counts.__getitem__)
        taken: list[tuple[Held, asyncio.Future[bool | None]]] = []
        rest: list[tuple[Held, asyncio.Future[bool | None]]] = []
        for entry in self.to_complete:
            (taken if entry[0].item.partition == partition and len(taken) < MAX_BATCH else rest).append(entry)
        self.to_complete = rest
        if not rest and self.linger is not None:
            self.linger.cancel()
            self.linger = None
        return taken

    def _flush_completions(self) -> None:
        """Hand every waiting completion to Complete calls."""
        if self.linger is not None:
            self.linger.cancel()
            self.linger = None
        waiting, self.to_complete = self.to_complete, []
        _resolve_all(waiting, None)

    def _make_item(self, **fields: Any) -> _LeasedBase:
        """The object the handler gets: an AsyncLeasedItem, or a LeasedItem for a sync
        handler (an item with no handler gets an AsyncLeasedItem: it is only dead-lettered)."""
        route = self.single or self.dispatch.route(fields["kind"])
        if route is None or route.is_async or route.in_process is not None:
            return self.calls.async_item(fields)
        if self._sync_client is None:
            self._sync_client = self.calls.sync_client()
            self._owns_sync_client = True
        return self.calls.sync_item(self._sync_client, fields)

    def _forget(self, held: Held) -> None:
        if self.held.pop(held.key, None) is not None:
            self._unwait(held)
            if held.finished:
                self.n_finished -= 1
        self.room.set()

    def _unwait(self, held: Held) -> None:
        if held.waiting:
            held.waiting = False
            self.n_waiting -= 1
            if not self.n_waiting:
                self.room.set()  # the handlers may run dry: lease what fits

    # -- handling ---------------------------------------------------------------------------

    async def _process(self, held: Held) -> None:
        item = held.item
        route = self.single or self.dispatch.route(item.kind)
        try:
            if route is None:
                held.started = True
                self._unwait(held)
                await self._settle(held, DeadLetter(f"no handler for kind {item.kind!r}"), None)
                return
            async with route.slots or contextlib.nullcontext(), self.slots:
                assert self.stopping is not None
                if self.stopping.is_set() or held.abandoned:
                    return  # not started: _shutdown releases it
                held.started = True
                self._unwait(held)
                self.hook("on_start", item)
                began = time.monotonic()
                error: BaseException | None = None
                timeout = route.timeout or self.handler_timeout
                try:
                    with self._span(item):
                        if route.in_process is not None:
                            assert self.processes is not None
                            await self.processes.run(route.in_process(item), route.time_limit, timeout)
                        elif route.is_async:
                            call = route.handler(item)  # type: ignore[arg-type]
                            if timeout is None:
                                await call  # type: ignore[misc]
                            else:
                                await self._limited(cast(Awaitable[object], call), timeout)
                        else:
                            await self._run_sync(route, item, timeout)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    error = exc
                elapsed = time.monotonic() - began
            if held.abandoned:
                return
            await self._settle(held, error, elapsed, route)
        finally:
            # An item that never started stays held: _shutdown gives it back (forgotten
            # here, it would stay leased until its lease ran out).
            if held.started and not held.abandoned:
                self._forget(held)

    async def _limited(self, call: Awaitable[object], timeout: float) -> None:
        """An async handler under ``handler_timeout``: cancelled when it runs past it."""
        limit = asyncio.timeout(timeout)
        try:
            async with limit:
                await call
        except TimeoutError:
            if not limit.expired():
                raise  # the handler's own
            raise HandlerTimeout(f"the handler ran past handler_timeout ({timeout:g}s) and was cancelled") from None

    async def _run_sync(self, route: Route, item: _LeasedBase, timeout: float | None) -> None:
        assert self.threads is not None
        # The handler's thread sees this task's context (the span).
        ctx = contextvars.copy_context()
        sync_handler = cast(Callable[[_LeasedBase], object], route.handler)
        future = self.threads.run(functools.partial(ctx.run, sync_handler, item))
        if timeout is None:
            await future
            return
        done, _ = await asyncio.wait([future], timeout=timeout)
        if not done:
            # A thread cannot be stopped: the call runs on, ignored, and another
            # thread takes its place.
            self.threads.abandon(future)
            raise HandlerTimeout(f"the handler ran past handler_timeout ({timeout:g}s) and was abandoned")
        future.result()

    def _span(self, item: _LeasedBase) -> contextlib.AbstractContextManager[object]:
        """The handler's CONSUMER span when tracing is on (querator.tracing)."""
        if not self.tracing:
            return contextlib.nullcontext()
        return _tracing.process_span(item, client_id=self.client_id)

    def _failed(self, item: _LeasedBase, error: BaseException, elapsed: float | None) -> None:
        """Counts a handler's failure (stats, metrics); the hooks log it."""
        self.stats.failed += 1
        self.stats.failures[type(error).__qualname__] += 1
        if isinstance(error, HandlerTimeout):
            self.stats.timed_out += 1
        if self.metrics is not None:
            self.metrics.failed(item.kind, error, elapsed)

    async def _settle(self, held: Held, error: BaseException | None, elapsed: float | None, route: Route | None = None) -> None:
        item = held.item
        held.settling = True
        if error is not None:
            self._failed(item, error, elapsed)
        if item.settled:  # the handler completed, retried or dead-lettered it itself
            if item.state == COMPLETED:
                self._completed(item, elapsed)
            elif item.state == DEAD:
                self._dead(item, error)
            else:
                self.stats.retried += 1
            return
        if error is None:
            if await self._complete(held):
                self._completed(item, elapsed)
            return
        decision = (route.rules if route is not None and route.rules is not None else self.policy).decide(error)
        out_of_attempts = (self.max_attempts and item.attempts >= self.max_attempts) or (
            decision.max_attempts is not None and item.attempts >= decision.max_attempts
        )
        text = failure_text(error)
        if decision.dead or isinstance(error, DeadLetter) or out_of_attempts:
            if await self.settler.submit(held, "retry", None, True, text):
                self._dead(item, error)
            return
        retry_at = datetime.now(UTC) + decision.backoff(item.attempts)
        if await self.settler.submit(held, "retry", retry_at, False, text):
            self.stats.retried += 1
            self.hook("on_retry", item, error, retry_at)

    def _completed(self, item: _LeasedBase, elapsed: float | None) -> None:
        self.stats.completed += 1
        self.hook("on_complete", item, timedelta(seconds=elapsed or 0.0))
        if self.metrics is not None:
            self.metrics.handled(item.kind, elapsed or 0.0)

    def _dead(self, item: _LeasedBase, error: BaseException | None) -> None:
        self.stats.dead += 1
        self.hook("on_dead", item, error)
        if self.metrics is not None:
            self.metrics.dead(item.kind)

    def lost(self, held: Held, error: QueratorError) -> None:
        if not held.lost:
            held.lost = True
            self.stats.lost += 1
            self.hook("on_lease_lost", held.item, error)

    # -- shutdown ---------------------------------------------------------------------------

    async def _release(self, items: Sequence[_LeasedBase]) -> None:
        """Give items back at once (Retry now) so others can take them."""
        if not items:
            return
        try:
            await self.calls.retry([(item, None, False, "") for item in items])
        except QueratorError as error:
            # Per item, so one lost lease does not keep the others.
            for item in items:
                try:
                    await self.calls.retry([(item, None, False, "")])
                except QueratorError as one:
                    if not isinstance(one, LeaseLost):
                        self.stats.errors += 1
                        self.hook("on_error", error)
                    continue
                self.stats.released += 1
        else:
            self.stats.released += len(items)
        self.hook("on_release", items)

    async def _shutdown(self, lease_loop: asyncio.Task[None]) -> None:
        await asyncio.gather(lease_loop, return_exceptions=True)
        # Leased but not started: give them back now.
        waiting = [h for h in self.held.values() if not h.started]
        for held in waiting:
            held.abandoned = True
            self._forget(held)
        await self._release([h.item for h in waiting])
        running = {h.task for h in self.held.values() if h.task is not None and not h.task.done()}
        if running:
            _, late = await asyncio.wait(running, timeout=seconds(self.o.shutdown_timeout))
            if late:
                stuck = [h for h in self.held.values() if h.task in late]
                for held in stuck:
                    held.abandoned = True
                    if held.task is not None:
                        held.task.cancel()  # async handlers stop; a sync one runs on, ignored
                    self._forget(held)
                await asyncio.gather(*late, return_exceptions=True)
                await self._release([h.item for h in stuck if not h.item.settled])


def _resolve_all(entries: list[tuple[Held, asyncio.Future[bool | None]]], value: bool | None) -> None:
    for _, future in entries:
        if not future.done():
            future.set_result(value)


async def _first(*aws: Awaitable[Any]) -> None:
    """Wait until the first of ``aws`` finishes; cancel the helper tasks made here."""
    tasks = [a if isinstance(a, asyncio.Task) else asyncio.ensure_future(a) for a in aws]
    own = [t for t, a in zip(tasks, aws) if t is not a]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in own:
            task.cancel()
