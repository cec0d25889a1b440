"""One record per lease (storage/lease_records.py): every path on a lease of plain items.

A lease of plain items writes one record and leaves the items' records as they were;
the exact completion of the whole lease deletes items and record unread; every other
path writes the lease out into its items first. Each test drives ``Cycle`` on a real
LMDB partition and checks what storage holds (items, expiry index, records), the view's
counts and book, and that a restart (the views read again) agrees.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from querator_server.actor.ids import item_id
from querator_server.actor.loading import load
from querator_server.actor.requests import (
    ClearRequest,
    CompleteRequest,
    DeleteItemsRequest,
    ExtendRequest,
    GiveBackRequest,
    LeaseRequest,
    ListItemsRequest,
    ProduceRequest,
    RetryRequest,
)
from querator_server.actor.view import PartitionView
from querator_server.errors import FailedPrecondition
from querator_server.model import NewItem, QueueConfig, RetryOrder
from querator_server.storage import Item, QueueStore, done_runs, lease_records
from querator_server.storage.record import item_key

from cycle_helpers import SECOND, T0
from cycle_helpers import request as _request
from cycle_helpers import run_cycle as _run
from cycle_helpers import seq_of as _seq
from cycle_helpers import stored_keys as _stored_keys

LEASE = 60 * SECOND
CONFIG = QueueConfig(name="q", uid=1, lease_timeout_us=LEASE, expire_timeout_us=3600 * SECOND, max_attempts=3)


@pytest.fixture
def store(tmp_path: object) -> Iterator[QueueStore]:
    s = QueueStore(str(tmp_path / "q"), 1, map_size=1 << 22, sync=False)  # type: ignore[operator]
    yield s
    s.close()


def _produce(store: QueueStore, views: list[PartitionView], count: int, now: int = T0) -> list[str]:
    produce = _request(ProduceRequest([], [b"p%d" % i for i in range(count)]))
    cycle = _run(store, CONFIG, views, now, lambda c, t: c.produce(t, produce))
    return list(cycle.results[0][1].ids)  # type: ignore[attr-defined]


def _lease(store: QueueStore, views: list[PartitionView], count: int, now: int = T0) -> list[str]:
    lease = _request(LeaseRequest(count, "", now))
    cycle = _run(store, CONFIG, views, now, lambda c, t: c.lease(t, [lease]))
    return list(cycle.results[0][1].ids) if cycle.results else []  # type: ignore[attr-defined]


def _records(store: QueueStore) -> list[lease_records.LeaseRecord]:
    with store.env.begin() as txn:
        return lease_records.read_all(txn, store.db(0))


def _state(store: QueueStore) -> dict[int, tuple[bool, int, int]]:
    """Every stored item as (leased, attempts, lease deadline), a lease record's items
    read as its write-out would leave them."""
    held = {seq: record for record in _records(store) for seq in record.seqs()}
    out: dict[int, tuple[bool, int, int]] = {}
    with store.env.begin() as txn:
        for seq in _stored_keys(store)[0]:
            item = Item.decode(txn.get(item_key(seq), db=store.db(0)))
            record = held.get(seq)
            if record is not None:
                assert not item.is_leased, f"item {seq} is flagged leased and held by a record"
                out[seq] = (True, item.attempts + 1, record.deadline)
            else:
                out[seq] = (item.is_leased, item.attempts, item.lease_deadline)
    return out


def _agrees(store: QueueStore, views: list[PartitionView]) -> None:
    """The view's book is what storage holds, and a restart finds the same counts."""
    v = views[0]
    assert v.leases.records == {record.first: record for record in _records(store)}
    state = _state(store)
    assert (v.ready, v.leased) == (sum(1 for s in state.values() if not s[0]), sum(1 for s in state.values() if s[0]))
    again = load(store).views[0]
    assert (again.ready, again.leased, again.created_sum, again.leased_at_sum) == (
        v.ready,
        v.leased,
        v.created_sum,
        v.leased_at_sum,
    )
    assert again.leases.records == v.leases.records


