"""Commit groups across queues: a storage-level prototype, not the server.

Q queues each keep one 100-item produce in flight (W4's shape). Each queue writes
its items into a database of its own inside one of G LMDB environments (durable:
``sync``, ``metasync``), and every environment commits on one storage lane
(``querator_server.storage.lane``), as the server does:

- G = Q is what the server does with ``--no-commit-groups`` (and did before commit
  groups): an environment per queue, a commit per request, the lanes committing side
  by side.
- G < Q shares an environment between queues, as the server's commit groups now do
  (``querator_server.storage.commit_group``): a queue's write runs in a nested
  transaction of the environment's held one (so that a failing queue would abort
  only its own part), and one commit makes every queue that wrote since the last
  one durable.

The commit of an environment is handed to its lane once the event loop has run what
was ready when the first queue joined, so that the queues woken by the last commit
join the next one. No gRPC, no actor cycle: what is measured is what the commit
costs per request, on the loop (hand-over, results) and in the process (lanes,
kernel).

    .venv/bin/python bench/commit_groups.py [--items 600000] [--rounds 2]
        [--configs 10:10:8,10:2:2,10:1:1,1:1:1]     # queues:environments:lanes
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import lmdb

from querator_server.storage.lane import StorageLane

BATCH = 100
PAYLOAD = 256


class Environment:
    """One LMDB environment, its held write transaction and its group of waiting writers."""

    def __init__(self, path: str, lane: StorageLane) -> None:
        self.env = lmdb.open(path, map_size=1 << 34, max_dbs=64, sync=True, metasync=True)
        self.lane = lane
        self.held: Any = None
        self.committing = False
        self.ready: asyncio.Future[None] | None = None  # the next held transaction is there
        self.joined: list[asyncio.Future[None]] = []  # writers waiting on the next commit
        self.handing_in = False
        self.commits = 0
        self.writes = 0

    def _hold(self) -> None:
        self.held = self.env.begin(write=True)

    def _release(self) -> None:
        # On the lane: LMDB ties the write lock to the thread that took it.
        if self.held is not None:
            self.held.abort()
            self.held = None
        self.env.close()

    def _commit(self) -> None:
        txn, self.held = self.held, None
        txn.commit()
        self.held = self.env.begin(write=True)

    async def write(self, fn: Callable[[Any], None]) -> None:
        """Run ``fn`` in a nested transaction and return once a commit made it durable."""
        loop = asyncio.get_running_loop()
        while self.held is None or self.committing:
            if self.ready is None or self.ready.done():
                self.ready = loop.create_future()
                if self.held is None and not self.committing:
                    self.committing = True
                    await self.lane.run(self._hold)
                    self.committing = False
                    self.ready.set_result(None)
                    continue
            await self.ready
        child = self.env.begin(write=True, parent=self.held)
        try:
            fn(child)
        except BaseException:
            child.abort()
            raise
        child.commit()
        durable = loop.create_future()
        self.joined.append(durable)
        self.writes += 1
        if not self.handing_in:
            self.handing_in = True
            # Two hops: the writers woken by the last commit are queued behind one.
            loop.call_soon(loop.call_soon, self._hand_in)
        await durable

    def _hand_in(self) -> None:
        self.handing_in = False
        joined, self.joined = self.joined, []
        self.committing = True
        self.commits += 1
        self.ready = asyncio.get_running_loop().create_future()
        ready = self.ready

        def done(committed: asyncio.Future[None]) -> None:
            self.committing = False
            error = committed.exception()
            for waiter in joined:
                if error is not None:
                    waiter.set_exception(error)
                else:
                    waiter.set_result(None)
            if not ready.done():
                ready.set_result(None)

        self.lane.run(self._commit).add_done_callback(done)


async def measure(queues: int, environments: int, lanes: int, items: int, workdir: str) -> dict[str, float]:
    base = tempfile.mkdtemp(prefix="groups-", dir=workdir)
    threads = [StorageLane(f"bench-lane-{i}") for i in range(lanes)]
    try:
        envs = []
        for g in range(environments):
            path = os.path.join(base, str(g))
            os.makedirs(path)
            envs.append(Environment(path, threads[g % lanes]))
        dbs = []
        for q in range(queues):
            env = envs[q % environments].env
            with env.begin(write=True) as txn:
                dbs.append(env.open_db(b"q%d" % q, txn=txn))
        payload = os.urandom(PAYLOAD)
        requests = items // BATCH
        sent = 0

        async def producer(q: int) -> None:
            nonlocal sent
            env, db, seq = envs[q % environments], dbs[q], 0
            while sent < requests:
                sent += 1
                batch = [((seq + j).to_bytes(8, "big"), payload) for j in range(BATCH)]
                seq += BATCH
                await env.write(lambda txn, db=db, batch=batch: txn.cursor(db=db).putmulti(batch, append=True))

        wall0, loop0, process0 = time.perf_counter(), time.thread_time(), time.process_time()
        await asyncio.wait_for(asyncio.gather(*(producer(q) for q in range(queues))), timeout=300)
        wall = time.perf_counter() - wall0
        loop_cpu, process_cpu = time.thread_time() - loop0, time.process_time() - process0
        commits = sum(e.commits for e in envs)
        for e in envs:
            await e.lane.run(e._release)
        return {
            "items/s": requests * BATCH / wall,
            "per commit": requests / commits,
            "loop µs/request": loop_cpu * 1e6 / requests,
            "process µs/request": process_cpu * 1e6 / requests,
        }
    finally:
        for t in threads:
            t.shutdown()
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=600_000, help="items per measurement (default 600,000)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all configurations (default 2)")
    parser.add_argument("--configs", default="10:10:8,10:2:2,10:1:1,1:1:1", help="queues:environments:lanes, comma-separated")
    parser.add_argument("--workdir", default=None, help="where the environments go (default: a temp dir)")
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    workdir = args.workdir or tempfile.gettempdir()
    rows: dict[tuple[int, ...], list[dict[str, float]]] = {c: [] for c in configs}
    for _ in range(args.rounds):
        for c in configs:
            rows[c].append(asyncio.run(measure(*c, args.items, workdir)))
    print("| queues | environments | lanes | items/s | requests per commit | loop µs/request | process µs/request |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c, runs in rows.items():
        cells = [" / ".join(f"{r[k]:,.0f}" if r[k] >= 10 else f"{r[k]:.1f}" for r in runs) for k in runs[0]]
        print(f"| {c[0]} | {c[1]} | {c[2]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
