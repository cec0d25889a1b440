"""The asyncio client: the same methods as Client, awaited."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from . import _protocol as p
from ._base import BaseClient, ProduceCollector
from ._convert import Seconds, seconds
from ._items import COMPLETED, DEAD, RETRIED, AsyncLeasedItem
from ._models import (
    ApiKey,
    CreatedKey,
    DeadReason,
    ExtendResult,
    Item,
    Page,
    Payload,
    ProduceResult,
    QueueInfo,
    QueueStats,
    RedriveResult,
    StoredItem,
)
from ._paging import AsyncPager
from ._streams import Streams, StreamsUnsupported, from_stream_error
from .errors import InvalidRequest, QueratorError, Unauthenticated, Unavailable, from_rpc_error
from .v1 import (
    keys_pb2,
    keys_pb2_grpc,
    queue_pb2,
    queue_pb2_grpc,
    queues_pb2,
    queues_pb2_grpc,
    storage_pb2,
    storage_pb2_grpc,
)

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
T = TypeVar("T")


class AsyncClient(BaseClient):
    """An asyncio Querator client over one ``grpc.aio`` channel.

    Same constructor and methods as :class:`~querator.Client`, as coroutines. The
    channel is opened on first use inside the running event loop; use ``async with``
    or ``await client.close()``.
    """

    def _setup(self) -> None:
        self._channel: grpc.aio.Channel | None = None
        self._closed = False
        self._streams = Streams()
        self._compact = True  # ProduceRequest.payloads; off once a server refuses it

    def _stubs(
        self,
    ) -> tuple[
        queue_pb2_grpc.QueueServiceAsyncStub,
        queues_pb2_grpc.QueuesServiceAsyncStub,
        storage_pb2_grpc.StorageServiceAsyncStub,
    ]:
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._channel is None:
            creds = self._config.credentials()
            options = self._config.options()
            if creds is None:
                self._channel = grpc.aio.insecure_channel(self._config.address, options=options)
            else:
                self._channel = grpc.aio.secure_channel(self._config.address, creds, options=options)
            self._queue = queue_pb2_grpc.QueueServiceStub(self._channel)
            self._queues = queues_pb2_grpc.QueuesServiceStub(self._channel)
            self._storage = storage_pb2_grpc.StorageServiceStub(self._channel)
            self._keys = keys_pb2_grpc.KeysServiceStub(self._channel)
        return self._queue, self._queues, self._storage

    # -- lifecycle ---------------------------------------------------------------------

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._closed = True
        await self._streams.close()
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def wait_ready(self, timeout: Seconds = 10) -> None:
        """Wait until the channel is connected; Unavailable after ``timeout``."""
        self._stubs()
        assert self._channel is not None
        try:
            await asyncio.wait_for(self._channel.channel_ready(), seconds(timeout))
        except TimeoutError:
            raise Unavailable(
                f"could not connect to {self._config.address} within {timeout}s", code=grpc.StatusCode.UNAVAILABLE
            ) from None

    # -- calling -----------------------------------------------------------------------

    async def _call(
        self,
        rpc: grpc.aio.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        *,
        timeout: float,
        retry: bool,
        item_call: bool = False,
        key_call: bool = False,
    ) -> Resp:
        attempt = 0
        while True:
            try:
                return await rpc(
                    request,
                    timeout=timeout,
                    metadata=tuple(self._config.call_metadata()),
                    wait_for_ready=self._config.wait_for_ready or None,
                )
            except grpc.aio.AioRpcError as exc:
                error = from_rpc_error(exc, item_call=item_call, key_call=key_call)
                if not (retry and isinstance(error, Unavailable) and attempt < self._config.retries):
                    raise error from exc
            attempt += 1
            await asyncio.sleep(self._backoff(attempt))

    async def _queue_call(
        self,
        method: str,
        request: Any,
        *,
        timeout: float,
        retry: bool,
        item_call: bool = False,
    ) -> Any:
        """A Produce or Lease: over the queue's stream (see _streams.py), else unary."""
        stub = self._stubs()[0]
        unary: Any = stub.Produce if method == "Produce" else stub.Lease
        if not self._config.streams or self._streams.unsupported:
            return await self._call(unary, request, timeout=timeout, retry=retry, item_call=item_call)
        if method == "Produce":
            message: Any = queue_pb2.ProduceStreamRequest(request=request)
            open_call: Any = stub.ProduceStream
        else:
            message = queue_pb2.LeaseStreamRequest(request=request)
            open_call = stub.LeaseStream
        config = self._config
        stream = self._streams.get(
            method,
            request.queue_name,
            lambda: open_call(metadata=tuple(config.call_metadata()), wait_for_ready=config.wait_for_ready or None),
        )
        attempt = 0
        while True:
            try:
                answer = await stream.ask(message, timeout)
            except StreamsUnsupported:
                self._streams.unsupported = True
                return await self._call(unary, request, timeout=timeout, retry=retry, item_call=item_call)
            except QueratorError as exc:
                error = exc
            else:
                if answer.WhichOneof("result") == "response":
                    return answer.response
                error = from_stream_error(answer.error, item_call=item_call)
                if isinstance(error, Unauthenticated):
                    stream.reopen()  # the next request opens it with fresh credentials
            if not (retry and isinstance(error, Unavailable) and attempt < config.retries):
                raise error
            attempt += 1
            await asyncio.sleep(self._backoff(attempt))

    async def _produce_call(self, request: queue_pb2.ProduceRequest, *, timeout: float, retry: bool) -> Any:
        """A Produce; a request in the compact form goes again as items to a server
        from before ``payloads`` (which refuses it for having no items)."""
        try:
            return await self._queue_call("Produce", request, timeout=timeout, retry=retry)
        except InvalidRequest as error:
            plain = p.itemized(request)
            if plain is None or not p.refuses_compact(error, request):
                raise
            self._compact = False
            return await self._queue_call("Produce", plain, timeout=timeout, retry=retry)

    # -- QueueService -------------------------------------------------------------------

    async def produce(
        self,
        queue_name: str,
        items: Iterable[p.ProduceArg] | p.ProduceArg,
        *,
        encoding: str = "",
        kind: str = "",
        reference: str = "",
        enqueue_at: datetime | None = None,
        timeout: Seconds | None = None,
        retry: bool | None = None,
        batch_size: int = 1000,
        max_in_flight: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> ProduceResult:
        """Add items to a queue; see :meth:`querator.Client.produce`.

        Requests run ``max_in_flight`` at a time; after a failure no new request is sent,
        those in flight are awaited, and the error is raised with ``.produced`` set.
        """
        defaults = Item(b"", encoding=encoding, kind=kind, reference=reference, enqueue_at=enqueue_at)
        call_timeout = self._config.call_timeout(timeout)
        retry = self._config.retry_produce if retry is None else retry
        window = max_in_flight or self._config.max_in_flight
        collector = ProduceCollector(on_progress)

        async def send(index: int, request: queue_pb2.ProduceRequest) -> None:
            try:
                keyed = bool(request.items) and p.all_keyed(list(request.items))
                response = await self._produce_call(request, timeout=call_timeout, retry=retry or keyed)
            except QueratorError as error:
                collector.failed(error)
                return
            collector.stored(index, list(response.ids), response.partition, response.duplicates)

        pending: set[asyncio.Task[None]] = set()
        try:
            batches = p.produce_batches(items, defaults, max_items=batch_size, trace=self._trace())
            for index, batch in enumerate(batches):
                while len(pending) >= window:
                    _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if collector.error is not None:
                    break
                collector.sent(index, len(batch))
                request = p.produce_request(queue_name, batch, call_timeout, compact=self._compact)
                pending.add(asyncio.create_task(send(index, request)))
            if pending:
                await asyncio.wait(pending)
        except BaseException:
            for task in pending:
                task.cancel()
            raise
        return collector.finish()

    async def lease(
        self,
        queue_name: str,
        *,
        batch_size: int = 1,
        wait: Seconds = 30,
        client_id: str = "",
        complete: p.ItemsArg | None = None,
        lease_key: str = "",
    ) -> list[AsyncLeasedItem]:
        """Lease up to ``batch_size`` ready items, after completing ``complete`` (one
        partition of this queue) in the same call; see :meth:`querator.Client.lease`."""
        return await self._lease_as(
            functools.partial(AsyncLeasedItem, self), queue_name, batch_size, wait, client_id, complete, lease_key
        )

    async def _lease_as(
        self,
        make: Callable[..., T],
        queue_name: str,
        batch_size: int,
        wait: Seconds,
        client_id: str,
        complete: p.ItemsArg | None,
        lease_key: str = "",
    ) -> list[T]:
        """``lease``, each item made by ``make(**fields)`` (the Worker hands sync handlers
        LeasedItems, made at once rather than copied from AsyncLeasedItems)."""
        completing = p.lease_completions(queue_name, complete)
        request, wait_s = p.lease_request(queue_name, batch_size, wait, client_id, completing, lease_key)
        response = await self._queue_call(
            "Lease",
            request,
            timeout=self._lease_deadline(wait_s),
            retry=not completing,
            item_call=bool(completing),
        )
        p.mark(completing, COMPLETED)
        return [make(**fields) for fields in p.leased_fields(response)]

    async def complete(
        self,
        items: p.ItemsArg = (),
        *,
        lease_keys: Iterable[str] | str | None = None,
        queue_name: str | None = None,
        timeout: Seconds | None = None,
    ) -> None:
        """Complete leased items, or by ``lease_keys``; see :meth:`querator.Client.complete`."""
        call_timeout = self._config.call_timeout(timeout)
        stub = self._stubs()[0]
        for queue, partition, members in p.group_refs(items):
            request = p.complete_request(queue, partition, members, call_timeout)
            await self._call(stub.Complete, request, timeout=call_timeout, retry=False, item_call=True)
            p.mark(members, COMPLETED)
        queue, key_chunks = p.lease_keys(lease_keys, queue_name)
        for keys in key_chunks:
            request = p.complete_keys_request(queue, keys, call_timeout)
            await self._call(stub.Complete, request, timeout=call_timeout, retry=True, item_call=True)

    async def retry(
        self,
        items: p.ItemsArg,
        *,
        at: datetime | None = None,
        in_: Seconds | None = None,
        dead: bool = False,
        timeout: Seconds | None = None,
    ) -> None:
        """Give leased items back; see :meth:`querator.Client.retry`."""
        when = p.retry_at(at, in_)
        await self._retry_orders([(m, when, dead) for m in p.refs(items)], timeout=timeout)

    async def _retry_orders(
        self, orders: list[tuple[p.Ref, datetime | None, bool]], *, timeout: Seconds | None = None
    ) -> None:
        call_timeout = self._config.call_timeout(timeout)
        grouped: dict[tuple[str, int], list[tuple[p.Ref, datetime | None, bool]]] = {}
        for order in orders:
            grouped.setdefault((order[0].queue_name, order[0].partition), []).append(order)
        for (queue, partition), group in grouped.items():
            for chunk in p.chunks(group):
                request = p.retry_request(queue, partition, chunk, call_timeout)
                await self._call(self._stubs()[0].Retry, request, timeout=call_timeout, retry=False, item_call=True)
                for ref, _, dead in chunk:
                    p.mark([ref], DEAD if dead else RETRIED)

    async def extend(
        self,
        items: p.ItemsArg = (),
        *,
        lease_timeout: Seconds | None = None,
        lease_keys: Iterable[str] | str | None = None,
        queue_name: str | None = None,
        timeout: Seconds | None = None,
    ) -> ExtendResult:
        """Push lease deadlines, of items or by ``lease_keys``; see :meth:`querator.Client.extend`."""
        call_timeout = self._config.call_timeout(timeout)
        stub = self._stubs()[0]
        out: list[datetime] = []
        key_items = 0
        for queue, partition, members in p.group_refs(items):
            request = p.extend_request(queue, partition, members, lease_timeout, call_timeout)
            response = await self._call(stub.Extend, request, timeout=call_timeout, retry=True, item_call=True)
            out.extend(p.apply_deadlines(members, response))
        queue, key_chunks = p.lease_keys(lease_keys, queue_name)
        for keys in key_chunks:
            request = p.extend_request(queue, 0, [], lease_timeout, call_timeout, keys)
            response = await self._call(stub.Extend, request, timeout=call_timeout, retry=True, item_call=True)
            key_items += response.key_items_extended
        return p.extend_result(out, key_items)

    # -- QueuesService ------------------------------------------------------------------

    async def create_queue(
        self,
        name: str,
        *,
        dead_queue: str | None = None,
        reference: str | None = None,
        lease_timeout: Seconds | None = None,
        expire_timeout: Seconds | None = None,
        max_attempts: int | None = None,
        partitions: int | None = None,
        dedup_window: Seconds | None = None,
        lease_key_ttl: Seconds | None = None,
        timeout: Seconds | None = None,
    ) -> QueueInfo:
        """Create a queue; see :meth:`querator.Client.create_queue`."""
        info, _ = p.queue_info_message(
            name,
            {
                "dead_queue": dead_queue,
                "reference": reference,
                "lease_timeout": lease_timeout,
                "expire_timeout": expire_timeout,
                "max_attempts": max_attempts,
                "partitions": partitions,
                "dedup_window": dedup_window,
                "lease_key_ttl": lease_key_ttl,
            },
        )
        request = queues_pb2.CreateQueueRequest(queue=info)
        response = await self._call(
            self._stubs()[1].CreateQueue, request, timeout=self._config.call_timeout(timeout), retry=False
        )
        return p.queue_info(response.queue)

    async def get_queue(self, name: str, *, timeout: Seconds | None = None) -> QueueInfo:
        request = queues_pb2.GetQueueRequest(queue_name=name)
        response = await self._call(
            self._stubs()[1].GetQueue, request, timeout=self._config.call_timeout(timeout), retry=True
        )
        return p.queue_info(response.queue)

    def list_queues(
        self, *, page_size: int = 0, page_token: str = "", timeout: Seconds | None = None
    ) -> AsyncPager[QueueInfo]:
        """All queues sorted by name: ``async for queue in client.list_queues()``."""
        call_timeout = self._config.call_timeout(timeout)

        async def fetch(token: str) -> Page[QueueInfo]:
            request = queues_pb2.ListQueuesRequest(page_size=page_size, page_token=token)
            response = await self._call(self._stubs()[1].ListQueues, request, timeout=call_timeout, retry=True)
            return Page([p.queue_info(q) for q in response.queues], response.next_page_token)

        return AsyncPager(fetch, page_token)

    async def update_queue(
        self,
        name: str,
        *,
        dead_queue: str | None = None,
        reference: str | None = None,
        lease_timeout: Seconds | None = None,
        expire_timeout: Seconds | None = None,
        max_attempts: int | None = None,
        partitions: int | None = None,
        dedup_window: Seconds | None = None,
        lease_key_ttl: Seconds | None = None,
        timeout: Seconds | None = None,
    ) -> QueueInfo:
        """Change exactly the settings given; see :meth:`querator.Client.update_queue`."""
        info, paths = p.queue_info_message(
            name,
            {
                "dead_queue": dead_queue,
                "reference": reference,
                "lease_timeout": lease_timeout,
                "expire_timeout": expire_timeout,
                "max_attempts": max_attempts,
                "partitions": partitions,
                "dedup_window": dedup_window,
                "lease_key_ttl": lease_key_ttl,
            },
        )
        if not paths:
            raise ValueError("update_queue needs at least one setting to change")
        request = queues_pb2.UpdateQueueRequest(queue=info, update_mask=p.update_mask(paths))
        response = await self._call(
            self._stubs()[1].UpdateQueue, request, timeout=self._config.call_timeout(timeout), retry=True
        )
        return p.queue_info(response.queue)

    async def delete_queue(self, name: str, *, force: bool = False, timeout: Seconds | None = None) -> None:
        request = queues_pb2.DeleteQueueRequest(queue_name=name, force=force)
        await self._call(
            self._stubs()[1].DeleteQueue, request, timeout=self._config.call_timeout(timeout), retry=False
        )

    async def clear_queue(
        self,
        name: str,
        *,
        ready: bool = True,
        scheduled: bool = False,
        destructive: bool = False,
        timeout: Seconds | None = None,
    ) -> None:
        request = queues_pb2.ClearQueueRequest(
            queue_name=name, queue=ready, scheduled=scheduled, destructive=destructive
        )
        await self._call(self._stubs()[1].ClearQueue, request, timeout=self._config.call_timeout(timeout), retry=True)

    async def queue_stats(self, name: str, *, timeout: Seconds | None = None) -> QueueStats:
        request = queues_pb2.GetQueueStatsRequest(queue_name=name)
        response = await self._call(
            self._stubs()[1].GetQueueStats, request, timeout=self._config.call_timeout(timeout), retry=True
        )
        return p.queue_stats(response)

    # -- StorageService ------------------------------------------------------------------

    def list_items(
        self,
        queue_name: str,
        *,
        partition: int = 0,
        page_size: int = 0,
        page_token: str = "",
        timeout: Seconds | None = None,
    ) -> AsyncPager[StoredItem]:
        """Ready and leased items of one partition in FIFO order (``async for``)."""
        call_timeout = self._config.call_timeout(timeout)

        async def fetch(token: str) -> Page[StoredItem]:
            request = storage_pb2.ListItemsRequest(
                queue_name=queue_name, partition=partition, page_size=page_size, page_token=token
            )
            response = await self._call(self._stubs()[2].ListItems, request, timeout=call_timeout, retry=True)
            return Page([p.stored_item(i, partition) for i in response.items], response.next_page_token)

        return AsyncPager(fetch, page_token)

    def list_scheduled_items(
        self,
        queue_name: str,
        *,
        partition: int = 0,
        page_size: int = 0,
        page_token: str = "",
        timeout: Seconds | None = None,
    ) -> AsyncPager[StoredItem]:
        """Scheduled items of one partition, by due time (``async for``)."""
        call_timeout = self._config.call_timeout(timeout)

        async def fetch(token: str) -> Page[StoredItem]:
            request = storage_pb2.ListScheduledItemsRequest(
                queue_name=queue_name, partition=partition, page_size=page_size, page_token=token
            )
            response = await self._call(
                self._stubs()[2].ListScheduledItems, request, timeout=call_timeout, retry=True
            )
            return Page([p.stored_item(i, partition) for i in response.items], response.next_page_token)

        return AsyncPager(fetch, page_token)

    async def import_items(
        self,
        queue_name: str,
        items: Iterable[StoredItem | Item | Payload],
        *,
        partition: int = 0,
        timeout: Seconds | None = None,
    ) -> list[str]:
        """Store items as given; see :meth:`querator.Client.import_items`."""
        call_timeout = self._config.call_timeout(timeout)
        ids: list[str] = []
        for chunk in p.chunks([p.storage_item(i) for i in items]):
            request = storage_pb2.ImportItemsRequest(queue_name=queue_name, partition=partition, items=chunk)
            response = await self._call(self._stubs()[2].ImportItems, request, timeout=call_timeout, retry=False)
            ids.extend(response.ids)
        return ids

    async def delete_items(
        self, queue_name: str, ids: Iterable[str], *, partition: int = 0, timeout: Seconds | None = None
    ) -> None:
        """Delete items by id, whatever their state; unknown ids are ignored."""
        call_timeout = self._config.call_timeout(timeout)
        for chunk in p.chunks(list(ids)):
            request = storage_pb2.DeleteItemsRequest(queue_name=queue_name, partition=partition, ids=chunk)
            await self._call(self._stubs()[2].DeleteItems, request, timeout=call_timeout, retry=True)

    async def redrive_items(
        self,
        queue_name: str,
        *,
        to: str | None = None,
        kind: str | None = None,
        dead_reason: DeadReason | str | None = None,
        limit: int | None = None,
        timeout: Seconds | None = None,
    ) -> RedriveResult:
        """Move ready items out of a dead-letter queue; see :meth:`querator.Client.redrive_items`."""
        call_timeout = self._config.call_timeout(timeout)
        done, token = RedriveResult(), ""
        while True:
            request = p.redrive_request(
                queue_name, done, token, to=to, kind=kind, dead_reason=dead_reason, limit=limit
            )
            if request is None:
                return done
            response = await self._call(self._stubs()[2].RedriveItems, request, timeout=call_timeout, retry=False)
            done, token = p.redrive_progress(done, response), response.next_page_token
            if not token:
                return done

    # -- KeysService --------------------------------------------------------------------------

    def _keys_stub(self) -> keys_pb2_grpc.KeysServiceAsyncStub:
        self._stubs()
        return self._keys

    async def create_key(
        self,
        role: str,
        queues: Iterable[str] | str,
        *,
        description: str = "",
        timeout: Seconds | None = None,
    ) -> CreatedKey:
        """Create an API key; see :meth:`querator.Client.create_key`."""
        request = p.create_key_request(role, queues, description)
        response = await self._call(
            self._keys_stub().CreateKey, request, timeout=self._config.call_timeout(timeout), retry=False, key_call=True
        )
        return p.created_key(response)

    async def list_keys(self, *, timeout: Seconds | None = None) -> list[ApiKey]:
        """Every key, sorted by id (never the tokens)."""
        request = keys_pb2.ListKeysRequest()
        response = await self._call(
            self._keys_stub().ListKeys, request, timeout=self._config.call_timeout(timeout), retry=True, key_call=True
        )
        return [p.api_key(k) for k in response.keys]

    async def revoke_key(self, key_id: str, *, timeout: Seconds | None = None) -> None:
        """Delete a key; calls with its token fail with Unauthenticated from then on."""
        request = keys_pb2.RevokeKeyRequest(key_id=key_id)
        await self._call(
            self._keys_stub().RevokeKey, request, timeout=self._config.call_timeout(timeout), retry=False, key_call=True
        )


__all__ = ["AsyncClient"]
