"""Giving back the items of a LeaseStream answer that was never delivered (the cycle
step behind a stalled or ended stream): only items still under that very lease change,
the attempt the lease took is given back, and items whose ids may have reached the
client get new ids, so those ids fence."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from querator_server.actor.cycle import Cycle
from querator_server.actor.requests import CompleteRequest, ExtendRequest, GiveBackRequest, LeaseRequest, ProduceRequest
from querator_server.actor.view import PartitionView
from querator_server.errors import NotFound
from querator_server.model import NewItem, QueueConfig
from querator_server.storage import QueueStore, lease_records

from cycle_helpers import SECOND, T0
from cycle_helpers import request as _request
from cycle_helpers import run_cycle as _run

CONFIG = QueueConfig(name="q", uid=1, lease_timeout_us=60 * SECOND)


@pytest.fixture
def store(tmp_path: object) -> Iterator[QueueStore]:
    s = QueueStore(str(tmp_path / "q"), 1, map_size=1 << 22, sync=False)  # type: ignore[operator]
    yield s
    s.close()


def _lease(store: QueueStore, views: list[PartitionView], count: int, now: int) -> tuple[list[str], int]:
    lease = _request(LeaseRequest(count, "", now))
    cycle = _run(store, CONFIG, views, now, lambda c, t: c.lease(t, [lease]))
    (_, result) = cycle.results[0]
    return list(result.ids), result.lease_deadlines[0]  # type: ignore[attr-defined]


def _give_back(store: QueueStore, views: list[PartitionView], ids: list[str], deadline: int, reached: bool) -> int:
    give = _request(GiveBackRequest(0, ids, deadline, reached))
    cycle = _run(store, CONFIG, views, T0 + 2 * SECOND, lambda c, t: Cycle.give_back(c, t, request=give))
    (_, given) = cycle.results[0]
    return int(given)  # type: ignore[call-overload]


def test_unsent_items_go_back_in_place_with_their_attempt_and_extended_ones_stay(store: QueueStore) -> None:
    views = [PartitionView()]
    produce = _request(ProduceRequest([NewItem(payload=bytes([n])) for n in range(4)]))
    _run(store, CONFIG, views, T0, lambda c, t: c.produce(t, produce))
    ids, deadline = _lease(store, views, 4, T0)
    # The client extended one of them: it holds that lease, which is no longer the one given.
    extend = _request(ExtendRequest(0, [ids[1]], 0))
    _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.extend(t, extend))

    assert _give_back(store, views, ids, deadline, reached=False) == 3
    assert (views[0].ready, views[0].leased) == (3, 1)
    again, _ = _lease(store, views, 4, T0 + 3 * SECOND)
    # The same ids, in FIFO order, leased for the first time again as far as attempts go.
    assert again == [ids[0], ids[2], ids[3]]
    with store.env.begin() as txn:
        # The lease of plain items is a record (lease_records.py): its items count the
        # attempt it took when written out.
        held = {seq for record in lease_records.read_all(txn, store.db(0)) for seq in record.seqs()}
        stored = {seq: store.get(txn, 0, seq) for seq in (1, 2, 3, 4)}
    assert held == {1, 3, 4}
    assert [item.attempts + (seq in held) for seq, item in stored.items() if item is not None] == [1, 1, 1, 1]


def test_items_whose_ids_may_have_arrived_get_new_ids_and_the_old_ones_fence(store: QueueStore) -> None:
    views = [PartitionView()]
    produce = _request(ProduceRequest([NewItem(payload=bytes([n])) for n in range(2)]))
    _run(store, CONFIG, views, T0, lambda c, t: c.produce(t, produce))
    ids, deadline = _lease(store, views, 2, T0)
    assert _give_back(store, views, ids, deadline, reached=True) == 2
    assert (views[0].ready, views[0].leased) == (2, 0)
    # A second give-back of the same answer changes nothing.
    assert _give_back(store, views, ids, deadline, reached=True) == 0
    complete = _request(CompleteRequest(0, ids))
    with pytest.raises(NotFound):
        _run(store, CONFIG, views, T0 + 3 * SECOND, lambda c, t: c.complete(t, complete))
    again, _ = _lease(store, views, 2, T0 + 3 * SECOND)
    assert len(again) == 2 and not set(again) & set(ids)
    with store.env.begin() as txn:
        attempts = [item.attempts for _, item in store.page_items(txn, 0, 0, 10)]
    assert attempts == [1, 1]
