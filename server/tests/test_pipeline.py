"""Additions for data pipelines: idempotency keys, idempotent lease keys."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf import duration_pb2, field_mask_pb2

from querator.v1 import queue_pb2, queues_pb2

from conftest import Stubs, ThreadServer, wait_until

SHORT = duration_pb2.Duration(seconds=1)


def produce_keyed(stubs: Stubs, name: str, pairs: list[tuple[bytes, str]]) -> queue_pb2.ProduceResponse:
    items = [queue_pb2.ProduceItem(payload=p, idempotency_key=k) for p, k in pairs]
    return stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=items), timeout=10)


def lease_keyed(stubs: Stubs, name: str, key: str, batch: int = 10) -> queue_pb2.LeaseResponse:
    request = queue_pb2.LeaseRequest(
        queue_name=name, batch_size=batch, lease_key=key, request_timeout=duration_pb2.Duration(nanos=200_000_000)
    )
    return stubs.queue.Lease(request, timeout=5)


def stored(stubs: Stubs, name: str) -> list[bytes]:
    return [i.payload for i in stubs.list_items(name)]


# -- idempotency keys ----------------------------------------------------------------


def test_a_repeated_idempotency_key_stores_nothing_and_answers_the_first_id(stubs: Stubs) -> None:
    stubs.create("dedup")
    first = produce_keyed(stubs, "dedup", [(b"a", "k-a"), (b"b", "k-b")])
    assert first.duplicates == 0
    again = produce_keyed(stubs, "dedup", [(b"a2", "k-a"), (b"c", "k-c"), (b"c2", "k-c"), (b"plain", "")])
    assert again.duplicates == 2
    assert again.ids[0] == first.ids[0]
    assert again.ids[2] == again.ids[1]
    assert stored(stubs, "dedup") == [b"a", b"b", b"c", b"plain"]


def test_idempotency_outlives_the_item_and_a_restart_but_not_the_window(data_dir: str) -> None:
    srv = ThreadServer(data_dir)
    try:
        stubs = Stubs(grpc.insecure_channel(srv.address))
        stubs.create("window")  # the default window, a day, outlasts the restart however slow it is
        produce_keyed(stubs, "window", [(b"x", "once")])
        produced_by = time.time()
        leased = stubs.lease("window")
        stubs.complete("window", leased.partition, [leased.items[0].id])
    finally:
        srv.stop()
    srv = ThreadServer(data_dir)
    try:
        stubs = Stubs(grpc.insecure_channel(srv.address))
        assert produce_keyed(stubs, "window", [(b"x", "once")]).duplicates == 1
        assert stored(stubs, "window") == []
        # The window is checked when a key comes again: shortened to one second, it has
        # passed for the stored key once a second has gone by since the first produce.
        update = queues_pb2.UpdateQueueRequest(
            queue=queues_pb2.QueueInfo(queue_name="window", dedup_window=SHORT),
            update_mask=field_mask_pb2.FieldMask(paths=["dedup_window"]),
        )
        stubs.queues.UpdateQueue(update, timeout=5)
        time.sleep(max(0.0, produced_by + 1.1 - time.time()))
        assert produce_keyed(stubs, "window", [(b"x", "once")]).duplicates == 0
        assert stored(stubs, "window") == [b"x"]
    finally:
        srv.stop()


def test_idempotency_key_validation(stubs: Stubs) -> None:
    stubs.create("keyval")
    with pytest.raises(grpc.RpcError) as err:
        produce_keyed(stubs, "keyval", [(b"x", "k" * 513)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[0].idempotency_key" in err.value.details()


def test_dedup_window_and_lease_key_ttl_are_queue_settings(stubs: Stubs) -> None:
    created = stubs.create("settings")
    assert created.dedup_window.seconds == 24 * 3600
    assert created.lease_key_ttl.seconds == 3600
    update = queues_pb2.UpdateQueueRequest(
        queue=queues_pb2.QueueInfo(queue_name="settings", dedup_window=duration_pb2.Duration(seconds=60)),
        update_mask=field_mask_pb2.FieldMask(paths=["dedup_window"]),
    )
    updated = stubs.queues.UpdateQueue(update, timeout=5).queue
    assert (updated.dedup_window.seconds, updated.lease_key_ttl.seconds) == (60, 3600)


# -- lease keys ----------------------------------------------------------------------


def test_a_repeated_lease_key_returns_the_same_items_and_never_new_ones(stubs: Stubs) -> None:
    stubs.create("lk")
    stubs.produce("lk", [b"1", b"2", b"3", b"4", b"5"])
    first = lease_keyed(stubs, "lk", "batch-1", batch=3)
    assert [i.payload for i in first.items] == [b"1", b"2", b"3"]
    again = lease_keyed(stubs, "lk", "batch-1", batch=3)
    assert [i.id for i in again.items] == [i.id for i in first.items]
    assert [i.attempts for i in again.items] == [1, 1, 1]
    assert stubs.stats("lk").partitions[0].total_leased == 3
    other = lease_keyed(stubs, "lk", "batch-2", batch=10)
    assert [i.payload for i in other.items] == [b"4", b"5"]


def test_complete_by_key_is_idempotent_and_forgets_the_key(stubs: Stubs) -> None:
    stubs.create("lkc")
    stubs.produce("lkc", [b"1", b"2", b"3"])
    lease_keyed(stubs, "lkc", "k", batch=2)
    request = queue_pb2.CompleteRequest(queue_name="lkc", lease_keys=["k"])
    stubs.queue.Complete(request, timeout=5)
    stubs.queue.Complete(request, timeout=5)  # again: not an error
    stubs.queue.Complete(queue_pb2.CompleteRequest(queue_name="lkc", lease_keys=["never-used"]), timeout=5)
    assert stored(stubs, "lkc") == [b"3"]
    # Forgotten once all its items completed: the key now leases anew.
    assert [i.payload for i in lease_keyed(stubs, "lkc", "k").items] == [b"3"]


def test_a_key_re_leases_its_expired_items_unless_someone_else_took_them(stubs: Stubs) -> None:
    stubs.create("lkx", lease_timeout=SHORT)
    stubs.produce("lkx", [b"1", b"2"])
    first = lease_keyed(stubs, "lkx", "k", batch=2)
    assert len(first.items) == 2
    # Both leases expire and the items go back to the tail under new ids.
    wait_until(lambda: stubs.stats("lkx").partitions[0].total_leased == 0, timeout=10)
    # The leases taken from now on last long enough not to end during the checks below.
    update = queues_pb2.UpdateQueueRequest(
        queue=queues_pb2.QueueInfo(queue_name="lkx", lease_timeout=duration_pb2.Duration(seconds=60)),
        update_mask=field_mask_pb2.FieldMask(paths=["lease_timeout"]),
    )
    stubs.queues.UpdateQueue(update, timeout=5)
    taken = stubs.lease("lkx", batch_size=1)  # an ordinary lease takes item "1"
    assert [i.payload for i in taken.items] == [b"1"]
    again = lease_keyed(stubs, "lkx", "k", batch=2)
    assert [i.payload for i in again.items] == [b"2"]
    assert again.items[0].attempts == 2
    assert again.items[0].id != first.items[1].id
    # Completing by key completes what the key still holds, not the other lease.
    stubs.queue.Complete(queue_pb2.CompleteRequest(queue_name="lkx", lease_keys=["k"]), timeout=5)
    assert [i.payload for i in stubs.list_items("lkx")] == [b"1"]


def test_extend_by_key_extends_every_item_of_the_key(stubs: Stubs) -> None:
    stubs.create("lke", lease_timeout=duration_pb2.Duration(seconds=30))
    stubs.produce("lke", [b"1", b"2"])
    first = lease_keyed(stubs, "lke", "k", batch=2)
    response = stubs.queue.Extend(
        queue_pb2.ExtendRequest(
            queue_name="lke", lease_keys=["k", "unknown"], lease_timeout=duration_pb2.Duration(seconds=600)
        ),
        timeout=5,
    )
    assert response.key_items_extended == 2
    later = {i.id: i.lease_deadline.seconds for i in stubs.list_items("lke")}
    assert all(later[i.id] >= i.lease_deadline.seconds + 500 for i in first.items)


def test_lease_keys_are_forgotten_after_their_ttl(stubs: Stubs) -> None:
    stubs.create("lkt", lease_key_ttl=SHORT)
    stubs.produce("lkt", [b"1", b"2"])
    assert [i.payload for i in lease_keyed(stubs, "lkt", "k", batch=1).items] == [b"1"]
    time.sleep(1.1)  # the key's TTL passes
    wait_until(lambda: [i.payload for i in lease_keyed(stubs, "lkt", "k", batch=1).items] == [b"2"], timeout=10)


def test_lease_keys_survive_a_restart(data_dir: str) -> None:
    srv = ThreadServer(data_dir)
    try:
        stubs = Stubs(grpc.insecure_channel(srv.address))
        stubs.create("lkr")
        stubs.produce("lkr", [b"1", b"2", b"3"])
        first = lease_keyed(stubs, "lkr", "k", batch=2)
    finally:
        srv.stop()
    srv = ThreadServer(data_dir)
    try:
        stubs = Stubs(grpc.insecure_channel(srv.address))
        assert [i.id for i in lease_keyed(stubs, "lkr", "k", batch=2).items] == [i.id for i in first.items]
    finally:
        srv.stop()


def test_complete_needs_ids_or_lease_keys(stubs: Stubs) -> None:
    stubs.create("lkv")
    with pytest.raises(grpc.RpcError) as err:
        stubs.queue.Complete(queue_pb2.CompleteRequest(queue_name="lkv"), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_lease_key_that_found_nothing_never_returns_later_items(stubs: Stubs) -> None:
    stubs.create("lkempty")
    started = time.monotonic()
    request = queue_pb2.LeaseRequest(
        queue_name="lkempty", batch_size=10, lease_key="k", request_timeout=duration_pb2.Duration(seconds=20)
    )
    assert list(stubs.queue.Lease(request, timeout=30).items) == []
    assert time.monotonic() - started < 10  # a keyed lease answers at once, it does not wait 20 s
    stubs.produce("lkempty", [b"late"])
    assert list(lease_keyed(stubs, "lkempty", "k").items) == []
    assert [i.payload for i in lease_keyed(stubs, "lkempty", "other").items] == [b"late"]
