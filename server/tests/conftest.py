"""Fixtures: a real server on 127.0.0.1:0 with real LMDB in a temp dir.

``server`` runs in-process on a thread of its own (its own event loop), so tests
talk to it through real gRPC channels exactly as other services do. ``process_server``
runs ``querator serve`` as a child process for tests that must ``kill -9`` it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from querator.v1 import (
    queue_pb2,
    queue_pb2_grpc,
    queues_pb2,
    queues_pb2_grpc,
    storage_pb2,
    storage_pb2_grpc,
)
from querator_server.config import ServerConfig
from querator_server.server import QueratorServer


@dataclass
class Stubs:
    channel: grpc.Channel
    queue: queue_pb2_grpc.QueueServiceStub = field(init=False)
    queues: queues_pb2_grpc.QueuesServiceStub = field(init=False)
    storage: storage_pb2_grpc.StorageServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.queue = queue_pb2_grpc.QueueServiceStub(self.channel)
        self.queues = queues_pb2_grpc.QueuesServiceStub(self.channel)
        self.storage = storage_pb2_grpc.StorageServiceStub(self.channel)

    # Small helpers that keep tests readable.
    def create(self, name: str, **settings: object) -> queues_pb2.QueueInfo:
        info = queues_pb2.QueueInfo(queue_name=name, **settings)  # type: ignore[arg-type]
        return self.queues.CreateQueue(queues_pb2.CreateQueueRequest(queue=info), timeout=10).queue

    def produce(self, name: str, payloads: list[bytes], **kw: object) -> queue_pb2.ProduceResponse:
        items = [queue_pb2.ProduceItem(payload=p) for p in payloads]
        return self.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=items, **kw), timeout=10)  # type: ignore[arg-type]

    def lease(self, name: str, batch_size: int = 10, client_id: str = "", timeout: float = 5, **kw: object) -> queue_pb2.LeaseResponse:
        request = queue_pb2.LeaseRequest(queue_name=name, batch_size=batch_size, client_id=client_id, **kw)  # type: ignore[arg-type]
        return self.queue.Lease(request, timeout=timeout)

    def complete(self, name: str, partition: int, ids: list[str]) -> None:
        self.queue.Complete(queue_pb2.CompleteRequest(queue_name=name, partition=partition, ids=ids), timeout=10)

    def stats(self, name: str) -> queues_pb2.GetQueueStatsResponse:
        return self.queues.GetQueueStats(queues_pb2.GetQueueStatsRequest(queue_name=name), timeout=10)

    def list_items(self, name: str, partition: int = 0, page_size: int = 1000) -> list[storage_pb2.StorageItem]:
        request = storage_pb2.ListItemsRequest(queue_name=name, partition=partition, page_size=page_size)
        return list(self.storage.ListItems(request, timeout=10).items)


class ThreadServer:
    """A QueratorServer on its own event loop in a background thread."""

    def __init__(self, data_dir: str, **settings: object) -> None:
        self.data_dir = data_dir
        settings.setdefault("address", "127.0.0.1:0")
        self.config = ServerConfig(data_dir=data_dir, **settings)  # type: ignore[arg-type]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = QueratorServer(self.config)
        self._call(self.server.start())
        self.address = self.server.address

    def _call(self, coro: object, timeout: float = 30) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self, grace: float = 1.0) -> None:
        if self.loop.is_running():
            self._call(self.server.stop(grace))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture
def data_dir(tmp_path: object) -> str:
    return str(tmp_path / "data")  # type: ignore[operator]


@pytest.fixture
def server(data_dir: str) -> Iterator[ThreadServer]:
    srv = ThreadServer(data_dir)
    yield srv
    srv.stop()


@pytest.fixture
def stubs(server: ThreadServer) -> Iterator[Stubs]:
    channel = grpc.insecure_channel(server.address)
    yield Stubs(channel)
    channel.close()


def _port_slice() -> range:
    """The ports this test process hands out: below the kernel's ephemeral range (so
    neither a bind to port 0 nor an outgoing connection is ever given one), split
    between the xdist workers (and one more share for a process outside xdist: `./dev
    test` runs one beside them, telling it their number in QUERATOR_TEST_WORKERS) so two
    workers never pick the same port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    low = 12000
    high = max(ephemeral, low + 2000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or os.environ.get("QUERATOR_TEST_WORKERS") or 0)
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else count
    share = (high - low) // (count + 1)
    start = low + min(index, count) * share
    return range(start, start + share)


