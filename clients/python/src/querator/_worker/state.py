"""What the settler and keep-alive see of the engine: the items it holds, and a few of
its parts (a Protocol, so that they need not import the engine)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from .._items import _LeasedBase
from ..errors import QueratorError
from .calls import WorkerCalls
from .options import WorkerStats

#: An item's key among those a worker holds: its partition and its id. In a cluster
#: each partition's home issues ids from its own counters, so items of two partitions
#: may have the same id (docs/cluster.md, Limits).
HeldKey = tuple[int, str]


@dataclass(eq=False)
class Held:
    item: _LeasedBase
    extend_at: float
    length: float
    #: When it was leased (monotonic): ``max_lease_duration`` counts from here.
    leased_at: float
    started: bool = False
    settling: bool = False
    lost: bool = False
    abandoned: bool = False
    #: Keep-alive stopped at ``max_lease_duration``.
    capped: bool = False
    #: The handler returned and the item only waits to be completed: it no longer
    #: takes room from leasing.
    finished: bool = False
    #: Leased, not started, not abandoned (counted in Engine.n_waiting).
    waiting: bool = True
    task: asyncio.Task[None] | None = None

    @property
    def key(self) -> HeldKey:
        return (self.item.partition, self.item.id)


class EngineState(Protocol):
    """The engine's parts the settler and keep-alive use."""

    held: dict[HeldKey, Held]
    stats: WorkerStats
    calls: WorkerCalls
    #: Lease length asked for by Extend (None: the queue's), the queue's lease_timeout,
    #: and max_lease_duration, in seconds.
    extension: float | None
    lease_timeout: float
    max_lease: float | None
    #: Set when items were leased: keep-alive looks at them.
    new_leases: asyncio.Event

    def hook(self, name: str, *args: Any) -> None: ...

    def lost(self, held: Held, error: QueratorError) -> None: ...
