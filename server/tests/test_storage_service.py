"""Contract tests for querator.v1.StorageService (see spec/API.md: StorageItem, paging).

Every test talks to a real server over a real gRPC channel, with real LMDB storage
in a temp dir.
"""

from __future__ import annotations

import base64
import struct
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from google.protobuf import field_mask_pb2, timestamp_pb2

from querator.v1 import queue_pb2, queues_pb2, storage_pb2

from conftest import ProcessServer, Stubs, ThreadServer, bad_request_fields, dur, expect_code, secs

Code = grpc.StatusCode
HOUR = 3600


# -- helpers ------------------------------------------------------------------------






def ts_at(seconds: float) -> timestamp_pb2.Timestamp:
    """A Timestamp at a whole microsecond (the server's resolution)."""
    ts = timestamp_pb2.Timestamp()
    ts.FromMicroseconds(int(seconds * 1e6))
    return ts


def expect_invalid(call: Callable[[], object], field: str) -> grpc.RpcError:
    """The call fails INVALID_ARGUMENT with a BadRequest violation naming ``field``."""
    error = expect_code(call, Code.INVALID_ARGUMENT)
    named = bad_request_fields(error)
    assert field in named, f"violations {named} do not name {field}: {error.details()}"
    return error


def list_items(
    stubs: Stubs, name: str, partition: int = 0, page_size: int = 0, page_token: str = ""
) -> storage_pb2.ListItemsResponse:
    request = storage_pb2.ListItemsRequest(
        queue_name=name, partition=partition, page_size=page_size, page_token=page_token
    )
    return stubs.storage.ListItems(request, timeout=10)


def list_scheduled(
    stubs: Stubs, name: str, partition: int = 0, page_size: int = 0, page_token: str = ""
) -> storage_pb2.ListScheduledItemsResponse:
    request = storage_pb2.ListScheduledItemsRequest(
        queue_name=name, partition=partition, page_size=page_size, page_token=page_token
    )
    return stubs.storage.ListScheduledItems(request, timeout=10)


def walk(
    lister: Callable[..., object], stubs: Stubs, name: str, page_size: int, partition: int = 0, token: str = ""
) -> tuple[list[storage_pb2.StorageItem], list[int]]:
    """Every item over all pages (from ``token`` on), and the size of each page."""
    items: list[storage_pb2.StorageItem] = []
    sizes: list[int] = []
    for _ in range(10_000):
        page = lister(stubs, name, partition, page_size, token)
        items.extend(page.items)  # type: ignore[attr-defined]
        sizes.append(len(page.items))  # type: ignore[attr-defined]
        token = page.next_page_token  # type: ignore[attr-defined]
        if not token:
            return items, sizes
    raise AssertionError("the listing never returned an empty next_page_token")


def produce_items(stubs: Stubs, name: str, items: list[queue_pb2.ProduceItem]) -> queue_pb2.ProduceResponse:
    return stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=items), timeout=10)


def import_items(stubs: Stubs, name: str, items: list[storage_pb2.StorageItem], partition: int = 0) -> list[str]:
    request = storage_pb2.ImportItemsRequest(queue_name=name, partition=partition, items=items)
    return list(stubs.storage.ImportItems(request, timeout=10).ids)


def delete_items(stubs: Stubs, name: str, ids: list[str], partition: int = 0) -> None:
    request = storage_pb2.DeleteItemsRequest(queue_name=name, partition=partition, ids=ids)
    stubs.storage.DeleteItems(request, timeout=10)


def counts(stubs: Stubs, name: str) -> list[tuple[int, int, int]]:
    """(total, total_leased, scheduled) per partition."""
    return [(p.total, p.total_leased, p.scheduled) for p in stubs.stats(name).partitions]


def payloads(items: object) -> list[bytes]:
    return [i.payload for i in items]  # type: ignore[attr-defined]


# -- ListItems ------------------------------------------------------------------------


