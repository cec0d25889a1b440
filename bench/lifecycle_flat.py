"""Lifecycle work per cycle versus stored, not-yet-due items (10 k -> 1 M).

Fills one partition with N ready items and N scheduled items that are far from due,
adds a fixed handful of due work (scheduled items due now, expired items, expired
leases), then times the actor's lifecycle step on real LMDB. The lifecycle reads
only what is due (index seeks), so the time per cycle must stay flat as N grows.

    .venv/bin/python bench/lifecycle_flat.py [--sizes 10000,100000,1000000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from querator_server.actor.cycle import Cycle
from querator_server.actor.requests import LeaseRequest, ProduceRequest
from querator_server.actor.view import PartitionView
from querator_server.model import NewItem, QueueConfig
from querator_server.storage import QueueStore

# The test suite's way of driving a Cycle on a real store, shared rather than copied.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server", "tests"))
from cycle_helpers import SECOND, request, run_cycle  # noqa: E402

HOUR = 3600 * SECOND
DUE_WORK = 100  # items of each kind that fall due per measured cycle


def measure(n: int, rounds: int) -> tuple[float, float]:
    path = tempfile.mkdtemp(prefix="querator-bench-")
    store = QueueStore(path, 1, map_size=1 << 33, sync=False)
    long_config = QueueConfig(name="bench", uid=1, lease_timeout_us=HOUR, expire_timeout_us=100 * HOUR)
    views = [PartitionView()]
    t0 = 1_800_000_000 * SECOND
    payload = b"x" * 64
    chunk = 10_000
    for start in range(0, n, chunk):  # N ready items, N scheduled far in the future
        count = min(chunk, n - start)
        ready = request(ProduceRequest([NewItem(payload=payload) for _ in range(count)]))
        later = request(ProduceRequest([NewItem(payload=payload, enqueue_at_us=t0 + 50 * HOUR) for _ in range(count)]))
        run_cycle(store, long_config, views, t0, lambda c, t, a=ready, b=later: (c.produce(t, a), c.produce(t, b)))
    timings: list[float] = []
    lifecycle_only: list[float] = []
    now = t0
    short = long_config.replace(lease_timeout_us=SECOND, expire_timeout_us=2 * SECOND)
    for _ in range(rounds):
        # Fresh due work: scheduled items due in 1 s, items that expire in 2 s, leases of 1 s.
        due = request(ProduceRequest([NewItem(payload=payload, enqueue_at_us=now + SECOND) for _ in range(DUE_WORK)]))
        dying = request(ProduceRequest([NewItem(payload=payload) for _ in range(DUE_WORK)]))
        run_cycle(store, short, views, now, lambda c, t, a=due, b=dying: (c.produce(t, a), c.produce(t, b)))
        lease = request(LeaseRequest(DUE_WORK, "", now))
        cycle = run_cycle(store, short, views, now, lambda c, t, r=lease: c.lease(t, [r]))
        expired = sorted(cycle.lease_deadlines)
        now += 3 * SECOND
        start = time.perf_counter()
        inner: list[float] = []

        def step(
            c: Cycle, t: object, e: list[tuple[int, int, int]] = expired, inner: list[float] = inner
        ) -> None:
            a = time.perf_counter()
            c.lifecycle(t, e)  # type: ignore[arg-type]
            inner.append(time.perf_counter() - a)

        run_cycle(store, short, views, now, step)
        timings.append(time.perf_counter() - start)
        lifecycle_only.append(inner[0])
    store.close()
    shutil.rmtree(path, ignore_errors=True)
    timings.sort()
    lifecycle_only.sort()
    return lifecycle_only[len(lifecycle_only) // 2], timings[len(timings) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"{'stored (ready + scheduled)':>28} {'lifecycle ms':>13} {'cycle ms':>9}   due per cycle: "
          f"{DUE_WORK} promotions, {DUE_WORK} expiries, {DUE_WORK} lease expiries")
    base = None
    for n in (int(x) for x in args.sizes.split(",")):
        lifecycle, cycle = measure(n, args.rounds)
        base = base or lifecycle
        print(f"{2 * n:>28,} {lifecycle * 1000:>13.2f} {cycle * 1000:>9.2f}   x{lifecycle / base:.2f} of the smallest")


if __name__ == "__main__":
    main()
