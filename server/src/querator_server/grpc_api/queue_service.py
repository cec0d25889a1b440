"""querator.v1.QueueService: Produce, Lease, Complete, Retry, Extend, and the streams."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message

from querator.v1 import queue_pb2 as pb

from .. import actor as a
from ..auth import Action
from ..clock import now_us
from ..errors import InvalidArgument, QueratorError
from ..logging import get_logger
from ..manager import QueuesManager
from ..model import (
    DEFAULT_WAIT_US,
    MAX_LABEL_BYTES,
    MAX_LEASE_TIMEOUT_US,
    MAX_LONG_DURATION_US,
    MAX_WAIT_US,
    SERVER_UNSENT_BYTES,
    STALL_SECONDS,
    STREAM_UNSENT_BYTES,
    NewItem,
    RetryOrder,
    check_lease_keys,
    cut_error,
)
from ..storage import StorageError
from . import convert as c
from .authz import Guard
from .before_routing import checked_before_routing
from .handlers import generic_handler
from .send_room import LeaseRoom, SendRoom, StreamRoom, current_stream
from .stream_call import Sending

log = get_logger("rpc")

if TYPE_CHECKING:
    from ..cluster.router import Router

SERVICE = "querator.v1.QueueService"

# How long before the caller's deadline a waiting Lease answers (empty), so callers
# see OK rather than DEADLINE_EXCEEDED even when the machine is slow: a fifth of the
# time the call has, at most half a second.
_ANSWER_MARGIN_US = 500_000


def _call_deadline_us(context: grpc.aio.ServicerContext[Any, Any], now: int) -> int:
    remaining = context.time_remaining()
    return 0 if remaining is None else now + int(remaining * 1_000_000)


def _request_deadline_us(request: object, context: grpc.aio.ServicerContext[Any, Any], now: int) -> int:
    timeout = c.optional_duration_us(request, "request_timeout", "request_timeout", maximum_us=MAX_WAIT_US)
    call = _call_deadline_us(context, now)
    own = now + timeout if timeout else 0
    return min(d for d in (own, call) if d) if (own or call) else 0


def check_produce(request: pb.ProduceRequest) -> None:
    """What a Produce is refused for without looking at its queue."""
    if request.payloads:
        if request.items:
            raise InvalidArgument("payloads", "set items or payloads, not both")
        c.count(request.payloads, "payloads")
    else:
        c.count(request.items, "items")


def check_lease(request: pb.LeaseRequest) -> None:
    """What a Lease is refused for without looking at its queue."""
    if not 1 <= request.batch_size <= 1000:
        raise InvalidArgument("batch_size", f"must be between 1 and 1000, got {request.batch_size}")
    c.text(request.client_id, "client_id", MAX_LABEL_BYTES)


class QueueService:
    def __init__(
        self,
        manager: QueuesManager,
        guard: Guard | None = None,
        router: Router | None = None,
        *,
        unsent_bytes: int = SERVER_UNSENT_BYTES,
        stream_unsent_bytes: int = STREAM_UNSENT_BYTES,
        stall_s: float = STALL_SECONDS,
    ) -> None:
        self.manager = manager
        self.guard = guard
        self.router = router  # cluster mode: calls for partitions homed elsewhere are forwarded
        self._stream_readers: set[asyncio.Task[None]] = set()
        # Bytes of LeaseStream answers made and not yet sent, server-wide (a metric).
        self.send_room = SendRoom(unsent_bytes)
        self.lease_sending = Sending(
            self.send_room, self.give_back, stream_limit=stream_unsent_bytes, stall_s=stall_s
        )
        self._giving: set[asyncio.Task[None]] = set()

    def end_streams(self) -> None:
        """End every open stream once what it already sent is answered (shutting down)."""
        for reader in list(self._stream_readers):
            reader.cancel()

    async def produce(self, request: pb.ProduceRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.ProduceResponse:
        name = c.queue_name(request.queue_name)
        check_produce(request)
        if request.payloads:
            produce = a.ProduceRequest([], list(request.payloads))
        else:
            produce = a.ProduceRequest([_new_item(index, item) for index, item in enumerate(request.items)])
        produce.deadline_us = _request_deadline_us(request, context, now_us())
        result: a.ProduceResult = await self.manager.actor(name).submit(produce)
        return pb.ProduceResponse(partition=result.partition, ids=result.ids, duplicates=result.duplicates)

    async def lease(self, request: pb.LeaseRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.LeaseResponse:
        name = c.queue_name(request.queue_name)
        check_lease(request)
        wait = c.optional_duration_us(request, "request_timeout", "request_timeout", maximum_us=MAX_WAIT_US)
        now = now_us()
        call_deadline = _call_deadline_us(context, now)
        # An explicit zero means "answer at once"; unset means "as long as the call allows".
        if not wait and not request.HasField("request_timeout"):
            wait = min(call_deadline - now, MAX_WAIT_US) if call_deadline else DEFAULT_WAIT_US
        wait_until = now + wait
        if call_deadline:
            margin = min(_ANSWER_MARGIN_US, (call_deadline - now) // 5)
            wait_until = min(wait_until, call_deadline - margin)
        complete_ids: list[str] = []
        complete_partition = 0
        if request.complete_ids:
            complete_ids = c.ids(request.complete_ids, "complete_ids")
            complete_partition = c.partition(
                request.complete_partition, self.manager.get(name).partitions, "complete_partition"
            )
        lease = a.LeaseRequest(
            request.batch_size,
            request.client_id,
            wait_until,
            complete_ids,
            complete_partition,
            c.key(request.lease_key, "lease_key"),
            deadline_us=call_deadline,
        )
        stream = current_stream.get()
        if stream is None:
            result: a.LeaseResult = await self.manager.actor(name).submit(lease)
        else:
            result = await self._lease_on_stream(name, lease, stream)
        if request.columnar:
            return _lease_columns(name, result)
        return _lease_response(name, result)

    async def _lease_on_stream(self, name: str, lease: a.LeaseRequest, stream: StreamRoom) -> a.LeaseResult:
        """Lease only what the stream has room to send (send_room.py): without room, wait
        for it and ask again. Room comes as the answers before this one are sent (the
        one sent next always has room on its stream), so the wait ends unless the client
        stops reading, and then the stream is ended; or at the call's deadline."""
        task = asyncio.current_task()
        room = LeaseRoom(stream, task)
        loop = asyncio.get_running_loop()
        until = loop.time() + (lease.deadline_us - now_us()) / 1_000_000 if lease.deadline_us else math.inf
        while True:
            if room.room() <= 0 and not await stream.wait_for_room(task, until):
                return a.LeaseResult(0)
            lease.room = room
            try:
                result: a.LeaseResult = await self.manager.actor(name).submit(lease)
            finally:
                # What the cycles took provisionally; the answer's real size is taken
                # by the stream as soon as it is made.
                stream.give(lease.charged)
                lease.charged = 0
            if not result.no_room:
                return result
            # complete_ids already committed were emptied by the actor: not repeated.
            lease = dataclasses.replace(lease)

    def give_back(self, response: Message, reached: bool) -> None:
        """Give back the items of a Lease answer its stream will never deliver (in a
        cluster, at the node homing them: the answer's partition is cluster-wide)."""
        assert isinstance(response, pb.LeaseResponse)
        if response.columns.ids:
            ids, deadline = list(response.columns.ids), response.columns.lease_deadlines_us[0]
        elif response.items:
            first = response.items[0].lease_deadline
            ids, deadline = [item.id for item in response.items], first.seconds * 1_000_000 + first.nanos // 1000
        else:
            return
        name, partition = response.queue_name, response.partition
        work: Awaitable[object]
        if self.router is None:
            work = self.give_back_here(name, partition, ids, deadline, reached)
        else:
            work = self.router.give_backs.give_back(name, partition, ids, deadline, reached, self.give_back_here)
        task = asyncio.get_running_loop().create_task(self._give_back(name, len(ids), work))
        self._giving.add(task)
        task.add_done_callback(self._giving.discard)

    async def give_back_here(self, name: str, partition: int, ids: list[str], deadline: int, reached: bool) -> int:
        """Give back leased items of this node's ``partition`` (see a.GiveBackRequest)."""
        given: int = await self.manager.actor(name).submit(a.GiveBackRequest(partition, ids, deadline, reached))
        log.info("leases_given_back", queue=name[:200], partition=partition, items=given, new_ids=reached)
        return given

    async def _give_back(self, name: str, items: int, work: Awaitable[object]) -> None:
        try:
            await work
        except (QueratorError, StorageError) as exc:
            # Left leased: they come back when their lease runs out.
            log.warning("give_back_failed", queue=name[:200], items=items, error=str(exc))

    def _partition(self, name: str, partition: int) -> int:
        return c.partition(partition, self.manager.get(name).partitions)

    def _ids_and_keys(self, name: str, request: pb.CompleteRequest | pb.ExtendRequest) -> tuple[list[str], int, list[str]]:
        keys = check_lease_keys(request.lease_keys)
        if keys and not request.ids:
            return [], 0, keys
        return c.ids(request.ids), self._partition(name, request.partition), keys

    async def complete(self, request: pb.CompleteRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.CompleteResponse:
        name = c.queue_name(request.queue_name)
        ids, partition, keys = self._ids_and_keys(name, request)
        deadline = _request_deadline_us(request, context, now_us())
        result: a.CompleteResult = await self.manager.actor(name).submit(
            a.CompleteRequest(partition, ids, keys, deadline_us=deadline)
        )
        return pb.CompleteResponse(already_completed=result.already_completed, key_items_completed=result.key_items_completed)

    async def retry(self, request: pb.RetryRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.RetryResponse:
        name = c.queue_name(request.queue_name)
        c.ids([item.id for item in request.items], "items", template="items[{index}].id")
        partition = self._partition(name, request.partition)
        now = now_us()
        orders = [
            RetryOrder(
                item_id=item.id,
                retry_at_us=c.future_timestamp_us(
                    item, "retry_at", f"items[{index}].retry_at", within_us=MAX_LONG_DURATION_US, now=now
                ),
                dead=item.dead,
                error=cut_error(item.error or request.error),
            )
            for index, item in enumerate(request.items)
        ]
        deadline = _request_deadline_us(request, context, now_us())
        result: a.RetryResult = await self.manager.actor(name).submit(a.RetryRequest(partition, orders, deadline_us=deadline))
        return pb.RetryResponse(dead_ids=result.dead_ids, already_retried=result.already_retried)

    async def extend(self, request: pb.ExtendRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.ExtendResponse:
        name = c.queue_name(request.queue_name)
        ids, partition, keys = self._ids_and_keys(name, request)
        lease_timeout = c.optional_duration_us(request, "lease_timeout", "lease_timeout", maximum_us=MAX_LEASE_TIMEOUT_US)
        deadline = _request_deadline_us(request, context, now_us())
        result: a.ExtendResult = await self.manager.actor(name).submit(
            a.ExtendRequest(partition, ids, lease_timeout, keys, deadline_us=deadline)
        )
        return pb.ExtendResponse(
            lease_deadlines=[c.to_timestamp(d) for d in result.deadlines],
            key_items_extended=result.key_items_extended,
        )

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        methods: dict[str, Any] = {
            "Produce": (self.produce, pb.ProduceRequest, pb.ProduceResponse, Action.PRODUCE),
            "Lease": (self.lease, pb.LeaseRequest, pb.LeaseResponse, Action.CONSUME),
            "Complete": (self.complete, pb.CompleteRequest, pb.CompleteResponse, Action.CONSUME),
            "Retry": (self.retry, pb.RetryRequest, pb.RetryResponse, Action.CONSUME),
            "Extend": (self.extend, pb.ExtendRequest, pb.ExtendResponse, Action.CONSUME),
        }
        if self.router is not None:
            methods = checked_before_routing(
                self.router.route(SERVICE, methods), {"Produce": check_produce, "Lease": check_lease}
            )
        return generic_handler(
            SERVICE,
            methods,
            open_streams=self._stream_readers,
            sending={"LeaseStream": self.lease_sending},
            streams={
                "ProduceStream": (methods["Produce"][0], pb.ProduceStreamRequest, pb.ProduceStreamResponse, Action.PRODUCE),
                "LeaseStream": (methods["Lease"][0], pb.LeaseStreamRequest, pb.LeaseStreamResponse, Action.CONSUME),
            },
            guard=self.guard,
        )


def _new_item(index: int, item: pb.ProduceItem) -> NewItem:
    fields = item.ListFields()
    if len(fields) == 1 and fields[0][0].name == "payload":
        return NewItem(fields[0][1])  # the common case, in half the time of the full one
    c.item_labels(item, f"items[{index}]")
    return NewItem(
        payload=item.payload or item.utf8.encode(),
        encoding=item.encoding,
        kind=item.kind,
        reference=item.reference,
        enqueue_at_us=c.future_timestamp_us(
            item, "enqueue_at", f"items[{index}].enqueue_at", within_us=MAX_LONG_DURATION_US, now=now_us()
        ),
        idempotency_key=c.key(item.idempotency_key, f"items[{index}].idempotency_key"),
        metadata=c.metadata(item.metadata, f"items[{index}].metadata"),
        group_key=c.group_key(item, f"items[{index}].group_key"),
        priority=c.priority(item.priority, f"items[{index}].priority") if item.priority else 0,
    )


def _lease_response(name: str, result: a.LeaseResult) -> pb.LeaseResponse:
    # Filling sub-messages in place costs less than half of building LeaseItem and
    # Timestamp objects and copying them in; this runs for every leased item. The
    # attempts and both timestamps go in as ready wire bytes, one merge per item: a
    # lease's items share their deadline and mostly their attempts, and items produced
    # together their creation time. A creation time becomes bytes from the second item
    # in a row that has it; until then it is set field by field, so items created one
    # by one cost what they did. 100 items: 76-78 µs instead of 117-120 when created
    # in runs of 50, the same (119-132) when each alone (best of 60 rounds of 20).
    response = pb.LeaseResponse(queue_name=name, partition=result.partition)
    add = response.items.add
    details = result.details
    priorities = result.priorities
    shared: dict[tuple[int, int], bytes] = {}  # (attempts, deadline): their bytes
    whole: dict[tuple[int, int, int], bytes] = {}  # (attempts, deadline, created)
    last: tuple[int, int, int] | None = None
    for index, item_id in enumerate(result.ids):
        payload = result.payloads[index]
        detail = details.get(index)
        if detail is not None:
            out = add(
                id=item_id,
                encoding=detail.encoding,
                kind=detail.kind,
                reference=detail.reference,
                payload=payload,
                message_id=detail.message_id or item_id,
                source_id=detail.source_id,
                group_key=detail.group_key,
            )
            if detail.metadata:
                out.metadata.update(detail.metadata)
            if detail.dead_reason:
                out.dead_reason = detail.dead_reason  # type: ignore[assignment]
                out.dead_attempts = detail.dead_attempts
                out.dead_at.seconds, micros = divmod(detail.dead_at, 1_000_000)
                out.dead_at.nanos = micros * 1000
            if detail.last_error:
                out.last_error = detail.last_error
                out.last_error_at.seconds, micros = divmod(detail.last_error_at, 1_000_000)
                out.last_error_at.nanos = micros * 1000
        else:  # most items: fewer keyword arguments to parse
            out = add(id=item_id, payload=payload, message_id=item_id)
        if priorities and priorities[index]:
            out.priority = priorities[index]
        key = (result.attempts[index], result.lease_deadlines[index], result.created_at[index])
        stamps = whole.get(key)
        if stamps is None and key == last:
            stamps = whole[key] = _item_stamps(*key)
        if stamps is not None:
            out.MergeFromString(stamps)
            continue
        last = key
        attempts, deadline_us, created_us = key
        stamps = shared.get((attempts, deadline_us))
        if stamps is None:
            stamps = shared[(attempts, deadline_us)] = _item_stamps(attempts, deadline_us, None)
        out.MergeFromString(stamps)
        created = out.created_at
        created.seconds, micros = divmod(created_us, 1_000_000)
        created.nanos = micros * 1000
    return response


def _item_stamps(attempts: int, deadline_us: int, created_us: int | None) -> bytes:
    """A LeaseItem's attempts, lease deadline and (if given) creation time, as wire bytes."""
    item = pb.LeaseItem(attempts=attempts, lease_deadline=c.to_timestamp(deadline_us))
    if created_us is not None:
        item.created_at.CopyFrom(c.to_timestamp(created_us))
    return item.SerializeToString()


def _lease_columns(name: str, result: a.LeaseResult) -> pb.LeaseResponse:
    # Repeated scalar fields take whole lists in C: no message per item. Filled in
    # place: a LeaseColumns built apart would be copied into the response (18 µs of
    # the 30 a 100-item reply took).
    response = pb.LeaseResponse(queue_name=name, partition=result.partition)
    columns = response.columns
    columns.ids.extend(result.ids)
    columns.payloads.extend(result.payloads)
    columns.attempts.extend(result.attempts)
    columns.lease_deadlines_us.extend(result.lease_deadlines)
    columns.created_at_us.extend(result.created_at)
    if result.priorities:
        columns.priorities.extend(result.priorities)
    details = result.details
    if details:
        indexes = range(len(result.ids))
        for attribute, column in (
            ("encoding", columns.encodings),
            ("kind", columns.kinds),
            ("reference", columns.references),
            ("group_key", columns.group_keys),
        ):
            if any(getattr(detail, attribute) for detail in details.values()):
                column.extend([getattr(details[i], attribute) if i in details else "" for i in indexes])
        if any(detail.metadata for detail in details.values()):
            for i in indexes:
                entries = columns.metadata.add().entries
                if i in details:
                    entries.update(details[i].metadata)
        if any(detail.message_id for detail in details.values()):
            ids = result.ids
            columns.message_ids.extend([(details[i].message_id if i in details else "") or ids[i] for i in indexes])
        if any(detail.source_id for detail in details.values()):
            columns.source_ids.extend([details[i].source_id if i in details else "" for i in indexes])
        if any(detail.dead_reason for detail in details.values()):
            dead = [details.get(i) for i in indexes]
            columns.dead_reasons.extend([d.dead_reason if d else 0 for d in dead])  # type: ignore[misc]
            columns.dead_at_us.extend([d.dead_at if d else 0 for d in dead])
            columns.dead_attempts.extend([d.dead_attempts if d else 0 for d in dead])
        if any(detail.last_error for detail in details.values()):
            failed = [details.get(i) for i in indexes]
            columns.last_errors.extend([d.last_error if d else "" for d in failed])
            columns.last_error_at_us.extend([d.last_error_at if d and d.last_error else 0 for d in failed])
    return response
