"""Requests and replies: building protobuf messages, reading them back, batching."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, TypeAlias, runtime_checkable

from google.protobuf import field_mask_pb2

from . import _convert as c
from ._config import BATCH_BYTES, MAX_BATCH
from ._models import (
    QUEUE_SETTINGS,
    ROLES,
    ApiKey,
    ClusterMember,
    ClusterView,
    CreatedKey,
    DeadReason,
    ExtendResult,
    Item,
    PartitionStats,
    Payload,
    QueueInfo,
    QueueStats,
    RedriveResult,
    ReplicaSet,
    SetAsideQueue,
    StoredItem,
)
from .tracing import _merge_trace as merge_trace
from .v1 import cluster_pb2, keys_pb2, queue_pb2, queues_pb2, storage_pb2


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
    # The usual case first: a runtime Protocol check is slow. Exact types only: a
    # caller's NamedTuple with the three fields is a Ref.
    if type(items) is list or type(items) is tuple:
        return list(items)
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


def produce_item(
    value: ProduceArg, defaults: Item | None, trace: Mapping[str, str] | None = None
) -> queue_pb2.ProduceItem:
    """The ProduceItem for ``value``; ``trace``: trace context to add to its metadata
    (the keys the item sets itself win)."""
    item = value if isinstance(value, Item) else Item(value)
    encoding, kind, reference, enqueue_at = item.encoding, item.kind, item.reference, item.enqueue_at
    priority = item.priority
    if defaults is not None:
        encoding = encoding or defaults.encoding
        kind = kind or defaults.kind
        reference = reference or defaults.reference
        enqueue_at = enqueue_at or defaults.enqueue_at
        priority = priority or defaults.priority
    out = queue_pb2.ProduceItem(
        payload=c.payload_bytes(item.payload),
        encoding=encoding,
        kind=kind,
        reference=reference,
        idempotency_key=item.idempotency_key,
        group_key=item.group_key,
        priority=priority,
    )
    if enqueue_at is not None:
        out.enqueue_at.CopyFrom(c.to_timestamp(enqueue_at))
    metadata = merge_trace(item.metadata, trace) if trace else item.metadata
    if metadata:
        out.metadata.update(metadata)
    return out


ProduceEntry: TypeAlias = "queue_pb2.ProduceItem | bytes"


def produce_batches(
    items: Iterable[ProduceArg] | ProduceArg,
    defaults: Item | None,
    *,
    max_items: int = MAX_BATCH,
    max_bytes: int = BATCH_BYTES,
    trace: Mapping[str, str] | None = None,
) -> Iterator[list[ProduceEntry]]:
    """Split ``items`` into request-sized batches (count and serialized bytes).

    A value that is only a payload (bytes or str, with no defaults or trace context to
    add) stays bytes: a batch of nothing else goes in the compact form
    (``ProduceRequest.payloads``), without a ProduceItem per item.
    """
    if isinstance(items, (bytes, bytearray, memoryview, str, Item)):
        items = [items]
    max_items = max(1, min(max_items, MAX_BATCH))
    bare = trace is None and (
        defaults is None
        or not (
            defaults.encoding or defaults.kind or defaults.reference or defaults.enqueue_at is not None or defaults.priority
        )
    )
    batch: list[ProduceEntry] = []
    size = 0
    for value in items:
        entry: ProduceEntry
        if bare and isinstance(value, (bytes, bytearray, memoryview, str)):
            entry = c.payload_bytes(value)
            cost = len(entry) + 6
        else:
            entry = produce_item(value, defaults, trace)
            # Each repeated entry costs its bytes plus a tag and a length prefix.
            cost = entry.ByteSize() + 6
        if batch and (len(batch) >= max_items or size + cost > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(entry)
        size += cost
    if batch:
        yield batch


def all_keyed(batch: Sequence[ProduceEntry]) -> bool:
    """Every item carries an idempotency key: repeating the request cannot store twice."""
    return all(not isinstance(item, bytes) and item.idempotency_key for item in batch)


def produce_request(queue_name: str, batch: Sequence[ProduceEntry], timeout: float) -> queue_pb2.ProduceRequest:
    """The request for ``batch``: the compact form when every entry is a bare payload,
    else one ProduceItem per item."""
    request = queue_pb2.ProduceRequest(queue_name=queue_name, request_timeout=c.to_duration(timeout))
    if all(isinstance(entry, bytes) for entry in batch):
        request.payloads.extend(batch)  # type: ignore[arg-type]
    else:
        request.items.extend(queue_pb2.ProduceItem(payload=e) if isinstance(e, bytes) else e for e in batch)
    return request


# -- lease, complete, retry, extend -----------------------------------------------------


def lease_request(
    queue_name: str,
    batch_size: int,
    wait: c.Seconds,
    client_id: str,
    complete: list[Ref] | None = None,
    lease_key: str = "",
) -> tuple[queue_pb2.LeaseRequest, float]:
    """The request and the wait in seconds (the caller adds its margin for the deadline).

    ``complete``: items of an earlier lease to complete first, all of ``queue_name`` and
    of one partition (:func:`lease_completions` checks that).
    """
    wait_s = c.seconds(wait)
    request = queue_pb2.LeaseRequest(
        queue_name=queue_name,
        batch_size=batch_size,
        client_id=client_id,
        request_timeout=c.to_duration(wait_s),
        lease_key=lease_key,
        columnar=True,
    )
    if complete:
        request.complete_ids.extend(m.id for m in complete)
        request.complete_partition = complete[0].partition
    return request, wait_s


def lease_completions(queue_name: str, items: ItemsArg | None) -> list[Ref]:
    """The items a Lease should complete first; they must name one partition of its queue."""
    if items is None:
        return []
    members = refs(items)
    if not members:
        return []
    if len(members) > MAX_BATCH:
        raise ValueError(f"a Lease completes at most {MAX_BATCH} items, got {len(members)}")
    partition = members[0].partition
    for ref in members:
        if ref.queue_name != queue_name:
            raise ValueError(f"complete= names an item of queue {ref.queue_name!r}, not {queue_name!r}")
        if ref.partition != partition:
            raise ValueError("complete= items must all come from one partition (one earlier Lease)")
    return members


def leased_fields(response: queue_pb2.LeaseResponse) -> Iterator[dict[str, Any]]:
    """Each leased item's fields, from the reply's columns (every Lease the SDK sends
    asks for them)."""
    queue_name, partition, columns = response.queue_name, response.partition, response.columns
    n = len(columns.ids)
    blank = [""] * n
    encodings = list(columns.encodings) or blank
    kinds = list(columns.kinds) or blank
    references = list(columns.references) or blank
    metadata = [dict(m.entries) for m in columns.metadata] or [{} for _ in range(n)]
    ids = list(columns.ids)
    message_ids = list(columns.message_ids) or ids
    source_ids = list(columns.source_ids) or blank
    reasons = [dead_reason(r) for r in columns.dead_reasons] or [None] * n
    dead_at = [c.from_micros(us) if us else None for us in columns.dead_at_us] or [None] * n
    dead_attempts = list(columns.dead_attempts) or [0] * n
    last_errors = list(columns.last_errors) or blank
    last_error_at = [c.from_micros(us) if us else None for us in columns.last_error_at_us] or [None] * n
    group_keys = list(columns.group_keys) or blank
    priorities = list(columns.priorities) or [0] * n
    # The items of one reply share their lease deadline, and those produced together
    # their creation time: each distinct time is converted once (a datetime built from
    # microseconds was most of the SDK's CPU per leased item).
    times: dict[int, datetime] = {}

    def at(us: int) -> datetime:
        value = times.get(us)
        if value is None:
            value = times[us] = c.from_micros(us)
        return value

    for i, (item_id, payload, attempts, deadline_us, created_us) in enumerate(
        zip(ids, columns.payloads, columns.attempts, columns.lease_deadlines_us, columns.created_at_us)
    ):
        yield {
            "message_id": message_ids[i],
            "source_id": source_ids[i],
            "dead_reason": reasons[i],
            "dead_at": dead_at[i],
            "dead_attempts": dead_attempts[i],
            "last_error": last_errors[i],
            "last_error_at": last_error_at[i],
            "group_key": group_keys[i],
            "priority": priorities[i],
            "queue_name": queue_name,
            "partition": partition,
            "id": item_id,
            "payload": payload,
            "encoding": encodings[i],
            "kind": kinds[i],
            "reference": references[i],
            "attempts": attempts,
            "lease_deadline": at(deadline_us),
            "created_at": at(created_us),
            "metadata": metadata[i],
        }


def complete_request(queue: str, partition: int, members: list[Ref], timeout: float) -> queue_pb2.CompleteRequest:
    return queue_pb2.CompleteRequest(
        queue_name=queue,
        partition=partition,
        ids=[m.id for m in members],
        request_timeout=c.to_duration(timeout),
    )


def lease_keys(keys: Iterable[str] | str | None, queue_name: str | None) -> tuple[str, list[list[str]]]:
    """The queue and the request-sized chunks of ``lease_keys`` (none: no chunks)."""
    if keys is None:
        return "", []
    values = [keys] if isinstance(keys, str) else list(keys)
    if not values:
        return "", []
    if not queue_name:
        raise ValueError("lease_keys need queue_name= (the queue the keys leased from)")
    return queue_name, list(chunks(values))


def complete_keys_request(queue: str, keys: list[str], timeout: float) -> queue_pb2.CompleteRequest:
    return queue_pb2.CompleteRequest(queue_name=queue, lease_keys=keys, request_timeout=c.to_duration(timeout))


def retry_at(at: datetime | None, in_: c.Seconds | None) -> datetime | None:
    if at is not None and in_ is not None:
        raise ValueError("give at= or in_=, not both")
    if in_ is not None:
        return c.now() + c.as_timedelta(in_)
    return at


def retry_request(
    queue: str, partition: int, orders: list[tuple[Ref, datetime | None, bool, str]], timeout: float
) -> queue_pb2.RetryRequest:
    items = []
    for ref, when, dead, error in orders:
        item = queue_pb2.RetryItem(id=ref.id, dead=dead, error=error)
        if when is not None:
            item.retry_at.CopyFrom(c.to_timestamp(when))
        items.append(item)
    return queue_pb2.RetryRequest(
        queue_name=queue, partition=partition, items=items, request_timeout=c.to_duration(timeout)
    )


def extend_request(
    queue: str,
    partition: int,
    members: list[Ref],
    lease_timeout: c.Seconds | None,
    timeout: float,
    keys: list[str] | None = None,
) -> queue_pb2.ExtendRequest:
    request = queue_pb2.ExtendRequest(
        queue_name=queue,
        partition=partition,
        ids=[m.id for m in members],
        request_timeout=c.to_duration(timeout),
        lease_keys=keys or [],
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

# QueueSettings names that differ from QueueInfo's field names, and the durations.
_PROTO_NAMES = {"partitions": "requested_partitions"}
_DURATIONS = ("lease_timeout", "expire_timeout", "dedup_window", "lease_key_ttl")


def queue_info_message(name: str, settings: Mapping[str, Any]) -> tuple[queues_pb2.QueueInfo, list[str]]:
    """A QueueInfo with the given settings (None values skipped) and the proto field names set."""
    info = queues_pb2.QueueInfo(queue_name=name)
    paths: list[str] = []
    for key, value in settings.items():
        if key not in QUEUE_SETTINGS:  # what a keyword-only signature would refuse
            raise TypeError(f"unknown queue setting {key!r}; the settings are {', '.join(QUEUE_SETTINGS)}")
        if value is None:
            continue
        proto_name = _PROTO_NAMES.get(key, key)
        if key in _DURATIONS:
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
        dedup_window=c.from_duration(info.dedup_window),
        lease_key_ttl=c.from_duration(info.lease_key_ttl),
        failure=info.failure if info.state == queues_pb2.QUEUE_STATE_FAILED else "",
        paused=info.paused,
        produce_paused=info.produce_paused,
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
                failure=(p.failure or "faulty") if p.faulty else "",
                faulty_since=c.optional_timestamp(p, "faulty_since"),
                produced=p.produced,
                completed=p.completed,
                groups_in_flight=p.groups_in_flight,
                oldest_waiting_in_group=(
                    c.from_duration(p.oldest_waiting_in_group) if p.HasField("oldest_waiting_in_group") else None
                ),
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
        metadata=dict(item.metadata),
        message_id=item.message_id,
        dead_reason=dead_reason(item.dead_reason),
        dead_at=c.optional_timestamp(item, "dead_at"),
        dead_attempts=item.dead_attempts,
        last_error=item.last_error,
        last_error_at=c.optional_timestamp(item, "last_error_at"),
        group_key=item.group_key,
        priority=item.priority,
    )


_DEAD_REASONS: dict[int, DeadReason] = {
    queue_pb2.DEAD_REASON_MAX_ATTEMPTS: DeadReason.MAX_ATTEMPTS,
    queue_pb2.DEAD_REASON_EXPIRED: DeadReason.EXPIRED,
    queue_pb2.DEAD_REASON_RETRY_DEAD: DeadReason.RETRY_DEAD,
}
_DEAD_REASON_VALUES = {reason: queue_pb2.DeadReason.Value(f"DEAD_REASON_{reason.name}") for reason in DeadReason}


def dead_reason(value: int) -> DeadReason | None:
    """The SDK's DeadReason of an API value (None: not a dead letter, or a reason this
    SDK does not know yet)."""
    return _DEAD_REASONS.get(value)


def dead_reason_value(reason: DeadReason | str | None) -> queue_pb2.DeadReason.ValueType:
    return _DEAD_REASON_VALUES[DeadReason(reason)] if reason else queue_pb2.DEAD_REASON_UNSPECIFIED


def redrive_request(
    queue_name: str,
    done: RedriveResult,
    token: str,
    *,
    to: str | None,
    kind: str | None,
    dead_reason: DeadReason | str | None,
    limit: int | None,
) -> storage_pb2.RedriveItemsRequest | None:
    """The next RedriveItems call of a redrive that has ``done`` so much, or None when
    ``limit`` items are moved."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    remaining = MAX_BATCH if limit is None else min(MAX_BATCH, limit - done.moved)
    if remaining <= 0:
        return None
    return storage_pb2.RedriveItemsRequest(
        queue_name=queue_name,
        target_queue=to or "",
        kind=kind or "",
        dead_reason=dead_reason_value(dead_reason),
        max_items=remaining,
        page_token=token,
    )


