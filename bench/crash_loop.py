"""Crash loop: kill -9 a loaded server at random moments, restart it, and account for every item.

Producers, consumers (complete, retry now, retry later, retry dead, abandon) and the
lifecycle (1 s leases, max_attempts 3, a dead-letter queue, scheduled items) run against
``querator serve`` in a child process, which is killed with SIGKILL at a random moment of
every cycle and restarted on the same data directory. Clients log every acknowledged
produce, lease and complete, keyed by payload (ids change on retry and expiry, payloads
do not). After the last cycle the server is restarted, left to settle, and:

- lost: an acknowledged produce that was neither completed nor is still stored
- duplicated: an item stored twice, completed (acknowledged) twice, or stored although
  its complete was acknowledged; or an item stored that nobody produced
- redelivered-after-complete: a lease granted (server time) after the lease whose
  complete was acknowledged
- stats must equal what ListItems / ListScheduledItems show, per partition

    .venv/bin/python bench/crash_loop.py --cycles 1000 [--seed 1] [--producers 2] [--consumers 2]
    .venv/bin/python bench/crash_loop.py --cluster --cycles 100 --producers 3 --consumers 3

``--cluster`` runs an etcd and three nodes and kills one node per cycle while clients on
the others go on (``run_cluster``); its queue has no dead-letter queue and no attempt
limit, so every item is either completed or still stored at the end.

server/tests/test_crash_loop.py runs the same harness (``run``) for about 20 cycles.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import grpc

from querator.v1 import (
    queue_pb2,
    queue_pb2_grpc,
    queues_pb2,
    queues_pb2_grpc,
    storage_pb2,
    storage_pb2_grpc,
)

WORK = "work"
DLQ = "work-dlq"
PARTITIONS = 2
LEASE_TIMEOUT_S = 1
MAX_ATTEMPTS = 3
RPC_TIMEOUT_S = 5.0
# The codes a Complete or Retry gets when its lease ran out and the item moved on.
LEASE_LOST = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """``querator serve`` (or a server with ``settings``) as a child, stderr to ``log_path``.

    Every start takes a fresh port on 127.0.0.1; a start that loses its port to another
    process is started again on a new one.
    """

    def __init__(self, data_dir: str, log_path: str, *, env: dict[str, str] | None = None, **settings: object) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.env = env or {}
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def _command(self, address: str) -> list[str]:
        if not self.settings:
            return [sys.executable, "-m", "querator_server.cli", "--address", address, "--data-dir", self.data_dir]
        settings = dict(self.settings, address=address, data_dir=self.data_dir)
        code = (
            "import asyncio, json, sys\n"
            "from querator_server import logging as qlogging\n"
            "from querator_server.config import ServerConfig\n"
            "from querator_server.server import serve\n"
            "qlogging.configure('warning')\n"
            "asyncio.run(serve(ServerConfig(**json.loads(sys.argv[1]))))\n"
        )
        return [sys.executable, "-c", code, json.dumps(settings)]

    def start(self, timeout: float = 30.0) -> None:
        for _ in range(5):
            self.address = f"127.0.0.1:{free_port()}"
            env = dict(os.environ, QUERATOR_LOG_LEVEL="warning", **self.env)
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self._command(self.address), env=env, stdout=subprocess.DEVNULL, stderr=log
                )
            if self._wait_ready(timeout):
                return
            if "cannot listen" not in self.log_tail():
                break
        raise RuntimeError(f"the server did not start: {self.log_tail()}")

    def _wait_ready(self, timeout: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        channel = grpc.insecure_channel(self.address, options=FAST_RECONNECT)
        ready = grpc.channel_ready_future(channel)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    return False
                try:
                    ready.result(timeout=0.2)
                    return True
                except grpc.FutureTimeoutError:
                    continue
        finally:
            ready.cancel()
            channel.close()
        self.kill9()
        return False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    stop = kill9

    def log_tail(self, lines: int = 8) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return " | ".join(line.strip() for line in f.readlines()[-lines:])
        except OSError:
            return ""


class Stubs:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.queue = queue_pb2_grpc.QueueServiceStub(self.channel)
        self.queues = queues_pb2_grpc.QueuesServiceStub(self.channel)
        self.storage = storage_pb2_grpc.StorageServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()


def _micros(ts: object) -> int:
    return ts.seconds * 1_000_000 + ts.nanos // 1000  # type: ignore[attr-defined]


@dataclass
class Ledger:
    """What clients were told, keyed by payload. All updates under ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    acked: set[bytes] = field(default_factory=set)
    unsure_produced: set[bytes] = field(default_factory=set)
    # payload -> lease deadlines (server µs) of every lease reply that held it
    leases: dict[bytes, list[int]] = field(default_factory=lambda: defaultdict(list))
    # payload -> lease deadline of each lease whose Complete was acknowledged
    completed: dict[bytes, list[int]] = field(default_factory=lambda: defaultdict(list))
    unsure_completed: set[bytes] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    killed: threading.Event = field(default_factory=threading.Event)

    def fail(self, what: str, exc: grpc.RpcError, killed: threading.Event | None = None) -> bool:
        """Note a failed call; True if it is the kill (expected), False if not."""
        if (killed or self.killed).is_set():
            return True
        with self.lock:
            self.unexpected.append(f"{what}: {exc.code().name} {exc.details()}")
        return False