def test_list_items_returns_ready_and_leased_items_with_every_field(stubs: Stubs) -> None:
    stubs.create("q", expire_timeout=dur(2 * HOUR), lease_timeout=dur(90))
    before = time.time()
    produced = produce_items(
        stubs,
        "q",
        [
            queue_pb2.ProduceItem(payload=b"\x00\x01bin", encoding="application/octet-stream", kind="k1", reference="r1"),
            queue_pb2.ProduceItem(utf8='{"n": 2}', encoding="application/json", kind="k2", reference="r2"),
            queue_pb2.ProduceItem(payload=b"three"),
        ],
    )
    after_produce = time.time()
    leased = stubs.lease("q", batch_size=1)
    after_lease = time.time()
    assert len(leased.items) == 1

    items = list(list_items(stubs, "q").items)
    assert [i.id for i in items] == list(produced.ids), "ListItems ids are the ids Produce returned, in FIFO order"
    first, second, third = items

    assert first.is_leased and not second.is_leased and not third.is_leased
    assert first.HasField("lease_deadline")
    assert first.lease_deadline == leased.items[0].lease_deadline
    assert after_produce + 90 - 0.01 <= secs(first.lease_deadline) <= after_lease + 90 + 0.01
    assert not second.HasField("lease_deadline") and not third.HasField("lease_deadline")
    assert (first.attempts, second.attempts, third.attempts) == (1, 0, 0)

    for item in items:
        assert before - 0.01 <= secs(item.created_at) <= after_produce + 0.01
        assert abs(secs(item.expire_deadline) - (secs(item.created_at) + 2 * HOUR)) < 1
        assert not item.HasField("enqueue_at")
        assert item.source_id == ""
    assert first.created_at == leased.items[0].created_at

    assert (first.payload, first.encoding, first.kind, first.reference) == (
        b"\x00\x01bin", "application/octet-stream", "k1", "r1"
    )
    assert (second.payload, second.encoding, second.kind, second.reference) == (
        b'{"n": 2}', "application/json", "k2", "r2"
    )
    assert (third.payload, third.encoding, third.kind, third.reference) == (b"three", "", "", "")


def test_list_items_on_an_empty_partition(stubs: Stubs) -> None:
    stubs.create("q")
    page = list_items(stubs, "q")
    assert list(page.items) == [] and page.next_page_token == ""


def test_list_items_pages_cover_every_item_once(stubs: Stubs) -> None:
    stubs.create("q")
    ids = list(stubs.produce("q", [b"%d" % i for i in range(25)]).ids)
    stubs.lease("q", batch_size=3)
    items, sizes = walk(list_items, stubs, "q", 10)
    assert [i.id for i in items] == ids
    assert payloads(items) == [b"%d" % i for i in range(25)]
    assert sizes == [10, 10, 5]
    assert [i.is_leased for i in items] == [True] * 3 + [False] * 22
    # A page size that divides the count exactly ends without an empty trailing page.
    items, sizes = walk(list_items, stubs, "q", 5)
    assert [i.id for i in items] == ids and sizes == [5] * 5
    items, sizes = walk(list_items, stubs, "q", 1)
    assert [i.id for i in items] == ids and len(sizes) == 25


def test_list_items_pages_are_stable_while_the_queue_changes(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"%02d" % i for i in range(12)])
    first = list_items(stubs, "q", page_size=5)
    assert payloads(first.items) == [b"%02d" % i for i in range(5)]
    # Between pages: new items arrive, the item the token points after is deleted,
    # and an item already listed is leased (it stays where it is).
    stubs.produce("q", [b"new-1", b"new-2"])
    delete_items(stubs, "q", [first.items[-1].id])
    stubs.lease("q", batch_size=1)
    rest, _ = walk(list_items, stubs, "q", 5, token=first.next_page_token)
    assert payloads(rest) == [b"%02d" % i for i in range(5, 12)] + [b"new-1", b"new-2"]
    seen = [i.id for i in first.items] + [i.id for i in rest]
    assert len(seen) == len(set(seen))


