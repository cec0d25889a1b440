"""Client: every call against a real server, values in and out, errors mapped."""

from __future__ import annotations

import socket
import time
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

import grpc
import pytest

import querator
from querator import Item, ItemRef
from querator.embedded import EmbeddedServer

from sdk_helpers import client, queue, srv, unique  # noqa: F401 (fixtures)


def test_queue_admin_round_trip(client: querator.Client) -> None:
    dlq = unique("dlq")
    name = unique()
    client.create_queue(dlq)
    info = client.create_queue(
        name, dead_queue=dlq, reference="ref", lease_timeout=timedelta(seconds=20), max_attempts=3, partitions=2
    )
    assert info.name == name and info.dead_queue == dlq and info.reference == "ref"
    assert info.lease_timeout == timedelta(seconds=20) and info.expire_timeout == timedelta(hours=24)
    assert info.max_attempts == 3 and info.partitions == 2
    assert info.created_at is not None and info.created_at.tzinfo is not None
    assert client.get_queue(name) == info

    updated = client.update_queue(name, max_attempts=5, lease_timeout=30.0)
    assert updated.max_attempts == 5 and updated.lease_timeout == timedelta(seconds=30)
    assert updated.reference == "ref"  # untouched: only the named fields change
    with pytest.raises(ValueError):
        client.update_queue(name)

    with pytest.raises(querator.QueueExists) as exists:
        client.create_queue(name)
    assert exists.value.code == grpc.StatusCode.ALREADY_EXISTS and exists.value.status == "ALREADY_EXISTS"

    client.produce(name, ["a"])
    with pytest.raises(querator.FailedPrecondition):
        client.delete_queue(name)  # still holds an item
    client.delete_queue(name, force=True)
    with pytest.raises(querator.QueueNotFound):
        client.get_queue(name)
    with pytest.raises(querator.NotFound):
        client.queue_stats(name)


def test_list_queues_walks_pages(client: querator.Client) -> None:
    prefix = unique("list")
    names = sorted(f"{prefix}-{i:02d}" for i in range(7))
    for name in names:
        client.create_queue(name)
    pager = client.list_queues(page_size=3)
    seen = [q.name for q in pager if q.name.startswith(prefix)]
    assert seen == names
    pages = list(client.list_queues(page_size=3).pages())
    assert len(pages) >= 3 and all(len(page.items) <= 3 for page in pages)
    assert pages[-1].next_page_token == ""


def test_invalid_request_carries_field_violations(client: querator.Client) -> None:
    with pytest.raises(querator.InvalidRequest) as bad:
        client.create_queue("has space")
    assert [v.field for v in bad.value.field_violations] == ["queue.queue_name"]
    assert "whitespace" in bad.value.field_violations[0].description
    with pytest.raises(querator.InvalidRequest) as bad_batch:
        client.lease(unique(), batch_size=0, wait=0)
    assert bad_batch.value.field_violations[0].field == "batch_size"


def test_produce_lease_complete_values(client: querator.Client, queue: str) -> None:
    result = client.produce(
        queue,
        ["text", b"\x00bytes", Item(b"{}", encoding="application/json", kind="k", reference="r")],
        kind="default-kind",
    )
    assert len(result) == 3 and len(set(result.ids)) == 3 and result.partitions == [0, 0, 0]

    items = client.lease(queue, batch_size=10, wait=0)
    assert [i.payload for i in items] == [b"text", b"\x00bytes", b"{}"]
    first, second, third = items
    assert first.text == "text" and first.kind == "default-kind" and first.attempts == 1
    assert third.json() == {} and (third.encoding, third.kind, third.reference) == ("application/json", "k", "r")
    assert first.lease_deadline > datetime.now(UTC) and first.created_at <= datetime.now(UTC)
    assert first.queue_name == queue and first.partition == 0

    client.complete(items)
    assert all(i.state == "completed" for i in items)
    assert client.queue_stats(queue).total == 0
    client.complete(first)  # sent again: the server answers it as done
    with pytest.raises(querator.ItemNotFound) as lost:
        client.complete(querator.ItemRef(queue, 0, first.id + "0"))
    assert isinstance(lost.value, querator.LeaseLost)


class _OwnRef(NamedTuple):
    """A caller's own reference type: a tuple that is also a Ref (the three fields)."""

    queue_name: str
    partition: int
    id: str


def test_settle_calls_take_one_ref_a_list_or_a_tuple_of_them(client: querator.Client, queue: str) -> None:
    client.produce(queue, [b"a", b"b", b"c", b"d"])
    a, b, c, d = client.lease(queue, batch_size=4, wait=0)
    client.complete(_OwnRef(a.queue_name, a.partition, a.id))  # one ref, though a tuple
    client.complete((b, c))
    client.complete([ItemRef(d.queue_name, d.partition, d.id)])
    assert (b.state, c.state) == ("completed", "completed")
    assert client.queue_stats(queue).total == 0