def test_a_lease_writes_one_record_and_its_exact_completion_deletes_all_unread(store: QueueStore) -> None:
    views = [PartitionView()]
    ids = _produce(store, views, 10)
    leased = _lease(store, views, 6)
    assert leased == ids[:6]
    (record,) = _records(store)
    assert (record.first, record.segments, record.deadline, record.leased_at) == (
        1,
        ((1, 6, T0 + 3600 * SECOND),),
        T0 + LEASE,
        T0,
    )
    with store.env.begin() as txn:  # the items' records are as produce wrote them
        assert all(not Item.decode(txn.get(item_key(seq), db=store.db(0))).is_leased for seq in range(1, 11))
    assert _state(store)[1] == (True, 1, T0 + LEASE)
    _agrees(store, views)
    complete = _request(CompleteRequest(0, leased))
    cycle = _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.complete(t, complete))
    assert cycle.results[0][1].already_completed == []  # type: ignore[attr-defined]
    assert _records(store) == []
    assert _stored_keys(store)[0] == set(range(7, 11))
    assert cycle.lease_ends == [] and [(p, list(seqs)) for p, seqs in cycle.lease_end_runs] == [(0, list(range(1, 7)))]
    assert (views[0].ready, views[0].leased, views[0].completed) == (4, 0, 6)
    assert views[0].created_sum == 4 * T0 and views[0].leased_at_sum == 0
    _agrees(store, views)
    # Sent again: answered as done, from the done records.
    again = _request(CompleteRequest(0, leased))
    cycle = _run(store, CONFIG, views, T0 + 2 * SECOND, lambda c, t: c.complete(t, again))
    assert cycle.results[0][1].already_completed == leased  # type: ignore[attr-defined]
    with store.env.begin() as txn:
        assert done_runs.find(txn, store.db(0), [1, 6]) == {1: done_runs.COMPLETED, 6: done_runs.COMPLETED}
    # The whole queue drains with the expiry runs gone too.
    rest = _lease(store, views, 10, T0 + 3 * SECOND)
    final = _request(CompleteRequest(0, rest))
    _run(store, CONFIG, views, T0 + 3 * SECOND, lambda c, t: c.complete(t, final))
    assert _stored_keys(store) == (set(), {}, 0)
    _agrees(store, views)


def test_completing_part_of_a_lease_writes_it_out_and_the_rest_stays_leased(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 5)
    leased = _lease(store, views, 5)
    part = _request(CompleteRequest(0, [leased[3], leased[1]]))
    _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.complete(t, part))
    assert _records(store) == []
    with store.env.begin() as txn:
        left = {seq: Item.decode(txn.get(item_key(seq), db=store.db(0))) for seq in (1, 3, 5)}
    assert all(i.is_leased and i.attempts == 1 and i.lease_deadline == T0 + LEASE and i.leased_at == T0 for i in left.values())
    assert _stored_keys(store)[0] == {1, 3, 5}
    _agrees(store, views)
    # The rest as the lease handed it out: the item-by-item path names the completed two.
    rest = _request(CompleteRequest(0, leased))
    cycle = _run(store, CONFIG, views, T0 + 2 * SECOND, lambda c, t: c.complete(t, rest))
    assert cycle.results[0][1].already_completed == [leased[1], leased[3]]  # type: ignore[attr-defined]
    assert _stored_keys(store) == (set(), {}, 0)
    _agrees(store, views)


def test_an_id_not_leased_among_a_leases_ids_fails_the_completion_and_changes_nothing(store: QueueStore) -> None:
    views = [PartitionView()]
    ids = _produce(store, views, 4)
    leased = _lease(store, views, 2)
    before = _state(store)
    bad = _request(CompleteRequest(0, [*leased, ids[2]]))
    with pytest.raises(FailedPrecondition, match=r"item is not leased: ids\[2\]"):
        _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.complete(t, bad))
    assert _state(store) == before
    _agrees(store, views)


def test_retry_writes_the_lease_out_and_requeues_with_its_attempt(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 3)
    leased = _lease(store, views, 3)
    retry = _request(RetryRequest(0, [RetryOrder(leased[0], error="boom")]))
    _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.retry(t, retry))
    state = _state(store)
    assert state[2] == (True, 1, T0 + LEASE) and state[3] == (True, 1, T0 + LEASE)
    with store.env.begin() as txn:
        again = Item.decode(txn.get(item_key(4), db=store.db(0)))
    assert (again.is_leased, again.attempts, again.last_error, again.message_id) == (False, 1, "boom", leased[0])
    _agrees(store, views)


