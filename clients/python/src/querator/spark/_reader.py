"""Reading a queue: a snapshot of the stored items, or a stream of leased micro-batches.

Snapshot (``spark.read``): one Spark partition per queue partition, each listing its
items page by page with ListItems. Nothing is leased; the items stay as they are.

Stream (``spark.readStream``): offsets are batch numbers. Planning batch ``k``
(``latestOffset``) decides how many items each Spark partition ``j`` takes and records
that plan in the offset, which Spark writes to its checkpoint. A task then leases its
share with lease keys ``<stream>:<k>:<j>:<n>`` (``n`` counts calls of at most
``leaseBatchSize`` items). The server answers a key it has seen with exactly the items
still leased under it, so every re-run of ``read()`` -- another action on the same
batch, a task retry, the replay of the batch after a restart -- sees the same items.
While a batch is planned and not yet completed, a thread of the driver extends every
key of it, so a batch may take longer than the queue's lease timeout.

Batch ``k`` is completed (by its keys, idempotently) only after Spark has committed it:
in ``latestOffset(start)`` when ``start`` is the end of batch ``k`` -- Spark calls it
at every trigger after the commit -- and again in ``commit(end)``, which Spark calls
late, only when it plans a next batch that has data.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)

from ..v1 import queue_pb2
from ._options import ReadOptions
from ._rpc import Pending, Rpc, connect, require_queue
from ._schema import leased_columns, stored_batch

log = logging.getLogger("querator.spark")

#: How long a lease under a new key waits when nothing is ready (seconds). Planning
#: only asks for items that were ready, so waiting longer rarely finds more.
LEASE_WAIT_S = 0.05
#: How often the stream re-reads the queue's settings (lease timeout, partitions), seconds.
QUEUE_REFRESH_S = 5.0


# -- snapshot --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ListPartition(InputPartition):
    """One queue partition to list (its scheduled items when ``scheduled``)."""

    partition: int
    scheduled: bool = False


class SnapshotReader(DataSourceReader):
    """``spark.read.format("querator")``: the stored items, nothing leased."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        count = max(1, connect(self.options.connection).queue_info().requested_partitions)
        parts = [ListPartition(p) for p in range(count)]
        if self.options.include_scheduled:
            parts += [ListPartition(p, scheduled=True) for p in range(count)]
        return parts

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, ListPartition)
        rpc = connect(self.options.connection)
        token = ""
        while True:
            items, token = rpc.list_page(
                partition.partition, self.options.page_size, token, scheduled=partition.scheduled
            )
            if items:
                yield stored_batch(partition.partition, items)
            if not token:
                return


# -- stream ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LeasePartition(InputPartition):
    """Spark partition ``index`` of micro-batch ``batch``: ``count`` items, leased ``chunk`` at a time."""

    stream: str
    batch: int
    index: int
    count: int
    chunk: int

    def lease_keys(self) -> list[str]:
        calls = -(-self.count // self.chunk)
        return [lease_key(self.stream, self.batch, self.index, n) for n in range(calls)]


def lease_key(stream: str, batch: int, index: int, call: int) -> str:
    return f"{stream}:{batch}:{index}:{call}"


def plan_partitions(offset: dict[str, Any]) -> list[LeasePartition]:
    """The Spark partitions of the batch that ends at ``offset`` (none for the initial one)."""
    batch = int(offset["batch"]) - 1
    stream, chunk = str(offset["stream"]), int(offset["chunk"])
    return [LeasePartition(stream, batch, j, int(c), chunk) for j, c in enumerate(offset["plan"]) if int(c) > 0]


def batch_keys(offset: dict[str, Any]) -> list[str]:
    return [key for part in plan_partitions(offset) for key in part.lease_keys()]


def split(total: int, parts: int) -> list[int]:
    """``total`` items over at most ``parts`` partitions, as evenly as possible."""
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    return [base + (1 if j < extra else 0) for j in range(parts)]


def read_leased(rpc: Rpc, part: LeasePartition, in_flight: int) -> Iterator[Any]:
    """Lease (or re-lease) the items of one Spark partition under its keys.

    Every key of the partition is asked, always in the same order, whatever the
    answers: a replay must see every key of the batch, since every key is completed
    when the batch is.
    """
    requests, remaining = [], part.count
    for key in part.lease_keys():
        size = min(part.chunk, remaining)
        remaining -= size
        requests.append(rpc.lease_request(key, size, LEASE_WAIT_S))
    timeout = rpc.conn.timeout + LEASE_WAIT_S
    pending: deque[Pending] = deque()
    try:
        for request in requests:
            pending.append(rpc.start("Lease", request, timeout=timeout))
            if len(pending) >= in_flight:  # the keys are fixed, so their order is free
                yield from _leased(rpc, pending.popleft())
        while pending:
            yield from _leased(rpc, pending.popleft())
    finally:
        for call in pending:
            call.cancel()


def _leased(rpc: Rpc, pending: Pending) -> Iterator[Any]:
    reply: queue_pb2.LeaseResponse = rpc.finish(pending)
    if reply.columns.ids:
        yield leased_columns(reply.partition, reply.columns)


class _KeepAlive:
    """A driver thread extending the leases of the batch that runs, until it is completed."""

    def __init__(self, reader: QueratorStreamReader) -> None:
        self._reader = reader
        self._lock = threading.Lock()
        self._batches: dict[int, list[str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, batch: int, keys: list[str]) -> None:
        with self._lock:
            self._batches[batch] = keys
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="querator-keep-alive", daemon=True)
                self._thread.start()

    def forget_below(self, batch: int) -> None:
        with self._lock:
            for k in [k for k in self._batches if k < batch]:
                del self._batches[k]

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self._reader.keep_alive_interval()):
            with self._lock:
                keys = [key for batch_keys in self._batches.values() for key in batch_keys]
            if not keys:
                continue
            try:
                self._reader.rpc().extend_keys(keys)
            except Exception as exc:  # noqa: BLE001 - a missed extension is retried next round
                log.warning("querator stream: extending %d lease keys failed: %s", len(keys), exc)


class QueratorStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("querator")``: micro-batches of items leased by key."""

    def __init__(self, options: ReadOptions) -> None:
        require_queue(options.connection)
        self.options = options
        self._rpc: Rpc | None = None
        self._initial: dict[str, Any] | None = None
        #: Batches below this one are known to be completed (in this process).
        self._completed_below = 0
        #: Trigger.AvailableNow: items ready when the query started, and what each
        #: planned batch takes of them (what it asked for until it is committed, then
        #: what it received).
        self._target: int | None = None
        self._planned: dict[int, int] = {}
        self._lease_timeout_s = 60.0
        self._queue_partitions = 1
        self._queue_read_at: float | None = None
        self._keep_alive = _KeepAlive(self)

    # Spark pickles the reader to run read() on the executors: only the options travel.
    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["options"])  # type: ignore[misc]

    # -- helpers -----------------------------------------------------------------------

    def rpc(self) -> Rpc:
        if self._rpc is None:
            self._rpc = connect(self.options.connection)
            self._refresh_queue()
        return self._rpc

    def _refresh_queue(self) -> int:
        """The queue's partition count; its settings are re-read every few seconds."""
        now = time.monotonic()
        if self._queue_read_at is None or now - self._queue_read_at >= QUEUE_REFRESH_S:
            info = self.rpc().queue_info()
            timeout = info.lease_timeout.seconds + info.lease_timeout.nanos / 1e9
            self._lease_timeout_s = timeout or 60.0
            self._queue_partitions = max(1, info.requested_partitions)
            self._queue_read_at = now
        return self._queue_partitions

    def keep_alive_interval(self) -> float:
        return self.options.keep_alive_interval or max(0.1, self._lease_timeout_s / 3)

    def _complete_before(self, offset: dict[str, Any]) -> None:
        """Complete the batch that ends at ``offset`` (Spark has committed it)."""
        batch = int(offset["batch"]) - 1
        if batch < self._completed_below:
            return
        keys = batch_keys(offset)
        if keys:
            self.rpc().complete_keys(keys)
        self._completed_below = batch + 1
        self._keep_alive.forget_below(batch + 1)

    # -- Spark's calls -----------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        if self._initial is None:
            stream = self.options.stream_id or uuid.uuid4().hex[:16]
            self._initial = {"stream": stream, "batch": 0, "chunk": self.options.lease_batch_size, "plan": []}
        return self._initial

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_items_per_trigger > 0:
            return ReadMaxRows(self.options.max_items_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self.rpc().ready_items()
        self._planned = {}

    def _count_received(self, offset: dict[str, Any]) -> None:
        """Trigger.AvailableNow: count what the batch that ends at ``offset`` received
        instead of what it asked for, before completing it.

        A keyed lease is served from one queue partition and returns fewer items than
        asked when that partition runs short while others still hold ready items;
        counting the items asked for would end the stream before it read them.
        """
        batch = int(offset["batch"]) - 1
        if batch in self._planned and batch >= self._completed_below:
            # Items still leased under the batch's keys: all it received, since Spark
            # committed the batch and the keys are kept alive until completed.
            self._planned[batch] = self.rpc().extend_keys(batch_keys(offset))

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        if self._target is not None:
            self._count_received(start)
        self._complete_before(start)
        partitions = self._refresh_queue()
        wanted = self.rpc().ready_items()
        batch = int(start["batch"])
        if isinstance(limit, ReadMaxRows):
            wanted = min(wanted, limit.max_rows)
        if self._target is not None:
            self._planned.pop(batch, None)
            wanted = min(wanted, self._target - sum(self._planned.values()))
        elif isinstance(limit, ReadMinRows) and wanted < limit.min_rows:
            return start
        if wanted <= 0:
            return start
        if self._target is not None:
            self._planned[batch] = wanted
        plan = split(wanted, self.options.num_partitions or partitions)
        return {"stream": start["stream"], "batch": batch + 1, "chunk": self.options.lease_batch_size, "plan": plan}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        parts = plan_partitions(end)
        if parts:
            self.rpc()
            self._keep_alive.watch(parts[0].batch, [key for part in parts for key in part.lease_keys()])
        return parts

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, LeasePartition)
        return read_leased(connect(self.options.connection), partition, self.options.leases_in_flight)

    def commit(self, end: dict[str, Any]) -> None:
        self._complete_before(end)

    def stop(self) -> None:
        self._keep_alive.stop()
