"""A replicated queue's copy on this node, as the cluster's data path drives it.

Passive while another node is the queue's primary: change sets are applied to it, it
is fenced, read whole for a snapshot, compared by digest. While this node is the
primary (``serving_epoch``), the actor writes it and nothing else may: a change set or
a fence under a later epoch first makes the node step down (``step_down``, given by
the manager), since a later epoch means another node was elected.

Operations run one at a time, each durable before it returns: in a write transaction
of the copy's own on its lane, or in its commit group's next commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import lmdb

from .change_set import ChangeSet, Fenced, Position
from .commit_group import CommitGroup
from .lane import StorageLane
from .queue_store import MAX_GROWTHS, MapFull, StorageFull
from .replica_state import ReplicaState

T = TypeVar("T")


class ReplicaCopy:
    """One queue's copy on this node (see the module docstring)."""

    def __init__(self, name: str, state: ReplicaState, lane: StorageLane, group: CommitGroup | None) -> None:
        self.name = name
        self.state = state
        self.lane = lane
        self.group = group
        self._lock = asyncio.Lock()
        # The epoch this node serves the queue under as its primary (0: passive).
        self.serving_epoch = 0
        # Stops the primary here before a later epoch's change or fence is taken.
        self.step_down: Callable[[int], Awaitable[None]] | None = None

    @property
    def incarnation(self) -> str:
        return self.state.incarnation

    def position(self) -> Position:
        return self.state.position()

    def fenced_epoch(self) -> int:
        return self.state.fenced_epoch()

    def history(self) -> list[tuple[int, int]]:
        return self.state.history()

    def digest(self) -> str:
        return self.state.digest()[1]

    async def apply(self, change: ChangeSet) -> Position:
        """Apply ``change`` durably (a no-op for one held already); raises ``Fenced`` or
        ``Diverged`` (change_set.py)."""
        async with self._lock:
            await self._passive(change.epoch, f"change {change.lsn} of epoch {change.epoch}")
            if self.group is None:
                state = self.state
                return await self.lane.run(lambda: state.apply_now(change))
            await self.group.job(lambda: self.state.prepare(change))
            if await self._grouped(lambda txn: self.state.apply(txn, change)):
                self.state.committed(change)
            return self.state.position()

    async def fence(self, epoch: int) -> Position:
        """Refuse, durably, every change set and promotion under an epoch below ``epoch``;
        the position of the last change held."""
        async with self._lock:
            await self._passive(epoch + 1, f"a fence at epoch {epoch}")
            if epoch <= self.state.fenced_epoch():
                return self.state.position()
            if self.group is None:
                state = self.state
                return await self.lane.run(lambda: state.fence_now(epoch))
            await self._grouped(lambda txn: self.state.fence_in(txn, epoch))
            self.state.fenced(epoch)
            return self.state.position()

    async def _passive(self, epoch: int, what: str) -> None:
        """Step down first if this node serves the queue under an epoch below ``epoch``;
        refuse ``what`` if it serves it under that epoch or a later one."""
        if not self.serving_epoch:
            return
        if epoch <= self.serving_epoch or self.step_down is None:
            raise Fenced(f"queue {self.name!r} is served here under epoch {self.serving_epoch}: {what} refused")
        await self.step_down(epoch)
        if self.serving_epoch:
            raise Fenced(f"queue {self.name!r} could not stop serving here under epoch {self.serving_epoch}")

    async def _grouped(self, body: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """``body`` in the commit group's next commit, once durable."""
        group = self.group
        assert group is not None
        for _ in range(MAX_GROWTHS):
            try:
                result, durable = await group.run(body, member=self)
            except MapFull:
                await group.grow()
                continue
            await durable
            return result
        raise StorageFull("storage is full: the LMDB map could not grow enough")

    async def close(self) -> None:
        """Close a copy with an environment of its own (a group closes its own)."""
        async with self._lock:
            if self.group is None:
                await self.lane.run(self.state.store.close)
