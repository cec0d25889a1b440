"""The cycle's ordering rules, driven directly on real LMDB with a chosen clock.

Timing through the network cannot place a Complete between a lease deadline and
the lifecycle's re-queue; here one transaction holds both, as a busy actor's would.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import pytest

from querator_server.actor.cycle import Cycle
from querator_server.actor.ids import item_id
from querator_server.actor.requests import (
    CompleteRequest,
    CompleteResult,
    ExtendRequest,
    LeaseRequest,
    ProduceRequest,
    RetryRequest,
)
from querator_server.actor.view import PartitionView
from querator_server.errors import FailedPrecondition, NotFound
from querator_server.model import NewItem, QueueConfig, RetryOrder
from querator_server.storage import Item, QueueStore, lease_records
from querator_server.storage.keyed import KeyedIndex
from querator_server.storage.record import item_key

from cycle_helpers import SECOND, T0
from cycle_helpers import request as _request
from cycle_helpers import run_cycle as _run
from cycle_helpers import seq_of as _seq
from cycle_helpers import stored_keys as _stored_keys


@pytest.fixture
def store(tmp_path: object) -> Iterator[QueueStore]:
    s = QueueStore(str(tmp_path / "q"), 1, map_size=1 << 22, sync=False)  # type: ignore[operator]
    yield s
    s.close()


def _leased_one(store: QueueStore, config: QueueConfig, views: list[PartitionView]) -> str:
    produce = _request(ProduceRequest([NewItem(payload=b"x")]))
    _run(store, config, views, T0, lambda c, t: c.produce(t, produce))
    lease = _request(LeaseRequest(1, "", T0))
    cycle = _run(store, config, views, T0, lambda c, t: c.lease(t, [lease]))
    (_, result) = cycle.results[0]
    return str(result.ids[0])  # type: ignore[attr-defined]


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
    assert cycle.results == [(complete, CompleteResult([], 0))]
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
    assert result.ids == [item_id(1, 0, 2)]  # type: ignore[attr-defined]
    assert result.attempts == [2]  # type: ignore[attr-defined]


def test_completions_in_any_order_remove_exactly_their_items_and_expiry_keys(store: QueueStore) -> None:
    """Completions delete runs of neighbours through cursors; gaps, shuffled ids, three
    expiry deadlines and a lease key must still leave exactly the other items indexed."""
    config = QueueConfig(name="q", uid=1, lease_timeout_us=60 * SECOND, expire_timeout_us=3600 * SECOND)
    views = [PartitionView()]
    keyed = KeyedIndex(store)
    deadline_of: dict[int, int] = {}
    for batch in range(3):  # three produce cycles: three expiry deadlines
        produce = _request(ProduceRequest([NewItem(payload=b"%d" % i) for i in range(40)]))
        now = T0 + batch * SECOND
        cycle = _run(store, config, views, now, lambda c, t, r=produce: c.produce(t, r))
        for text in cycle.results[0][1].ids:  # type: ignore[attr-defined]
            deadline_of[_seq(text)] = now + config.expire_timeout_us
    plain = _request(LeaseRequest(70, "", T0))
    tagged = _request(LeaseRequest(50, "", T0, lease_key="batch-1"))
    cycle = _run(store, config, views, T0 + 3 * SECOND, lambda c, t: c.lease(t, [plain, tagged]), keyed)
    ids = list(cycle.results[0][1].ids)  # type: ignore[attr-defined]
    by_key = [_seq(leased) for leased in cycle.results[1][1].ids]  # type: ignore[attr-defined]
    assert (len(ids), len(by_key)) == (70, 50)

    rng = random.Random(7)
    chosen = rng.sample(ids, 45)  # gaps, in shuffled order
    complete = _request(CompleteRequest(0, chosen, ["batch-1"]))
    cycle = _run(store, config, views, T0 + 4 * SECOND, lambda c, t: c.complete(t, complete), keyed)
    assert cycle.results == [(complete, CompleteResult([], 50))]

    gone = {_seq(text) for text in chosen} | set(by_key)
    left = set(deadline_of) - gone
    seqs, indexed, entries = _stored_keys(store)
    assert seqs == left
    assert indexed == {seq: deadline_of[seq] for seq in left}
    assert entries <= 3  # one run per produce cycle

    rest = _request(CompleteRequest(0, [text for text in ids if text not in chosen], []))
    cycle = _run(store, config, views, T0 + 5 * SECOND, lambda c, t: c.complete(t, rest), keyed)
    assert cycle.results == [(rest, CompleteResult([], 0))]
    assert _stored_keys(store) == (set(), {}, 0)  # the runs went with their last items
    assert (views[0].ready, views[0].leased) == (0, 0)


def test_bare_payloads_are_stored_as_the_general_path_stores_them(store: QueueStore) -> None:
    """A request of bare payloads is stored in bulk, and so is the compact form (payloads
    only); one with any other field item by item. All must leave the same records,
    expiry keys, ids and counts."""
    config = QueueConfig(name="q", uid=1, expire_timeout_us=3600 * SECOND)
    views = [PartitionView()]
    bare = _request(ProduceRequest([NewItem(payload=b"p%d" % i) for i in range(3)]))
    mixed = _request(ProduceRequest([NewItem(payload=b"m0"), NewItem(payload=b"m1", kind="k")]))
    compact = _request(ProduceRequest([], [b"c0", b"", b"c2"]))
    start = views[0].next_seq
    first = _run(store, config, views, T0, lambda c, t: c.produce(t, bare))
    second = _run(store, config, views, T0, lambda c, t: c.produce(t, mixed))
    third = _run(store, config, views, T0, lambda c, t: c.produce(t, compact))
    seqs_of = list(range(start, start + 8))
    assert first.results[0][1].ids == [item_id(1, 0, seq) for seq in seqs_of[:3]]  # type: ignore[attr-defined]
    assert second.results[0][1].ids == [item_id(1, 0, seq) for seq in seqs_of[3:5]]  # type: ignore[attr-defined]
    assert third.results[0][1].ids == [item_id(1, 0, seq) for seq in seqs_of[5:]]  # type: ignore[attr-defined]
    expire = T0 + config.expire_timeout_us
    run = {"created_at": T0, "expire_deadline": expire, "expiry_run": True}
    expected = [Item(payload=b"p%d" % i, **run) for i in range(3)]  # type: ignore[arg-type]
    expected += [Item(payload=b"m0", **run), Item(payload=b"m1", kind="k", **run)]  # type: ignore[arg-type]
    expected += [Item(payload=payload, **run) for payload in (b"c0", b"", b"c2")]  # type: ignore[arg-type]
    with store.env.begin() as txn:
        records = [txn.get(item_key(seq), db=store.db(0)) for seq in seqs_of]
    assert records == [item.encode() for item in expected]
    assert _stored_keys(store) == (set(seqs_of), {seq: expire for seq in seqs_of}, 3)  # a run per request
    assert (views[0].ready, views[0].next_seq, views[0].created_sum) == (8, start + 8, 8 * T0)


@pytest.mark.parametrize("bulk", [True, False])
def test_a_key_produced_again_after_its_window_is_remembered_from_then_on(store: QueueStore, bulk: bool) -> None:
    """The key's old time entry goes with the new record: forgetting what was produced
    before the new window must not forget the key produced again."""
    window = 60 * SECOND
    config = QueueConfig(name="q", uid=1, expire_timeout_us=3600 * SECOND, dedup_window_us=window)
    keyed = KeyedIndex(store)
    views = [PartitionView()]

    def produce(at: int, key: str) -> list[str]:
        extra = {} if bulk else {"kind": "k"}  # the general path takes items with more than a payload
        request = _request(ProduceRequest([NewItem(payload=b"x", idempotency_key=key, **extra)]))  # type: ignore[arg-type]
        cycle = _run(store, config, views, at, lambda c, t: c.produce(t, request), keyed)
        return list(cycle.results[0][1].ids)  # type: ignore[attr-defined]

    first = produce(T0, "job-1")
    assert produce(T0 + SECOND, "job-1") == first  # within the window: the first id
    second = produce(T0 + window + SECOND, "job-1")  # past it: stored again
    assert second != first
    with store.env.begin(write=True) as txn:
        forgotten, _ = keyed.forget_dedup_before(txn, T0 + window, limit=100)
        assert keyed.check(txn, "job-1", T0 + window)[0] == second[0]
    assert forgotten == 0  # only the old time entry was there before the cut, and it is gone
    assert produce(T0 + window + 2 * SECOND, "job-1") == second


def _expiring(seconds: int) -> QueueConfig:
    return QueueConfig(name="q", uid=1, lease_timeout_us=60 * SECOND, expire_timeout_us=seconds * SECOND)


def test_an_expiry_run_expires_its_ready_items_and_goes_with_its_last_leased_one(store: QueueStore) -> None:
    """One entry indexes a produced batch. At its deadline the ready items of the run are
    dead-lettered; leased ones wait for their lease to end, and the entry goes with them."""
    config = _expiring(10)
    views = [PartitionView()]
    produce = _request(ProduceRequest([], [b"%d" % i for i in range(10)]))
    ids = _run(store, config, views, T0, lambda c, t: c.produce(t, produce)).results[0][1].ids  # type: ignore[attr-defined]
    lease = _request(LeaseRequest(5, "", T0))
    leased = _run(store, config, views, T0, lambda c, t: c.lease(t, [lease])).results[0][1].ids  # type: ignore[attr-defined]
    complete = _request(CompleteRequest(0, leased[:2]))
    _run(store, config, views, T0 + SECOND, lambda c, t: c.complete(t, complete))
    deadline = T0 + 10 * SECOND
    assert _stored_keys(store) == (set(range(3, 11)), dict.fromkeys(range(3, 11), deadline), 1)

    cycle = _run(store, config, views, deadline + SECOND, lambda c, t: c.lifecycle(t, []))
    assert cycle.dropped == [(text, "expired", "") for text in ids[5:]]
    assert _stored_keys(store) == ({3, 4, 5}, dict.fromkeys((3, 4, 5), deadline), 1)

    ends = [(T0 + 60 * SECOND, 0, seq) for seq in (3, 4, 5)]
    cycle = _run(store, config, views, T0 + 61 * SECOND, lambda c, t: c.lifecycle(t, ends))
    assert cycle.dropped == [(text, "lease expired, expired", "lease expired after 1 attempt") for text in leased[2:]]
    assert _stored_keys(store) == (set(), {}, 0)
    assert (views[0].ready, views[0].leased) == (0, 0)


def test_expiry_stops_at_its_limit_inside_a_run_and_resumes_there(store: QueueStore) -> None:
    config = _expiring(10)
    views = [PartitionView()]
    produce = _request(ProduceRequest([], [b"%d" % i for i in range(10)]))
    _run(store, config, views, T0, lambda c, t: c.produce(t, produce))
    now = T0 + 11 * SECOND
    expired: list[int] = []

    def expire_some(txn: object) -> int:
        entries, next_deadline = store.expired(txn, 0, now, 4)  # type: ignore[arg-type]
        for key, item in entries:
            seq = int.from_bytes(key[1:], "big")
            store.delete(txn, 0, seq, item)  # type: ignore[arg-type]
            expired.append(seq)
        return next_deadline

    assert [store.write(expire_some) for _ in range(3)] == [now, now, 0]  # 4, 4, then the last 2
    assert expired == list(range(1, 11))
    assert _stored_keys(store) == (set(), {}, 0)


def test_a_requeued_item_leaves_its_run_for_an_entry_of_its_own(store: QueueStore) -> None:
    config = _expiring(3600)
    views = [PartitionView()]
    produce = _request(ProduceRequest([], [b"a", b"b"]))
    _run(store, config, views, T0, lambda c, t: c.produce(t, produce))
    lease = _request(LeaseRequest(2, "", T0))
    _run(store, config, views, T0, lambda c, t: c.lease(t, [lease]))
    ends = [(T0 + 60 * SECOND, 0, seq) for seq in (1, 2)]
    _run(store, config, views, T0 + 61 * SECOND, lambda c, t: c.lifecycle(t, ends))
    deadline = T0 + 3600 * SECOND
    assert _stored_keys(store) == ({3, 4}, {3: deadline, 4: deadline}, 2)
    with store.env.begin() as txn:
        assert not any(Item.decode(txn.get(item_key(seq), db=store.db(0))).expiry_run for seq in (3, 4))


def test_clear_takes_the_runs_with_the_items(store: QueueStore) -> None:
    config = _expiring(3600)
    views = [PartitionView()]
    for batch in range(3):
        produce = _request(ProduceRequest([], [b"%d" % i for i in range(5)]))
        _run(store, config, views, T0 + batch, lambda c, t, r=produce: c.produce(t, r))
    lease = _request(LeaseRequest(7, "", T0))
    _run(store, config, views, T0, lambda c, t: c.lease(t, [lease]))
    store.write(lambda txn: store.clear(txn, 0, ready=True, leased=False, scheduled=False))
    assert _stored_keys(store)[0] == set(range(1, 8))  # the leased ones stay, and their runs
    assert _stored_keys(store)[2] == 2
    store.write(lambda txn: store.clear(txn, 0, ready=True, leased=True, scheduled=False))
    assert _stored_keys(store) == (set(), {}, 0)


def _produce_and_lease(store: QueueStore, config: QueueConfig, views: list[PartitionView], produced: int, leased: int) -> list[str]:
    produce = _request(ProduceRequest([], [b"%d" % i for i in range(produced)]))
    _run(store, config, views, T0, lambda c, t: c.produce(t, produce))
    lease = _request(LeaseRequest(leased, "", T0))
    return list(_run(store, config, views, T0, lambda c, t: c.lease(t, [lease])).results[0][1].ids)  # type: ignore[attr-defined]


def test_a_leased_batch_completed_as_it_was_handed_out_goes_in_one_pass(store: QueueStore) -> None:
    config = _expiring(3600)
    views = [PartitionView()]
    ids = _produce_and_lease(store, config, views, 10, 6)
    calls: list[object] = []
    real = store.complete_run

    def counted(*args: object) -> object:
        calls.append(args[2:])
        return real(*args)  # type: ignore[arg-type]

    store.complete_run = counted  # type: ignore[method-assign]
    complete = _request(CompleteRequest(0, ids[1:5]))
    cycle = _run(store, config, views, T0 + SECOND, lambda c, t: c.complete(t, complete))
    assert cycle.results == [(complete, CompleteResult([], 0))]
    assert calls == [(2, 5)]
    assert _stored_keys(store)[:2] == ({1, 6, 7, 8, 9, 10}, dict.fromkeys((1, 6, 7, 8, 9, 10), T0 + 3600 * SECOND))
    assert (views[0].ready, views[0].leased, views[0].created_sum) == (4, 2, 6 * T0)
    assert views[0].leased_at_sum == 2 * T0


@pytest.mark.parametrize(
    ("case", "error", "named"),
    [
        ("one of them is ready", FailedPrecondition, "ids[5]"),
        ("one of them was retried", NotFound, "ids[2]"),
    ],
)
def test_a_run_of_ids_with_one_bad_id_completes_nothing_and_names_it(
    store: QueueStore, case: str, error: type[Exception], named: str
) -> None:
    config = _expiring(3600)
    views = [PartitionView()]
    if case == "one of them is ready":
        run = _produce_and_lease(store, config, views, 10, 5) + [item_id(1, 0, 6)]  # 6 was never leased
    else:
        ids = _produce_and_lease(store, config, views, 10, 8)
        done = _request(RetryRequest(0, [RetryOrder(item_id=ids[2])]))
        _run(store, config, views, T0, lambda c, t: c.retry(t, done))
        run = ids[:6]  # seqs 1..6 in order, 3 gone (a completed one would count as done); 7 is leased too and must stay
    before = (_stored_keys(store), views[0].leased, views[0].ready)
    with pytest.raises(error, match=re.escape(named)):
        _run(store, config, views, T0 + SECOND, lambda c, t: c.complete(t, _request(CompleteRequest(0, run))))
    assert (_stored_keys(store), views[0].leased, views[0].ready) == before


def test_a_run_of_items_put_back_after_their_lease_completes_with_their_own_entries(store: QueueStore) -> None:
    config = _expiring(3600)
    views = [PartitionView()]
    _produce_and_lease(store, config, views, 3, 3)
    ends = [(T0 + 60 * SECOND, 0, seq) for seq in (1, 2, 3)]
    _run(store, config, views, T0 + 61 * SECOND, lambda c, t: c.lifecycle(t, ends))
    lease = _request(LeaseRequest(3, "", T0))
    again = _run(store, config, views, T0 + 62 * SECOND, lambda c, t: c.lease(t, [lease])).results[0][1].ids  # type: ignore[attr-defined]
    assert [_seq(text) for text in again] == [4, 5, 6]
    assert _stored_keys(store)[2] == 3  # one entry each
    complete = _request(CompleteRequest(0, list(again)))
    _run(store, config, views, T0 + 63 * SECOND, lambda c, t: c.complete(t, complete))
    assert _stored_keys(store) == (set(), {}, 0)
    assert (views[0].ready, views[0].leased, views[0].created_sum, views[0].leased_at_sum) == (0, 0, 0, 0)


def test_a_lease_takes_plain_and_other_items_in_fifo_order_and_drops_the_dying(store: QueueStore) -> None:
    """The plain items go in runs; an item with more than a payload, or due to die, is
    met in its place and handled on its own, and the runs go on after it."""
    long, short = _expiring(3600), _expiring(5)
    views = [PartitionView()]
    for config, items in (
        (long, [NewItem(payload=b"a")]),
        (short, [NewItem(payload=b"b"), NewItem(payload=b"c")]),
        (long, [NewItem(payload=b"d", kind="k")]),
        (long, [NewItem(payload=b"e"), NewItem(payload=b"f"), NewItem(payload=b"g")]),
    ):
        produce = _request(ProduceRequest(items))
        _run(store, config, views, T0, lambda c, t, r=produce: c.produce(t, r))
    lease = _request(LeaseRequest(5, "", T0))
    cycle = _run(store, long, views, T0 + 6 * SECOND, lambda c, t: c.lease(t, [lease]))
    result = cycle.results[0][1]
    assert [_seq(text) for text in result.ids] == [1, 4, 5, 6, 7]  # type: ignore[attr-defined]
    assert result.payloads == [b"a", b"d", b"e", b"f", b"g"]  # type: ignore[attr-defined]
    assert result.attempts == [1] * 5  # type: ignore[attr-defined]
    assert {index: item.kind for index, item in result.details.items()} == {1: "k"}  # type: ignore[attr-defined]
    assert cycle.dropped == [(item_id(1, 0, 2), "expired", ""), (item_id(1, 0, 3), "expired", "")]
    assert (views[0].ready, views[0].leased, views[0].ready_hint) == (0, 5, 8)
    # The plain items are one lease record, their records untouched; the item of a
    # kind is rewritten as leased.
    with store.env.begin() as txn:
        records = lease_records.read_all(txn, store.db(0))
        plain = [Item.decode(txn.get(item_key(seq), db=store.db(0))) for seq in (1, 5, 6, 7)]
        other = Item.decode(txn.get(item_key(4), db=store.db(0)))
    assert [(r.first, r.deadline, r.leased_at, [s[:2] for s in r.segments]) for r in records] == [
        (1, T0 + 66 * SECOND, T0 + 6 * SECOND, [(1, 1), (5, 7)])
    ]
    assert set(views[0].leases.held) == {1, 5, 6, 7}
    assert not any(item.is_leased or item.attempts for item in plain)
    assert other.is_leased and other.attempts == 1 and other.lease_deadline == T0 + 66 * SECOND
    # Written out, they read as a lease that rewrites its items leaves them.
    store.write(lambda txn: lease_records.write_out(txn, store.db(0), records[0]))
    with store.env.begin() as txn:
        stored = [Item.decode(txn.get(item_key(seq), db=store.db(0))) for seq in (1, 4, 5, 6, 7)]
        assert lease_records.read_all(txn, store.db(0)) == []
    assert all(item.is_leased and item.attempts == 1 and item.leased_at == T0 + 6 * SECOND for item in stored)
    assert [item.lease_deadline for item in stored] == [T0 + 66 * SECOND] * 5
