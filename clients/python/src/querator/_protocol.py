"""Requests and replies: building protobuf messages, reading them back, batching."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any, Protocol, TypeAlias, runtime_checkable

from google.protobuf import field_mask_pb2

from . import _convert as c
from ._config import BATCH_BYTES, MAX_BATCH
from ._models import Item, ItemRef, Payload, PartitionStats, QueueInfo, QueueStats, StoredItem
from .v1 import queue_pb2, queues_pb2, storage_pb2


@runtime_checkable
class Ref(Protocol):
    """Anything that names a leased item: ItemRef, LeasedItem, AsyncLeasedItem."""

    @property
    def queue_name(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def id(self) -> str: ...


ItemsArg: TypeAlias = "Ref | Iterable[Ref]"
ProduceArg: TypeAlias = "Item | Payload"


def refs(items: ItemsArg) -> list[Ref]:
    if isinstance(items, Ref):
        return [items]
    return list(items)


def group_refs(items: ItemsArg) -> list[tuple[str, int, list[Ref]]]:
    """Items grouped by (queue, partition) in first-seen order, in chunks of at most 1,000."""
    groups: dict[tuple[str, int], list[Ref]] = {}
    for ref in refs(items):
        groups.setdefault((ref.queue_name, ref.partition), []).append(ref)
    out: list[tuple[str, int, list[Ref]]] = []
    for (queue, partition), members in groups.items():
        for start in range(0, len(members), MAX_BATCH):
            out.append((queue, partition, members[start : start + MAX_BATCH]))
    return out


def mark(items: Iterable[Ref], state: str) -> None:
    for ref in items:
        setter = getattr(ref, "_set_state", None)
        if setter is not None:
            setter(state)


# -- produce --------------------------------------------------------------------------


def produce_item(value: ProduceArg, defaults: Item | None) -> queue_pb2.ProduceItem:
    item = value if isinstance(value, Item) else Item(value)
    encoding, kind, reference, enqueue_at = item.encoding, item.kind, item.reference, item.enqueue_at
    if defaults is not None:
        encoding = encoding or defaults.encoding
        kind = kind or defaults.kind
        reference = reference or defaults.reference
        enqueue_at = enqueue_at or defaults.enqueue_at
    out = queue_pb2.ProduceItem(
        payload=c.payload_bytes(item.payload), encoding=encoding, kind=kind, reference=reference
    )
    if enqueue_at is not None:
        out.enqueue_at.CopyFrom(c.to_timestamp(enqueue_at))
    return out


def produce_batches(
    items: Iterable[ProduceArg] | ProduceArg, defaults: Item | None, *, max_items: int = MAX_BATCH, max_bytes: int = BATCH_BYTES
) -> Iterator[list[queue_pb2.ProduceItem]]:
    """Split ``items`` into request-sized batches (count and serialized bytes)."""
    if isinstance(items, (bytes, bytearray, memoryview, str, Item)):
        items = [items]
    max_items = max(1, min(max_items, MAX_BATCH))
    batch: list[queue_pb2.ProduceItem] = []
    size = 0
    for value in items:
        message = produce_item(value, defaults)
        # Each repeated entry costs its bytes plus a tag and a length prefix.
        cost = message.ByteSize() + 6
        if batch and (len(batch) >= max_items or size + cost > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(message)
        size += cost
    if batch:
        yield batch


def produce_request(
    queue_name: str, batch: list[queue_pb2.ProduceItem], timeout: float
) -> queue_pb2.ProduceRequest:
    return queue_pb2.ProduceRequest(queue_name=queue_name, items=batch, request_timeout=c.to_duration(timeout))


# -- lease, complete, retry, extend -----------------------------------------------------


def lease_request(
    queue_name: str, batch_size: int, wait: c.Seconds, client_id: str
) -> tuple[queue_pb2.LeaseRequest, float]:
    """The request and the call deadline (the wait plus the margin comes from the caller)."""
    wait_s = c.seconds(wait)
    request = queue_pb2.LeaseRequest(
        queue_name=queue_name, batch_size=batch_size, client_id=client_id, request_timeout=c.to_duration(wait_s)
    )
    return request, wait_s


def leased_fields(response: queue_pb2.LeaseResponse) -> Iterator[dict[str, Any]]:
    for item in response.items:
        yield {
            "queue_name": response.queue_name,
            "partition": response.partition,
            "id": item.id,
            "payload": bytes(item.payload),
            "encoding": item.encoding,
            "kind": item.kind,
            "reference": item.reference,
            "attempts": item.attempts,
            "lease_deadline": c.from_timestamp(item.lease_deadline),
            "created_at": c.from_timestamp(item.created_at),
        }


def complete_request(queue: str, partition: int, members: list[Ref], timeout: float) -> queue_pb2.CompleteRequest:
    return queue_pb2.CompleteRequest(
        queue_name=queue,
        partition=partition,
        ids=[m.id for m in members],
        request_timeout=c.to_duration(timeout),
    )


def retry_at(at: datetime | None, in_: c.Seconds | None) -> datetime | None:
    if at is not None and in_ is not None:
        raise ValueError("give at= or in_=, not both")
    if in_ is not None:
        return c.now() + c.as_timedelta(in_)
    return at


def retry_request(
    queue: str, partition: int, orders: list[tuple[Ref, datetime | None, bool]], timeout: float
) -> queue_pb2.RetryRequest:
    items = []
    for ref, when, dead in orders:
        item = queue_pb2.RetryItem(id=ref.id, dead=dead)
        if when is not None:
            item.retry_at.CopyFrom(c.to_timestamp(when))
        items.append(item)
    return queue_pb2.RetryRequest(
        queue_name=queue, partition=partition, items=items, request_timeout=c.to_duration(timeout)
    )


def extend_request(
    queue: str, partition: int, members: list[Ref], lease_timeout: c.Seconds | None, timeout: float
) -> queue_pb2.ExtendRequest:
    request = queue_pb2.ExtendRequest(
        queue_name=queue, partition=partition, ids=[m.id for m in members], request_timeout=c.to_duration(timeout)
    )
    if lease_timeout is not None:
        request.lease_timeout.CopyFrom(c.to_duration(lease_timeout))
    return request


def apply_deadlines(members: list[Ref], response: queue_pb2.ExtendResponse) -> list[datetime]:
    deadlines = [c.from_timestamp(ts) for ts in response.lease_deadlines]
    for ref, deadline in zip(members, deadlines):
        if hasattr(ref, "_set_deadline"):
            ref._set_deadline(deadline)
    return deadlines


# -- queues -------------------------------------------------------------------------------

_SETTINGS = {
    "dead_queue": "dead_queue",
    "reference": "reference",
    "lease_timeout": "lease_timeout",
    "expire_timeout": "expire_timeout",
    "max_attempts": "max_attempts",
    "partitions": "requested_partitions",
}


def queue_info_message(name: str, settings: dict[str, Any]) -> tuple[queues_pb2.QueueInfo, list[str]]:
    """A QueueInfo with the given settings (None values skipped) and the proto field names set."""
    info = queues_pb2.QueueInfo(queue_name=name)
    paths: list[str] = []
    for key, value in settings.items():
        if value is None:
            continue
        proto_name = _SETTINGS[key]
        if key in ("lease_timeout", "expire_timeout"):
            getattr(info, proto_name).CopyFrom(c.to_duration(value))
        else:
            setattr(info, proto_name, value)
        paths.append(proto_name)
    return info, paths


def update_mask(paths: list[str]) -> field_mask_pb2.FieldMask:
    return field_mask_pb2.FieldMask(paths=paths)


def queue_info(info: queues_pb2.QueueInfo) -> QueueInfo:
    return QueueInfo(
        name=info.queue_name,
        dead_queue=info.dead_queue,
        reference=info.reference,
        lease_timeout=c.from_duration(info.lease_timeout),
        expire_timeout=c.from_duration(info.expire_timeout),
        max_attempts=info.max_attempts,
        partitions=info.requested_partitions,
        created_at=c.optional_timestamp(info, "created_at"),
        updated_at=c.optional_timestamp(info, "updated_at"),
    )


def queue_stats(response: queues_pb2.GetQueueStatsResponse) -> QueueStats:
    return QueueStats(
        queue_name=response.queue_name,
        partitions=[
            PartitionStats(
                partition=p.partition,
                total=p.total,
                total_leased=p.total_leased,
                scheduled=p.scheduled,
                average_age=c.from_duration(p.average_age),
                average_leased_age=c.from_duration(p.average_leased_age),
            )
            for p in response.partitions
        ],
        lease_waiting=response.lease_waiting,
        produce_waiting=response.produce_waiting,
        in_flight=response.in_flight,
    )


# -- storage -------------------------------------------------------------------------------


def stored_item(item: storage_pb2.StorageItem, partition: int) -> StoredItem:
    return StoredItem(
        payload=bytes(item.payload),
        id=item.id,
        partition=partition,
        is_leased=item.is_leased,
        lease_deadline=c.optional_timestamp(item, "lease_deadline"),
        expire_deadline=c.optional_timestamp(item, "expire_deadline"),
        enqueue_at=c.optional_timestamp(item, "enqueue_at"),
        created_at=c.optional_timestamp(item, "created_at"),
        attempts=item.attempts,
        reference=item.reference,
        encoding=item.encoding,
        kind=item.kind,
        source_id=item.source_id,
    )


def storage_item(item: StoredItem | Item | Payload) -> storage_pb2.StorageItem:
    if isinstance(item, Item):
        item = StoredItem(
            payload=c.payload_bytes(item.payload),
            encoding=item.encoding,
            kind=item.kind,
            reference=item.reference,
            enqueue_at=item.enqueue_at,
        )
    elif not isinstance(item, StoredItem):
        item = StoredItem(payload=c.payload_bytes(item))
    out = storage_pb2.StorageItem(
        is_leased=item.is_leased,
        attempts=item.attempts,
        reference=item.reference,
        encoding=item.encoding,
        kind=item.kind,
        payload=c.payload_bytes(item.payload),
        source_id=item.source_id,
    )
    for name in ("lease_deadline", "expire_deadline", "enqueue_at", "created_at"):
        value: datetime | None = getattr(item, name)
        if value is not None:
            getattr(out, name).CopyFrom(c.to_timestamp(value))
    return out


def chunks(values: list[Any], size: int = MAX_BATCH) -> Iterator[list[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def as_ref(queue_name: str, partition: int, ids: Iterable[str]) -> list[ItemRef]:
    return [ItemRef(queue_name, partition, i) for i in ids]