def test_extend_writes_the_lease_out_with_the_new_deadline(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 3)
    leased = _lease(store, views, 3)
    extend = _request(ExtendRequest(0, [leased[1]], 120 * SECOND))
    cycle = _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.extend(t, extend))
    assert cycle.results[0][1].deadlines == [T0 + 121 * SECOND]  # type: ignore[attr-defined]
    assert _state(store) == {1: (True, 1, T0 + LEASE), 2: (True, 1, T0 + 121 * SECOND), 3: (True, 1, T0 + LEASE)}
    assert _records(store) == []
    _agrees(store, views)


def test_a_lease_running_out_requeues_its_items_as_before(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 2)
    _lease(store, views, 2)
    ends = [(T0 + LEASE, 0, seq) for seq in (1, 2)]
    cycle = _run(store, CONFIG, views, T0 + LEASE + 1, lambda c, t: c.lifecycle(t, ends))
    assert cycle.lease_expirations == 2
    assert _state(store) == {3: (False, 1, 0), 4: (False, 1, 0)}
    with store.env.begin() as txn:
        assert Item.decode(txn.get(item_key(3), db=store.db(0))).last_error == "lease expired after 1 attempt"
    _agrees(store, views)
    # A re-queued item carries its history (its first id): later leases rewrite it, and
    # the third lease's end dead-letters it.
    for attempt in (2, 3):
        now = T0 + attempt * 2 * LEASE
        leased = _lease(store, views, 2, now)
        assert _records(store) == []
        ends = [(now + LEASE, 0, _seq(text)) for text in leased]
        cycle = _run(store, CONFIG, views, now + LEASE + 1, lambda c, t, e=ends: c.lifecycle(t, e))
    assert [why for _id, why, _error in cycle.dropped] == ["lease expired, max_attempts reached"] * 2
    assert _stored_keys(store) == (set(), {}, 0)
    _agrees(store, views)


def test_a_deadline_popped_for_a_lease_extended_since_is_left_alone(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 2)
    leased = _lease(store, views, 2)
    extend = _request(ExtendRequest(0, [leased[0]], 300 * SECOND))
    _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.extend(t, extend))
    ends = [(T0 + LEASE, 0, seq) for seq in (1, 2)]
    cycle = _run(store, CONFIG, views, T0 + LEASE + 1, lambda c, t: c.lifecycle(t, ends))
    assert cycle.lease_expirations == 1
    assert _state(store) == {1: (True, 1, T0 + 301 * SECOND), 3: (False, 1, 0)}
    _agrees(store, views)


def test_items_that_expire_while_held_by_a_record_die_when_the_lease_ends(store: QueueStore) -> None:
    config = QueueConfig(name="q", uid=1, lease_timeout_us=LEASE, expire_timeout_us=10 * SECOND)
    views = [PartitionView()]
    produce = _request(ProduceRequest([], [b"a", b"b", b"c"]))
    _run(store, config, views, T0, lambda c, t: c.produce(t, produce))
    lease = _request(LeaseRequest(2, "", T0))
    _run(store, config, views, T0, lambda c, t: c.lease(t, [lease]))
    cycle = _run(store, config, views, T0 + 11 * SECOND, lambda c, t: c.lifecycle(t, []))
    assert [text for text, _why, _error in cycle.dropped] == [item_id(1, 0, 3)]  # the ready one only
    assert set(_state(store)) == {1, 2}
    _agrees(store, views)
    ends = [(T0 + LEASE, 0, seq) for seq in (1, 2)]
    cycle = _run(store, config, views, T0 + LEASE + 1, lambda c, t: c.lifecycle(t, ends))
    assert [why for _id, why, _error in cycle.dropped] == ["lease expired, expired"] * 2
    assert _stored_keys(store) == (set(), {}, 0)


def test_delete_of_a_held_item_writes_its_lease_out(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 3)
    leased = _lease(store, views, 3)
    delete = _request(DeleteItemsRequest(0, [leased[1]]))
    _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.delete_items(t, delete))
    assert _state(store) == {1: (True, 1, T0 + LEASE), 3: (True, 1, T0 + LEASE)}
    assert (views[0].ready, views[0].leased) == (0, 2)
    _agrees(store, views)


