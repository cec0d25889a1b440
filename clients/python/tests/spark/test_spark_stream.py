"""Spark connector: streaming reads (replayable micro-batches, completion after commit,
restarts, a killed driver, long batches) and a queue -> Spark -> queue pipeline."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import duration_pb2

from querator.embedded import EmbeddedServer
from querator.v1 import queue_pb2

from spark_helpers import Stubs, session_fixture, spark_env, srv, stubs, wait_until  # noqa: F401 - fixtures

spark = session_fixture("local[2,2]")
HERE = Path(__file__).resolve().parent


def stream(spark: Any, srv: EmbeddedServer, queue: str, **options: str) -> Any:
    reader = spark.readStream.format("querator").option("address", srv.address).option("queue", queue)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def run_available_now(df: Any, handler: Any, checkpoint: Path, timeout: float = 120) -> Any:
    from pyspark.errors import StreamingQueryException

    query = df.writeStream.foreachBatch(handler).option("checkpointLocation", str(checkpoint))
    query = query.trigger(availableNow=True).start()
    try:
        query.awaitTermination(timeout)
    except StreamingQueryException:
        pass  # the caller checks query.exception()
    finally:
        if query.isActive:
            query.stop()
    return query


def payloads(n: int, prefix: str = "item") -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def test_available_now_drains_in_batches_and_leaves_nothing_leased(
    spark: Any, srv: EmbeddedServer, stubs: Stubs, tmp_path: Path
) -> None:
    n, per_trigger = 2_500, 1_000
    queue = stubs.create(requested_partitions=2)
    stubs.produce(queue, payloads(n))
    batches: list[dict[str, Any]] = []

    def handler(df: Any, batch_id: int) -> None:
        collected = df.collect()
        counted = df.count()
        again = sorted(r.id for r in df.select("id").collect())
        batches.append(
            {
                "id": batch_id,
                "ids": sorted(r.id for r in collected),
                "again": again,
                "count": counted,
                "payloads": [r.payload for r in collected],
                "attempts": {r.attempts for r in collected},
                "stats": stubs.stats(queue),
            }
        )

    query = run_available_now(
        # Five Lease calls per Spark partition, three in flight: replies arrive out of turn.
        stream(
            spark,
            srv,
            queue,
            MAXITEMSPERTRIGGER=str(per_trigger),
            numPartitions="2",
            leaseBatchSize="100",
            leasesInFlight="3",
        ),
        handler,
        tmp_path / "cp",
    )
    assert query.exception() is None
    assert len(batches) == math.ceil(n / per_trigger)
    seen: Counter[bytes] = Counter()
    remaining = n
    for batch in batches:
        size = len(batch["ids"])
        assert size == min(per_trigger, remaining)
        # collect() and count() (and a second collect) of one batch see the same items.
        assert batch["count"] == size
        assert batch["again"] == batch["ids"]
        assert batch["attempts"] == {1}
        # Inside the batch its items are leased, not done; earlier batches are done.
        assert batch["stats"] == (remaining, size)
        remaining -= size
        seen.update(batch["payloads"])
    assert seen == Counter(payloads(n))
    assert stubs.stats(queue) == (0, 0)


def test_a_failed_batch_is_replayed_with_the_same_ids_after_a_restart(
    spark: Any, srv: EmbeddedServer, stubs: Stubs, tmp_path: Path
) -> None:
    n = 1_200
    queue = stubs.create()
    stubs.produce(queue, payloads(n))
    delivered: list[tuple[int, list[str], list[bytes]]] = []
    fail = {"batch": 1}

    def handler(df: Any, batch_id: int) -> None:
        rows = df.collect()
        delivered.append((batch_id, sorted(r.id for r in rows), [r.payload for r in rows]))
        if batch_id == fail["batch"]:
            fail["batch"] = -1
            raise RuntimeError("the sink failed")

    df = stream(spark, srv, queue, maxItemsPerTrigger="500")
    first = run_available_now(df, handler, tmp_path / "cp")
    assert first.exception() is not None and "the sink failed" in str(first.exception())
    assert [d[0] for d in delivered] == [0, 1]
    # Batch 0 is completed (Spark committed it); batch 1 is still leased.
    assert stubs.stats(queue) == (n - 500, 500)

    second = run_available_now(stream(spark, srv, queue, maxItemsPerTrigger="500"), handler, tmp_path / "cp")
    assert second.exception() is None
    assert [d[0] for d in delivered] == [0, 1, 1, 2]
    assert delivered[2][1] == delivered[1][1]  # the replay has the failed batch's ids
    counts = Counter(p for _, _, batch in delivered[:1] + delivered[2:] for p in batch)
    assert counts == Counter(payloads(n))
    assert stubs.stats(queue) == (0, 0)


def kill_driver_mid_batch(
    srv: EmbeddedServer, queue: str, tmp_path: Path, per_trigger: int, *options: str
) -> dict[str, list[str]]:
    """Run stream_driver.py until it stalls in batch 1, kill -9 it (and its JVM and
    Python workers); what each batch wrote to the sink, by file name."""
    sink, checkpoint = tmp_path / "sink", tmp_path / "cp"
    sink.mkdir()
    env = {**os.environ, **spark_env(), "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    args = [sys.executable, str(HERE / "stream_driver.py"), srv.address, queue, str(checkpoint), str(sink)]
    driver = subprocess.Popen(
        [*args, str(per_trigger), "1", *options],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(lambda: (sink / "stalled").exists() or driver.poll() is not None, timeout=180)
        assert driver.poll() is None, "the driver ended before its stalled batch"
        os.kill(driver.pid, signal.SIGKILL)  # the driver dies in the middle of batch 1
        driver.wait(30)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
        try:  # its JVM and Python workers go with it
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return {p.name: p.read_text().splitlines() for p in sink.glob("batch-*")}


def resume_after_kill(
    spark: Any, srv: EmbeddedServer, queue: str, tmp_path: Path, killed: dict[str, list[str]], n: int, **options: str
) -> None:
    """Restart from the killed driver's checkpoint; every item is read, and only those
    of the batch in flight at the kill at most twice."""
    in_flight = next(lines for name, lines in killed.items() if name.startswith("batch-1-"))
    resumed: list[str] = []

    def handler(df: Any, batch_id: int) -> None:
        resumed.extend(r.payload.decode() for r in df.select("payload").collect())

    query = run_available_now(stream(spark, srv, queue, **options), handler, tmp_path / "cp")
    assert query.exception() is None
    everything = Counter([line for lines in killed.values() for line in lines] + resumed)
    assert set(everything) == {p.decode() for p in payloads(n)}
    duplicates = {p for p, count in everything.items() if count > 1}
    assert duplicates <= set(in_flight)
    assert max(everything.values()) <= 2


@pytest.mark.timeout(300)
def test_a_killed_driver_resumes_and_duplicates_at_most_the_batch_in_flight(
    spark: Any, srv: EmbeddedServer, stubs: Stubs, tmp_path: Path
) -> None:
    n, per_trigger = 1_500, 500
    queue = stubs.create()
    stubs.produce(queue, payloads(n))
    killed = kill_driver_mid_batch(srv, queue, tmp_path, per_trigger)
    assert sorted(name.split("-")[1] for name in killed) == ["0", "1"]
    assert stubs.stats(queue) == (n - per_trigger, per_trigger)
    resume_after_kill(spark, srv, queue, tmp_path, killed, n, maxItemsPerTrigger=str(per_trigger))
    assert stubs.stats(queue) == (0, 0)


# Queue partitions filled unevenly: a keyed lease is served from the fullest partition
# and returns fewer items than asked once that one runs short while others hold more.
UNEVEN = (700, 300, 150, 50)


def fill_unevenly(stubs: Stubs) -> tuple[str, int]:
    queue = stubs.create(requested_partitions=len(UNEVEN))
    items = payloads(sum(UNEVEN))
    start = 0
    for partition, count in enumerate(UNEVEN):
        stubs.fill(queue, partition, items[start : start + count])
        start += count
    return queue, start


def test_available_now_reads_every_ready_item_of_unevenly_filled_partitions(
    spark: Any, srv: EmbeddedServer, stubs: Stubs, tmp_path: Path
) -> None:
    """One Lease of 500 per batch: the second batch gets the 300 of the fullest
    partition; the stream plans by what it received and reads all 1,200."""
    queue, n = fill_unevenly(stubs)
    seen: Counter[bytes] = Counter()
    sizes: list[int] = []

    def handler(df: Any, batch_id: int) -> None:
        rows = df.select("payload").collect()
        sizes.append(len(rows))
        seen.update(r.payload for r in rows)

    options = {"maxItemsPerTrigger": "500", "numPartitions": "1", "leaseBatchSize": "500"}
    query = run_available_now(stream(spark, srv, queue, **options), handler, tmp_path / "cp")
    assert query.exception() is None
    assert seen == Counter(payloads(n)), f"batches of {sizes}"
    assert 300 in sizes  # a batch did come up short
    assert stubs.stats(queue) == (0, 0)


@pytest.mark.timeout(300)
def test_a_killed_driver_of_an_uneven_queue_resumes_and_reads_every_item(
    spark: Any, srv: EmbeddedServer, stubs: Stubs, tmp_path: Path
) -> None:
    queue, n = fill_unevenly(stubs)
    options = {"numPartitions": "1", "leaseBatchSize": "500"}
    killed = kill_driver_mid_batch(srv, queue, tmp_path, 500, *(f"{k}={v}" for k, v in options.items()))
    assert sorted(name.split("-")[1] for name in killed) == ["0", "1"]
    resume_after_kill(spark, srv, queue, tmp_path, killed, n, maxItemsPerTrigger="500", **options)
    assert stubs.stats(queue) == (0, 0)


def test_a_batch_longer_than_the_lease_timeout_is_not_redelivered(
    spark: Any, srv: EmbeddedServer, stubs: Stubs, tmp_path: Path
) -> None:
    n = 300
    queue = stubs.create(lease_timeout=duration_pb2.Duration(seconds=2))
    stubs.produce(queue, payloads(n))
    seen: list[tuple[str, int]] = []

    def handler(df: Any, batch_id: int) -> None:
        before = [(r.id, r.attempts) for r in df.collect()]
        time.sleep(5)  # 2.5 lease timeouts
        after = [(r.id, r.attempts) for r in df.collect()]
        assert sorted(after) == sorted(before)
        seen.extend(after)

    query = run_available_now(stream(spark, srv, queue), handler, tmp_path / "cp")
    assert query.exception() is None
    assert len(seen) == n
    assert {attempts for _, attempts in seen} == {1}
    assert stubs.stats(queue) == (0, 0)


def test_queue_to_spark_to_queue(spark: Any, srv: EmbeddedServer, stubs: Stubs, tmp_path: Path) -> None:
    n = 3_000
    source, target = stubs.create(requested_partitions=2), stubs.create()
    stubs.produce(source, payloads(n))
    df = stream(spark, srv, source, maxItemsPerTrigger="1000").selectExpr(
        "payload", "'copied' as kind", "id as reference"
    )
    query = (
        df.writeStream.format("querator")
        .option("address", srv.address)
        .option("queue", target)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None
    assert stubs.stats(source) == (0, 0)
    copied = stubs.items(target)
    assert len(copied) == n
    assert Counter(i.payload for i in copied) == Counter(payloads(n))
    assert {i.kind for i in copied} == {"copied"}


def test_server_down_fails_the_query(spark: Any, stubs: Stubs, tmp_path: Path) -> None:
    from querator.testing import server

    with server() as doomed:
        queue = Stubs(doomed.address).create()
        Stubs(doomed.address).produce(queue, payloads(10))
        df = (
            spark.readStream.format("querator")
            .option("address", doomed.address)
            .option("queue", queue)
            .option("retries", "1")
            .option("timeout", "2")
            .load()
        )
        query = df.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "cp")).start()
        wait_until(lambda: query.lastProgress is not None or query.exception() is not None, timeout=60)
    from pyspark.errors import StreamingQueryException

    # The server is gone: the next trigger cannot plan or complete, and the query fails.
    try:
        query.awaitTermination(60)
    except StreamingQueryException:
        pass
    assert not query.isActive
    assert query.exception() is not None


def test_rows_carry_the_stable_message_id_of_items_that_were_redelivered(
    spark: Any, srv: EmbeddedServer, stubs: Stubs, tmp_path: Path
) -> None:
    queue = stubs.create()
    produced = {p: i for p, i in zip(payloads(4), _produce_ids(stubs, queue, payloads(4)))}
    # Two items leased and given back: they are redelivered under new ids.
    leased = stubs.queue.Lease(queue_pb2.LeaseRequest(queue_name=queue, batch_size=2), timeout=10)
    retry = [queue_pb2.RetryItem(id=i.id) for i in leased.items]
    stubs.queue.Retry(queue_pb2.RetryRequest(queue_name=queue, partition=0, items=retry), timeout=10)

    snapshot = spark.read.format("querator").option("address", srv.address).option("queue", queue).load()
    listed = {r.payload: (r.id, r.message_id) for r in snapshot.collect()}
    rows: list[Any] = []
    query = run_available_now(stream(spark, srv, queue), lambda df, _: rows.extend(df.collect()), tmp_path / "cp")
    assert query.exception() is None
    read = {r.payload: (r.id, r.message_id) for r in rows}
    for payload, first_id in produced.items():
        assert read[payload][1] == first_id == listed[payload][1]
        moved = payload in {i.payload for i in leased.items}
        assert (read[payload][0] != first_id) == moved and (listed[payload][0] != first_id) == moved


def _produce_ids(stubs: Stubs, queue: str, values: list[bytes]) -> list[str]:
    items = [queue_pb2.ProduceItem(payload=v) for v in values]
    return list(stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=queue, items=items), timeout=10).ids)