def test_list_items_page_size_default_cap_and_negative(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"x"] * 1000)
    stubs.produce("q", [b"y"])
    default = list_items(stubs, "q", page_size=0)
    assert len(default.items) == 100 and default.next_page_token
    capped = list_items(stubs, "q", page_size=5000)
    assert len(capped.items) == 1000 and capped.next_page_token
    last = list_items(stubs, "q", page_size=5000, page_token=capped.next_page_token)
    assert payloads(last.items) == [b"y"] and last.next_page_token == ""
    expect_invalid(lambda: list_items(stubs, "q", page_size=-1), "page_size")
    expect_invalid(lambda: list_scheduled(stubs, "q", page_size=-5), "page_size")


def test_list_items_rejects_tokens_it_did_not_issue(stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=2)
    stubs.create("other")
    assert stubs.produce("q", [b"1", b"2", b"3"]).partition == 0
    assert stubs.produce("q", [b"4", b"5", b"6"]).partition == 1
    stubs.produce("other", [b"1", b"2", b"3"])
    for scheduled_at in (HOUR, 2 * HOUR, 3 * HOUR):
        produce_items(stubs, "q", [queue_pb2.ProduceItem(payload=b"s", enqueue_at=ts_at(time.time() + scheduled_at))])

    token = list_items(stubs, "q", 0, page_size=1).next_page_token
    assert token
    tampered = token[:-2] + ("AA" if token[-2:] != "AA" else "BB")
    for forged in ["garbage", "!!!", "\u00e9", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", tampered, token[:-6]]:
        expect_invalid(lambda t=forged: list_items(stubs, "q", 0, 1, t), "page_token")  # type: ignore[misc]
    # Issued, but for another partition, another queue or another listing.
    expect_invalid(lambda: list_items(stubs, "q", 1, 1, token), "page_token")
    other_token = list_items(stubs, "other", 0, page_size=1).next_page_token
    expect_invalid(lambda: list_items(stubs, "q", 0, 1, other_token), "page_token")
    sched_partition = next(p.partition for p in stubs.stats("q").partitions if p.scheduled)
    sched_token = list_scheduled(stubs, "q", sched_partition, page_size=1).next_page_token
    assert sched_token
    expect_invalid(lambda: list_items(stubs, "q", sched_partition, 1, sched_token), "page_token")
    expect_invalid(lambda: list_scheduled(stubs, "q", sched_partition, 1, token), "page_token")
    stubs.create("a")
    stubs.create("b")
    queues_token = stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(page_size=1), timeout=10).next_page_token
    assert queues_token
    expect_invalid(lambda: list_items(stubs, "q", 0, 1, queues_token), "page_token")
    # The genuine token still works.
    assert payloads(list_items(stubs, "q", 0, 10, token).items) == [b"2", b"3"]


def test_storage_calls_check_the_partition_and_queue(stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=2)
    item = storage_pb2.StorageItem(payload=b"x")
    calls: list[Callable[[int], object]] = [
        lambda p: list_items(stubs, "q", p),
        lambda p: list_scheduled(stubs, "q", p),
        lambda p: import_items(stubs, "q", [item], partition=p),
        lambda p: delete_items(stubs, "q", ["1.0.1"], partition=p),
    ]
    for call in calls:
        for partition in (2, 99, -1):
            expect_invalid(lambda c=call, p=partition: c(p), "partition")  # type: ignore[misc]
        call(1)  # in range
    assert counts(stubs, "q") == [(0, 0, 0), (1, 0, 0)]
    for missing in [
        lambda: list_items(stubs, "ghost"),
        lambda: list_scheduled(stubs, "ghost"),
        lambda: import_items(stubs, "ghost", [item]),
        lambda: delete_items(stubs, "ghost", ["1.0.1"]),
    ]:
        expect_code(missing, Code.NOT_FOUND)
    expect_invalid(lambda: list_items(stubs, "bad/name"), "queue_name")


# -- ListScheduledItems ---------------------------------------------------------------


