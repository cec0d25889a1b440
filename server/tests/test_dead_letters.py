"""Dead letters keep their history, and every item a stable message id.

An item's ``id`` changes whenever it re-enters a partition (lease expired, Retry,
promotion, dead-lettering), which keeps stale ids from touching it; its
``message_id`` is the id it was produced with and never changes. A dead letter
says why it died (``dead_reason``), when (``dead_at``) and after how many attempts
(``dead_attempts``), in Lease answers (items and columns) and in ListItems.
Real servers over real gRPC on real LMDB; every wait polls with a bounded timeout.
"""

from __future__ import annotations

import time

from google.protobuf import timestamp_pb2

from querator.v1 import queue_pb2, storage_pb2

from conftest import Stubs, dur, secs, wait_until

EVENTUALLY = 10.0
MAX_ATTEMPTS = queue_pb2.DEAD_REASON_MAX_ATTEMPTS
EXPIRED = queue_pb2.DEAD_REASON_EXPIRED
RETRY_DEAD = queue_pb2.DEAD_REASON_RETRY_DEAD


def create(stubs: Stubs, name: str, *, lease: float = 60, expire: float = 600, **settings: object) -> None:
    stubs.create(name, lease_timeout=dur(lease), expire_timeout=dur(expire), **settings)


def lease_now(stubs: Stubs, name: str, batch_size: int = 10, **kw: object) -> queue_pb2.LeaseResponse:
    return stubs.lease(name, batch_size=batch_size, request_timeout=dur(0.2), **kw)


def retry(stubs: Stubs, name: str, ids: list[str], **kw: object) -> None:
    items = [queue_pb2.RetryItem(id=i, **kw) for i in ids]  # type: ignore[arg-type]
    stubs.queue.Retry(queue_pb2.RetryRequest(queue_name=name, partition=0, items=items), timeout=10)


