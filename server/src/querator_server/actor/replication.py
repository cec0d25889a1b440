"""The ack rule of a replicated queue: a cycle's requests are answered only once its
change set is durable on every in-sync copy, and in lsn order.

The actor commits a cycle locally, hands its change set to the ``Replication`` (which
ships it to the copies, in the order handed) and goes on with the next cycle; the
answers wait here. A cycle that wrote nothing waits for the cycles before it, since
what it answers may rest on them (a duplicate Produce answers an earlier item's id).
If ``replicated`` raises, that cycle and every later one fail UNAVAILABLE, never OK,
and the queue stops serving as primary (``on_lost``): its copy may now hold changes
the others lack, and it must be brought back in line before it serves again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from ..errors import Unavailable
from ..logging import get_logger
from ..storage.change_set import ChangeSet
from .requests import Request
from .transaction import answer

log = get_logger("queue")


class Replication(Protocol):
    """Where a replicated queue's change sets go (the cluster's data path)."""

    async def replicated(self, change: ChangeSet) -> None:
        """Return once every member of the in-sync set holds ``change`` durably; raise
        (``Unavailable``) when that cannot be had: deposed, below the minimum in-sync
        count. Called in lsn order; calls overlap."""


class ReplicationGate:
    """Releases the answers of a replicated queue's cycles, in lsn order."""

    def __init__(self, name: str, replication: Replication, on_lost: Callable[[str], None]) -> None:
        self.name = name
        self.replication = replication
        self._on_lost = on_lost
        self._tail: asyncio.Task[None] | None = None
        # Why replication was lost ("" while it works); every later answer fails.
        self.lost = ""
        self.pending = 0

    def release(self, change: ChangeSet | None, results: list[tuple[Request, object]]) -> None:
        """Answer ``results`` once ``change`` (None: the cycle wrote nothing) and every
        change handed before it are replicated."""
        if change is None and self._tail is None:
            self._answer(results)
            return
        self.pending += 1
        task = asyncio.get_running_loop().create_task(self._release(self._tail, change, results))
        self._tail = task
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.pending -= 1
        if self._tail is task:
            self._tail = None

    async def _release(self, before: asyncio.Task[None] | None, change: ChangeSet | None, results: list[tuple[Request, object]]) -> None:
        error: BaseException | None = None
        if change is not None and not self.lost:
            try:
                await self.replication.replicated(change)
            except (Exception, asyncio.CancelledError) as exc:
                error = exc
        if before is not None:
            await asyncio.wait([before])
        if error is not None and not self.lost:
            self.lost = f"change {change.lsn if change else 0} of epoch {change.epoch if change else 0} was not replicated: {error}"
            log.error("replication_lost", queue=self.name, reason=self.lost)
            self._on_lost(self.lost)
        if self.lost:
            failed = Unavailable(
                f"queue {self.name!r} lost its replicas' acknowledgement and stopped serving here "
                f"({self.lost}); the request may or may not have been applied, retry"
            )
            for request, _result in results:
                answer(request, failed)
            return
        self._answer(results)

    @staticmethod
    def _answer(results: list[tuple[Request, object]]) -> None:
        for request, result in results:
            answer(request, result)

    async def drain(self) -> None:
        """Wait until every answer handed here has been given."""
        while self._tail is not None:
            await asyncio.wait([self._tail])
