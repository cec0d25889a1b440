"""Prometheus metrics on --metrics-address: scraped over HTTP while the queue moves."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from querator.v1 import queue_pb2, queues_pb2
from querator_server.config import ServerConfig
from querator_server.metrics import MAX_SCRAPES, SCRAPE_THREAD, parse_address
from querator_server.server import QueratorServer

from conftest import Stubs, ThreadServer, wait_until


class Scraper:
    def __init__(self, port: int, token: str = "") -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    def text(self) -> str:
        with urllib.request.urlopen(urllib.request.Request(self.url, headers=self.headers), timeout=5) as reply:
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


def items(scrape: Scraper, queue: str, state: str) -> float:
    return scrape.value("querator_queue_items", queue=queue, state=state)


def test_depth_and_age_follow_produce_lease_complete(metered: tuple[ThreadServer, Stubs, Scraper]) -> None:
    _server, stubs, scrape = metered
    stubs.create("jobs")
    assert scrape.value("querator_queues") == 1
    assert items(scrape, "jobs", "ready") == 0
    assert scrape.value("querator_queue_oldest_ready_age_seconds", queue="jobs") == 0

    stubs.produce("jobs", [b"a", b"b", b"c", b"d"])
    assert items(scrape, "jobs", "ready") == 4
    time.sleep(0.2)
    age = scrape.value("querator_queue_oldest_ready_age_seconds", queue="jobs")
    assert 0.2 <= age < 30
    assert scrape.value("querator_queue_average_age_seconds", queue="jobs") >= 0.2

    leased = stubs.lease("jobs", batch_size=3)
    assert len(leased.items) == 3
    assert (items(scrape, "jobs", "ready"), items(scrape, "jobs", "leased")) == (1, 3)
    # The head is now the fourth item, produced in the same batch: still as old.
    assert scrape.value("querator_queue_oldest_ready_age_seconds", queue="jobs") >= 0.2

    stubs.complete("jobs", leased.partition, [i.id for i in leased.items])
    assert (items(scrape, "jobs", "ready"), items(scrape, "jobs", "leased")) == (1, 0)
    drained = stubs.lease("jobs", batch_size=10, columnar=True)  # counted from its columns
    stubs.complete("jobs", drained.partition, list(drained.columns.ids))
    assert (items(scrape, "jobs", "ready"), items(scrape, "jobs", "leased")) == (0, 0)
    assert scrape.value("querator_queue_oldest_ready_age_seconds", queue="jobs") == 0

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


def _families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def test_gauges_are_one_series_per_queue_whatever_its_partitions(metered: tuple[ThreadServer, Stubs, Scraper]) -> None:
    _server, stubs, scrape = metered
    stubs.create("narrow")
    stubs.create("wide", requested_partitions=64)
    stubs.produce("narrow", [b"n"] * 3)
    for _ in range(8):  # spread over several partitions
        stubs.produce("wide", [b"w"] * 5)
    time.sleep(0.2)
    stubs.produce("wide", [b"late"])
    families = _families(scrape.text())
    gauges = [name for name in families if name.startswith(("querator_queue_", "querator_lmdb_map"))]
    assert "querator_queue_items" in gauges and "querator_queue_oldest_ready_age_seconds" in gauges
    for name in gauges:
        per_queue = {q: sum(1 for labels, _ in families[name] if labels.get("queue") == q) for q in ("narrow", "wide")}
        assert per_queue["wide"] == per_queue["narrow"], name
    assert not [name for name, samples in families.items() if any("partition" in labels for labels, _ in samples)]
    value = lambda name, **labels: next(v for lab, v in families[name] if lab == labels)
    assert value("querator_queue_partitions", queue="wide") == 64
    assert value("querator_queue_items", queue="wide", state="ready") == 41  # summed over partitions
    assert value("querator_queue_items", queue="narrow", state="ready") == 3
    # The oldest head over all partitions: the first produce, not the latest one.
    assert value("querator_queue_oldest_ready_age_seconds", queue="wide") >= 0.2
    assert value("querator_queue_average_age_seconds", queue="wide") > 0


class _CountingEnv:
    """An LMDB environment that notes the thread of every use (each is a storage access)."""

    def __init__(self, env: object) -> None:
        self._env = env
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> object:
        self.threads.append(threading.current_thread().name)
        return getattr(self._env, name)


def test_a_scrape_reads_no_storage(data_dir: str) -> None:
    server = ThreadServer(data_dir, metrics_address="127.0.0.1:0", commit_groups=False)
    channel = grpc.insecure_channel(server.address)
    try:
        stubs, scrape = Stubs(channel), Scraper(server.server.metrics.port)
        stubs.create("deep", requested_partitions=32)
        for _ in range(40):
            stubs.produce("deep", [b"x"] * 10)
        leased = stubs.lease("deep", batch_size=7)
        store = server.server.manager.actor("deep").store
        counting = _CountingEnv(store.env)
        store.env = counting  # type: ignore[assignment]
        try:
            for _ in range(5):
                assert items(scrape, "deep", "ready") == 393 and items(scrape, "deep", "leased") == 7
            stubs.produce("deep", [b"y"])  # the counter sees what does use storage
            assert items(scrape, "deep", "ready") == 394
            assert counting.threads, "the counting environment saw no use at all"
            assert SCRAPE_THREAD not in counting.threads, counting.threads
        finally:
            store.env = counting._env  # type: ignore[assignment]
        stubs.complete("deep", leased.partition, [i.id for i in leased.items])
    finally:
        channel.close()
        server.stop()


TOKEN = "metrics-token-" + "k" * 10 + "Q7wXz2LmN9pR4tV8yB3cF6hJ"


def _status(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as reply:
            return reply.status, dict(reply.headers)
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers)


@pytest.mark.parametrize("from_file", [False, True])
def test_a_metrics_token_refuses_scrapes_without_it(data_dir: str, tmp_path: Path, from_file: bool) -> None:
    if from_file:
        path = tmp_path / "metrics-token"
        path.write_text(TOKEN + "\n")
        server = ThreadServer(data_dir, metrics_address="127.0.0.1:0", metrics_token_file=str(path))
    else:
        server = ThreadServer(data_dir, metrics_address="127.0.0.1:0", metrics_token=TOKEN)
    try:
        url = f"http://127.0.0.1:{server.server.metrics.port}/metrics"
        code, headers = _status(url)
        assert code == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert _status(url, {"Authorization": "Bearer " + TOKEN[:-1] + "x"})[0] == 401
        assert _status(url, {"Authorization": TOKEN})[0] == 401
        assert _status(url, {"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert Scraper(server.server.metrics.port, TOKEN).value("querator_queues") == 0
    finally:
        server.stop()


def test_a_weak_or_unreadable_metrics_token_is_refused_at_start(data_dir: str, tmp_path: Path) -> None:
    for settings, message in (
        ({"metrics_token": "short"}, "at least 32 characters"),
        ({"metrics_token_file": str(tmp_path / "missing")}, "cannot read the metrics token file"),
        ({"metrics_token": TOKEN, "metrics_token_file": str(tmp_path / "x")}, "not both"),
    ):
        config = ServerConfig(address="127.0.0.1:0", data_dir=data_dir, metrics_address="127.0.0.1:0", **settings)  # type: ignore[arg-type]
        with pytest.raises(OSError, match=message):
            asyncio.run(QueratorServer(config).start())


class _Gate(Collector):
    """A collector that holds the rendering until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()

    def describe(self) -> list[GaugeMetricFamily]:  # so registering does not collect
        return [GaugeMetricFamily("test_gate", "held by the test")]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.entered.set()
        self.gate.wait(30)
        yield GaugeMetricFamily("test_gate", "held by the test", value=1)


