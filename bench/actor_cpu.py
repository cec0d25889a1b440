"""W1's shape in one process, with no gRPC: CPU seconds per item of the manager and the
actor (and the items/s), so that a change to the cycle's path can be compared against
another commit's sources even on a loaded machine, where wall-clock figures swing 2x.

    .venv/bin/python bench/actor_cpu.py                      # the work tree's server
    .venv/bin/python bench/actor_cpu.py --at-commit dbb195b  # another commit's sources
    .venv/bin/python bench/actor_cpu.py --replicated         # a replicated queue: 2 copies

With ``--replicated`` the queue is a replicated one (issue 28) with two copies on two
managers in this one process: every cycle's change set is encoded, decoded and applied
durably to the other copy before the cycle's calls are answered; the CPU is both
nodes', with no network between them.

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


async def run(items: int, replicated: bool) -> str:
    from querator_server.actor import CompleteRequest, LeaseRequest, ProduceRequest
    from querator_server.manager import QueuesManager
    from querator_server.model import QueueConfig

    with tempfile.TemporaryDirectory() as data_dir:
        manager = QueuesManager(os.path.join(data_dir, "n1"), workers=2)
        await manager.start()
        other = None
        if replicated:
            from querator_server.storage.change_set import ChangeSet

            config = QueueConfig(name="q", partitions=1, uid=(1 << 40) + 1)
            other = QueuesManager(os.path.join(data_dir, "n2"), workers=2)
            await other.start()
            await manager.open_copy(config)
            target = await other.open_copy(config)
            order = asyncio.Lock()

            class Ship:
                async def replicated(self, change: ChangeSet) -> None:
                    data = change.encode()
                    async with order:
                        await target.apply(ChangeSet.decode(data))

            await manager.promote("q", 1, Ship())
        else:
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
        if other is not None:
            await other.stop()
    return (
        f"produce {(cpu1 - cpu0) / items * 1e6:.2f} µs CPU/item {items / (wall1 - wall0):,.0f} items/s; "
        f"drain {(cpu2 - cpu1) / items * 1e6:.2f} µs CPU/item {items / (wall2 - wall1):,.0f} items/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at-commit", metavar="REV", help="run this commit's server sources (git archive)")
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--replicated", action="store_true", help="a replicated queue, its other copy in this process")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tree:
        src = os.path.join(root, "server", "src")
        if args.at_commit:
            archive = subprocess.run(["git", "-C", root, "archive", args.at_commit, "server/src"], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
            src = os.path.join(tree, "server", "src")
        sys.path.insert(0, src)
        print(asyncio.run(run(args.items, args.replicated)))


if __name__ == "__main__":
    main()
