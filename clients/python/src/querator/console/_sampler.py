"""A small in-process sampler of queue stats, for the rates and the depth chart.

The server keeps counts and two counters per partition (GetQueueStats: items
produced and completed since it loaded the queue), not their history, so the console
keeps its own: every INTERVAL seconds it reads the stats of the queues a page showed
in the last WATCH_SECONDS (at most MAX_WATCHED of them), and keeps KEEP samples of
each. The produce and complete rates are the counters' growth over the last
RATE_WINDOW seconds; a counter that went down (its node restarted) counts from 0.
Items dead-lettered into a queue or redriven out of it are neither produced nor
completed: they show in the depth, not in the rates. The history lives as long as
the process; nothing is stored.

One sampler serves every visitor of the console (which talks to one server), so two
people logged in poll each queue once between them and see the same figures. Each
queue is polled with the key of the session that last showed it (a key that may read
that queue's stats), and with the one before once that session ends. A page shows a queue's rates and chart only once it has read the
queue's stats with the visitor's own key, so a shared history never shows a queue to
a key that cannot read it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

from ..errors import QueratorError
from ..v1 import queues_pb2
from ._api import Api

INTERVAL = 5.0
KEEP = 360  # 30 minutes at INTERVAL
WATCH_SECONDS = 600.0
MAX_WATCHED = 300
RATE_WINDOW = 300.0  # the rates cover the last 5 minutes
_CONCURRENCY = 8


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # time.monotonic()
    wall: float  # time.time()
    ready: int
    leased: int
    scheduled: int
    produced: tuple[int, ...] = ()  # per partition
    completed: tuple[int, ...] = ()

    @property
    def depth(self) -> int:
        return self.ready + self.leased + self.scheduled


@dataclass(frozen=True, slots=True)
class Rates:
    in_per_min: float  # produced
    out_per_min: float  # completed
    seconds: float  # the span the rates cover


def sample_of(stats: queues_pb2.GetQueueStatsResponse) -> Sample:
    leased = sum(p.total_leased for p in stats.partitions)
    total = sum(p.total for p in stats.partitions)
    scheduled = sum(p.scheduled for p in stats.partitions)
    produced = tuple(p.produced for p in stats.partitions)
    completed = tuple(p.completed for p in stats.partitions)
    return Sample(time.monotonic(), time.time(), total - leased, leased, scheduled, produced, completed)


def _growth(before: tuple[int, ...], after: tuple[int, ...]) -> int:
    """How much counters grew; one that went down restarted from 0 (a partition
    added since is new: all of its count)."""
    return sum(a - b if a >= b else a for a, b in zip(after, before + (0,) * (len(after) - len(before)), strict=False))


class Sampler:
    def __init__(self) -> None:
        self._series: dict[str, deque[Sample]] = {}
        self._watched: dict[str, float] = {}
        # The clients that showed each watched queue, most recent last: it is polled with
        # the last, and with the one before once that one's session ends.
        self._pollers: dict[str, list[Api]] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, names: list[str], api: Api) -> None:
        """Keep sampling ``names`` for the next WATCH_SECONDS, with ``api`` (the client
        whose key just read their stats; starts the loop)."""
        now = time.monotonic()
        for name in names:
            self._watched.pop(name, None)
            self._watched[name] = now  # most recent last
            pollers = self._pollers.setdefault(name, [])
            if api in pollers:
                pollers.remove(api)
            pollers.append(api)
        while len(self._watched) > MAX_WATCHED:
            self._unwatch(next(iter(self._watched)))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def forget(self, api: Api) -> None:
        """Stop polling with ``api`` (its session ended): each of its queues goes on with
        the client that showed it before, if any; else it waits for a page to show it."""
        for name, pollers in list(self._pollers.items()):
            if api in pollers:
                pollers.remove(api)
            if not pollers:
                del self._pollers[name]

    def _unwatch(self, name: str) -> None:
        self._watched.pop(name, None)
        self._pollers.pop(name, None)
        self._series.pop(name, None)

    def record(self, name: str, stats: queues_pb2.GetQueueStatsResponse) -> None:
        """A sample from stats a page read anyway (at most one per second kept)."""
        series = self._series.setdefault(name, deque(maxlen=KEEP))
        sample = sample_of(stats)
        if series and sample.at - series[-1].at < 1.0:
            return
        series.append(sample)

    def series(self, name: str) -> list[Sample]:
        return list(self._series.get(name, ()))

    def rates(self, name: str, window: float = RATE_WINDOW) -> Rates | None:
        """Produced and completed per minute over the last ``window`` seconds; None
        before two samples."""
        samples = self._series.get(name)
        if not samples or len(samples) < 2:
            return None
        since = samples[-1].at - window
        recent = [s for s in samples if s.at >= since]
        if len(recent) < 2:
            recent = list(samples)[-2:]
        seconds = recent[-1].at - recent[0].at
        if seconds <= 0:
            return None
        produced = completed = 0
        for before, after in zip(recent, recent[1:], strict=False):
            produced += _growth(before.produced, after.produced)
            completed += _growth(before.completed, after.completed)
        return Rates(produced * 60 / seconds, completed * 60 / seconds, seconds)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        limit = asyncio.Semaphore(_CONCURRENCY)

        async def one(name: str, api: Api) -> None:
            async with limit:
                try:
                    self.record(name, await api.stats(name))
                except QueratorError:
                    pass  # deleted, refused or unreachable: the chart shows a gap

        while self._watched:
            await asyncio.sleep(INTERVAL)
            cutoff = time.monotonic() - WATCH_SECONDS
            for name in [n for n, seen in self._watched.items() if seen < cutoff]:
                self._unwatch(name)
            polls = [one(name, pollers[-1]) for name, pollers in list(self._pollers.items())]
            await asyncio.gather(*polls, return_exceptions=True)  # a session closing mid-call: a gap