def test_clear_keeps_held_items_unless_destructive(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 5)
    _lease(store, views, 3)
    keep = _request(ClearRequest(ready=True, scheduled=False, destructive=False))
    _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.clear(t, keep))
    assert _state(store) == {seq: (True, 1, T0 + LEASE) for seq in (1, 2, 3)}
    _agrees(store, views)
    _lease(store, views, 3, T0 + SECOND)  # nothing ready: the held items are not leased again
    assert views[0].leased == 3
    wipe = _request(ClearRequest(ready=True, scheduled=False, destructive=True))
    cycle = _run(store, CONFIG, views, T0 + 2 * SECOND, lambda c, t: c.clear(t, wipe))
    assert sorted(cycle.lease_ends) == [(0, 1), (0, 2), (0, 3)]
    assert _stored_keys(store) == (set(), {}, 0)
    _agrees(store, views)


def test_a_listing_shows_held_items_leased_and_writes_nothing(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 3)
    _lease(store, views, 2)
    listing = _request(ListItemsRequest(0, 10, (0, 0), False))
    cycle = store.read(lambda txn: _listed(store, views, txn, listing))
    page = cycle.results[0][1].items  # type: ignore[attr-defined]
    assert [(s.item.is_leased, s.item.attempts, s.item.lease_deadline) for s in page] == [
        (True, 1, T0 + LEASE),
        (True, 1, T0 + LEASE),
        (False, 0, 0),
    ]
    assert len(_records(store)) == 1


def _listed(store: QueueStore, views: list[PartitionView], txn: object, listing: object) -> object:
    from querator_server.actor.cycle import Cycle

    cycle = Cycle(store, CONFIG, views, T0, writable=False)
    cycle.list_items(txn, listing)  # type: ignore[arg-type]
    return cycle


def test_a_lease_whose_caller_left_deletes_its_record_and_the_items_are_ready_again(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 4)
    lease = _request(LeaseRequest(3, "", T0))

    def gone(cycle: object, txn: object) -> None:
        cycle.lease(txn, [lease])  # type: ignore[attr-defined]
        lease.future.cancel()  # type: ignore[attr-defined]
        cycle.fence_leases(txn, T0)  # type: ignore[attr-defined]

    cycle = _run(store, CONFIG, views, T0, gone)
    assert cycle.lease_deadlines == [] and all(not seqs for _d, _p, seqs in cycle.lease_deadline_runs)
    assert _records(store) == []
    assert _state(store) == {seq: (False, 0, 0) for seq in range(1, 5)}
    assert (views[0].ready, views[0].leased, views[0].ready_hint) == (4, 0, 1)
    _agrees(store, views)
    assert _lease(store, views, 4, T0 + SECOND) == [item_id(1, 0, seq) for seq in range(1, 5)]


def test_a_given_back_lease_is_ready_again_with_its_attempts_and_not_leased_twice(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 6)
    first = _lease(store, views, 3)
    second = _lease(store, views, 2)
    give = _request(GiveBackRequest(0, first, T0 + LEASE))
    lease = _request(LeaseRequest(10, "", T0 + SECOND))

    def back_then_lease(cycle: object, txn: object) -> None:
        cycle.give_back(txn, give)  # type: ignore[attr-defined]
        cycle.lease(txn, [lease])  # type: ignore[attr-defined]

    cycle = _run(store, CONFIG, views, T0 + SECOND, back_then_lease)
    assert cycle.results[0][1] == 3
    again = cycle.results[1][1].ids  # type: ignore[attr-defined]
    # The given-back three and the one never leased; the second lease's two stay its own.
    assert again == [*first, item_id(1, 0, 6)]
    assert not set(again) & set(second)
    assert cycle.results[1][1].attempts == [1, 1, 1, 1]  # type: ignore[attr-defined]
    _agrees(store, views)


