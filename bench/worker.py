"""The SDK's Worker draining a queue: items/s and the worker process's CPU per item.

A durable server in its own process (as ``run.py`` starts it); this process produces
the items with the ``AsyncClient``, then drains them with an ``AsyncWorker`` (an
``async def`` handler) or a ``Worker`` (a plain function, run in its thread pool) whose
handler does nothing, so the figures are the worker's own cost and the server's.

    .venv/bin/python bench/worker.py [--items 100000] [--concurrency 100] [--batch 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import querator  # noqa: E402
from common import process_cpu_s  # noqa: E402
from querator_target import QueratorService  # noqa: E402


async def produce(address: str, queue: str, items: int) -> None:
    async with querator.AsyncClient(address) as client:
        await client.create_queue(queue, lease_timeout=300)
        payload = os.urandom(256)
        await client.produce(queue, [payload] * items)


async def drain_async(address: str, queue: str, items: int, args: argparse.Namespace) -> tuple[float, float]:
    async def handle(item: querator.AsyncLeasedItem) -> None:
        return None

    async with querator.AsyncClient(address) as client:
        worker = querator.AsyncWorker(
            client, queue, handle, concurrency=args.concurrency, batch_size=args.batch, handle_signals=False
        )
        start, cpu = time.perf_counter(), time.process_time()
        run = asyncio.create_task(worker.run())
        while worker.stats.completed < items and not run.done():
            await asyncio.sleep(0.01)
        elapsed, used = time.perf_counter() - start, time.process_time() - cpu
        worker.stop()
        await run
        return elapsed, used


def drain_sync(address: str, queue: str, items: int, args: argparse.Namespace) -> tuple[float, float]:
    def handle(item: querator.LeasedItem) -> None:
        return None

    with querator.Client(address) as client:
        worker = querator.Worker(
            client, queue, handle, concurrency=args.concurrency, batch_size=args.batch, handle_signals=False
        )
        start, cpu = time.perf_counter(), time.process_time()
        worker.start()
        deadline = start + args.time_limit
        while worker.stats.completed < items and time.perf_counter() < deadline:
            time.sleep(0.01)
        elapsed, used = time.perf_counter() - start, time.process_time() - cpu
        worker.stop()
        return elapsed, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per drain before giving up")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="querator-bench-") as workdir:
        service = QueratorService(workdir)
        address = service.start().address
        try:
            print(f"{args.items:,} items of 256 B, concurrency {args.concurrency}, batch {args.batch}, no-op handler")
            print(f"{'worker':>12} {'items/s':>9} {'worker CPU µs/item':>19} {'server CPU µs/item':>19}")
            for round_ in range(args.rounds):
                for kind in ("AsyncWorker", "Worker"):
                    queue = f"{kind.lower()}-{round_}"
                    asyncio.run(produce(address, queue, args.items))
                    server_cpu = process_cpu_s(service.pid)
                    if kind == "AsyncWorker":
                        elapsed, used = asyncio.run(drain_async(address, queue, args.items, args))
                    else:
                        elapsed, used = drain_sync(address, queue, args.items, args)
                    server_used = process_cpu_s(service.pid) - server_cpu
                    per = 1e6 / args.items
                    print(f"{kind:>12} {args.items / elapsed:>9,.0f} {used * per:>19.1f} {server_used * per:>19.1f}")
        finally:
            service.stop()


if __name__ == "__main__":
    main()