def test_retry_now_later_and_dead(client: querator.Client) -> None:
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq)
    client.produce(name, ["now", "later", "dead"])
    now, later, dead = client.lease(name, batch_size=3, wait=0)

    now.retry()
    later.retry(in_=timedelta(hours=1))
    dead.dead()
    assert (now.state, later.state, dead.state) == ("retried", "retried", "dead")

    ready = list(client.list_items(name))
    assert [i.payload for i in ready] == [b"now"] and ready[0].attempts == 1 and not ready[0].is_leased
    scheduled = list(client.list_scheduled_items(name))
    assert [i.payload for i in scheduled] == [b"later"]
    assert scheduled[0].enqueue_at is not None and scheduled[0].enqueue_at > datetime.now(UTC) + timedelta(minutes=59)
    dead_items = list(client.list_items(dlq))
    assert [i.payload for i in dead_items] == [b"dead"] and dead_items[0].source_id == dead.id

    with pytest.raises(ValueError):
        client.retry(now, at=datetime.now(UTC), in_=5)
    with pytest.raises(ValueError):
        client.retry(now, at=datetime(2030, 1, 1))  # naive datetimes are refused


def test_extend_and_lease_lost_errors(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name, lease_timeout=timedelta(seconds=10))
    client.produce(name, ["a", "b"])
    a, b = client.lease(name, batch_size=2, wait=0)
    before = a.lease_deadline
    deadlines = client.extend([a, b], lease_timeout=timedelta(seconds=60))
    assert len(deadlines) == 2 and a.lease_deadline == deadlines[0] > before + timedelta(seconds=40)
    assert a.extend() <= a.lease_deadline + timedelta(seconds=1)

    ready = client.produce(name, ["c"])
    with pytest.raises(querator.NotLeased) as not_leased:
        client.complete(ItemRef(name, 0, ready.ids[0]))
    assert isinstance(not_leased.value, querator.LeaseLost) and not_leased.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(querator.ItemNotFound):
        client.extend(ItemRef(name, 0, "1.0.999999"))
    with pytest.raises(querator.QueueNotFound):
        client.complete(ItemRef(unique("missing"), 0, "x"))


def test_leased_item_context_manager(client: querator.Client) -> None:
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq)
    client.produce(name, ["ok", "boom", "poison", "manual"])
    ok, boom, poison, manual = client.lease(name, batch_size=4, wait=0)

    with ok:
        pass
    with pytest.raises(RuntimeError), boom:
        raise RuntimeError("handler failed")
    with poison:
        raise querator.DeadLetter("cannot parse")  # swallowed: the item is dead-lettered
    with manual:
        manual.retry(in_=timedelta(minutes=5))  # settled inside: the block leaves it alone

    assert (ok.state, boom.state, poison.state, manual.state) == ("completed", "retried", "dead", "retried")
    assert [i.payload for i in client.list_items(name)] == [b"boom"]
    assert [i.payload for i in client.list_items(dlq)] == [b"poison"]
    assert [i.payload for i in client.list_scheduled_items(name)] == [b"manual"]


def test_produce_splits_by_count_and_bytes(client: querator.Client, queue: str) -> None:
    progress: list[int] = []
    # One request in flight: requests are stored in order (FIFO across requests too).
    result = client.produce(queue, (f"n{i}" for i in range(2500)), on_progress=progress.append, max_in_flight=1)
    assert len(result) == 2500 and len(set(result.ids)) == 2500
    assert progress[-1] == 2500 and len(progress) == 3  # 1000 + 1000 + 500

    big = b"x" * 1_500_000
    result = client.produce(queue, [big] * 6)  # 9 MB: over the 5 MB limit as one request; several in flight
    assert len(result) == 6 and all(result.ids)
    assert client.queue_stats(queue).total == 2506

    pager = client.list_items(queue, page_size=1000)
    assert sum(len(page.items) for page in pager.pages()) == 2506
    first = next(iter(client.list_items(queue, page_size=1)))
    assert first.payload == b"n0"  # FIFO


def test_produce_scheduled_and_failure(client: querator.Client, queue: str) -> None:
    at = datetime.now(UTC) + timedelta(hours=2)
    result = client.produce(queue, ["later"], enqueue_at=at)
    assert client.lease(queue, wait=0) == []
    scheduled = list(client.list_scheduled_items(queue))
    assert [i.id for i in scheduled] == result.ids
    assert scheduled[0].enqueue_at is not None and abs(scheduled[0].enqueue_at - at) < timedelta(milliseconds=1)

    with pytest.raises(querator.QueueNotFound) as missing:
        client.produce(unique("missing"), ["x"] * 10)
    assert missing.value.produced is None


def test_lease_waits_then_answers_empty(client: querator.Client, queue: str) -> None:
    started = time.monotonic()
    assert client.lease(queue, batch_size=5, wait=0.4) == []
    assert 0.3 <= time.monotonic() - started < 3


