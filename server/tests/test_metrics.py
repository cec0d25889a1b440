"""Prometheus metrics on --metrics-address: scraped over HTTP while the queue moves."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from conftest import Stubs, ThreadServer, wait_until
from google.protobuf import duration_pb2, timestamp_pb2
from prometheus_client.parser import text_string_to_metric_families
from querator.v1 import queue_pb2
from querator_server.config import ServerConfig
from querator_server.metrics import parse_address
from querator_server.server import QueratorServer


class Scraper:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"

    def text(self) -> str:
        with urllib.request.urlopen(self.url, timeout=5) as reply:
            assert reply.status == 200
            return reply.read().decode()

    def samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in text_string_to_metric_families(self.text()):
            for s in family.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out

    def value(self, name: str, **labels: str) -> float:
        return self.samples().get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def metered(data_dir: str) -> Iterator[tuple[ThreadServer, Stubs, Scraper]]:
    server = ThreadServer(data_dir, metrics_address="127.0.0.1:0")
    channel = grpc.insecure_channel(server.address)
    try:
        yield server, Stubs(channel), Scraper(server.server.metrics.port)
    finally:
        channel.close()
        server.stop()


def items(scrape: Scraper, queue: str, state: str, partition: str = "0") -> float:
    return scrape.value("querator_partition_items", queue=queue, partition=partition, state=state)


def test_depth_and_age_follow_produce_lease_complete(metered: tuple[ThreadServer, Stubs, Scraper]) -> None:
    _server, stubs, scrape = metered
    stubs.create("jobs")
    assert scrape.value("querator_queues") == 1
    assert items(scrape, "jobs", "ready") == 0
    assert scrape.value("querator_partition_oldest_ready_age_seconds", queue="jobs", partition="0") == 0

    stubs.produce("jobs", [b"a", b"b", b"c", b"d"])
    assert items(scrape, "jobs", "ready") == 4
    time.sleep(0.2)
    age = scrape.value("querator_partition_oldest_ready_age_seconds", queue="jobs", partition="0")
    assert 0.2 <= age < 30
    assert scrape.value("querator_partition_average_age_seconds", queue="jobs", partition="0") >= 0.2

    leased = stubs.lease("jobs", batch_size=3)
    assert len(leased.items) == 3
    assert (items(scrape, "jobs", "ready"), items(scrape, "jobs", "leased")) == (1, 3)
    # The head is now the fourth item, produced in the same batch: still as old.
    assert scrape.value("querator_partition_oldest_ready_age_seconds", queue="jobs", partition="0") >= 0.2

    stubs.complete("jobs", leased.partition, [i.id for i in leased.items])
    assert (items(scrape, "jobs", "ready"), items(scrape, "jobs", "leased")) == (1, 0)
    drained = stubs.lease("jobs", batch_size=10, columnar=True)  # counted from its columns
    stubs.complete("jobs", drained.partition, list(drained.columns.ids))
    assert (items(scrape, "jobs", "ready"), items(scrape, "jobs", "leased")) == (0, 0)
    assert scrape.value("querator_partition_oldest_ready_age_seconds", queue="jobs", partition="0") == 0

    s = scrape.samples()
    total = lambda action: s.get(("querator_items_total", frozenset({("queue", "jobs"), ("action", action)})), 0)
    assert (total("produced"), total("leased"), total("completed")) == (4, 4, 4)
    ok = lambda method: s.get(
        ("querator_rpc_requests_total", frozenset({("queue", "jobs"), ("method", method), ("code", "OK")})), 0
    )
    assert (ok("Produce"), ok("Lease"), ok("Complete")) == (1, 2, 2)
    assert s[("querator_rpc_duration_seconds_count", frozenset({("queue", "jobs"), ("method", "Lease")}))] == 2
    assert s[("querator_cycle_duration_seconds_count", frozenset({("queue", "jobs")}))] >= 5
    assert s[("querator_cycle_batch_requests_sum", frozenset({("queue", "jobs")}))] >= 5
    assert s[("querator_lmdb_commit_duration_seconds_count", frozenset({("queue", "jobs")}))] >= 5
    used = s[("querator_lmdb_map_used_bytes", frozenset({("queue", "jobs")}))]
    assert 0 < used <= s[("querator_lmdb_map_size_bytes", frozenset({("queue", "jobs")}))]


def test_errors_are_counted_by_status_and_unknown_queues_stay_unlabelled(
    metered: tuple[ThreadServer, Stubs, Scraper],
) -> None:
    _server, stubs, scrape = metered
    stubs.create("q")
    with pytest.raises(grpc.RpcError):
        stubs.complete("q", 0, ["no-such-id"])
    with pytest.raises(grpc.RpcError):
        stubs.produce("random-name-1", [b"x"])
    assert scrape.value("querator_rpc_requests_total", queue="q", method="Complete", code="NOT_FOUND") == 1
    # A name that is not a queue is not a label value (no series per made-up name).
    assert scrape.value("querator_rpc_requests_total", queue="", method="Produce", code="NOT_FOUND") == 1
    assert "random-name-1" not in scrape.text()


def test_stream_messages_are_counted_as_calls(metered: tuple[ThreadServer, Stubs, Scraper]) -> None:
    _server, stubs, scrape = metered
    stubs.create("s")
    produce = [
        queue_pb2.ProduceStreamRequest(
            request=queue_pb2.ProduceRequest(queue_name=name, items=[queue_pb2.ProduceItem(payload=b"x")] * 3)
        )
        for name in ("s", "made-up-queue")
    ]
    compact = queue_pb2.ProduceRequest(queue_name="s", payloads=[b"y"] * 3)  # counted the same
    produce.insert(1, queue_pb2.ProduceStreamRequest(request=compact))
    assert len(list(stubs.queue.ProduceStream(iter(produce), timeout=10))) == 3
    lease = queue_pb2.LeaseStreamRequest(
        request=queue_pb2.LeaseRequest(queue_name="s", batch_size=4, request_timeout=duration_pb2.Duration())
    )
    [leased] = list(stubs.queue.LeaseStream(iter([lease]), timeout=10))
    done = queue_pb2.LeaseRequest(
        queue_name="s",
        batch_size=4,
        request_timeout=duration_pb2.Duration(),
        complete_ids=[item.id for item in leased.response.items],
    )
    assert len(list(stubs.queue.LeaseStream(iter([queue_pb2.LeaseStreamRequest(request=done)]), timeout=10))) == 1
    value = scrape.value
    assert value("querator_rpc_requests_total", queue="s", method="ProduceStream", code="OK") == 2
    assert value("querator_rpc_requests_total", queue="", method="ProduceStream", code="NOT_FOUND") == 1
    assert value("querator_rpc_requests_total", queue="s", method="LeaseStream", code="OK") == 2
    assert value("querator_rpc_duration_seconds_count", queue="s", method="LeaseStream") == 2
    assert value("querator_items_total", queue="s", action="produced") == 6
    assert value("querator_items_total", queue="s", action="leased") == 6  # 4, then the last 2
    assert value("querator_items_total", queue="s", action="completed") == 4
    assert "made-up-queue" not in scrape.text()


def test_scheduled_expired_leases_and_dead_letters(metered: tuple[ThreadServer, Stubs, Scraper]) -> None:
    _server, stubs, scrape = metered
    stubs.create("dlq")
    stubs.create("work", dead_queue="dlq", max_attempts=1, lease_timeout=duration_pb2.Duration(nanos=300_000_000))
    later = timestamp_pb2.Timestamp()
    later.FromMicroseconds(int((time.time() + 600) * 1e6))
    stubs.queue.Produce(
        queue_pb2.ProduceRequest(queue_name="work", items=[queue_pb2.ProduceItem(utf8="later", enqueue_at=later)]),
        timeout=10,
    )
    assert items(scrape, "work", "scheduled") == 1

    stubs.produce("work", [b"expires", b"dead"])
    leased = stubs.lease("work", batch_size=2)
    stubs.queue.Retry(
        queue_pb2.RetryRequest(
            queue_name="work", partition=leased.partition, items=[queue_pb2.RetryItem(id=leased.items[1].id, dead=True)]
        ),
        timeout=10,
    )
    # The other lease runs out: with max_attempts 1 the item goes to the dead-letter queue.
    wait_until(lambda: scrape.value("querator_lease_expirations_total", queue="work") == 1, timeout=10)
    wait_until(lambda: items(scrape, "dlq", "ready") == 2, timeout=10)
    assert scrape.value("querator_dead_letters_total", queue="work", outcome="moved") == 2
    assert scrape.value("querator_items_total", queue="work", action="retried") == 1
    assert (items(scrape, "work", "ready"), items(scrape, "work", "leased")) == (0, 0)


def test_off_by_default_and_bad_address_refused(data_dir: str) -> None:
    plain = ThreadServer(data_dir)
    try:
        assert plain.server.metrics is None
    finally:
        plain.stop()
    config = ServerConfig(address="127.0.0.1:0", data_dir=data_dir, metrics_address="no-port-here")
    server = QueratorServer(config)
    with pytest.raises(OSError, match="metrics address"):
        asyncio.run(server.start())


@pytest.mark.parametrize(
    ("address", "expected"),
    [("127.0.0.1:9090", ("127.0.0.1", 9090)), (":9090", ("0.0.0.0", 9090)), ("[::1]:9", ("::1", 9))],
)
def test_parse_address(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected
