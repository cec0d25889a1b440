"""Periodic jobs: produced by every worker that runs them, each tick once.

There is no scheduler process to keep single (Celery beat's rule: exactly one beat).
Every worker computes the same ticks from the schedule alone (cron times, or multiples
of the interval since the Unix epoch) and produces each with the idempotency key
``name@tick``; the server stores the first and answers the others as duplicates, for
as long as the queue's ``dedup_window`` (24 h by default) remembers the key. So N
workers, on one host or many, produce each tick exactly once. A worker produces the
ticks that come while it runs; ticks missed while none ran are not produced later,
unless ``catch_up`` asks for those of a recent window.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from typing import TYPE_CHECKING, Any

from .._convert import Seconds, as_timedelta
from .._models import Item
from ..errors import QueratorError

if TYPE_CHECKING:
    from .._async_client import AsyncClient
    from .tasks import Task

log = logging.getLogger("querator.worker")

#: Metadata of a produced tick: the job's name and its scheduled time (ISO 8601, UTC).
PERIODIC_KEY = "querator-periodic"
TICK_KEY = "querator-tick"


@dataclass(frozen=True, kw_only=True)
class Periodic:
    """A job produced on a schedule (``WorkerSettings.periodic``, ``worker.schedule``)::

        querator.Periodic(name="cleanup", cron="0 3 * * *", task=cleanup, kwargs={"days": 30})
        querator.Periodic(name="heartbeat", every=timedelta(seconds=10), kind="ping", payload=b"")

    ``cron``: a cron expression (the ``cron`` extra, croniter; a 6th field gives
    seconds), read in ``timezone`` (UTC by default); or ``every``: an interval, ticking
    at multiples of it since the Unix epoch, so that every worker finds the same ticks.
    What each tick produces: the ``task`` with ``kwargs``, or an item of ``kind`` and
    ``payload``; to ``queue`` (default: the task's queue, else the worker's). The item
    carries the idempotency key ``name@<tick, ISO 8601>`` and, in its metadata,
    ``querator-periodic`` (the name) and ``querator-tick`` (the tick). ``catch_up``: at
    start, also produce the ticks of this long before now (those produced already are
    duplicates and store nothing); default none: ticks missed while no worker ran are
    not produced.
    """

    name: str
    cron: str | None = None
    every: Seconds | None = None
    task: Task[Any] | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    kind: str = ""
    payload: bytes | str = b""
    queue: str | None = None
    timezone: tzinfo = UTC
    catch_up: Seconds | None = None

    def __post_init__(self) -> None:
        if not self.name or "@" in self.name:
            raise ValueError(f"a periodic job's name is non-empty and without '@', not {self.name!r}")
        if (self.cron is None) == (self.every is None):
            raise ValueError(f"periodic job {self.name!r}: give cron or every (one of them)")
        if self.every is not None and as_timedelta(self.every) < timedelta(seconds=1):
            raise ValueError(f"periodic job {self.name!r}: every must be at least 1 second")
        if self.task is not None and (self.kind or self.payload):
            raise ValueError(f"periodic job {self.name!r}: give a task, or kind and payload, not both")
        if self.task is not None:
            self.task.item(**self.kwargs)  # the arguments fit the function, now
        if self.cron is not None:
            self._cron(datetime.now(UTC))  # a bad expression (or no croniter) fails now
        if self.catch_up is not None and as_timedelta(self.catch_up) < timedelta(0):
            raise ValueError(f"periodic job {self.name!r}: catch_up must not be negative")

    # -- the schedule ---------------------------------------------------------------------

    def _cron(self, after: datetime) -> datetime:
        try:
            from croniter import croniter
        except ImportError:
            raise ImportError("cron schedules need croniter: pip install 'querator-client[cron]'") from None
        try:
            it = croniter(self.cron, after.astimezone(self.timezone))
        except (ValueError, KeyError) as exc:
            raise ValueError(f"periodic job {self.name!r}: bad cron expression {self.cron!r}: {exc}") from None
        found: datetime = it.get_next(datetime)
        return found.astimezone(UTC)

    def next_tick(self, after: datetime) -> datetime:
        """The first tick strictly after ``after`` (UTC)."""
        if self.every is None:
            return self._cron(after)
        step = as_timedelta(self.every).total_seconds()
        # Whole microseconds, so that every worker formats the same key for a tick.
        n = math.floor(after.timestamp() / step) + 1
        return datetime.fromtimestamp(0, UTC) + timedelta(microseconds=round(n * step * 1_000_000))

    def item(self, tick: datetime) -> Item:
        """What the tick produces."""
        at = tick.astimezone(UTC).isoformat(timespec="microseconds")
        base = self.task.item(**self.kwargs) if self.task is not None else Item(self.payload, kind=self.kind)
        return Item(
            base.payload,
            encoding=base.encoding,
            kind=base.kind,
            idempotency_key=f"{self.name}@{at}",
            metadata={PERIODIC_KEY: self.name, TICK_KEY: at},
        )


class Scheduler:
    """Produces a worker's periodic jobs until cancelled."""

    def __init__(self, client: AsyncClient, queue: str, jobs: tuple[Periodic, ...]) -> None:
        self.client = client
        self.queue = queue
        self.jobs = jobs
        #: Ticks produced by this worker, and ticks another worker had produced first.
        self.produced = 0
        self.duplicates = 0

    async def run(self) -> None:
        await asyncio.gather(*(self._run(job) for job in self.jobs))

    async def _run(self, job: Periodic) -> None:
        now = datetime.now(UTC)
        cursor = now - as_timedelta(job.catch_up) if job.catch_up is not None else now
        while True:
            tick = job.next_tick(cursor)
            wait = (tick - datetime.now(UTC)).total_seconds()
            if wait > 0:
                await asyncio.sleep(wait)
            cursor = tick
            # Ticks found late (the loop was busy, the host slept): with catch_up each
            # is produced, without it only the latest due one.
            after = job.next_tick(tick)
            if job.catch_up is None and after <= datetime.now(UTC):
                continue
            await self._produce(job, tick)

    async def _produce(self, job: Periodic, tick: datetime) -> None:
        queue = job.queue or (job.task.tasks.queue if job.task is not None else self.queue)
        try:
            # retry=True: safe with an idempotency key (a repeat stores nothing).
            result = await self.client.produce(queue, job.item(tick), retry=True)
        except QueratorError as error:
            # Other workers may produce it; this one carries on with the next tick.
            log.warning("periodic job %s: tick %s not produced: %s", job.name, tick.isoformat(), error)
            return
        if result.duplicates:
            self.duplicates += 1
        else:
            self.produced += 1
            log.debug("periodic job %s: produced tick %s", job.name, tick.isoformat())


async def run_with(engine_run: Awaitable[None], client: AsyncClient, queue: str, jobs: tuple[Periodic, ...]) -> None:
    """Run a worker's engine with its periodic jobs beside it; they stop with it."""
    if not jobs:
        await engine_run
        return
    scheduler = asyncio.create_task(Scheduler(client, queue, jobs).run())
    scheduler.add_done_callback(_report)
    try:
        await engine_run
    finally:
        scheduler.cancel()
        await asyncio.gather(scheduler, return_exceptions=True)


def _report(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("periodic jobs stopped", exc_info=task.exception())
