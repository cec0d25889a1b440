"""Overload: a bounded inbox under a flood, and thousands of idle long-poll leases.

Two measurements against a server in a child process (so its memory is its own):

1. Waiting leases. N Lease calls wait on an empty queue (long polls) while a producer
   writes to another queue. Produce latency with them waiting is compared with the same
   producer on an idle server; the server's RSS is read before and after; then 2 x N
   items arrive in the waited-on queue and every waiting Lease must get its share.
2. Inbox bound. The disk is stalled (QUERATOR_FAULT_FILE=stall) with one Produce in its
   commit; waves of concurrent produces follow. ``max_inbox`` of them wait, every other
   one is refused with RESOURCE_EXHAUSTED without waiting for the disk, the server's RSS
   stays flat from wave to wave, and once the disk returns every accepted produce is
   stored.

    .venv/bin/python bench/overload.py [--leases 2000] [--waves 20] [--wave 2000] [--max-inbox 1000]

server/tests/test_overload.py runs the same functions in a short form.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc

from querator.v1 import queue_pb2, queue_pb2_grpc, queues_pb2, queues_pb2_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from crash_loop import ServerProcess

FAULT_FILE_ENV = "QUERATOR_FAULT_FILE"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def wait_for(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f}s")
        time.sleep(0.02)


class Client:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.queue = queue_pb2_grpc.QueueServiceStub(self.channel)
        self.queues = queues_pb2_grpc.QueuesServiceStub(self.channel)

    def create(self, name: str) -> None:
        self.queues.CreateQueue(queues_pb2.CreateQueueRequest(queue=queues_pb2.QueueInfo(queue_name=name)), timeout=10)

    def stats(self, name: str) -> queues_pb2.GetQueueStatsResponse:
        return self.queues.GetQueueStats(queues_pb2.GetQueueStatsRequest(queue_name=name), timeout=10)

    def total(self, name: str) -> int:
        return sum(p.total for p in self.stats(name).partitions)

    def close(self) -> None:
        self.channel.close()


def produce_latencies(client: Client, queue: str, n: int, payload: bytes = b"x" * 100) -> list[float]:
    """Seconds per sequential one-item Produce."""
    out: list[float] = []
    request = queue_pb2.ProduceRequest(queue_name=queue, items=[queue_pb2.ProduceItem(payload=payload)])
    for _ in range(n):
        started = time.perf_counter()
        client.queue.Produce(request, timeout=10)
        out.append(time.perf_counter() - started)
    return out


class AsyncCalls:
    """Many concurrent calls from one grpc.aio event loop on a thread of its own."""

    def __init__(self, address: str, channels: int = 4) -> None:
        self.address = address
        self.channels = channels
        self.completed = 0  # calls answered so far, over every ``many``
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _many(self, make_call: Any, n: int) -> list[tuple[grpc.StatusCode, Any, float]]:
        channels = [grpc.aio.insecure_channel(self.address) for _ in range(self.channels)]
        stubs = [queue_pb2_grpc.QueueServiceStub(c) for c in channels]

        async def one(i: int) -> tuple[grpc.StatusCode, Any, float]:
            started = time.perf_counter()
            try:
                reply = await make_call(stubs[i % len(stubs)], i)
                return grpc.StatusCode.OK, reply, time.perf_counter() - started
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details(), time.perf_counter() - started
            finally:
                self.completed += 1

        try:
            return list(await asyncio.gather(*(one(i) for i in range(n))))
        finally:
            for c in channels:
                await c.close()

    def many(self, make_call: Any, n: int) -> Any:
        """Start ``n`` calls at once; the future gives (code, reply or details, seconds) per call."""
        return self.submit(self._many(make_call, n))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class LeaseFigures:
    leases: int
    idle_p50_ms: float
    idle_p90_ms: float
    waiting_p50_ms: float
    waiting_p90_ms: float
    idle_after_p50_ms: float
    rss_before_mb: float
    rss_waiting_mb: float
    lease_waiting_stat: int
    served: int
    lease_codes: dict[str, int] = field(default_factory=dict)
    seconds_to_serve: float = 0.0

    def lines(self) -> list[str]:
        return [
            f"waiting leases: {self.leases}",
            f"produce latency idle:          p50 {self.idle_p50_ms:.2f} ms, p90 {self.idle_p90_ms:.2f} ms",
            (
                f"produce latency with leases:   p50 {self.waiting_p50_ms:.2f} ms, p90 {self.waiting_p90_ms:.2f} ms "
                f"(x{self.waiting_p50_ms / self.idle_p50_ms:.2f} at p50)"
            ),
            f"produce latency idle again:    p50 {self.idle_after_p50_ms:.2f} ms",
            (
                f"server RSS: {self.rss_before_mb:.0f} MB before, {self.rss_waiting_mb:.0f} MB with the leases "
                f"waiting (+{(self.rss_waiting_mb - self.rss_before_mb) * 1024 / max(1, self.leases):.1f} KB per lease)"
            ),
            f"served: {self.served}/{self.leases} leases got an item in {self.seconds_to_serve:.2f} s; codes {self.lease_codes}",
        ]


def measure_waiting_leases(work_dir: str, leases: int, produces: int = 200, step: int = 200) -> LeaseFigures:
    """``leases`` long polls: ``step`` at a time, each batch once the previous ones wait
    (like workers starting over some seconds), or all at the same instant (``step=0``)."""
    server = ServerProcess(os.path.join(work_dir, "leases-data"), os.path.join(work_dir, "leases.log"))
    server.start()
    calls = AsyncCalls(server.address)
    client = Client(server.address)
    try:
        client.create("idle")
        client.create("work")
        produce_latencies(client, "work", 20)  # warm up
        idle = produce_latencies(client, "work", produces)
        rss_before = rss_mb(server.pid)

        def lease(stub: Any, i: int) -> Any:
            request = queue_pb2.LeaseRequest(
                queue_name="idle", batch_size=1, client_id=f"w{i}", request_timeout={"seconds": 120}
            )
            return stub.Lease(request, timeout=150)

        batches = []
        for first in range(0, leases, step or leases):
            count = min(step or leases, leases - first)
            batches.append(calls.many(lambda stub, i, first=first: lease(stub, first + i), count))
            wait_for(
                lambda n=first + count: client.stats("idle").lease_waiting + calls.completed >= n,
                f"{first + count} waiting leases",
                timeout=120,
            )
        waiting_stat = client.stats("idle").lease_waiting
        waiting = produce_latencies(client, "work", produces)
        rss_waiting = rss_mb(server.pid)

        started = time.perf_counter()
        for start in range(0, 2 * leases, 1000):
            count = min(1000, 2 * leases - start)
            items = [queue_pb2.ProduceItem(payload=f"i{start + k}".encode()) for k in range(count)]
            client.queue.Produce(queue_pb2.ProduceRequest(queue_name="idle", items=items), timeout=30)
        results = [r for batch in batches for r in batch.result(timeout=150)]
        served_in = time.perf_counter() - started
        idle_after = produce_latencies(client, "work", produces)
        codes = Counter(code.name for code, _, _ in results)
        served = sum(1 for code, reply, _ in results if code == grpc.StatusCode.OK and len(reply.items) == 1)
        return LeaseFigures(
            leases=leases,
            idle_p50_ms=statistics.median(idle) * 1000,
            idle_p90_ms=percentile(idle, 0.9) * 1000,
            waiting_p50_ms=statistics.median(waiting) * 1000,
            waiting_p90_ms=percentile(waiting, 0.9) * 1000,
            idle_after_p50_ms=statistics.median(idle_after) * 1000,
            rss_before_mb=rss_before,
            rss_waiting_mb=rss_waiting,
            lease_waiting_stat=waiting_stat,
            served=served,
            lease_codes=dict(codes),
            seconds_to_serve=served_in,
        )
    finally:
        client.close()
        calls.close()
        server.kill9()


@dataclass
class FloodFigures:
    max_inbox: int
    waves: int
    wave: int
    payload_bytes: int
    produce_waiting_stat: int
    codes: dict[str, int]
    refused_p50_ms: float
    refused_max_ms: float
    rss_before_mb: float
    rss_after_wave_mb: list[float]
    stored: int
    accepted: int
    refusal: str = ""

    def lines(self) -> list[str]:
        offered = self.waves * self.wave * self.payload_bytes / 1e6
        rss = ", ".join(f"{r:.0f}" for r in self.rss_after_wave_mb)
        return [
            (
                f"flood: {self.waves} waves of {self.wave} concurrent produces of {self.payload_bytes} B "
                f"({offered:.0f} MB in all) at a stalled disk, max_inbox {self.max_inbox}"
            ),
            f"answers: {self.codes}; {self.produce_waiting_stat} waiting in the inbox",
            (
                f"refused in: p50 {self.refused_p50_ms:.1f} ms, max {self.refused_max_ms:.1f} ms "
                f"(client-side, {self.wave} calls in flight); e.g. {self.refusal!r}"
            ),
            f"server RSS: {self.rss_before_mb:.0f} MB before; after each wave {rss} MB",
            f"after the disk returned: {self.stored} stored = {self.accepted} accepted",
        ]


def measure_flood(work_dir: str, max_inbox: int, waves: int, wave: int, payload_bytes: int) -> FloodFigures:
    """Waves of concurrent produces against a stalled disk; RSS after each wave."""
    switch = os.path.join(work_dir, "stall")
    server = ServerProcess(
        os.path.join(work_dir, "flood-data"),
        os.path.join(work_dir, "flood.log"),
        env={FAULT_FILE_ENV: switch},
        max_inbox=max_inbox,
    )
    server.start()
    calls = AsyncCalls(server.address, channels=8)
    client = Client(server.address)
    payload = b"f" * payload_bytes
    try:
        client.create("flood")
        produce_latencies(client, "flood", 10)  # warm up: 10 items stored
        rss_before = rss_mb(server.pid)
        with open(switch, "w") as f:
            f.write("stall")

        def produce(stub: Any, i: int) -> Any:
            request = queue_pb2.ProduceRequest(queue_name="flood", items=[queue_pb2.ProduceItem(payload=payload)])
            return stub.Produce(request, timeout=120)

        first = calls.many(produce, 1)  # the one stuck in its commit
        wait_for(lambda: client.stats("flood").in_flight == 1, "a stalled commit")
        # Wave 1 fills the inbox; the calls beyond it are refused while the disk stalls.
        done_before = calls.completed
        accepted_wave = calls.many(produce, wave)
        wait_for(lambda: calls.completed - done_before >= wave - max_inbox, "the refusals of wave 1", timeout=60)
        rss_after = [rss_mb(server.pid)]
        results: list[tuple[grpc.StatusCode, Any, float]] = []
        for _ in range(waves - 1):  # every later call is refused at once
            results += calls.many(produce, wave).result(timeout=120)
            rss_after.append(rss_mb(server.pid))
        waiting_stat = client.stats("flood").produce_waiting
        os.remove(switch)
        results += accepted_wave.result(timeout=120) + first.result(timeout=120)
        codes = Counter(code.name for code, _, _ in results)
        refused = [seconds for code, _, seconds in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
        refusal = next((str(d) for code, d, _ in results if code == grpc.StatusCode.RESOURCE_EXHAUSTED), "")
        accepted = sum(1 for code, _, _ in results if code == grpc.StatusCode.OK)
        return FloodFigures(
            max_inbox=max_inbox,
            waves=waves,
            wave=wave,
            payload_bytes=payload_bytes,
            produce_waiting_stat=waiting_stat,
            codes=dict(codes),
            refused_p50_ms=statistics.median(refused) * 1000 if refused else 0.0,
            refused_max_ms=max(refused) * 1000 if refused else 0.0,
            rss_before_mb=rss_before,
            rss_after_wave_mb=rss_after,
            stored=client.total("flood") - 10,
            accepted=accepted,
            refusal=refusal[:200],
        )
    finally:
        if os.path.exists(switch):
            os.remove(switch)
        client.close()
        calls.close()
        server.kill9()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=2000)
    parser.add_argument("--produces", type=int, default=500)
    parser.add_argument("--step", type=int, default=200, help="leases started per batch (0: all at once)")
    parser.add_argument("--waves", type=int, default=20)
    parser.add_argument("--wave", type=int, default=2000, help="concurrent produces per wave")
    parser.add_argument("--max-inbox", type=int, default=1000)
    parser.add_argument("--payload", type=int, default=20_000, help="bytes per flooding produce")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="querator-overload-")
    try:
        for line in measure_waiting_leases(work, args.leases, args.produces, args.step).lines():
            print(line)
        for line in measure_flood(work, args.max_inbox, args.waves, args.wave, args.payload).lines():
            print(line)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
