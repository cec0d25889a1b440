"""The few calls the connector makes, over the SDK's blocking transport.

Every call the connector makes is safe to repeat: produces carry idempotency keys,
leases carry lease keys, completion and extension by key are idempotent, listing and
stats only read. So a call that fails with UNAVAILABLE (or whose deadline passed) is
retried a few times with backoff, under the SDK's one retry policy; after that the
error is raised as the SDK's :class:`~querator.errors.QueratorError` subclass, which
fails the Spark task (Spark retries the task) or the driver call (the query fails).

Connections are cached per process: Spark reuses its Python workers across tasks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import grpc

from .._config import Backoff, ClientConfig
from .._convert import to_duration
from .._operations import QUEUE, QUEUES, STORAGE, Call
from .._retry import RetryPolicy
from .._transport import SyncTransport
from ..errors import DeadlineExceeded, Unavailable
from ..v1 import queue_pb2, queues_pb2, storage_pb2
from ._options import Connection

#: Most lease keys one Complete or Extend request may name.
MAX_KEYS = 1000
# Every call is safe to repeat, so a passed deadline is retried too.
_RETRY_ON = (Unavailable, DeadlineExceeded)
_BACKOFF = Backoff(timedelta(milliseconds=200), timedelta(seconds=5))


@dataclass(frozen=True, slots=True)
class Pending:
    """A call sent by :meth:`Rpc.start`, its reply still to come."""

    call: Call
    future: grpc.Future[Any]

    def cancel(self) -> None:
        self.future.cancel()


class Rpc:
    """A channel to one server and the calls on one queue."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.queue_name = conn.queue
        config = ClientConfig(
            address=conn.address,
            tls=conn.tls,
            root_certificates=conn.root_certificates,
            bearer_token=conn.token or None,
        )
        options = [
            # Lease replies of many large items; the server bounds requests at 5 MB.
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", 6 << 20),
        ]
        policy = RetryPolicy(conn.retries, _BACKOFF, on=_RETRY_ON)
        self.transport = SyncTransport(config, retry_policy=policy, options=options)

    def close(self) -> None:
        self.transport.close()

    # -- plumbing ----------------------------------------------------------------------

    def _call(self, service: str, method: str, request: Any, timeout: float | None) -> Call:
        return Call(service, method, request, timeout or self.conn.timeout, retry=True)

    def call(self, service: str, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """The reply to ``service.method(request)``, retried while the policy allows."""
        return self.transport.invoke(self._call(service, method, request, timeout))

    def start(self, method: str, request: Any, *, timeout: float | None = None) -> Pending:
        """Send a QueueService ``request`` without waiting; :meth:`finish` gets the reply."""
        call = self._call(QUEUE, method, request, timeout)
        return Pending(call, self.transport.start(call))

    def finish(self, pending: Pending) -> Any:
        """The reply of a :meth:`start`; a retryable failure is sent again."""
        return self.transport.finish(pending.call, pending.future)

    # -- calls -------------------------------------------------------------------------

    def produce(self, items: Sequence[queue_pb2.ProduceItem]) -> queue_pb2.ProduceResponse:
        reply: queue_pb2.ProduceResponse = self.call(QUEUE, "Produce", self.produce_request(items))
        return reply

    def produce_request(self, items: Sequence[queue_pb2.ProduceItem]) -> queue_pb2.ProduceRequest:
        return queue_pb2.ProduceRequest(queue_name=self.queue_name, items=items)

    def lease_request(self, key: str, batch_size: int, wait: float) -> queue_pb2.LeaseRequest:
        return queue_pb2.LeaseRequest(
            queue_name=self.queue_name,
            batch_size=batch_size,
            lease_key=key,
            request_timeout=to_duration(wait),
            columnar=True,
        )

    def complete_keys(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), MAX_KEYS):
            request = queue_pb2.CompleteRequest(queue_name=self.queue_name, lease_keys=keys[i : i + MAX_KEYS])
            self.call(QUEUE, "Complete", request)

    def extend_keys(self, keys: Sequence[str]) -> int:
        extended = 0
        for i in range(0, len(keys), MAX_KEYS):
            request = queue_pb2.ExtendRequest(queue_name=self.queue_name, lease_keys=keys[i : i + MAX_KEYS])
            extended += self.call(QUEUE, "Extend", request).key_items_extended
        return extended

    def queue_info(self) -> queues_pb2.QueueInfo:
        request = queues_pb2.GetQueueRequest(queue_name=self.queue_name)
        info: queues_pb2.QueueInfo = self.call(QUEUES, "GetQueue", request).queue
        return info

    def ready_items(self) -> int:
        """Items ready now (stored minus leased; scheduled ones are not counted)."""
        request = queues_pb2.GetQueueStatsRequest(queue_name=self.queue_name)
        stats = self.call(QUEUES, "GetQueueStats", request)
        return sum(max(0, p.total - p.total_leased) for p in stats.partitions)

    def list_page(
        self, partition: int, page_size: int, token: str, *, scheduled: bool = False
    ) -> tuple[Sequence[storage_pb2.StorageItem], str]:
        if scheduled:
            sched = storage_pb2.ListScheduledItemsRequest(
                queue_name=self.queue_name, partition=partition, page_size=page_size, page_token=token
            )
            reply = self.call(STORAGE, "ListScheduledItems", sched)
            return reply.items, reply.next_page_token
        request = storage_pb2.ListItemsRequest(
            queue_name=self.queue_name, partition=partition, page_size=page_size, page_token=token
        )
        page = self.call(STORAGE, "ListItems", request)
        return page.items, page.next_page_token

    def delete_items(self, partition: int, ids: Sequence[str]) -> None:
        request = storage_pb2.DeleteItemsRequest(queue_name=self.queue_name, partition=partition, ids=ids)
        self.call(STORAGE, "DeleteItems", request)


def require_queue(conn: Connection) -> None:
    """Fail here, on the driver, when the queue does not exist (QueueNotFound), rather
    than in every task of the job."""
    connect(conn).queue_info()


_cache: dict[Connection, Rpc] = {}
_cache_lock = threading.Lock()


def connect(conn: Connection) -> Rpc:
    """This process's :class:`Rpc` for ``conn`` (one channel per server and queue)."""
    with _cache_lock:
        rpc = _cache.get(conn)
        if rpc is None:
            rpc = _cache[conn] = Rpc(conn)
        return rpc