def test_a_lease_passes_over_items_a_record_holds_when_its_walk_starts_behind_them(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 6)
    _lease(store, views, 2)  # 1, 2 by record
    held = _lease(store, views, 2)  # 3, 4 by record
    retry = _request(RetryRequest(0, [RetryOrder(item_id(1, 0, 1))]))
    _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.retry(t, retry))
    views[0].ready_hint = 1  # as a give-back or fence would leave it
    taken = _lease(store, views, 10, T0 + 2 * SECOND)
    assert [_seq(text) for text in taken] == [5, 6, 7]
    assert not set(taken) & set(held)
    _agrees(store, views)


def test_a_lease_takes_plain_items_by_record_and_others_by_rewrite_in_one_answer(store: QueueStore) -> None:
    views = [PartitionView()]
    items = [NewItem(payload=b"a"), NewItem(payload=b"b", priority=3), NewItem(payload=b"c", kind="k"), NewItem(payload=b"d")]
    produce = _request(ProduceRequest(items))
    _run(store, CONFIG, views, T0, lambda c, t: c.produce(t, produce))
    leased = _lease(store, views, 4)
    assert [_seq(text) for text in leased] == [2, 1, 3, 4]  # the priority item first
    (record,) = _records(store)
    assert [s[:2] for s in record.segments] == [(1, 1), (4, 4)]
    assert _state(store) == {seq: (True, 1, T0 + LEASE) for seq in (1, 2, 3, 4)}
    # Not the exact lease (the ids of a lease of several kinds are not one run): item by item.
    complete = _request(CompleteRequest(0, leased))
    _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.complete(t, complete))
    assert _stored_keys(store) == (set(), {}, 0)
    assert _records(store) == []
    _agrees(store, views)


def test_a_keyed_lease_rewrites_its_items_and_writes_no_record(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 2)
    lease = _request(LeaseRequest(2, "", T0, lease_key="k1"))
    from querator_server.storage.keyed import KeyedIndex

    keyed = KeyedIndex(store)
    _run(store, CONFIG, views, T0, lambda c, t: c.lease(t, [lease]), keyed)
    assert _records(store) == []
    assert _state(store) == {1: (True, 1, T0 + LEASE), 2: (True, 1, T0 + LEASE)}


def test_items_leased_in_the_older_layout_complete_and_run_out_as_before(store: QueueStore) -> None:
    """A data directory written before lease records: its leased items carry the flag."""
    views = [PartitionView()]
    _produce(store, views, 4)
    lease = _request(LeaseRequest(4, "", T0, lease_key="old"))  # a rewriting lease
    _run(store, CONFIG, views, T0, lambda c, t: c.lease(t, [lease]))
    assert _records(store) == []
    views = load(store).views  # read as a server of this format reads an older one
    assert (views[0].leased, views[0].ready) == (4, 0)
    ids = [item_id(1, 0, seq) for seq in (1, 2)]
    complete = _request(CompleteRequest(0, ids))
    _run(store, CONFIG, views, T0 + SECOND, lambda c, t: c.complete(t, complete))
    ends = [(T0 + LEASE, 0, seq) for seq in (3, 4)]
    _run(store, CONFIG, views, T0 + LEASE + 1, lambda c, t: c.lifecycle(t, ends))
    assert _state(store) == {5: (False, 1, 0), 6: (False, 1, 0)}
    _agrees(store, views)


def test_a_record_whose_item_is_missing_is_refused_and_nothing_past_it_is_deleted(store: QueueStore) -> None:
    views = [PartitionView()]
    _produce(store, views, 5)
    _lease(store, views, 3)
    (record,) = _records(store)
    db = store.db(0)
    with store.env.begin(write=True) as txn:
        txn.delete(item_key(2), db=db)  # what no path may do: an item of an open record gone
        with pytest.raises(lease_records.BrokenLease, match=r"\(1\.\.3\) is not stored"):
            lease_records.complete(txn, db, record)
        assert txn.get(item_key(4), db=db) is not None  # the walk stopped at the segment's end
        txn.abort()
    with store.env.begin(write=True) as txn:
        txn.put(item_key(2), b"\x01" + txn.get(item_key(1), db=db)[1:], db=db)  # flagged leased
        with pytest.raises(lease_records.BrokenLease, match="flagged leased"):
            lease_records.write_out(txn, db, record)
        txn.abort()
