"""What isolating one failing request costs a cycle (bench/RESULTS.md, "Isolating a failing request").

Times, on real LMDB in a commit group's environment (1,016 databases, where a nested
transaction costs the most), a cycle of many Produce requests of 100 bare payloads:

- ``first run``: as every cycle runs (each step guarded by a ``try``, no nested
  transaction);
- ``isolated``: each step in a nested transaction of its own with the cycle's state
  saved before it, as a cycle runs again after a step failed half-way;

so the second line is what a nested transaction per request would cost every cycle.
Bounded: a few hundred cycles, a few seconds.

    .venv/bin/python bench/isolation.py [--requests 500] [--rounds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from functools import partial

from querator_server.actor.cycle import Cycle
from querator_server.actor.requests import ProduceRequest
from querator_server.actor.view import PartitionView
from querator_server.model import NewItem, QueueConfig
from querator_server.storage import QueueStore
from querator_server.storage.group_layout import open_group_env, queue_prefix

T0 = 1_800_000_000 * 1_000_000


def _cycle(store: QueueStore, config: QueueConfig, views: list[PartitionView], requests: list[ProduceRequest], isolated: bool) -> float:
    started = time.perf_counter()

    def body(txn: object) -> Cycle:
        cycle = Cycle(store, config, views, T0, isolated=isolated)
        for request in requests:
            cycle.apply(txn, request, partial(cycle.produce, request=request))  # type: ignore[arg-type]
        cycle.finish(txn)  # type: ignore[arg-type]
        return cycle

    with store.env.begin(write=True) as txn:
        cycle = body(txn)
    took = time.perf_counter() - started
    for p, view in cycle.views.items():
        views[p] = view
    return took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--items", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    loop = asyncio.new_event_loop()
    payload = b"x" * 256
    with tempfile.TemporaryDirectory() as root:
        env = open_group_env(root, map_size=1 << 32, sync=False)
        # Fill the group's database table as a full group does (28 queues of 36 databases).
        stores = [QueueStore(root, 32, shared=env, prefix=queue_prefix(uid)) for uid in range(1, 29)]
        store = stores[0]
        config = QueueConfig(name="q", uid=1)
        views = [PartitionView() for _ in range(store.partitions)]
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for isolated in (False, True):
                requests = []
                for _ in range(args.requests):
                    request = ProduceRequest([NewItem(payload=payload) for _ in range(args.items)])
                    request.future = loop.create_future()
                    requests.append(request)
                times[isolated].append(_cycle(store, config, views, requests, isolated))
        env.close()
    first, isolated = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.requests} requests x {args.items} items, median of {args.rounds}:")
    print(f"  first run: {first * 1e3:.2f} ms")
    print(f"  isolated:  {isolated * 1e3:.2f} ms (+{(isolated / first - 1) * 100:.0f}%, "
          f"{(isolated - first) / args.requests * 1e6:.1f} µs per request)")


if __name__ == "__main__":
    main()
