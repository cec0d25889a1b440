"""A small in-process sampler of queue stats, for the rates and the depth chart.

The server keeps counts and two counters per partition (GetQueueStats: items
produced and completed since it loaded the queue), not their history, so the console
keeps its own: every INTERVAL seconds it reads the stats of the queues a page showed
in the last WATCH_SECONDS (at most MAX_WATCHED of them), and keeps KEEP samples of
each. The produce and complete rates are the counters' growth over the last
RATE_WINDOW seconds; a counter that went down (its node restarted) counts from 0.
Items dead-lettered into a queue or redriven out of it are neither produced nor
completed: they show in the depth, not in the rates. The history lives as long as
the process and the session; nothing is stored.
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
    def __init__(self, api: Api) -> None:
        self._api = api
        self._series: dict[str, deque[Sample]] = {}
        self._watched: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, names: list[str]) -> None:
        """Keep sampling ``names`` for the next WATCH_SECONDS (starts the loop)."""
        now = time.monotonic()
        for name in names:
            self._watched.pop(name, None)
            self._watched[name] = now  # most recent last
        while len(self._watched) > MAX_WATCHED:
            oldest = next(iter(self._watched))
            del self._watched[oldest]
            self._series.pop(oldest, None)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

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

        async def one(name: str) -> None:
            async with limit:
                try:
                    self.record(name, await self._api.stats(name))
                except QueratorError:
                    pass  # deleted, refused or unreachable: the chart shows a gap

        while self._watched:
            await asyncio.sleep(INTERVAL)
            cutoff = time.monotonic() - WATCH_SECONDS
            for name in [n for n, seen in self._watched.items() if seen < cutoff]:
                del self._watched[name]
                self._series.pop(name, None)
            await asyncio.gather(*(one(name) for name in list(self._watched)))