def _at(epoch_seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromMicroseconds(int(epoch_seconds * 1e6))
    return ts


def test_the_message_id_survives_retry_lease_expiry_and_scheduling_while_the_id_changes(stubs: Stubs) -> None:
    create(stubs, "q", lease=1)
    (produced,) = stubs.produce("q", [b"a"]).ids
    first = lease_now(stubs, "q").items[0]
    assert (first.id, first.message_id) == (produced, produced)
    listed = stubs.list_items("q")[0]
    assert listed.message_id == produced and listed.dead_reason == queue_pb2.DEAD_REASON_UNSPECIFIED

    retry(stubs, "q", [first.id])  # re-queued at once: a new id
    second = lease_now(stubs, "q").items[0]
    assert second.id != produced and second.message_id == produced
    # The lease runs out: re-queued again under a third id.
    wait_until(lambda: not stubs.list_items("q")[0].is_leased, timeout=EVENTUALLY)
    third = lease_now(stubs, "q").items[0]
    assert third.id not in (produced, second.id) and third.message_id == produced
    assert third.attempts == 3

    retry(stubs, "q", [third.id], retry_at=_at(time.time() + 300))
    request = storage_pb2.ListScheduledItemsRequest(queue_name="q", partition=0)
    (scheduled,) = stubs.storage.ListScheduledItems(request, timeout=10).items
    assert scheduled.id != third.id and scheduled.message_id == produced


def test_columns_carry_message_ids_only_when_an_item_of_the_batch_moved(stubs: Stubs) -> None:
    create(stubs, "q")
    ids = list(stubs.produce("q", [b"a", b"b", b"c"]).ids)
    fresh = lease_now(stubs, "q", columnar=True).columns
    assert list(fresh.ids) == ids and list(fresh.message_ids) == []  # equal to the ids: left out
    retry(stubs, "q", [ids[1]])
    stubs.complete("q", 0, [ids[0], ids[2]])
    stubs.produce("q", [b"d"])
    moved = lease_now(stubs, "q", columnar=True).columns
    assert [bytes(p) for p in moved.payloads] == [b"b", b"d"]
    assert moved.message_ids[0] == ids[1] and moved.ids[0] != ids[1]
    assert moved.message_ids[1] == moved.ids[1]
    assert list(moved.dead_reasons) == []


def test_dead_letters_say_why_when_and_after_how_many_attempts(stubs: Stubs) -> None:
    create(stubs, "dlq")
    create(stubs, "tries", lease=1, max_attempts=2, dead_queue="dlq")
    create(stubs, "short", lease=1, expire=1.5, dead_queue="dlq")
    create(stubs, "gives-up", dead_queue="dlq")
    started = time.time()
    (tried,) = stubs.produce("tries", [b"tried"]).ids
    (short,) = stubs.produce("short", [b"expired"]).ids
    (given,) = stubs.produce("gives-up", [b"retried dead"]).ids

    gives_up = lease_now(stubs, "gives-up").items[0]
    retry(stubs, "gives-up", [gives_up.id], dead=True)
    # Two leases that run out: re-queued once, then dead with max_attempts reached.
    lease_now(stubs, "tries")
    wait_until(lambda: lease_now(stubs, "tries").items, timeout=EVENTUALLY)
    final_id = stubs.list_items("tries")[0].id
    wait_until(lambda: len(stubs.list_items("dlq")) == 3, timeout=EVENTUALLY)
    died_by = time.time()

    listed = {i.payload: i for i in stubs.list_items("dlq")}
    want = {
        b"tried": (tried, final_id, MAX_ATTEMPTS, 2),
        b"expired": (short, short, EXPIRED, 0),
        b"retried dead": (given, gives_up.id, RETRY_DEAD, 1),
    }
    for payload, (message_id, source_id, reason, attempts) in want.items():
        item = listed[payload]
        assert (item.message_id, item.source_id, item.dead_reason, item.dead_attempts) == (
            message_id,
            source_id,
            reason,
            attempts,
        ), payload
        assert started - 0.05 <= secs(item.dead_at) <= died_by + 0.05
        assert item.attempts == 0, "attempts count the leases in the dead-letter queue"
        assert item.id != item.message_id

    leased = {i.payload: i for i in lease_now(stubs, "dlq").items}
    for payload, (message_id, source_id, reason, attempts) in want.items():
        item = leased[payload]
        assert (item.message_id, item.source_id, item.dead_reason, item.dead_attempts, item.attempts) == (
            message_id,
            source_id,
            reason,
            attempts,
            1,
        ), payload
        assert item.dead_at == listed[payload].dead_at
    retry(stubs, "dlq", [i.id for i in leased.values()])

    columns = lease_now(stubs, "dlq", columnar=True).columns
    order = [bytes(p) for p in columns.payloads]
    assert sorted(order) == sorted(want)
    assert list(columns.message_ids) == [want[p][0] for p in order]
    assert list(columns.source_ids) == [want[p][1] for p in order]
    assert list(columns.dead_reasons) == [want[p][2] for p in order]
    assert list(columns.dead_attempts) == [want[p][3] for p in order]
    assert list(columns.dead_at_us) == [listed[p].dead_at.ToMicroseconds() for p in order]


def test_import_keeps_the_history_it_is_given_and_checks_it(stubs: Stubs) -> None:
    create(stubs, "q")
    item = storage_pb2.StorageItem(
        payload=b"x", message_id="9.0.1", source_id="9.0.7", dead_reason=EXPIRED, dead_attempts=4, dead_at=_at(1.7e9)
    )
    request = storage_pb2.ImportItemsRequest(queue_name="q", partition=0, items=[item])
    (new_id,) = stubs.storage.ImportItems(request, timeout=10).ids
    (stored,) = stubs.list_items("q")
    assert (stored.id, stored.message_id, stored.source_id, stored.dead_reason, stored.dead_attempts) == (
        new_id,
        "9.0.1",
        "9.0.7",
        EXPIRED,
        4,
    )
    assert secs(stored.dead_at) == 1.7e9
    for bad, field in (
        (storage_pb2.StorageItem(payload=b"x", dead_attempts=-1), "items[0].dead_attempts"),
        (storage_pb2.StorageItem(payload=b"x", dead_reason=99), "items[0].dead_reason"),  # type: ignore[arg-type]
        (storage_pb2.StorageItem(payload=b"x", message_id="m" * 513), "items[0].message_id"),
    ):
        request = storage_pb2.ImportItemsRequest(queue_name="q", partition=0, items=[bad])
        try:
            stubs.storage.ImportItems(request, timeout=10)
        except Exception as exc:  # noqa: BLE001 - checked below
            assert "INVALID_ARGUMENT" in str(exc) and field in str(exc)
        else:
            raise AssertionError(f"{field} was accepted")


def test_dead_letters_stay_in_the_dead_letter_queue_until_removed(stubs: Stubs) -> None:
    """The dead-letter queue's expire_timeout (1.5 s here) applies to what is produced
    into it, never to the dead letters it keeps for someone to look at."""
    create(stubs, "dlq", lease=1, expire=1.5)
    create(stubs, "q", dead_queue="dlq")
    stubs.produce("q", [b"dead"])
    retry(stubs, "q", [lease_now(stubs, "q").items[0].id], dead=True)
    wait_until(lambda: stubs.list_items("dlq"), timeout=EVENTUALLY)
    stubs.produce("dlq", [b"produced here"])
    (dead,) = [i for i in stubs.list_items("dlq") if i.payload == b"dead"]
    assert not dead.HasField("expire_deadline"), "a dead letter has no expiry"

    # Both re-queued by a Retry (a re-queue keeps the dead letter's lack of expiry).
    # The produced item expires; the dead letter, which arrived first and would have
    # expired first under the queue's expire_timeout, is still there after it.
    retry(stubs, "dlq", [i.id for i in lease_now(stubs, "dlq").items])
    wait_until(lambda: b"produced here" not in [i.payload for i in stubs.list_items("dlq")], timeout=EVENTUALLY)
    assert [(i.payload, i.message_id) for i in stubs.list_items("dlq")] == [(b"dead", dead.message_id)]
    (again,) = lease_now(stubs, "dlq").items
    assert again.payload == b"dead" and again.dead_reason == RETRY_DEAD
