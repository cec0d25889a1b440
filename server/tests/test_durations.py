"""Every duration and future time a caller gives has a documented maximum, so every
time the server computes from one stays a valid Timestamp; and a duration shorter than
the server's microsecond resolution is refused instead of read as 0 ("the default")."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf import field_mask_pb2, timestamp_pb2

from querator.v1 import queue_pb2, queues_pb2, storage_pb2
from querator_server.storage.local_catalog import Catalog

from conftest import Stubs, ThreadServer, bad_request_fields, dur

HOUR = 3600
YEAR = 365 * 24 * HOUR
MILLENNIA = 8000 * YEAR


def _invalid(call: object, *args: object, **kw: object) -> list[str]:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kw)  # type: ignore[operator]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return bad_request_fields(err.value)


def _at(seconds_from_now: float) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=int(time.time() + seconds_from_now))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lease_timeout", dur(MILLENNIA)),
        ("lease_timeout", dur(24 * HOUR, 1000)),
        ("expire_timeout", dur(MILLENNIA)),
        ("expire_timeout", dur(10 * YEAR + 1)),
        ("dedup_window", dur(10 * YEAR + 1)),
        ("lease_key_ttl", dur(10 * YEAR + 1)),
        ("expire_timeout", dur(0, 1)),
        ("lease_timeout", dur(0, 999)),
        ("dedup_window", dur(0, 1)),
    ],
)
def test_queue_durations_beyond_their_maximum_or_below_a_microsecond_are_invalid(
    stubs: Stubs, field: str, value: object
) -> None:
    settings = {field: value}
    if field == "lease_timeout":
        settings["expire_timeout"] = dur(10 * YEAR)
    assert _invalid(stubs.create, "q", **settings) == [f"queue.{field}"]
    stubs.create("q")
    update = queues_pb2.UpdateQueueRequest(
        queue=queues_pb2.QueueInfo(queue_name="q", **{field: value}),
        update_mask=field_mask_pb2.FieldMask(paths=[field]),
    )
    assert _invalid(stubs.queues.UpdateQueue, update, timeout=10) == [f"queue.{field}"]


def test_the_longest_durations_allowed_give_valid_deadlines(stubs: Stubs) -> None:
    info = stubs.create(
        "q",
        lease_timeout=dur(24 * HOUR),
        expire_timeout=dur(10 * YEAR),
        dedup_window=dur(10 * YEAR),
        lease_key_ttl=dur(10 * YEAR),
    )
    assert info.lease_timeout.seconds == 24 * HOUR
    assert info.expire_timeout.seconds == 10 * YEAR
    stubs.produce("q", [b"a", b"b"])
    leased = stubs.lease("q", batch_size=2)
    now = time.time()
    for item in leased.items:
        # What the SDK does with it: a datetime, not an OverflowError.
        assert item.lease_deadline.ToDatetime().year < 10_000
        assert abs(item.lease_deadline.seconds - (now + 24 * HOUR)) < 60
    extended = stubs.queue.Extend(
        queue_pb2.ExtendRequest(queue_name="q", partition=0, ids=[leased.items[0].id], lease_timeout=dur(24 * HOUR)),
        timeout=10,
    )
    assert abs(extended.lease_deadlines[0].seconds - (now + 24 * HOUR)) < 60
    stored = stubs.list_items("q")
    assert all(abs(s.expire_deadline.seconds - (now + 10 * YEAR)) < 60 for s in stored)


def test_extend_beyond_24_hours_is_invalid_and_changes_nothing(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(30))
    stubs.produce("q", [b"a"])
    item = stubs.lease("q", batch_size=1).items[0]
    for value in (dur(MILLENNIA), dur(24 * HOUR + 1), dur(0, 5)):
        request = queue_pb2.ExtendRequest(queue_name="q", partition=0, ids=[item.id], lease_timeout=value)
        assert _invalid(stubs.queue.Extend, request, timeout=10) == ["lease_timeout"]
    assert stubs.list_items("q")[0].lease_deadline == item.lease_deadline


def test_schedules_more_than_10_years_ahead_are_invalid(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(30))
    far = queue_pb2.ProduceItem(payload=b"x", enqueue_at=_at(10 * YEAR + 3600))
    request = queue_pb2.ProduceRequest(queue_name="q", items=[queue_pb2.ProduceItem(payload=b"ok"), far])
    assert _invalid(stubs.queue.Produce, request, timeout=10) == ["items[1].enqueue_at"]
    near = queue_pb2.ProduceItem(payload=b"x", enqueue_at=_at(10 * YEAR - 3600))
    assert len(stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="q", items=[near]), timeout=10).ids) == 1

    stubs.produce("q", [b"r"])
    item = stubs.lease("q", batch_size=1, request_timeout=dur(0)).items[0]
    retry = queue_pb2.RetryRequest(
        queue_name="q", partition=0, items=[queue_pb2.RetryItem(id=item.id, retry_at=_at(100 * YEAR))]
    )
    assert _invalid(stubs.queue.Retry, retry, timeout=10) == ["items[0].retry_at"]
    assert stubs.stats("q").partitions[0].total_leased == 1  # the refused retry changed nothing


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lease_deadline", _at(24 * HOUR + 3600)),
        ("expire_deadline", _at(10 * YEAR + 3600)),
        ("enqueue_at", _at(100 * YEAR)),
    ],
)
def test_imported_times_beyond_their_maximum_are_invalid(stubs: Stubs, field: str, value: object) -> None:
    stubs.create("q")
    item = storage_pb2.StorageItem(payload=b"x", is_leased=field == "lease_deadline", **{field: value})
    request = storage_pb2.ImportItemsRequest(queue_name="q", items=[storage_pb2.StorageItem(payload=b"ok"), item])
    assert _invalid(stubs.storage.ImportItems, request, timeout=10) == [f"items[1].{field}"]
    assert stubs.stats("q").partitions[0].total == 0


def test_a_request_timeout_below_a_microsecond_is_invalid_not_unlimited(stubs: Stubs) -> None:
    stubs.create("q")
    produce = queue_pb2.ProduceRequest(
        queue_name="q", items=[queue_pb2.ProduceItem(payload=b"x")], request_timeout=dur(0, 1)
    )
    assert _invalid(stubs.queue.Produce, produce, timeout=10) == ["request_timeout"]
    lease = queue_pb2.LeaseRequest(queue_name="q", batch_size=1, request_timeout=dur(0, 1))
    assert _invalid(stubs.queue.Lease, lease, timeout=10) == ["request_timeout"]
    assert stubs.stats("q").partitions[0].total == 0


def test_settings_stored_before_the_maximums_are_held_to_them(data_dir: str) -> None:
    srv = ThreadServer(data_dir)
    channel = grpc.insecure_channel(srv.address)
    try:
        Stubs(channel).create("q")
    finally:
        channel.close()
        srv.stop()
    # What an older server accepted: a lease of 8,000 years.
    catalog = Catalog(f"{data_dir}/catalog")
    (config,) = catalog.load()
    catalog.put(config.replace(lease_timeout_us=MILLENNIA * 1_000_000, expire_timeout_us=MILLENNIA * 1_000_000))
    catalog.env.close()

    srv = ThreadServer(data_dir)
    channel = grpc.insecure_channel(srv.address)
    try:
        stubs = Stubs(channel)
        info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="q"), timeout=10).queue
        assert info.lease_timeout.seconds == 24 * HOUR
        assert info.expire_timeout.seconds == 10 * YEAR
        stubs.produce("q", [b"a"])
        item = stubs.lease("q", batch_size=1).items[0]
        assert item.lease_deadline.ToDatetime().year < 10_000
    finally:
        channel.close()
        srv.stop()