def _producer(
    address: str, ledger: Ledger, tag: str, seed: int, stop: threading.Event, killed: threading.Event | None = None
) -> None:
    killed = killed or ledger.killed
    rng = random.Random(seed)
    stubs = Stubs(address)
    n = 0
    try:
        while not stop.is_set():
            payloads = [f"{tag}-{n + i}".encode() for i in range(rng.randint(1, 10))]
            n += len(payloads)
            later = rng.random() < 0.1
            items = []
            for p in payloads:
                item = queue_pb2.ProduceItem(payload=p)
                if later:
                    item.enqueue_at.FromMicroseconds(int((time.time() + 0.3) * 1e6))
                items.append(item)
            if later or rng.random() < 0.5:
                request = queue_pb2.ProduceRequest(queue_name=WORK, items=items)
            else:  # the compact form, for bare payloads
                request = queue_pb2.ProduceRequest(queue_name=WORK, payloads=payloads)
            try:
                stubs.queue.Produce(request, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                with ledger.lock:
                    ledger.unsure_produced.update(payloads)
                ledger.fail("Produce", exc, killed)
                return
            with ledger.lock:
                ledger.acked.update(payloads)
                ledger.counts["produce_calls"] += 1
            time.sleep(rng.random() * 0.01)
    finally:
        stubs.close()


def _consumer(
    address: str,
    ledger: Ledger,
    tag: str,
    seed: int,
    stop: threading.Event,
    killed: threading.Event | None = None,
    home_down: threading.Event | None = None,
) -> None:
    """``killed``: this client's server is gone (its errors are expected); ``home_down``
    (cluster): another node is, so a Complete or Retry for its partition may fail."""
    killed = killed or ledger.killed
    dead_letters = home_down is None  # the cluster run has no dead-letter queue
    rng = random.Random(seed)
    stubs = Stubs(address)
    try:
        while not stop.is_set():
            request = queue_pb2.LeaseRequest(
                queue_name=WORK, batch_size=rng.randint(1, 20), client_id=tag, request_timeout={"nanos": 200_000_000}
            )
            try:
                lease = stubs.queue.Lease(request, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                ledger.fail("Lease", exc, killed)
                return
            if not lease.items:
                continue
            by_payload = {i.id: (i.payload, _micros(i.lease_deadline)) for i in lease.items}
            with ledger.lock:
                for payload, deadline in by_payload.values():
                    ledger.leases[payload].append(deadline)
                ledger.counts["leased"] += len(by_payload)
            complete: list[str] = []
            retry: list[queue_pb2.RetryItem] = []
            for item_id in by_payload:
                roll = rng.random()
                if roll < 0.70:
                    complete.append(item_id)
                elif roll < 0.80:
                    retry.append(queue_pb2.RetryItem(id=item_id))
                elif roll < 0.85:
                    at = queue_pb2.RetryItem(id=item_id)
                    at.retry_at.FromMicroseconds(int((time.time() + 0.3) * 1e6))
                    retry.append(at)
                elif roll < 0.90:
                    if dead_letters:
                        retry.append(queue_pb2.RetryItem(id=item_id, dead=True))
                    else:
                        complete.append(item_id)
                else:
                    ledger.counts["abandoned"] += 1  # its lease runs out: the lifecycle takes it
            # Looked at when a call fails, not before it is sent: a node killed while a
            # forwarded Complete or Retry is on its way fails that call too.
            down = killed if home_down is None else home_down
            if complete and not _settle(stubs, ledger, lease.partition, complete, by_payload, "Complete", down):
                return
            if retry and not _settle(stubs, ledger, lease.partition, retry, by_payload, "Retry", down):
                return
    finally:
        stubs.close()


def _settle(
    stubs: Stubs,
    ledger: Ledger,
    partition: int,
    entries: list[str] | list[queue_pb2.RetryItem],
    by_payload: dict[str, tuple[bytes, int]],
    rpc: str,
    killed: threading.Event | None = None,
) -> bool:
    """Complete or retry ``entries``; False when the server is gone."""
    killed = killed or ledger.killed
    ids = [e if isinstance(e, str) else e.id for e in entries]
    try:
        if rpc == "Complete":
            request = queue_pb2.CompleteRequest(queue_name=WORK, partition=partition, ids=ids)
            stubs.queue.Complete(request, timeout=RPC_TIMEOUT_S)
        else:
            request = queue_pb2.RetryRequest(queue_name=WORK, partition=partition, items=entries)
            stubs.queue.Retry(request, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        if rpc == "Complete" and killed.is_set():
            with ledger.lock:
                ledger.unsure_completed.update(by_payload[i][0] for i in ids)
        if not killed.is_set() and exc.code() in LEASE_LOST:
            with ledger.lock:  # a slow client: its 1 s lease ran out first
                ledger.counts["lease_lost"] += 1
            return True
        if killed is not ledger.killed and killed.is_set():
            return True  # cluster: the partition's home is down; this client goes on
        ledger.fail(rpc, exc, killed)
        return False
    with ledger.lock:
        if rpc == "Complete":
            for i in ids:
                payload, deadline = by_payload[i]
                ledger.completed[payload].append(deadline)
        ledger.counts[rpc.lower()] += len(ids)
    return True


@dataclass
class Report:
    cycles: int = 0
    acked: int = 0
    lost: int = 0
    duplicated: int = 0
    redelivered_after_complete: int = 0
    completed: int = 0
    in_queue: int = 0
    in_dlq: int = 0
    unsure_produced: int = 0
    unsure_completed: int = 0
    stats_mismatches: list[str] = field(default_factory=list)
    unexpected_errors: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.duplicated
            or self.redelivered_after_complete
            or self.stats_mismatches
            or self.unexpected_errors
            or self.server_errors
        )

    def headline(self) -> str:
        return (
            f"cycles={self.cycles}, acked={self.acked}, lost={self.lost}, duplicated={self.duplicated}, "
            f"redelivered-after-complete={self.redelivered_after_complete}"
        )


def _list(stubs: Stubs, name: str, partition: int, scheduled: bool) -> list[storage_pb2.StorageItem]:
    items: list[storage_pb2.StorageItem] = []
    token = ""
    for _ in range(100_000):
        if scheduled:
            page = stubs.storage.ListScheduledItems(
                storage_pb2.ListScheduledItemsRequest(queue_name=name, partition=partition, page_size=1000, page_token=token),
                timeout=30,
            )
        else:
            page = stubs.storage.ListItems(
                storage_pb2.ListItemsRequest(queue_name=name, partition=partition, page_size=1000, page_token=token),
                timeout=30,
            )
        items.extend(page.items)
        token = page.next_page_token
        if not token:
            return items
    raise RuntimeError("paging did not end")


def _snapshot(stubs: Stubs, names: tuple[str, ...] = (WORK, DLQ)) -> tuple[dict[str, list[bytes]], list[str]]:
    """Payloads stored per queue, and per-partition stats that differ from the listing."""
    stored: dict[str, list[bytes]] = {}
    mismatches: list[str] = []
    for name in names:
        info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name=name), timeout=10).queue
        stats = {p.partition: p for p in stubs.queues.GetQueueStats(
            queues_pb2.GetQueueStatsRequest(queue_name=name), timeout=10
        ).partitions}
        payloads: list[bytes] = []
        for p in range(info.requested_partitions):
            ready_leased = _list(stubs, name, p, scheduled=False)
            scheduled = _list(stubs, name, p, scheduled=True)
            payloads += [i.payload for i in ready_leased + scheduled]
            listed = (len(ready_leased), sum(1 for i in ready_leased if i.is_leased), len(scheduled))
            s = stats[p]
            if (s.total, s.total_leased, s.scheduled) != listed:
                mismatches.append(f"{name}[{p}] stats {(s.total, s.total_leased, s.scheduled)} != listed {listed}")
        stored[name] = payloads
    return stored, mismatches


