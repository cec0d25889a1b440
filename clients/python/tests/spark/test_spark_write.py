"""Spark connector: batch writes (exactly once, task failures, re-runs, abort) and snapshot reads."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from querator.embedded import EmbeddedServer

from spark_helpers import Stubs, session_fixture, srv, stubs  # noqa: F401 - fixtures

# local[2,2]: two cores, and a failed task is tried once more before its job fails.
spark = session_fixture("local[2,2]")


def write(df: Any, srv: EmbeddedServer, queue: str, **options: str) -> None:
    writer = df.write.format("querator").option("address", srv.address).option("queue", queue).mode("append")
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.save()


def numbers(spark: Any, n: int, partitions: int) -> Any:
    return spark.range(n).selectExpr("cast(id as string) as payload").repartition(partitions)


def test_rows_from_four_partitions_arrive_exactly_once(spark: Any, srv: EmbeddedServer, stubs: Stubs) -> None:
    queue = stubs.create(requested_partitions=2)
    df = numbers(spark, 10_000, 4)
    assert df.rdd.getNumPartitions() == 4
    write(df, srv, queue, batchSize="500")
    assert Counter(stubs.payloads(queue)) == Counter(str(i).encode() for i in range(10_000))


def failing(address: str, queue: str, partition: int, first_attempt_only: bool, stored: int, marker: str) -> Any:
    """A partition function that fails ``partition`` once the writer has stored ``stored`` items."""

    def run(index: int, rows: Any) -> Any:
        # Self-contained: Spark ships it to its Python workers, which cannot import this module.
        import time

        import grpc
        from pyspark import TaskContext

        from querator.v1 import queues_pb2, queues_pb2_grpc

        def stored_count() -> int:
            with grpc.insecure_channel(address) as channel:
                stub = queues_pb2_grpc.QueuesServiceStub(channel)
                reply = stub.GetQueueStats(queues_pb2.GetQueueStatsRequest(queue_name=queue), timeout=10)
                return sum(p.total for p in reply.partitions)

        attempt = TaskContext.get().attemptNumber()
        doomed = index == partition and (attempt == 0 or not first_attempt_only)
        yield from rows
        if doomed:
            deadline = time.monotonic() + 30
            while (seen := stored_count()) < stored and time.monotonic() < deadline:
                time.sleep(0.05)
            with open(f"{marker}.{attempt}", "w") as f:
                f.write(str(seen))
            raise RuntimeError("forced failure")

    return run


def failing_frame(spark: Any, n: int, run: Any) -> Any:
    rdd = numbers(spark, n, 4).rdd.mapPartitionsWithIndex(run)
    return spark.createDataFrame(rdd, "payload string")


def test_a_failed_task_attempt_publishes_nothing_twice(
    spark: Any, srv: EmbeddedServer, stubs: Stubs, tmp_path: Any
) -> None:
    queue = stubs.create()
    marker = str(tmp_path / "failed")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "250")
    try:
        df = failing_frame(spark, 10_000, failing(srv.address, queue, 1, True, 1000, marker))
        write(df, srv, queue, batchSize="100", inFlight="1")
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    # The first attempt of partition 1 failed after the writer had stored items of it.
    with open(f"{marker}.0") as f:
        assert int(f.read()) >= 1000
    payloads = stubs.payloads(queue)
    assert len(payloads) == 10_000
    assert Counter(payloads) == Counter(str(i).encode() for i in range(10_000))


def test_a_rerun_with_a_key_column_adds_nothing(spark: Any, srv: EmbeddedServer, stubs: Stubs) -> None:
    queue = stubs.create(requested_partitions=2)
    df = spark.range(3_000).selectExpr("cast(id as string) as payload", "concat('order-', id) as order_id")
    df = df.repartition(3)
    write(df, srv, queue, keyColumn="order_id")
    assert len(stubs.payloads(queue)) == 3_000
    write(df, srv, queue, KEYCOLUMN="order_id")  # options are case-insensitive
    assert len(stubs.payloads(queue)) == 3_000
    # An idempotency_key column works the same way, without the option.
    keyed = df.withColumnRenamed("order_id", "idempotency_key")
    write(keyed, srv, queue)
    assert len(stubs.payloads(queue)) == 3_000


def test_an_aborted_job_leaves_nothing_a_rerun_would_repeat(
    spark: Any, srv: EmbeddedServer, stubs: Stubs, tmp_path: Any
) -> None:
    queue = stubs.create()
    marker = str(tmp_path / "failed")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "250")
    try:
        df = failing_frame(spark, 4_000, failing(srv.address, queue, 2, False, 500, marker))
        with pytest.raises(Exception, match="forced failure"):
            write(df, srv, queue, batchSize="100", inFlight="2")
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
    with open(f"{marker}.0") as f:
        assert int(f.read()) >= 500
    assert stubs.payloads(queue) == []
    assert stubs.stats(queue) == (0, 0)
    # The re-run stores every row once.
    write(numbers(spark, 4_000, 4), srv, queue)
    assert Counter(stubs.payloads(queue)) == Counter(str(i).encode() for i in range(4_000))


def test_optional_columns_and_binary_payloads(spark: Any, srv: EmbeddedServer, stubs: Stubs) -> None:
    queue = stubs.create()
    later = datetime.now(UTC) + timedelta(hours=1)
    rows = [
        (b"\x00\x01", "resize", "img-1", "application/octet-stream", None),
        (b"{}", "", None, "application/json", None),
        (b"later", "k", "r", "e", later),
    ]
    df = spark.createDataFrame(
        rows, "payload binary, kind string, reference string, encoding string, enqueue_at timestamp"
    )
    write(df, srv, queue)
    stored = {i.payload: i for i in stubs.items(queue)}
    assert set(stored) == {b"\x00\x01", b"{}"}  # the third is scheduled
    first = stored[b"\x00\x01"]
    assert (first.kind, first.reference, first.encoding) == ("resize", "img-1", "application/octet-stream")
    assert (stored[b"{}"].kind, stored[b"{}"].encoding) == ("", "application/json")
    snapshot = (
        spark.read.format("querator")
        .option("address", srv.address)
        .option("queue", queue)
        .option("includeScheduled", "true")
        .load()
    )
    scheduled = snapshot.where("enqueue_at is not null").collect()
    assert [(r.payload, r.kind, r.reference) for r in scheduled] == [(b"later", "k", "r")]
    assert abs(scheduled[0].enqueue_at.timestamp() - later.timestamp()) < 0.001


def test_bad_input_fails_on_the_driver_with_a_clear_message(spark: Any, srv: EmbeddedServer, stubs: Stubs) -> None:
    queue = stubs.create()
    with pytest.raises(Exception, match="needs a 'payload' column"):
        write(spark.range(3), srv, queue)
    with pytest.raises(Exception, match="option 'queue' is required"):
        spark.range(3).selectExpr("'x' as payload").write.format("querator").mode("append").save()
    with pytest.raises(Exception, match="keyColumn"):
        write(spark.range(3).selectExpr("'x' as payload"), srv, queue, keyColumn="missing")


def test_server_down_fails_the_job_after_retries(spark: Any, stubs: Stubs) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    df = spark.range(10).selectExpr("cast(id as string) as payload")
    writer = df.write.format("querator").option("address", dead).option("queue", "q").option("retries", "1")
    with pytest.raises(Exception, match="(?i)unavailable|connect"):
        writer.option("timeout", "2").mode("append").save()


# -- snapshot reads --------------------------------------------------------------------


def test_snapshot_returns_every_stored_item_once_and_leases_nothing(
    spark: Any, srv: EmbeddedServer, stubs: Stubs
) -> None:
    queue = stubs.create(requested_partitions=3)
    stubs.produce(queue, [f"item-{i}".encode() for i in range(2_500)])
    # Some items are leased by someone else: listed, and left leased.
    from querator.v1 import queue_pb2

    leased = stubs.queue.Lease(queue_pb2.LeaseRequest(queue_name=queue, batch_size=10), timeout=10)
    assert len(leased.items) == 10
    before = stubs.items(queue)

    df = (
        spark.read.format("querator")
        .option("ADDRESS", srv.address)
        .option("Queue", queue)
        .option("MODE", "Snapshot")
        .option("pageSize", "300")
        .load()
    )
    assert df.rdd.getNumPartitions() == 3
    rows = df.collect()
    assert sorted(r.id for r in rows) == sorted(i.id for i in before)
    assert len({r.id for r in rows}) == 2_500
    assert Counter(r.payload for r in rows) == Counter(f"item-{i}".encode() for i in range(2_500))
    assert sum(r.is_leased for r in rows) == 10
    assert {r.id for r in rows if r.is_leased} == {i.id for i in leased.items}
    assert all(r.lease_deadline is not None for r in rows if r.is_leased)
    assert stubs.stats(queue) == (2_500, 10)
    assert [(i.id, i.attempts) for i in stubs.items(queue)] == [(i.id, i.attempts) for i in before]


def test_snapshot_schema_is_the_stream_schema_and_modes_are_checked(
    spark: Any, srv: EmbeddedServer, stubs: Stubs
) -> None:
    from querator.spark import READ_SCHEMA

    queue = stubs.create()
    reader = spark.read.format("querator").option("address", srv.address).option("queue", queue)
    assert reader.load().schema == READ_SCHEMA
    stream = spark.readStream.format("querator").option("address", srv.address).option("queue", queue).load()
    assert stream.schema == READ_SCHEMA
    with pytest.raises(Exception, match="mode"):
        reader.option("mode", "lease").load().collect()


# -- streaming writes ------------------------------------------------------------------


def test_a_replayed_streaming_batch_stores_nothing_twice(
    spark: Any, srv: EmbeddedServer, stubs: Stubs, tmp_path: Any
) -> None:
    from pathlib import Path

    queue = stubs.create(requested_partitions=2)
    source, checkpoint = Path(tmp_path) / "in", Path(tmp_path) / "cp"
    source.mkdir()
    for f in range(3):
        (source / f"part-{f}.txt").write_text("\n".join(f"line-{f}-{i}" for i in range(400)))

    def run() -> None:
        query = (
            spark.readStream.option("maxFilesPerTrigger", 1)
            .text(str(source))
            .selectExpr("value as payload", "'line' as kind")
            .writeStream.format("querator")
            .option("address", srv.address)
            .option("queue", queue)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
        assert query.exception() is None

    run()
    expected = Counter(f"line-{f}-{i}".encode() for f in range(3) for i in range(400))
    assert Counter(stubs.payloads(queue)) == expected
    # Forget that the last batch was committed: the restart runs it again, with the same
    # query id and batch id, so the same keys.
    commits = sorted((checkpoint / "commits").glob("[0-9]*"), key=lambda p: int(p.name))
    assert [p.name for p in commits] == ["0", "1", "2"]
    commits[-1].unlink()
    (checkpoint / "commits" / ".2.crc").unlink(missing_ok=True)
    run()
    assert (checkpoint / "commits" / "2").exists()  # batch 2 ran again
    assert Counter(stubs.payloads(queue)) == expected


def test_a_write_to_a_missing_queue_fails_on_the_driver_before_any_task(spark: Any, srv: EmbeddedServer) -> None:
    df = numbers(spark, 100, 2)
    with pytest.raises(Exception) as failed:
        write(df, srv, "no-such-queue")
    text = str(failed.value)
    assert "QueueNotFound" in text and "no-such-queue" in text
    assert "in stage" not in text and "Task" not in text  # no task ran: the driver refused the job