def test_list_scheduled_items_ordered_by_due_time(stubs: Stubs) -> None:
    stubs.create("q", expire_timeout=dur(5 * HOUR))
    now = time.time()
    due = {b"+3h": ts_at(now + 3 * HOUR), b"+1h": ts_at(now + HOUR), b"+2h": ts_at(now + 2 * HOUR)}
    produced = produce_items(
        stubs,
        "q",
        [queue_pb2.ProduceItem(payload=p, kind="sched", enqueue_at=t) for p, t in due.items()]
        + [queue_pb2.ProduceItem(payload=b"ready")],
    )
    same_time = produce_items(
        stubs, "q", [queue_pb2.ProduceItem(payload=b"+1h-later-produce", enqueue_at=due[b"+1h"])]
    )
    ids = dict(zip(list(due) + [b"ready"], produced.ids))

    scheduled = list(list_scheduled(stubs, "q").items)
    assert payloads(scheduled) == [b"+1h", b"+1h-later-produce", b"+2h", b"+3h"]
    for item in scheduled:
        assert item.HasField("enqueue_at")
        assert not item.is_leased and not item.HasField("lease_deadline")
        assert item.attempts == 0 and item.kind in ("sched", "")
        assert abs(secs(item.expire_deadline) - (secs(item.created_at) + 5 * HOUR)) < 1
    assert [i.enqueue_at for i in scheduled] == [due[b"+1h"], due[b"+1h"], due[b"+2h"], due[b"+3h"]]
    assert scheduled[0].id == ids[b"+1h"] and scheduled[1].id == same_time.ids[0]
    assert scheduled[2].id == ids[b"+2h"] and scheduled[3].id == ids[b"+3h"]

    ready = list(list_items(stubs, "q").items)
    assert payloads(ready) == [b"ready"] and ready[0].id == ids[b"ready"]
    assert counts(stubs, "q") == [(1, 0, 4)]
    # Scheduled items are not leasable yet.
    leased = stubs.lease("q", batch_size=10)
    assert payloads(leased.items) == [b"ready"]

    items, sizes = walk(list_scheduled, stubs, "q", 3)
    assert [i.id for i in items] == [i.id for i in scheduled] and sizes == [3, 1]
    items, sizes = walk(list_scheduled, stubs, "q", 1)
    assert [i.id for i in items] == [i.id for i in scheduled] and sizes == [1, 1, 1, 1]


# -- ImportItems ----------------------------------------------------------------------


def test_import_keeps_the_given_fields(stubs: Stubs) -> None:
    stubs.create("q", expire_timeout=dur(3 * HOUR), lease_timeout=dur(60))
    now = time.time()
    given_expire = ts_at(now + 2 * HOUR)
    given_created = ts_at(now - 600)
    given_lease = ts_at(now + 45)
    given_due = ts_at(now + HOUR)
    imported = [
        storage_pb2.StorageItem(
            payload=b"kept",
            attempts=3,
            source_id="src-1",
            expire_deadline=given_expire,
            created_at=given_created,
            encoding="e",
            kind="k",
            reference="r",
        ),
        storage_pb2.StorageItem(payload=b"defaults"),
        storage_pb2.StorageItem(payload=b"scheduled", enqueue_at=given_due, attempts=1, source_id="src-3"),
        storage_pb2.StorageItem(payload=b"leased", is_leased=True, lease_deadline=given_lease, attempts=2),
    ]
    before = time.time()
    ids = import_items(stubs, "q", imported)
    after = time.time()
    assert len(ids) == 4 and len(set(ids)) == 4 and all(ids)

    listed = list(list_items(stubs, "q").items)
    assert [i.id for i in listed] == [ids[0], ids[1], ids[3]]
    kept, defaults, leased = listed
    assert (kept.payload, kept.attempts, kept.source_id) == (b"kept", 3, "src-1")
    assert (kept.encoding, kept.kind, kept.reference) == ("e", "k", "r")
    assert kept.expire_deadline == given_expire
    assert kept.created_at == given_created
    assert not kept.is_leased and not kept.HasField("lease_deadline")

    assert defaults.attempts == 0 and defaults.source_id == ""
    assert before + 3 * HOUR - 0.01 <= secs(defaults.expire_deadline) <= after + 3 * HOUR + 0.01, (
        "missing expire_deadline defaults from the queue"
    )

    assert leased.is_leased and leased.lease_deadline == given_lease and leased.attempts == 2

    scheduled = list(list_scheduled(stubs, "q").items)
    assert [i.id for i in scheduled] == [ids[2]]
    assert scheduled[0].enqueue_at == given_due
    assert (scheduled[0].attempts, scheduled[0].source_id) == (1, "src-3")
    assert counts(stubs, "q") == [(3, 1, 1)]

    # Imported ready items lease like any other; attempts go on from the given count.
    got = stubs.lease("q", batch_size=10)
    assert [(i.payload, i.attempts) for i in got.items] == [(b"kept", 4), (b"defaults", 1)]
    assert got.items[0].created_at == given_created
    # An imported leased item is completable by its id.
    stubs.complete("q", 0, [ids[3]])
    assert counts(stubs, "q") == [(2, 2, 1)]


