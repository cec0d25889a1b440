"""What the replication data path needs of the storage (a shard's copies, change sets),
as structural types, and small readings of a shard record."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from .shard_record import UNCLAIMED, ShardRecord

__all__ = ["UNCLAIMED", "ChangeSetLike", "CopyLike", "Decode", "PositionLike", "isr_incarnation", "isr_nodes"]


class PositionLike(Protocol):
    @property
    def epoch(self) -> int: ...
    @property
    def lsn(self) -> int: ...


class ChangeSetLike(Protocol):
    @property
    def uid(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def lsn(self) -> int: ...
    def encode(self) -> bytes: ...


class CopyLike(Protocol):
    """One node's copy of a shard (storage's ReplicaCopy)."""

    @property
    def incarnation(self) -> str: ...
    # The epoch this node serves the shard under as primary (0: a passive copy); the
    # storage resets it when the primary stops (demoted, or its gate lost the replicas).
    serving_epoch: int
    def position(self) -> PositionLike: ...
    def fenced_epoch(self) -> int: ...
    async def apply(self, change: ChangeSetLike, sender: int = 0) -> PositionLike: ...
    async def fence(self, epoch: int) -> PositionLike: ...
    def snapshot_chunks(self) -> AsyncIterator[bytes]: ...
    async def install_snapshot(self, chunks: AsyncIterator[bytes]) -> PositionLike: ...
    def digest(self) -> str: ...


# Decodes a change set shipped by a primary (storage's ChangeSet.decode).
Decode = Callable[[bytes], ChangeSetLike]


def isr_nodes(record: ShardRecord) -> list[str]:
    return [node for node, _ in record.isr]


def isr_incarnation(record: ShardRecord, node: str) -> str | None:
    for member, incarnation in record.isr:
        if member == node:
            return incarnation
    return None
