"""The cycle's ordering rules, driven directly on real LMDB with a chosen clock.

Timing through the network cannot place a Complete between a lease deadline and
the lifecycle's re-queue; here one transaction holds both, as a busy actor's would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from querator_server.actor.cycle import Cycle
from querator_server.actor.ids import item_id, parse_id
from querator_server.actor.requests import CompleteRequest, ExtendRequest, LeaseRequest, ProduceRequest
from querator_server.actor.view import PartitionView
from querator_server.errors import FailedPrecondition
from querator_server.model import NewItem, QueueConfig
from querator_server.storage import QueueStore

SECOND = 1_000_000
T0 = 1_800_000_000 * SECOND


@pytest.fixture
def store(tmp_path: object) -> Iterator[QueueStore]:
    s = QueueStore(str(tmp_path / "q"), 1, map_size=1 << 22, sync=False)  # type: ignore[operator]
    yield s
    s.close()


def _request(request: object) -> object:
    request.future = asyncio.Future(loop=asyncio.new_event_loop())  # type: ignore[attr-defined]
    return request


def _run(store: QueueStore, config: QueueConfig, views: list[PartitionView], now: int, steps: object) -> Cycle:
    def body(txn: object) -> Cycle:
        cycle = Cycle(store, config, views, now)
        steps(cycle, txn)  # type: ignore[operator]
        cycle.finish(txn)  # type: ignore[arg-type]
        return cycle

    cycle = store.write(body)  # type: ignore[arg-type]
    for p, view in cycle.views.items():
        views[p] = view
    return cycle


def _seq(text: str) -> int:
    ref = parse_id(text)
    assert ref is not None
    return ref.seq


def _leased_one(store: QueueStore, config: QueueConfig, views: list[PartitionView]) -> str:
    produce = _request(ProduceRequest([NewItem(payload=b"x")]))
    _run(store, config, views, T0, lambda c, t: c.produce(t, produce))
    lease = _request(LeaseRequest(1, "", T0))
    cycle = _run(store, config, views, T0, lambda c, t: c.lease(t, [lease]))
    (_, result) = cycle.results[0]
    return str(result.items[0].item_id)  # type: ignore[attr-defined]


def test_complete_after_the_deadline_but_before_the_requeue_succeeds(store: QueueStore) -> None:
    config = QueueConfig(name="q", uid=1, lease_timeout_us=SECOND)
    views = [PartitionView()]
    leased = _leased_one(store, config, views)
    late = T0 + 2 * SECOND
    complete = _request(CompleteRequest(0, [leased]))
    deadline = T0 + SECOND

    def steps(cycle: Cycle, txn: object) -> None:
        cycle.complete(txn, complete)  # type: ignore[arg-type]
        cycle.lifecycle(txn, [(deadline, 0, _seq(leased))])  # type: ignore[arg-type]

    cycle = _run(store, config, views, late, steps)
    assert cycle.results == [(complete, None)]
    assert (views[0].ready, views[0].leased) == (0, 0)


def test_extend_after_the_deadline_fails_even_before_the_requeue(store: QueueStore) -> None:
    config = QueueConfig(name="q", uid=1, lease_timeout_us=SECOND)
    views = [PartitionView()]
    leased = _leased_one(store, config, views)
    extend = _request(ExtendRequest(0, [leased], 0))

    with pytest.raises(FailedPrecondition, match="expired"):
        _run(store, config, views, T0 + 2 * SECOND, lambda c, t: c.extend(t, extend))


def test_requeue_after_the_deadline_gives_a_new_id_at_the_tail(store: QueueStore) -> None:
    config = QueueConfig(name="q", uid=1, lease_timeout_us=SECOND)
    views = [PartitionView()]
    leased = _leased_one(store, config, views)
    _run(store, config, views, T0 + 2 * SECOND, lambda c, t: c.lifecycle(t, [(T0 + SECOND, 0, _seq(leased))]))
    assert (views[0].ready, views[0].leased) == (1, 0)
    assert leased == item_id(1, 0, 1)
    again = _request(LeaseRequest(1, "", T0))
    cycle = _run(store, config, views, T0 + 3 * SECOND, lambda c, t: c.lease(t, [again]))
    (_, result) = cycle.results[0]
    item = result.items[0]  # type: ignore[attr-defined]
    assert item.item_id == item_id(1, 0, 2)
    assert item.item.attempts == 2
