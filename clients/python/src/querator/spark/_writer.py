"""Writing a DataFrame into a queue: batch jobs and streaming queries.

Every row gets an idempotency key, so a task that runs twice (a retry, a speculative
copy, a replayed micro-batch) stores nothing twice:

- by default ``spark-<job>:<partition>:<row>`` for a batch job (``<job>`` is made on the
  driver when the job is planned, the same for every attempt of its tasks) and
  ``spark-<query id>:<batch id>:<partition>:<row>`` for a streaming query (the query id
  lives in the checkpoint, so a batch replayed after a restart has the same keys);
- the ``idempotency_key`` column, or the column named by the ``keyColumn`` option, when
  there is one: then re-running the whole job adds nothing either.

``<row>`` is the row's position in its Spark partition, stable when the input is read in
the same order on every attempt (true of files and tables; sort first if not).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped,unused-ignore]
import pyarrow.compute as pc  # type: ignore[import-untyped,unused-ignore]
from google.protobuf import timestamp_pb2
from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    BinaryType,
    DataType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from .._config import BATCH_BYTES
from ..v1 import queue_pb2
from ._options import OptionError, WriteOptions
from ._rpc import Pending, Rpc, connect, require_queue

log = logging.getLogger("querator.spark")

PAYLOAD = "payload"
KEY = "idempotency_key"
TEXT_COLUMNS = ("kind", "reference", "encoding")
ENQUEUE_AT = "enqueue_at"
#: Local properties Spark sets on the tasks of a micro-batch.
QUERY_ID_PROPERTY = "sql.streaming.queryId"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
#: How far in the future the abort clean-up parks the probes it stores (never leasable).
_PROBE_DELAY_S = 365 * 24 * 3600


@dataclass(frozen=True, slots=True)
class WriteMessage(WriterCommitMessage):
    """What one task reports to the driver: how many rows it sent, how many were new."""

    partition: int
    rows: int
    duplicates: int


def check_input(schema: StructType, key_column: str) -> None:
    """Fail on the driver, before any task runs, for columns the writer cannot use."""
    fields = {f.name: f.dataType for f in schema.fields}
    if PAYLOAD not in fields:
        raise OptionError(f"the DataFrame needs a '{PAYLOAD}' column (binary or string); it has {sorted(fields)}")
    _expect(PAYLOAD, fields[PAYLOAD], (BinaryType, StringType))
    for name in TEXT_COLUMNS:
        if name in fields:
            _expect(name, fields[name], (StringType,))
    if ENQUEUE_AT in fields:
        _expect(ENQUEUE_AT, fields[ENQUEUE_AT], (TimestampType, TimestampNTZType))
    if key_column and key_column not in fields:
        raise OptionError(f"option 'keyColumn': the DataFrame has no column {key_column!r}; it has {sorted(fields)}")
    if key_column and KEY in fields and key_column != KEY:
        raise OptionError(f"give either an '{KEY}' column or the 'keyColumn' option, not both")


def _expect(name: str, actual: DataType, allowed: tuple[type[DataType], ...]) -> None:
    if not isinstance(actual, allowed):
        wanted = " or ".join(t.typeName() for t in allowed)
        raise OptionError(f"column {name!r} must be {wanted}, got {actual.simpleString()}")


def _timestamp(us: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=us // 1_000_000, nanos=(us % 1_000_000) * 1000)


def _texts(batch: Any, name: str) -> list[str] | None:
    index = batch.schema.get_field_index(name)
    if index < 0:
        return None
    column = batch.column(index)
    if column.type != pa.string() and column.type != pa.large_string():
        column = pc.cast(column, pa.string())
    return column.to_pylist()  # type: ignore[no-any-return]


def rows_to_items(batch: Any, key_column: str, key_prefix: str, first_row: int) -> list[queue_pb2.ProduceItem]:
    """The produce items of one Arrow record batch, rows numbered from ``first_row``."""
    payload_col = batch.column(batch.schema.get_field_index(PAYLOAD))
    if pa.types.is_string(payload_col.type) or pa.types.is_large_string(payload_col.type):
        payload_col = pc.cast(payload_col, pa.binary())
    payloads: list[bytes | None] = payload_col.to_pylist()
    n = len(payloads)
    if key_column:
        keys = _texts(batch, key_column)
        assert keys is not None
        if any(k is None or k == "" for k in keys):
            raise ValueError(f"the key column {key_column!r} holds a null or empty value")
    else:
        keys = [f"{key_prefix}{first_row + i}" for i in range(n)]
    items = [queue_pb2.ProduceItem(payload=p or b"", idempotency_key=k) for p, k in zip(payloads, keys)]
    for name in TEXT_COLUMNS:
        values = _texts(batch, name)
        if values is not None:
            for item, value in zip(items, values):
                if value:
                    setattr(item, name, value)
    index = batch.schema.get_field_index(ENQUEUE_AT)
    if index >= 0:
        column = batch.column(index)
        micros = pc.cast(pc.cast(column, pa.timestamp("us", tz=column.type.tz)), pa.int64())
        for item, us in zip(items, micros.to_pylist()):
            if us is not None:
                item.enqueue_at.CopyFrom(_timestamp(us))
    return items


def _requests(items: list[queue_pb2.ProduceItem], batch_size: int) -> Iterator[list[queue_pb2.ProduceItem]]:
    """Split items into requests of at most ``batch_size`` items and about 4 MB."""
    start, size = 0, 0
    for i, item in enumerate(items):
        item_bytes = len(item.payload) + len(item.idempotency_key) + 64
        if i > start and (i - start >= batch_size or size + item_bytes > BATCH_BYTES):
            yield items[start:i]
            start, size = i, 0
        size += item_bytes
    if start < len(items):
        yield items[start:]


class _Sender:
    """Produces requests with up to ``in_flight`` of them outstanding."""

    def __init__(self, rpc: Rpc, in_flight: int) -> None:
        self.rpc = rpc
        self.in_flight = in_flight
        self.pending: deque[Pending] = deque()
        self.rows = 0
        self.duplicates = 0

    def send(self, items: list[queue_pb2.ProduceItem]) -> None:
        while len(self.pending) >= self.in_flight:
            self._settle_oldest()
        self.pending.append(self.rpc.start("Produce", self.rpc.produce_request(items)))

    def flush(self) -> None:
        while self.pending:
            self._settle_oldest()

    def cancel(self) -> None:
        for pending in self.pending:
            pending.cancel()
        self.pending.clear()

    def _settle_oldest(self) -> None:
        pending = self.pending.popleft()
        response: queue_pb2.ProduceResponse = self.rpc.finish(pending)
        self.rows += len(pending.call.request.items)  # type: ignore[attr-defined]
        self.duplicates += response.duplicates


def key_column_of(schema: StructType, options: WriteOptions) -> str:
    """The column that holds the keys; empty for the default per-row keys."""
    return options.key_column or (KEY if KEY in schema.fieldNames() else "")


def write_partition(
    options: WriteOptions, key_column: str, batches: Iterator[Any], partition: int, key_prefix: str
) -> WriteMessage:
    """Produce every row of this task's partition; default keys start with ``key_prefix``."""
    sender = _Sender(connect(options.connection), options.in_flight)
    row = 0
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            items = rows_to_items(batch, key_column, key_prefix, row)
            row += len(items)
            for request in _requests(items, options.batch_size):
                sender.send(request)
        sender.flush()
    except BaseException:
        sender.cancel()
        raise
    return WriteMessage(partition, sender.rows, sender.duplicates)


