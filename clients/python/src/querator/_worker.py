"""Workers: lease items, run a handler on each, then complete, retry or dead-letter them.

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
by Complete calls, batched. Retries and dead-letters always go by Retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

from . import tracing as _tracing
from ._config import MAX_BATCH, Backoff
from ._convert import Seconds, seconds
from ._items import COMPLETED, DEAD, AnyLeasedItem, AsyncLeasedItem, LeasedItem, _LeasedBase
from .errors import DeadLetter, LeaseLost, QueratorError, Unavailable

if TYPE_CHECKING:
    from ._async_client import AsyncClient
    from ._client import Client

log = logging.getLogger("querator.worker")

Handler = Callable[["LeasedItem"], object] | Callable[["AsyncLeasedItem"], Awaitable[object]]


class WorkerHooks:
    """Callbacks for metrics and logging; subclass and override what you need.

    They run on the worker's event loop and must be quick; an exception in a hook is
    logged and ignored. The defaults log through ``logging.getLogger("querator.worker")``.
    ``item`` is the object the handler received (LeasedItem or AsyncLeasedItem).
    """

    def on_lease(self, items: Sequence[AnyLeasedItem]) -> None:
        """A Lease call returned ``items`` (not called for empty replies)."""

    def on_start(self, item: AnyLeasedItem) -> None:
        """The handler is about to run for ``item``."""

    def on_complete(self, item: AnyLeasedItem, elapsed: timedelta) -> None:
        """``item`` was handled in ``elapsed`` and completed."""

    def on_retry(self, item: AnyLeasedItem, error: BaseException, retry_at: datetime) -> None:
        """The handler raised ``error``; ``item`` comes back at ``retry_at``."""
        log.warning("handler failed for item %s (attempt %d), retry at %s: %r", item.id, item.attempts, retry_at, error)

    def on_dead(self, item: AnyLeasedItem, error: BaseException | None) -> None:
        """``item`` went to the dead-letter queue (DeadLetter raised, or out of attempts)."""
        log.warning("item %s dead-lettered after %d attempts: %r", item.id, item.attempts, error)

    def on_extend(self, items: Sequence[AnyLeasedItem]) -> None:
        """The leases of ``items`` were extended (keep-alive)."""

    def on_lease_lost(self, item: AnyLeasedItem, error: QueratorError) -> None:
        """The lease of ``item`` was lost; another consumer may handle it again."""
        log.warning("lease of item %s lost: %s", item.id, error)

    def on_release(self, items: Sequence[AnyLeasedItem]) -> None:
        """At shutdown, ``items`` were given back unhandled (Retry now)."""

    def on_error(self, error: BaseException) -> None:
        """A call the worker made failed (it carries on, with backoff)."""
        log.error("worker call failed: %s", error)


@dataclass
class WorkerStats:
    """Counters of what a worker did so far."""

    leased: int = 0
    completed: int = 0
    retried: int = 0
    dead: int = 0
    extended: int = 0
    lost: int = 0
    released: int = 0
    errors: int = 0


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """A worker's settings (all keyword-only; durations as timedelta or seconds)."""

    #: Handlers running at once (threads for a sync handler, tasks for an async one).
    concurrency: int = 10
    #: Items asked for per Lease call (default: ``concurrency``, at most 1,000).
    batch_size: int | None = None
    #: Leased items waiting for a free handler slot beyond those running (default:
    #: ``batch_size``). Flow control: no Lease is sent while the worker holds
    #: ``concurrency + max_buffered`` items; a Lease stays in flight while earlier items
    #: are being handled and completed.
    max_buffered: int | None = None
    #: How long a Lease waits on the server when nothing is ready.
    lease_wait: Seconds = timedelta(seconds=30)
    #: Extend leases of held items when half their time is gone.
    keep_alive: bool = True
    #: Lease length asked for by Extend (default: the queue's lease_timeout).
    lease_extension: Seconds | None = None
    #: Delay before a failed item comes back, by its attempt number (1 = first lease).
    retry_backoff: Callable[[int], timedelta] = Backoff(timedelta(seconds=1), timedelta(minutes=5))
    #: At stop: how long running handlers may finish before their items are released.
    shutdown_timeout: Seconds = timedelta(seconds=30)
    #: At stop: how long a Lease in flight may still answer before it is cancelled.
    lease_grace: Seconds = timedelta(seconds=1)
    #: Stop gracefully on SIGTERM and SIGINT (run() in the main thread only).
    handle_signals: bool = True
    #: Callbacks for metrics and logging.
    hooks: WorkerHooks | None = None
    #: The Lease client_id (default: host, pid and a random suffix). A second Lease in
    #: flight uses ``<client_id>/1``, a third ``/2``: the server takes one per id.
    client_id: str | None = None
    #: Complete handled items with the next Lease call (``complete_ids``) instead of
    #: separate Complete calls. Needs a server that knows ``LeaseRequest.complete_ids``.
    complete_with_lease: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.batch_size is not None and not 1 <= self.batch_size <= MAX_BATCH:
            raise ValueError(f"batch_size must be between 1 and {MAX_BATCH}")
        if self.max_buffered is not None and self.max_buffered < 0:
            raise ValueError("max_buffered must not be negative")


