"""What the Spark connector tests share: Java 17, one local SparkSession, a server.

No conftest.py (server/tests has one, and both would be imported as "conftest"):
test modules import these by name. Each module builds one SparkSession through the
module-scoped ``spark`` fixture it imports from here and stops it at the end.
"""

from __future__ import annotations

import glob
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="the Spark tests need: pip install 'querator-client[spark]'")
pytest.importorskip("pyarrow", reason="the Spark tests need: pip install 'querator-client[spark]'")

import grpc
from pyspark.sql import SparkSession

import querator.spark
from querator.embedded import EmbeddedServer
from querator.testing import server as embedded_server
from querator.v1 import queue_pb2, queue_pb2_grpc, queues_pb2, queues_pb2_grpc, storage_pb2, storage_pb2_grpc

#: The JVM flags that start a local session fastest (no C2 compiler, serial GC).
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Xss4m"


def java17_home() -> str | None:
    """Debian's OpenJDK 17 (Spark must not pick up a newer default JDK)."""
    for home in sorted(glob.glob("/usr/lib/jvm/java-17-openjdk-*")):
        if os.path.isfile(os.path.join(home, "bin", "java")):
            return home
    given = os.environ.get("JAVA_HOME", "")
    return given if "17" in os.path.basename(given.rstrip("/")) else None


def spark_env() -> dict[str, str]:
    """The environment a Spark driver of these tests needs (also for subprocess drivers)."""
    home = java17_home()
    if home is None:
        pytest.skip("the Spark tests need OpenJDK 17 (apt-get install openjdk-17-jdk-headless)")
    return {
        "JAVA_HOME": home,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        # A driver that starts its JVM while gRPC is busy in the same process: see ./dev's
        # note on the Spark tests (read when a process starts, so it reaches drivers started
        # as subprocesses; ./dev sets it for the pytest process itself).
        "GRPC_ENABLE_FORK_SUPPORT": "false",
    }


def build_session(master: str = "local[2]", app: str = "querator-tests") -> SparkSession:
    os.environ.update(spark_env())
    spark = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.extraJavaOptions", FAST_JVM)
        .config("spark.executor.extraJavaOptions", FAST_JVM)
        .config("spark.sql.streaming.stopTimeout", "30s")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    querator.spark.register(spark)
    return spark


def session_fixture(master: str = "local[2]") -> Any:
    """A module-scoped fixture: one SparkSession for the module, stopped at its end."""

    @pytest.fixture(scope="module")
    def spark() -> Iterator[SparkSession]:
        session = build_session(master)
        try:
            yield session
        finally:
            session.stop()

    return spark


@pytest.fixture(scope="module")
def srv() -> Iterator[EmbeddedServer]:
    """One server for the module (each test uses queues of its own)."""
    with embedded_server() as server:
        yield server


class Stubs:
    """Direct stubs on the test server: set-up and checks independent of the connector."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)])
        self.queue = queue_pb2_grpc.QueueServiceStub(self.channel)
        self.queues = queues_pb2_grpc.QueuesServiceStub(self.channel)
        self.storage = storage_pb2_grpc.StorageServiceStub(self.channel)

    def create(self, name: str | None = None, **fields: Any) -> str:
        name = name or f"q-{uuid.uuid4().hex[:10]}"
        self.queues.CreateQueue(queues_pb2.CreateQueueRequest(queue=queues_pb2.QueueInfo(queue_name=name, **fields)))
        return name

    def produce(self, name: str, payloads: list[bytes]) -> None:
        for i in range(0, len(payloads), 1000):
            items = [queue_pb2.ProduceItem(payload=p) for p in payloads[i : i + 1000]]
            self.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=items), timeout=30)

    def fill(self, name: str, partition: int, payloads: list[bytes]) -> None:
        """Store ready items straight into one partition (ImportItems), for uneven fills."""
        for i in range(0, len(payloads), 1000):
            items = [storage_pb2.StorageItem(payload=p) for p in payloads[i : i + 1000]]
            request = storage_pb2.ImportItemsRequest(queue_name=name, partition=partition, items=items)
            self.storage.ImportItems(request, timeout=30)

    def items(self, name: str) -> list[storage_pb2.StorageItem]:
        info = self.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name=name)).queue
        out: list[storage_pb2.StorageItem] = []
        for partition in range(info.requested_partitions):
            token = ""
            while True:
                page = self.storage.ListItems(
                    storage_pb2.ListItemsRequest(queue_name=name, partition=partition, page_size=1000, page_token=token)
                )
                out.extend(page.items)
                token = page.next_page_token
                if not token:
                    break
        return out

    def payloads(self, name: str) -> list[bytes]:
        return [i.payload for i in self.items(name)]

    def stats(self, name: str) -> tuple[int, int]:
        """(stored, leased) over every partition."""
        reply = self.queues.GetQueueStats(queues_pb2.GetQueueStatsRequest(queue_name=name))
        return sum(p.total for p in reply.partitions), sum(p.total_leased for p in reply.partitions)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture(scope="module")
def stubs(srv: EmbeddedServer) -> Iterator[Stubs]:
    s = Stubs(srv.address)
    yield s
    s.close()


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")