class QueratorWriter(DataSourceArrowWriter):
    """``df.write.format("querator")``: one job, keys ``spark-<job>:<partition>:<row>``."""

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        require_queue(options.connection)
        check_input(schema, options.key_column)
        self.options = options
        self.key_column = key_column_of(schema, options)
        self.job = uuid.uuid4().hex[:16]

    def write(self, iterator: Iterator[Any]) -> WriteMessage:
        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        prefix = f"spark-{self.job}:{partition}:"
        return write_partition(self.options, self.key_column, iterator, partition, prefix)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        sent = [m for m in messages if isinstance(m, WriteMessage)]
        rows = sum(m.rows for m in sent)
        duplicates = sum(m.duplicates for m in sent)
        log.info(
            "querator write %s: %d rows, %d stored, %d already there", self.job, rows, rows - duplicates, duplicates
        )

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Remove what this job stored, so running it again stores each row once.

        Only with the default keys: they are unique to this job, so a re-run would
        repeat anything left behind. With a key column the stored rows stay, and a
        re-run stores only the missing ones.
        """
        if self.key_column:
            log.warning("querator write %s aborted; rows stored so far stay (keys from a column)", self.job)
            return
        rpc = connect(self.options.connection)
        removed = 0
        for index, message in enumerate(messages):
            partition = message.partition if isinstance(message, WriteMessage) else index
            known = message.rows if isinstance(message, WriteMessage) else None
            removed += remove_stored(rpc, f"spark-{self.job}:{partition}:", known, self.options)
        log.warning("querator write %s aborted; removed the %d items it had stored", self.job, removed)


def remove_stored(rpc: Rpc, prefix: str, rows: int | None, options: WriteOptions) -> int:
    """Delete the items stored under keys ``prefix + n``; return how many were found.

    A key's item is found by producing the key again: a duplicate answers the stored
    item's id. A key that was never used stores a probe scheduled a year ahead (never
    leasable), deleted at once; it also spends the key, so a task still running
    cannot store it later. ``rows`` is the partition's row count when its task
    reported one; otherwise probing goes on until a gap longer than anything the
    task's in-flight requests could have left.
    """
    step = 1000
    due = int((time.time() + _PROBE_DELAY_S) * 1_000_000)
    partitions = max(1, rpc.queue_info().requested_partitions)
    gap_limit = options.in_flight * options.batch_size + step
    found, start, gap = 0, 0, 0
    while (start < rows) if rows is not None else (gap < gap_limit):
        count = min(step, rows - start) if rows is not None else step
        keys = [f"{prefix}{start + i}" for i in range(count)]
        probes = [queue_pb2.ProduceItem(idempotency_key=k, enqueue_at=_timestamp(due)) for k in keys]
        reply = rpc.produce(probes)
        found += reply.duplicates
        gap = gap + count if reply.duplicates == 0 else 0
        _delete_anywhere(rpc, partitions, reply.ids)
        start += count
    return found


def _delete_anywhere(rpc: Rpc, partitions: int, ids: Sequence[str]) -> None:
    """Delete ``ids`` whatever partition holds them (an id elsewhere is ignored)."""
    for partition in range(partitions):
        rpc.delete_items(partition, ids)


class QueratorStreamWriter(DataSourceStreamArrowWriter):
    """``writeStream.format("querator")``: keys ``spark-<query>:<batch>:<partition>:<row>``.

    A micro-batch replayed after a failure or a restart has the same query id (kept in
    the checkpoint) and batch id, so its rows are stored once. An aborted micro-batch
    leaves its rows: the query fails, and its restart replays the batch.
    """

    def __init__(self, options: WriteOptions, schema: StructType) -> None:
        require_queue(options.connection)
        check_input(schema, options.key_column)
        self.options = options
        self.key_column = key_column_of(schema, options)
        self.fallback_id = uuid.uuid4().hex[:16]

    def write(self, iterator: Iterator[Any]) -> WriteMessage:
        context = TaskContext.get()
        query = batch = None
        partition = 0
        if context is not None:
            query = context.getLocalProperty(QUERY_ID_PROPERTY)
            batch = context.getLocalProperty(BATCH_ID_PROPERTY)
            partition = context.partitionId()
        prefix = f"spark-{query or self.fallback_id}:{batch or 0}:{partition}:"
        return write_partition(self.options, self.key_column, iterator, partition, prefix)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        sent = [m for m in messages if isinstance(m, WriteMessage)]
        log.debug("querator stream write batch %d: %d rows", batchId, sum(m.rows for m in sent))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning("querator stream write batch %d aborted; its restart stores only the missing rows", batchId)
