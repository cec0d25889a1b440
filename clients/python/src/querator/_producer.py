"""Producers: hand over single items, get futures; items travel in batches.

A producer collects items into a batch until it holds ``max_items`` items or
``max_bytes`` bytes, or its oldest item has waited ``max_latency``; it keeps up to
``max_in_flight`` batches in flight. ``produce()`` blocks (``Producer``) or waits
(``AsyncProducer``) while ``max_pending`` items are buffered or in flight: that is the
flow control that keeps a fast producer from growing memory without bound.
Each item's future resolves to its id, or to the :class:`~querator.QueratorError` of
its batch. Items of one batch go to one partition, in order.

An item may carry an idempotency key (``Item(..., idempotency_key=k)`` or
``produce(item, idempotency_key=k)``): a repeat of the key within the queue's
``dedup_window`` stores nothing and its future resolves to the first item's id
(``duplicates`` counts them). A batch whose every item has a key is retried after
UNAVAILABLE even without ``retry=True``: repeating it cannot store anything twice.

An item may belong to an ordered group (``Item(..., group_key=g)`` or ``produce(item,
group_key=g)``): a batch holds items of at most one group (and items of none), and a
group's next batch is sent only once the one before it is answered, so the group's
items are stored in the order ``produce()`` was called. A batch that fails (its futures
raise) leaves the group's later items stored without it.

An item may carry metadata (``Item(..., metadata={...})`` or ``produce(item,
metadata={...})``). With the client's ``tracing=True`` each item also gets the trace
context current where ``produce()`` was called (:mod:`querator.tracing`).
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc

from . import _operations as ops
from . import _protocol as p
from . import tracing as _tracing
from ._config import BATCH_BYTES, MAX_BATCH
from ._convert import Seconds, payload_bytes, seconds
from ._models import Item, Payload
from .errors import QueratorError

if TYPE_CHECKING:
    from ._async_client import AsyncClient
    from ._client import Client

F = TypeVar("F")


@dataclass
class _Batch(Generic[F]):
    items: list[p.ProduceEntry] = field(default_factory=list)
    futures: list[F] = field(default_factory=list)
    size: int = 0
    started: float = 0.0
    attempt: int = 0
    not_before: float = 0.0
    # The ordered group of its grouped items ("" for none; at most one per batch).
    group: str = ""

    def add(self, message: p.ProduceEntry, future: F, cost: int) -> None:
        if not self.items:
            self.started = time.monotonic()
        self.group = self.group or _group_of(message)
        self.items.append(message)
        self.futures.append(future)
        self.size += cost


class _Settings:
    def __init__(
        self,
        queue_name: str,
        max_items: int,
        max_bytes: int,
        max_latency: Seconds,
        max_in_flight: int,
        max_pending: int,
        encoding: str,
        kind: str,
        reference: str,
        enqueue_at: datetime | None,
        priority: int,
        tracing: bool,
    ) -> None:
        if not 1 <= max_items <= MAX_BATCH:
            raise ValueError(f"max_items must be between 1 and {MAX_BATCH}")
        if max_in_flight < 1 or max_pending < 1 or max_bytes < 1:
            raise ValueError("max_in_flight, max_pending and max_bytes must be at least 1")
        self.queue_name = queue_name
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.max_latency = seconds(max_latency)
        self.max_in_flight = max_in_flight
        self.max_pending = max_pending
        self.defaults = Item(b"", encoding=encoding, kind=kind, reference=reference, enqueue_at=enqueue_at, priority=priority)
        self.tracing = tracing
        # Values that are only a payload need no message: nothing to add to them.
        self.bare = not (encoding or kind or reference or enqueue_at is not None or priority or tracing)

    def message(
        self,
        item: p.ProduceArg,
        idempotency_key: str | None,
        metadata: Mapping[str, str] | None,
        group_key: str | None = None,
    ) -> tuple[p.ProduceEntry, int]:
        """The item's message (in the caller's context: that is the trace context added),
        or only its payload when that is all it carries (the compact form of the batch)."""
        if (
            self.bare
            and idempotency_key is None
            and group_key is None
            and not metadata
            and isinstance(item, (bytes, bytearray, memoryview, str))
        ):
            payload = payload_bytes(item)
            return payload, len(payload) + 6
        if metadata:
            base = item if isinstance(item, Item) else Item(item)
            item = replace(base, metadata={**base.metadata, **metadata})
        message = p.produce_item(item, self.defaults, _tracing._carrier() if self.tracing else None)
        if idempotency_key is not None:
            message.idempotency_key = idempotency_key
        if group_key is not None:
            message.group_key = group_key
        return message, message.ByteSize() + 6

    def fits(self, batch: _Batch[Any], message: p.ProduceEntry, cost: int) -> bool:
        """Whether ``message`` may join ``batch``: room, and no second group."""
        if batch.items and (len(batch.items) >= self.max_items or batch.size + cost > self.max_bytes):
            return False
        group = _group_of(message)
        return not (group and batch.group and batch.group != group)

    def full(self, batch: _Batch[Any], cost: int) -> bool:
        return bool(batch.items) and (len(batch.items) >= self.max_items or batch.size + cost > self.max_bytes)


def _group_of(message: p.ProduceEntry) -> str:
    return "" if isinstance(message, bytes) else message.group_key


C = TypeVar("C", "Client", "AsyncClient")


class _Producing(abc.ABC, Generic[C]):
    """The constructor both producers share; each sets up its own machinery in ``_setup``."""

    def __init__(
        self,
        client: C,
        queue_name: str,
        *,
        max_items: int = MAX_BATCH,
        max_bytes: int = BATCH_BYTES,
        max_latency: Seconds = 0.01,
        max_in_flight: int = 4,
        max_pending: int = 100_000,
        retry: bool | None = None,
        timeout: Seconds | None = None,
        encoding: str = "",
        kind: str = "",
        reference: str = "",
        enqueue_at: datetime | None = None,
        priority: int = 0,
    ) -> None:
        self._s = _Settings(
            queue_name, max_items, max_bytes, max_latency, max_in_flight, max_pending,
            encoding, kind, reference, enqueue_at, priority, client.config.tracing,
        )  # fmt: skip
        self._retry = client.config.retry_produce if retry is None else retry
        self._timeout = client.config.call_timeout(timeout)
        self._pending = 0
        self._duplicates = 0
        self._closed = False
        self._setup(client)

    @abc.abstractmethod
    def _setup(self, client: C) -> None:
        """The producer's own state, and its client's transport."""

    @property
    def pending(self) -> int:
        """Items buffered or in flight."""
        return self._pending

    @property
    def duplicates(self) -> int:
        """Items so far whose idempotency key had been seen before (they stored nothing)."""
        return self._duplicates


class Producer(_Producing["Client"]):
    """Batching producer for :class:`~querator.Client`; ``produce()`` returns a Future of the id.

    A background thread sends the batches. ``flush()`` waits for everything produced so
    far; ``close()`` (or leaving the ``with`` block) flushes and stops the thread.
    """

    def _setup(self, client: Client) -> None:
        self._transport = client._transport  # the client's I/O: its internal interface
        self._cond = threading.Condition()
        self._batch: _Batch[concurrent.futures.Future[str]] = _Batch()
        self._ready: collections.deque[_Batch[concurrent.futures.Future[str]]] = collections.deque()
        self._in_flight = 0
        # Groups with a batch in flight: the next batch of one waits for its answer.
        self._sending: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="querator-producer", daemon=True)
        self._thread.start()

    def produce(
        self,
        item: Item | Payload,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, str] | None = None,
        timeout: Seconds | None = None,
        group_key: str | None = None,
    ) -> concurrent.futures.Future[str]:
        """Queue one item (bytes, str or Item); blocks while ``max_pending`` items wait.

        ``idempotency_key`` and ``group_key`` override the item's own; ``metadata`` pairs
        are added to the item's own (these win). ``timeout`` bounds the wait (then
        :class:`~querator.Overloaded` is raised).
        """
        message, cost = self._s.message(item, idempotency_key, metadata, group_key)
        future: concurrent.futures.Future[str] = concurrent.futures.Future()
        limit = None if timeout is None else time.monotonic() + seconds(timeout)
        with self._cond:
            while self._pending >= self._s.max_pending and not self._closed:
                remaining = None if limit is None else limit - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise _overloaded(self._s.max_pending)
                self._cond.wait(remaining)
            if self._closed:
                raise RuntimeError("the producer is closed")
            if not self._s.fits(self._batch, message, cost):
                self._seal()
            self._batch.add(message, future, cost)
            self._pending += 1
            if self._s.full(self._batch, 0):
                self._seal()
            self._cond.notify_all()
        return future

    def _seal(self) -> None:
        self._ready.append(self._batch)
        self._batch = _Batch()

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                if self._batch.items and (self._closed or now - self._batch.started >= self._s.max_latency):
                    self._seal()
                sendable = (
                    self._ready
                    and self._in_flight < self._s.max_in_flight
                    and self._ready[0].group not in self._sending
                )
                if sendable and self._ready[0].not_before <= now:
                    batch = self._ready.popleft()
                    self._in_flight += 1
                    if batch.group:
                        self._sending.add(batch.group)
                    self._send(batch)
                    continue
                if self._closed and not self._ready and not self._batch.items and self._in_flight == 0:
                    return
                wake = 1.0
                if self._batch.items:
                    wake = min(wake, self._batch.started + self._s.max_latency - now)
                if sendable:
                    wake = min(wake, self._ready[0].not_before - now)
                self._cond.wait(max(wake, 0.001))

    def _send(self, batch: _Batch[concurrent.futures.Future[str]]) -> None:
        request = p.produce_request(self._s.queue_name, batch.items, self._timeout)
        call = ops.produce_call(request, self._timeout, self._retry)
        try:
            future = self._transport.start(call)
        except Exception as exc:  # e.g. the client was closed: fail this batch, keep running
            self._done(batch, call, _Failed(exc))
            return
        future.add_done_callback(lambda done: self._done(batch, call, done))

    def _done(self, batch: _Batch[concurrent.futures.Future[str]], call: ops.Call, future: Any) -> None:
        try:
            response = future.result()
            error: QueratorError | None = None
        except grpc.RpcError as exc:
            error = self._transport.error(call, exc)
        except Exception as exc:  # cancelled at close, or a bug: fail the batch's futures
            error = QueratorError(f"produce failed: {exc!r}")
        with self._cond:
            self._in_flight -= 1
            self._sending.discard(batch.group)
            # Retried from the sender thread after the policy's delay, not slept on here
            # (this runs on a gRPC callback thread).
            delay = self._transport.retry_policy.delay(batch.attempt + 1, error) if error and call.retry else None
            if delay is not None:
                batch.attempt += 1
                batch.not_before = time.monotonic() + delay
                self._ready.appendleft(batch)
                self._cond.notify_all()
                return
            self._pending -= len(batch.items)
            if error is None:
                self._duplicates += response.duplicates
            self._cond.notify_all()
        if error is not None:
            for future in batch.futures:
                future.set_exception(error)
        else:
            for future, item_id in zip(batch.futures, response.ids):
                future.set_result(item_id)

    def flush(self, timeout: Seconds | None = None) -> None:
        """Send what is buffered now and wait until nothing is pending."""
        limit = None if timeout is None else time.monotonic() + seconds(timeout)
        with self._cond:
            if self._batch.items:
                self._seal()
                self._cond.notify_all()
            while self._pending:
                remaining = None if limit is None else limit - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self._pending} items still pending")
                self._cond.wait(remaining)

    def close(self, timeout: Seconds | None = None) -> None:
        """Flush, then stop the background thread. Further ``produce()`` calls fail."""
        try:
            self.flush(timeout)
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._thread.join(None if timeout is None else seconds(timeout))

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Failed:
    """Stands in for a call that could not even be started."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def result(self) -> Any:
        raise self.error


