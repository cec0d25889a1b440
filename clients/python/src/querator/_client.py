"""The blocking client: the operations of ``_operations.py`` over a :class:`SyncTransport`."""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable
from datetime import datetime
from types import TracebackType
from typing import Unpack

import grpc

from . import _operations as ops
from . import _protocol as p
from ._base import BaseClient, ProduceCollector
from ._convert import Seconds
from ._items import LeasedItem
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
from ._paging import Pager
from ._transport import SyncTransport
from .errors import QueratorError
from .v1 import queue_pb2


class Client(BaseClient):
    """A blocking Querator client over one gRPC channel; safe to share between threads.

    ``Client("host:2319", timeout=10, bearer_token=...)``; use it as a context manager or
    call :meth:`close`. Every setting is described in :class:`~querator.ClientConfig`.
    """

    def _setup(self) -> None:
        self._transport = SyncTransport(self._config)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel; calls in flight are cancelled."""
        self._transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def wait_ready(self, timeout: Seconds = 10) -> None:
        """Block until the channel is connected; Unavailable after ``timeout``."""
        self._transport.wait_ready(timeout)

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
        priority: int = 0,
        timeout: Seconds | None = None,
        retry: bool | None = None,
        batch_size: int = 1000,
        max_in_flight: int | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> ProduceResult:
        """Add items (bytes, str or :class:`~querator.Item`) to a queue; any number of them.

        They are sent in requests of at most ``batch_size`` (<= 1,000) items and ~4 MB,
        ``max_in_flight`` at a time; each request's items go to one partition, in order.
        ``encoding``/``kind``/``reference``/``enqueue_at``/``priority`` apply to items that
        do not set their own (``priority``: 0 to 9, higher leased first; see :class:`Item`). Returns every id in the order given (``duplicates`` counts the items
        whose ``Item.idempotency_key`` was seen before). ``retry=True`` retries a request
        after UNAVAILABLE, at the risk of storing it twice if only its reply was lost
        (unless every item carries an idempotency key: then a repeat stores nothing).
        ``on_progress`` is called with the number of items stored so far. With the
        client's ``tracing=True`` each item's metadata also gets the current trace
        context (:mod:`querator.tracing`).
        """
        plan = self._produce_plan(
            queue_name, items, encoding, kind, reference, enqueue_at, priority, timeout, retry, batch_size
        )
        window = max_in_flight or self._config.max_in_flight
        collector = ProduceCollector(on_progress)
        inflight: collections.deque[tuple[int, ops.Call, grpc.Future[queue_pb2.ProduceResponse]]] = collections.deque()

        def finish_oldest() -> None:
            index, call, future = inflight.popleft()
            try:
                response = self._transport.finish(call, future)
            except QueratorError as error:
                collector.failed(error)
                return
            collector.stored(index, list(response.ids), response.partition, response.duplicates)

        for index, call, size in plan:
            while len(inflight) >= window:
                finish_oldest()
            if collector.error is not None:
                break
            collector.sent(index, size)
            inflight.append((index, call, self._transport.start(call)))
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
        make = functools.partial(LeasedItem, self)
        return self._transport.run(
            ops.lease(self._config, make, queue_name, batch_size, wait, client_id, complete, lease_key)
        )

    def complete(
        self,
        items: p.ItemsArg = (),
        *,
        lease_keys: Iterable[str] | str | None = None,
        queue_name: str | None = None,
        timeout: Seconds | None = None,
    ) -> CompleteResult:
        """Complete leased items (LeasedItem or ItemRef, one or many).

        Each (queue, partition) group of up to 1,000 ids is one all-or-nothing request:
        one lost lease (:class:`~querator.LeaseLost`) fails its whole request.

        ``lease_keys`` (with ``queue_name``) completes every item still leased under
        each key. Idempotent: a key already completed or forgotten is no error, so these
        requests are retried after UNAVAILABLE.

        Returns a :class:`~querator.CompleteResult`: ``already_completed`` names the ids
        an earlier send had completed (the request was sent again after a lost answer,
        ``retry_complete``), ``key_items_completed`` counts what ``lease_keys`` completed.
        """
        return self._transport.run(ops.complete(self._config, items, lease_keys, queue_name, timeout))

    def retry(
        self,
        items: p.ItemsArg,
        *,
        at: datetime | None = None,
        in_: Seconds | None = None,
        dead: bool = False,
        error: str | BaseException = "",
        timeout: Seconds | None = None,
    ) -> RetryResult:
        """Give leased items back: to the tail now, at ``at`` / after ``in_``, or ``dead``.

        ``dead=True`` sends them to the dead-letter queue (deleted when there is none).
        An item out of attempts (the queue's ``max_attempts``) is dead-lettered anyway.
        Returns the ids of the items dead-lettered (a :class:`~querator.RetryResult`,
        a list: empty when every item was retried); a LeasedItem's ``state`` says the
        same. Its ``already_retried`` names the ids an earlier send had retried (the
        request was sent again after a lost answer): they were not retried twice.

        ``error``: what went wrong, kept as each item's ``last_error`` (the next
        lease's handler and the dead letter see it): text, or an exception, sent as
        :func:`~querator.failure_text` makes it (type, message, last traceback frames).
        The server keeps at most 2,048 bytes; empty keeps the error the items had.
        """
        return self._transport.run(ops.retry(self._config, self._orders_for_retry(items, at, in_, dead, error), timeout))

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
        return self._transport.run(ops.extend(self._config, items, lease_timeout, lease_keys, queue_name, timeout))

    # -- QueuesService ------------------------------------------------------------------

    def create_queue(self, name: str, *, timeout: Seconds | None = None, **settings: Unpack[QueueSettings]) -> QueueInfo:
        """Create a queue; unset settings take the server's defaults. QueueExists if taken.

        Settings (:class:`~querator.QueueSettings`): ``dead_queue``, ``reference``,
        ``lease_timeout``, ``expire_timeout``, ``max_attempts``, ``partitions``,
        ``dedup_window``, ``lease_key_ttl``; durations as seconds, timedelta or "30s".
        """
        return self._transport.run(ops.create_queue(self._config, name, settings, timeout))

    def get_queue(self, name: str, *, timeout: Seconds | None = None) -> QueueInfo:
        """A queue's settings; QueueNotFound when there is none of that name."""
        return self._transport.run(ops.get_queue(self._config, name, timeout))

    def list_queues(self, *, page_size: int = 0, page_token: str = "", timeout: Seconds | None = None) -> Pager[QueueInfo]:
        """All queues sorted by name, fetched ``page_size`` at a time as iteration goes."""
        page = ops.list_queues(self._config, page_size, timeout)
        return Pager(lambda token: self._transport.run(page(token)), page_token)

    def update_queue(self, name: str, *, timeout: Seconds | None = None, **settings: Unpack[QueueSettings]) -> QueueInfo:
        """Change exactly the settings given (``dead_queue=""`` removes the DLQ); the
        settings are those of :meth:`create_queue`."""
        return self._transport.run(ops.update_queue(self._config, name, settings, timeout))

    def pause_queue(self, name: str, *, produce: bool = False, timeout: Seconds | None = None) -> QueueInfo:
        """Stop the queue handing out items until :meth:`resume_queue`: leases wait (and
        answer empty at their ``wait``), while produce, completions, retries, lease
        expiry, scheduled items and dead-lettering go on. ``produce=True`` refuses
        produce too (:class:`~querator.FailedPrecondition`). The pause is stored with the
        queue (it outlives restarts and holds on every node of a cluster). Admin key."""
        return self._transport.run(ops.pause_queue(self._config, name, produce, timeout))

    def resume_queue(self, name: str, *, timeout: Seconds | None = None) -> QueueInfo:
        """End a pause: waiting leases get items again. A queue not paused is left as is."""
        return self._transport.run(ops.resume_queue(self._config, name, timeout))

    def delete_queue(self, name: str, *, force: bool = False, timeout: Seconds | None = None) -> None:
        """Delete a queue and its items; one that still holds items needs ``force=True``."""
        self._transport.run(ops.delete_queue(self._config, name, force, timeout))

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
        self._transport.run(ops.clear_queue(self._config, name, ready, scheduled, destructive, timeout))

    def queue_stats(self, name: str, *, timeout: Seconds | None = None) -> QueueStats:
        """Counts per partition; cheap enough to call every second."""
        return self._transport.run(ops.queue_stats(self._config, name, timeout))

    # -- StorageService ------------------------------------------------------------------

    def list_items(
        self, queue_name: str, *, partition: int = 0, page_size: int = 0, page_token: str = "", timeout: Seconds | None = None
    ) -> Pager[StoredItem]:
        """Ready and leased items of one partition in FIFO order."""
        page = ops.list_items(self._config, queue_name, partition, page_size, timeout, scheduled=False)
        return Pager(lambda token: self._transport.run(page(token)), page_token)

    def list_scheduled_items(
        self, queue_name: str, *, partition: int = 0, page_size: int = 0, page_token: str = "", timeout: Seconds | None = None
    ) -> Pager[StoredItem]:
        """Scheduled items of one partition, by due time."""
        page = ops.list_items(self._config, queue_name, partition, page_size, timeout, scheduled=True)
        return Pager(lambda token: self._transport.run(page(token)), page_token)

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
        return self._transport.run(ops.import_items(self._config, queue_name, items, partition, timeout))

    def delete_items(
        self, queue_name: str, ids: Iterable[str], *, partition: int = 0, timeout: Seconds | None = None
    ) -> None:
        """Delete items by id, whatever their state; unknown ids are ignored."""
        self._transport.run(ops.delete_items(self._config, queue_name, ids, partition, timeout))

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
        return self._transport.run(
            ops.redrive_items(self._config, queue_name, to, kind, dead_reason, limit, timeout)
        )

    # -- KeysService (servers with auth on; an admin key for "*") -----------------------------

    def create_key(
        self, role: str, queues: Iterable[str] | str, *, description: str = "", timeout: Seconds | None = None
    ) -> CreatedKey:
        """Create an API key: ``role`` is producer, consumer or admin; ``queues`` name patterns.

        The result's ``token`` is shown only here (the server keeps a hash). Not retried:
        a repeat would make a second key.
        """
        return self._transport.run(ops.create_key(self._config, role, queues, description, timeout))

    def list_keys(self, *, timeout: Seconds | None = None) -> list[ApiKey]:
        """Every key, sorted by id (never the tokens)."""
        return self._transport.run(ops.list_keys(self._config, timeout))

    # -- queues set aside by cluster nodes (docs/cluster.md) --------------------------------

    def list_set_aside_queues(self, node_id: str = "", *, timeout: Seconds | None = None) -> SetAsideQueues:
        """The queues cluster nodes have set aside (``node_id``: only that node's; default
        every live node's). Needs an admin key for ``"*"``."""
        return self._transport.run(ops.list_set_aside_queues(self._config, node_id, timeout))

    def remove_set_aside_queue(
        self, node_id: str, set_aside_id: str, *, timeout: Seconds | None = None
    ) -> SetAsideQueue:
        """Delete a set-aside queue and its items from ``node_id``'s disk, for good."""
        return self._transport.run(ops.remove_set_aside_queue(self._config, node_id, set_aside_id, timeout))

    def revoke_key(self, key_id: str, *, timeout: Seconds | None = None) -> None:
        """Delete a key; calls with its token fail with Unauthenticated from then on."""
        self._transport.run(ops.revoke_key(self._config, key_id, timeout))

    # -- ClusterService -----------------------------------------------------------------------

    def cluster_info(self, *, check_members: bool = False, timeout: Seconds | None = None) -> ClusterView:
        """The answering node's view of its cluster: members (address, live, fenced) and
        each queue's partition homes, at a catalog revision (a single server answers as
        one node). With ``check_members`` the node also asks each other live member
        whether it is fenced (up to 2 s for one that does not answer)."""
        return self._transport.run(ops.cluster_info(self._config, check_members, timeout))

    def move_queue(
        self, queue: str, node_id: str, *, from_node_id: str = "", timeout: Seconds | None = None
    ) -> ReplicaSet:
        """Make ``node_id`` serve replicated ``queue``: the primary is handed over to its
        in-sync copy there, or, on a node without a copy, the primary's copy moves there
        (added, caught up, then the old one dropped). With ``from_node_id``, that node's
        copy moves to ``node_id`` instead (the primary moving with it if it was the
        primary). See docs/cluster.md, Replication; returns where it is kept now. Needs
        an admin key for "*". Not retried; calling it again finishes a move cut short."""
        return self._transport.run(ops.move_queue(self._config, queue, node_id, timeout, from_node_id))

    def drain_node(self, node_id: str, *, timeout: Seconds | None = None) -> tuple[list[str], list[str]]:
        """Move every replicated queue's primary and copy off ``node_id``: primaries to
        another live in-sync copy, copies to live nodes without one (caught up first):
        (queues moved, queues kept with why). Needs an admin key for "*"."""
        return self._transport.run(ops.drain_node(self._config, node_id, timeout))

    def retire_node_discarding_data(self, node_id: str, *, timeout: Seconds | None = None) -> int:
        """Retire a dead node for good: its partitions are recreated, **empty**, on the
        live nodes, and the items they held are lost (docs/cluster.md). Needs an admin
        key for "*"; raises FailedPrecondition while the node is live, NotFound when it
        homes no partition. Returns how many partitions were recreated. Not retried."""
        return self._transport.run(ops.retire_node_discarding_data(self._config, node_id, timeout))

    def retire_node(self, node_id: str, *, promote_copies_behind: bool = False, timeout: Seconds | None = None) -> RetiredNode:
        """``retire_node_discarding_data`` answering all it did. ``promote_copies_behind``:
        a replicated queue whose only in-sync copy the node held gets its most advanced
        other copy as primary, LOSING the changes acknowledged after that copy's
        position (``RetiredNode.copies_promoted``), and one the node was the primary of
        with no live copy anywhere is re-made empty (its items lost, its partitions in
        ``partitions_recreated``); without it such a retire raises
        FailedPrecondition and retires nothing. Not retried."""
        return self._transport.run(ops.retire_node(self._config, node_id, promote_copies_behind, timeout))


__all__ = ["Client"]
