"""querator.v1.StorageService: list, import and delete stored items."""

from __future__ import annotations

import asyncio
import struct
from typing import TYPE_CHECKING, Any

import grpc

from querator.v1 import queue_pb2
from querator.v1 import storage_pb2 as pb

from .. import actor as a
from ..auth import Action
from ..clock import now_us
from ..errors import InvalidArgument
from ..manager import QueuesManager
from ..model import (
    MAX_BATCH,
    MAX_LABEL_BYTES,
    MAX_LEASE_TIMEOUT_US,
    MAX_LONG_DURATION_US,
    NEVER_US,
    REPLY_ITEMS_BYTES,
    ImportedItem,
    cut_error,
)
from . import convert as c
from .authz import Guard, current_principal
from .before_routing import checked_before_routing
from .handlers import generic_handler

if TYPE_CHECKING:
    from ..cluster.router import Router

SERVICE = "querator.v1.StorageService"

_CURSOR = struct.Struct(">QIQQ")  # queue uid, partition, then (seq, 0) or (due, seq)
_MAX_CURSOR = 1 << 63  # seqs and times in µs stay below it


def storage_item(stored: a.StoredItem) -> pb.StorageItem:
    item = stored.item
    ts = c.to_timestamp
    out = pb.StorageItem(
        id=stored.item_id,
        is_leased=item.is_leased,
        created_at=ts(item.created_at),
        attempts=item.attempts,
        reference=item.reference,
        encoding=item.encoding,
        kind=item.kind,
        payload=item.payload,
        source_id=item.source_id,
        metadata=item.metadata,
        message_id=item.message_id or stored.item_id,
        dead_reason=item.dead_reason,  # type: ignore[arg-type]
        dead_attempts=item.dead_attempts,
        group_key=item.group_key,
        priority=item.priority,
    )
    if item.expire_deadline < NEVER_US:  # unset: it never expires
        out.expire_deadline.CopyFrom(ts(item.expire_deadline))
    if item.dead_at:
        out.dead_at.CopyFrom(ts(item.dead_at))
    if item.is_leased:
        out.lease_deadline.CopyFrom(ts(item.lease_deadline))
    if item.enqueue_at:
        out.enqueue_at.CopyFrom(ts(item.enqueue_at))
    if item.last_error:
        out.last_error = item.last_error
        out.last_error_at.CopyFrom(ts(item.last_error_at))
    return out


