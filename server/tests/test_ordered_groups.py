"""Ordered groups (ProduceItem.group_key): one item in flight per group, FIFO within it.

Real server on 127.0.0.1:0, real LMDB. Deliveries are told apart by payload (the
contract's stable part), never by item ids.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import defaultdict

import grpc
import pytest

from querator.v1 import queue_pb2, queues_pb2
from querator_server.model import MAX_KEY_BYTES

from conftest import Stubs, ThreadServer, bad_request_fields, dur, secs, wait_until


def produce(stubs: Stubs, name: str, items: list[tuple[str, bytes]], **kw: object) -> queue_pb2.ProduceResponse:
    """Produce (group_key, payload) pairs in one request ("" for no group)."""
    request = queue_pb2.ProduceRequest(
        queue_name=name, items=[queue_pb2.ProduceItem(group_key=g, payload=p) for g, p in items], **kw  # type: ignore[arg-type]
    )
    return stubs.queue.Produce(request, timeout=10)


def lease(stubs: Stubs, name: str, batch: int = 10, wait: float = 0.2, client_id: str = "") -> queue_pb2.LeaseResponse:
    return stubs.lease(name, batch_size=batch, client_id=client_id, request_timeout=dur(wait), timeout=wait + 5)


def payloads(response: queue_pb2.LeaseResponse) -> list[bytes]:
    return [item.payload for item in response.items]


def test_one_in_flight_per_group_fifo_and_independent_groups(stubs: Stubs) -> None:
    stubs.create("g", lease_timeout=dur(60))
    produce(stubs, "g", [("A", b"A1")])
    produce(stubs, "g", [("A", b"A2")])
    produce(stubs, "g", [("B", b"B1")])
    # Two consumers: the first gets A1 and B1 (B does not wait for A); the second
    # gets nothing, since A2 waits behind A1.
    first = lease(stubs, "g", batch=10, client_id="c1")
    assert payloads(first) == [b"A1", b"B1"]
    assert [item.group_key for item in first.items] == ["A", "B"]
    second = lease(stubs, "g", batch=10, client_id="c2")
    assert payloads(second) == []
    stats = stubs.stats("g").partitions[0]
    assert stats.total == 3 and stats.total_leased == 2 and stats.groups_in_flight == 2
    assert stats.HasField("oldest_waiting_in_group")
    # B1 done changes nothing for A; A1 done lets A2 go.
    stubs.complete("g", first.partition, [first.items[1].id])
    assert payloads(lease(stubs, "g", client_id="c2")) == []
    stubs.complete("g", first.partition, [first.items[0].id])
    second = lease(stubs, "g", client_id="c2")
    assert payloads(second) == [b"A2"]
    stubs.complete("g", second.partition, [second.items[0].id])
    stats = stubs.stats("g").partitions[0]
    assert stats.total == 0 and stats.groups_in_flight == 0 and not stats.HasField("oldest_waiting_in_group")


def test_expired_lease_keeps_its_place_at_the_head_of_its_group(stubs: Stubs) -> None:
    stubs.create("g", lease_timeout=dur(0.3))
    produce(stubs, "g", [("A", b"A1"), ("A", b"A2"), ("", b"plain")])
    got = lease(stubs, "g")
    assert payloads(got) == [b"A1", b"plain"]
    # Both leases run out: A1 comes again (its second attempt), A2 still waits.
    again = lease(stubs, "g", batch=10, wait=3)
    assert sorted(payloads(again)) == [b"A1", b"plain"]
    assert {item.payload: item.attempts for item in again.items}[b"A1"] == 2
    stubs.complete("g", again.partition, [item.id for item in again.items])
    assert payloads(lease(stubs, "g")) == [b"A2"]


def test_retry_without_delay_keeps_the_head_and_with_delay_holds_the_group(stubs: Stubs) -> None:
    stubs.create("g", lease_timeout=dur(60))
    produce(stubs, "g", [("A", b"A1"), ("A", b"A2"), ("B", b"B1"), ("B", b"B2")])
    got = lease(stubs, "g")
    assert payloads(got) == [b"A1", b"B1"]
    a1, b1 = got.items
    # A1 retried now: it is leased again before A2.
    stubs.queue.Retry(queue_pb2.RetryRequest(queue_name="g", partition=got.partition, items=[queue_pb2.RetryItem(id=a1.id)]), timeout=10)
    # B1 retried in 0.5 s: B is held until then (B2 does not go meanwhile).
    retry_at = queue_pb2.RetryItem(id=b1.id)
    retry_at.retry_at.FromMicroseconds(int(time.time() * 1e6) + 500_000)
    stubs.queue.Retry(queue_pb2.RetryRequest(queue_name="g", partition=got.partition, items=[retry_at]), timeout=10)
    again = lease(stubs, "g")
    assert payloads(again) == [b"A1"]
    later = lease(stubs, "g", wait=3)
    assert payloads(later) == [b"B1"]
    stubs.complete("g", later.partition, [later.items[0].id])
    stubs.complete("g", again.partition, [again.items[0].id])
    assert sorted(payloads(lease(stubs, "g"))) == [b"A2", b"B2"]


def test_dead_lettering_and_deleting_release_the_group(stubs: Stubs) -> None:
    stubs.create("dead")
    stubs.create("g", lease_timeout=dur(60), dead_queue="dead", max_attempts=1)
    produce(stubs, "g", [("A", b"A1"), ("A", b"A2"), ("A", b"A3"), ("B", b"B1"), ("B", b"B2")])
    got = lease(stubs, "g")
    assert payloads(got) == [b"A1", b"B1"]
    a1, b1 = got.items
    # A1 retried as dead: A2 goes on.
    stubs.queue.Retry(
        queue_pb2.RetryRequest(queue_name="g", partition=got.partition, items=[queue_pb2.RetryItem(id=a1.id, dead=True)]),
        timeout=10,
    )
    # B1 deleted while leased: B2 goes on.
    from querator.v1 import storage_pb2

    stubs.storage.DeleteItems(storage_pb2.DeleteItemsRequest(queue_name="g", partition=got.partition, ids=[b1.id]), timeout=10)
    nxt = lease(stubs, "g")
    assert sorted(payloads(nxt)) == [b"A2", b"B2"]
    dead = lease(stubs, "dead")
    assert payloads(dead) == [b"A1"]
    assert dead.items[0].group_key == ""  # a dead letter leaves its group
    # With max_attempts 1, A2's lease running out dead-letters it: A3 goes on.
    stubs.queue.Extend(
        queue_pb2.ExtendRequest(queue_name="g", partition=nxt.partition, ids=[i.id for i in nxt.items], lease_timeout=dur(0.2)),
        timeout=10,
    )
    assert payloads(lease(stubs, "g", wait=3)) == [b"A3"]


def test_a_blocked_group_does_not_stall_a_lease_with_other_ready_items(stubs: Stubs) -> None:
    stubs.create("g", lease_timeout=dur(60))
    # 3,000 items of one group, then plain items.
    for start in range(0, 3000, 1000):
        produce(stubs, "g", [("busy", f"busy-{i}".encode()) for i in range(start, start + 1000)])
    produce(stubs, "g", [("", f"plain-{i}".encode()) for i in range(5)])
    first = lease(stubs, "g", batch=10)
    assert payloads(first) == [b"busy-0"] + [f"plain-{i}".encode() for i in range(5)]
    assert payloads(lease(stubs, "g", batch=10)) == []
    stats = stubs.stats("g").partitions[0]
    assert stats.total == 3005 and stats.total_leased == 6 and stats.groups_in_flight == 1


def test_group_key_bounds_and_enqueue_at(stubs: Stubs) -> None:
    stubs.create("g")
    with pytest.raises(grpc.RpcError) as err:
        produce(stubs, "g", [("", b"x"), ("k" * (MAX_KEY_BYTES + 1), b"y")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["items[1].group_key"]
    item = queue_pb2.ProduceItem(group_key="A", payload=b"x")
    item.enqueue_at.FromMicroseconds(int(time.time() * 1e6) + 10_000_000)
    with pytest.raises(grpc.RpcError) as err:
        stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="g", items=[item]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["items[0].group_key"]
    assert stubs.stats("g").partitions[0].total == 0


def test_groups_stay_in_their_partition_as_partitions_are_added(stubs: Stubs) -> None:
    stubs.create("g", requested_partitions=2)
    keys = [f"k{i}" for i in range(20)]
    placed = {k: produce(stubs, "g", [(k, b"1")]).partition for k in keys}
    assert placed == {k: zlib.crc32(k.encode()) % 2 for k in keys}
    # A request whose groups live in two partitions is refused, naming the item.
    a, b = next(k for k in keys if placed[k] == 0), next(k for k in keys if placed[k] == 1)
    with pytest.raises(grpc.RpcError) as err:
        produce(stubs, "g", [(a, b"2"), ("", b"plain"), (b, b"2")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["items[2].group_key"]
    stubs.queues.UpdateQueue(
        queues_pb2.UpdateQueueRequest(
            queue=queues_pb2.QueueInfo(queue_name="g", requested_partitions=5),
            update_mask={"paths": ["requested_partitions"]},  # type: ignore[arg-type]
        ),
        timeout=10,
    )
    # Still by the count the first grouped item was produced with.
    assert {k: produce(stubs, "g", [(k, b"2")]).partition for k in keys} == placed


def test_order_holds_per_group_with_100_groups_and_8_consumers(stubs: Stubs, capsys: pytest.CaptureFixture[str]) -> None:
    """10,000 items over 100 groups, 8 consumers: every group's items are handed out
    one at a time, in produce order (checked per group by payload)."""
    stubs.create("g", lease_timeout=dur(60), requested_partitions=4)
    groups, per_group, consumers = 100, 100, 8
    by_partition: dict[int, list[tuple[str, bytes]]] = defaultdict(list)
    for n in range(per_group):
        for g in range(groups):
            key = f"group-{g}"
            by_partition[zlib.crc32(key.encode()) % 4].append((key, f"{key}/{n}".encode()))
    started = time.monotonic()
    for items in by_partition.values():
        for start in range(0, len(items), 1000):
            produce(stubs, "g", items[start : start + 1000])
    produced_s = time.monotonic() - started
    seen: dict[str, list[int]] = defaultdict(list)
    in_flight: set[str] = set()
    violations: list[str] = []
    lock = threading.Lock()
    done = threading.Event()
    total = groups * per_group
    deadline = time.monotonic() + 120

    def consume(index: int) -> None:
        while not done.is_set() and time.monotonic() < deadline:
            got = lease(stubs, "g", batch=20, wait=0.5, client_id=f"c{index}")
            with lock:
                for item in got.items:
                    key, n = item.payload.decode().split("/")
                    if key in in_flight:
                        violations.append(f"{key} handed out twice at once")
                    in_flight.add(key)
                    seen[key].append(int(n))
            if not got.items:
                continue
            with lock:  # forget them as in flight before the Complete is sent
                for item in got.items:
                    in_flight.discard(item.payload.decode().split("/")[0])
                if sum(map(len, seen.values())) >= total:
                    done.set()
            stubs.complete("g", got.partition, [item.id for item in got.items])

    started = time.monotonic()
    threads = [threading.Thread(target=consume, args=(i,)) for i in range(consumers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(130)
    drained_s = time.monotonic() - started
    assert not violations
    assert sum(map(len, seen.values())) == total
    for key, order in seen.items():
        assert order == list(range(per_group)), f"{key} out of order: {order[:20]}"
    wait_until(lambda: stubs.stats("g").partitions[0].total == 0)
    with capsys.disabled():
        print(
            f"\nordered groups: {total} items, {groups} groups, {consumers} consumers: produce {total / produced_s:,.0f} items/s, "
            f"drain {total / drained_s:,.0f} items/s ({drained_s:.1f} s)"
        )


def test_stats_oldest_waiting_age(stubs: Stubs) -> None:
    stubs.create("g", lease_timeout=dur(60))
    produce(stubs, "g", [("A", b"A1"), ("A", b"A2")])
    lease(stubs, "g")
    time.sleep(0.3)
    stats = stubs.stats("g").partitions[0]
    assert stats.groups_in_flight == 1
    assert secs(stats.oldest_waiting_in_group) >= 0.3


def test_clearing_a_queue_drops_waiting_items_and_leaves_no_group_blocked(stubs: Stubs) -> None:
    stubs.create("g", lease_timeout=dur(60))
    produce(stubs, "g", [("A", b"A1"), ("A", b"A2"), ("B", b"B1"), ("B", b"B2")])
    got = lease(stubs, "g", batch=1)
    assert payloads(got) == [b"A1"]
    # Ready items go (B1, and A2 and B2 behind their heads); the leased A1 stays.
    stubs.queues.ClearQueue(queues_pb2.ClearQueueRequest(queue_name="g", queue=True), timeout=10)
    stats = stubs.stats("g").partitions[0]
    assert (stats.total, stats.total_leased, stats.groups_in_flight) == (1, 1, 1)
    # A still waits behind A1; B starts afresh.
    produce(stubs, "g", [("A", b"A3"), ("B", b"B3")])
    assert payloads(lease(stubs, "g")) == [b"B3"]
    stubs.complete("g", got.partition, [got.items[0].id])
    assert payloads(lease(stubs, "g")) == [b"A3"]


def test_clearing_the_scheduled_head_of_a_group_lets_the_next_go(stubs: Stubs) -> None:
    stubs.create("g", lease_timeout=dur(60))
    produce(stubs, "g", [("B", b"B1"), ("B", b"B2")])
    got = lease(stubs, "g")
    later = queue_pb2.RetryItem(id=got.items[0].id)
    later.retry_at.FromMicroseconds(int(time.time() * 1e6) + 60_000_000)
    stubs.queue.Retry(queue_pb2.RetryRequest(queue_name="g", partition=got.partition, items=[later]), timeout=10)
    assert payloads(lease(stubs, "g")) == []  # B is held by its delayed head
    stubs.queues.ClearQueue(queues_pb2.ClearQueueRequest(queue_name="g", scheduled=True), timeout=10)
    assert payloads(lease(stubs, "g")) == [b"B2"]


def test_metrics_count_waiting_items_and_groups_in_flight(server: ThreadServer, stubs: Stubs) -> None:
    from querator_server.metrics import QueueCollector

    stubs.create("g", lease_timeout=dur(60))
    produce(stubs, "g", [("A", b"A1"), ("A", b"A2"), ("A", b"A3"), ("B", b"B1")])
    lease(stubs, "g", batch=1)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in QueueCollector(server.server.manager).collect()
        for s in family.samples
        if s.labels.get("queue") == "g"
    }
    assert samples[("querator_queue_items", (("queue", "g"), ("state", "waiting_in_group")))] == 2
    assert samples[("querator_queue_items", (("queue", "g"), ("state", "ready")))] == 1
    assert samples[("querator_queue_groups_in_flight", (("queue", "g"),))] == 1
