"""Contract tests for querator.v1.QueuesService (see spec/API.md: Queues, Errors).

Every test talks to a real server over a real gRPC channel, with real LMDB storage
in a temp dir. Waits are bounded polls, never bare sleeps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import grpc
import pytest
from google.protobuf import field_mask_pb2, timestamp_pb2

from querator.v1 import queue_pb2, queues_pb2, storage_pb2

from conftest import Stubs, ThreadServer, bad_request_fields, dur, expect_code, secs, wait_until

Code = grpc.StatusCode
HOUR = 3600


# -- helpers ------------------------------------------------------------------------






def in_future(seconds: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int((time.time() + seconds) * 1e9))
    return ts


def expect_invalid(call: Callable[[], object], *fields: str) -> grpc.RpcError:
    """The call fails INVALID_ARGUMENT with a BadRequest violation on one of ``fields``."""
    error = expect_code(call, Code.INVALID_ARGUMENT)
    named = bad_request_fields(error)
    assert any(f in named for f in fields), f"violations {named} name none of {fields}: {error.details()}"
    assert any(f in (error.details() or "") for f in fields), f"message does not name the field: {error.details()}"
    return error


def get_queue(stubs: Stubs, name: str) -> queues_pb2.QueueInfo:
    return stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name=name), timeout=10).queue


def update(stubs: Stubs, info: queues_pb2.QueueInfo, paths: list[str]) -> queues_pb2.QueueInfo:
    request = queues_pb2.UpdateQueueRequest(queue=info, update_mask=field_mask_pb2.FieldMask(paths=paths))
    return stubs.queues.UpdateQueue(request, timeout=10).queue


def list_page(stubs: Stubs, page_size: int = 0, page_token: str = "") -> queues_pb2.ListQueuesResponse:
    request = queues_pb2.ListQueuesRequest(page_size=page_size, page_token=page_token)
    return stubs.queues.ListQueues(request, timeout=10)


def walk_queues(stubs: Stubs, page_size: int) -> tuple[list[str], list[int]]:
    """Every queue name over all pages, and the size of each page."""
    names: list[str] = []
    sizes: list[int] = []
    token = ""
    for _ in range(10_000):
        page = list_page(stubs, page_size, token)
        names.extend(q.queue_name for q in page.queues)
        sizes.append(len(page.queues))
        token = page.next_page_token
        if not token:
            return names, sizes
    raise AssertionError("ListQueues never returned an empty next_page_token")


def delete(stubs: Stubs, name: str, force: bool = False) -> None:
    stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name=name, force=force), timeout=10)


def clear(stubs: Stubs, name: str, **flags: bool) -> None:
    stubs.queues.ClearQueue(queues_pb2.ClearQueueRequest(queue_name=name, **flags), timeout=10)


def produce_scheduled(stubs: Stubs, name: str, payloads: list[bytes], delay: float = HOUR) -> queue_pb2.ProduceResponse:
    due = in_future(delay)
    items = [queue_pb2.ProduceItem(payload=p, enqueue_at=due) for p in payloads]
    return stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=items), timeout=10)


def scheduled_items(stubs: Stubs, name: str, partition: int = 0) -> list[storage_pb2.StorageItem]:
    request = storage_pb2.ListScheduledItemsRequest(queue_name=name, partition=partition, page_size=1000)
    return list(stubs.storage.ListScheduledItems(request, timeout=10).items)


def counts(stubs: Stubs, name: str) -> list[tuple[int, int, int]]:
    """(total, total_leased, scheduled) per partition."""
    return [(p.total, p.total_leased, p.scheduled) for p in stubs.stats(name).partitions]


# -- CreateQueue ----------------------------------------------------------------------


def test_create_fills_in_defaults(stubs: Stubs) -> None:
    before = time.time()
    created = stubs.create("defaults")
    after = time.time()
    assert created.queue_name == "defaults"
    assert created.lease_timeout == dur(60)
    assert created.expire_timeout == dur(24 * HOUR)
    assert created.requested_partitions == 1
    assert created.max_attempts == 0
    assert created.dead_queue == ""
    assert created.HasField("created_at") and created.HasField("updated_at")
    assert before - 0.01 <= secs(created.created_at) <= after + 0.01
    assert before - 0.01 <= secs(created.updated_at) <= after + 0.01
    assert get_queue(stubs, "defaults") == created


def test_create_keeps_given_settings(stubs: Stubs) -> None:
    stubs.create("dlq")
    created = stubs.create(
        "orders",
        dead_queue="dlq",
        reference="team-a",
        lease_timeout=dur(30, 500_000_000),
        expire_timeout=dur(2 * HOUR),
        max_attempts=5,
        requested_partitions=3,
    )
    assert created.dead_queue == "dlq"
    assert created.reference == "team-a"
    assert created.lease_timeout == dur(30, 500_000_000)
    assert created.expire_timeout == dur(2 * HOUR)
    assert created.max_attempts == 5
    assert created.requested_partitions == 3
    assert get_queue(stubs, "orders") == created
    assert [p.partition for p in stubs.stats("orders").partitions] == [0, 1, 2]


def test_create_existing_name_is_already_exists_and_changes_nothing(stubs: Stubs) -> None:
    first = stubs.create("dup", max_attempts=3)
    expect_code(lambda: stubs.create("dup", max_attempts=9), Code.ALREADY_EXISTS)
    assert get_queue(stubs, "dup") == first


def test_create_accepts_boundary_values(stubs: Stubs) -> None:
    created = stubs.create("q", max_attempts=65_536, lease_timeout=dur(HOUR), expire_timeout=dur(HOUR))
    assert created.max_attempts == 65_536
    assert created.lease_timeout == created.expire_timeout == dur(HOUR)
    # Punctuation other than '~' and '/' is fine.
    assert stubs.create("a.b-c_d:e@f").queue_name == "a.b-c_d:e@f"


def test_create_accepts_a_512_char_name(stubs: Stubs) -> None:
    name = "n" * 512
    assert stubs.create(name).queue_name == name
    assert get_queue(stubs, name).queue_name == name
    stubs.produce(name, [b"x"])
    assert [i.payload for i in stubs.lease(name).items] == [b"x"]


def test_create_accepts_a_long_multibyte_name(stubs: Stubs) -> None:
    # The limit is in characters: 300 characters are 600 bytes of UTF-8.
    name = "\u00e9" * 300
    assert stubs.create(name).queue_name == name
    assert get_queue(stubs, name).queue_name == name
    assert [q.queue_name for q in list_page(stubs).queues] == [name]


def test_create_without_queue_is_invalid(stubs: Stubs) -> None:
    expect_invalid(lambda: stubs.queues.CreateQueue(queues_pb2.CreateQueueRequest(), timeout=10), "queue")
    assert list(list_page(stubs).queues) == []


INVALID_CREATES: list[tuple[str, dict[str, object], tuple[str, ...]]] = [
    ("empty name", {"queue_name": ""}, ("queue.queue_name",)),
    ("space in name", {"queue_name": "a b"}, ("queue.queue_name",)),
    ("tab in name", {"queue_name": "a\tb"}, ("queue.queue_name",)),
    ("newline in name", {"queue_name": "a\nb"}, ("queue.queue_name",)),
    ("tilde in name", {"queue_name": "a~b"}, ("queue.queue_name",)),
    ("slash in name", {"queue_name": "a/b"}, ("queue.queue_name",)),
    ("513-char name", {"queue_name": "x" * 513}, ("queue.queue_name",)),
    (
        "lease_timeout longer than expire_timeout",
        {"queue_name": "q", "lease_timeout": dur(2 * HOUR), "expire_timeout": dur(HOUR)},
        ("queue.lease_timeout", "queue.expire_timeout"),
    ),
    ("negative lease_timeout", {"queue_name": "q", "lease_timeout": dur(-1)}, ("queue.lease_timeout",)),
    ("negative lease_timeout nanos", {"queue_name": "q", "lease_timeout": dur(0, -5)}, ("queue.lease_timeout",)),
    ("negative expire_timeout", {"queue_name": "q", "expire_timeout": dur(-60)}, ("queue.expire_timeout",)),
    ("max_attempts -1", {"queue_name": "q", "max_attempts": -1}, ("queue.max_attempts",)),
    ("max_attempts 65537", {"queue_name": "q", "max_attempts": 65_537}, ("queue.max_attempts",)),
    ("negative requested_partitions", {"queue_name": "q", "requested_partitions": -1}, ("queue.requested_partitions",)),
    ("dead_queue that does not exist", {"queue_name": "q", "dead_queue": "nowhere"}, ("queue.dead_queue",)),
    ("dead_queue is the queue itself", {"queue_name": "q", "dead_queue": "q"}, ("queue.dead_queue",)),
    ("dead_queue not a valid name", {"queue_name": "q", "dead_queue": "a/b"}, ("queue.dead_queue",)),
]


@pytest.mark.parametrize(
    ("settings", "fields"), [c[1:] for c in INVALID_CREATES], ids=[c[0] for c in INVALID_CREATES]
)
def test_create_rejects_invalid_settings(stubs: Stubs, settings: dict[str, object], fields: tuple[str, ...]) -> None:
    request = queues_pb2.CreateQueueRequest(queue=queues_pb2.QueueInfo(**settings))  # type: ignore[arg-type]
    expect_invalid(lambda: stubs.queues.CreateQueue(request, timeout=10), *fields)
    assert list(list_page(stubs).queues) == [], "a rejected create must not create anything"


def test_create_dead_queue_may_not_have_a_dead_queue_of_its_own(stubs: Stubs) -> None:
    stubs.create("last")
    stubs.create("middle", dead_queue="last")
    expect_invalid(lambda: stubs.create("first", dead_queue="middle"), "queue.dead_queue")
    expect_code(lambda: get_queue(stubs, "first"), Code.NOT_FOUND)
    # Pointing at the end of the chain is fine.
    assert stubs.create("first", dead_queue="last").dead_queue == "last"


def test_a_dead_letter_queue_cannot_be_given_a_dead_queue(stubs: Stubs) -> None:
    stubs.create("dlq")
    stubs.create("work", dead_queue="dlq")
    stubs.create("other")
    before = get_queue(stubs, "dlq")
    expect_code(lambda: update(stubs, queues_pb2.QueueInfo(queue_name="dlq", dead_queue="other"), ["dead_queue"]),
                Code.FAILED_PRECONDITION)
    assert get_queue(stubs, "dlq") == before


# -- GetQueue / ListQueues ------------------------------------------------------------


def test_get_queue_errors(stubs: Stubs) -> None:
    expect_code(lambda: get_queue(stubs, "missing"), Code.NOT_FOUND)
    expect_invalid(lambda: get_queue(stubs, ""), "queue_name")
    expect_invalid(lambda: get_queue(stubs, "a/b"), "queue_name")


def test_list_queues_sorted_by_name(stubs: Stubs) -> None:
    names = ["delta", "alpha", "charlie", "alpha-2", "bravo", "a", "zulu", "alpha1"]
    for name in names:
        stubs.create(name)
    page = list_page(stubs, 0)
    assert [q.queue_name for q in page.queues] == sorted(names)
    assert page.next_page_token == ""
    # Each entry is the full QueueInfo, as GetQueue reports it.
    assert page.queues[0] == get_queue(stubs, "a")


def test_list_queues_pages_cover_every_queue_once(stubs: Stubs) -> None:
    names = [f"q{i:02d}" for i in range(23)]
    for name in reversed(names):
        stubs.create(name)
    walked, sizes = walk_queues(stubs, 5)
    assert walked == names
    assert sizes == [5, 5, 5, 5, 3]
    walked, sizes = walk_queues(stubs, 1)
    assert walked == names and len(sizes) == 23
    # Exactly one full page: no token, and no empty trailing page.
    walked, sizes = walk_queues(stubs, 23)
    assert walked == names and sizes == [23]
    first = list_page(stubs, 22)
    assert first.next_page_token != ""
    last = list_page(stubs, 22, first.next_page_token)
    assert [q.queue_name for q in last.queues] == ["q22"] and last.next_page_token == ""


def test_list_queues_token_survives_changes_between_pages(stubs: Stubs) -> None:
    for name in ["b", "d", "f", "h"]:
        stubs.create(name)
    first = list_page(stubs, 2)
    assert [q.queue_name for q in first.queues] == ["b", "d"]
    delete(stubs, "d")  # the queue the token points after
    stubs.create("a")  # sorts before the cursor: not seen by this walk
    stubs.create("e")  # sorts after it: seen, in order
    rest = list_page(stubs, 10, first.next_page_token)
    assert [q.queue_name for q in rest.queues] == ["e", "f", "h"]
    assert rest.next_page_token == ""


def test_list_queues_page_size_default_and_cap(tmp_path: object) -> None:
    # Throw-away data: commit without fsync so 1,001 queues take a couple of seconds.
    srv = ThreadServer(str(tmp_path / "data"), sync=False, map_size=1 << 20)  # type: ignore[operator]
    channel = grpc.insecure_channel(srv.address)
    try:
        stubs = Stubs(channel)
        names = [f"q{i:04d}" for i in range(1001)]
        for name in names:
            stubs.create(name)
        default = list_page(stubs, 0)
        assert [q.queue_name for q in default.queues] == names[:100]
        assert default.next_page_token != ""
        capped = list_page(stubs, 5000)
        assert [q.queue_name for q in capped.queues] == names[:1000]
        assert capped.next_page_token != ""
        last = list_page(stubs, 5000, capped.next_page_token)
        assert [q.queue_name for q in last.queues] == names[1000:]
        assert last.next_page_token == ""
        walked, sizes = walk_queues(stubs, 0)
        assert walked == names and sizes == [100] * 10 + [1]
    finally:
        channel.close()
        srv.stop()


def test_list_queues_rejects_negative_page_size(stubs: Stubs) -> None:
    stubs.create("q")
    expect_invalid(lambda: list_page(stubs, -1), "page_size")


def test_list_queues_rejects_tokens_it_did_not_issue(stubs: Stubs) -> None:
    for name in ["a", "b", "c"]:
        stubs.create(name)
    good = list_page(stubs, 1).next_page_token
    assert good
    tampered = good[:-2] + ("AA" if good[-2:] != "AA" else "BB")
    for token in ["garbage", "not a token!", "\u00e9t\u00e9", "AAAAAAAAAAAAAAAA", tampered, good + "x" * 8]:
        expect_invalid(lambda t=token: list_page(stubs, 1, t), "page_token")  # type: ignore[misc]
    # A token ListItems issued is not a ListQueues token.
    stubs.produce("a", [b"1", b"2", b"3"])
    items_token = stubs.storage.ListItems(
        storage_pb2.ListItemsRequest(queue_name="a", partition=0, page_size=1), timeout=10
    ).next_page_token
    assert items_token
    expect_invalid(lambda: list_page(stubs, 1, items_token), "page_token")
    # The genuine token still works after all that.
    assert [q.queue_name for q in list_page(stubs, 5, good).queues] == ["b", "c"]


# -- UpdateQueue ----------------------------------------------------------------------


def test_update_changes_exactly_the_fields_in_the_mask(stubs: Stubs) -> None:
    stubs.create("dlq")
    original = stubs.create(
        "q", reference="r0", lease_timeout=dur(30), expire_timeout=dur(HOUR), max_attempts=3
    )
    everything = queues_pb2.QueueInfo(
        queue_name="q",
        dead_queue="dlq",
        reference="r1",
        lease_timeout=dur(10),
        expire_timeout=dur(2 * HOUR),
        max_attempts=7,
        requested_partitions=4,
    )
    updated = update(stubs, everything, ["max_attempts"])
    assert updated.max_attempts == 7
    for field in ["dead_queue", "reference", "lease_timeout", "expire_timeout", "requested_partitions", "created_at"]:
        assert getattr(updated, field) == getattr(original, field), field
    assert get_queue(stubs, "q") == updated
    assert len(stubs.stats("q").partitions) == 1

    updated = update(stubs, everything, ["reference", "lease_timeout"])
    assert (updated.reference, updated.lease_timeout, updated.max_attempts) == ("r1", dur(10), 7)
    assert updated.expire_timeout == dur(HOUR) and updated.dead_queue == "" and updated.requested_partitions == 1
    assert get_queue(stubs, "q") == updated


def test_update_mask_field_left_empty_in_the_request_is_cleared(stubs: Stubs) -> None:
    stubs.create("dlq")
    stubs.create("q", reference="keep-me?", dead_queue="dlq", max_attempts=4)
    updated = update(stubs, queues_pb2.QueueInfo(queue_name="q"), ["reference", "dead_queue"])
    assert updated.reference == "" and updated.dead_queue == ""
    assert updated.max_attempts == 4
    # No longer anyone's DLQ: it may be deleted now.
    delete(stubs, "dlq")


def test_update_advances_updated_at_and_keeps_created_at(stubs: Stubs) -> None:
    created = stubs.create("q")
    before = time.time()
    updated = update(stubs, queues_pb2.QueueInfo(queue_name="q", max_attempts=2), ["max_attempts"])
    after = time.time()
    assert updated.created_at == created.created_at
    assert secs(updated.updated_at) > secs(created.updated_at)
    assert before - 0.01 <= secs(updated.updated_at) <= after + 0.01


def test_update_rejects_bad_masks(stubs: Stubs) -> None:
    original = stubs.create("q", max_attempts=1)
    info = queues_pb2.QueueInfo(queue_name="q", max_attempts=9, reference="x")
    expect_invalid(lambda: update(stubs, info, []), "update_mask")
    for paths in (["no_such_field"], ["max_attempts", "bogus"], ["queue_name"], ["created_at"]):
        error = expect_code(lambda p=paths: update(stubs, info, p), Code.INVALID_ARGUMENT)  # type: ignore[misc]
        named = bad_request_fields(error)
        assert any(f.startswith("update_mask") for f in named), (paths, named)
    expect_invalid(
        lambda: stubs.queues.UpdateQueue(
            queues_pb2.UpdateQueueRequest(update_mask=field_mask_pb2.FieldMask(paths=["max_attempts"])), timeout=10
        ),
        "queue",
    )
    assert get_queue(stubs, "q") == original


def test_update_rejects_invalid_values(stubs: Stubs) -> None:
    original = stubs.create("q", lease_timeout=dur(30), expire_timeout=dur(HOUR))
    cases: list[tuple[queues_pb2.QueueInfo, list[str], tuple[str, ...]]] = [
        (queues_pb2.QueueInfo(queue_name="q", max_attempts=65_537), ["max_attempts"], ("queue.max_attempts",)),
        (queues_pb2.QueueInfo(queue_name="q", max_attempts=-1), ["max_attempts"], ("queue.max_attempts",)),
        (queues_pb2.QueueInfo(queue_name="q", lease_timeout=dur(-1)), ["lease_timeout"], ("queue.lease_timeout",)),
        (
            queues_pb2.QueueInfo(queue_name="q", lease_timeout=dur(2 * HOUR)),
            ["lease_timeout"],
            ("queue.lease_timeout", "queue.expire_timeout"),
        ),
        (
            queues_pb2.QueueInfo(queue_name="q", expire_timeout=dur(10)),
            ["expire_timeout"],
            ("queue.lease_timeout", "queue.expire_timeout"),
        ),
        (
            queues_pb2.QueueInfo(queue_name="q", requested_partitions=-2),
            ["requested_partitions"],
            ("queue.requested_partitions",),
        ),
    ]
    for info, paths, fields in cases:
        expect_invalid(lambda i=info, p=paths: update(stubs, i, p), *fields)  # type: ignore[misc]
    assert get_queue(stubs, "q") == original


def test_update_unknown_queue_is_not_found(stubs: Stubs) -> None:
    expect_code(
        lambda: update(stubs, queues_pb2.QueueInfo(queue_name="ghost", max_attempts=1), ["max_attempts"]),
        Code.NOT_FOUND,
    )


def test_update_dead_queue_follows_the_create_rules(stubs: Stubs) -> None:
    stubs.create("end")
    stubs.create("has-dlq", dead_queue="end")
    stubs.create("plain")
    original = stubs.create("q")
    for target in ["nowhere", "q", "has-dlq"]:
        expect_invalid(
            lambda t=target: update(stubs, queues_pb2.QueueInfo(queue_name="q", dead_queue=t), ["dead_queue"]),  # type: ignore[misc]
            "queue.dead_queue",
        )
    assert get_queue(stubs, "q") == original
    assert update(stubs, queues_pb2.QueueInfo(queue_name="q", dead_queue="plain"), ["dead_queue"]).dead_queue == "plain"
    assert get_queue(stubs, "q").dead_queue == "plain"
    # "plain" is now a DLQ, so it may not get one of its own.
    expect_code(
        lambda: update(stubs, queues_pb2.QueueInfo(queue_name="plain", dead_queue="end"), ["dead_queue"]),
        Code.FAILED_PRECONDITION,
    )


def test_update_lowering_partitions_is_failed_precondition(stubs: Stubs) -> None:
    original = stubs.create("q", requested_partitions=3)
    expect_code(
        lambda: update(stubs, queues_pb2.QueueInfo(queue_name="q", requested_partitions=2), ["requested_partitions"]),
        Code.FAILED_PRECONDITION,
    )
    assert get_queue(stubs, "q") == original
    assert len(stubs.stats("q").partitions) == 3


def test_a_single_server_keeps_one_copy_and_refuses_replicas_naming_the_field(stubs: Stubs) -> None:
    expect_invalid(lambda: stubs.create("q", replicas=2), "queue.replicas")
    expect_invalid(lambda: stubs.create("q", min_in_sync=1), "queue.min_in_sync")
    # 0 and 1 are the one copy a single server keeps; answers read as before the field.
    assert (stubs.create("q", replicas=1).replicas, stubs.create("r").replicas) == (0, 0)
    expect_invalid(lambda: update(stubs, queues_pb2.QueueInfo(queue_name="q", replicas=3), ["replicas"]), "queue.replicas")
    assert update(stubs, queues_pb2.QueueInfo(queue_name="q", replicas=1), ["replicas"]).replicas == 0


def test_update_raising_partitions_adds_empty_usable_partitions(stubs: Stubs) -> None:
    stubs.create("q")
    assert stubs.produce("q", [b"a", b"b"]).partition == 0
    updated = update(stubs, queues_pb2.QueueInfo(queue_name="q", requested_partitions=3), ["requested_partitions"])
    assert updated.requested_partitions == 3
    assert get_queue(stubs, "q").requested_partitions == 3
    assert counts(stubs, "q") == [(2, 0, 0), (0, 0, 0), (0, 0, 0)]
    assert [p.partition for p in stubs.stats("q").partitions] == [0, 1, 2]
    assert stubs.list_items("q", 1) == [] and stubs.list_items("q", 2) == []
    # Produce goes to a partition with the fewest ready items: one of the new ones.
    landed = stubs.produce("q", [b"c"])
    assert landed.partition in (1, 2)
    assert [i.payload for i in stubs.list_items("q", landed.partition)] == [b"c"]
    assert [i.id for i in stubs.list_items("q", landed.partition)] == list(landed.ids)
    # And the new partition's items can be leased and completed.
    leased = stubs.lease("q", batch_size=10, client_id="c")
    assert leased.partition == 0 and [i.payload for i in leased.items] == [b"a", b"b"]
    leased = stubs.lease("q", batch_size=10, client_id="c")
    assert leased.partition == landed.partition and [i.payload for i in leased.items] == [b"c"]
    stubs.complete("q", leased.partition, [i.id for i in leased.items])


def test_update_lease_timeout_applies_to_new_leases_only(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(60))
    stubs.produce("q", [b"first", b"second"])
    t0 = time.time()
    old = stubs.lease("q", batch_size=1).items[0]
    assert t0 + 60 - 0.01 <= secs(old.lease_deadline) <= time.time() + 60 + 0.01
    update(stubs, queues_pb2.QueueInfo(queue_name="q", lease_timeout=dur(5)), ["lease_timeout"])
    t1 = time.time()
    new = stubs.lease("q", batch_size=1).items[0]
    assert new.payload == b"second"
    assert t1 + 5 - 0.01 <= secs(new.lease_deadline) <= time.time() + 5 + 0.01
    stored = {i.id: i for i in stubs.list_items("q")}
    assert stored[old.id].lease_deadline == old.lease_deadline, "an existing lease must keep its deadline"
    assert stored[new.id].lease_deadline == new.lease_deadline


def test_update_expire_timeout_applies_to_new_items_only(stubs: Stubs) -> None:
    stubs.create("q", expire_timeout=dur(24 * HOUR))
    stubs.produce("q", [b"old"])
    update(stubs, queues_pb2.QueueInfo(queue_name="q", expire_timeout=dur(2 * HOUR)), ["expire_timeout"])
    stubs.produce("q", [b"new"])
    old, new = stubs.list_items("q")
    assert abs(secs(old.expire_deadline) - secs(old.created_at) - 24 * HOUR) < 1
    assert abs(secs(new.expire_deadline) - secs(new.created_at) - 2 * HOUR) < 1


# -- DeleteQueue ----------------------------------------------------------------------


def test_delete_missing_queue_is_not_found(stubs: Stubs) -> None:
    expect_code(lambda: delete(stubs, "ghost"), Code.NOT_FOUND)
    expect_code(lambda: delete(stubs, "ghost", force=True), Code.NOT_FOUND)
    expect_invalid(lambda: delete(stubs, ""), "queue_name")


def test_delete_empty_queue(stubs: Stubs) -> None:
    stubs.create("keep")
    stubs.create("gone")
    delete(stubs, "gone")
    expect_code(lambda: get_queue(stubs, "gone"), Code.NOT_FOUND)
    expect_code(lambda: stubs.stats("gone"), Code.NOT_FOUND)
    expect_code(lambda: stubs.produce("gone", [b"x"]), Code.NOT_FOUND)
    assert [q.queue_name for q in list_page(stubs).queues] == ["keep"]
    expect_code(lambda: delete(stubs, "gone"), Code.NOT_FOUND)


@pytest.mark.parametrize("holding", ["ready", "leased", "scheduled"])
def test_delete_queue_with_items_needs_force(stubs: Stubs, holding: str) -> None:
    stubs.create("q")
    if holding == "scheduled":
        produce_scheduled(stubs, "q", [b"later"])
    else:
        stubs.produce("q", [b"item"])
        if holding == "leased":
            assert len(stubs.lease("q").items) == 1
    before = counts(stubs, "q")
    error = expect_code(lambda: delete(stubs, "q"), Code.FAILED_PRECONDITION)
    # The same words from a cluster node: the CLI turns "set force" into "add --force".
    assert error.details() == "queue 'q' still holds items; set force to delete it"
    # The refused delete left the queue whole and working.
    assert get_queue(stubs, "q").queue_name == "q"
    assert counts(stubs, "q") == before
    stubs.produce("q", [b"more"])
    assert [i.payload for i in stubs.lease("q").items][-1:] == [b"more"]
    delete(stubs, "q", force=True)
    expect_code(lambda: get_queue(stubs, "q"), Code.NOT_FOUND)


def test_recreated_queue_starts_empty_and_old_ids_are_not_found(stubs: Stubs) -> None:
    stubs.create("q", max_attempts=3)
    old_ready = stubs.produce("q", [b"old-1", b"old-2"]).ids
    produce_scheduled(stubs, "q", [b"old-later"])
    old_lease = stubs.lease("q", batch_size=1).items[0]
    delete(stubs, "q", force=True)

    recreated = stubs.create("q")
    assert recreated.max_attempts == 0
    assert counts(stubs, "q") == [(0, 0, 0)]
    assert stubs.list_items("q") == [] and scheduled_items(stubs, "q") == []
    assert list(stubs.lease("q", request_timeout=dur(0, 100_000_000)).items) == []

    # The new queue's items sit where the old ones did; old ids must not reach them.
    stubs.produce("q", [b"new-1", b"new-2"])
    leased = stubs.lease("q", batch_size=10)
    assert [i.payload for i in leased.items] == [b"new-1", b"new-2"]
    assert old_lease.id not in {i.id for i in leased.items}
    expect_code(lambda: stubs.complete("q", 0, [old_lease.id]), Code.NOT_FOUND)
    expect_code(lambda: stubs.complete("q", 0, [old_ready[1]]), Code.NOT_FOUND)
    assert counts(stubs, "q") == [(2, 2, 0)]
    stubs.complete("q", leased.partition, [i.id for i in leased.items])
    assert counts(stubs, "q") == [(0, 0, 0)]


def test_delete_dead_letter_queue_in_use_is_failed_precondition(stubs: Stubs) -> None:
    stubs.create("dlq")
    stubs.create("a", dead_queue="dlq")
    stubs.create("b", dead_queue="dlq")
    expect_code(lambda: delete(stubs, "dlq"), Code.FAILED_PRECONDITION)
    expect_code(lambda: delete(stubs, "dlq", force=True), Code.FAILED_PRECONDITION)
    delete(stubs, "a")
    expect_code(lambda: delete(stubs, "dlq"), Code.FAILED_PRECONDITION)
    update(stubs, queues_pb2.QueueInfo(queue_name="b"), ["dead_queue"])
    delete(stubs, "dlq")
    assert [q.queue_name for q in list_page(stubs).queues] == ["b"]


def test_delete_answers_a_waiting_lease_promptly(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.create("other")
    request = queue_pb2.LeaseRequest(queue_name="q", batch_size=1, client_id="waiter", request_timeout=dur(20))
    waiting = stubs.queue.Lease.future(request, timeout=25)
    try:
        wait_until(lambda: stubs.stats("q").lease_waiting == 1, timeout=10)
        started = time.monotonic()
        delete(stubs, "q")
        try:
            reply = waiting.result(timeout=15)
        except grpc.RpcError as error:
            assert error.code() == Code.UNAVAILABLE, f"{error.code().name}: {error.details()}"
        else:
            assert list(reply.items) == []
        assert time.monotonic() - started < 10, "answered by the delete, not by its 20 s request_timeout"
    finally:
        waiting.cancel()
    # The other queue is untouched and a queue of the same name can be made again.
    assert get_queue(stubs, "other").queue_name == "other"
    stubs.create("q")
    stubs.produce("q", [b"x"])
    assert [i.payload for i in stubs.lease("q", client_id="waiter").items] == [b"x"]


# -- ClearQueue -----------------------------------------------------------------------


def test_clear_requires_queue_or_scheduled(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"a"])
    error = expect_code(lambda: clear(stubs, "q"), Code.INVALID_ARGUMENT)
    assert bad_request_fields(error)
    expect_code(lambda: clear(stubs, "q", destructive=True), Code.INVALID_ARGUMENT)
    assert counts(stubs, "q") == [(1, 0, 0)]
    expect_code(lambda: clear(stubs, "ghost", queue=True), Code.NOT_FOUND)


def test_clear_queue_removes_ready_then_destructive_removes_leased(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"r1", b"r2", b"r3"])
    leased = stubs.lease("q", batch_size=1).items[0]
    produce_scheduled(stubs, "q", [b"s1", b"s2"])
    assert counts(stubs, "q") == [(3, 1, 2)]

    clear(stubs, "q", queue=True)
    assert counts(stubs, "q") == [(1, 1, 2)]
    assert [(i.id, i.is_leased) for i in stubs.list_items("q")] == [(leased.id, True)]
    assert len(scheduled_items(stubs, "q")) == 2

    clear(stubs, "q", queue=True, destructive=True)
    assert counts(stubs, "q") == [(0, 0, 2)]
    assert stubs.list_items("q") == []
    assert [i.payload for i in scheduled_items(stubs, "q")] == [b"s1", b"s2"]
    expect_code(lambda: stubs.complete("q", 0, [leased.id]), Code.NOT_FOUND)

    # The queue still works after clearing.
    stubs.produce("q", [b"after"])
    again = stubs.lease("q", batch_size=10)
    assert [i.payload for i in again.items] == [b"after"]
    stubs.complete("q", again.partition, [again.items[0].id])
    assert counts(stubs, "q") == [(0, 0, 2)]


def test_clear_scheduled_removes_only_scheduled_items(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"r1", b"r2"])
    leased = stubs.lease("q", batch_size=1).items[0]
    produce_scheduled(stubs, "q", [b"s1", b"s2", b"s3"])
    clear(stubs, "q", scheduled=True)
    assert counts(stubs, "q") == [(2, 1, 0)]
    assert scheduled_items(stubs, "q") == []
    assert [i.payload for i in stubs.list_items("q")] == [b"r1", b"r2"]
    # destructive without queue does not touch leased items either.
    produce_scheduled(stubs, "q", [b"s4"])
    clear(stubs, "q", scheduled=True, destructive=True)
    assert counts(stubs, "q") == [(2, 1, 0)]
    stubs.complete("q", 0, [leased.id])
    # Both at once empties everything but leased items.
    produce_scheduled(stubs, "q", [b"s5"])
    stubs.lease("q", batch_size=1)
    stubs.produce("q", [b"r3"])
    clear(stubs, "q", queue=True, scheduled=True)
    assert counts(stubs, "q") == [(1, 1, 0)]


def test_clear_covers_every_partition(stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=3)
    landed = {stubs.produce("q", [b"a", b"b"]).partition for _ in range(3)}
    assert landed == {0, 1, 2}
    produce_scheduled(stubs, "q", [b"s"])
    clear(stubs, "q", queue=True)
    assert [c[0] for c in counts(stubs, "q")] == [0, 0, 0]
    assert sum(c[2] for c in counts(stubs, "q")) == 1


# -- GetQueueStats --------------------------------------------------------------------


def test_stats_per_partition(stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=2)
    assert stubs.produce("q", [b"1", b"2", b"3"]).partition == 0
    assert stubs.produce("q", [b"4", b"5"]).partition == 1
    leased = stubs.lease("q", batch_size=2)  # from the fullest partition
    assert leased.partition == 0 and len(leased.items) == 2
    assert produce_scheduled(stubs, "q", [b"later"]).partition == 0  # fewest ready
    stats = stubs.stats("q")
    assert stats.queue_name == "q"
    assert [(p.partition, p.total, p.total_leased, p.scheduled) for p in stats.partitions] == [
        (0, 3, 2, 1),
        (1, 2, 0, 0),
    ]
    p0, p1 = stats.partitions
    assert secs(p0.average_age) > 0 and secs(p1.average_age) > 0
    assert secs(p0.average_leased_age) > 0
    assert secs(p0.average_age) < 60 and secs(p0.average_leased_age) < 60
    assert stats.lease_waiting == 0 and stats.produce_waiting == 0

    stubs.complete("q", 0, [i.id for i in leased.items])
    assert counts(stubs, "q") == [(1, 0, 1), (2, 0, 0)]


def test_stats_count_produced_and_completed_items(stubs: Stubs) -> None:
    stubs.create("q", requested_partitions=2)
    stubs.produce("q", [b"1", b"2", b"3"])  # partition 0
    stubs.produce("q", [b"4", b"5"])  # partition 1
    keyed = [queue_pb2.ProduceItem(payload=b"k", idempotency_key="once")]
    stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="q", items=keyed), timeout=10)
    again = stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="q", items=keyed), timeout=10)
    assert again.duplicates == 1  # stores nothing: not counted
    produce_scheduled(stubs, "q", [b"later"])  # scheduled items are produced too

    def counters() -> list[tuple[int, int]]:
        return [(p.produced, p.completed) for p in stubs.stats("q").partitions]

    assert sum(p for p, _ in counters()) == 7 and sum(c for _, c in counters()) == 0
    # Complete, Lease's complete_ids, and lease keys all count; Retry does not.
    a = stubs.lease("q", batch_size=2)
    stubs.complete("q", a.partition, [i.id for i in a.items])
    b = stubs.lease("q", batch_size=1)
    stubs.queue.Retry(
        queue_pb2.RetryRequest(queue_name="q", partition=b.partition, items=[queue_pb2.RetryItem(id=b.items[0].id)]),
        timeout=10,
    )
    c = stubs.lease("q", batch_size=1)
    stubs.lease("q", batch_size=1, complete_ids=[c.items[0].id], complete_partition=c.partition, request_timeout=dur(0))
    d = stubs.lease("q", batch_size=1, lease_key="job-1")
    assert len(d.items) == 1
    stubs.queue.Complete(queue_pb2.CompleteRequest(queue_name="q", lease_keys=["job-1"]), timeout=10)
    assert sum(c for _, c in counters()) == 4
    # A clear keeps the counters (they count what went through, not what is there).
    stubs.queues.ClearQueue(queues_pb2.ClearQueueRequest(queue_name="q", queue=True, scheduled=True), timeout=10)
    assert sum(p for p, _ in counters()) == 7 and sum(c for _, c in counters()) == 4


def test_stats_counts_waiting_leases(stubs: Stubs) -> None:
    stubs.create("q")
    request = queue_pb2.LeaseRequest(queue_name="q", batch_size=1, client_id="w", request_timeout=dur(10))
    waiting = stubs.queue.Lease.future(request, timeout=15)
    try:
        wait_until(lambda: stubs.stats("q").lease_waiting == 1, timeout=10)
        stubs.produce("q", [b"x"])
        assert [i.payload for i in waiting.result(timeout=10).items] == [b"x"]
        assert stubs.stats("q").lease_waiting == 0
    finally:
        waiting.cancel()


def test_stats_errors(stubs: Stubs) -> None:
    expect_code(lambda: stubs.stats("ghost"), Code.NOT_FOUND)
    expect_invalid(lambda: stubs.stats("bad name"), "queue_name")


# -- durability of admin changes ----------------------------------------------------


def test_admin_changes_survive_a_restart(data_dir: str) -> None:
    srv = ThreadServer(data_dir)
    channel = grpc.insecure_channel(srv.address)
    try:
        stubs = Stubs(channel)
        stubs.create("dlq")
        stubs.create("q", dead_queue="dlq", max_attempts=2, requested_partitions=1)
        stubs.create("gone")
        update(stubs, queues_pb2.QueueInfo(queue_name="q", requested_partitions=2, reference="v2"),
               ["requested_partitions", "reference"])
        delete(stubs, "gone")
        before = [get_queue(stubs, n) for n in ("dlq", "q")]
    finally:
        channel.close()
        srv.stop()
    srv = ThreadServer(data_dir)
    channel = grpc.insecure_channel(srv.address)
    try:
        stubs = Stubs(channel)
        assert [get_queue(stubs, n) for n in ("dlq", "q")] == before
        expect_code(lambda: get_queue(stubs, "gone"), Code.NOT_FOUND)
        assert len(stubs.stats("q").partitions) == 2
        expect_code(lambda: delete(stubs, "dlq"), Code.FAILED_PRECONDITION)
    finally:
        channel.close()
        srv.stop()


def block_new_storage(data_dir: str) -> list[str]:
    """Files where the next queues' storage would go (the first commit group, and the
    directories of queues too wide for a group: uids start at 1); remove them to unblock."""
    blockers = [os.path.join(data_dir, "groups", "0")]
    blockers += [os.path.join(data_dir, "queues", str(uid)) for uid in range(1, 4)]
    for path in blockers:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("not a directory")
    return blockers


def test_create_when_storage_fails_is_unavailable_and_retryable(server: ThreadServer, stubs: Stubs) -> None:
    blockers = block_new_storage(server.data_dir)
    expect_code(lambda: stubs.create("q"), Code.UNAVAILABLE)
    expect_code(lambda: stubs.create("wide", requested_partitions=40), Code.UNAVAILABLE)
    expect_code(lambda: get_queue(stubs, "q"), Code.NOT_FOUND)
    assert list(list_page(stubs).queues) == []
    for path in blockers:
        os.remove(path)
    # Safe to retry: the same calls now succeed and the queues work.
    stubs.create("q")
    stubs.create("wide", requested_partitions=40)
    for name in ("q", "wide"):
        stubs.produce(name, [b"x"])
        assert [i.payload for i in stubs.lease(name).items] == [b"x"]


def test_a_short_expire_timeout_without_a_lease_timeout_shrinks_the_default_lease(stubs: Stubs) -> None:
    created = stubs.create("shortlived", expire_timeout=dur(10))
    assert created.expire_timeout == dur(10)
    assert created.lease_timeout == dur(10)