class StorageService:
    def __init__(self, manager: QueuesManager, guard: Guard | None = None, router: Router | None = None) -> None:
        self.manager = manager
        self.guard = guard
        self.router = router  # cluster mode: each call goes to its partition's home

    async def _list(
        self,
        request: pb.ListItemsRequest | pb.ListScheduledItemsRequest,
        *,
        scheduled: bool,
    ) -> tuple[list[pb.StorageItem], str]:
        name = c.queue_name(request.queue_name)
        config = self.manager.get(name)
        partition = c.partition(request.partition, config.partitions)
        limit = c.page_size(request.page_size)
        kind = b"S" if scheduled else b"I"
        after = (0, -1) if scheduled else (0, 0)
        if request.page_token:
            raw = c.decode_token(self.manager.token_secret, request.page_token, kind)
            if len(raw) != _CURSOR.size:
                raise InvalidArgument("page_token", "is not a page token this server issued")
            uid, token_partition, first, second = _CURSOR.unpack(raw)
            if uid != config.uid or token_partition != partition:
                raise InvalidArgument("page_token", "was issued for another queue or partition")
            # Signed, so only ever what a page ended on; checked all the same, since
            # these become storage keys (seq + 1 must still fit).
            if not (first < _MAX_CURSOR and second < _MAX_CURSOR and (scheduled or second == 0)):
                raise InvalidArgument("page_token", "is not a page token this server issued")
            after = (first, second)
        page: a.PageResult = await self.manager.actor(name).submit(
            a.ListItemsRequest(partition, limit, after, scheduled)
        )
        # The page was cut by an estimate of each item's size; this is the exact cut, in
        # case an item's reply entry holds more than the estimate allowed for.
        items: list[pb.StorageItem] = []
        next_after = page.next_after
        size = 0
        for index, stored in enumerate(page.items):
            item = storage_item(stored)
            size += item.ByteSize() + 8  # with its tag and length in the reply
            if size > REPLY_ITEMS_BYTES and items:
                next_after = page.cursors[index - 1]
                break
            items.append(item)
        token = ""
        if next_after is not None:
            token = c.encode_token(self.manager.token_secret, kind, _CURSOR.pack(config.uid, partition, *next_after))
        return items, token

    async def list_items(self, request: pb.ListItemsRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.ListItemsResponse:
        items, token = await self._list(request, scheduled=False)
        return pb.ListItemsResponse(items=items, next_page_token=token)

    async def list_scheduled_items(
        self, request: pb.ListScheduledItemsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListScheduledItemsResponse:
        items, token = await self._list(request, scheduled=True)
        return pb.ListScheduledItemsResponse(items=items, next_page_token=token)

    async def import_items(
        self, request: pb.ImportItemsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ImportItemsResponse:
        name = c.queue_name(request.queue_name)
        partition = c.partition(request.partition, self.manager.get(name).partitions)
        c.count(request.items, "items")
        items: list[ImportedItem] = []
        now = now_us()
        for index, item in enumerate(request.items):
            field = f"items[{index}]"
            if item.attempts < 0:
                raise InvalidArgument(f"{field}.attempts", "must not be negative")
            c.item_labels(item, field)
            if item.dead_attempts < 0:
                raise InvalidArgument(f"{field}.dead_attempts", "must not be negative")
            if item.dead_reason not in queue_pb2.DeadReason.values():
                raise InvalidArgument(f"{field}.dead_reason", f"is not a known DeadReason: {item.dead_reason}")
            error = cut_error(item.last_error)
            error_at = c.optional_timestamp_us(item, "last_error_at", f"{field}.last_error_at") if error else 0
            items.append(
                ImportedItem(
                    payload=item.payload,
                    encoding=item.encoding,
                    kind=item.kind,
                    reference=item.reference,
                    is_leased=item.is_leased,
                    lease_deadline_us=c.future_timestamp_us(
                        item, "lease_deadline", f"{field}.lease_deadline", within_us=MAX_LEASE_TIMEOUT_US, now=now
                    ),
                    expire_deadline_us=c.future_timestamp_us(
                        item, "expire_deadline", f"{field}.expire_deadline", within_us=MAX_LONG_DURATION_US, now=now
                    ),
                    enqueue_at_us=c.future_timestamp_us(
                        item, "enqueue_at", f"{field}.enqueue_at", within_us=MAX_LONG_DURATION_US, now=now
                    ),
                    created_at_us=c.optional_timestamp_us(item, "created_at", f"{field}.created_at"),
                    attempts=item.attempts,
                    source_id=c.source_id(item.source_id, f"{field}.source_id"),
                    metadata=c.metadata(item.metadata, f"{field}.metadata"),
                    message_id=c.source_id(item.message_id, f"{field}.message_id"),
                    dead_reason=item.dead_reason,
                    dead_at_us=c.optional_timestamp_us(item, "dead_at", f"{field}.dead_at"),
                    dead_attempts=item.dead_attempts,
                    last_error=error,
                    last_error_at_us=error_at or (now if error else 0),
                    priority=c.priority(item.priority, f"{field}.priority"),
                )
            )
        ids: list[str] = await self.manager.actor(name).submit(a.ImportItemsRequest(partition, items))
        return pb.ImportItemsResponse(ids=ids)

    async def delete_items(
        self, request: pb.DeleteItemsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteItemsResponse:
        name = c.queue_name(request.queue_name)
        partition = c.partition(request.partition, self.manager.get(name).partitions)
        ids = c.ids(request.ids)
        await self.manager.actor(name).submit(a.DeleteItemsRequest(partition, ids))
        return pb.DeleteItemsResponse()

    async def redrive_items(
        self, request: pb.RedriveItemsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RedriveItemsResponse:
        name = c.queue_name(request.queue_name)
        limit = request.max_items or MAX_BATCH
        if not 1 <= limit <= MAX_BATCH:
            raise InvalidArgument("max_items", f"must be between 1 and {MAX_BATCH}, got {request.max_items}")
        if request.dead_reason not in queue_pb2.DeadReason.values():
            raise InvalidArgument("dead_reason", f"is not a known DeadReason: {request.dead_reason}")
        c.text(request.kind, "kind", MAX_LABEL_BYTES)
        if request.target_queue and c.queue_name(request.target_queue, "target_queue") == name:
            raise InvalidArgument("target_queue", "must not be the queue the items come from")
        if self.router is None:
            return await self._redrive_here(request, context)
        # A cluster: the redrive runs on each node homing the queue; its page token
        # says which node goes on (a forwarded call's is that node's own).
        token = None
        if request.page_token and not self.router.is_forwarded(context):
            token = c.decode_token(self.manager.token_secret, request.page_token, b"N")
        response, rest = await self.router.redrive(request, limit, token, context, self._redrive_here)
        if rest is not None:
            response.next_page_token = c.encode_token(self.manager.token_secret, b"N", rest)
        return response

    async def _redrive_here(
        self, request: pb.RedriveItemsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RedriveItemsResponse:
        """The redrive of this server's queue (on a cluster: this node's part of it)."""
        name = c.queue_name(request.queue_name)
        config = self.manager.get(name)
        limit = request.max_items or MAX_BATCH
        after = (0, 0)
        if request.page_token:
            raw = c.decode_token(self.manager.token_secret, request.page_token, b"R")
            if len(raw) != _CURSOR.size:
                raise InvalidArgument("page_token", "is not a page token this server issued")
            uid, partition, seq, _ = _CURSOR.unpack(raw)
            if uid != config.uid or partition >= config.partitions:
                raise InvalidArgument("page_token", "was issued for another queue")
            if seq >= 2**64 - 1:  # seq + 1 becomes a storage key
                raise InvalidArgument("page_token", "is not a page token this server issued")
            after = (partition, seq)
        target_uid = 0
        if request.target_queue:
            target = c.queue_name(request.target_queue, "target_queue")
            target_uid = self.manager.uid_of(target)
            targets = {target_uid: target}
            own_prefix, own = "", dict[int, str]()
        else:
            principal = current_principal.get()
            visible = None if principal is None else principal.matches
            targets = self.manager.queues_by_uid(visible, config)
            own_prefix, own = self.manager.own_sources(visible, config)
        actor = self.manager.actor(name)
        result: a.RedriveResult = await actor.submit(
            a.RedriveRequest(
                targets,
                limit,
                after,
                kind=request.kind,
                dead_reason=request.dead_reason,
                target_uid=target_uid,
                own_prefix=own_prefix,
                own=own,
            )
        )
        # Answer once the items are stored in their targets and gone from here.
        if result.delivered is not None:
            await asyncio.shield(result.delivered)
        token = ""
        if result.next_after is not None:
            token = c.encode_token(self.manager.token_secret, b"R", _CURSOR.pack(config.uid, result.next_after[0], result.next_after[1], 0))
        return pb.RedriveItemsResponse(
            moved=len(result.message_ids), message_ids=result.message_ids, skipped=result.skipped, next_page_token=token
        )

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        methods: dict[str, Any] = {
                "ListItems": (self.list_items, pb.ListItemsRequest, pb.ListItemsResponse, Action.ADMIN),
                "ListScheduledItems": (
                    self.list_scheduled_items,
                    pb.ListScheduledItemsRequest,
                    pb.ListScheduledItemsResponse, Action.ADMIN),
                "ImportItems": (self.import_items, pb.ImportItemsRequest, pb.ImportItemsResponse, Action.ADMIN),
                "DeleteItems": (self.delete_items, pb.DeleteItemsRequest, pb.DeleteItemsResponse, Action.ADMIN),
                "RedriveItems": (self.redrive_items, pb.RedriveItemsRequest, pb.RedriveItemsResponse, Action.ADMIN),
        }
        if self.router is not None:
            methods = checked_before_routing(self.router.route(SERVICE, methods))
        return generic_handler(SERVICE, methods, guard=self.guard)