def test_import_into_a_chosen_partition_after_existing_items(stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=2)
    stubs.produce("q", [b"p0"])
    ids = import_items(stubs, "q", [storage_pb2.StorageItem(payload=b"i1"), storage_pb2.StorageItem(payload=b"i2")], partition=1)
    assert [i.id for i in list_items(stubs, "q", 1).items] == ids
    assert payloads(list_items(stubs, "q", 0).items) == [b"p0"]
    assert counts(stubs, "q") == [(1, 0, 0), (2, 0, 0)]


def test_import_rejects_bad_input(stubs: Stubs) -> None:
    stubs.create("q")
    expect_invalid(lambda: import_items(stubs, "q", []), "items")
    expect_invalid(
        lambda: import_items(stubs, "q", [storage_pb2.StorageItem(payload=b"ok"), storage_pb2.StorageItem(attempts=-1)]),
        "items[1].attempts",
    )
    assert counts(stubs, "q") == [(0, 0, 0)], "a rejected import stores nothing"


# -- DeleteItems ----------------------------------------------------------------------


def test_delete_items_removes_ready_leased_and_scheduled_items(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.create("other")
    ready_ids = list(stubs.produce("q", [b"r1", b"r2", b"r3"]).ids)
    leased = stubs.lease("q", batch_size=1).items[0]
    assert leased.id == ready_ids[0]
    later = ts_at(time.time() + HOUR)
    sched_ids = list(
        produce_items(stubs, "q", [queue_pb2.ProduceItem(payload=b"s1", enqueue_at=later),
                                   queue_pb2.ProduceItem(payload=b"s2", enqueue_at=later)]).ids
    )
    other_ids = list(stubs.produce("other", [b"o1", b"o2", b"o3"]).ids)
    assert counts(stubs, "q") == [(3, 1, 2)]

    delete_items(stubs, "q", [ready_ids[1], leased.id, sched_ids[0], "no-such-id", "7.0.1", "ffff.0.1.1", other_ids[2]])
    assert counts(stubs, "q") == [(1, 0, 1)]
    assert [i.id for i in list_items(stubs, "q").items] == [ready_ids[2]]
    assert [i.id for i in list_scheduled(stubs, "q").items] == [sched_ids[1]]
    assert counts(stubs, "other") == [(3, 0, 0)], "ids of another queue must not touch it"
    expect_code(lambda: stubs.complete("q", 0, [leased.id]), Code.NOT_FOUND)

    # Deleting ids that are already gone is fine and changes nothing.
    delete_items(stubs, "q", [ready_ids[1], leased.id, sched_ids[0]])
    assert counts(stubs, "q") == [(1, 0, 1)]
    assert payloads(stubs.lease("q", batch_size=10).items) == [b"r3"]


def test_delete_items_only_touches_the_named_partition(stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=2)
    p0 = stubs.produce("q", [b"a"])
    p1 = stubs.produce("q", [b"b"])
    assert (p0.partition, p1.partition) == (0, 1)
    delete_items(stubs, "q", [p1.ids[0]], partition=0)
    assert counts(stubs, "q") == [(1, 0, 0), (1, 0, 0)]
    delete_items(stubs, "q", [p1.ids[0]], partition=1)
    assert counts(stubs, "q") == [(1, 0, 0), (0, 0, 0)]


def test_delete_items_rejects_bad_ids(stubs: Stubs) -> None:
    stubs.create("q")
    ids = list(stubs.produce("q", [b"a"]).ids)
    expect_invalid(lambda: delete_items(stubs, "q", []), "ids")
    expect_invalid(lambda: delete_items(stubs, "q", [ids[0], ""]), "ids[1]")
    expect_invalid(lambda: delete_items(stubs, "q", ["x"] * 1001), "ids")
    assert counts(stubs, "q") == [(1, 0, 0)]


def test_stats_follow_storage_changes(stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=1)
    ids = import_items(stubs, "q", [storage_pb2.StorageItem(payload=b"%d" % i) for i in range(4)])
    stubs.queues.UpdateQueue(
        queues_pb2.UpdateQueueRequest(
            queue=queues_pb2.QueueInfo(queue_name="q", requested_partitions=2),
            update_mask=field_mask_pb2.FieldMask(paths=["requested_partitions"]),
        ),
        timeout=10,
    )
    import_items(stubs, "q", [storage_pb2.StorageItem(payload=b"p1")], partition=1)
    assert counts(stubs, "q") == [(4, 0, 0), (1, 0, 0)]
    delete_items(stubs, "q", ids[:2])
    assert counts(stubs, "q") == [(2, 0, 0), (1, 0, 0)]
    stats = stubs.stats("q")
    assert secs(stats.partitions[0].average_age) > 0


def test_listing_items_commits_nothing(server: ThreadServer, stubs: Stubs) -> None:
    stubs.create("reads")
    stubs.produce("reads", [b"a", b"b"])
    env = server.server.manager.actor("reads").store.env
    before = env.info()["last_txnid"]
    for _ in range(3):
        assert len(stubs.list_items("reads")) == 2
        stubs.storage.ListScheduledItems(storage_pb2.ListScheduledItemsRequest(queue_name="reads"), timeout=5)
    assert env.info()["last_txnid"] == before


def _crc_token(kind: bytes, payload: bytes, fmt: int) -> str:
    """A token as format 1 built them: anyone can compute its checksum."""
    data = bytes([fmt]) + kind + payload
    data += struct.pack(">I", zlib.crc32(data))
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def test_a_forged_page_token_fails_alone_and_concurrent_produces_succeed(process_server: ProcessServer) -> None:
    """A cursor anyone could compute (seq 2**64 - 1 with a valid checksum) once reached
    storage and failed every request of the queue's cycle; now it is refused before."""
    channel = grpc.insecure_channel(process_server.address)
    stubs = Stubs(channel)
    try:
        stubs.create("q")
        stubs.produce("q", [b"1", b"2"])
        # uid, partition, seq 2**64 - 1, 0: the cursor that overflowed in page_items.
        uid = _uid_of(stubs)
        payload = struct.pack(">QIQQ", uid, 0, (1 << 64) - 1, 0)
        forged = [_crc_token(b"I", payload, fmt) for fmt in (1, 2)]
        refusals: list[tuple[str, Callable[[], object]]] = [
            ("page_token", lambda t=token: list_items(stubs, "q", 0, 10, t)) for token in forged  # type: ignore[misc]
        ]
        produced, refused = _produce_while_refused(stubs, 6, refusals, 3)
        assert produced > 0 and refused > 0
        assert stubs.stats("q").partitions[0].total == 2 + produced
    finally:
        channel.close()


def _produce_while_refused(
    stubs: Stubs, producers: int, refusals: list[tuple[str, Callable[[], object]]], seconds: float
) -> tuple[int, int]:
    """For ``seconds``, ``producers`` threads produce to "q" while two others make the
    calls of ``refusals`` over and over, each of which must fail INVALID_ARGUMENT naming
    its field: the items produced and the calls refused (any other failure raises)."""
    stop = time.monotonic() + seconds

    def produce_loop() -> int:
        done = 0
        while time.monotonic() < stop:
            stubs.produce("q", [b"p"])
            done += 1
        return done

    def refuse_loop() -> int:
        refused = 0
        while time.monotonic() < stop:
            for field, call in refusals:
                expect_invalid(call, field)
                refused += 1
        return refused

    with ThreadPoolExecutor(producers + 2) as pool:
        producing = [pool.submit(produce_loop) for _ in range(producers)]
        refusing = [pool.submit(refuse_loop) for _ in range(2)]
        produced = sum(f.result(timeout=60) for f in producing)
        return produced, sum(f.result(timeout=60) for f in refusing)


def _uid_of(stubs: Stubs) -> int:
    """The queue's uid, as its item ids carry it (hex, before the first dot)."""
    return int(stubs.list_items("q")[0].id.split(".")[0], 16)


def test_page_tokens_stay_good_across_a_restart(process_server: ProcessServer) -> None:
    channel = grpc.insecure_channel(process_server.address)
    stubs = Stubs(channel)
    try:
        stubs.create("q")
        stubs.create("r")
        stubs.produce("q", [b"1", b"2", b"3"])
        token = list_items(stubs, "q", 0, page_size=1).next_page_token
        queues_token = stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(page_size=1), timeout=10).next_page_token
    finally:
        channel.close()
    assert process_server.terminate() == 0
    process_server.start()
    channel = grpc.insecure_channel(process_server.address)
    stubs = Stubs(channel)
    try:
        assert payloads(list_items(stubs, "q", 0, 10, token).items) == [b"2", b"3"]
        page = stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(page_size=1, page_token=queues_token), timeout=10)
        assert [q.queue_name for q in page.queues] == ["r"]
    finally:
        channel.close()


