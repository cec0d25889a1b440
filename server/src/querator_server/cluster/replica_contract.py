"""What the replication data path needs of the storage (a shard's copies, change sets),
as structural types, and small readings of a shard record."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from .shard_record import UNCLAIMED, ShardRecord

__all__ = [
    "UNCLAIMED",
    "ChangeSetLike",
    "CopyLike",
    "Decode",
    "PositionLike",
    "isr_incarnation",
    "isr_nodes",
    "why_not_electable",
]


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
    # Changes in order in one durable write, up to the first refused: those written and
    # the refusal (raised instead when the first is refused).
    async def apply_all(
        self, changes: list[ChangeSetLike], sender: int = 0
    ) -> tuple[list[ChangeSetLike], Exception | None]: ...
    async def fence(self, epoch: int) -> PositionLike: ...
    def snapshot_chunks(self) -> AsyncIterator[bytes]: ...
    async def install_snapshot(self, chunks: AsyncIterator[bytes], sender: int = 0) -> PositionLike: ...
    def digest(self) -> str: ...
    # The epoch of the primary whose snapshot the copy last installed whole (0: none).
    def rebuilt_epoch(self) -> int: ...


# Decodes a change set shipped by a primary (storage's ChangeSet.decode).
Decode = Callable[[bytes], ChangeSetLike]


def isr_nodes(record: ShardRecord) -> list[str]:
    return [node for node, _ in record.isr]


def isr_incarnation(record: ShardRecord, node: str) -> str | None:
    for member, incarnation in record.isr:
        if member == node:
            return incarnation
    return None


def why_not_electable(record: ShardRecord, node: str, incarnation: str, rebuilt: int) -> str:
    """Why ``node``'s copy (its ``incarnation``; ``rebuilt``: the epoch of the primary
    whose snapshot it last installed whole) may not take over from ``record``'s primary,
    "" when it may: when it holds every acknowledged change.

    The copy the in-sync set names does, and any copy of a node whose entry is still
    unclaimed (nothing was acknowledged yet). So does one that primary rebuilt from a
    snapshot while the set named the node: the snapshot held everything the primary
    held, and while the set names a node the primary counts it, so nothing was
    acknowledged afterwards without this copy's ack. Its new incarnation may not be in
    the set yet (the primary records it a moment after, through etcd, and may die
    first). Any other copy (wiped, half-installed, rebuilt under an older epoch) may
    lack an acknowledged change."""
    entry = isr_incarnation(record, node)
    if entry is None:
        return f"node {node!r} is not in the in-sync set"
    if not incarnation:
        return f"node {node!r} has no copy"
    if incarnation == entry:
        return ""
    if entry == UNCLAIMED:
        # A new queue's entry, not yet claimed: its primary acknowledged nothing while any
        # entry was unclaimed (shipper's ack rule), so any copy of the node holds every
        # acknowledged change (none), whatever it holds.
        return ""
    if rebuilt and rebuilt == record.epoch:
        return ""
    rebuilt_by = f"rebuilt under epoch {rebuilt}" if rebuilt else "not rebuilt whole by a primary"
    return (
        f"the copy on {node!r} is incarnation {incarnation}, the in-sync set names {entry}, "
        f"and it was {rebuilt_by}, not by the primary of epoch {record.epoch}: it may lack acknowledged changes"
    )