def redrive_progress(done: RedriveResult, response: storage_pb2.RedriveItemsResponse) -> RedriveResult:
    return RedriveResult(
        moved=done.moved + response.moved,
        message_ids=done.message_ids + tuple(response.message_ids),
        skipped=done.skipped + response.skipped,
    )


def storage_item(item: StoredItem | Item | Payload) -> storage_pb2.StorageItem:
    if isinstance(item, Item):
        item = StoredItem(
            payload=c.payload_bytes(item.payload),
            encoding=item.encoding,
            kind=item.kind,
            reference=item.reference,
            enqueue_at=item.enqueue_at,
            metadata=item.metadata,
            priority=item.priority,
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
        message_id=item.message_id,
        dead_reason=dead_reason_value(item.dead_reason),
        dead_attempts=item.dead_attempts,
        last_error=item.last_error,
        priority=item.priority,
    )
    if item.metadata:
        out.metadata.update(item.metadata)
    for name in ("lease_deadline", "expire_deadline", "enqueue_at", "created_at", "dead_at", "last_error_at"):
        value: datetime | None = getattr(item, name)
        if value is not None:
            getattr(out, name).CopyFrom(c.to_timestamp(value))
    return out


def chunks(values: list[Any], size: int = MAX_BATCH) -> Iterator[list[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def extend_result(deadlines: list[datetime], key_items: int) -> ExtendResult:
    out = ExtendResult(deadlines)
    out.key_items_extended = key_items
    return out


# -- keys ----------------------------------------------------------------------------------


def role_value(role: str) -> keys_pb2.Role.ValueType:
    name = role.strip().lower().removeprefix("role_")
    if name not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    return keys_pb2.Role.Value(f"ROLE_{name.upper()}")


def role_name(value: keys_pb2.Role.ValueType) -> str:
    try:
        return keys_pb2.Role.Name(value).removeprefix("ROLE_").lower()
    except ValueError:
        return str(int(value))


def api_key(key: keys_pb2.ApiKey) -> ApiKey:
    return ApiKey(
        key_id=key.key_id,
        role=role_name(key.role),
        queues=list(key.queues),
        description=key.description,
        created_at=c.optional_timestamp(key, "created_at"),
    )


def set_aside_queue(queue: cluster_pb2.SetAsideQueue) -> SetAsideQueue:
    return SetAsideQueue(
        node_id=queue.node_id,
        set_aside_id=queue.set_aside_id,
        queue_name=queue.queue_name,
        items=queue.items,
        reason=queue.reason,
        set_aside_at=c.optional_timestamp(queue, "set_aside_at"),
        partitions=queue.partitions,
    )


def create_key_request(role: str, queues: Iterable[str] | str, description: str) -> keys_pb2.CreateKeyRequest:
    patterns = [queues] if isinstance(queues, str) else list(queues)
    return keys_pb2.CreateKeyRequest(role=role_value(role), queues=patterns, description=description)


def created_key(response: keys_pb2.CreateKeyResponse) -> CreatedKey:
    return CreatedKey(api_key(response.key), response.token)


def cluster_view(response: cluster_pb2.ClusterInfoResponse) -> ClusterView:
    return ClusterView(
        clustered=response.clustered,
        node_id=response.node_id,
        revision=response.revision,
        members=[
            ClusterMember(m.node_id, m.address, m.live, m.fenced, m.check_error) for m in response.members
        ],
        homes={q.queue_name: list(q.homes) for q in response.queues},
        admin_writable=response.admin_writable,
        replicated={
            q.queue_name: ReplicaSet(
                q.primary,
                q.epoch,
                list(q.replicas),
                list(q.in_sync),
                q.min_in_sync,
                q.failover_blocked,
                q.moving_from,
                q.moving_to,
            )
            for q in response.queues
            if q.replicas
        },
    )
