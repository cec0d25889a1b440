"""Replies fit what a client can receive: a Lease takes items up to a byte budget
(unary and stream alike) instead of committing a lease whose reply cannot be sent,
and listing pages are cut by bytes too."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from querator.v1 import queue_pb2, queues_pb2, storage_pb2

from conftest import Stubs, ThreadServer, bad_request_fields, dur

# What gRPC clients accept by default, and so what every reply is built to fit.
DEFAULT_RECEIVE = 4 << 20
ITEM = 10_000
BIG = 4_900_000


@pytest.fixture
def big_channel(server: ThreadServer) -> Iterator[grpc.Channel]:
    """A channel that receives up to 64 MiB, as the SDK's does: big enough for the
    9.2 MB the server may send, so only the server's own limits are tested."""
    channel = grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", 64 << 20)])
    yield channel
    channel.close()


def _fill(stubs: Stubs, name: str, count: int, size: int) -> list[str]:
    ids: list[str] = []
    per_request = max(1, 4_000_000 // size)
    for start in range(0, count, per_request):
        n = min(per_request, count - start)
        payloads = [f"{start + i:08d}".encode().ljust(size, b".") for i in range(n)]
        ids.extend(stubs.produce(name, payloads).ids)
    return ids


def test_a_lease_of_more_than_a_reply_holds_takes_what_fits_and_loses_nothing(stubs: Stubs, big_channel: grpc.Channel) -> None:
    stubs.create("q", lease_timeout=dur(5), max_attempts=2)
    produced = _fill(stubs, "q", 1200, ITEM)
    lease = Stubs(big_channel).queue.Lease
    first = lease(queue_pb2.LeaseRequest(queue_name="q", batch_size=1000), timeout=10)
    second = lease(queue_pb2.LeaseRequest(queue_name="q", batch_size=1000), timeout=10)
    for reply in (first, second):
        assert 0 < len(reply.items) < 1000
        assert reply.ByteSize() <= DEFAULT_RECEIVE
        # Nearly full: the budget stops near the item that would overflow, not far earlier.
        assert reply.ByteSize() > 0.9 * DEFAULT_RECEIVE
    # Leased exactly what was answered: the rest is still ready, never burnt.
    stats = stubs.stats("q").partitions[0]
    assert stats.total_leased == len(first.items) + len(second.items)
    delivered = [item.id for reply in (first, second) for item in reply.items]
    # A client with gRPC's default limit reads the rest, reply by reply.
    while len(delivered) < len(produced):
        reply = stubs.lease("q", batch_size=1000, request_timeout=dur(0))
        assert reply.items, f"{len(produced) - len(delivered)} items never delivered"
        delivered.extend(item.id for item in reply.items)
        assert all(item.attempts == 1 for item in reply.items)
    assert sorted(delivered) == sorted(produced)
    assert all(item.attempts == 1 for reply in (first, second) for item in reply.items)


def test_items_near_the_request_limit_are_leased_one_a_reply(stubs: Stubs, big_channel: grpc.Channel) -> None:
    stubs.create("q", lease_timeout=dur(5), max_attempts=2)
    produced = _fill(stubs, "q", 2, BIG)
    lease = Stubs(big_channel).queue.Lease
    replies = [lease(queue_pb2.LeaseRequest(queue_name="q", batch_size=2), timeout=10) for _ in range(2)]
    assert [len(r.items) for r in replies] == [1, 1]
    assert [r.items[0].id for r in replies] == produced
    assert [len(r.items[0].payload) for r in replies] == [BIG, BIG]
    assert [r.items[0].attempts for r in replies] == [1, 1]


def test_items_with_strings_and_metadata_are_counted_too(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(5))
    metadata = {f"key{i}": "v" * 200 for i in range(64)}
    item = queue_pb2.ProduceItem(payload=b"x" * ITEM, reference="r" * 500, kind="k", encoding="e", metadata=metadata)
    for _ in range(6):
        stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="q", items=[item] * 100), timeout=10)
    total = 0
    for columnar in (False, True, False):
        reply = stubs.lease("q", batch_size=1000, columnar=columnar, request_timeout=dur(0))
        count = len(reply.columns.ids) if columnar else len(reply.items)
        assert 0 < count < 1000
        assert reply.ByteSize() <= DEFAULT_RECEIVE
        total += count
    assert stubs.stats("q").partitions[0].total_leased == total


def _lease_message(name: str, batch_size: int) -> queue_pb2.LeaseStreamRequest:
    request = queue_pb2.LeaseRequest(queue_name=name, batch_size=batch_size, request_timeout=dur(0))
    return queue_pb2.LeaseStreamRequest(request=request)


def test_lease_stream_answers_fit_and_deliver_every_item(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(5), max_attempts=2)
    produced = _fill(stubs, "q", 1200, ITEM)
    # Three Leases in flight at a time, the next sent as an answer arrives, until every
    # item came: no answer too big to send, no item leased twice or lost.
    outbox: queue.Queue[queue_pb2.LeaseStreamRequest | None] = queue.Queue()
    for _ in range(3):
        outbox.put(_lease_message("q", 1000))
    delivered: list[str] = []
    answers = 0
    call = stubs.queue.LeaseStream(iter(outbox.get, None), timeout=30)
    for answer in call:
        answers += 1
        assert answer.WhichOneof("result") == "response"
        assert answer.ByteSize() <= DEFAULT_RECEIVE
        assert all(item.attempts == 1 for item in answer.response.items)
        delivered.extend(item.id for item in answer.response.items)
        outbox.put(_lease_message("q", 1000) if len(delivered) < len(produced) and answers < 50 else None)
    assert sorted(delivered) == sorted(produced)


