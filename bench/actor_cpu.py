"""W1's shape in one process, with no gRPC: CPU seconds per item of the manager and the
actor (and the items/s), so that a change to the cycle's path can be compared against
another commit's sources even on a loaded machine, where wall-clock figures swing 2x.

    .venv/bin/python bench/actor_cpu.py                      # the work tree's server
    .venv/bin/python bench/actor_cpu.py --at-commit dbb195b  # another commit's sources

Produce: 100,000 items of 256 bytes in 100-item compact batches, 8 calls in flight; then
drain: Lease(100) + Complete, 8 loops. One queue of one partition, durable commits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time


async def run(items: int) -> str:
    from querator_server.actor import CompleteRequest, LeaseRequest, ProduceRequest
    from querator_server.manager import QueuesManager
    from querator_server.model import QueueConfig

    with tempfile.TemporaryDirectory() as data_dir:
        manager = QueuesManager(data_dir, workers=2)
        await manager.start()
        await manager.create(QueueConfig(name="q", partitions=1))
        actor = manager.actor("q")
        payload = os.urandom(256)
        cpu0, wall0 = time.process_time(), time.monotonic()

        async def produce(calls: int) -> None:
            for _ in range(calls):
                await actor.submit(ProduceRequest(items=[], payloads=[payload] * 100))

        await asyncio.gather(*(produce(items // 800) for _ in range(8)))
        cpu1, wall1 = time.process_time(), time.monotonic()

        async def drain() -> None:
            while True:
                lease = await actor.submit(LeaseRequest(batch_size=100, client_id="", wait_until_us=0))
                if not lease.ids:
                    return
                await actor.submit(CompleteRequest(partition=lease.partition, ids=lease.ids))

        await asyncio.gather(*(drain() for _ in range(8)))
        cpu2, wall2 = time.process_time(), time.monotonic()
        await manager.stop()
    return (
        f"produce {(cpu1 - cpu0) / items * 1e6:.2f} µs CPU/item {items / (wall1 - wall0):,.0f} items/s; "
        f"drain {(cpu2 - cpu1) / items * 1e6:.2f} µs CPU/item {items / (wall2 - wall1):,.0f} items/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at-commit", metavar="REV", help="run this commit's server sources (git archive)")
    parser.add_argument("--items", type=int, default=100_000)
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tree:
        src = os.path.join(root, "server", "src")
        if args.at_commit:
            archive = subprocess.run(["git", "-C", root, "archive", args.at_commit, "server/src"], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
            src = os.path.join(tree, "server", "src")
        sys.path.insert(0, src)
        print(asyncio.run(run(args.items)))


if __name__ == "__main__":
    main()