def _is_async(handler: Callable[..., Any]) -> bool:
    # An object whose __call__ is async; callable() cannot tell that.
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(getattr(handler, "__call__", None))  # noqa: B004


@dataclass(eq=False)
class _Held:
    item: _LeasedBase
    extend_at: float
    length: float
    started: bool = False
    settling: bool = False
    lost: bool = False
    abandoned: bool = False
    #: The handler returned and the item only waits to be completed: it no longer
    #: takes room from leasing.
    finished: bool = False
    #: Leased, not started, not abandoned (counted in _Engine.n_waiting).
    waiting: bool = True
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class _LeaseCall:
    task: asyncio.Task[list[_LeasedBase]]
    #: The completions it carries, resolved when it answers.
    completing: list[tuple[_Held, asyncio.Future[bool | None]]]
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


class _Engine:
    """The asyncio machinery behind both Worker and AsyncWorker."""

    def __init__(
        self,
        aclient: AsyncClient,
        queue_name: str,
        handler: Handler,
        options: WorkerOptions,
        make_sync_client: Callable[[], Client] | None,
    ) -> None:
        self.aclient = aclient
        self.queue_name = queue_name
        self.handler = handler
        self.o = options
        self.hooks = options.hooks or WorkerHooks()
        self.stats = WorkerStats()
        self.is_async = _is_async(handler)
        self.tracing = aclient.config.tracing
        self._make_sync_client = make_sync_client
        self._sync_client: Client | None = None
        self._owns_sync_client = False
        self.batch_size = min(options.batch_size or options.concurrency, MAX_BATCH)
        buffered = self.batch_size if options.max_buffered is None else options.max_buffered
        self.max_held = options.concurrency + buffered
        self.client_id = options.client_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.held: dict[str, _Held] = {}
        self.n_waiting = 0  # held items not started yet
        self.n_finished = 0  # held items whose handler returned, waiting for completion
        # Completions for the next Lease call: (held, future of True = completed by the
        # Lease, None = not sent with a Lease, complete it with Complete).
        self.to_complete: list[tuple[_Held, asyncio.Future[bool | None]]] = []
        self.accepting = False  # the lease loop takes completions
        self.linger: asyncio.TimerHandle | None = None
        self.lease_rtt = 0.01
        # The last Lease came back full: the queue has a backlog, so further Leases may
        # be in flight at once.
        self.backlog = False
        self.failures = 0  # Lease calls failed in a row
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopping: asyncio.Event | None = None
        self.started = threading.Event()

    # -- plumbing ---------------------------------------------------------------------------

    def _hook(self, name: str, *args: Any) -> None:
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

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.stopping = asyncio.Event()
        self.room = asyncio.Event()
        self.new_leases = asyncio.Event()
        self.slots = asyncio.Semaphore(self.o.concurrency)
        info = await self.aclient.get_queue(self.queue_name)
        self.lease_timeout = info.lease_timeout.total_seconds()
        self.max_attempts = info.max_attempts
        self.extension = seconds(self.o.lease_extension) if self.o.lease_extension is not None else None
        self.threads: _Threads | None = None
        if not self.is_async:
            self.threads = _Threads(self.loop, self.o.concurrency)
            if self._make_sync_client is not None:
                self._sync_client = self._make_sync_client()
        self.settler = _Settler(self)
        installed = self._install_signals()
        lease_loop = asyncio.create_task(self._lease_loop())
        keep_alive = asyncio.create_task(self._keep_alive()) if self.o.keep_alive else None
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
                if self._owns_sync_client and self._sync_client is not None:
                    self._sync_client.close()

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
        # The server takes one Lease at a time per client_id: each one in flight has its own.
        used = {c.slot for c in calls}
        slot = min(n for n in range(len(calls) + 1) if n not in used)
        task = asyncio.create_task(
            self.aclient._lease_as(
                self._make_item,
                self.queue_name,
                asked,
                self.o.lease_wait if waits else 0,
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
            self._hook("on_error", error)
            if not self.stopping.is_set():
                backoff = self.aclient._backoff(self.failures) if isinstance(error, Unavailable) else min(5.0, 0.2 * 2**self.failures)
                await self._sleep(backoff)
            return
        if call.completing:
            self.lease_rtt = 0.8 * self.lease_rtt + 0.2 * (time.monotonic() - call.sent)
            _resolve_all(call.completing, True)
        self.failures = 0
        self.backlog = len(items) >= call.asked
        if not items:
            return
        self.stats.leased += len(items)
        self._hook("on_lease", items)
        if self.stopping.is_set():
            await self._release(items)
            return
        length = self.lease_timeout
        for obj in items:
            held = _Held(obj, extend_at=call.sent + length / 2, length=length)
            self.held[obj.id] = held
            self.n_waiting += 1
            held.task = asyncio.create_task(self._process(held))
        self.new_leases.set()

    # -- completing with the next Lease ---------------------------------------------------

    async def _complete(self, held: _Held) -> bool:
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

    def _take_completions(self) -> list[tuple[_Held, asyncio.Future[bool | None]]]:
        """Up to 1,000 waiting completions of one partition (the one with most) for a Lease."""
        if not self.to_complete:
            return []
        counts: dict[int, int] = {}
        for held, _ in self.to_complete:
            counts[held.item.partition] = counts.get(held.item.partition, 0) + 1
        partition = max(counts, key=counts.__getitem__)
        taken: list[tuple[_Held, asyncio.Future[bool | None]]] = []
        rest: list[tuple[_Held, asyncio.Future[bool | None]]] = []
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
        """The object the handler gets: an AsyncLeasedItem, or a LeasedItem for a sync handler."""
        if self.is_async:
            return AsyncLeasedItem(self.aclient, **fields)
        if self._sync_client is None:
            from ._client import Client

            self._sync_client = Client(config=self.aclient.config)
            self._owns_sync_client = True
        return LeasedItem(self._sync_client, **fields)

    def _forget(self, held: _Held) -> None:
        if self.held.pop(held.item.id, None) is not None:
            self._unwait(held)
            if held.finished:
                self.n_finished -= 1
        self.room.set()

    def _unwait(self, held: _Held) -> None:
        if held.waiting:
            held.waiting = False
            self.n_waiting -= 1
            if not self.n_waiting:
                self.room.set()  # the handlers may run dry: lease what fits

    # -- handling ---------------------------------------------------------------------------

    async def _process(self, held: _Held) -> None:
        item = held.item
        try:
            async with self.slots:
                assert self.stopping is not None
                if self.stopping.is_set() or held.abandoned:
                    return  # not started: _shutdown releases it
                held.started = True
                self._unwait(held)
                self._hook("on_start", item)
                began = time.monotonic()
                error: BaseException | None = None
                try:
                    with self._span(item):
                        if self.is_async:
                            await self.handler(item)  # type: ignore[arg-type,misc]
                        else:
                            assert self.loop is not None
                            # The handler's thread sees this task's context (the span).
                            ctx = contextvars.copy_context()
                            sync_handler = cast(Callable[[_LeasedBase], object], self.handler)
                            call = functools.partial(ctx.run, sync_handler, item)
                            assert self.threads is not None
                            await self.threads.run(call)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    error = exc
                elapsed = time.monotonic() - began
            if held.abandoned:
                return
            await self._settle(held, error, elapsed)
        finally:
            # An item that never started stays held: _shutdown gives it back (forgotten
            # here, it would stay leased until its lease ran out).
            if held.started and not held.abandoned:
                self._forget(held)

    def _span(self, item: _LeasedBase) -> contextlib.AbstractContextManager[object]:
        """The handler's CONSUMER span when tracing is on (querator.tracing)."""
        if not self.tracing:
            return contextlib.nullcontext()
        return _tracing.process_span(item, client_id=self.client_id)

    async def _settle(self, held: _Held, error: BaseException | None, elapsed: float) -> None:
        item = held.item
        held.settling = True
        if item.settled:  # the handler completed, retried or dead-lettered it itself
            if item.state == COMPLETED:
                self.stats.completed += 1
                self._hook("on_complete", item, timedelta(seconds=elapsed))
            elif item.state == DEAD:
                self.stats.dead += 1
                self._hook("on_dead", item, error)
            else:
                self.stats.retried += 1
            return
        if error is None:
            if await self._complete(held):
                self.stats.completed += 1
                self._hook("on_complete", item, timedelta(seconds=elapsed))
            return
        if isinstance(error, DeadLetter) or (self.max_attempts and item.attempts >= self.max_attempts):
            if await self.settler.submit(held, "retry", None, True):
                self.stats.dead += 1
                self._hook("on_dead", item, error)
            return
        retry_at = datetime.now(UTC) + self.o.retry_backoff(item.attempts)
        if await self.settler.submit(held, "retry", retry_at, False):
            self.stats.retried += 1
            self._hook("on_retry", item, error, retry_at)

    def lost(self, held: _Held, error: QueratorError) -> None:
        if not held.lost:
            held.lost = True
            self.stats.lost += 1
            self._hook("on_lease_lost", held.item, error)

    # -- keep-alive -------------------------------------------------------------------------

    async def _keep_alive(self) -> None:
        while True:
            now = time.monotonic()
            due = [h for h in self.held.values() if self._keep(h) and h.extend_at <= now]
            if due:
                await self._extend(due)
            now = time.monotonic()
            upcoming = [h.extend_at for h in self.held.values() if self._keep(h)]
            delay = min(upcoming, default=now + 1.0) - now
            self.new_leases.clear()
            try:
                await asyncio.wait_for(self.new_leases.wait(), min(max(delay, 0.02), 1.0))
            except TimeoutError:
                pass

    @staticmethod
    def _keep(held: _Held) -> bool:
        return not (held.lost or held.abandoned or held.settling or held.item.settled)

    async def _extend(self, due: list[_Held]) -> None:
        groups: dict[int, list[_Held]] = {}
        for held in due:
            groups.setdefault(held.item.partition, []).append(held)
        for members in groups.values():
            for start in range(0, len(members), MAX_BATCH):
                chunk = members[start : start + MAX_BATCH]
                sent = time.monotonic()
                try:
                    await self.aclient.extend([h.item for h in chunk], lease_timeout=self.extension)
                except LeaseLost:
                    await self._extend_one_by_one(chunk)
                    continue
                except QueratorError as error:
                    self.stats.errors += 1
                    self._hook("on_error", error)
                    for held in chunk:  # try again soon, while the lease lasts
                        held.extend_at = sent + min(1.0, held.length / 10)
                    continue
                self._extended(chunk, sent)

    async def _extend_one_by_one(self, chunk: list[_Held]) -> None:
        for held in chunk:
            sent = time.monotonic()
            try:
                await self.aclient.extend(held.item, lease_timeout=self.extension)
            except LeaseLost as error:
                assert isinstance(error, QueratorError)
                if self._keep(held):  # else it was completed meanwhile: not lost
                    self.lost(held, error)
            except QueratorError as error:
                self.stats.errors += 1
                self._hook("on_error", error)
                held.extend_at = sent + min(1.0, held.length / 10)
            else:
                self._extended([held], sent)

    def _extended(self, chunk: list[_Held], sent: float) -> None:
        for held in chunk:
            held.length = self.extension or self.lease_timeout
            held.extend_at = sent + held.length / 2
        self.stats.extended += len(chunk)
        self._hook("on_extend", [h.item for h in chunk])

    # -- shutdown ---------------------------------------------------------------------------

    async def _release(self, items: Sequence[_LeasedBase]) -> None:
        """Give items back at once (Retry now) so others can take them."""
        if not items:
            return
        try:
            await self.aclient._retry_orders([(item, None, False) for item in items])
        except QueratorError as error:
            # Per item, so one lost lease does not keep the others.
            for item in items:
                try:
                    await self.aclient._retry_orders([(item, None, False)])
                except QueratorError as one:
                    if not isinstance(one, LeaseLost):
                        self.stats.errors += 1
                        self._hook("on_error", error)
                    continue
                self.stats.released += 1
        else:
            self.stats.released += len(items)
        self._hook("on_release", items)

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


class _Threads:
    """The threads that run sync handlers, one call each at a time.

    A call is handed over through a queue, and the loop is woken once for all the calls
    that finished meanwhile: with many short handlers, ``run_in_executor``'s future per
    call, chained to an asyncio future, and its wake-up per call cost more than the
    calls. Like an executor's threads they are not daemons, so Python waits for a
    handler still running when it exits.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[tuple[asyncio.Future[None], Callable[[], object]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished: list[tuple[asyncio.Future[None], BaseException | None]] = []
        self._woken = False
        self._closed = False
        self._count = count
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a call

    def run(self, call: Callable[[], object]) -> asyncio.Future[None]:
        """``call()`` on one of the threads; the future ends as it does (cancelling the
        future does not stop a call that started)."""
        future: asyncio.Future[None] = self._loop.create_future()
        self._jobs.put((future, call))
        # Threads are started as calls need them, up to ``count``, as an executor's are.
        if not self._idle and len(self._threads) < self._count:
            thread = threading.Thread(target=self._work, name=f"querator-handler-{len(self._threads)}", daemon=False)
            self._threads.append(thread)
            thread.start()
        return future

    def close(self) -> None:
        """Drop the calls not started (their futures cancelled); each thread ends once
        its call, if any, returns."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        main = threading.main_thread()
        while True:
            with self._lock:
                self._idle += 1
            try:
                job = self._jobs.get(timeout=_IDLE_CHECK)
            except queue.Empty:
                # A worker whose loop died without close(): end with the program.
                if self._closed or not main.is_alive():
                    return
                continue
            finally:
                with self._lock:
                    self._idle -= 1
            if job is None:  # close()
                return
            future, call = job
            error: BaseException | None = None
            try:
                call()
            except BaseException as exc:  # the handler's to report, whatever it is
                error = exc if not isinstance(exc, StopIteration) else RuntimeError(f"the handler raised {exc!r}")
            with self._lock:
                self._finished.append((future, error))
                wake = not self._woken
                self._woken = True
            del job, future, call, error  # hold no item while idle
            if wake:
                try:
                    self._loop.call_soon_threadsafe(self._deliver)
                except RuntimeError:
                    pass  # the loop is closed: nobody waits for these any more

    def _deliver(self) -> None:
        with self._lock:
            finished, self._finished = self._finished, []
            self._woken = False
        for future, error in finished:
            if future.done():
                continue  # cancelled: the handler was abandoned
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)


# How often an idle handler thread checks that its worker and the program still run.
_IDLE_CHECK = 1.0


class _Settler:
    """Completes and retries in batches: what queued up while a call ran goes in the next one."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.queue: list[tuple[_Held, str, datetime | None, bool, asyncio.Future[bool]]] = []
        self.wake = asyncio.Event()

    async def submit(self, held: _Held, kind: str, retry_at: datetime | None, dead: bool) -> bool:
        """Queue one settlement and wait for it; True when it took effect."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.queue.append((held, kind, retry_at, dead, future))
        self.wake.set()
        return await future

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.queue = self.queue, []
            groups: dict[tuple[str, int], list[tuple[_Held, str, datetime | None, bool, asyncio.Future[bool]]]] = {}
            for entry in batch:
                groups.setdefault((entry[1], entry[0].item.partition), []).append(entry)
            for (kind, _), entries in groups.items():
                for start in range(0, len(entries), MAX_BATCH):
                    await self._apply(kind, entries[start : start + MAX_BATCH], split=True)

    async def _apply(
        self, kind: str, entries: list[tuple[_Held, str, datetime | None, bool, asyncio.Future[bool]]], *, split: bool
    ) -> None:
        engine = self.engine
        attempt = 0
        while True:
            try:
                if kind == "complete":
                    await engine.aclient.complete([e[0].item for e in entries])
                else:
                    await engine.aclient._retry_orders([(e[0].item, e[2], e[3]) for e in entries])
            except LeaseLost as error:
                if split and len(entries) > 1:
                    for entry in entries:  # all-or-nothing: find the lost ones
                        await self._apply(kind, [entry], split=False)
                    return
                assert isinstance(error, QueratorError)
                for entry in entries:
                    engine.lost(entry[0], error)
                    _resolve(entry[4], False)
                return
            except Unavailable as error:
                attempt += 1
                if attempt <= engine.aclient.config.retries:
                    await asyncio.sleep(engine.aclient._backoff(attempt))
                    continue
                self._failed(entries, error)
                return
            except QueratorError as error:
                self._failed(entries, error)
                return
            for entry in entries:
                _resolve(entry[4], True)
            return

    def _failed(self, entries: list[tuple[_Held, str, datetime | None, bool, asyncio.Future[bool]]], error: QueratorError) -> None:
        self.engine.stats.errors += 1
        self.engine._hook("on_error", error)
        for entry in entries:
            _resolve(entry[4], False)


def _resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)


