"""The gRPC calls the console makes, through the SDK's transport, answering protobuf messages.

The console reads the messages themselves (not the SDK's models) so a field a newer
server sends (an item's ``last_error``, say) shows as soon as the generated code knows
it, and every call goes through the SDK's routing, retries, TLS and key handling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._async_client import AsyncClient
from .._operations import CLUSTER, QUEUES, STORAGE, Call
from ..v1 import cluster_pb2, queue_pb2, queues_pb2, storage_pb2

# Calls made while a page is drawn; a page never waits longer than this for one.
CALL_TIMEOUT = 10.0


class Api:
    """One key's view of the server: every call carries the key of the client given."""

    def __init__(self, client: AsyncClient, timeout: float = CALL_TIMEOUT) -> None:
        self.client = client
        self.timeout = timeout

    async def _call(self, service: str, method: str, request: Any, retry: bool) -> Any:
        return await self.client._transport.invoke(Call(service, method, request, self.timeout, retry))

    async def list_queues(self, page_size: int, page_token: str = "") -> queues_pb2.ListQueuesResponse:
        request = queues_pb2.ListQueuesRequest(page_size=page_size, page_token=page_token)
        reply: queues_pb2.ListQueuesResponse = await self._call(QUEUES, "ListQueues", request, True)
        return reply

    async def get_queue(self, name: str) -> queues_pb2.QueueInfo:
        reply = await self._call(QUEUES, "GetQueue", queues_pb2.GetQueueRequest(queue_name=name), True)
        info: queues_pb2.QueueInfo = reply.queue
        return info

    async def stats(self, name: str) -> queues_pb2.GetQueueStatsResponse:
        request = queues_pb2.GetQueueStatsRequest(queue_name=name)
        reply: queues_pb2.GetQueueStatsResponse = await self._call(QUEUES, "GetQueueStats", request, True)
        return reply

    async def list_items(
        self, name: str, partition: int, page_size: int, page_token: str = "", *, scheduled: bool = False
    ) -> storage_pb2.ListItemsResponse | storage_pb2.ListScheduledItemsResponse:
        if scheduled:
            sched = storage_pb2.ListScheduledItemsRequest(
                queue_name=name, partition=partition, page_size=page_size, page_token=page_token
            )
            return await self._call(STORAGE, "ListScheduledItems", sched, True)  # type: ignore[no-any-return]
        request = storage_pb2.ListItemsRequest(queue_name=name, partition=partition, page_size=page_size, page_token=page_token)
        return await self._call(STORAGE, "ListItems", request, True)  # type: ignore[no-any-return]

    async def delete_items(self, name: str, partition: int, ids: Sequence[str]) -> None:
        request = storage_pb2.DeleteItemsRequest(queue_name=name, partition=partition, ids=list(ids))
        await self._call(STORAGE, "DeleteItems", request, True)

    async def import_items(self, name: str, items: Sequence[storage_pb2.StorageItem]) -> list[str]:
        request = storage_pb2.ImportItemsRequest(queue_name=name, partition=0, items=list(items))
        reply: storage_pb2.ImportItemsResponse = await self._call(STORAGE, "ImportItems", request, False)
        return list(reply.ids)

    async def redrive(
        self, name: str, *, target: str, kind: str, reason: int, max_items: int, page_token: str
    ) -> storage_pb2.RedriveItemsResponse:
        request = storage_pb2.RedriveItemsRequest(
            queue_name=name,
            target_queue=target,
            kind=kind,
            dead_reason=reason,  # type: ignore[arg-type]
            max_items=max_items,
            page_token=page_token,
        )
        reply: storage_pb2.RedriveItemsResponse = await self._call(STORAGE, "RedriveItems", request, False)
        return reply

    async def clear(self, name: str) -> None:
        request = queues_pb2.ClearQueueRequest(queue_name=name, queue=True, scheduled=True)
        await self._call(QUEUES, "ClearQueue", request, False)

    async def cluster_info(
        self, queue_names: Sequence[str] = (), *, check_members: bool = False
    ) -> cluster_pb2.ClusterInfoResponse:
        request = cluster_pb2.ClusterInfoRequest(queue_names=list(queue_names), check_members=check_members)
        reply: cluster_pb2.ClusterInfoResponse = await self._call(CLUSTER, "ClusterInfo", request, True)
        return reply


DEAD_REASONS: dict[str, int] = {
    "max_attempts": queue_pb2.DEAD_REASON_MAX_ATTEMPTS,
    "expired": queue_pb2.DEAD_REASON_EXPIRED,
    "retry_dead": queue_pb2.DEAD_REASON_RETRY_DEAD,
}
REASON_NAMES: dict[int, str] = {value: name for name, value in DEAD_REASONS.items()}
