"""The SDK's values: plain dataclasses in and out, no protobuf in sight."""

from __future__ import annotations

import json as _json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

T = TypeVar("T")

Payload = bytes | bytearray | memoryview | str


@dataclass(frozen=True, slots=True)
class Item:
    """An item to produce. A ``str`` payload is stored as UTF-8.

    ``enqueue_at`` (timezone-aware) at least 100 ms in the future schedules the item:
    it becomes leasable at that time.
    """

    payload: Payload
    encoding: str = ""
    kind: str = ""
    reference: str = ""
    enqueue_at: datetime | None = None

    @classmethod
    def from_json(cls, value: Any, **options: Any) -> Item:
        """An item whose payload is ``value`` as JSON, with ``encoding="application/json"``."""
        options.setdefault("encoding", "application/json")
        return cls(_json.dumps(value, separators=(",", ":")).encode(), **options)


@dataclass(frozen=True, slots=True)
class ProduceResult:
    """The ids of produced items, in the order given, and the partition each went to."""

    ids: list[str] = field(default_factory=list)
    partitions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self.ids)


@dataclass(frozen=True, slots=True)
class ItemRef:
    """Names a leased item: what Complete, Retry and Extend need.

    Lease results (:class:`LeasedItem`) carry the same three fields and can be passed
    wherever an ``ItemRef`` is accepted.
    """

    queue_name: str
    partition: int
    id: str


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A queue's settings. ``partitions`` is the contract's ``requested_partitions``."""

    name: str
    dead_queue: str = ""
    reference: str = ""
    lease_timeout: timedelta = timedelta(minutes=1)
    expire_timeout: timedelta = timedelta(hours=24)
    max_attempts: int = 0
    partitions: int = 1
    created_at: datetime | None = None
    updated_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class PartitionStats:
    """One partition's counts. ``total`` is ready plus leased; scheduled items are apart."""

    partition: int
    total: int
    total_leased: int
    scheduled: int
    average_age: timedelta
    average_leased_age: timedelta

    @property
    def ready(self) -> int:
        return self.total - self.total_leased


@dataclass(frozen=True, slots=True)
class QueueStats:
    """A queue's counts now, per partition and summed."""

    queue_name: str
    partitions: list[PartitionStats]
    lease_waiting: int = 0
    produce_waiting: int = 0
    in_flight: int = 0

    @property
    def total(self) -> int:
        """Ready plus leased items in every partition (scheduled ones not counted)."""
        return sum(p.total for p in self.partitions)

    @property
    def total_leased(self) -> int:
        return sum(p.total_leased for p in self.partitions)

    @property
    def ready(self) -> int:
        return sum(p.ready for p in self.partitions)

    @property
    def scheduled(self) -> int:
        return sum(p.scheduled for p in self.partitions)


@dataclass(frozen=True, slots=True)
class StoredItem:
    """An item as StorageService stores it. Build one to import items (``id`` is ignored)."""

    payload: bytes = b""
    id: str = ""
    partition: int = 0
    is_leased: bool = False
    lease_deadline: datetime | None = None
    expire_deadline: datetime | None = None
    enqueue_at: datetime | None = None
    created_at: datetime | None = None
    attempts: int = 0
    reference: str = ""
    encoding: str = ""
    kind: str = ""
    source_id: str = ""


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a listing; ``next_page_token`` is empty on the last page."""

    items: list[T]
    next_page_token: str = ""