def _settled(stubs: Stubs) -> bool:
    stats = stubs.queues.GetQueueStats(queues_pb2.GetQueueStatsRequest(queue_name=WORK), timeout=10)
    return all(p.total_leased == 0 and p.scheduled == 0 for p in stats.partitions)


def _account(ledger: Ledger, stored: dict[str, list[bytes]], report: Report) -> None:
    where = Counter(p for payloads in stored.values() for p in payloads)
    examples: list[str] = []
    lost = [p for p in ledger.acked if p not in where and not ledger.completed.get(p) and p not in ledger.unsure_completed]
    twice_stored = [p for p, n in where.items() if n > 1]
    twice_completed = [p for p, d in ledger.completed.items() if len(d) > 1]
    completed_but_stored = [p for p, d in ledger.completed.items() if d and p in where]
    phantoms = [p for p in where if p not in ledger.acked and p not in ledger.unsure_produced]
    redelivered = [
        (p, d) for p, done in ledger.completed.items() if done for d in ledger.leases.get(p, []) if d > min(done)
    ]
    report.lost = len(lost)
    report.duplicated = len(set(twice_stored) | set(twice_completed) | set(completed_but_stored) | set(phantoms))
    report.redelivered_after_complete = len(redelivered)
    for label, values in (
        ("lost", lost),
        ("stored twice", twice_stored),
        ("completed twice", twice_completed),
        ("stored after its complete", completed_but_stored),
        ("stored, never produced", phantoms),
        ("leased after its complete", [p for p, _ in redelivered]),
    ):
        if values:
            examples.append(f"{label}: {len(values)}, e.g. {sorted(values)[:3]}")
    report.examples = examples
    report.in_queue = len(stored[WORK])
    report.in_dlq = len(stored.get(DLQ, []))


