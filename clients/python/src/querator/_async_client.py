"""The asyncio client: the operations of ``_operations.py`` over an :class:`AsyncTransport`."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from datetime import datetime
from types import TracebackType
from typing import TypeVar, Unpack

from . import _operations as ops
from . import _protocol as p
from ._base import BaseClient, ProduceCollector
from ._convert import Seconds
from ._items import AsyncLeasedItem
from ._models import (
    ApiKey,
    ClusterView,
    CompleteResult,
    CreatedKey,
    DeadReason,
    ExtendResult,
    Item,
    Payload,
    ProduceResult,
    QueueInfo,
    QueueSettings,
    QueueStats,
    RedriveResult,
    ReplicaSet,
    RetiredNode,
    RetryResult,
    SetAsideQueue,
    SetAsideQueues,
    StoredItem,
)
from ._paging import AsyncPager
from ._transport import AsyncTransport
from .errors import QueratorError

T = TypeVar("T")


class AsyncClient(BaseClient):
    """An asyncio Querator client over one ``grpc.aio`` channel.

    Same constructor and methods as :class:`~querator.Client`, as coroutines. The
    channel is opened on first use inside the running event loop; use ``async with``
    or ``await client.close()``.
    """

    def _setup(self) -> None:
        self._transport = AsyncTransport(self._config)

    # -- lifecycle ---------------------------------------------------------------------

    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        await self._transport.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def wait_ready(self, timeout: Seconds = 10) -> None:
        """Wait until the channel is connected; Unavailable after ``timeout``."""
        await self._transport.wait_ready(timeout)

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
        priority: int = 0,
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
        window = max_in_flight or self._config.max_in_flight
        collector = ProduceCollector(on_progress)

        async def send(index: int, call: ops.Call) -> None:
            try:
                response = await self._transport.invoke(call)
            except QueratorError as error:
                collector.failed(error)
                return
            collector.stored(index, list(response.ids), response.partition, response.duplicates)

        pending: set[asyncio.Task[None]] = set()
        try:
            plan = self._produce_plan(
                queue_name, items, encoding, kind, reference, enqueue_at, priority, timeout, retry, batch_size
            )
            for index, call, size in plan:
                while len(pending) >= window:
                    _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if collector.error is not None:
                    break
                collector.sent(index, size)
                pending.add(asyncio.create_task(send(index, call)))
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
        make = functools.partial(AsyncLeasedItem, self)
        op = ops.lease(self._config, make, queue_name, batch_size, wait, client_id, complete, lease_key)
        return await self._transport.run(op)

    async def complete(
        self,
        items: p.ItemsArg = (),
        *,
        lease_keys: Iterable[str] | str | None = None,
        queue_name: str | None = None,
        timeout: Seconds | None = None,
    ) -> CompleteResult:
        """Complete leased items, or by ``lease_keys``; returns which ids were done
        already; see :meth:`querator.Client.complete`."""
        return await self._transport.run(ops.complete(self._config, items, lease_keys, queue_name, timeout))

    async def retry(
        self,
        items: p.ItemsArg,
        *,
        at: datetime | None = None,
        in_: Seconds | None = None,
        dead: bool = False,
        error: str | BaseException = "",
        timeout: Seconds | None = None,
    ) -> RetryResult:
        """Give leased items back; returns the ids dead-lettered (and ``already_retried``);
        see :meth:`querator.Client.retry`."""
        return await self._transport.run(ops.retry(self._config, self._orders_for_retry(items, at, in_, dead, error), timeout))

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
        return await self._transport.run(ops.extend(self._config, items, lease_timeout, lease_keys, queue_name, timeout))

    # -- QueuesService ------------------------------------------------------------------

    async def create_queue(
        self, name: str, *, timeout: Seconds | None = None, **settings: Unpack[QueueSettings]
    ) -> QueueInfo:
        """Create a queue; see :meth:`querator.Client.create_queue`."""
        return await self._transport.run(ops.create_queue(self._config, name, settings, timeout))

    async def get_queue(self, name: str, *, timeout: Seconds | None = None) -> QueueInfo:
        """A queue's settings; see :meth:`querator.Client.get_queue`."""
        return await self._transport.run(ops.get_queue(self._config, name, timeout))

    def list_queues(
        self, *, page_size: int = 0, page_token: str = "", timeout: Seconds | None = None
    ) -> AsyncPager[QueueInfo]:
        """All queues sorted by name: ``async for queue in client.list_queues()``."""
        page = ops.list_queues(self._config, page_size, timeout)
        return AsyncPager(lambda token: self._transport.run(page(token)), page_token)

    async def update_queue(
        self, name: str, *, timeout: Seconds | None = None, **settings: Unpack[QueueSettings]
    ) -> QueueInfo:
        """Change exactly the settings given; see :meth:`querator.Client.update_queue`."""
        return await self._transport.run(ops.update_queue(self._config, name, settings, timeout))

    async def pause_queue(self, name: str, *, produce: bool = False, timeout: Seconds | None = None) -> QueueInfo:
        """Pause the queue's leases (and produce with ``produce=True``); see :meth:`querator.Client.pause_queue`."""
        return await self._transport.run(ops.pause_queue(self._config, name, produce, timeout))

    async def resume_queue(self, name: str, *, timeout: Seconds | None = None) -> QueueInfo:
        """End a pause; see :meth:`querator.Client.resume_queue`."""
        return await self._transport.run(ops.resume_queue(self._config, name, timeout))

    async def delete_queue(self, name: str, *, force: bool = False, timeout: Seconds | None = None) -> None:
        """Delete a queue; see :meth:`querator.Client.delete_queue`."""
        await self._transport.run(ops.delete_queue(self._config, name, force, timeout))

    async def clear_queue(
        self,
        name: str,
        *,
        ready: bool = True,
        scheduled: bool = False,
        destructive: bool = False,
        timeout: Seconds | None = None,
    ) -> None:
        """Remove items; see :meth:`querator.Client.clear_queue`."""
        await self._transport.run(ops.clear_queue(self._config, name, ready, scheduled, destructive, timeout))

    async def queue_stats(self, name: str, *, timeout: Seconds | None = None) -> QueueStats:
        """Counts per partition; see :meth:`querator.Client.queue_stats`."""
        return await self._transport.run(ops.queue_stats(self._config, name, timeout))

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
        page = ops.list_items(self._config, queue_name, partition, page_size, timeout, scheduled=False)
        return AsyncPager(lambda token: self._transport.run(page(token)), page_token)

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
        page = ops.list_items(self._config, queue_name, partition, page_size, timeout, scheduled=True)
        return AsyncPager(lambda token: self._transport.run(page(token)), page_token)

    async def import_items(
        self,
        queue_name: str,
        items: Iterable[StoredItem | Item | Payload],
        *,
        partition: int = 0,
        timeout: Seconds | None = None,
    ) -> list[str]:
        """Store items as given; see :meth:`querator.Client.import_items`."""
        return await self._transport.run(ops.import_items(self._config, queue_name, items, partition, timeout))

    async def delete_items(
        self, queue_name: str, ids: Iterable[str], *, partition: int = 0, timeout: Seconds | None = None
    ) -> None:
        """Delete items by id; see :meth:`querator.Client.delete_items`."""
        await self._transport.run(ops.delete_items(self._config, queue_name, ids, partition, timeout))

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
        return await self._transport.run(
            ops.redrive_items(self._config, queue_name, to, kind, dead_reason, limit, timeout)
        )

    # -- KeysService --------------------------------------------------------------------------

    async def create_key(
        self,
        role: str,
        queues: Iterable[str] | str,
        *,
        description: str = "",
        timeout: Seconds | None = None,
    ) -> CreatedKey:
        """Create an API key; see :meth:`querator.Client.create_key`."""
        return await self._transport.run(ops.create_key(self._config, role, queues, description, timeout))

    async def list_keys(self, *, timeout: Seconds | None = None) -> list[ApiKey]:
        """Every key, sorted by id (never the tokens)."""
        return await self._transport.run(ops.list_keys(self._config, timeout))

    # -- queues set aside by cluster nodes (docs/cluster.md) --------------------------------

    async def list_set_aside_queues(self, node_id: str = "", *, timeout: Seconds | None = None) -> SetAsideQueues:
        """See :meth:`querator.Client.list_set_aside_queues`."""
        return await self._transport.run(ops.list_set_aside_queues(self._config, node_id, timeout))

    async def remove_set_aside_queue(
        self, node_id: str, set_aside_id: str, *, timeout: Seconds | None = None
    ) -> SetAsideQueue:
        """See :meth:`querator.Client.remove_set_aside_queue`."""
        return await self._transport.run(ops.remove_set_aside_queue(self._config, node_id, set_aside_id, timeout))

    async def revoke_key(self, key_id: str, *, timeout: Seconds | None = None) -> None:
        """Revoke a key; see :meth:`querator.Client.revoke_key`."""
        await self._transport.run(ops.revoke_key(self._config, key_id, timeout))

    # -- ClusterService ---------------------------------------------------------------------

    async def cluster_info(self, *, check_members: bool = False, timeout: Seconds | None = None) -> ClusterView:
        """The answering node's view of its cluster; see :meth:`querator.Client.cluster_info`."""
        return await self._transport.run(ops.cluster_info(self._config, check_members, timeout))

    async def move_queue(
        self, queue: str, node_id: str, *, from_node_id: str = "", timeout: Seconds | None = None
    ) -> ReplicaSet:
        """Move a replicated queue's primary or a copy; see :meth:`querator.Client.move_queue`."""
        return await self._transport.run(ops.move_queue(self._config, queue, node_id, timeout, from_node_id))

    async def drain_node(self, node_id: str, *, timeout: Seconds | None = None) -> tuple[list[str], list[str]]:
        """Move a node's primaries and copies off it; see :meth:`querator.Client.drain_node`."""
        return await self._transport.run(ops.drain_node(self._config, node_id, timeout))

    async def retire_node_discarding_data(self, node_id: str, *, timeout: Seconds | None = None) -> int:
        """Retire a dead node, losing its items; see :meth:`querator.Client.retire_node_discarding_data`."""
        return await self._transport.run(ops.retire_node_discarding_data(self._config, node_id, timeout))

    async def retire_node(
        self, node_id: str, *, promote_copies_behind: bool = False, timeout: Seconds | None = None
    ) -> RetiredNode:
        """Retire a dead node, answering all it did; see :meth:`querator.Client.retire_node`."""
        return await self._transport.run(ops.retire_node(self._config, node_id, promote_copies_behind, timeout))


__all__ = ["AsyncClient"]
