"""W1's and W4's drain in one process, with no gRPC: CPU µs per drained item of the
manager and the actors, so that the cost of a queue's request when several queues share
the event loop and the commit group can be compared with one queue's, and one commit's
sources with another's (``--at-commit``), on a loaded machine where wall-clock figures
swing 2x.

    .venv/bin/python bench/drain_cpu.py                          # W1 (1 queue, 8 loops), then W4 (10 queues, 1 loop each)
    .venv/bin/python bench/drain_cpu.py --at-commit main         # another commit's sources
    .venv/bin/python bench/drain_cpu.py --profile 25             # cProfile of each drain: the top functions by own time

Each loop leases 100 and completes them with its next Lease (``complete_ids``), as
``bench/run.py --complete-in-lease`` does. Items: 100,000 of 256 bytes over all queues,
produced first (not measured). Durable commits, one manager, commit groups as the
server has them (the default).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import subprocess
import sys
import tempfile
import time


async def drain(queues: int, loops: int, items: int, profile: int, dump: str = "", batch: int = 100) -> str:
    from querator_server.actor import LeaseRequest, ProduceRequest
    from querator_server.manager import QueuesManager
    from querator_server.model import QueueConfig

    with tempfile.TemporaryDirectory() as data_dir:
        manager = QueuesManager(os.path.join(data_dir, "n1"))
        await manager.start()
        names = [f"q{i}" for i in range(queues)]
        for name in names:
            await manager.create(QueueConfig(name=name, partitions=1))
        payload = os.urandom(256)
        per_queue = items // queues
        for name in names:
            actor = manager.actor(name)
            for _ in range(per_queue // 100):
                await actor.submit(ProduceRequest(items=[], payloads=[payload] * 100))

        async def loop(name: str, client: str) -> None:
            actor = manager.actor(name)
            previous: tuple[int, list[str]] = (0, [])
            while True:
                lease = await actor.submit(
                    LeaseRequest(
                        batch_size=batch,
                        client_id=client,
                        wait_until_us=0,
                        complete_ids=previous[1],
                        complete_partition=previous[0],
                    )
                )
                if not lease.ids:
                    return
                previous = (lease.partition, list(lease.ids))

        try:  # the collector settings of a served process (querator serve)
            from querator_server.server import tune_gc
        except ImportError:
            pass
        else:
            tune_gc()
        profiler = cProfile.Profile(time.thread_time) if profile else None  # CPU, not wall time
        groups = list(getattr(manager._groups, "_open", {}).values())
        commits0 = sum(g.commits for g in groups)
        cpu0, wall0, loop0 = time.process_time(), time.monotonic(), time.thread_time()
        if profiler is not None:
            profiler.enable()
        await asyncio.gather(*(loop(name, f"c{name}-{i}") for name in names for i in range(loops)))
        if profiler is not None:
            profiler.disable()
        cpu1, wall1, loop1 = time.process_time(), time.monotonic(), time.thread_time()
        commits = sum(g.commits for g in groups) - commits0
        await manager.stop()
    drained = per_queue * queues
    out = (
        f"{queues} queue(s) x {loops} loop(s), leases of {batch}: {(cpu1 - cpu0) / drained * 1e6:.2f} µs CPU/item, "
        f"of it the loop's thread {(loop1 - loop0) / drained * 1e6:.2f}; "
        f"{drained / (wall1 - wall0):,.0f} items/s; {commits} commits"
    )
    if profiler is not None and dump:
        profiler.dump_stats(dump)
    if profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(profile)
        out += "\n" + text.getvalue()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at-commit", metavar="REV", help="run this commit's server sources (git archive)")
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--shape", default="w1,w4", help="w1 (1 queue, 8 loops), w4 (10 queues, 1 loop each), or both")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's top N functions by own time")
    parser.add_argument("--rounds", type=int, default=1, help="run each shape this many times, in turn")
    parser.add_argument("--batch", type=int, default=100, help="items per Lease (default 100; fewer shows the cost per request)")
    parser.add_argument("--dump", metavar="PATH", help="with --profile: write each drain's stats to PATH.w1 / PATH.w4")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shapes = {"w1": (1, 8), "w4": (10, 1)}
    with tempfile.TemporaryDirectory() as tree:
        src = os.path.join(root, "server", "src")
        if args.at_commit:
            archive = subprocess.run(
                ["git", "-C", root, "archive", args.at_commit, "server/src"], check=True, capture_output=True
            )
            subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
            src = os.path.join(tree, "server", "src")
        sys.path.insert(0, src)
        for _ in range(args.rounds):
            for shape in args.shape.split(","):
                queues, loops = shapes[shape]
                dump = f"{args.dump}.{shape}" if args.dump else ""
                print(f"{shape}: " + asyncio.run(drain(queues, loops, args.items, args.profile, dump, args.batch)), flush=True)


if __name__ == "__main__":
    main()