_ports = _port_slice()
_next_port = random.Random(os.getpid()).randrange(len(_ports))


def free_port() -> int:
    """A port free now that stays this process's: a node restarted on it later finds it
    free. A port picked by binding 0 and released comes from the ephemeral range, where
    the kernel may give it to any other socket meanwhile (a restarted node once found
    its port taken while it was down); one of this process's share of the ports below
    that range is given to nobody else, and each is handed out once per round."""
    global _next_port
    for _ in range(len(_ports)):
        port = _ports[_next_port % len(_ports)]
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_ports}")


# Channel options that retry a refused connection every few tens of milliseconds instead
# of backing off for seconds, so a wait for a booting server ends as soon as it listens.
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 100),
]


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on ``port`` (true where /proc cannot tell)."""
    owned: set[str] = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                owned.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    except OSError:
        return True
    tables = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        tables += 1
        for row in rows:  # local address "hex-ip:hex-port", state 0A is LISTEN, then the inode
            if row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port and f"socket:[{row[9]}]" in owned:
                return True
    return tables == 0


def wait_for_server(address: str, proc: subprocess.Popen[bytes], timeout: float, log: Callable[[], str]) -> None:
    """Wait until the child ``proc`` answers on ``address``; fail with its stderr if it
    exits first or does not answer within ``timeout`` seconds (it is then killed).

    An answer counts only once the child itself listens on the port: a free port picked
    beforehand can be taken by another process in the meantime, and the test must not
    go on talking to that one.
    """
    port = int(address.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout
    channel = grpc.insecure_channel(address, options=FAST_RECONNECT)
    ready = grpc.channel_ready_future(channel)
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited with {proc.returncode} before it answered on {address}:\n{log()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                proc.kill()
                proc.wait(10)
                raise AssertionError(f"the server did not answer on {address} within {timeout}s:\n{log()}")
            try:
                ready.result(timeout=min(0.25, remaining))
            except grpc.FutureTimeoutError:
                continue
            if _listens(proc.pid, port):
                return
            time.sleep(0.05)  # an answer, but not from the child (not yet, or another process's)
    finally:
        ready.cancel()
        channel.close()


class ProcessServer:
    """``querator serve`` in a child process, for kill -9 and signal tests.

    The child's stderr goes to a file (never a pipe nobody reads); ``stderr_text()``
    returns what the latest start wrote.
    """

    def __init__(self, data_dir: str, extra_args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.extra_args = extra_args or []
        self.env = env or {}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    def start(self, timeout: float = 30) -> None:
        env = dict(os.environ, QUERATOR_LOG_LEVEL="warning", **self.env)
        self._close_stderr()
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "querator_server.cli", "--address", self.address, "--data-dir", self.data_dir,
             *self.extra_args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )
        wait_for_server(self.address, self.proc, timeout, self.stderr_text)

    def stderr_text(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", errors="replace")

    def _close_stderr(self) -> None:
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 20) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_stderr()


@pytest.fixture
def process_server(data_dir: str) -> Iterator[ProcessServer]:
    srv = ProcessServer(data_dir)
    srv.start()
    yield srv
    srv.stop()


def wait_until(predicate: object, timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` seconds (always bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


# -- protobuf and status helpers shared by the test modules ----------------------------


def dur(seconds: float = 0, nanos: int = 0) -> duration_pb2.Duration:
    """A Duration of ``seconds`` (fractions allowed) plus ``nanos``."""
    whole = int(seconds // 1)
    total = round((seconds - whole) * 1e9) + nanos
    return duration_pb2.Duration(seconds=whole + total // 1_000_000_000, nanos=total % 1_000_000_000)


def secs(value: object) -> float:
    """A Timestamp or Duration as float seconds."""
    return value.seconds + value.nanos / 1e9  # type: ignore[attr-defined, no-any-return]


def rpc_error(call: Callable[[], object]) -> grpc.RpcError:
    """The error ``call`` raises (it must raise one)."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def expect_code(call: Callable[[], object], code: grpc.StatusCode) -> grpc.RpcError:
    """The error ``call`` raises, which must have ``code``."""
    error = rpc_error(call)
    assert error.code() == code, f"expected {code.name}, got {error.code().name}: {error.details()}"
    return error