def _pages(fetch: Callable[[str], Any], names: Callable[[Any], list[str]]) -> tuple[list[str], int]:
    """Every page ``fetch(token)`` answers, from the first, each within what a default
    client receives: the ``names`` on them in order, and how many pages there were."""
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        page = fetch(token)
        assert page.ByteSize() <= DEFAULT_RECEIVE
        seen.extend(names(page))
        pages += 1
        token = page.next_page_token
        if not token:
            return seen, pages


def _list_items(stubs: Stubs) -> Callable[[str], storage_pb2.ListItemsResponse]:
    return lambda token: stubs.storage.ListItems(
        storage_pb2.ListItemsRequest(queue_name="q", page_size=1000, page_token=token), timeout=10
    )


def _ids(page: Any) -> list[str]:
    return [item.id for item in page.items]


def test_list_items_pages_are_cut_by_bytes(stubs: Stubs) -> None:
    stubs.create("q")
    produced = _fill(stubs, "q", 1200, ITEM)
    seen, pages = _pages(_list_items(stubs), _ids)
    assert seen == produced
    assert pages >= 3


def test_list_scheduled_items_pages_are_cut_by_bytes(stubs: Stubs) -> None:
    stubs.create("q")
    later = queue_pb2.ProduceItem(payload=b"s" * ITEM)
    later.enqueue_at.GetCurrentTime()
    later.enqueue_at.seconds += 3600
    produced: list[str] = []
    for _ in range(3):
        produced.extend(stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="q", items=[later] * 400), timeout=10).ids)
    seen, _ = _pages(
        lambda token: stubs.storage.ListScheduledItems(
            storage_pb2.ListScheduledItemsRequest(queue_name="q", page_size=1000, page_token=token), timeout=10
        ),
        _ids,
    )
    assert sorted(seen) == sorted(produced)


def test_list_queues_pages_are_cut_by_bytes(data_dir: str) -> None:
    # The longest names and reference allowed, in 4-byte characters: 820 queues of
    # about 5.2 KB each make a page of 1000 larger than a default client receives.
    srv = ThreadServer(data_dir, sync=False)
    channel = grpc.insecure_channel(srv.address)
    try:
        stubs = Stubs(channel)
        dead = "\U0001d538" * 512
        stubs.create(dead)
        names = [f"{i:04d}" + "\U0001d539" * 508 for i in range(820)]
        for name in names:
            stubs.create(name, dead_queue=dead, reference="\u00e9" * 512)
        seen, pages = _pages(
            lambda token: stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(page_size=1000, page_token=token), timeout=30),
            lambda page: [q.queue_name for q in page.queues],
        )
        assert sorted(seen) == sorted([*names, dead])
        assert pages == 2
    finally:
        channel.close()
        srv.stop()


@pytest.mark.parametrize(
    ("field", "value"),
    [("reference", "r" * 1025), ("reference", "\u00e9" * 513)],
)
def test_a_queue_reference_over_1024_bytes_is_invalid(stubs: Stubs, field: str, value: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stubs.create("q", **{field: value})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == [f"queue.{field}"]
    stubs.create("q", reference="\u00e9" * 512)  # 1024 bytes: accepted
    with pytest.raises(grpc.RpcError) as err:
        stubs.queues.UpdateQueue(
            queues_pb2.UpdateQueueRequest(
                queue=queues_pb2.QueueInfo(queue_name="q", reference=value),
                update_mask=field_mask_pb2.FieldMask(paths=["reference"]),
            ),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["queue.reference"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("encoding", "e" * 257), ("kind", "k" * 257), ("reference", "r" * 1025), ("kind", "\u00e9" * 129)],
)
def test_item_labels_over_their_limit_are_invalid(stubs: Stubs, field: str, value: str) -> None:
    stubs.create("q")
    items = [queue_pb2.ProduceItem(payload=b"ok"), queue_pb2.ProduceItem(payload=b"x", **{field: value})]
    with pytest.raises(grpc.RpcError) as err:
        stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="q", items=items), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == [f"items[1].{field}"]
    with pytest.raises(grpc.RpcError) as err:
        stubs.storage.ImportItems(
            storage_pb2.ImportItemsRequest(queue_name="q", items=[storage_pb2.StorageItem(payload=b"x", **{field: value})]),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == [f"items[0].{field}"]
    assert stubs.stats("q").partitions[0].total == 0


def test_a_client_id_over_256_bytes_is_invalid(stubs: Stubs) -> None:
    stubs.create("q")
    with pytest.raises(grpc.RpcError) as err:
        stubs.lease("q", batch_size=1, client_id="c" * 257, request_timeout=dur(0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["client_id"]
    assert len(stubs.lease("q", batch_size=1, client_id="c" * 256, request_timeout=dur(0)).items) == 0


def test_a_page_whose_entries_outgrow_the_estimate_is_cut_exactly(
    stubs: Stubs, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With no allowance for what an entry adds to its payload, the storage step's cut
    # lets a page grow past 4 MiB; the exact cut in the reply must catch it and page on.
    from querator_server.actor import storage_steps

    monkeypatch.setattr(storage_steps, "ITEM_REPLY_OVERHEAD", 0)
    stubs.create("q")
    produced = _fill(stubs, "q", 1200, ITEM)
    seen, _ = _pages(_list_items(stubs), _ids)
    assert seen == produced
