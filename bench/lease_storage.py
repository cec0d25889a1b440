"""What a drained item costs in storage: rewriting every leased record against one
lease record per lease (storage/lease_records.py).

A rewriting lease (a keyed one, and every lease before catalog format 7) rewrites each
record it hands out (flag, attempts, deadline, lease time) through its cursor, and the
completion reads each record again to check it is leased before deleting it. A lease
of plain items now leaves their records as they are and writes one record naming its
items, deadline and time; the exact completion deletes the items and that record
unread. (Every other path writes the lease out into its items first; see RESULTS.md.)

Both run on the same LMDB environment, a partition of 256-byte plain items, 100
items a lease, each step in a transaction of its own (committed without fsync, as
the fsync is the same for both). "Today" is the server's own code: a Cycle that
completes the previous batch and leases the next, as a LeaseStream request with
``complete_ids`` does (by lease record where the server has them: run this file at
an older commit for the cycle before), and the storage calls alone of both ways:
``QueueStore.lease_run`` rewriting and ``complete_run``, or ``lease_run`` leaving the
records with ``lease_records.put``, and ``lease_records.complete``.

    .venv/bin/python bench/lease_storage.py [--batches 2000] [--rounds 3] [--cpu]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from querator_server.actor.requests import LeaseRequest, ProduceRequest
from querator_server.actor.view import PartitionView
from querator_server.model import ITEM_REPLY_OVERHEAD, REPLY_ITEMS_BYTES, QueueConfig
from querator_server.storage import QueueStore, lease_records
from querator_server.storage.record import TAG_ITEM, plain_leaser, seq_of_item_key

# The test suite's way of driving a Cycle on a real store, shared rather than copied.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server", "tests"))
from cycle_helpers import SECOND, T0, request, run_cycle  # noqa: E402

BATCH = 100
# Wall time, or with --cpu this thread's CPU time (a machine busy with other work
# stretches the wall time of both sides by whatever it runs meanwhile).
_clock = time.perf_counter
HOUR = 3600 * SECOND


def fill(store: QueueStore, config: QueueConfig, views: list[PartitionView], items: int) -> None:
    payload = os.urandom(256)
    for _ in range(0, items, 10_000):
        produce = request(ProduceRequest([], payloads=[payload] * 10_000))
        run_cycle(store, config, views, T0, lambda c, t, r=produce: c.produce(t, r))


def cycles(store: QueueStore, config: QueueConfig, views: list[PartitionView], batches: int) -> float:
    """Seconds for ``batches`` cycles, each completing the last batch and leasing the next."""
    previous: list[str] = []
    start = _clock()
    for _ in range(batches):
        lease = request(LeaseRequest(BATCH, "", 0, complete_ids=previous))
        cycle = run_cycle(store, config, views, T0, lambda c, t, r=lease: c.lease(t, c.complete_before_lease(t, [r])))
        (_, result), *_ = cycle.results
        previous = result.ids  # type: ignore[attr-defined]
    return _clock() - start


def storage_calls(store: QueueStore, batches: int) -> tuple[float, float]:
    """Seconds in ``lease_run`` and in ``complete_run`` for ``batches`` leases."""
    leasing = completing = 0.0
    leaser = plain_leaser(now=T0, max_attempts=0, deadline=T0 + HOUR, key_bytes=b"")
    from_seq = _first_ready(store)
    for _ in range(batches):
        with store.env.begin(write=True) as txn:
            a = _clock()
            run = store.lease_run(
                txn, 0, from_seq, BATCH, leaser, REPLY_ITEMS_BYTES, ITEM_REPLY_OVERHEAD, take_first=True
            )
            leasing += _clock() - a
        with store.env.begin(write=True) as txn:
            a = _clock()
            assert store.complete_run(txn, 0, run.seqs[0], run.seqs[-1]) is not None
            completing += _clock() - a
        from_seq = run.last_seq + 1
    return leasing, completing


def by_records(store: QueueStore, batches: int) -> tuple[float, float]:
    """The same leases, with one lease record each and the items left unwritten."""
    leasing = completing = 0.0
    db = store.db(0)
    from_seq = _first_ready(store)
    held: dict[int, int] = {}  # as the actor passes its book (empty: nothing before the walk)
    for _ in range(batches):
        with store.env.begin(write=True) as txn:
            a = _clock()
            run = lease_records.lease_walk(
                txn,
                db,
                from_seq,
                BATCH,
                now=T0,
                max_attempts=0,
                max_bytes=REPLY_ITEMS_BYTES,
                item_overhead=ITEM_REPLY_OVERHEAD,
                take_first=True,
                skip=held,
            )
            record = lease_records.build(run.seqs, run.expires, sum(run.created_at), T0 + HOUR, T0)
            lease_records.put(txn, db, record)
            leasing += _clock() - a
        with store.env.begin(write=True) as txn:
            a = _clock()
            lease_records.complete(txn, db, record)
            completing += _clock() - a
        from_seq = run.last_seq + 1
    return leasing, completing


def _first_ready(store: QueueStore) -> int:
    with store.env.begin() as txn:
        cursor = txn.cursor(db=store.db(0))
        assert cursor.set_range(TAG_ITEM)
        return seq_of_item_key(cursor.key())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="this thread's CPU time instead of wall time")
    args = parser.parse_args()
    if args.cpu:
        global _clock
        _clock = time.thread_time
    items = args.batches * BATCH
    config = QueueConfig(name="bench", uid=1, lease_timeout_us=HOUR, expire_timeout_us=100 * HOUR)
    print(f"µs per drained item ({'CPU' if args.cpu else 'wall'}), {args.batches} leases of {BATCH} (each line one round)")
    print(f"{'cycle':>12} {'lease_run':>10} {'complete_run':>13} {'lease record':>13} {'its completion':>15}")
    for _ in range(args.rounds):
        figures = []
        for step in ("cycle", "calls", "records"):
            path = tempfile.mkdtemp(prefix="querator-bench-")
            store = QueueStore(path, 1, map_size=1 << 32, sync=False)
            views = [PartitionView()]
            fill(store, config, views, items + BATCH)
            if step == "cycle":
                figures.append(cycles(store, config, views, args.batches))
            elif step == "calls":
                figures.extend(storage_calls(store, args.batches))
            else:
                figures.extend(by_records(store, args.batches))
            store.close()
            shutil.rmtree(path, ignore_errors=True)
        us = [f * 1e6 / items for f in figures]
        print(f"{us[0]:>12.2f} {us[1]:>10.2f} {us[2]:>13.2f} {us[3]:>13.2f} {us[4]:>15.2f}")


if __name__ == "__main__":
    main()
