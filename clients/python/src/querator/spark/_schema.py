"""The one schema of every read mode, and items -> Arrow record batches."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped,unused-ignore]
from google.protobuf import timestamp_pb2
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    IntegerType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ..v1 import queue_pb2, storage_pb2

#: The columns of a read, snapshot or stream. A streaming read's rows are leased items
#: (``is_leased`` true, no ``expire_deadline`` / ``enqueue_at``); a snapshot's rows are
#: stored items as listed, leased or not.
READ_SCHEMA = StructType(
    [
        StructField("id", StringType(), False),
        StructField("partition", IntegerType(), False),
        StructField("payload", BinaryType(), False),
        StructField("kind", StringType(), False),
        StructField("reference", StringType(), False),
        StructField("encoding", StringType(), False),
        StructField("attempts", IntegerType(), False),
        StructField("created_at", TimestampType(), True),
        StructField("lease_deadline", TimestampType(), True),
        StructField("is_leased", BooleanType(), False),
        StructField("enqueue_at", TimestampType(), True),
        StructField("expire_deadline", TimestampType(), True),
        StructField("source_id", StringType(), True),
        # The item's stable id (the id it was produced with): the same on every
        # redelivery, so a sink can deduplicate by it; ``id`` is the lease's.
        StructField("message_id", StringType(), False),
    ]
)


@cache
def arrow_schema() -> Any:
    """READ_SCHEMA as Spark converts it (timestamps in UTC), so batches pass its check."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(READ_SCHEMA, timezone="UTC")


def micros(ts: timestamp_pb2.Timestamp) -> int | None:
    """A Timestamp in microseconds since the epoch; None when unset."""
    seconds, nanos = ts.seconds, ts.nanos
    if not seconds and not nanos:
        return None
    return seconds * 1_000_000 + nanos // 1000


def leased_columns(partition: int, columns: queue_pb2.LeaseColumns) -> Any:
    """One record batch of leased items (all from queue ``partition``), from a columnar
    Lease reply (``LeaseRequest.columnar``)."""
    n = len(columns.ids)
    none: list[None] = [None] * n
    blank = [""] * n
    values: list[list[Any]] = [
        list(columns.ids),
        [partition] * n,
        list(columns.payloads),
        list(columns.kinds) or blank,
        list(columns.references) or blank,
        list(columns.encodings) or blank,
        list(columns.attempts),
        [us or None for us in columns.created_at_us],
        [us or None for us in columns.lease_deadlines_us],
        [True] * n,
        none,
        none,
        [s or None for s in columns.source_ids] or none,
        list(columns.message_ids) or list(columns.ids),
    ]
    return _batch(values)


def stored_batch(partition: int, items: Sequence[storage_pb2.StorageItem]) -> Any:
    """One record batch of stored items as ListItems returns them."""
    n = len(items)
    columns: list[list[Any]] = [
        [i.id for i in items],
        [partition] * n,
        [i.payload for i in items],
        [i.kind for i in items],
        [i.reference for i in items],
        [i.encoding for i in items],
        [i.attempts for i in items],
        [micros(i.created_at) for i in items],
        [micros(i.lease_deadline) if i.is_leased else None for i in items],
        [i.is_leased for i in items],
        [micros(i.enqueue_at) for i in items],
        [micros(i.expire_deadline) for i in items],
        [i.source_id or None for i in items],
        [i.message_id or i.id for i in items],
    ]
    return _batch(columns)


def _batch(columns: list[list[Any]]) -> Any:
    schema = arrow_schema()
    arrays = [pa.array(values, type=field.type) for values, field in zip(columns, schema)]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