def _resolve_all(entries: list[tuple[_Held, asyncio.Future[bool | None]]], value: bool | None) -> None:
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


def _options(options: WorkerOptions | None, overrides: dict[str, Any]) -> WorkerOptions:
    base = options or WorkerOptions()
    if overrides:
        from dataclasses import replace

        return replace(base, **overrides)
    return base


class AsyncWorker:
    """Runs ``handler`` on items of ``queue_name`` leased through an :class:`~querator.AsyncClient`.

    An ``async def`` handler gets :class:`~querator.AsyncLeasedItem` objects and runs as
    tasks; a plain function gets :class:`~querator.LeasedItem` objects and runs in a
    thread pool of ``concurrency`` threads. After the handler:

    - it returned: the item is completed (unless the handler settled it itself);
    - it raised :class:`~querator.DeadLetter`: the item goes to the dead-letter queue;
    - it raised anything else: the item is retried at ``now + retry_backoff(attempts)``
      (dead-lettered instead once it used the queue's ``max_attempts``).

    With the client's ``tracing=True`` each handler runs inside a CONSUMER span that
    continues the producer's trace (:func:`querator.tracing.process_span`).

    Options are :class:`WorkerOptions` fields, as keywords. ``await worker.run()`` runs
    until :meth:`stop` (or SIGTERM/SIGINT): leasing stops, buffered items are released,
    running handlers get ``shutdown_timeout`` to finish, and the items of those that do
    not are released too (Retry now; an item on its last attempt is dead-lettered).
    """

    def __init__(
        self, client: AsyncClient, queue_name: str, handler: Handler, options: WorkerOptions | None = None, **overrides: Any
    ) -> None:
        self.client = client
        self.queue_name = queue_name
        self.options = _options(options, overrides)
        self._engine = _Engine(client, queue_name, handler, self.options, None)
        self._task: asyncio.Task[None] | None = None

    @property
    def stats(self) -> WorkerStats:
        return self._engine.stats

    async def run(self) -> None:
        """Run until stopped."""
        await self._engine.run()

    def stop(self) -> None:
        """Ask the worker to stop gracefully (safe from any thread); ``run()`` then returns."""
        self._engine.request_stop()

    async def __aenter__(self) -> AsyncWorker:
        self._task = asyncio.create_task(self._engine.run())
        while not self._engine.started.is_set() and not self._task.done():
            await asyncio.sleep(0.005)
        if self._task.done():
            self._task.result()  # raises the start-up error (e.g. QueueNotFound)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if self._task is not None:
            await self._task


