"""The few calls the connector makes, on the generated stubs, with bounded retries.

Every call the connector makes is safe to repeat: produces carry idempotency keys,
leases carry lease keys, completion and extension by key are idempotent, listing and
stats only read. So a call that fails with UNAVAILABLE (or whose deadline passed) is
retried a few times with backoff; after that the error is raised as the SDK's
:class:`~querator.errors.QueratorError` subclass, which fails the Spark task (Spark
retries the task) or the driver call (the query fails).

Connections are cached per process: Spark reuses its Python workers across tasks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf import duration_pb2

from .._config import ClientConfig
from ..errors import from_rpc_error
from ..v1 import queue_pb2, queue_pb2_grpc, queues_pb2, queues_pb2_grpc, storage_pb2, storage_pb2_grpc
from ._options import Connection

Request = TypeVar("Request")
Response = TypeVar("Response")

#: Most lease keys one Complete or Extend request may name.
MAX_KEYS = 1000
_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_BACKOFF_S = 0.2


def duration(seconds: float) -> duration_pb2.Duration:
    micros = max(0, round(seconds * 1_000_000))
    return duration_pb2.Duration(seconds=micros // 1_000_000, nanos=(micros % 1_000_000) * 1000)


def retryable(error: grpc.RpcError) -> bool:
    return isinstance(error, grpc.Call) and error.code() in _RETRYABLE


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
        credentials = config.credentials()
        if credentials is None:
            self.channel = grpc.insecure_channel(conn.address, options=options)
        else:
            self.channel = grpc.secure_channel(conn.address, credentials, options=options)
        self.metadata = tuple(config.call_metadata())
        self.queue = queue_pb2_grpc.QueueServiceStub(self.channel)
        self.queues = queues_pb2_grpc.QueuesServiceStub(self.channel)
        self.storage = storage_pb2_grpc.StorageServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    # -- plumbing ----------------------------------------------------------------------

    def call(self, method: Callable[..., Response], request: Any, *, timeout: float | None = None) -> Response:
        """``method(request)`` with the connection's deadline, retried while retryable."""
        attempt = 0
        while True:
            try:
                return method(request, timeout=timeout or self.conn.timeout, metadata=self.metadata)
            except grpc.RpcError as error:
                attempt += 1
                if not retryable(error) or attempt > self.conn.retries:
                    raise from_rpc_error(error) from error
                time.sleep(_BACKOFF_S * 2 ** (attempt - 1))

    def start(self, method: Any, request: Request, *, timeout: float | None = None) -> grpc.Future[Any]:
        """Send ``request`` without waiting; :meth:`finish` gets the reply."""
        future: grpc.Future[Any] = method.future(request, timeout=timeout or self.conn.timeout, metadata=self.metadata)
        return future

    def finish(
        self, future: grpc.Future[Response], method: Any, request: Request, *, timeout: float | None = None
    ) -> Response:
        """The reply of a :meth:`start`; a retryable failure is sent again with :meth:`call`."""
        try:
            return future.result()
        except grpc.RpcError as error:
            if not retryable(error) or self.conn.retries < 1:
                raise from_rpc_error(error) from error
        reply: Response = self.call(method, request, timeout=timeout)
        return reply

    # -- calls -------------------------------------------------------------------------

    def produce(self, items: Sequence[queue_pb2.ProduceItem]) -> queue_pb2.ProduceResponse:
        request = queue_pb2.ProduceRequest(queue_name=self.queue_name, items=items)
        return self.call(self.queue.Produce, request)

    def produce_request(self, items: Sequence[queue_pb2.ProduceItem]) -> queue_pb2.ProduceRequest:
        return queue_pb2.ProduceRequest(queue_name=self.queue_name, items=items)

    def lease_request(self, key: str, batch_size: int, wait: float) -> queue_pb2.LeaseRequest:
        return queue_pb2.LeaseRequest(
            queue_name=self.queue_name,
            batch_size=batch_size,
            lease_key=key,
            request_timeout=duration(wait),
            columnar=True,
        )

    def complete_keys(self, keys: Sequence[str]) -> None:
        for i in range(0, len(keys), MAX_KEYS):
            request = queue_pb2.CompleteRequest(queue_name=self.queue_name, lease_keys=keys[i : i + MAX_KEYS])
            self.call(self.queue.Complete, request)

    def extend_keys(self, keys: Sequence[str]) -> int:
        extended = 0
        for i in range(0, len(keys), MAX_KEYS):
            request = queue_pb2.ExtendRequest(queue_name=self.queue_name, lease_keys=keys[i : i + MAX_KEYS])
            extended += self.call(self.queue.Extend, request).key_items_extended
        return extended

    def queue_info(self) -> queues_pb2.QueueInfo:
        request = queues_pb2.GetQueueRequest(queue_name=self.queue_name)
        return self.call(self.queues.GetQueue, request).queue

    def ready_items(self) -> int:
        """Items ready now (stored minus leased; scheduled ones are not counted)."""
        request = queues_pb2.GetQueueStatsRequest(queue_name=self.queue_name)
        stats = self.call(self.queues.GetQueueStats, request)
        return sum(max(0, p.total - p.total_leased) for p in stats.partitions)

    def list_page(
        self, partition: int, page_size: int, token: str, *, scheduled: bool = False
    ) -> tuple[Sequence[storage_pb2.StorageItem], str]:
        if scheduled:
            sched = storage_pb2.ListScheduledItemsRequest(
                queue_name=self.queue_name, partition=partition, page_size=page_size, page_token=token
            )
            reply = self.call(self.storage.ListScheduledItems, sched)
            return reply.items, reply.next_page_token
        request = storage_pb2.ListItemsRequest(
            queue_name=self.queue_name, partition=partition, page_size=page_size, page_token=token
        )
        page = self.call(self.storage.ListItems, request)
        return page.items, page.next_page_token

    def delete_items(self, partition: int, ids: Sequence[str]) -> None:
        request = storage_pb2.DeleteItemsRequest(queue_name=self.queue_name, partition=partition, ids=ids)
        self.call(self.storage.DeleteItems, request)


_cache: dict[Connection, Rpc] = {}
_cache_lock = threading.Lock()


def connect(conn: Connection) -> Rpc:
    """This process's :class:`Rpc` for ``conn`` (one channel per server and queue)."""
    with _cache_lock:
        rpc = _cache.get(conn)
        if rpc is None:
            rpc = _cache[conn] = Rpc(conn)
        return rpc
