"""The lifecycle of items: lease expiry, max_attempts, expiry, scheduling, dead letters, Extend.

API.md, "Lifecycle", "Retry", "Extend", "Ids" and "Details". Every test runs real
servers over real gRPC on real LMDB. Leases last about a second and expiries a few
seconds, and every wait polls with a bounded timeout, so the file stays fast. The
crash tests run ``querator serve`` as a child process and ``kill -9`` it (or let the
``QUERATOR_CRASH_AT`` hook kill it at the worst moment).

Timing on a loaded machine: a wait for something to happen is bounded generously
(``EVENTUALLY``), an upper limit on how late something happened is ``WAKE_LIMIT``
(far below the request timeout it is told apart from), and a check that must run
inside a window of a second or so only judges what it saw before the window closed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from google.protobuf import field_mask_pb2, timestamp_pb2

from querator.v1 import queue_pb2, queues_pb2, storage_pb2

from conftest import ProcessServer, Stubs, ThreadServer, dur, secs, wait_until

OK = grpc.StatusCode.OK
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
# A Complete/Retry/Extend with an id whose lease is gone: NOT_FOUND once the item was
# re-queued under a new id, FAILED_PRECONDITION while it was not yet (API.md, Details).
LEASE_LOST = (NOT_FOUND, PRECONDITION)
# Clock slack between this process and the server when comparing with deadlines.
SLACK = 0.05
# A bound on waiting for the server to do something it is due to do (a re-queue, a
# promotion, a dead-letter hand-over); only a failing test ever waits this long.
EVENTUALLY = 10.0
# How late after its cause a waiting lease may be answered, or a due item promoted,
# and still count as prompt: far below the request timeouts (20 s) and the seconds-long
# gaps the tests tell it apart from, and wide enough for a loaded CI machine.
WAKE_LIMIT = 3.0

# -- helpers -----------------------------------------------------------------------




def ts_at(epoch_seconds: float) -> timestamp_pb2.Timestamp:
    at = timestamp_pb2.Timestamp()
    at.FromMicroseconds(int(epoch_seconds * 1e6))
    return at




def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return OK


def sleep_until(epoch_seconds: float) -> None:
    """Sleep until a wall-clock instant a test computed (always a few seconds at most)."""
    delay = epoch_seconds - time.time()
    assert delay < 10, "tests only ever wait a few seconds"
    if delay > 0:
        time.sleep(delay)


def lead_time(stubs: Stubs, calls: int, least: float = 1.0) -> float:
    """How far ahead to put a due time or deadline so that ``calls`` calls made before it
    surely come first: ``least`` seconds, or on a loaded machine ten times what as many
    small calls take right now."""
    started = time.monotonic()
    for _ in range(calls):
        stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(), timeout=10)
    return max(least, 10 * (time.monotonic() - started))


def create(stubs: Stubs, name: str, *, lease: float = 1, expire: float = 60, **settings: object) -> None:
    stubs.create(name, lease_timeout=dur(lease), expire_timeout=dur(expire), **settings)


def update(stubs: Stubs, name: str, **changes: object) -> None:
    info = queues_pb2.QueueInfo(queue_name=name, **changes)  # type: ignore[arg-type]
    mask = field_mask_pb2.FieldMask(paths=list(changes))
    stubs.queues.UpdateQueue(queues_pb2.UpdateQueueRequest(queue=info, update_mask=mask), timeout=10)


def produce_at(stubs: Stubs, name: str, payloads: list[bytes], at: float) -> list[str]:
    """Produce items scheduled at wall-clock time ``at``; their ids."""
    items = [queue_pb2.ProduceItem(payload=p, enqueue_at=ts_at(at)) for p in payloads]
    response = stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=items), timeout=10)
    return list(response.ids)


def produce_mixed(stubs: Stubs, name: str, items: list[tuple[bytes, float | None]]) -> list[str]:
    """Produce (payload, due time or None for ready at once) pairs in one call; their ids."""
    request = queue_pb2.ProduceRequest(
        queue_name=name,
        items=[
            queue_pb2.ProduceItem(payload=p, enqueue_at=None if at is None else ts_at(at)) for p, at in items
        ],
    )
    return list(stubs.queue.Produce(request, timeout=10).ids)


def lease_now(stubs: Stubs, name: str, batch_size: int = 10, client_id: str = "") -> queue_pb2.LeaseResponse:
    """A Lease that waits only briefly when nothing is ready."""
    return stubs.lease(name, batch_size=batch_size, client_id=client_id, request_timeout=dur(0.2))


def retry(stubs: Stubs, name: str, partition: int, ids: list[str], **kw: object) -> None:
    items = [queue_pb2.RetryItem(id=i, **kw) for i in ids]  # type: ignore[arg-type]
    stubs.queue.Retry(queue_pb2.RetryRequest(queue_name=name, partition=partition, items=items), timeout=10)


def extend(stubs: Stubs, name: str, partition: int, ids: list[str], **kw: object) -> list[float]:
    request = queue_pb2.ExtendRequest(queue_name=name, partition=partition, ids=ids, **kw)  # type: ignore[arg-type]
    return [secs(t) for t in stubs.queue.Extend(request, timeout=10).lease_deadlines]


def partitions_of(stubs: Stubs, name: str) -> int:
    return stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name=name), timeout=10).queue.requested_partitions


def scheduled_items(stubs: Stubs, name: str, partition: int = 0) -> list[storage_pb2.StorageItem]:
    request = storage_pb2.ListScheduledItemsRequest(queue_name=name, partition=partition, page_size=1000)
    return list(stubs.storage.ListScheduledItems(request, timeout=10).items)


def all_items(stubs: Stubs, name: str) -> list[storage_pb2.StorageItem]:
    """Ready and leased items of every partition."""
    return [item for p in range(partitions_of(stubs, name)) for item in stubs.list_items(name, p)]


def payloads(items: object) -> list[bytes]:
    return [i.payload for i in items]  # type: ignore[attr-defined]


def totals(stubs: Stubs, name: str) -> tuple[int, int, int]:
    """(ready + leased, leased, scheduled) over all partitions, from GetQueueStats."""
    parts = stubs.stats(name).partitions
    return sum(p.total for p in parts), sum(p.total_leased for p in parts), sum(p.scheduled for p in parts)


def connect(address: str) -> Stubs:
    return Stubs(grpc.insecure_channel(address))


@pytest.fixture
def proc(data_dir: str) -> Iterator[ProcessServer]:
    """A ``querator serve`` child that the test starts itself (after setting its env)."""
    srv = ProcessServer(data_dir)
    yield srv
    srv.stop()


def wait_for_exit(srv: ProcessServer, timeout: float = 20) -> int:
    assert srv.proc is not None
    wait_until(lambda: srv.proc.poll() is not None, timeout=timeout)  # type: ignore[union-attr]
    return srv.proc.returncode  # type: ignore[union-attr]


# -- lease expiry and ids as fencing tokens --------------------------------------------


def test_expired_lease_goes_back_to_the_tail_with_a_new_id_and_the_same_attempts(stubs: Stubs) -> None:
    create(stubs, "q")
    produced = stubs.produce("q", [b"a", b"b", b"c"]).ids
    first = lease_now(stubs, "q", batch_size=1).items[0]
    assert (first.payload, first.id, first.attempts) == (b"a", produced[0], 1)
    deadline = secs(first.lease_deadline)

    wait_until(lambda: not any(i.is_leased for i in stubs.list_items("q")), timeout=EVENTUALLY)
    assert time.time() >= deadline - SLACK, "re-queued before its lease deadline"
    items = stubs.list_items("q")
    assert payloads(items) == [b"b", b"c", b"a"], "an expired lease goes to the tail"
    requeued = items[2]
    assert requeued.id not in produced, "re-entering the partition gives a new id"
    assert requeued.attempts == 1, "expiry does not add to attempts"
    assert totals(stubs, "q") == (3, 0, 0)

    again = lease_now(stubs, "q", batch_size=3)
    assert payloads(again.items) == [b"b", b"c", b"a"]
    assert [i.attempts for i in again.items] == [1, 1, 2]
    assert again.items[2].id == requeued.id


def test_a_stale_id_can_never_touch_the_re_leased_item(stubs: Stubs) -> None:
    create(stubs, "q")
    stubs.produce("q", [b"job"])
    old = lease_now(stubs, "q", client_id="slow").items[0]
    old_deadline = secs(old.lease_deadline)

    # The second consumer is already waiting when the lease expires; it is woken at once.
    new_response = stubs.lease("q", batch_size=1, client_id="fast", request_timeout=dur(20), timeout=30)
    woke = time.time()
    assert len(new_response.items) == 1
    new = new_response.items[0]
    assert new.payload == b"job" and new.attempts == 2
    assert new.id != old.id
    assert old_deadline - SLACK <= woke < old_deadline + WAKE_LIMIT, "the waiting lease was not woken promptly"

    assert code_of(lambda: stubs.complete("q", 0, [old.id])) == NOT_FOUND
    assert code_of(lambda: retry(stubs, "q", 0, [old.id])) == NOT_FOUND
    assert code_of(lambda: retry(stubs, "q", 0, [old.id], dead=True)) == NOT_FOUND
    assert code_of(lambda: retry(stubs, "q", 0, [old.id], retry_at=ts_at(time.time() + 60))) == NOT_FOUND
    assert code_of(lambda: extend(stubs, "q", 0, [old.id])) in LEASE_LOST

    # The new holder's lease is untouched by all of that.
    (item,) = stubs.list_items("q")
    assert item.id == new.id and item.is_leased and item.attempts == 2
    assert item.lease_deadline == new.lease_deadline
    assert totals(stubs, "q") == (1, 1, 0)
    stubs.complete("q", 0, [new.id])
    assert stubs.list_items("q") == []


def test_a_complete_after_the_lease_deadline_is_applied_whole_or_not_at_all(stubs: Stubs) -> None:
    """A late Complete either removes the item, or fails and leaves it re-queued once."""
    create(stubs, "q")
    stubs.produce("q", [b"a"])
    leased = lease_now(stubs, "q").items[0]
    sleep_until(secs(leased.lease_deadline) + 0.3)
    code = code_of(lambda: stubs.complete("q", 0, [leased.id]))
    items = stubs.list_items("q")
    if code == OK:
        assert items == []
    else:
        assert code in LEASE_LOST
        assert len(items) == 1 and not items[0].is_leased and items[0].id != leased.id


# -- max_attempts ----------------------------------------------------------------------


def test_a_final_attempt_is_not_dead_lettered_before_its_lease_ends(stubs: Stubs) -> None:
    create(stubs, "dlq")
    create(stubs, "q", max_attempts=2, dead_queue="dlq")
    stubs.produce("q", [b"keep", b"drop"])
    assert [i.attempts for i in lease_now(stubs, "q").items] == [1, 1]
    wait_until(lambda: totals(stubs, "q") == (2, 0, 0), timeout=EVENTUALLY)

    final = {i.payload: i for i in lease_now(stubs, "q").items}
    assert [i.attempts for i in final.values()] == [2, 2]
    keep, drop = final[b"keep"], final[b"drop"]
    deadline = secs(drop.lease_deadline)

    def still_held(lease_ends: float) -> None:
        items = {i.id: i for i in stubs.list_items("q")}
        dead = stubs.list_items("dlq")
        if time.time() < lease_ends - SLACK:  # both answers describe the valid lease
            assert drop.id in items and items[drop.id].is_leased, "dead-lettered in the middle of a valid lease"
            assert dead == []

    while time.time() < deadline - 0.5:
        still_held(deadline)
        time.sleep(0.05)
    # A heartbeat keeps the final attempt alive past its first deadline.
    (extended,) = extend(stubs, "q", 0, [drop.id])
    assert extended > deadline
    stubs.complete("q", 0, [keep.id])
    while time.time() < extended - 0.2:
        still_held(extended)
        time.sleep(0.05)

    wait_until(lambda: len(stubs.list_items("dlq")) == 1, timeout=EVENTUALLY)
    assert time.time() >= extended - SLACK
    (dead,) = stubs.list_items("dlq")
    assert dead.payload == b"drop" and dead.source_id == drop.id and dead.attempts == 0
    assert stubs.list_items("q") == [] and totals(stubs, "q") == (0, 0, 0)


def test_retry_of_the_final_attempt_dead_letters_and_retry_dead_moves_at_once(stubs: Stubs) -> None:
    create(stubs, "dlq")
    create(stubs, "q", lease=60, max_attempts=2, dead_queue="dlq")  # no lease may end by itself
    stubs.produce("q", [b"now", b"later", b"dead"])
    first = {i.payload: i for i in lease_now(stubs, "q").items}
    retry(stubs, "q", 0, [first[b"now"].id, first[b"later"].id])
    retry(stubs, "q", 0, [first[b"dead"].id], dead=True)  # on attempt 1 of 2
    wait_until(lambda: len(stubs.list_items("dlq")) == 1, timeout=EVENTUALLY)
    (moved,) = stubs.list_items("dlq")
    assert (moved.payload, moved.source_id, moved.attempts) == (b"dead", first[b"dead"].id, 0)

    second = {i.payload: i for i in lease_now(stubs, "q").items}
    assert sorted(second) == [b"later", b"now"]
    assert all(i.attempts == 2 for i in second.values())
    retry(stubs, "q", 0, [second[b"now"].id])
    retry(stubs, "q", 0, [second[b"later"].id], retry_at=ts_at(time.time() + 60))

    wait_until(lambda: len(stubs.list_items("dlq")) == 3, timeout=EVENTUALLY)
    by_payload = {i.payload: i for i in stubs.list_items("dlq")}
    assert by_payload[b"now"].source_id == second[b"now"].id
    assert by_payload[b"later"].source_id == second[b"later"].id
    assert all(i.attempts == 0 for i in by_payload.values())
    assert stubs.list_items("q") == [] and scheduled_items(stubs, "q") == []
    assert totals(stubs, "q") == (0, 0, 0)


def test_max_attempts_changes_apply_to_stored_items(stubs: Stubs) -> None:
    create(stubs, "dlq")
    create(stubs, "q", lease=60, max_attempts=0, dead_queue="dlq")  # no lease may end by itself
    stubs.produce("q", [b"ready", b"held"])
    for attempt in (1, 2):
        leased = {i.payload: i for i in lease_now(stubs, "q").items}
        assert [i.attempts for i in leased.values()] == [attempt, attempt]
        if attempt == 1:
            retry(stubs, "q", 0, [i.id for i in leased.values()])
    retry(stubs, "q", 0, [leased[b"ready"].id])  # ready again with 2 attempts used
    held = leased[b"held"]  # still leased, on attempt 2

    # Lowered to 2: the stored ready item has used its attempts and is never leased again.
    update(stubs, "q", max_attempts=2)
    assert list(lease_now(stubs, "q").items) == []
    wait_until(lambda: payloads(stubs.list_items("dlq")) == [b"ready"], timeout=EVENTUALLY)

    # Raised to 3 while leased: the retry of attempt 2 is no longer the last one.
    update(stubs, "q", max_attempts=3)
    retry(stubs, "q", 0, [held.id])
    third = lease_now(stubs, "q").items
    assert payloads(third) == [b"held"] and third[0].attempts == 3
    retry(stubs, "q", 0, [third[0].id])  # the third of 3: dead-lettered
    wait_until(lambda: sorted(payloads(stubs.list_items("dlq"))) == [b"held", b"ready"], timeout=EVENTUALLY)
    assert stubs.list_items("q") == []


def test_without_a_dead_letter_queue_items_are_deleted_with_a_log_line(proc: ProcessServer) -> None:
    proc.start()
    stubs = connect(proc.address)
    try:
        create(stubs, "q", max_attempts=1)
        stubs.produce("q", [b"retried", b"dead", b"expired"])
        leased = {i.payload: i for i in lease_now(stubs, "q").items}
        retry(stubs, "q", 0, [leased[b"retried"].id])
        retry(stubs, "q", 0, [leased[b"dead"].id], dead=True, error="KeyError: 'account'")
        assert payloads(stubs.list_items("q")) == [b"expired"]
        wait_until(lambda: stubs.list_items("q") == [], timeout=EVENTUALLY)  # its lease ends
        assert totals(stubs, "q") == (0, 0, 0)
        assert list(lease_now(stubs, "q").items) == []
    finally:
        stubs.channel.close()
    proc.terminate()
    lines = proc.stderr_text().splitlines()
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    dropped = {e.get("item_id"): e for e in events if e.get("event") == "item_dropped"}
    for item in leased.values():
        assert item.id in dropped, f"no item_dropped log line for {item.id}: {lines}"
        assert dropped[item.id].get("queue") == "q"
        assert dropped[item.id].get("reason")
    # What went wrong is in the line too: all that is left of the item.
    assert dropped[leased[b"dead"].id].get("error") == "KeyError: 'account'"
    assert dropped[leased[b"expired"].id].get("error") == "lease expired after 1 attempt"


# -- expire_timeout ----------------------------------------------------------------------


def test_an_unleased_expired_item_lands_once_in_the_dlq_and_never_in_the_source(data_dir: str) -> None:
    srv = ThreadServer(data_dir)
    stubs = connect(srv.address)
    try:
        create(stubs, "dlq", expire=3600, requested_partitions=2)
        create(stubs, "q", lease=1, expire=1.5, dead_queue="dlq")
        produced_at = time.time()
        ids = list(stubs.produce("q", [b"a", b"b", b"c"]).ids)
        wait_until(lambda: totals(stubs, "dlq")[0] == 3, timeout=EVENTUALLY)
        assert time.time() >= produced_at + 1.5 - SLACK, "dead-lettered before it expired"
        # Expired: never leased again, gone from the source.
        assert list(lease_now(stubs, "q").items) == []
        assert stubs.list_items("q") == [] and totals(stubs, "q") == (0, 0, 0)

        def check_dlq() -> None:
            dead = all_items(stubs, "dlq")
            assert sorted(i.source_id for i in dead) == sorted(ids), "each item exactly once"
            assert sorted(payloads(dead)) == [b"a", b"b", b"c"]
            assert all(i.attempts == 0 and not i.is_leased for i in dead)
            assert all(i.id not in ids for i in dead)
            # Neither the source's expiry nor the DLQ's: a dead letter stays until removed.
            assert not any(i.HasField("expire_deadline") for i in dead)

        check_dlq()
        time.sleep(1.2)  # longer than the outbox's resend interval: still no second copy
        check_dlq()
    finally:
        stubs.channel.close()
        srv.stop()
    # After a restart the outbox holds nothing that could come back.
    srv = ThreadServer(data_dir)
    stubs = connect(srv.address)
    try:
        time.sleep(0.3)
        check_dlq()
        assert stubs.list_items("q") == [] and totals(stubs, "q") == (0, 0, 0)
    finally:
        stubs.channel.close()
        srv.stop()


def test_an_item_that_expires_during_its_lease_is_dead_lettered_when_the_lease_ends(stubs: Stubs) -> None:
    create(stubs, "dlq")
    half = lead_time(stubs, 4, least=0.9)  # the four calls in the window between expiry and lease end
    create(stubs, "q", lease=2 * half, expire=2 * half, dead_queue="dlq")
    stubs.produce("q", [b"done", b"dead"])
    # Lease halfway through the items' life: the lease then ends ``half`` after they expire.
    sleep_until(secs(stubs.list_items("q")[0].expire_deadline) - half)
    leased = {i.payload: i for i in lease_now(stubs, "q").items}
    done, dead = leased[b"done"], leased[b"dead"]
    stored = {i.id: i for i in stubs.list_items("q")}
    expires, lease_ends = secs(stored[dead.id].expire_deadline), secs(dead.lease_deadline)
    assert lease_ends > expires + half - SLACK

    sleep_until(expires + 0.1)
    # Expired but still validly leased: not dead-lettered, not extendable, completable.
    listed = stubs.list_items("q")
    dead_letters = stubs.list_items("dlq")
    extend_code = code_of(lambda: extend(stubs, "q", 0, [dead.id]))
    stubs.complete("q", 0, [done.id])
    assert time.time() < lease_ends - SLACK, "these checks ran past the end of the lease"
    assert len(listed) == 2 and all(i.is_leased for i in listed)
    assert dead_letters == []
    assert extend_code == PRECONDITION

    wait_until(lambda: len(stubs.list_items("dlq")) == 1, timeout=EVENTUALLY)
    assert time.time() >= lease_ends - SLACK, "dead-lettered in the middle of a valid lease"
    (moved,) = stubs.list_items("dlq")
    assert (moved.payload, moved.source_id, moved.attempts) == (b"dead", dead.id, 0)
    assert stubs.list_items("q") == [] and totals(stubs, "q") == (0, 0, 0)


def test_a_scheduled_item_whose_expiry_comes_first_is_dead_lettered_not_enqueued(stubs: Stubs) -> None:
    create(stubs, "dlq")
    life = lead_time(stubs, 6, least=1.2)  # the calls up to the totals check come before any expiry
    create(stubs, "q", lease=1, expire=life, dead_queue="dlq")
    start = time.time()
    due = start + life + 0.8  # after both items expire
    (scheduled_id,) = produce_at(stubs, "q", [b"produced"], due)
    stubs.produce("q", [b"retried"])
    leased = lease_now(stubs, "q").items[0]
    retry(stubs, "q", 0, [leased.id], retry_at=ts_at(due))
    sched = {i.payload: i for i in scheduled_items(stubs, "q")}
    assert sorted(sched) == [b"produced", b"retried"] and sched[b"produced"].id == scheduled_id
    assert totals(stubs, "q") == (0, 0, 2)

    deadline = time.monotonic() + EVENTUALLY
    while len(stubs.list_items("dlq")) < 2:
        assert stubs.list_items("q") == [], "an expired scheduled item was enqueued"
        assert time.monotonic() < deadline, "expired scheduled items never reached the DLQ"
        time.sleep(0.05)
    moved = {i.payload: i for i in stubs.list_items("dlq")}
    assert moved[b"produced"].source_id == scheduled_id
    assert moved[b"retried"].source_id == sched[b"retried"].id
    sleep_until(due + 0.2)  # past the due time too
    assert stubs.list_items("q") == [] and scheduled_items(stubs, "q") == []
    assert totals(stubs, "q") == (0, 0, 0)
    assert len(stubs.list_items("dlq")) == 2


# -- Extend ------------------------------------------------------------------------------


def test_extend_moves_the_deadline_all_or_nothing_and_never_past_expiry(stubs: Stubs) -> None:
    create(stubs, "q", lease=1, expire=5)
    stubs.produce("q", [b"a", b"b"])
    leased = {i.payload: i for i in lease_now(stubs, "q").items}
    a, b = leased[b"a"], leased[b"b"]
    first_deadline = secs(a.lease_deadline)

    # Both extended at once, well before the first deadline; b is capped at its expiry.
    (b_deadline,) = extend(stubs, "q", 0, [b.id], lease_timeout=dur(600))
    before = time.time()
    (a_deadline,) = extend(stubs, "q", 0, [a.id], lease_timeout=dur(2))
    assert before + 2 - SLACK <= a_deadline <= time.time() + 2 + SLACK

    # One bad id: nothing is extended.
    assert code_of(lambda: extend(stubs, "q", 0, [a.id, "not-an-id"], lease_timeout=dur(3))) == NOT_FOUND
    stored = {i.id: i for i in stubs.list_items("q")}
    assert secs(stored[a.id].lease_deadline) == pytest.approx(a_deadline, abs=1e-6)
    assert secs(stored[b.id].lease_deadline) == pytest.approx(b_deadline, abs=1e-6)
    assert b_deadline == pytest.approx(secs(stored[b.id].expire_deadline), abs=1e-6)

    # Past the first deadline both leases still hold, under the same ids.
    sleep_until(first_deadline + 0.2)
    stored = {i.id: i for i in stubs.list_items("q")}
    assert set(stored) == {a.id, b.id} and all(i.is_leased for i in stored.values())

    # After the extended deadline the lease is gone; Extend then fails and changes nothing.
    wait_until(lambda: a.id not in {i.id for i in stubs.list_items("q")}, timeout=EVENTUALLY)
    assert time.time() >= a_deadline - SLACK
    assert code_of(lambda: extend(stubs, "q", 0, [a.id])) in LEASE_LOST
    requeued = [i for i in stubs.list_items("q") if i.payload == b"a"]
    assert len(requeued) == 1 and not requeued[0].is_leased

    # The default is the queue's lease_timeout.
    before = time.time()
    (b_again,) = extend(stubs, "q", 0, [b.id])
    assert before + 1 - SLACK <= b_again <= time.time() + 1 + SLACK


# -- scheduled items -----------------------------------------------------------------------


def test_items_scheduled_at_different_times_all_promote_in_due_then_produce_order(stubs: Stubs) -> None:
    create(stubs, "q", expire=600)
    first = time.time() + lead_time(stubs, 9, least=0.8)  # the 9 calls up to the promotion watch come first
    stubs.produce("q", [b"r0"])
    far = produce_at(stubs, "q", [b"far"], first + 300)  # minutes away: must not hold the others back
    late = produce_at(stubs, "q", [b"late"], first + 1.2)
    mid = produce_at(stubs, "q", [b"mid"], first + 0.6)
    early = produce_at(stubs, "q", [b"early1", b"early2"], first)
    stubs.produce("q", [b"r1"])
    due = {b"early1": first, b"early2": first, b"mid": first + 0.6, b"late": first + 1.2}

    # Scheduled: counted, listed by due time, not leasable, not in ListItems.
    assert totals(stubs, "q") == (2, 0, 5)
    listed = scheduled_items(stubs, "q")
    assert payloads(listed) == [b"early1", b"early2", b"mid", b"late", b"far"]
    assert [i.id for i in listed] == early + mid + late + far
    assert [secs(i.enqueue_at) for i in listed] == pytest.approx([*due.values(), first + 300], abs=2e-6)
    assert payloads(stubs.list_items("q")) == [b"r0", b"r1"]

    # When each item became ready lies between the start of the last listing that did
    # not show it and the end of the first one that did.
    seen: dict[bytes, tuple[float, float]] = {}  # payload -> (not ready at, ready by)
    asked = time.time()
    deadline = time.monotonic() + EVENTUALLY
    while not due.keys() <= seen.keys():
        assert time.monotonic() < deadline, f"only {sorted(seen)} ready"
        previous, asked = asked, time.time()
        ready = payloads(stubs.list_items("q"))
        answered = time.time()
        for payload in ready:
            seen.setdefault(payload, (previous, answered))
        time.sleep(0.02)
    for payload, at in due.items():
        not_ready_at, ready_by = seen[payload]
        assert ready_by >= at - SLACK, f"{payload!r} promoted early"
        # Late means after the next due time came round: promoted by its own timer, not with others.
        assert not_ready_at < at + 1.0, f"{payload!r} promoted late"

    items = stubs.list_items("q")
    assert payloads(items) == [b"r0", b"r1", b"early1", b"early2", b"mid", b"late"]
    scheduled_ids = set(early + mid + late)
    assert not scheduled_ids & {i.id for i in items}, "promotion gives a new id"
    assert payloads(scheduled_items(stubs, "q")) == [b"far"] and scheduled_items(stubs, "q")[0].id == far[0]
    assert totals(stubs, "q") == (6, 0, 1)
    assert [i.attempts for i in lease_now(stubs, "q").items] == [0 + 1] * 6


def test_more_due_items_than_one_cycle_handles_all_promote(stubs: Stubs) -> None:
    create(stubs, "q", expire=600)
    at = time.time() + lead_time(stubs, 10, least=0.5)  # two large produces and a check come first
    names = [f"{n:04d}".encode() for n in range(1500)]
    produce_at(stubs, "q", names[:1000], at)
    produce_at(stubs, "q", names[1000:], at)
    assert totals(stubs, "q") == (0, 0, 1500)
    wait_until(lambda: totals(stubs, "q") == (1500, 0, 0), timeout=EVENTUALLY)
    assert payloads(stubs.list_items("q", page_size=1000)) == names[:1000]


def test_a_waiting_lease_wakes_when_a_scheduled_item_becomes_ready(stubs: Stubs) -> None:
    create(stubs, "q")
    due = time.time() + 0.2 + lead_time(stubs, 3, least=0.6)  # a produce and a 0.2 s lease come first
    (scheduled_id,) = produce_at(stubs, "q", [b"soon"], due)
    assert list(lease_now(stubs, "q").items) == [], "a scheduled item is not leasable"
    response = stubs.lease("q", batch_size=1, request_timeout=dur(20), timeout=30)
    woke = time.time()
    assert payloads(response.items) == [b"soon"]
    assert response.items[0].id != scheduled_id
    assert due - SLACK <= woke < due + WAKE_LIMIT, "the waiting lease was not woken when the item became ready"


def test_retry_at_schedules_the_item_in_its_own_partition_and_ids_change(stubs: Stubs) -> None:
    create(stubs, "q", lease=60, requested_partitions=2)
    stubs.produce("q", [b"p0"])
    produced = stubs.produce("q", [b"x", b"y"])
    assert produced.partition == 1
    leased = lease_now(stubs, "q", batch_size=1)
    assert leased.partition == 1 and leased.items[0].payload == b"x"
    x = leased.items[0]
    due = time.time() + lead_time(stubs, 6, least=0.6)  # the retry and the checks below come first
    retry(stubs, "q", 1, [x.id], retry_at=ts_at(due))

    (sched,) = scheduled_items(stubs, "q", 1)
    assert sched.payload == b"x" and sched.attempts == 1
    assert scheduled_items(stubs, "q", 0) == []
    assert payloads(stubs.list_items("q", 1)) == [b"y"]
    assert [(p.scheduled, p.total) for p in stubs.stats("q").partitions] == [(0, 1), (1, 1)]
    assert x.id == produced.ids[0]
    ids = {sched.id} | set(produced.ids)
    assert len(ids) == 3, "a retried item gets a new id"

    wait_until(lambda: payloads(stubs.list_items("q", 1)) == [b"y", b"x"], timeout=EVENTUALLY)
    assert time.time() >= due - SLACK
    promoted = stubs.list_items("q", 1)[1]
    assert promoted.id not in ids, "promotion gives a new id"
    assert promoted.attempts == 1
    assert scheduled_items(stubs, "q", 1) == [] and stubs.list_items("q", 0)[0].payload == b"p0"

    # An immediate retry goes to the tail of the same partition, with yet another id.
    leased = lease_now(stubs, "q", batch_size=2)
    assert leased.partition == 1 and payloads(leased.items) == [b"y", b"x"]
    assert leased.items[1].id == promoted.id and leased.items[1].attempts == 2
    assert stubs.produce("q", [b"z"]).partition == 1  # the partition with fewest ready items
    retry(stubs, "q", 1, [leased.items[1].id])
    tail = stubs.list_items("q", 1)[-1]
    assert tail.payload == b"x" and not tail.is_leased and tail.attempts == 2
    assert tail.id not in ids | {promoted.id}


# -- restarts and crashes ------------------------------------------------------------------


def test_everything_due_while_down_is_handled_at_start_and_scheduled_items_survive_kill9(
    proc: ProcessServer,
) -> None:
    proc.start()
    stubs = connect(proc.address)
    try:
        create(stubs, "dlq")
        create(stubs, "later", expire=600)
        # Every lease, expiry and due time set from t0 on must pass while the server is
        # down, so the five calls that set them must all come before the kill: they get a
        # window sized from how fast this machine answers right now.
        window = lead_time(stubs, 5, least=1.0)
        create(stubs, "q", lease=window, expire=60, dead_queue="dlq")
        create(stubs, "short", lease=window, expire=window, max_attempts=1, dead_queue="dlq")
        t0 = time.time()
        down_until = t0 + 2 * window + 0.2  # past every deadline set below
        # Scheduled before the crash, due after the restart at doubling intervals: however
        # long the restart takes, the later ones are still ahead when it is done.
        later_due = [down_until + 1.5 * 2**k for k in range(6)]
        later = produce_mixed(stubs, "later", [(f"later-{k}".encode(), at) for k, at in enumerate(later_due)])
        s1, s2, far, _ = produce_mixed(
            stubs, "q", [(b"s1", t0 + window), (b"s2", t0 + window + 0.2), (b"far", t0 + 300), (b"leased", None)]
        )
        held = lease_now(stubs, "q").items[0]
        final, gone, sched_gone = produce_mixed(
            stubs, "short", [(b"final-attempt", None), (b"gone", None), (b"sched-gone", t0 + 2 * window)]
        )  # sched-gone expires before it is due
        assert [i.id for i in lease_now(stubs, "short", batch_size=1).items] == [final]
    finally:
        stubs.channel.close()
    proc.kill9()
    # The earliest deadline is t0 + window: s1's due time; leases and expiries count from later.
    assert time.time() < t0 + window - SLACK, f"five calls took longer than their {window:.1f}s window"
    sleep_until(down_until)

    proc.start()
    stubs = connect(proc.address)
    try:
        # Right after start: both due items promoted, the lease re-queued, the expired
        # items dead-lettered (the DLQ hand-over may wait one resend interval, a second).
        wait_until(lambda: sorted(payloads(stubs.list_items("q"))) == [b"leased", b"s1", b"s2"], timeout=WAKE_LIMIT)
        items = stubs.list_items("q")
        assert payloads(items).index(b"s1") < payloads(items).index(b"s2")
        assert not any(i.is_leased for i in items)
        requeued = next(i for i in items if i.payload == b"leased")
        assert requeued.id != held.id and requeued.attempts == 1
        assert not {i.id for i in items} & {s1, s2}, "promotion gives a new id"
        assert [i.id for i in scheduled_items(stubs, "q")] == [far]
        assert totals(stubs, "q") == (3, 0, 1)

        wait_until(lambda: len(stubs.list_items("dlq")) == 3, timeout=WAKE_LIMIT + 1)
        assert sorted(i.source_id for i in stubs.list_items("dlq")) == sorted([final, gone, sched_gone])
        assert stubs.list_items("short") == [] and totals(stubs, "short") == (0, 0, 0)

        # The items of "later" still ahead are scheduled under the ids they had before the
        # crash; the next one is promoted on time, by the server's own timer.
        pending = {i.id for i in scheduled_items(stubs, "later")}
        listed = time.time()
        ahead = [(item_id, at) for item_id, at in zip(later, later_due, strict=True) if at > listed + SLACK]
        assert ahead, "the restart took longer than the latest due time"
        assert {item_id for item_id, _ in ahead} <= pending, "a scheduled item was lost or promoted early"
        next_id, next_due = ahead[0]
        wait_until(
            lambda: next_id not in {i.id for i in scheduled_items(stubs, "later")},
            timeout=next_due - time.time() + WAKE_LIMIT,
        )
        assert time.time() >= next_due - SLACK, "promoted early"
        payload = f"later-{later.index(next_id)}".encode()
        promoted = [i for i in stubs.list_items("later") if i.payload == payload]
        assert len(promoted) == 1 and promoted[0].id != next_id, "promotion gives a new id"
        still_ahead = {item_id for item_id, at in ahead if at > time.time() + SLACK}
        assert still_ahead <= {i.id for i in scheduled_items(stubs, "later")}
        assert [i.id for i in scheduled_items(stubs, "q")] == [far]
        assert len(stubs.list_items("dlq")) == 3
    finally:
        stubs.channel.close()


def _dead_letter_all(stubs: Stubs, name: str) -> dict[str, bytes]:
    leased = lease_now(stubs, name, batch_size=100)
    retry(stubs, name, leased.partition, [i.id for i in leased.items], dead=True)
    return {i.id: i.payload for i in leased.items}


def test_kill9_between_the_dlq_write_and_the_source_delete_leaves_exactly_one_copy(
    proc: ProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUERATOR_CRASH_AT", "dead-letter-stored")
    proc.start()
    stubs = connect(proc.address)
    try:
        # The DLQ sorts (and so starts) first: the resend after the restart is immediate.
        create(stubs, "dead", requested_partitions=2)
        create(stubs, "work", dead_queue="dead")
        stubs.produce("work", [b"a", b"b", b"c"])
        sent = _dead_letter_all(stubs, "work")
    finally:
        stubs.channel.close()
    assert wait_for_exit(proc) == -9, "the crash hook did not fire"

    monkeypatch.delenv("QUERATOR_CRASH_AT")
    proc.start()
    stubs = connect(proc.address)
    try:
        # One more dead letter queued behind the re-sent ones: once it arrived, they were re-sent.
        stubs.produce("work", [b"marker"])
        sent.update(_dead_letter_all(stubs, "work"))
        wait_until(lambda: b"marker" in payloads(all_items(stubs, "dead")), timeout=EVENTUALLY)
        dead = all_items(stubs, "dead")
        assert sorted(i.source_id for i in dead) == sorted(sent), "a dead letter was duplicated or lost"
        assert {i.source_id: i.payload for i in dead} == sent
        assert all(i.attempts == 0 for i in dead)
        assert all_items(stubs, "work") == [] and totals(stubs, "work") == (0, 0, 0)
        assert totals(stubs, "dead")[0] == 4
    finally:
        stubs.channel.close()


def test_a_dead_letter_consumed_before_the_resend_after_a_crash_is_not_sent_again(
    proc: ProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUERATOR_CRASH_AT", "dead-letter-stored")
    proc.start()
    stubs = connect(proc.address)
    try:
        # The source sorts (and so starts) before its DLQ.
        create(stubs, "z-dead")
        create(stubs, "a-work", dead_queue="z-dead")
        stubs.produce("a-work", [b"once"])
        sent = _dead_letter_all(stubs, "a-work")
    finally:
        stubs.channel.close()
    assert wait_for_exit(proc) == -9, "the crash hook did not fire"

    monkeypatch.delenv("QUERATOR_CRASH_AT")
    proc.start()
    stubs = connect(proc.address)
    try:
        # A consumer of the DLQ handles the dead letter as soon as the server is back.
        copy = lease_now(stubs, "z-dead").items
        assert payloads(copy) == [b"once"]
        stubs.complete("z-dead", 0, [copy[0].id])

        stubs.produce("a-work", [b"marker"])
        sent.update(_dead_letter_all(stubs, "a-work"))
        wait_until(lambda: b"marker" in payloads(all_items(stubs, "z-dead")), timeout=EVENTUALLY)
        assert payloads(all_items(stubs, "z-dead")) == [b"marker"], "the consumed dead letter came back"
    finally:
        stubs.channel.close()


def test_scheduled_produces_spread_over_partitions_by_their_scheduled_counts(stubs: Stubs) -> None:
    """ADR 24: scheduled items are distributed like ready ones, counted on their own.
    Eight produces of ten scheduled items on four partitions: twenty in each, not all
    eighty in the partition that has the fewest ready items."""
    create(stubs, "q", expire=600, requested_partitions=4)
    stubs.produce("q", [b"ready"] * 3)  # ready items elsewhere do not steer scheduled ones
    due = time.time() + 300
    for n in range(8):
        produce_at(stubs, "q", [b"s%d" % n] * 10, due)
    per_partition = [p.scheduled for p in stubs.stats("q").partitions]
    assert per_partition == [20, 20, 20, 20]
    assert sum(len(scheduled_items(stubs, "q", p)) for p in range(4)) == 80