class Worker:
    """The blocking twin of :class:`AsyncWorker`, for a :class:`~querator.Client`.

    ``worker.run()`` blocks until :meth:`stop` or SIGTERM/SIGINT; ``worker.start()``
    (or ``with worker:``) runs it on a background thread instead. A sync handler runs
    in a pool of ``concurrency`` threads and gets :class:`~querator.LeasedItem` objects
    bound to ``client``; an ``async def`` handler runs on the worker's own event loop.
    """

    def __init__(
        self, client: Client, queue_name: str, handler: Handler, options: WorkerOptions | None = None, **overrides: Any
    ) -> None:
        self.client = client
        self.queue_name = queue_name
        self.options = _options(options, overrides)
        self._handler = handler
        self._engine: _Engine | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop_requested = False

    @property
    def stats(self) -> WorkerStats:
        return self._engine.stats if self._engine is not None else WorkerStats()

    def run(self) -> None:
        """Run until stopped (blocking)."""
        asyncio.run(self._main())

    async def _main(self) -> None:
        from ._async_client import AsyncClient

        aclient = AsyncClient(config=self.client.config)
        self._engine = _Engine(aclient, self.queue_name, self._handler, self.options, lambda: self.client)
        try:
            if self._stop_requested:
                return
            await self._engine.run()
        finally:
            await aclient.close()

    def start(self, timeout: Seconds = 30) -> Worker:
        """Run on a background thread; returns once the worker is leasing."""
        if self._thread is not None:
            raise RuntimeError("the worker is already started")
        self.options = _options(self.options, {"handle_signals": False})

        def target() -> None:
            try:
                self.run()
            except BaseException as exc:  # reported by stop()
                self._error = exc

        self._thread = threading.Thread(target=target, name="querator-worker", daemon=True)
        self._thread.start()
        limit = time.monotonic() + seconds(timeout)
        while time.monotonic() < limit and self._thread.is_alive():
            engine = self._engine
            if engine is not None and engine.started.wait(0.01):
                return self
        if self._error is not None:
            raise self._error
        raise TimeoutError("the worker did not start in time")

    def stop(self, *, wait: bool = True, timeout: Seconds | None = None) -> None:
        """Stop gracefully; with ``wait``, block until done (and raise what run() raised)."""
        self._stop_requested = True
        if self._engine is not None:
            self._engine.request_stop()
        if wait and self._thread is not None:
            self._thread.join(None if timeout is None else seconds(timeout))
            if self._error is not None:
                raise self._error

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