def bad_request_fields(error: grpc.RpcError) -> list[str]:
    """The fields named by the google.rpc.BadRequest details of an INVALID_ARGUMENT."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None, "INVALID_ARGUMENT must carry a google.rpc.Status with details"
    fields: list[str] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields.extend(v.field for v in bad.field_violations)
    return fields


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """A test's ``figures`` (``record_property("figures", text)``), printed after the run
    even when it passed, and from xdist workers too (user properties travel with reports)."""
    lines = [
        f"{report.nodeid}:\n{value}"
        for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
        if report.when == "call"
        for name, value in report.user_properties
        if name == "figures"
    ]
    if lines:
        terminalreporter.section("figures")
        for line in lines:
            terminalreporter.write_line(line)


# How `./dev test` spreads the suite over its two xdist workers (--dist loadfile
# --no-loadscope-reorder): each file is one unit of work (each test, for SPREAD_TESTS),
# handed out in collection order as a worker runs low. The slowest files go first, so
# that the many short ones even the workers out at the end rather than one long file
# starting last on one worker while the other idles. Measured per file in one full run
# on 2 busy cores (seconds there, about 2.5 times CI's): first the long files that use
# CPU rather than wait and bound no time (the Spark JVM and the TypeScript build start
# meanwhile), then the failover cases, then the rest by time. Files changed since that
# run were measured alone (-p no:xdist) before and after the change, on the same busy
# machine (load 8-13), and moved by the ratio, except as noted.
SLOWEST_FIRST = [
    "test_disk_faults.py",  # 177 s (92 s alone)
    "test_replication_failover.py",  # 550 s in 10 tests of 26-96 s (SPREAD_TESTS)
    "test_cluster_identity.py",  # 140 s
    "test_replication_network_faults.py",  # 133 s in 5 tests (SPREAD_TESTS)
    "test_replication_wiped_node.py",  # 117 s in 3 tests (SPREAD_TESTS)
    "test_server_process.py",
    "test_durability.py",
    "test_sdk_cli_docs.py",
    "test_cluster_faults.py",
    "test_crash_loop.py",
    "test_lifecycle.py",
    "test_audit.py",  # 111 s at 70 s of faults; 45 s now: 80 -> 57 s alone
    "test_model.py",  # 83 s, one test
    "test_dev_script.py",  # 106 s; pip no longer byte-compiles: 90 -> 50 s alone
    "test_cluster.py",
    "test_cluster_etcd_access.py",
    "test_cluster_operator.py",
    "test_cluster_peers.py",
    "test_storage_model.py",
    "test_fuzz.py",
    "test_cluster_redrive.py",
    "test_replica_copies_added.py",
    "test_overload.py",
    "test_sdk_cluster_faults.py",
    # 185 s; 68 -> 50 s alone, in tests of at most 10 s: as units of SPREAD_TESTS they
    # even the workers out late rather than early.
    "test_sdk_cli.py",
    # 185 s in that run, yet 18-20 s alone and beside test_sdk_cli.py (load 8-15) since it
    # runs at a fifth of the scale: kept ahead of the short files all the same.
    "test_console_scale.py",
]


# Long files whose tests each start what they need (a server or cluster of their own,
# no module-scoped fixture, no fixed port or path, no order among them): under --dist
# loadfile each of their tests is a unit of work of its own, so their cases spread over
# both workers instead of holding one for the file's whole time
# (test_replication_failover.py: ten cases, about 250 s in CI).
SPREAD_TESTS = {
    "test_replication_failover.py",
    "test_replication_network_faults.py",
    "test_replication_wiped_node.py",
    "test_sdk_cli.py",
    "test_cluster_identity.py",
    "test_server_process.py",
    "test_durability.py",
    "test_crash_loop.py",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """--dist loadfile, except that a file of SPREAD_TESTS goes out test by test."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SpreadFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if os.path.basename(path) in SPREAD_TESTS else path

    return SpreadFileScheduling(config, log)  # type: ignore[arg-type]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a run on one process keeps the collection order

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: the other files' order, and each file's own, stay as collected