def test_parallel_scrapes_share_one_rendering_and_are_bounded(metered: tuple[ThreadServer, Stubs, Scraper]) -> None:
    server, stubs, scrape = metered
    stubs.create("q")
    metrics = server.server.metrics
    assert metrics is not None
    gate = _Gate()
    metrics.registry.register(gate)
    exposition = metrics._http.get_app()  # type: ignore[union-attr]
    before = exposition.rendered
    results: list[tuple[int, dict[str, str]]] = []
    threads = [threading.Thread(target=lambda: results.append(_status(scrape.url))) for _ in range(MAX_SCRAPES)]
    try:
        threads[0].start()
        assert gate.entered.wait(10)
        for thread in threads[1:]:
            thread.start()
        # Every slot is taken (one rendering, the others waiting for it): one more is refused.
        wait_until(lambda: exposition._slots._value == 0, timeout=10)
        assert _status(scrape.url)[0] == 503
    finally:
        gate.gate.set()
        for thread in threads:
            thread.join(10)
    assert [code for code, _ in results] == [200] * MAX_SCRAPES
    assert exposition.rendered - before == 1  # MAX_SCRAPES answers, one rendering
    metrics.registry.unregister(gate)
    assert scrape.value("querator_queues") == 1 and exposition.rendered - before == 2


