"""QueueService (Produce, Lease, Complete, Retry, Extend) against the v1 contract.

Every test talks to a real server over real gRPC channels with real LMDB storage.
Long polls use short request timeouts so the whole file stays fast.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from querator.v1 import queue_pb2, storage_pb2

from conftest import Stubs, ThreadServer, dur, secs, wait_until
from conftest import bad_request_fields as violation_fields

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION

BAD_QUEUE_NAMES = ["", " ", "a b", "tab\tname", "new\nline", "a~b", "a/b", "x" * 513]
# How late after its cause a waiting Lease may answer and still count as prompt: far
# below the request timeouts it is told apart from, wide enough for a loaded machine.
PROMPT = 3.0

# -- helpers -----------------------------------------------------------------------




def ts_in(seconds: float) -> timestamp_pb2.Timestamp:
    """A timestamp ``seconds`` from now (negative: in the past)."""
    at = timestamp_pb2.Timestamp()
    at.FromMicroseconds(int((time.time() + seconds) * 1e6))
    return at




def rpc_error(call: Callable[..., object], *args: object, **kwargs: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


def message(err: grpc.RpcError) -> str:
    return err.details() or ""  # type: ignore[attr-defined]




def assert_invalid(err: grpc.RpcError, field: str) -> None:
    assert err.code() == INVALID, (err.code(), message(err))
    fields = violation_fields(err)
    assert field in fields, f"expected a BadRequest violation for {field!r}, got {fields}"
    assert field in message(err), message(err)


def expect_invalid(field: str, call: Callable[..., object], *args: object, **kwargs: object) -> None:
    assert_invalid(rpc_error(call, *args, **kwargs), field)


def expect_code(code: grpc.StatusCode, call: Callable[..., object], *args: object, **kwargs: object) -> grpc.RpcError:
    err = rpc_error(call, *args, **kwargs)
    assert err.code() == code, (err.code(), message(err))
    return err


def produce_items(stubs: Stubs, name: str, items: list[queue_pb2.ProduceItem], **kw: object) -> queue_pb2.ProduceResponse:
    return stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=items, **kw), timeout=10)  # type: ignore[arg-type]


def lease_now(stubs: Stubs, name: str, batch_size: int = 10, client_id: str = "") -> queue_pb2.LeaseResponse:
    """A Lease that does not wait long when nothing is ready."""
    return stubs.lease(name, batch_size=batch_size, client_id=client_id, request_timeout=dur(0.2))


def complete_req(name: str, partition: int, ids: list[str]) -> queue_pb2.CompleteRequest:
    return queue_pb2.CompleteRequest(queue_name=name, partition=partition, ids=ids)


def retry_req(name: str, partition: int, ids: list[str], **kw: object) -> queue_pb2.RetryRequest:
    items = [queue_pb2.RetryItem(id=i, **kw) for i in ids]  # type: ignore[arg-type]
    return queue_pb2.RetryRequest(queue_name=name, partition=partition, items=items)


def extend_req(name: str, partition: int, ids: list[str], **kw: object) -> queue_pb2.ExtendRequest:
    return queue_pb2.ExtendRequest(queue_name=name, partition=partition, ids=ids, **kw)  # type: ignore[arg-type]


def leased_count(stubs: Stubs, name: str) -> int:
    return sum(p.total_leased for p in stubs.stats(name).partitions)


def stored(stubs: Stubs, name: str, partition: int = 0) -> dict[str, storage_pb2.StorageItem]:
    return {item.id: item for item in stubs.list_items(name, partition)}


@pytest.fixture
def big_channel(server: ThreadServer) -> Iterator[grpc.Channel]:
    limit = 64 << 20
    channel = grpc.insecure_channel(
        server.address,
        options=[("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)],
    )
    yield channel
    channel.close()


# -- validation: INVALID_ARGUMENT naming the field ---------------------------------------


@pytest.mark.parametrize("bad_name", BAD_QUEUE_NAMES, ids=repr)
def test_bad_queue_name_is_invalid_argument_on_every_rpc(stubs: Stubs, bad_name: str) -> None:
    q = stubs.queue
    expect_invalid("queue_name", q.Produce, queue_pb2.ProduceRequest(queue_name=bad_name, items=[queue_pb2.ProduceItem(payload=b"x")]), timeout=5)
    expect_invalid("queue_name", q.Lease, queue_pb2.LeaseRequest(queue_name=bad_name, batch_size=1, request_timeout=dur(0.2)), timeout=5)
    expect_invalid("queue_name", q.Complete, complete_req(bad_name, 0, ["a"]), timeout=5)
    expect_invalid("queue_name", q.Retry, retry_req(bad_name, 0, ["a"]), timeout=5)
    expect_invalid("queue_name", q.Extend, extend_req(bad_name, 0, ["a"]), timeout=5)


def test_a_bad_request_names_its_field_before_its_queue_is_looked_up(stubs: Stubs) -> None:
    """A request wrong in itself is INVALID_ARGUMENT naming the field whether or not its
    queue exists: the checks that need no queue come first (in a cluster too, where the
    queue is looked up in the catalog before the call reaches a handler)."""
    q, missing = stubs.queue, "no-such-queue"
    expect_invalid("batch_size", stubs.lease, missing, batch_size=0, request_timeout=dur(0.2))
    expect_invalid("client_id", stubs.lease, missing, batch_size=1, client_id="c" * 10_000, request_timeout=dur(0.2))
    expect_invalid("items", q.Produce, queue_pb2.ProduceRequest(queue_name=missing), timeout=5)
    both = queue_pb2.ProduceRequest(queue_name=missing, payloads=[b"x"], items=[queue_pb2.ProduceItem(payload=b"y")])
    expect_invalid("payloads", q.Produce, both, timeout=5)
    expect_code(NOT_FOUND, stubs.lease, missing, batch_size=1, request_timeout=dur(0.2))


def test_longest_valid_queue_name_is_not_invalid(stubs: Stubs) -> None:
    name = "q" * 512
    expect_code(NOT_FOUND, stubs.produce, name, [b"x"])
    stubs.create(name)
    assert len(stubs.produce(name, [b"x"]).ids) == 1


def test_huge_bad_queue_name_gives_short_invalid_argument(stubs: Stubs) -> None:
    err = rpc_error(stubs.produce, "a b" + "x" * 10_000, [b"x"])
    assert_invalid(err, "queue_name")
    assert len(message(err)) < 4096


def test_produce_items_count_limits(stubs: Stubs) -> None:
    stubs.create("q")
    expect_invalid("items", stubs.queue.Produce, queue_pb2.ProduceRequest(queue_name="q"), timeout=5)
    expect_invalid("items", stubs.produce, "q", [b""] * 1001)
    assert len(stubs.produce("q", [b"x"] * 1000).ids) == 1000
    assert stubs.stats("q").partitions[0].total == 1000  # the refused requests stored nothing


def test_produce_payloads_the_compact_form(stubs: Stubs) -> None:
    stubs.create("q")
    compact = stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="q", payloads=[b"a", b"", b"c"]), timeout=5)
    itemized = stubs.produce("q", [b"d"])
    assert compact.partition == itemized.partition == 0 and len(set(compact.ids)) == 3
    leased = stubs.lease("q", batch_size=10, request_timeout=dur(0))
    assert [(item.id, item.payload, item.attempts) for item in leased.items] == [
        (compact.ids[0], b"a", 1),
        (compact.ids[1], b"", 1),
        (compact.ids[2], b"c", 1),
        (itemized.ids[0], b"d", 1),
    ]
    assert all(not (item.encoding or item.kind or item.reference or item.metadata) for item in leased.items)
    both = queue_pb2.ProduceRequest(queue_name="q", payloads=[b"x"], items=[queue_pb2.ProduceItem(payload=b"y")])
    expect_invalid("payloads", stubs.queue.Produce, both, timeout=5)
    expect_invalid("payloads", stubs.queue.Produce, queue_pb2.ProduceRequest(queue_name="q", payloads=[b""] * 1001), timeout=5)
    assert len(stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="q", payloads=[b"z"] * 1000), timeout=5).ids) == 1000
    assert stubs.stats("q").partitions[0].total == 1004  # the refused requests stored nothing


@pytest.mark.parametrize("batch_size", [0, -1, 1001])
def test_lease_batch_size_out_of_range(stubs: Stubs, batch_size: int) -> None:
    stubs.create("q")
    stubs.produce("q", [b"x"])
    expect_invalid("batch_size", stubs.lease, "q", batch_size=batch_size, request_timeout=dur(0.2))
    assert leased_count(stubs, "q") == 0


def test_lease_batch_size_bounds_are_accepted(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"x", b"y"])
    assert len(lease_now(stubs, "q", batch_size=1).items) == 1
    assert len(lease_now(stubs, "q", batch_size=1000).items) == 1


def test_negative_request_timeout_is_invalid(stubs: Stubs) -> None:
    stubs.create("q")
    negative = duration_pb2.Duration(seconds=-1)
    item = queue_pb2.ProduceItem(payload=b"x")
    q = stubs.queue
    expect_invalid("request_timeout", q.Lease, queue_pb2.LeaseRequest(queue_name="q", batch_size=1, request_timeout=negative), timeout=5)
    expect_invalid("request_timeout", q.Produce, queue_pb2.ProduceRequest(queue_name="q", items=[item], request_timeout=negative), timeout=5)
    expect_invalid("request_timeout", q.Complete, queue_pb2.CompleteRequest(queue_name="q", ids=["a"], request_timeout=negative), timeout=5)
    expect_invalid("request_timeout", q.Extend, extend_req("q", 0, ["a"], request_timeout=negative), timeout=5)
    negative_nanos = duration_pb2.Duration(nanos=-500_000_000)
    expect_invalid("request_timeout", q.Lease, queue_pb2.LeaseRequest(queue_name="q", batch_size=1, request_timeout=negative_nanos), timeout=5)
    assert stubs.stats("q").partitions[0].total == 0


def test_request_timeout_over_15_minutes_is_invalid(stubs: Stubs) -> None:
    stubs.create("q")
    too_long = duration_pb2.Duration(seconds=15 * 60 + 1)
    q = stubs.queue
    expect_invalid("request_timeout", q.Lease, queue_pb2.LeaseRequest(queue_name="q", batch_size=1, request_timeout=too_long), timeout=5)
    item = queue_pb2.ProduceItem(payload=b"x")
    expect_invalid("request_timeout", q.Produce, queue_pb2.ProduceRequest(queue_name="q", items=[item], request_timeout=too_long), timeout=5)
    # Exactly 15 minutes is allowed (and answers at once because an item is ready).
    stubs.produce("q", [b"x"])
    exact = duration_pb2.Duration(seconds=15 * 60)
    assert len(q.Lease(queue_pb2.LeaseRequest(queue_name="q", batch_size=1, request_timeout=exact), timeout=5).items) == 1


def test_ids_list_rules_for_complete_and_extend(stubs: Stubs) -> None:
    stubs.create("q")
    q = stubs.queue
    for rpc, make in ((q.Complete, complete_req), (q.Extend, extend_req)):
        expect_invalid("ids", rpc, make("q", 0, []), timeout=5)
        expect_invalid("ids", rpc, make("q", 0, [f"id{i}" for i in range(1001)]), timeout=5)
        expect_invalid("ids[1]", rpc, make("q", 0, ["a", ""]), timeout=5)
        expect_invalid("ids[2]", rpc, make("q", 0, ["a", "b", "a"]), timeout=5)


def test_item_rules_for_retry(stubs: Stubs) -> None:
    stubs.create("q")
    q = stubs.queue
    expect_invalid("items", q.Retry, retry_req("q", 0, []), timeout=5)
    expect_invalid("items", q.Retry, retry_req("q", 0, [f"id{i}" for i in range(1001)]), timeout=5)
    for ids in (["a", ""], ["a", "a"]):
        err = rpc_error(q.Retry, retry_req("q", 0, ids), timeout=5)
        assert err.code() == INVALID
        fields = violation_fields(err)
        assert any("items" in f and "1" in f and "id" in f for f in fields), fields


def test_duplicate_id_in_complete_changes_nothing(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"x"])
    item = lease_now(stubs, "q").items[0]
    expect_invalid("ids[1]", stubs.queue.Complete, complete_req("q", 0, [item.id, item.id]), timeout=5)
    assert leased_count(stubs, "q") == 1
    stubs.complete("q", 0, [item.id])


@pytest.mark.parametrize("partition", [-1, 4, 1000])
def test_partition_out_of_range(stubs: Stubs, partition: int) -> None:
    stubs.create("q", requested_partitions=4)
    q = stubs.queue
    expect_invalid("partition", q.Complete, complete_req("q", partition, ["a"]), timeout=5)
    expect_invalid("partition", q.Retry, retry_req("q", partition, ["a"]), timeout=5)
    expect_invalid("partition", q.Extend, extend_req("q", partition, ["a"]), timeout=5)


def test_invalid_timestamps_name_the_item(stubs: Stubs) -> None:
    stubs.create("q")
    bad = timestamp_pb2.Timestamp(seconds=-5)
    items = [queue_pb2.ProduceItem(payload=b"ok"), queue_pb2.ProduceItem(payload=b"bad", enqueue_at=bad)]
    expect_invalid("items[1].enqueue_at", stubs.queue.Produce, queue_pb2.ProduceRequest(queue_name="q", items=items), timeout=5)
    assert stubs.stats("q").partitions[0].total == 0
    stubs.produce("q", [b"x"])
    item = lease_now(stubs, "q").items[0]
    request = queue_pb2.RetryRequest(queue_name="q", items=[queue_pb2.RetryItem(id=item.id, retry_at=bad)])
    expect_invalid("items[0].retry_at", stubs.queue.Retry, request, timeout=5)
    assert leased_count(stubs, "q") == 1


def test_extend_negative_lease_timeout_is_invalid(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"x"])
    item = lease_now(stubs, "q").items[0]
    expect_invalid("lease_timeout", stubs.queue.Extend, extend_req("q", 0, [item.id], lease_timeout=duration_pb2.Duration(seconds=-5)), timeout=5)


# -- NOT_FOUND and FAILED_PRECONDITION ------------------------------------------------------


def test_unknown_queue_is_not_found_on_every_rpc(stubs: Stubs) -> None:
    q = stubs.queue
    err = expect_code(NOT_FOUND, stubs.produce, "nope", [b"x"])
    assert "nope" in message(err)
    expect_code(NOT_FOUND, stubs.lease, "nope", request_timeout=dur(0.2))
    expect_code(NOT_FOUND, q.Complete, complete_req("nope", 0, ["a"]), timeout=5)
    expect_code(NOT_FOUND, q.Retry, retry_req("nope", 0, ["a"]), timeout=5)
    expect_code(NOT_FOUND, q.Extend, extend_req("nope", 0, ["a"]), timeout=5)


@pytest.mark.parametrize("garbage", ["nope", "ffff.0.1", "0.0.0", "zz.zz.zz", "1.0.1.0", "1.0.1.1.1", "...", "\u00e9\u00e9"])
def test_garbage_ids_are_not_found(stubs: Stubs, garbage: str) -> None:
    stubs.create("q")
    stubs.produce("q", [b"x"])
    lease_now(stubs, "q")
    q = stubs.queue
    for rpc, request in (
        (q.Complete, complete_req("q", 0, [garbage])),
        (q.Retry, retry_req("q", 0, [garbage])),
        (q.Extend, extend_req("q", 0, [garbage])),
    ):
        err = expect_code(NOT_FOUND, rpc, request, timeout=5)
        assert repr(garbage) in message(err) or garbage in message(err)
    assert leased_count(stubs, "q") == 1


def test_complete_twice_is_done_the_second_time_and_other_calls_not_found(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"x"])
    item = lease_now(stubs, "q").items[0]
    stubs.complete("q", 0, [item.id])
    q = stubs.queue
    again = q.Complete(complete_req("q", 0, [item.id]), timeout=5)
    assert list(again.already_completed) == [item.id]
    expect_code(NOT_FOUND, q.Retry, retry_req("q", 0, [item.id]), timeout=5)
    expect_code(NOT_FOUND, q.Extend, extend_req("q", 0, [item.id]), timeout=5)


def test_unleased_ready_item_is_failed_precondition(stubs: Stubs) -> None:
    stubs.create("q")
    produced = stubs.produce("q", [b"x"])
    ready_id = produced.ids[0]
    q = stubs.queue
    err = expect_code(PRECONDITION, q.Complete, complete_req("q", produced.partition, [ready_id]), timeout=5)
    assert ready_id in message(err)
    expect_code(PRECONDITION, q.Retry, retry_req("q", produced.partition, [ready_id]), timeout=5)
    expect_code(PRECONDITION, q.Extend, extend_req("q", produced.partition, [ready_id]), timeout=5)
    # Nothing changed: the item is still ready and leasable under that id.
    leased = lease_now(stubs, "q")
    assert [i.id for i in leased.items] == [ready_id]
    assert leased.items[0].attempts == 1


def test_scheduled_item_id_is_failed_precondition(stubs: Stubs) -> None:
    """A scheduled item exists but is not leased: FAILED_PRECONDITION, not NOT_FOUND."""
    stubs.create("q")
    produced = produce_items(stubs, "q", [queue_pb2.ProduceItem(payload=b"later", enqueue_at=ts_in(60))])
    scheduled_id = produced.ids[0]
    err = expect_code(PRECONDITION, stubs.queue.Complete, complete_req("q", produced.partition, [scheduled_id]), timeout=5)
    assert scheduled_id in message(err)
    assert stubs.stats("q").partitions[0].scheduled == 1


def test_id_from_another_partition_is_not_found(stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=2)
    first = stubs.produce("q", [b"a"])
    second = stubs.produce("q", [b"b"])
    assert {first.partition, second.partition} == {0, 1}
    one = lease_now(stubs, "q", batch_size=1)
    two = lease_now(stubs, "q", batch_size=1)
    assert {one.partition, two.partition} == {0, 1}
    # Both partitions hold their item at the same position; an id must still only
    # match in its own partition.
    q = stubs.queue
    wrong = two.partition
    err = expect_code(NOT_FOUND, q.Complete, complete_req("q", wrong, [one.items[0].id]), timeout=5)
    assert one.items[0].id in message(err)
    expect_code(NOT_FOUND, q.Retry, retry_req("q", wrong, [one.items[0].id]), timeout=5)
    expect_code(NOT_FOUND, q.Extend, extend_req("q", wrong, [one.items[0].id]), timeout=5)
    assert [p.total_leased for p in stubs.stats("q").partitions] == [1, 1]
    stubs.complete("q", one.partition, [one.items[0].id])
    stubs.complete("q", two.partition, [two.items[0].id])


def test_id_from_another_queue_is_not_found(stubs: Stubs) -> None:
    stubs.create("a")
    stubs.create("b")
    stubs.produce("a", [b"a"])
    stubs.produce("b", [b"b"])
    from_a = lease_now(stubs, "a").items[0]
    from_b = lease_now(stubs, "b").items[0]
    q = stubs.queue
    expect_code(NOT_FOUND, q.Complete, complete_req("b", 0, [from_a.id]), timeout=5)
    expect_code(NOT_FOUND, q.Retry, retry_req("b", 0, [from_a.id]), timeout=5)
    expect_code(NOT_FOUND, q.Extend, extend_req("b", 0, [from_a.id]), timeout=5)
    assert leased_count(stubs, "a") == 1
    assert leased_count(stubs, "b") == 1
    stubs.complete("b", 0, [from_b.id])
    stubs.complete("a", 0, [from_a.id])


def test_id_from_a_deleted_queue_of_the_same_name_is_not_found(stubs: Stubs) -> None:
    from querator.v1 import queues_pb2

    stubs.create("q")
    stubs.produce("q", [b"old"])
    old = lease_now(stubs, "q").items[0]
    stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="q", force=True), timeout=10)
    stubs.create("q")
    stubs.produce("q", [b"new"])
    new = lease_now(stubs, "q").items[0]
    assert new.payload == b"new"
    expect_code(NOT_FOUND, stubs.queue.Complete, complete_req("q", 0, [old.id]), timeout=5)
    assert leased_count(stubs, "q") == 1


def test_huge_id_is_not_found_with_a_short_message(stubs: Stubs) -> None:
    stubs.create("q")
    huge = "7" * 10_240
    for rpc, request in (
        (stubs.queue.Complete, complete_req("q", 0, [huge])),
        (stubs.queue.Retry, retry_req("q", 0, [huge])),
        (stubs.queue.Extend, extend_req("q", 0, [huge])),
    ):
        err = expect_code(NOT_FOUND, rpc, request, timeout=5)
        assert len(message(err)) < 4096
        assert "7777" in message(err)  # the value is quoted, just cut short


def test_huge_duplicate_ids_give_short_invalid_argument(stubs: Stubs) -> None:
    stubs.create("q")
    huge = "7" * 10_240
    err = rpc_error(stubs.queue.Complete, complete_req("q", 0, [huge, huge]), timeout=5)
    assert_invalid(err, "ids[1]")
    assert len(message(err)) < 4096


# -- all-or-nothing ---------------------------------------------------------------------


def test_complete_with_one_bad_id_changes_nothing(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"a", b"b"])
    good = lease_now(stubs, "q", batch_size=1).items[0]
    err = expect_code(NOT_FOUND, stubs.queue.Complete, complete_req("q", 0, [good.id, "bogus-id"]), timeout=5)
    assert "bogus-id" in message(err)
    assert good.id not in message(err)
    assert stored(stubs, "q")[good.id].is_leased
    assert stubs.stats("q").partitions[0].total_leased == 1

    # A good id plus a ready (unleased) one: FAILED_PRECONDITION, still nothing changes.
    ready_id = next(i for i in stored(stubs, "q") if i != good.id)
    err = expect_code(PRECONDITION, stubs.queue.Complete, complete_req("q", 0, [good.id, ready_id]), timeout=5)
    assert ready_id in message(err)
    assert stubs.stats("q").partitions[0].total == 2
    assert stubs.stats("q").partitions[0].total_leased == 1
    stubs.complete("q", 0, [good.id])
    assert stubs.stats("q").partitions[0].total == 1


def test_complete_names_every_bad_id(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"a"])
    good = lease_now(stubs, "q").items[0]
    err = expect_code(NOT_FOUND, stubs.queue.Complete, complete_req("q", 0, ["bad-one", good.id, "bad-two"]), timeout=5)
    assert "bad-one" in message(err) and "bad-two" in message(err)
    assert leased_count(stubs, "q") == 1


def test_retry_with_one_bad_id_changes_nothing(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"a", b"b"])
    good = lease_now(stubs, "q", batch_size=1).items[0]
    before = stored(stubs, "q")
    err = expect_code(NOT_FOUND, stubs.queue.Retry, retry_req("q", 0, [good.id, "bogus-id"]), timeout=5)
    assert "bogus-id" in message(err)
    after = stored(stubs, "q")
    assert after.keys() == before.keys()  # no new id: the good item was not re-queued
    assert after[good.id].is_leased
    assert stubs.stats("q").partitions[0].total_leased == 1


def test_extend_with_one_bad_id_changes_nothing(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(30))
    stubs.produce("q", [b"a"])
    good = lease_now(stubs, "q").items[0]
    expect_code(NOT_FOUND, stubs.queue.Extend, extend_req("q", 0, [good.id, "bogus-id"], lease_timeout=dur(600)), timeout=5)
    assert stored(stubs, "q")[good.id].lease_deadline == good.lease_deadline


# -- produce and lease --------------------------------------------------------------------


def test_produce_returns_one_id_per_item_in_order(stubs: Stubs) -> None:
    stubs.create("q")
    produced = stubs.produce("q", [b"a", b"b", b"c"])
    assert produced.partition == 0
    assert len(produced.ids) == 3 and len(set(produced.ids)) == 3
    listed = stubs.list_items("q")
    assert [i.id for i in listed] == list(produced.ids)
    assert [i.payload for i in listed] == [b"a", b"b", b"c"]


def test_fifo_within_a_partition_across_requests(stubs: Stubs) -> None:
    stubs.create("q")
    expected: list[bytes] = []
    for batch in range(4):
        payloads = [f"{batch}-{i}".encode() for i in range(3)]
        stubs.produce("q", payloads)
        expected += payloads
    first = lease_now(stubs, "q", batch_size=5)
    rest = lease_now(stubs, "q", batch_size=100)
    assert [i.payload for i in first.items] == expected[:5]
    assert [i.payload for i in rest.items] == expected[5:]


def test_lease_returns_every_ready_item_up_to_batch_size(stubs: Stubs) -> None:
    stubs.create("q")
    for i in range(7):
        stubs.produce("q", [str(i).encode()])
    assert len(lease_now(stubs, "q", batch_size=5).items) == 5
    assert len(lease_now(stubs, "q", batch_size=5).items) == 2  # a partial batch comes at once
    assert len(lease_now(stubs, "q", batch_size=5).items) == 0


def test_leased_item_fields(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(30))
    before = time.time()
    produce_items(
        stubs,
        "q",
        [
            queue_pb2.ProduceItem(payload=b"\x00\x01bin", encoding="application/octet-stream", kind="k1", reference="ref-1"),
            queue_pb2.ProduceItem(utf8="h\u00e9llo", encoding="text/plain", kind="k2", reference="ref-2"),
            queue_pb2.ProduceItem(payload=b"bytes win", utf8="ignored"),
            queue_pb2.ProduceItem(),
        ],
    )
    after = time.time()
    leased = lease_now(stubs, "q")
    lease_returned = time.time()
    items = list(leased.items)
    assert leased.queue_name == "q" and leased.partition == 0
    assert [i.payload for i in items] == [b"\x00\x01bin", "h\u00e9llo".encode(), b"bytes win", b""]
    assert [(i.encoding, i.kind, i.reference) for i in items[:2]] == [
        ("application/octet-stream", "k1", "ref-1"),
        ("text/plain", "k2", "ref-2"),
    ]
    assert (items[3].encoding, items[3].kind, items[3].reference) == ("", "", "")
    assert len({i.id for i in items}) == 4
    for item in items:
        assert item.attempts == 1
        assert before - 1 <= secs(item.created_at) <= after + 1
        assert before + 30 - 1 <= secs(item.lease_deadline) <= lease_returned + 30 + 1


def test_produce_past_enqueue_at_is_ready_and_future_is_scheduled(stubs: Stubs) -> None:
    stubs.create("q")
    produce_items(
        stubs,
        "q",
        [
            queue_pb2.ProduceItem(payload=b"past", enqueue_at=ts_in(-60)),
            queue_pb2.ProduceItem(payload=b"future", enqueue_at=ts_in(60)),
            queue_pb2.ProduceItem(payload=b"now"),
        ],
    )
    stats = stubs.stats("q").partitions[0]
    assert (stats.total, stats.scheduled) == (2, 1)
    assert [i.payload for i in lease_now(stubs, "q").items] == [b"past", b"now"]


def test_produce_spreads_requests_over_partitions_and_lease_takes_the_fullest(stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=4)
    partitions = [stubs.produce("q", [f"single-{i}".encode()]).partition for i in range(4)]
    assert sorted(partitions) == [0, 1, 2, 3]
    # Every partition holds one ready item; a request of three lands on one of them,
    # which becomes the fullest.
    bulk = stubs.produce("q", [b"bulk-0", b"bulk-1", b"bulk-2"])
    counts = [p.total for p in stubs.stats("q").partitions]
    assert counts[bulk.partition] == 4 and sorted(counts) == [1, 1, 1, 4]
    # The next single item goes to a partition with the fewest ready items.
    single = stubs.produce("q", [b"next"])
    assert single.partition != bulk.partition
    leased = lease_now(stubs, "q", batch_size=100)
    assert leased.partition == bulk.partition
    assert len(leased.items) == 4
    assert [i.payload for i in leased.items][1:] == [b"bulk-0", b"bulk-1", b"bulk-2"]


def test_produce_goes_to_the_partition_with_fewest_ready_items(stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=3)
    partitions = [stubs.produce("q", [b"x"] * size).partition for size in (5, 6, 7)]
    assert len(set(partitions)) == 3
    # Lease all of the fullest partition: it now has the fewest ready items (leased
    # items do not count) and receives the next request.
    drained = lease_now(stubs, "q", batch_size=7)
    assert drained.partition == partitions[2]
    assert len(drained.items) == 7
    assert stubs.produce("q", [b"y"]).partition == partitions[2]
    assert stubs.produce("q", [b"y"] * 5).partition == partitions[2]
    assert stubs.produce("q", [b"y"]).partition == partitions[0]


# -- concurrent leases ------------------------------------------------------------------------


@pytest.mark.parametrize("produced", [2, 4, 10])
def test_waiting_leases_share_arriving_items(stubs: Stubs, produced: int) -> None:
    stubs.create("q")
    waiters = 4
    # When fewer items than waiters arrive, the callers left out wait out their
    # request_timeout; keep it short so they do not slow the test down.
    wait = 5.0 if produced >= waiters else 2.5
    calls = [
        stubs.queue.Lease.future(
            queue_pb2.LeaseRequest(queue_name="q", batch_size=100, client_id=f"c{n}", request_timeout=dur(wait)),
            timeout=10,
        )
        for n in range(waiters)
    ]
    wait_until(lambda: stubs.stats("q").lease_waiting == waiters, timeout=5)
    stubs.produce("q", [f"item-{i}".encode() for i in range(produced)])
    results = [call.result(timeout=10) for call in calls]
    got = [[i.payload for i in r.items] for r in results]
    everything = [p for g in got for p in g]
    assert sorted(everything) == sorted(f"item-{i}".encode() for i in range(produced)), got  # none twice
    if produced >= waiters:
        assert all(got), f"a waiter got nothing while others got items: {got}"
        assert max(map(len, got)) - min(map(len, got)) <= 1, got
    else:
        assert sorted(map(len, got)) == [0] * (waiters - produced) + [1] * produced, got
    assert stubs.stats("q").partitions[0].total_leased == produced


def test_racing_completes_and_retries_of_one_id_apply_once(stubs: Stubs) -> None:
    """The first to arrive applies; the others of its kind answer OK as already done
    (they may be sends again of it), the other kind NOT_FOUND."""
    stubs.create("q")
    stubs.produce("q", [b"a"])
    item = lease_now(stubs, "q").items[0]
    q = stubs.queue
    completes: list[grpc.Future] = [q.Complete.future(complete_req("q", 0, [item.id]), timeout=10) for _ in range(4)]
    retries: list[grpc.Future] = [q.Retry.future(retry_req("q", 0, [item.id]), timeout=10) for _ in range(4)]
    outcomes = []
    for call, already in [(c, "already_completed") for c in completes] + [(r, "already_retried") for r in retries]:
        error = call.exception(timeout=10)  # type: ignore[call-arg]
        if error is not None:
            outcomes.append(error.code())  # type: ignore[attr-defined]
        else:
            outcomes.append("again" if list(getattr(call.result(), already)) == [item.id] else "applied")
    assert outcomes.count("applied") == 1, outcomes
    complete_won = "applied" in outcomes[:4]
    mine, theirs = (outcomes[:4], outcomes[4:]) if complete_won else (outcomes[4:], outcomes[:4])
    assert sorted(mine) == ["again", "again", "again", "applied"], outcomes
    assert set(theirs) == {NOT_FOUND}, outcomes
    stats = stubs.stats("q").partitions[0]
    assert stats.total_leased == 0 and stats.total == (0 if complete_won else 1)


def test_same_client_id_concurrently_is_refused_at_once(stubs: Stubs) -> None:
    stubs.create("q")
    first = stubs.queue.Lease.future(
        queue_pb2.LeaseRequest(queue_name="q", batch_size=1, client_id="worker", request_timeout=dur(20)), timeout=30
    )
    wait_until(lambda: stubs.stats("q").lease_waiting == 1, timeout=10)
    started = time.monotonic()
    err = expect_code(
        PRECONDITION, stubs.lease, "q", batch_size=1, client_id="worker", request_timeout=dur(20), timeout=30
    )
    assert time.monotonic() - started < PROMPT  # refused, not left to wait
    assert "worker" in message(err)
    # The same client_id on another queue, and an empty client_id, are not refused.
    stubs.create("other")
    assert list(stubs.lease("other", batch_size=1, client_id="worker", request_timeout=dur(0.2)).items) == []
    assert list(stubs.lease("q", batch_size=1, client_id="", request_timeout=dur(0.2)).items) == []
    stubs.produce("q", [b"x"])
    assert [i.payload for i in first.result(timeout=10).items] == [b"x"]
    # Once the first call has returned the client_id may lease again.
    stubs.produce("q", [b"y"])
    assert [i.payload for i in stubs.lease("q", batch_size=1, client_id="worker", request_timeout=dur(0.5)).items] == [b"y"]


def test_competing_consumers_never_get_an_item_twice(server: ThreadServer, stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=3)
    total = 150
    seen: list[bytes] = []
    lock = threading.Lock()
    stop = time.monotonic() + 15

    def consume(n: int) -> None:
        channel_stubs = Stubs(grpc.insecure_channel(server.address))
        try:
            while time.monotonic() < stop:
                with lock:
                    if len(seen) >= total:
                        return
                response = channel_stubs.lease("q", batch_size=7, client_id=f"c{n}", request_timeout=dur(0.3))
                if response.items:
                    channel_stubs.complete("q", response.partition, [i.id for i in response.items])
                with lock:
                    seen.extend(i.payload for i in response.items)
        finally:
            channel_stubs.channel.close()

    with ThreadPoolExecutor(5) as pool:
        workers = [pool.submit(consume, n) for n in range(5)]
        for batch in range(10):
            stubs.produce("q", [f"{batch}-{i}".encode() for i in range(total // 10)])
        for worker in workers:
            worker.result(timeout=20)
    assert len(seen) == total
    assert len(set(seen)) == total
    assert sum(p.total for p in stubs.stats("q").partitions) == 0


def test_concurrent_empty_client_ids_all_wait(stubs: Stubs) -> None:
    stubs.create("q")
    calls = [
        stubs.queue.Lease.future(queue_pb2.LeaseRequest(queue_name="q", batch_size=1, request_timeout=dur(5)), timeout=10)
        for _ in range(3)
    ]
    wait_until(lambda: stubs.stats("q").lease_waiting == 3, timeout=5)
    stubs.produce("q", [b"a", b"b", b"c"])
    got = sorted(p.payload for c in calls for p in c.result(timeout=5).items)
    assert got == [b"a", b"b", b"c"]


# -- long poll ----------------------------------------------------------------------------------


def test_lease_waits_request_timeout_then_answers_empty(stubs: Stubs) -> None:
    stubs.create("q")
    started = time.monotonic()
    response = stubs.lease("q", batch_size=1, request_timeout=dur(0.5), timeout=30)
    elapsed = time.monotonic() - started
    assert list(response.items) == []
    assert 0.45 <= elapsed < 0.5 + PROMPT, elapsed  # not held until the call deadline


def test_lease_with_only_a_call_deadline_answers_ok_before_it(stubs: Stubs) -> None:
    stubs.create("q")
    started = time.monotonic()
    response = stubs.queue.Lease(queue_pb2.LeaseRequest(queue_name="q", batch_size=1), timeout=1.0)
    elapsed = time.monotonic() - started
    assert list(response.items) == []
    assert 0.5 <= elapsed < 1.0, elapsed


def test_lease_with_request_timeout_beyond_the_call_deadline_answers_ok(stubs: Stubs) -> None:
    stubs.create("q")
    started = time.monotonic()
    response = stubs.lease("q", batch_size=1, request_timeout=dur(10), timeout=1.0)
    assert list(response.items) == []
    assert time.monotonic() - started < 1.0


def test_produce_wakes_a_waiting_lease_promptly(stubs: Stubs) -> None:
    stubs.create("q")
    call = stubs.queue.Lease.future(
        queue_pb2.LeaseRequest(queue_name="q", batch_size=10, request_timeout=dur(20)), timeout=30
    )
    wait_until(lambda: stubs.stats("q").lease_waiting == 1, timeout=10)
    started = time.monotonic()
    stubs.produce("q", [b"wake"])
    response = call.result(timeout=20)
    assert time.monotonic() - started < PROMPT
    assert [i.payload for i in response.items] == [b"wake"]


def test_hung_up_lease_is_given_nothing(stubs: Stubs) -> None:
    stubs.create("q")
    call = stubs.queue.Lease.future(
        queue_pb2.LeaseRequest(queue_name="q", batch_size=10, client_id="gone", request_timeout=dur(5)), timeout=10
    )
    wait_until(lambda: stubs.stats("q").lease_waiting == 1, timeout=5)
    assert call.cancel()
    wait_until(lambda: stubs.stats("q").lease_waiting == 0, timeout=5)
    stubs.produce("q", [b"kept"])
    stats = stubs.stats("q").partitions[0]
    assert (stats.total, stats.total_leased) == (1, 0)
    # Another caller (even with the same client_id) gets it, as a first lease.
    leased = stubs.lease("q", batch_size=10, client_id="gone", request_timeout=dur(1))
    assert [(i.payload, i.attempts) for i in leased.items] == [(b"kept", 1)]


# -- size limits and malformed requests --------------------------------------------------------------


def test_produce_of_four_and_a_half_megabytes_succeeds(stubs: Stubs, big_channel: grpc.Channel) -> None:
    stubs.create("q")
    big = Stubs(big_channel)
    payloads = [bytes([i]) * 900_000 for i in range(5)]
    produced = big.produce("q", payloads)
    assert len(produced.ids) == 5
    # A reply is kept within 4 MiB (what gRPC clients receive by default): the first
    # lease takes the items that fit, the next one the rest.
    leased = big.lease("q", batch_size=10, request_timeout=dur(0.5))
    assert leased.ByteSize() <= 4 << 20
    rest = big.lease("q", batch_size=10, request_timeout=dur(0.5))
    assert [i.payload for i in (*leased.items, *rest.items)] == payloads


def test_produce_over_five_megabytes_is_resource_exhausted(stubs: Stubs, big_channel: grpc.Channel) -> None:
    stubs.create("q")
    big = Stubs(big_channel)
    err = expect_code(grpc.StatusCode.RESOURCE_EXHAUSTED, big.produce, "q", [b"z" * 1_000_000] * 6)
    assert message(err)
    # Nothing stored, and the connection still works.
    assert big.stats("q").partitions[0].total == 0
    assert len(big.produce("q", [b"small"]).ids) == 1


def test_undecodable_request_bytes_are_invalid_argument(server: ThreadServer) -> None:
    channel = grpc.insecure_channel(server.address)
    try:
        for method in ("Produce", "Lease", "Complete", "Retry", "Extend"):
            raw = channel.unary_unary(
                f"/querator.v1.QueueService/{method}",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )
            err = rpc_error(raw, b"\xff\xff\xff", timeout=5)
            assert err.code() == INVALID, (method, err.code(), message(err))
            # A string field (queue_name) that is not UTF-8.
            err = rpc_error(raw, b"\x0a\x02\xff\xfe", timeout=5)
            assert err.code() == INVALID, (method, err.code(), message(err))
    finally:
        channel.close()


# -- retry --------------------------------------------------------------------------------------------


def test_retry_now_moves_the_item_to_the_tail_with_a_new_id(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"a", b"b"])
    first = lease_now(stubs, "q", batch_size=1).items[0]
    assert (first.payload, first.attempts) == (b"a", 1)
    stubs.queue.Retry(retry_req("q", 0, [first.id]), timeout=5)

    listed = stubs.list_items("q")
    assert [i.payload for i in listed] == [b"b", b"a"]
    requeued = listed[1]
    assert requeued.id != first.id
    assert not requeued.is_leased
    assert requeued.attempts == 1  # retry does not count; the next lease does
    stats = stubs.stats("q").partitions[0]
    assert (stats.total, stats.total_leased) == (2, 0)

    again = lease_now(stubs, "q", batch_size=10).items
    assert [(i.payload, i.attempts) for i in again] == [(b"b", 1), (b"a", 2)]
    assert again[1].id == requeued.id
    assert again[1].created_at == first.created_at
    expect_code(NOT_FOUND, stubs.queue.Complete, complete_req("q", 0, [first.id]), timeout=5)
    # The same Retry sent again is answered as done, and retries nothing a second time.
    resent = stubs.queue.Retry(retry_req("q", 0, [first.id]), timeout=5)
    assert (list(resent.already_retried), list(resent.dead_ids)) == ([first.id], [])
    assert stubs.stats("q").partitions[0].total_leased == 2
    stubs.complete("q", 0, [i.id for i in again])
    assert stubs.stats("q").partitions[0].total == 0


def test_retry_answers_the_ids_it_dead_lettered(stubs: Stubs) -> None:
    stubs.create("q", max_attempts=2)
    stubs.produce("q", [b"a", b"b", b"c"])
    first = lease_now(stubs, "q", batch_size=3).items
    reply = stubs.queue.Retry(retry_req("q", 0, [i.id for i in first]), timeout=5)
    assert list(reply.dead_ids) == []  # attempts 1 of 2: all back in the queue
    second = lease_now(stubs, "q", batch_size=3).items
    assert [i.attempts for i in second] == [2, 2, 2]
    request = queue_pb2.RetryRequest(
        queue_name="q",
        partition=0,
        items=[queue_pb2.RetryItem(id=second[0].id), queue_pb2.RetryItem(id=second[1].id, dead=True)],
    )
    reply = stubs.queue.Retry(request, timeout=5)
    # Out of attempts, and sent dead: both dead-lettered (deleted: no DLQ), in the order sent.
    assert list(reply.dead_ids) == [second[0].id, second[1].id]
    stubs.complete("q", 0, [second[2].id])
    assert stubs.stats("q").partitions[0].total == 0


def test_retry_at_in_the_past_is_immediate(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"a"])
    item = lease_now(stubs, "q").items[0]
    stubs.queue.Retry(retry_req("q", 0, [item.id], retry_at=ts_in(-30)), timeout=5)
    stats = stubs.stats("q").partitions[0]
    assert (stats.total, stats.total_leased, stats.scheduled) == (1, 0, 0)
    assert [(i.payload, i.attempts) for i in lease_now(stubs, "q").items] == [(b"a", 2)]


def test_retry_at_in_the_future_schedules_the_item(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"a"])
    item = lease_now(stubs, "q").items[0]
    due = ts_in(60)
    stubs.queue.Retry(retry_req("q", 0, [item.id], retry_at=due), timeout=5)
    stats = stubs.stats("q").partitions[0]
    assert (stats.total, stats.total_leased, stats.scheduled) == (0, 0, 1)
    scheduled = stubs.storage.ListScheduledItems(storage_pb2.ListScheduledItemsRequest(queue_name="q"), timeout=5).items
    assert [i.payload for i in scheduled] == [b"a"]
    assert abs(secs(scheduled[0].enqueue_at) - secs(due)) < 0.01
    assert scheduled[0].attempts == 1
    assert list(lease_now(stubs, "q").items) == []
    expect_code(NOT_FOUND, stubs.queue.Complete, complete_req("q", 0, [item.id]), timeout=5)


# -- extend ----------------------------------------------------------------------------------------------


def test_extend_returns_a_later_deadline_per_id(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(10))
    stubs.produce("q", [b"a", b"b"])
    items = list(lease_now(stubs, "q").items)
    before = time.time()
    response = stubs.queue.Extend(extend_req("q", 0, [items[1].id, items[0].id], lease_timeout=dur(120)), timeout=5)
    assert len(response.lease_deadlines) == 2
    for deadline, item in zip(response.lease_deadlines, [items[1], items[0]]):
        assert secs(deadline) > secs(item.lease_deadline)
        assert before + 120 - 1 <= secs(deadline) <= time.time() + 120 + 1
    listed = stored(stubs, "q")
    assert listed[items[1].id].lease_deadline == response.lease_deadlines[0]
    assert listed[items[0].id].lease_deadline == response.lease_deadlines[1]


def test_extend_defaults_to_the_queue_lease_timeout(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(30))
    stubs.produce("q", [b"a"])
    item = lease_now(stubs, "q").items[0]
    time.sleep(0.05)  # bounded: lets the clock move so the new deadline is later
    before = time.time()
    response = stubs.queue.Extend(extend_req("q", 0, [item.id]), timeout=5)
    after = time.time()
    (deadline,) = response.lease_deadlines
    assert secs(deadline) > secs(item.lease_deadline)
    assert before + 30 - 0.01 <= secs(deadline) <= after + 30 + 0.01


def test_extend_never_passes_the_item_expiry(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(10), expire_timeout=dur(20))
    stubs.produce("q", [b"a"])
    item = lease_now(stubs, "q").items[0]
    (deadline,) = stubs.queue.Extend(extend_req("q", 0, [item.id], lease_timeout=dur(3600)), timeout=5).lease_deadlines
    expire = stored(stubs, "q")[item.id].expire_deadline
    assert secs(deadline) <= secs(expire)
    assert secs(deadline) > secs(item.lease_deadline)


def test_extend_unknown_id_is_not_found(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"a"])
    lease_now(stubs, "q")
    err = expect_code(NOT_FOUND, stubs.queue.Extend, extend_req("q", 0, ["0.0.99"]), timeout=5)
    assert "0.0.99" in message(err)


# -- stats -----------------------------------------------------------------------------------------------


def test_stats_follow_produce_lease_complete_retry(stubs: Stubs) -> None:
    stubs.create("q")

    def counts() -> tuple[int, int, int]:
        p = stubs.stats("q").partitions[0]
        return (p.total, p.total_leased, p.scheduled)

    assert counts() == (0, 0, 0)
    stubs.produce("q", [b"a", b"b", b"c"])
    assert counts() == (3, 0, 0)
    leased = lease_now(stubs, "q", batch_size=2).items
    assert counts() == (3, 2, 0)
    stubs.complete("q", 0, [leased[0].id])
    assert counts() == (2, 1, 0)
    stubs.queue.Retry(retry_req("q", 0, [leased[1].id]), timeout=5)
    assert counts() == (2, 0, 0)
    produce_items(stubs, "q", [queue_pb2.ProduceItem(payload=b"later", enqueue_at=ts_in(60))])
    assert counts() == (2, 0, 1)
    again = lease_now(stubs, "q", batch_size=10).items
    assert len(again) == 2
    assert counts() == (2, 2, 1)
    stubs.complete("q", 0, [i.id for i in again])
    assert counts() == (0, 0, 1)


def test_stats_count_waiting_leases(stubs: Stubs) -> None:
    stubs.create("q")
    assert stubs.stats("q").lease_waiting == 0
    # Long enough to be seen waiting by the polling below on a loaded machine.
    call = stubs.queue.Lease.future(
        queue_pb2.LeaseRequest(queue_name="q", batch_size=1, request_timeout=dur(2)), timeout=10
    )
    wait_until(lambda: stubs.stats("q").lease_waiting == 1, timeout=10)
    assert list(call.result(timeout=10).items) == []
    wait_until(lambda: stubs.stats("q").lease_waiting == 0, timeout=10)


# -- Lease with complete_ids: one call per batch -------------------------------------


def _lease_completing(stubs: Stubs, name: str, partition: int, ids: list[str], **kw: object) -> queue_pb2.LeaseResponse:
    request = queue_pb2.LeaseRequest(
        queue_name=name, batch_size=10, complete_ids=ids, complete_partition=partition, **kw  # type: ignore[arg-type]
    )
    return stubs.queue.Lease(request, timeout=5)


def test_lease_completes_the_previous_batch_then_leases(stubs: Stubs) -> None:
    stubs.create("lc")
    stubs.produce("lc", [b"a", b"b"])
    first = stubs.lease("lc", batch_size=1)
    stubs.produce("lc", [b"c"])
    second = _lease_completing(stubs, "lc", first.partition, [first.items[0].id])
    assert [i.payload for i in second.items] == [b"b", b"c"]
    stored = {i.id for i in stubs.list_items("lc")}
    assert first.items[0].id not in stored
    assert stubs.stats("lc").partitions[0].total_leased == 2


def test_lease_with_a_bad_complete_id_completes_and_leases_nothing(stubs: Stubs) -> None:
    stubs.create("lcbad")
    stubs.produce("lcbad", [b"a", b"b"])
    first = stubs.lease("lcbad", batch_size=1)
    with pytest.raises(grpc.RpcError) as err:
        _lease_completing(stubs, "lcbad", first.partition, [first.items[0].id, "1.0.ff"])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "complete_ids[1]" in err.value.details()
    stats = stubs.stats("lcbad").partitions[0]
    assert (stats.total, stats.total_leased) == (2, 1)


def test_lease_completion_is_applied_once_even_when_the_lease_waits(stubs: Stubs) -> None:
    stubs.create("lcwait")
    stubs.produce("lcwait", [b"only"])
    first = stubs.lease("lcwait", batch_size=1)
    # Nothing else is ready: the completion commits at once, then the lease waits.
    future = stubs.queue.Lease.future(
        queue_pb2.LeaseRequest(
            queue_name="lcwait",
            batch_size=1,
            complete_ids=[first.items[0].id],
            complete_partition=first.partition,
            request_timeout={"seconds": 5},
        ),
        timeout=10,
    )
    wait_until(lambda: stubs.stats("lcwait").partitions[0].total == 0, timeout=5)
    assert stubs.stats("lcwait").lease_waiting == 1
    stubs.produce("lcwait", [b"next"])
    assert [i.payload for i in future.result(timeout=5).items] == [b"next"]


def test_lease_complete_ids_are_validated(stubs: Stubs) -> None:
    stubs.create("lcval", requested_partitions=2)
    for ids, partition, field in ((["", "x"], 0, "complete_ids[0]"), (["x", "x"], 0, "complete_ids[1]"), (["x"], 2, "complete_partition")):
        with pytest.raises(grpc.RpcError) as err:
            _lease_completing(stubs, "lcval", partition, ids)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
