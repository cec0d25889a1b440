"""LeaseRequest.columnar: the same leases, answered as parallel lists (LeaseColumns)."""

from __future__ import annotations

import time

from querator.v1 import queue_pb2

from conftest import Stubs, dur

SECOND_US = 1_000_000


def _mixed_items() -> list[queue_pb2.ProduceItem]:
    return [
        queue_pb2.ProduceItem(payload=b"plain"),
        queue_pb2.ProduceItem(payload=b"typed", kind="order", encoding="application/json"),
        queue_pb2.ProduceItem(payload=b"", reference="ref-3", metadata={"traceparent": "00-ab-cd-01"}),
        queue_pb2.ProduceItem(payload=b"\x00\xff" * 100),
    ]


def test_columns_carry_what_items_would(stubs: Stubs) -> None:
    for name in ("rows", "cols"):
        stubs.create(name, lease_timeout=dur(30))
        stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=_mixed_items()), timeout=10)
    rows = stubs.lease("rows", batch_size=10, request_timeout=dur(0))
    before_us = int(time.time() * SECOND_US)
    cols = stubs.lease("cols", batch_size=10, request_timeout=dur(0), columnar=True)
    after_us = int(time.time() * SECOND_US)

    assert len(rows.items) == 4 and not rows.HasField("columns")
    assert not cols.items and cols.partition == rows.partition
    c = cols.columns
    assert list(c.payloads) == [item.payload for item in rows.items]
    assert list(c.kinds) == [item.kind for item in rows.items]
    assert list(c.encodings) == [item.encoding for item in rows.items]
    assert list(c.references) == [item.reference for item in rows.items]
    assert [dict(m.entries) for m in c.metadata] == [dict(item.metadata) for item in rows.items]
    assert list(c.attempts) == [1, 1, 1, 1]
    assert all(before_us + 29 * SECOND_US <= us <= after_us + 31 * SECOND_US for us in c.lease_deadlines_us)

    # The ids and creation times are the stored items', oldest first, and they complete.
    stored = stubs.list_items("cols")
    assert list(c.ids) == [item.id for item in stored]
    assert list(c.created_at_us) == [item.created_at.ToMicroseconds() for item in stored]
    assert all(item.is_leased for item in stored)
    stubs.complete("cols", cols.partition, list(c.ids))
    assert stubs.list_items("cols") == []


def test_payload_only_batches_leave_the_optional_columns_empty(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"a", b"b", b"c"])
    c = stubs.lease("q", batch_size=10, request_timeout=dur(0), columnar=True).columns
    assert list(c.payloads) == [b"a", b"b", b"c"] and len(c.ids) == len(c.attempts) == len(c.created_at_us) == 3
    assert (list(c.kinds), list(c.encodings), list(c.references), list(c.metadata)) == ([], [], [], [])


def test_a_keyed_columnar_lease_replays_the_same_items(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"%d" % i for i in range(5)])
    first = stubs.lease("q", batch_size=3, lease_key="batch-7", columnar=True)
    again = stubs.lease("q", batch_size=3, lease_key="batch-7", columnar=True)
    as_items = stubs.lease("q", batch_size=3, lease_key="batch-7")
    assert list(first.columns.ids) == list(again.columns.ids) == [item.id for item in as_items.items]
    assert list(first.columns.payloads) == [b"0", b"1", b"2"]


def test_nothing_ready_answers_empty_columns(stubs: Stubs) -> None:
    stubs.create("q")
    reply = stubs.lease("q", batch_size=10, request_timeout=dur(0.05), columnar=True)
    assert not reply.items and not reply.columns.ids


def test_leased_items_carry_their_own_attempts_deadline_and_creation_time(stubs: Stubs) -> None:
    # Items created one by one and in batches, some leased before (more attempts), some
    # with details: every item of one reply must carry exactly what is stored for it,
    # however the reply shares the bytes of equal attempts, deadlines and creation times.
    stubs.create("stamps", lease_timeout=dur(30))
    for n in range(3):
        stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="stamps", items=[queue_pb2.ProduceItem(payload=b"one-%d" % n)]), timeout=10)
        time.sleep(0.002)  # a creation time of its own
    for _ in range(2):
        stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="stamps", items=_mixed_items()), timeout=10)
    first = stubs.lease("stamps", batch_size=2, request_timeout=dur(0))
    retry = [queue_pb2.RetryItem(id=item.id) for item in first.items]
    stubs.queue.Retry(queue_pb2.RetryRequest(queue_name="stamps", partition=first.partition, items=retry), timeout=10)

    reply = stubs.lease("stamps", batch_size=100, request_timeout=dur(0))
    stored = {item.id: item for item in stubs.list_items("stamps")}
    assert len(reply.items) == len(stored) == 11
    assert sorted(item.attempts for item in reply.items) == [1] * 9 + [2] * 2
    assert len({item.created_at.ToMicroseconds() for item in reply.items}) >= 4
    for item in reply.items:
        want = stored[item.id]
        assert want.is_leased
        assert item.attempts == want.attempts
        assert item.lease_deadline == want.lease_deadline
        assert item.created_at == want.created_at
        assert (item.payload, item.kind, item.encoding, item.reference) == (want.payload, want.kind, want.encoding, want.reference)
        assert dict(item.metadata) == dict(want.metadata)