def test_series_of_deleted_queues_are_removed(metered: tuple[ThreadServer, Stubs, Scraper]) -> None:
    _server, stubs, scrape = metered
    stubs.create("kept")
    stubs.produce("kept", [b"k"])
    stubs.create("warm-up")  # a delete is counted under queue="" (the queue is gone when it ends)
    stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="warm-up"), timeout=10)
    baseline = set(scrape.samples())
    for round_ in range(30):
        name = f"churn-{round_ % 3}" if round_ % 2 else f"churn-{round_}"
        stubs.create(name, dead_queue="kept" if round_ % 5 == 0 else "")
        stubs.produce(name, [b"a", b"b"])
        leased = stubs.lease(name, batch_size=2)
        stubs.complete(name, leased.partition, [i.id for i in leased.items])
        stream = queue_pb2.ProduceStreamRequest(request=queue_pb2.ProduceRequest(queue_name=name, payloads=[b"s"]))
        assert len(list(stubs.queue.ProduceStream(iter([stream]), timeout=10))) == 1
        with pytest.raises(grpc.RpcError):
            stubs.complete(name, 0, ["no-such-id"])
        assert f'queue="{name}"' in scrape.text()
        stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name=name, force=True), timeout=10)
        assert f'queue="{name}"' not in scrape.text()
    text = scrape.text()
    assert "churn-" not in text
    # Exactly the series there were before the churn, whatever the number of rounds.
    after = set(scrape.samples())
    assert after == baseline, (sorted(after - baseline)[:5], sorted(baseline - after)[:5])


def test_the_oldest_age_is_known_after_a_restart_without_any_call(data_dir: str) -> None:
    server = ThreadServer(data_dir, metrics_address="127.0.0.1:0")
    channel = grpc.insecure_channel(server.address)
    try:
        stubs = Stubs(channel)
        stubs.create("idle", requested_partitions=4)
        for _ in range(4):
            stubs.produce("idle", [b"x"])
        produced = time.time()
    finally:
        channel.close()
        server.stop()
    server = ThreadServer(data_dir, metrics_address="127.0.0.1:0")
    try:
        scrape = Scraper(server.server.metrics.port)
        assert items(scrape, "idle", "ready") == 4
        wait_until(lambda: scrape.value("querator_queue_oldest_ready_age_seconds", queue="idle") > 0, timeout=10)
        age = scrape.value("querator_queue_oldest_ready_age_seconds", queue="idle")
        assert age >= time.time() - produced - 1  # the first item's age, not a fresh one
    finally:
        server.stop()