def _overloaded(limit: int) -> QueratorError:
    from .errors import Overloaded

    return Overloaded(f"{limit} items are already pending in the producer")


class AsyncProducer(_Producing["AsyncClient"]):
    """Batching producer for :class:`~querator.AsyncClient`.

    ``fut = await producer.produce(item)`` waits only for room (``max_pending``) and
    returns an ``asyncio.Future`` of the id; ``await fut`` when you need it. Use it in
    one event loop; ``async with`` flushes and stops it.
    """

    def _setup(self, client: AsyncClient) -> None:
        self._transport = client._transport  # the client's I/O: its internal interface
        self._batch: _Batch[asyncio.Future[str]] = _Batch()
        self._changed: asyncio.Condition | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Each group's last batch sent: the group's next batch waits for it.
        self._group_tail: dict[str, asyncio.Future[None]] = {}

    def _start(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
            self._slots = asyncio.Semaphore(self._s.max_in_flight)
            self._flusher = asyncio.create_task(self._flush_on_time())
        return self._changed

    async def produce(
        self,
        item: Item | Payload,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, str] | None = None,
        group_key: str | None = None,
    ) -> asyncio.Future[str]:
        """Queue one item; waits while ``max_pending`` items are pending (see :meth:`Producer.produce`)."""
        if self._closed:
            raise RuntimeError("the producer is closed")
        message, cost = self._s.message(item, idempotency_key, metadata, group_key)
        changed = self._start()
        async with changed:
            await changed.wait_for(lambda: self._pending < self._s.max_pending)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if not self._s.fits(self._batch, message, cost):
            await self._seal()
        self._batch.add(message, future, cost)
        self._pending += 1
        if self._s.full(self._batch, 0):
            await self._seal()
        return future

    async def _seal(self) -> None:
        batch, self._batch = self._batch, _Batch()
        if not batch.items:
            return
        assert self._slots is not None
        await self._slots.acquire()
        after = mine = None
        if batch.group:  # sent once the group's batch before it is answered
            after = self._group_tail.get(batch.group)
            mine = self._group_tail[batch.group] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._send(batch, after, mine))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flush_on_time(self) -> None:
        while True:
            if self._batch.items:
                due = self._batch.started + self._s.max_latency - time.monotonic()
                if due <= 0:
                    await self._seal()
                    continue
                await asyncio.sleep(due)
            else:
                await asyncio.sleep(self._s.max_latency or 0.001)

    async def _send(
        self,
        batch: _Batch[asyncio.Future[str]],
        after: asyncio.Future[None] | None = None,
        mine: asyncio.Future[None] | None = None,
    ) -> None:
        assert self._slots is not None and self._changed is not None
        try:
            if after is not None:
                await asyncio.shield(after)
            request = p.produce_request(self._s.queue_name, batch.items, self._timeout)
            try:
                response = await self._transport.invoke(ops.produce_call(request, self._timeout, self._retry))
            except QueratorError as error:
                for future in batch.futures:
                    if not future.done():
                        future.set_exception(error)
            else:
                self._duplicates += response.duplicates
                for future, item_id in zip(batch.futures, response.ids):
                    if not future.done():
                        future.set_result(item_id)
        finally:
            if mine is not None:
                mine.set_result(None)
                if self._group_tail.get(batch.group) is mine:
                    del self._group_tail[batch.group]
            self._slots.release()
            self._pending -= len(batch.items)
            async with self._changed:
                self._changed.notify_all()

    async def flush(self) -> None:
        """Send what is buffered and wait until nothing is pending."""
        if self._changed is None:
            return
        await self._seal()
        async with self._changed:
            await self._changed.wait_for(lambda: self._pending == 0)

    async def close(self) -> None:
        """Flush, then stop. Further ``produce()`` calls fail."""
        try:
            await self.flush()
        finally:
            self._closed = True
            if self._flusher is not None:
                self._flusher.cancel()
                try:
                    await self._flusher
                except asyncio.CancelledError:
                    pass

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