def test_keyed_fields_are_length_checked_before_the_cycle(process_server: ProcessServer) -> None:
    """Every string a caller sends that becomes (part of) a storage key is refused with
    INVALID_ARGUMENT naming it when too long, and never fails concurrent Produce calls
    (a 511-byte source_id once failed the whole cycle with MDB_BAD_VALSIZE)."""
    channel = grpc.insecure_channel(process_server.address)
    stubs = Stubs(channel)
    try:
        stubs.create("q")
        too_long: list[tuple[str, Callable[[], object]]] = [
            ("items[0].source_id", lambda: import_items(stubs, "q", [storage_pb2.StorageItem(payload=b"x", source_id="s" * 511)])),
            ("items[1].source_id", lambda: import_items(stubs, "q", [storage_pb2.StorageItem(payload=b"x"), storage_pb2.StorageItem(payload=b"x", source_id="é" * 256)])),
            ("items[0].idempotency_key", lambda: produce_items(stubs, "q", [queue_pb2.ProduceItem(payload=b"x", idempotency_key="k" * 513)])),
            ("lease_key", lambda: stubs.lease("q", 1, lease_key="é" * 257)),
            ("lease_keys[1]", lambda: stubs.queue.Complete(queue_pb2.CompleteRequest(queue_name="q", lease_keys=["a", "k" * 513]), timeout=10)),
            ("lease_keys[0]", lambda: stubs.queue.Extend(queue_pb2.ExtendRequest(queue_name="q", lease_keys=["k" * 513]), timeout=10)),
        ]
        produced, refused = _produce_while_refused(stubs, 4, too_long, 2)
        assert refused > 0
        assert stubs.stats("q").partitions[0].total == produced
        # At the limits, accepted and kept: a 510-byte source_id deduplicates dead letters.
        longest = "s" * 508 + "é"
        assert len(longest.encode()) == 510
        # In a queue of its own: "q" holds however many items the loops above produced.
        stubs.create("edge")
        ids = import_items(stubs, "edge", [storage_pb2.StorageItem(payload=b"edge", source_id=longest)])
        assert [i.source_id for i in list_items(stubs, "edge", 0, 1000).items if i.id == ids[0]] == [longest]
        produce_items(stubs, "q", [queue_pb2.ProduceItem(payload=b"k", idempotency_key="é" * 256)])
        assert len(stubs.lease("q", 1, lease_key="k" * 512).items) == 1
    finally:
        channel.close()
