"""Each client call as a generator: the calls to make in order, then the result.

This is the sans-IO core both clients share. An operation yields a :class:`Call` (the
RPC, its request, its deadline and whether it may be repeated) and is sent the reply;
what it returns is the method's result. :class:`~querator.Client` drives operations
with blocking calls and :class:`~querator.AsyncClient` with awaited ones (their
transports, ``_transport.py``), so the rules of each call (how it is split in
requests, what is retried, what a reply means) are written once, here.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias, TypeVar

from google.protobuf.message import Message

from . import _protocol as p
from ._config import ClientConfig
from ._convert import Seconds
from ._items import COMPLETED, DEAD, RETRIED
from ._models import (
    ApiKey,
    ClusterView,
    CompleteResult,
    CreatedKey,
    DeadReason,
    ExtendResult,
    Item,
    Page,
    Payload,
    PromotedCopy,
    QueueInfo,
    QueueStats,
    RedriveResult,
    ReplicaSet,
    RetiredNode,
    RetryResult,
    SetAsideQueue,
    SetAsideQueues,
    StoredItem,
)
from .errors import QueratorError
from .v1 import cluster_pb2, keys_pb2, queue_pb2, queues_pb2, storage_pb2

T = TypeVar("T")

# The gRPC services, by the name a Call gives them.
QUEUE, QUEUES, STORAGE, KEYS, CLUSTER = "queue", "queues", "storage", "keys", "cluster"


@dataclass(frozen=True, slots=True)
class Call:
    """One RPC to make: ``service`` (QUEUE, ...) and ``method`` name the stub's method.

    ``retry``: safe to repeat after a failure the client's retry policy accepts;
    ``item_call``/``key_call`` tell the error mapping what NOT_FOUND means.
    """

    service: str
    method: str
    request: Message
    timeout: float
    retry: bool
    item_call: bool = False
    key_call: bool = False


Operation: TypeAlias = Generator[Call, Any, T]
# (item, retry at, dead, error text)
RetryOrder: TypeAlias = tuple[p.Ref, datetime | None, bool, str]


# -- QueueService --------------------------------------------------------------------------


def produce_call(request: queue_pb2.ProduceRequest, timeout: float, retry: bool) -> Call:
    """One Produce request; repeated after UNAVAILABLE when ``retry`` or when every item
    carries an idempotency key (a repeat then stores nothing twice)."""
    keyed = bool(request.items) and p.all_keyed(list(request.items))
    return Call(QUEUE, "Produce", request, timeout, retry or keyed)


def lease(
    config: ClientConfig,
    make: Callable[..., T],
    queue_name: str,
    batch_size: int,
    wait: Seconds,
    client_id: str,
    complete: p.ItemsArg | None,
    lease_key: str,
) -> Operation[list[T]]:
    """Lease, each item made by ``make(**fields)``. A Lease that completes items first is
    repeated as a Complete is (``retry_complete``): the server answers its ids as done
    the second time."""
    completing = p.lease_completions(queue_name, complete)
    request, wait_s = p.lease_request(queue_name, batch_size, wait, client_id, completing, lease_key)
    deadline = wait_s + config.lease_margin.total_seconds()
    again = config.retry_complete or not completing
    response = yield Call(QUEUE, "Lease", request, deadline, again, item_call=bool(completing))
    p.mark(completing, COMPLETED)
    return [make(**fields) for fields in p.leased_fields(response)]


def complete(
    config: ClientConfig,
    items: p.ItemsArg,
    lease_keys: Iterable[str] | str | None,
    queue_name: str | None,
    timeout: Seconds | None,
) -> Operation[CompleteResult]:
    call_timeout = config.call_timeout(timeout)
    already: list[str] = []
    key_items = 0
    for queue, partition, members in p.group_refs(items):
        request = p.complete_request(queue, partition, members, call_timeout)
        # Sent again, ids the first send completed are answered as done (already_completed).
        response = yield Call(QUEUE, "Complete", request, call_timeout, config.retry_complete, item_call=True)
        p.mark(members, COMPLETED)
        already.extend(response.already_completed)
    queue, key_chunks = p.lease_keys(lease_keys, queue_name)
    for keys in key_chunks:
        request = p.complete_keys_request(queue, keys, call_timeout)
        response = yield Call(QUEUE, "Complete", request, call_timeout, True, item_call=True)
        key_items += response.key_items_completed
    return CompleteResult(tuple(already), key_items)


def retry(config: ClientConfig, orders: list[RetryOrder], timeout: Seconds | None) -> Operation[RetryResult]:
    """Retry requests per (queue, partition) and 1,000 items; returns the ids the server
    dead-lettered (sent with dead=True, or out of attempts) with those an earlier send
    had retried already, and marks each item."""
    call_timeout = config.call_timeout(timeout)
    grouped: dict[tuple[str, int], list[RetryOrder]] = {}
    for order in orders:
        grouped.setdefault((order[0].queue_name, order[0].partition), []).append(order)
    out = RetryResult()
    already: list[str] = []
    for (queue, partition), group in grouped.items():
        for chunk in p.chunks(group):
            request = p.retry_request(queue, partition, chunk, call_timeout)
            # Sent again, ids the first send retried are answered as done (already_retried).
            response = yield Call(QUEUE, "Retry", request, call_timeout, config.retry_complete, item_call=True)
            dead = set(response.dead_ids)
            for ref, *_ in chunk:
                p.mark([ref], DEAD if ref.id in dead else RETRIED)
            out.extend(response.dead_ids)
            already.extend(response.already_retried)
    out.already_retried = tuple(already)
    return out


def extend(
    config: ClientConfig,
    items: p.ItemsArg,
    lease_timeout: Seconds | None,
    lease_keys: Iterable[str] | str | None,
    queue_name: str | None,
    timeout: Seconds | None,
) -> Operation[ExtendResult]:
    call_timeout = config.call_timeout(timeout)
    out: list[datetime] = []
    key_items = 0
    for queue, partition, members in p.group_refs(items):
        request = p.extend_request(queue, partition, members, lease_timeout, call_timeout)
        response = yield Call(QUEUE, "Extend", request, call_timeout, True, item_call=True)
        out.extend(p.apply_deadlines(members, response))
    queue, key_chunks = p.lease_keys(lease_keys, queue_name)
    for keys in key_chunks:
        request = p.extend_request(queue, 0, [], lease_timeout, call_timeout, keys)
        response = yield Call(QUEUE, "Extend", request, call_timeout, True, item_call=True)
        key_items += response.key_items_extended
    return p.extend_result(out, key_items)


# -- QueuesService -------------------------------------------------------------------------


def create_queue(config: ClientConfig, name: str, settings: Mapping[str, Any], timeout: Seconds | None) -> Operation[QueueInfo]:
    info, _ = p.queue_info_message(name, settings)
    request = queues_pb2.CreateQueueRequest(queue=info)
    response = yield Call(QUEUES, "CreateQueue", request, config.call_timeout(timeout), False)
    return p.queue_info(response.queue)


def get_queue(config: ClientConfig, name: str, timeout: Seconds | None) -> Operation[QueueInfo]:
    request = queues_pb2.GetQueueRequest(queue_name=name)
    response = yield Call(QUEUES, "GetQueue", request, config.call_timeout(timeout), True)
    return p.queue_info(response.queue)


def list_queues(config: ClientConfig, page_size: int, timeout: Seconds | None) -> Callable[[str], Operation[Page[QueueInfo]]]:
    """The operation that fetches the page at a token."""
    call_timeout = config.call_timeout(timeout)

    def page(token: str) -> Operation[Page[QueueInfo]]:
        request = queues_pb2.ListQueuesRequest(page_size=page_size, page_token=token)
        response = yield Call(QUEUES, "ListQueues", request, call_timeout, True)
        return Page([p.queue_info(q) for q in response.queues], response.next_page_token)

    return page


def update_queue(config: ClientConfig, name: str, settings: Mapping[str, Any], timeout: Seconds | None) -> Operation[QueueInfo]:
    info, paths = p.queue_info_message(name, settings)
    if not paths:
        raise ValueError("update_queue needs at least one setting to change")
    request = queues_pb2.UpdateQueueRequest(queue=info, update_mask=p.update_mask(paths))
    response = yield Call(QUEUES, "UpdateQueue", request, config.call_timeout(timeout), True)
    return p.queue_info(response.queue)


def pause_queue(config: ClientConfig, name: str, produce: bool, timeout: Seconds | None) -> Operation[QueueInfo]:
    request = queues_pb2.PauseQueueRequest(queue_name=name, produce=produce)
    # Pausing twice is pausing once: safe to retry.
    response = yield Call(QUEUES, "PauseQueue", request, config.call_timeout(timeout), True)
    return p.queue_info(response.queue)


def resume_queue(config: ClientConfig, name: str, timeout: Seconds | None) -> Operation[QueueInfo]:
    request = queues_pb2.ResumeQueueRequest(queue_name=name)
    response = yield Call(QUEUES, "ResumeQueue", request, config.call_timeout(timeout), True)
    return p.queue_info(response.queue)


def delete_queue(config: ClientConfig, name: str, force: bool, timeout: Seconds | None) -> Operation[None]:
    request = queues_pb2.DeleteQueueRequest(queue_name=name, force=force)
    yield Call(QUEUES, "DeleteQueue", request, config.call_timeout(timeout), False)


def clear_queue(
    config: ClientConfig, name: str, ready: bool, scheduled: bool, destructive: bool, timeout: Seconds | None
) -> Operation[None]:
    request = queues_pb2.ClearQueueRequest(queue_name=name, queue=ready, scheduled=scheduled, destructive=destructive)
    yield Call(QUEUES, "ClearQueue", request, config.call_timeout(timeout), True)


def queue_stats(config: ClientConfig, name: str, timeout: Seconds | None) -> Operation[QueueStats]:
    request = queues_pb2.GetQueueStatsRequest(queue_name=name)
    response = yield Call(QUEUES, "GetQueueStats", request, config.call_timeout(timeout), True)
    return p.queue_stats(response)


# -- StorageService ------------------------------------------------------------------------


def list_items(
    config: ClientConfig, queue_name: str, partition: int, page_size: int, timeout: Seconds | None, *, scheduled: bool
) -> Callable[[str], Operation[Page[StoredItem]]]:
    """The operation that fetches the page at a token: ready and leased items in FIFO
    order, or (``scheduled``) scheduled items by due time."""
    call_timeout = config.call_timeout(timeout)
    method, message = (
        ("ListScheduledItems", storage_pb2.ListScheduledItemsRequest) if scheduled else ("ListItems", storage_pb2.ListItemsRequest)
    )

    def page(token: str) -> Operation[Page[StoredItem]]:
        request = message(queue_name=queue_name, partition=partition, page_size=page_size, page_token=token)
        response = yield Call(STORAGE, method, request, call_timeout, True)
        return Page([p.stored_item(i, partition) for i in response.items], response.next_page_token)

    return page


def import_items(
    config: ClientConfig, queue_name: str, items: Iterable[StoredItem | Item | Payload], partition: int, timeout: Seconds | None
) -> Operation[list[str]]:
    call_timeout = config.call_timeout(timeout)
    ids: list[str] = []
    for chunk in p.chunks([p.storage_item(i) for i in items]):
        request = storage_pb2.ImportItemsRequest(queue_name=queue_name, partition=partition, items=chunk)
        response = yield Call(STORAGE, "ImportItems", request, call_timeout, False)
        ids.extend(response.ids)
    return ids


def redrive_items(
    config: ClientConfig,
    queue_name: str,
    to: str | None,
    kind: str | None,
    dead_reason: DeadReason | str | None,
    limit: int | None,
    timeout: Seconds | None,
) -> Operation[RedriveResult]:
    """RedriveItems page by page until nothing matches or ``limit`` items moved; not
    repeated after a failure (a repeat would move further items). A failure after
    earlier calls moved items carries them as ``.redriven``."""
    call_timeout = config.call_timeout(timeout)
    done, token = RedriveResult(), ""
    while True:
        request = p.redrive_request(queue_name, done, token, to=to, kind=kind, dead_reason=dead_reason, limit=limit)
        if request is None:
            return done
        try:
            response = yield Call(STORAGE, "RedriveItems", request, call_timeout, False)
        except QueratorError as exc:
            exc.redriven = done if done.moved else None
            raise
        done, token = p.redrive_progress(done, response), response.next_page_token
        if not token:
            return done


def delete_items(
    config: ClientConfig, queue_name: str, ids: Iterable[str], partition: int, timeout: Seconds | None
) -> Operation[None]:
    call_timeout = config.call_timeout(timeout)
    for chunk in p.chunks(list(ids)):
        request = storage_pb2.DeleteItemsRequest(queue_name=queue_name, partition=partition, ids=chunk)
        yield Call(STORAGE, "DeleteItems", request, call_timeout, True)


# -- KeysService ---------------------------------------------------------------------------


def create_key(
    config: ClientConfig, role: str, queues: Iterable[str] | str, description: str, timeout: Seconds | None
) -> Operation[CreatedKey]:
    request = p.create_key_request(role, queues, description)
    response = yield Call(KEYS, "CreateKey", request, config.call_timeout(timeout), False, key_call=True)
    return p.created_key(response)


def list_keys(config: ClientConfig, timeout: Seconds | None) -> Operation[list[ApiKey]]:
    response = yield Call(KEYS, "ListKeys", keys_pb2.ListKeysRequest(), config.call_timeout(timeout), True, key_call=True)
    return [p.api_key(k) for k in response.keys]


# -- ClusterService: queues set aside -------------------------------------------------------


def list_set_aside_queues(config: ClientConfig, node_id: str, timeout: Seconds | None) -> Operation[SetAsideQueues]:
    request = cluster_pb2.ListSetAsideQueuesRequest(node_id=node_id)
    response = yield Call(CLUSTER, "ListSetAsideQueues", request, config.call_timeout(timeout), True)
    return SetAsideQueues([p.set_aside_queue(q) for q in response.queues], list(response.unanswered_nodes))


def remove_set_aside_queue(
    config: ClientConfig, node_id: str, set_aside_id: str, timeout: Seconds | None
) -> Operation[SetAsideQueue]:
    request = cluster_pb2.RemoveSetAsideQueueRequest(node_id=node_id, set_aside_id=set_aside_id)
    response = yield Call(CLUSTER, "RemoveSetAsideQueue", request, config.call_timeout(timeout), False)
    return p.set_aside_queue(response.removed)


def revoke_key(config: ClientConfig, key_id: str, timeout: Seconds | None) -> Operation[None]:
    request = keys_pb2.RevokeKeyRequest(key_id=key_id)
    yield Call(KEYS, "RevokeKey", request, config.call_timeout(timeout), False, key_call=True)


# -- ClusterService ------------------------------------------------------------------------


def cluster_info(config: ClientConfig, check_members: bool, timeout: Seconds | None) -> Operation[ClusterView]:
    request = cluster_pb2.ClusterInfoRequest(check_members=check_members)
    response = yield Call(CLUSTER, "ClusterInfo", request, config.call_timeout(timeout), True)
    return p.cluster_view(response)


def move_queue(
    config: ClientConfig, queue: str, node_id: str, timeout: Seconds | None, from_node_id: str = ""
) -> Operation[ReplicaSet]:
    request = cluster_pb2.MoveQueueRequest(queue_name=queue, node_id=node_id, from_node_id=from_node_id)
    response = yield Call(CLUSTER, "MoveQueue", request, config.call_timeout(timeout), False)
    q = response.placement
    return ReplicaSet(
        q.primary, q.epoch, list(q.replicas), list(q.in_sync), q.min_in_sync, q.failover_blocked, q.moving_from, q.moving_to
    )


def drain_node(config: ClientConfig, node_id: str, timeout: Seconds | None) -> Operation[tuple[list[str], list[str]]]:
    request = cluster_pb2.DrainNodeRequest(node_id=node_id)
    response = yield Call(CLUSTER, "DrainNode", request, config.call_timeout(timeout), False)
    return list(response.moved), list(response.kept)


def retire_node_discarding_data(config: ClientConfig, node_id: str, timeout: Seconds | None) -> Operation[int]:
    retired = yield from retire_node(config, node_id, False, timeout)
    return retired.partitions_recreated


def retire_node(config: ClientConfig, node_id: str, promote_copies_behind: bool, timeout: Seconds | None) -> Operation[RetiredNode]:
    request = cluster_pb2.RetireNodeDiscardingDataRequest(node_id=node_id, promote_copies_behind=promote_copies_behind)
    response = yield Call(CLUSTER, "RetireNodeDiscardingData", request, config.call_timeout(timeout), False)
    return RetiredNode(
        int(response.partitions_recreated),
        int(response.copies_recreated),
        [PromotedCopy(c.queue_name, c.node_id, c.epoch, c.lsn, c.new_epoch) for c in response.copies_promoted],
    )
