"""Spark connector throughput: N items written by Spark into a queue, then drained by a
streaming read, items/s for each direction.

    .venv/bin/python bench/spark_bench.py [--items 1000000] [--payload-bytes 100]
        [--partitions 4] [--read-partitions 4] [--per-trigger 250000] [--no-sync]

Needs the spark extra (``pip install -e 'clients/python[spark]'``) and OpenJDK 17
(found under /usr/lib/jvm/java-17-openjdk-*, or $JAVA_HOME). The server runs in a
child process on 127.0.0.1 (durable, fsync on, unless --no-sync), Spark in this one
(local[2]); both share the machine's cores. Each direction is timed after a small
warm-up job, from the call to the end of the job / query:

- write: ``df.write.format("querator").save()`` of N rows from ``--partitions``
  Spark partitions (per-row idempotency keys, the default);
- read: ``readStream.format("querator")`` with Trigger.AvailableNow into Spark's
  ``noop`` sink, ``--per-trigger`` items per micro-batch, ``--read-partitions`` Spark
  partitions per batch; it ends when the queue is empty and nothing is leased.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

HOST = "127.0.0.1"

SERVER = """
import signal, sys, threading
from querator.embedded import EmbeddedServer
from querator_server.server import tune_gc
srv = EmbeddedServer(sys.argv[1], address=sys.argv[2], sync=sys.argv[3] == "1", log_level="warning").start()
tune_gc()  # as the `querator serve` process does
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
print("ready", flush=True)
done.wait()
srv.stop()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def java17() -> str:
    for home in sorted(glob.glob("/usr/lib/jvm/java-17-openjdk-*")):
        if os.path.isfile(os.path.join(home, "bin", "java")):
            return home
    home = os.environ.get("JAVA_HOME", "")
    if not home:
        sys.exit("spark_bench: OpenJDK 17 not found (apt-get install openjdk-17-jdk-headless)")
    return home


def start_server(data_dir: str, sync: bool) -> tuple[subprocess.Popen[str], str]:
    address = f"{HOST}:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, data_dir, address, "1" if sync else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        sys.exit("spark_bench: the server did not start")
    return proc, address


def session(master: str) -> Any:
    os.environ.update(
        JAVA_HOME=java17(), PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, SPARK_LOCAL_IP=HOST
    )
    from pyspark.sql import SparkSession

    import querator.spark

    fast = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    spark = (
        SparkSession.builder.master(master)
        .appName("querator-spark-bench")
        .config("spark.driver.bindAddress", HOST)
        .config("spark.driver.host", HOST)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", "2g")
        .config("spark.driver.extraJavaOptions", fast)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    querator.spark.register(spark)
    return spark


def stored_and_leased(address: str, queue: str) -> tuple[int, int]:
    import grpc

    from querator.v1 import queues_pb2, queues_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = queues_pb2_grpc.QueuesServiceStub(channel)
        reply = stub.GetQueueStats(queues_pb2.GetQueueStatsRequest(queue_name=queue), timeout=30)
        return sum(p.total for p in reply.partitions), sum(p.total_leased for p in reply.partitions)


def create_queue(address: str, queue: str, partitions: int) -> None:
    import grpc

    from querator.v1 import queues_pb2, queues_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = queues_pb2_grpc.QueuesServiceStub(channel)
        info = queues_pb2.QueueInfo(queue_name=queue, requested_partitions=partitions)
        stub.CreateQueue(queues_pb2.CreateQueueRequest(queue=info), timeout=30)


def rows(spark: Any, n: int, payload_bytes: int, partitions: int) -> Any:
    # A zero-padded row number, padded with 'x' to the payload size: unique payloads.
    pad = max(0, payload_bytes - 12)
    expr = f"concat(lpad(cast(id as string), 12, '0'), repeat('x', {pad})) as payload"
    return spark.range(0, n, 1, partitions).selectExpr(expr)


def write(spark: Any, address: str, queue: str, n: int, args: argparse.Namespace) -> float:
    df = rows(spark, n, args.payload_bytes, args.partitions)
    start = time.perf_counter()
    df.write.format("querator").option("address", address).option("queue", queue).mode("append").save()
    return time.perf_counter() - start


def drain(spark: Any, address: str, queue: str, checkpoint: str, args: argparse.Namespace) -> tuple[float, Any]:
    df = (
        spark.readStream.format("querator")
        .option("address", address)
        .option("queue", queue)
        .option("maxItemsPerTrigger", str(args.per_trigger))
        .option("numPartitions", str(args.read_partitions))
        .load()
    )
    start = time.perf_counter()
    query = (
        df.writeStream.format("noop")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    elapsed = time.perf_counter() - start
    if query.exception() is not None:
        raise RuntimeError(f"the streaming read failed: {query.exception()}")
    return elapsed, query.recentProgress


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--payload-bytes", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=4, help="Spark partitions of the write")
    parser.add_argument("--read-partitions", type=int, default=4, help="Spark partitions per read batch")
    parser.add_argument("--queue-partitions", type=int, default=2)
    parser.add_argument("--per-trigger", type=int, default=250_000, help="maxItemsPerTrigger of the read")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--no-sync", action="store_true", help="run the server without fsync")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="querator-spark-bench-")
    server, address = start_server(os.path.join(work, "data"), sync=not args.no_sync)
    try:
        spark = session(args.master)
        # Warm-up: JVM, Python workers, connections.
        create_queue(address, "warm", args.queue_partitions)
        write(spark, address, "warm", 20_000, args)
        drain(spark, address, "warm", os.path.join(work, "cp-warm"), args)

        create_queue(address, "bench", args.queue_partitions)
        n = args.items
        print(
            f"spark_bench: {n:,} items of {args.payload_bytes} B, {args.master}, "
            f"server {'durable' if not args.no_sync else 'without fsync'}, queue partitions {args.queue_partitions}"
        )
        seconds = write(spark, address, "bench", n, args)
        stored, _ = stored_and_leased(address, "bench")
        assert stored == n, f"stored {stored} of {n}"
        print(f"write: {n:,} items in {seconds:.1f} s = {n / seconds:,.0f} items/s ({args.partitions} Spark partitions)")

        seconds, progress = drain(spark, address, "bench", os.path.join(work, "cp"), args)
        left = stored_and_leased(address, "bench")
        assert left == (0, 0), f"left after the drain (stored, leased): {left}"
        batches = [p for p in progress if p["numInputRows"]]
        busy = sum(p["durationMs"].get("triggerExecution", 0) for p in batches) / 1000
        print(
            f"read:  {n:,} items in {seconds:.1f} s = {n / seconds:,.0f} items/s "
            f"({len(batches)} batches, {busy:.1f} s inside them, {args.read_partitions} Spark partitions each)"
        )
        spark.stop()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