def _server_errors(log_path: str) -> list[str]:
    """Error-level log lines (and tracebacks) the server wrote during the run."""
    out: list[str] = []
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    if "Traceback" in line or "Error" in line:
                        out.append(line.strip()[:300])
                    continue
                if isinstance(event, dict) and event.get("level") in ("error", "critical"):
                    out.append(line.strip()[:300])
    except OSError:
        pass
    return out


def run(
    cycles: int,
    data_dir: str,
    *,
    seed: int = 1,
    producers: int = 2,
    consumers: int = 2,
    max_run_s: float = 0.5,
    settle_s: float = 20.0,
    progress: bool = False,
) -> Report:
    """Run ``cycles`` kill -9 cycles on ``data_dir`` (which must not hold a server yet)."""
    started = time.monotonic()
    rng = random.Random(seed)
    ledger = Ledger()
    report = Report(cycles=cycles)
    os.makedirs(data_dir, exist_ok=True)
    log_path = os.path.join(os.path.dirname(os.path.abspath(data_dir)), f"{os.path.basename(data_dir)}.server.log")
    server = ServerProcess(data_dir, log_path)
    server.start()
    try:
        stubs = Stubs(server.address)
        try:
            stubs.queues.CreateQueue(queues_pb2.CreateQueueRequest(queue=queues_pb2.QueueInfo(queue_name=DLQ)), timeout=10)
            info = queues_pb2.QueueInfo(
                queue_name=WORK,
                dead_queue=DLQ,
                lease_timeout={"seconds": LEASE_TIMEOUT_S},
                max_attempts=MAX_ATTEMPTS,
                requested_partitions=PARTITIONS,
            )
            stubs.queues.CreateQueue(queues_pb2.CreateQueueRequest(queue=info), timeout=10)
        finally:
            stubs.close()
        for cycle in range(cycles):
            ledger.killed.clear()
            stop = threading.Event()
            workers = [
                threading.Thread(
                    target=_producer,
                    args=(server.address, ledger, f"c{cycle}p{i}", rng.getrandbits(32), stop),
                    daemon=True,
                )
                for i in range(producers)
            ] + [
                threading.Thread(
                    target=_consumer,
                    args=(server.address, ledger, f"c{cycle}w{i}", rng.getrandbits(32), stop),
                    daemon=True,
                )
                for i in range(consumers)
            ]
            for w in workers:
                w.start()
            # Mostly mid-load; sometimes right after start-up, while recovery still runs.
            time.sleep(rng.uniform(0.0, 0.05) if rng.random() < 0.2 else rng.uniform(0.05, max_run_s))
            ledger.killed.set()
            server.kill9()
            stop.set()
            for w in workers:
                w.join(RPC_TIMEOUT_S * 3)
                if w.is_alive():
                    ledger.unexpected.append(f"cycle {cycle}: a client thread did not notice the dead server")
            server.start()
            if progress and (cycle + 1) % 50 == 0:
                print(f"  cycle {cycle + 1}/{cycles}: acked {len(ledger.acked)}", file=sys.stderr, flush=True)

        # Let every lease run out, scheduled items fall due and dead letters arrive.
        stubs = Stubs(server.address)
        try:
            deadline = time.monotonic() + settle_s
            while not _settled(stubs) and time.monotonic() < deadline:
                time.sleep(0.1)
            stored, mismatches = _snapshot(stubs)
            _account(ledger, stored, report)
            # A dead letter in transit (committed to the source's outbox, not yet stored
            # by the DLQ) is briefly in neither listing: look again before calling it lost.
            while (report.lost or mismatches) and time.monotonic() < deadline:
                time.sleep(0.2)
                stored, mismatches = _snapshot(stubs)
                _account(ledger, stored, report)
            report.stats_mismatches = mismatches
        finally:
            stubs.close()
        server.terminate()
    finally:
        server.kill9()
    report.acked = len(ledger.acked)
    report.completed = sum(1 for d in ledger.completed.values() if d)
    report.unsure_produced = len(ledger.unsure_produced - ledger.acked)
    report.unsure_completed = len(ledger.unsure_completed)
    report.unexpected_errors = list(ledger.unexpected)
    report.server_errors = _server_errors(log_path)
    report.counts = dict(ledger.counts)
    report.seconds = time.monotonic() - started
    return report


