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

# Cycles committed here and not yet acknowledged by the replicas, at most: the actor
# waits before the next cycle beyond it. What a primary may hold that its copies lack
# stays bounded (what a failover away from it drops, unanswered), and so does the work
# piled up behind a replica that stopped answering until the in-sync set shrinks.
MAX_UNREPLICATED = 32


class Replication(Protocol):
    """Where a replicated queue's change sets go (the cluster's data path). A class that
    names ``Replication`` as its base inherits the ``writable`` that refuses nothing."""

    async def replicated(self, change: ChangeSet) -> None:
        """Return once every member of the in-sync set holds ``change`` durably; raise
        (``Unavailable``) when that cannot be had: deposed, below the minimum in-sync
        count. Called in lsn order; calls overlap."""

    def writable(self) -> None:
        """Raise ``Unavailable`` while a change made now could not be acknowledged (fewer
        copies in sync than the queue's minimum): the actor then refuses the cycle's
        writes before storing them (``ReplicationGate.refusal``)."""
        return None


class ReplicationGate:
    """Releases the answers of a replicated queue's cycles, in lsn order."""

    def __init__(self, name: str, replication: Replication, on_lost: Callable[[str], None]) -> None:
        self.name = name
        self.replication = replication
        self._on_lost = on_lost
        self._tail: asyncio.Task[None] | None = None
        # Each waiting cycle's task, with the answers it owes.
        self._pending: dict[asyncio.Task[None], list[tuple[Request, object]]] = {}
        # Why replication was lost ("" while it works); every later answer fails.
        self.lost = ""

    def release(
        self, change: ChangeSet | None, results: list[tuple[Request, object]], then: Callable[[], None] | None = None
    ) -> None:
        """Answer ``results`` once ``change`` (None: the cycle wrote nothing) and every
        change handed before it are replicated, after calling ``then`` (what the cycle
        starts outside the queue, such as handing dead letters over, waits too)."""
        if change is None and self._tail is None:
            if then is not None:
                then()
            self._answer(results)
            return
        task = asyncio.get_running_loop().create_task(self._release(self._tail, change, results, then))
        self._tail = task
        self._pending[task] = results
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        results = self._pending.pop(task, [])
        if self._tail is task:
            self._tail = None
        if task.cancelled():  # cancelled before it ran: its answers are still owed
            self._fail(results)

    def refusal(self) -> Unavailable | None:
        """Why the requests that write must be refused now, or None: below the minimum
        in-sync count a write is refused UNAVAILABLE before it is stored, rather than
        stored and left waiting for an acknowledgement until its deadline (its caller
        then could not tell whether it was applied)."""
        try:
            self.replication.writable()
        except Unavailable as exc:
            return exc
        return None

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def _release(
        self,
        before: asyncio.Task[None] | None,
        change: ChangeSet | None,
        results: list[tuple[Request, object]],
        then: Callable[[], None] | None,
    ) -> None:
        error: BaseException | None = None
        try:
            if change is not None and not self.lost:
                await self.replication.replicated(change)
            if before is not None:
                await asyncio.wait([before])
        except (Exception, asyncio.CancelledError) as exc:  # cancelled: abandoned
            error = exc
        if error is not None and not self.lost:
            at = f"change {change.lsn} of epoch {change.epoch}" if change is not None else "a change"
            self._lose(f"{at} was not replicated: {error or type(error).__name__}", expected=isinstance(error, Unavailable))
        if self.lost:
            self._fail(results)
            return
        if then is not None:
            then()
        if change is not None:
            # One line per acknowledged cycle, at debug level: which epoch's primary
            # answered what, and when (the network-fault tests check that no two epochs'
            # acknowledgements overlap in time).
            log.debug("replicated_answers", queue=self.name, epoch=change.epoch, lsn=change.lsn, answers=len(results))
        self._answer(results)

    def _fail(self, results: list[tuple[Request, object]]) -> None:
        failed = Unavailable(
            f"queue {self.name!r} stopped serving here before its replicas acknowledged the change "
            f"({self.lost or 'stopped'}); the request may or may not have been applied, retry"
        )
        for request, _result in results:
            answer(request, failed)

    def _lose(self, reason: str, *, expected: bool) -> None:
        """``expected``: the replication's own verdict (UNAVAILABLE: this primary was
        deposed or stopped serving, which every failover and hand-over does, and which
        the shard already logged as such): a warning. Anything else is a fault: an error."""
        self.lost = reason
        (log.warning if expected else log.error)("replication_lost", queue=self.name, reason=reason)
        self._on_lost(reason)

    def abandon(self, reason: str) -> None:
        """Stop waiting: every answer not given yet fails UNAVAILABLE (the queue stops
        serving here)."""
        if not self.lost:
            self.lost = reason
        for task in list(self._pending):
            task.cancel()

    @staticmethod
    def _answer(results: list[tuple[Request, object]]) -> None:
        for request, result in results:
            answer(request, result)

    async def room(self) -> None:
        """Until fewer than ``MAX_UNREPLICATED`` cycles wait for their replicas."""
        while len(self._pending) >= MAX_UNREPLICATED:
            await asyncio.wait(set(self._pending), return_when=asyncio.FIRST_COMPLETED)

    async def drain(self) -> None:
        """Wait until every answer handed here has been given."""
        while self._tail is not None:
            await asyncio.wait([self._tail])