def test_clear_queue(client: querator.Client, queue: str) -> None:
    client.produce(queue, ["a", "b"])
    client.produce(queue, ["s"], enqueue_at=datetime.now(UTC) + timedelta(hours=1))
    leased = client.lease(queue, wait=0)
    client.clear_queue(queue)
    stats = client.queue_stats(queue)
    assert (stats.total, stats.total_leased, stats.scheduled) == (1, 1, 1)
    client.clear_queue(queue, ready=True, scheduled=True, destructive=True)
    stats = client.queue_stats(queue)
    assert (stats.total, stats.scheduled) == (0, 0)
    with pytest.raises(querator.LeaseLost):
        leased[0].complete()


def test_storage_import_and_delete(client: querator.Client, queue: str) -> None:
    created = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
    ids = client.import_items(
        queue,
        [querator.StoredItem(payload=b"imported", attempts=2, source_id="src-1", created_at=created), "plain"],
    )
    assert len(ids) == 2
    stored = list(client.list_items(queue))
    assert [(i.payload, i.attempts, i.source_id) for i in stored] == [(b"imported", 2, "src-1"), (b"plain", 0, "")]
    assert stored[0].created_at == created and stored[0].expire_deadline is not None
    client.delete_items(queue, [ids[0], "1.0.424242"])  # unknown ids are ignored
    assert [i.payload for i in client.list_items(queue)] == [b"plain"]


def test_stats_values(client: querator.Client, queue: str) -> None:
    client.produce(queue, ["a", "b", "c"])
    client.lease(queue, wait=0)
    stats = client.queue_stats(queue)
    assert stats.queue_name == queue and len(stats.partitions) == 1
    assert (stats.total, stats.total_leased, stats.ready, stats.scheduled) == (3, 1, 2, 0)
    assert isinstance(stats.partitions[0].average_age, timedelta)


def test_unavailable_is_retried_then_raised() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backoff = querator.Backoff(initial=timedelta(milliseconds=10), maximum=timedelta(milliseconds=20))
    with querator.Client(f"127.0.0.1:{port}", retries=2, backoff=backoff, timeout=2) as c:
        started = time.monotonic()
        with pytest.raises(querator.Unavailable) as err:
            c.get_queue("anything")
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 5
        with pytest.raises(querator.Unavailable):
            c.wait_ready(timeout=0.2)


def test_retries_ride_over_a_server_start(tmp_path: object) -> None:
    """A read issued while the server is down succeeds once it comes up (UNAVAILABLE retried)."""
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = EmbeddedServer(str(tmp_path) + "/data", address=f"127.0.0.1:{port}", sync=False, log_level="warning")
    starter = threading.Timer(0.3, server.start)
    backoff = querator.Backoff(initial=timedelta(milliseconds=100), maximum=timedelta(milliseconds=300), jitter=0)
    try:
        with querator.Client(f"127.0.0.1:{port}", retries=30, backoff=backoff) as c:
            starter.start()
            assert list(c.list_queues()) == []
    finally:
        starter.join()
        server.stop()


def test_credentials_and_metadata_hooks(srv: EmbeddedServer) -> None:
    calls: list[int] = []

    def provider() -> list[tuple[str, str]]:
        calls.append(1)
        return [("x-request-source", "tests")]

    with srv.client(bearer_token="secret", metadata=[("x-team", "a")], metadata_provider=provider) as c:
        assert ("authorization", "Bearer secret") in c.config.call_metadata()
        c.create_queue(unique())
        assert calls  # the provider runs for each call
    with pytest.raises(ValueError):
        querator.Client(srv.address, call_credentials=grpc.access_token_call_credentials("t"))
    # TLS to a plain-text server cannot connect: the channel is built with credentials.
    tls = querator.Client(srv.address, tls=True, retries=0, timeout=1)
    try:
        assert tls.config.secure
        with pytest.raises((querator.Unavailable, querator.DeadlineExceeded)):
            tls.get_queue("x")
    finally:
        tls.close()


def test_config_is_shared_between_twins(srv: EmbeddedServer) -> None:
    c = querator.Client(srv.address, timeout=timedelta(seconds=3), retries=1)
    a = querator.AsyncClient(config=c.config)
    assert a.config is c.config and a.config.timeout == timedelta(seconds=3)
    c.close()


def test_retry_returns_and_marks_the_items_the_server_dead_lettered(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name, max_attempts=2)
    client.produce(name, ["a", "b"])
    first = client.lease(name, batch_size=2, wait=0)
    assert client.retry(first) == []
    assert [i.state for i in first] == ["retried", "retried"]
    second = client.lease(name, batch_size=2, wait=0)
    assert client.retry(second) == [i.id for i in second]  # out of attempts
    assert [i.state for i in second] == ["dead", "dead"]


def test_a_closed_client_says_so(srv: EmbeddedServer) -> None:
    c = querator.Client(srv.address)
    c.wait_ready(10)
    c.close()
    c.close()  # twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        c.wait_ready(1)