# -- cluster mode ---------------------------------------------------------------------

CLUSTER_NODES = 3
CLUSTER_PARTITIONS = 6  # two on each node
CLUSTER_TTL_S = 2


class EtcdProcess:
    """etcd (the binary on PATH) on free loopback ports, data under ``data_dir``."""

    def __init__(self, data_dir: str, log_path: str) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("cluster mode needs the etcd binary (Debian: apt-get install etcd-server)")
        self.endpoint = f"127.0.0.1:{free_port()}"
        peer = f"http://127.0.0.1:{free_port()}"
        self.command = [
            binary, "--name", "crash-loop", "--data-dir", data_dir,
            "--listen-client-urls", f"http://{self.endpoint}", "--advertise-client-urls", f"http://{self.endpoint}",
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"crash-loop={peer}", "--log-level", "warn",
        ]  # fmt: skip
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", int(self.endpoint.rsplit(":", 1)[1]))) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError("etcd did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def run_cluster(
    cycles: int,
    root: str,
    *,
    seed: int = 1,
    producers: int = 3,
    consumers: int = 3,
    max_run_s: float = 0.5,
    settle_s: float = 30.0,
    progress: bool = False,
) -> Report:
    """Cycles of kill -9 on one random node of an etcd-coordinated three-node cluster.

    Clients are spread over the nodes. The killed node's clients stop (their errors are
    expected); the others go on while it is dead, and their Produce and Lease calls must
    not fail (a Complete or Retry for the dead node's partition may: unknown outcome).
    Then it restarts on its data directory. The accounting is the single-server one.
    """
    started = time.monotonic()
    rng = random.Random(seed)
    ledger = Ledger()
    report = Report(cycles=cycles)
    os.makedirs(root, exist_ok=True)
    log_path = os.path.join(root, "cluster.log")
    etcd = EtcdProcess(os.path.join(root, "etcd"), log_path)
    etcd.start()
    url = f"etcd://{etcd.endpoint}/crash-loop"
    nodes = [
        ServerProcess(
            os.path.join(root, f"n{i}"), log_path, cluster=url, node_id=f"n{i}", cluster_lease_ttl_s=CLUSTER_TTL_S
        )
        for i in range(1, CLUSTER_NODES + 1)
    ]
    try:
        for node in nodes:
            node.start(timeout=60)
        stubs = Stubs(nodes[0].address)
        try:
            info = queues_pb2.QueueInfo(
                queue_name=WORK, lease_timeout={"seconds": LEASE_TIMEOUT_S}, requested_partitions=CLUSTER_PARTITIONS
            )
            stubs.queues.CreateQueue(queues_pb2.CreateQueueRequest(queue=info), timeout=10)
        finally:
            stubs.close()
        for cycle in range(cycles):
            victim = rng.randrange(len(nodes))
            gone = [threading.Event() for _ in nodes]  # per node: it was killed
            home_down = threading.Event()
            stop = threading.Event()
            workers = []
            for i in range(producers):
                at = i % len(nodes)
                args = (nodes[at].address, ledger, f"c{cycle}p{i}", rng.getrandbits(32), stop, gone[at])
                workers.append(threading.Thread(target=_producer, args=args, daemon=True))
            for i in range(consumers):
                at = i % len(nodes)
                args = (nodes[at].address, ledger, f"c{cycle}w{i}", rng.getrandbits(32), stop, gone[at], home_down)
                workers.append(threading.Thread(target=_consumer, args=args, daemon=True))
            for w in workers:
                w.start()
            time.sleep(rng.uniform(0.05, max_run_s))
            gone[victim].set()
            home_down.set()
            nodes[victim].kill9()
            time.sleep(rng.uniform(0.2, 1.0))  # the others serve on while it is dead
            stop.set()
            for w in workers:
                w.join(RPC_TIMEOUT_S * 3)
                if w.is_alive():
                    ledger.unexpected.append(f"cycle {cycle}: a client thread did not stop")
            nodes[victim].start(timeout=60)
            if progress and (cycle + 1) % 10 == 0:
                print(f"  cycle {cycle + 1}/{cycles}: acked {len(ledger.acked)}", file=sys.stderr, flush=True)

        stubs = Stubs(nodes[0].address)
        try:
            deadline = time.monotonic() + settle_s
            while time.monotonic() < deadline:
                try:
                    if _settled(stubs):
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
            stored, mismatches = _snapshot(stubs, (WORK,))
            _account(ledger, stored, report)
            report.stats_mismatches = mismatches
        finally:
            stubs.close()
        for node in nodes:
            node.terminate()
    finally:
        for node in nodes:
            node.kill9()
        etcd.stop()
    report.acked = len(ledger.acked)
    report.completed = sum(1 for d in ledger.completed.values() if d)
    report.unsure_produced = len(ledger.unsure_produced - ledger.acked)
    report.unsure_completed = len(ledger.unsure_completed)
    report.unexpected_errors = list(ledger.unexpected)
    report.server_errors = _server_errors(log_path)
    report.counts = dict(ledger.counts)
    report.seconds = time.monotonic() - started
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--max-run", type=float, default=0.5, help="longest load phase per cycle, seconds")
    parser.add_argument("--data-dir", help="where to keep the data (default: a temporary directory, removed)")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="kill -9 one node of an etcd-coordinated three-node cluster per cycle (needs the etcd binary)",
    )
    args = parser.parse_args(argv)
    work = args.data_dir or tempfile.mkdtemp(prefix="querator-crash-loop-")
    data_dir = os.path.join(work, "data") if not args.data_dir else args.data_dir
    try:
        report = (run_cluster if args.cluster else run)(
            args.cycles,
            data_dir,
            seed=args.seed,
            producers=args.producers,
            consumers=args.consumers,
            max_run_s=args.max_run,
            progress=True,
        )
    finally:
        if not args.data_dir:
            shutil.rmtree(work, ignore_errors=True)
    print(report.headline())
    print(
        f"completed={report.completed}, in_queue={report.in_queue}, in_dlq={report.in_dlq}, "
        f"unsure_produced={report.unsure_produced}, unsure_completed={report.unsure_completed}, "
        f"seconds={report.seconds:.0f}"
    )
    print("calls: " + ", ".join(f"{k}={v}" for k, v in sorted(report.counts.items())))
    for line in report.examples + report.stats_mismatches:
        print("  " + line)
    for line in report.unexpected_errors[:10]:
        print("  unexpected client error: " + line)
    for line in report.server_errors[:10]:
        print("  server error: " + line)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
