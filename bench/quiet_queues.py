"""Many queues, one small call at a time each: commit groups on against off.

Q client threads (one channel each) each produce 10-item batches into a queue of
their own, one call at a time with a 2 ms pause between calls, as services that
each own a queue do. The same run is made against a server with commit groups on
(the default) and one with ``QUERATOR_COMMIT_GROUPS=false``, alternating, and the
calls per second and produce latency (p50, p99) of each are printed.

    .venv/bin/python bench/quiet_queues.py [--queues 28] [--calls 100] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import grpc

from querator.v1 import queue_pb2, queue_pb2_grpc, queues_pb2, queues_pb2_grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import install_cleanup_handlers, percentile  # noqa: E402
from querator_target import QueratorService  # noqa: E402

PAUSE_S = 0.002
BATCH = [b"x" * 100] * 10


def _produce_loop(address: str, queue: str, calls: int, out: list[float], lock: threading.Lock) -> None:
    channel = grpc.insecure_channel(address)
    stub = queue_pb2_grpc.QueueServiceStub(channel)
    took: list[float] = []
    try:
        for _ in range(calls):
            started = time.perf_counter()
            stub.Produce(queue_pb2.ProduceRequest(queue_name=queue, payloads=BATCH), timeout=10)
            took.append(time.perf_counter() - started)
            time.sleep(PAUSE_S)
    finally:
        channel.close()
    with lock:
        out.extend(took)


def measure(workdir: str, groups: bool, queues: int, calls: int) -> tuple[float, float, float]:
    """(calls/s, p50 ms, p99 ms) of one run against a fresh server."""
    os.environ["QUERATOR_COMMIT_GROUPS"] = "true" if groups else "false"
    service = QueratorService(workdir)
    address = service.start().address
    try:
        with grpc.insecure_channel(address) as channel:
            admin = queues_pb2_grpc.QueuesServiceStub(channel)
            for i in range(queues):
                info = queues_pb2.QueueInfo(queue_name=f"quiet-{i}")
                admin.CreateQueue(queues_pb2.CreateQueueRequest(queue=info), timeout=10)
        latencies: list[float] = []
        lock = threading.Lock()
        threads = [
            threading.Thread(target=_produce_loop, args=(address, f"quiet-{i}", calls, latencies, lock))
            for i in range(queues)
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        elapsed = time.perf_counter() - started
    finally:
        service.stop()
    latencies.sort()
    return len(latencies) / elapsed, 1e3 * percentile(latencies, 50), 1e3 * percentile(latencies, 99)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queues", type=int, default=28)
    parser.add_argument("--calls", type=int, default=100, help="calls per queue (default 100)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    install_cleanup_handlers()
    print("| commit groups | queues | calls/s | p50 ms | p99 ms |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="querator-quiet-") as workdir:
        for _ in range(args.rounds):
            for groups in (True, False):
                rate, p50, p99 = measure(workdir, groups, args.queues, args.calls)
                print(f"| {'on' if groups else 'off'} | {args.queues} | {rate:,.0f} | {p50:.2f} | {p99:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
