"""Fixtures: a real server on 127.0.0.1:0 with real LMDB in a temp dir.

``server`` runs in-process on a thread of its own (its own event loop), so tests
talk to it through real gRPC channels exactly as other services do. ``subprocess_server``
runs ``querator serve`` as a child process for tests that must ``kill -9`` it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
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
        self.config = ServerConfig(address="127.0.0.1:0", data_dir=data_dir, **settings)  # type: ignore[arg-type]
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ProcessServer:
    """``querator serve`` in a child process, for kill -9 and signal tests."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20) -> None:
        env = dict(os.environ, QUERATOR_LOG_LEVEL="warning")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "querator_server.cli", "--address", self.address, "--data-dir", self.data_dir],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        channel = grpc.insecure_channel(self.address)
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        finally:
            channel.close()

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
