"""The blocking client."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from . import _protocol as p
from ._base import BaseClient, ProduceCollector
from ._convert import Seconds, seconds
from ._items import COMPLETED, DEAD, RETRIED, LeasedItem
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
from ._paging import Pager
from .errors import QueratorError, Unavailable, from_rpc_error
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


class Client(BaseClient):
    """A blocking Querator client over one gRPC channel; safe to share between threads.

    ``Client("host:2319", timeout=10, bearer_token=...)``; use it as a context manager or
    call :meth:`close`. Every setting is described in :class:`~querator.ClientConfig`.
    """

    def _setup(self) -> None:
        self._compact = True  # ProduceRequest.payloads; off once a server refuses it
        creds = self._config.credentials()
        options = self._config.options()
        if creds is None:
            self._channel: grpc.Channel | None = grpc.insecure_channel(self._config.address, options=options)
        else:
            self._channel = grpc.secure_channel(self._config.address, creds, options=options)
        self._queue = queue_pb2_grpc.QueueServiceStub(self._channel)
        self._queues = queues_pb2_grpc.QueuesServiceStub(self._channel)
        self._storage = storage_pb2_grpc.StorageServiceStub(self._channel)
        self._keys = keys_pb2_grpc.KeysServiceStub(self._channel)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def wait_ready(self, timeout: Seconds = 10) -> None:
        """Block until the channel is connected; Unavailable after ``timeout``."""
        if self._channel is None:
            raise RuntimeError("the client is closed")
        try:
            grpc.channel_ready_future(self._channel).result(timeout=seconds(timeout))
        except grpc.FutureTimeoutError:
            raise Unavailable(
                f"could not connect to {self._config.address} within {timeout}s", code=grpc.StatusCode.UNAVAILABLE
            ) from None

    # -- calling -----------------------------------------------------------------------

    def _call(
        self,
        rpc: grpc.UnaryUnaryMultiCallable[Req, Resp],
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
                return rpc(
                    request,
                    timeout=timeout,
                    metadata=tuple(self._config.call_metadata()),
                    wait_for_ready=self._config.wait_for_ready or None,
                )
            except grpc.RpcError as exc:
                error = from_rpc_error(exc, item_call=item_call, key_call=key_call)
                if not (retry and isinstance(error, Unavailable) and attempt < self._config.retries):
                    raise error from exc
            attempt += 1
            time.sleep(self._backoff(attempt))

    # -- QueueService -------------------------------------------------------------------

    def produce(
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
        """Add items (bytes, str or :class:`~querator.Item`) to a queue; any number of them.

        They are sent in requests of at most ``batch_size`` (<= 1,000) items and ~4 MB,
        ``max_in_flight`` at a time; each request's items go to one partition, in order.
        ``encoding``/``kind``/``reference``/``enqueue_at`` apply to items that do not set
        their own. Returns every id in the order given (``duplicates`` counts the items
        whose ``Item.idempotency_key`` was seen before). ``retry=True`` retries a request
        after UNAVAILABLE, at the risk of storing it twice if only its reply was lost
        (unless every item carries an idempotency key: then a repeat stores nothing).
        ``on_progress`` is called with the number of items stored so far. With the
        client's ``tracing=True`` each item's metadata also gets the current trace
        context (:mod:`querator.tracing`).
        """
        defaults = Item(b"", encoding=encoding, kind=kind, reference=reference, enqueue_at=enqueue_at)
        call_timeout = self._config.call_timeout(timeout)
        retry = self._config.retry_produce if retry is None else retry
        window = max_in_flight or self._config.max_in_flight
        stub = self._queue
        collector = ProduceCollector(on_progress)
        inflight: collections.deque[tuple[int, queue_pb2.ProduceRequest, Any]] = collections.deque()

        def finish_oldest() -> None:
            index, request, future = inflight.popleft()
            try:
                response = future.result()
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
                plain = p.itemized(request)
                if plain is not None and p.refuses_compact(error, request):
                    # A server from before ProduceRequest.payloads: send items, now and later.
                    self._compact = False
                    request = plain
                elif not ((retry or p.all_keyed(list(request.items))) and isinstance(error, Unavailable)):
                    collector.failed(error)
                    return
                try:
                    response = self._call(stub.Produce, request, timeout=call_timeout, retry=retry or p.all_keyed(list(request.items)))
                except QueratorError as again:
                    collector.failed(again)
                    return
            collector.stored(index, list(response.ids), response.partition, response.duplicates)

        batches = p.produce_batches(items, defaults, max_items=batch_size, trace=self._trace())
        for index, batch in enumerate(batches):
            if collector.error is not None:
                break
            while len(inflight) >= window:
                finish_oldest()
            if collector.error is not None:
                break
            request = p.produce_request(queue_name, batch, call_timeout, compact=self._compact)
            collector.sent(index, len(batch))
            future = stub.Produce.future(
                request,
                timeout=call_timeout,
                metadata=tuple(self._config.call_metadata()),
                wait_for_ready=self._config.wait_for_ready or None,
            )
            inflight.append((index, request, future))
        while inflight:
            finish_oldest()
        return collector.finish()

    def lease(
        self,
        queue_name: str,
        *,
        batch_size: int = 1,
        wait: Seconds = 30,
        client_id: str = "",
        complete: p.ItemsArg | None = None,
        lease_key: str = "",
    ) -> list[LeasedItem]:
        """Lease up to ``batch_size`` ready items, oldest first, all from one partition.

        When none is ready the server waits up to ``wait`` and then answers with an empty
        list (``wait=0``: answer at once). The call's deadline is ``wait`` plus the
        client's ``lease_margin``. Retried after UNAVAILABLE: items leased by an attempt
        whose reply was lost come back by lease expiry.

        ``complete``: items of an earlier lease (one partition of this queue, at most
        1,000) to complete first, in the same call. All-or-nothing like :meth:`complete`:
        if one cannot be completed the call raises (:class:`~querator.LeaseLost`) and
        nothing is completed or leased; an answer, even an empty list, means they are
        completed. Such a call is not retried (a repeat would answer NOT_FOUND).

        ``lease_key`` makes the lease idempotent: a later call with the same key returns
        the items still leased under it instead of new ones (complete them with
        ``complete(lease_keys=...)``).
        """
        completing = p.lease_completions(queue_name, complete)
        request, wait_s = p.lease_request(queue_name, batch_size, wait, client_id, completing, lease_key)
        response = self._call(
            self._queue.Lease,
            request,
            timeout=self._lease_deadline(wait_s),
            retry=not completing,
            item_call=bool(completing),
        )
        p.mark(completing, COMPLETED)
        return [LeasedItem(self, **fields) for fields in p.leased_fields(response)]

    def complete(
        self,
        items: p.ItemsArg = (),
        *,
        lease_keys: Iterable[str] | str | None = None,
        queue_name: str | None = None,
        timeout: Seconds | None = None,
    ) -> None:
        """Complete leased items (LeasedItem or ItemRef, one or many).

        Each (queue, partition) group of up to 1,000 ids is one all-or-nothing request:
        one lost lease (:class:`~querator.LeaseLost`) fails its whole request.

        ``lease_keys`` (with ``queue_name``) completes every item still leased under
        each key. Idempotent: a key already completed or forgotten is no error, so these
        requests are retried after UNAVAILABLE.
        """
        call_timeout = self._config.call_timeout(timeout)
        stub = self._queue
        for queue, partition, members in p.group_refs(items):
            request = p.complete_request(queue, partition, members, call_timeout)
            self._call(stub.Complete, request, timeout=call_timeout, retry=False, item_call=True)
            p.mark(members, COMPLETED)
        queue, key_chunks = p.lease_keys(lease_keys, queue_name)
        for keys in key_chunks:
            request = p.complete_keys_request(queue, keys, call_timeout)
            self._call(stub.Complete, request, timeout=call_timeout, retry=True, item_call=True)

    def retry(
        self,
        items: p.ItemsArg,
        *,
        at: datetime | None = None,
        in_: Seconds | None = None,
        dead: bool = False,
        timeout: Seconds | None = None,
    ) -> None:
        """Give leased items back: to the tail now, at ``at`` / after ``in_``, or ``dead``.

        ``dead=True`` sends them to the dead-letter queue (deleted when there is none).
        An item out of attempts (the queue's ``max_attempts``) is dead-lettered anyway.
        """
        when = p.retry_at(at, in_)
        self._retry_orders([(m, when, dead) for m in p.refs(items)], timeout=timeout)

    def _retry_orders(self, orders: list[tuple[p.Ref, datetime | None, bool]], *, timeout: Seconds | None = None) -> None:
        call_timeout = self._config.call_timeout(timeout)
        grouped: dict[tuple[str, int], list[tuple[p.Ref, datetime | None, bool]]] = {}
        for order in orders:
            grouped.setdefault((order[0].queue_name, order[0].partition), []).append(order)
        for (queue, partition), group in grouped.items():
            for chunk in p.chunks(group):
                request = p.retry_request(queue, partition, chunk, call_timeout)
                self._call(self._queue.Retry, request, timeout=call_timeout, retry=False, item_call=True)
                for ref, _, dead in chunk:
                    p.mark([ref], DEAD if dead else RETRIED)

    def extend(
        self,
        items: p.ItemsArg = (),
        *,
        lease_timeout: Seconds | None = None,
        lease_keys: Iterable[str] | str | None = None,
        queue_name: str | None = None,
        timeout: Seconds | None = None,
    ) -> ExtendResult:
        """Push lease deadlines to now + ``lease_timeout`` (default: the queue's).

        Returns the new deadlines in order (a list) and updates ``lease_deadline`` of
        LeasedItems. A lease whose deadline already passed fails with
        :class:`~querator.NotLeased`. ``lease_keys`` (with ``queue_name``) extends every
        item still validly leased under each key; the result's ``key_items_extended``
        counts them.
        """
        call_timeout = self._config.call_timeout(timeout)
        stub = self._queue
        out: list[datetime] = []
        key_items = 0
        for queue, partition, members in p.group_refs(items):
            request = p.extend_request(queue, partition, members, lease_timeout, call_timeout)
            response = self._call(stub.Extend, request, timeout=call_timeout, retry=True, item_call=True)
            out.extend(p.apply_deadlines(members, response))
        queue, key_chunks = p.lease_keys(lease_keys, queue_name)
        for keys in key_chunks:
            request = p.extend_request(queue, 0, [], lease_timeout, call_timeout, keys)
            response = self._call(stub.Extend, request, timeout=call_timeout, retry=True, item_call=True)
            key_items += response.key_items_extended
        return p.extend_result(out, key_items)

    # -- QueuesService ------------------------------------------------------------------

    def create_queue(
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
        """Create a queue; unset settings take the server's defaults. QueueExists if taken."""
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
        response = self._call(
            self._queues.CreateQueue, request, timeout=self._config.call_timeout(timeout), retry=False
        )
        return p.queue_info(response.queue)

    def get_queue(self, name: str, *, timeout: Seconds | None = None) -> QueueInfo:
        request = queues_pb2.GetQueueRequest(queue_name=name)
        response = self._call(self._queues.GetQueue, request, timeout=self._config.call_timeout(timeout), retry=True)
        return p.queue_info(response.queue)

    def list_queues(
        self, *, page_size: int = 0, page_token: str = "", timeout: Seconds | None = None
    ) -> Pager[QueueInfo]:
        """All queues sorted by name, fetched ``page_size`` at a time as iteration goes."""
        call_timeout = self._config.call_timeout(timeout)

        def fetch(token: str) -> Page[QueueInfo]:
            request = queues_pb2.ListQueuesRequest(page_size=page_size, page_token=token)
            response = self._call(self._queues.ListQueues, request, timeout=call_timeout, retry=True)
            return Page([p.queue_info(q) for q in response.queues], response.next_page_token)

        return Pager(fetch, page_token)

    def update_queue(
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
        """Change exactly the settings given (``dead_queue=""`` removes the DLQ)."""
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
        response = self._call(
            self._queues.UpdateQueue, request, timeout=self._config.call_timeout(timeout), retry=True
        )
        return p.queue_info(response.queue)

    def delete_queue(self, name: str, *, force: bool = False, timeout: Seconds | None = None) -> None:
        """Delete a queue and its items; one that still holds items needs ``force=True``."""
        request = queues_pb2.DeleteQueueRequest(queue_name=name, force=force)
        self._call(self._queues.DeleteQueue, request, timeout=self._config.call_timeout(timeout), retry=False)

    def clear_queue(
        self,
        name: str,
        *,
        ready: bool = True,
        scheduled: bool = False,
        destructive: bool = False,
        timeout: Seconds | None = None,
    ) -> None:
        """Remove ready items (leased ones too with ``destructive``) and/or scheduled items."""
        request = queues_pb2.ClearQueueRequest(
            queue_name=name, queue=ready, scheduled=scheduled, destructive=destructive
        )
        self._call(self._queues.ClearQueue, request, timeout=self._config.call_timeout(timeout), retry=True)

    def queue_stats(self, name: str, *, timeout: Seconds | None = None) -> QueueStats:
        """Counts per partition; cheap enough to call every second."""
        request = queues_pb2.GetQueueStatsRequest(queue_name=name)
        response = self._call(
            self._queues.GetQueueStats, request, timeout=self._config.call_timeout(timeout), retry=True
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
    ) -> Pager[StoredItem]:
        """Ready and leased items of one partition in FIFO order."""
        call_timeout = self._config.call_timeout(timeout)

        def fetch(token: str) -> Page[StoredItem]:
            request = storage_pb2.ListItemsRequest(
                queue_name=queue_name, partition=partition, page_size=page_size, page_token=token
            )
            response = self._call(self._storage.ListItems, request, timeout=call_timeout, retry=True)
            return Page([p.stored_item(i, partition) for i in response.items], response.next_page_token)

        return Pager(fetch, page_token)

    def list_scheduled_items(
        self,
        queue_name: str,
        *,
        partition: int = 0,
        page_size: int = 0,
        page_token: str = "",
        timeout: Seconds | None = None,
    ) -> Pager[StoredItem]:
        """Scheduled items of one partition, by due time."""
        call_timeout = self._config.call_timeout(timeout)

        def fetch(token: str) -> Page[StoredItem]:
            request = storage_pb2.ListScheduledItemsRequest(
                queue_name=queue_name, partition=partition, page_size=page_size, page_token=token
            )
            response = self._call(self._storage.ListScheduledItems, request, timeout=call_timeout, retry=True)
            return Page([p.stored_item(i, partition) for i in response.items], response.next_page_token)

        return Pager(fetch, page_token)

    def import_items(
        self,
        queue_name: str,
        items: Iterable[StoredItem | Item | Payload],
        *,
        partition: int = 0,
        timeout: Seconds | None = None,
    ) -> list[str]:
        """Store items as given (attempts, deadlines, source_id kept); returns the new ids.

        Sent 1,000 at a time; not retried automatically (a retry could store twice).
        """
        call_timeout = self._config.call_timeout(timeout)
        ids: list[str] = []
        for chunk in p.chunks([p.storage_item(i) for i in items]):
            request = storage_pb2.ImportItemsRequest(queue_name=queue_name, partition=partition, items=chunk)
            response = self._call(self._storage.ImportItems, request, timeout=call_timeout, retry=False)
            ids.extend(response.ids)
        return ids

    def delete_items(
        self, queue_name: str, ids: Iterable[str], *, partition: int = 0, timeout: Seconds | None = None
    ) -> None:
        """Delete items by id, whatever their state; unknown ids are ignored."""
        call_timeout = self._config.call_timeout(timeout)
        for chunk in p.chunks(list(ids)):
            request = storage_pb2.DeleteItemsRequest(queue_name=queue_name, partition=partition, ids=chunk)
            self._call(self._storage.DeleteItems, request, timeout=call_timeout, retry=True)

    def redrive_items(
        self,
        queue_name: str,
        *,
        to: str | None = None,
        kind: str | None = None,
        dead_reason: DeadReason | str | None = None,
        limit: int | None = None,
        timeout: Seconds | None = None,
    ) -> RedriveResult:
        """Move ready items out of ``queue_name`` (a dead-letter queue): each back to the
        queue it died in, or all ``to`` one queue; only those of ``kind`` or that died for
        ``dead_reason`` when given; at most ``limit`` (None: every matching one).

        Each item is moved exactly once, also if the server crashes mid-move; the calls
        are not retried automatically (a retry would move further items). Items whose
        source queue is gone stay, counted in ``skipped``.
        """
        call_timeout = self._config.call_timeout(timeout)
        done, token = RedriveResult(), ""
        while True:
            request = p.redrive_request(
                queue_name, done, token, to=to, kind=kind, dead_reason=dead_reason, limit=limit
            )
            if request is None:
                return done
            response = self._call(self._storage.RedriveItems, request, timeout=call_timeout, retry=False)
            done, token = p.redrive_progress(done, response), response.next_page_token
            if not token:
                return done

    # -- KeysService (servers with auth on; an admin key for "*") -----------------------------

    def create_key(
        self,
        role: str,
        queues: Iterable[str] | str,
        *,
        description: str = "",
        timeout: Seconds | None = None,
    ) -> CreatedKey:
        """Create an API key: ``role`` is producer, consumer or admin; ``queues`` name patterns.

        The result's ``token`` is shown only here (the server keeps a hash). Not retried:
        a repeat would make a second key.
        """
        request = p.create_key_request(role, queues, description)
        response = self._call(
            self._keys.CreateKey, request, timeout=self._config.call_timeout(timeout), retry=False, key_call=True
        )
        return p.created_key(response)

    def list_keys(self, *, timeout: Seconds | None = None) -> list[ApiKey]:
        """Every key, sorted by id (never the tokens)."""
        request = keys_pb2.ListKeysRequest()
        response = self._call(
            self._keys.ListKeys, request, timeout=self._config.call_timeout(timeout), retry=True, key_call=True
        )
        return [p.api_key(k) for k in response.keys]

    def revoke_key(self, key_id: str, *, timeout: Seconds | None = None) -> None:
        """Delete a key; calls with its token fail with Unauthenticated from then on."""
        request = keys_pb2.RevokeKeyRequest(key_id=key_id)
        self._call(
            self._keys.RevokeKey, request, timeout=self._config.call_timeout(timeout), retry=False, key_call=True
        )


__all__ = ["Client"]
