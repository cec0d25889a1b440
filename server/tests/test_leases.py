"""The actor's lease timer: live leases only, stale heap entries dropped and bounded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from querator_server.actor.leases import STALE_SLACK, LeaseDeadlines
from querator_server.actor.logical_queue import LogicalQueue
from querator_server.actor.requests import (
    ClearRequest,
    CompleteRequest,
    DeleteItemsRequest,
    ExtendRequest,
    LeaseRequest,
    ProduceRequest,
    RetryRequest,
)
from querator_server.model import NewItem, QueueConfig, RetryOrder
from querator_server.storage import QueueStore
from querator_server.storage.lane import StorageLane


def test_only_live_leases_fall_due_with_their_latest_deadline() -> None:
    leases = LeaseDeadlines([(100, 0, 1), (200, 0, 2)])
    leases.add(150, 0, 3)
    leases.end(0, 1)  # completed: its entry is stale now
    leases.add(300, 0, 2)  # extended: the entry at 200 is stale
    assert leases.first() == 150
    assert leases.pop_due(1_000, limit=10) == [(150, 0, 3), (300, 0, 2)]
    assert len(leases) == 0 and leases.first() == 0


def test_pop_due_respects_the_limit_and_restore_puts_leases_back() -> None:
    leases = LeaseDeadlines((10 + i, 1, i) for i in range(5))
    due = leases.pop_due(100, limit=2)
    assert due == [(10, 1, 0), (11, 1, 1)]
    assert len(leases) == 3
    leases.restore(due)
    assert leases.pop_due(100, limit=10) == [(10 + i, 1, i) for i in range(5)]


def test_a_run_falls_due_item_by_item_within_the_limit_and_ends_by_runs() -> None:
    leases = LeaseDeadlines()
    leases.add_runs([(100, 0, range(1, 11)), (100, 1, [5, 7]), (300, 0, range(20, 23))])
    leases.end_runs([(0, range(3, 6)), (2, range(1, 3))])  # completed; a partition with none
    leases.add(400, 0, 8)  # extended: its run's entry is stale for it
    assert len(leases) == 12 and leases.first() == 100
    assert leases.pop_due(200, limit=4) == [(100, 0, 1), (100, 0, 2), (100, 0, 6), (100, 0, 7)]
    assert leases.pop_due(200, limit=10) == [(100, 0, 9), (100, 0, 10), (100, 1, 5), (100, 1, 7)]
    leases.end_runs([(0, range(20, 23))])
    assert leases.first() == 400 and len(leases) == 1
    assert leases.pop_due(1_000, limit=10) == [(400, 0, 8)]
    assert leases.first() == 0 and leases.heap_size == 0


def test_leases_of_one_deadline_fall_due_in_seq_order_whatever_runs_hold_them() -> None:
    leases = LeaseDeadlines()
    leases.add_all([(100, 0, 9), (100, 0, 2)])  # extended in this order: due as 2, 9
    leases.add_runs([(100, 0, [8, 3, 12]), (100, 0, range(4, 7)), (100, 1, [1])])  # a priority lease's order
    assert leases.pop_due(200, limit=5) == [(100, 0, seq) for seq in (2, 3, 4, 5, 6)]
    assert leases.pop_due(200, limit=10) == [(100, 0, 8), (100, 0, 9), (100, 0, 12), (100, 1, 1)]


def test_runs_of_completed_leases_do_not_pile_up_in_the_heap() -> None:
    leases = LeaseDeadlines()
    for lease in range(STALE_SLACK // 10):
        leases.add_runs([(1_000_000 + lease, 0, range(lease * 100, lease * 100 + 100))])
        if lease >= 8:
            leases.end_runs([(0, range((lease - 8) * 100, (lease - 7) * 100))])
    assert len(leases) == 800
    assert leases.heap_size <= 2 * len(leases) + STALE_SLACK + 100
    assert leases.first() == 1_000_000 + STALE_SLACK // 10 - 8


def test_completed_leases_do_not_pile_up_in_the_heap() -> None:
    leases = LeaseDeadlines()
    for seq in range(5 * STALE_SLACK):
        leases.add(1_000_000 + seq, 0, seq)
        if seq >= 100:
            leases.end(0, seq - 100)  # completed a little after it was leased
    assert len(leases) == 100
    assert leases.heap_size <= 2 * len(leases) + STALE_SLACK + 1
    assert leases.first() == 1_000_000 + 5 * STALE_SLACK - 100


def test_every_way_a_lease_ends_early_leaves_the_actor_timer(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = QueueStore(str(tmp_path / "q"), 1, sync=False)
        lane = StorageLane("test-lane")
        actor = LogicalQueue(QueueConfig(name="q"), store, lane)
        await actor.start()

        async def call(request: Any) -> Any:
            # Callers are answered as the commit is durable; the actor takes the
            # cycle's state in the same turn of the loop, right after them.
            result = await actor.submit(request)
            await asyncio.sleep(0)
            return result

        try:
            await call(ProduceRequest([NewItem(str(i).encode()) for i in range(40)]))
            leased = await call(LeaseRequest(40, "", 0))
            ids = list(leased.ids)
            assert len(actor._leases) == 40
            await call(CompleteRequest(0, ids[:10]))
            assert len(actor._leases) == 30
            await call(RetryRequest(0, [RetryOrder(i) for i in ids[10:20]]))
            assert len(actor._leases) == 20
            await call(DeleteItemsRequest(0, ids[20:25]))
            assert len(actor._leases) == 15
            await call(ExtendRequest(0, ids[25:30], 120_000_000))
            assert len(actor._leases) == 15  # still leased, with a later deadline
            await call(ClearRequest(ready=True, scheduled=True, destructive=True))
            assert len(actor._leases) == 0
        finally:
            await actor.stop()
            lane.shutdown(wait=True)

    asyncio.run(scenario())
