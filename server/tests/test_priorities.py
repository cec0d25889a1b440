"""Item priorities (ProduceItem.priority, 0 to 9): a lease takes the highest-priority
ready items of its partition first, FIFO within a priority; priorities survive
scheduling, Retry, an expired lease, kill -9 and old data."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import lmdb
import pytest

# Records as the server before priorities wrote them (test_storage_format.py's).
from test_storage_format import FORMAT_4_DEAD, FORMAT_4_REQUEUED

from querator.v1 import queue_pb2, storage_pb2
from querator_server.storage import Item
from querator_server.storage.record import item_key, priority_key, read_state, with_lease

from conftest import ProcessServer, Stubs, ThreadServer, bad_request_fields, dur, wait_until


def _produce(stubs: Stubs, name: str, items: Sequence[tuple[bytes, int]]) -> queue_pb2.ProduceResponse:
    request = queue_pb2.ProduceRequest(
        queue_name=name, items=[queue_pb2.ProduceItem(payload=payload, priority=priority) for payload, priority in items]
    )
    return stubs.queue.Produce(request, timeout=10)


def _lease(stubs: Stubs, name: str, batch_size: int, **kw: object) -> queue_pb2.LeaseResponse:
    return stubs.lease(name, batch_size=batch_size, request_timeout=dur(0.2), **kw)


def test_a_lease_takes_higher_priorities_first_and_fifo_within_one(stubs: Stubs) -> None:
    stubs.create("prio", requested_partitions=1)
    _produce(stubs, "prio", [(b"low-1", 0), (b"mid-1", 5), (b"high-1", 9), (b"low-2", 0), (b"mid-2", 5), (b"high-2", 9)])
    first = _lease(stubs, "prio", 3)
    assert [(i.payload, i.priority) for i in first.items] == [(b"high-1", 9), (b"high-2", 9), (b"mid-1", 5)]
    # A higher priority produced later still goes before the older lower ones.
    _produce(stubs, "prio", [(b"top", 7)])
    second = _lease(stubs, "prio", 10)
    assert [(i.payload, i.priority) for i in second.items] == [(b"top", 7), (b"mid-2", 5), (b"low-1", 0), (b"low-2", 0)]
    listed = {i.payload: i.priority for i in stubs.list_items("prio")}
    assert listed == {b"high-1": 9, b"high-2": 9, b"mid-1": 5, b"top": 7, b"mid-2": 5, b"low-1": 0, b"low-2": 0}


def test_columnar_leases_carry_priorities_only_when_some_are_set(stubs: Stubs) -> None:
    stubs.create("cols", requested_partitions=1)
    _produce(stubs, "cols", [(b"a", 0), (b"b", 0)])
    plain = _lease(stubs, "cols", 10, columnar=True)
    assert list(plain.columns.payloads) == [b"a", b"b"] and list(plain.columns.priorities) == []
    _produce(stubs, "cols", [(b"c", 0), (b"d", 3)])
    mixed = _lease(stubs, "cols", 10, columnar=True)
    assert list(mixed.columns.payloads) == [b"d", b"c"] and list(mixed.columns.priorities) == [3, 0]


@pytest.mark.parametrize("priority", [-1, 10, 1000])
def test_a_priority_outside_0_to_9_is_refused_naming_the_field(stubs: Stubs, priority: int) -> None:
    stubs.create("bad")
    with pytest.raises(grpc.RpcError) as err:
        _produce(stubs, "bad", [(b"fine", 1), (b"bad", priority)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["items[1].priority"]
    assert stubs.stats("bad").partitions[0].total == 0
    imported = storage_pb2.ImportItemsRequest(queue_name="bad", items=[storage_pb2.StorageItem(payload=b"x", priority=priority)])
    with pytest.raises(grpc.RpcError) as err:
        stubs.storage.ImportItems(imported, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["items[0].priority"]


def test_scheduled_retried_expired_and_imported_items_keep_their_priority(stubs: Stubs) -> None:
    stubs.create("keep", requested_partitions=1, lease_timeout=dur(1))
    soon = queue_pb2.ProduceItem(payload=b"scheduled", priority=8)
    soon.enqueue_at.FromMicroseconds(int(time.time() * 1e6) + 300_000)
    stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="keep", items=[soon]), timeout=10)
    _produce(stubs, "keep", [(b"retried", 6), (b"expires", 4), (b"plain", 0)])
    stubs.storage.ImportItems(
        storage_pb2.ImportItemsRequest(queue_name="keep", items=[storage_pb2.StorageItem(payload=b"imported", priority=5)]),
        timeout=10,
    )
    leased = _lease(stubs, "keep", 2)
    assert [i.payload for i in leased.items] == [b"retried", b"imported"]
    stubs.queue.Retry(
        queue_pb2.RetryRequest(queue_name="keep", partition=0, items=[queue_pb2.RetryItem(id=leased.items[0].id)]), timeout=10
    )
    stubs.complete("keep", 0, [leased.items[1].id])
    # "expires" (4) is leased and left to run out; meanwhile the scheduled item falls due.
    again = _lease(stubs, "keep", 1)
    assert [(i.payload, i.priority) for i in again.items] == [(b"retried", 6)]
    stubs.complete("keep", 0, [again.items[0].id])
    expiring = _lease(stubs, "keep", 1)
    assert [(i.payload, i.priority) for i in expiring.items] == [(b"expires", 4)]
    wait_until(lambda: any(i.payload == b"scheduled" for i in stubs.list_items("keep")), timeout=10)
    wait_until(lambda: not any(i.is_leased and i.payload == b"expires" for i in stubs.list_items("keep")), timeout=10)
    rest = _lease(stubs, "keep", 10)
    assert [(i.payload, i.priority) for i in rest.items] == [(b"scheduled", 8), (b"expires", 4), (b"plain", 0)]
    assert rest.items[1].attempts == 2 and rest.items[1].last_error.startswith("lease expired")


def test_dead_letters_keep_their_priority_in_the_dead_letter_queue(stubs: Stubs) -> None:
    stubs.create("dlq-p", requested_partitions=1)
    stubs.create("src-p", requested_partitions=1, dead_queue="dlq-p")
    _produce(stubs, "src-p", [(b"plain", 0), (b"urgent", 7)])
    leased = _lease(stubs, "src-p", 2)
    items = [queue_pb2.RetryItem(id=i.id, dead=True) for i in leased.items]
    stubs.queue.Retry(queue_pb2.RetryRequest(queue_name="src-p", partition=0, items=items), timeout=10)
    wait_until(lambda: len(stubs.list_items("dlq-p")) == 2, timeout=10)
    assert [(i.payload, i.priority) for i in _lease(stubs, "dlq-p", 10).items] == [(b"urgent", 7), (b"plain", 0)]


def test_1000_items_of_random_priorities_leave_in_priority_order_per_partition(stubs: Stubs) -> None:
    """Leases of random sizes over three partitions, with Retry (re-queued at the tail of
    its priority) and produces in between: every lease answers exactly the highest
    priorities ready in its partition, FIFO within each, never a lower one while a
    higher one is ready there. Counted by payload (stable), not by id."""
    rng = random.Random(31)
    stubs.create("mixed", requested_partitions=3)
    # partition -> payload -> (priority, order): order grows with each entry into the
    # partition's ready set (produce or re-queue), so FIFO is ascending order.
    ready: dict[int, dict[bytes, tuple[int, int]]] = {0: {}, 1: {}, 2: {}}
    order = 0
    produced = completed = 0
    done: set[bytes] = set()

    def produce(count: int) -> None:
        nonlocal order, produced
        items = [(f"m{produced + n}".encode(), rng.randrange(10)) for n in range(count)]
        produced += count
        answer = _produce(stubs, "mixed", items)
        for payload, priority in items:
            order += 1
            ready[answer.partition][payload] = (priority, order)

    for _ in range(10):
        produce(rng.randrange(20, 60))
    deadline = time.monotonic() + 120
    while (completed < 1000 or any(ready.values())) and time.monotonic() < deadline:
        if produced < 1000 and rng.random() < 0.3:
            produce(min(1000 - produced, rng.randrange(5, 40)))
        answer = _lease(stubs, "mixed", rng.randrange(1, 40))
        if not answer.items:
            continue
        p = answer.partition
        got = [(i.payload, i.priority) for i in answer.items]
        expected = sorted(ready[p].items(), key=lambda entry: (-entry[1][0], entry[1][1]))[: len(got)]
        assert got == [(payload, priority) for payload, (priority, _) in expected], f"partition {p}"
        for payload, _ in got:
            del ready[p][payload]
        retry = [i for i in answer.items if rng.random() < 0.1]
        finish = [i.id for i in answer.items if i not in retry]
        if retry:
            stubs.queue.Retry(
                queue_pb2.RetryRequest(queue_name="mixed", partition=p, items=[queue_pb2.RetryItem(id=i.id) for i in retry]),
                timeout=10,
            )
            for item in retry:
                order += 1
                ready[p][item.payload] = (item.priority, order)
        if finish:
            stubs.complete("mixed", p, finish)
            for item in answer.items:
                if item.id in finish:
                    assert item.payload not in done
                    done.add(item.payload)
            completed += len(finish)
    assert completed == 1000 and not any(ready.values())
    assert sum(p.total for p in stubs.stats("mixed").partitions) == 0


def test_records_written_before_priorities_read_as_priority_0_and_encode_unchanged() -> None:
    for raw in (FORMAT_4_DEAD, FORMAT_4_REQUEUED):
        item = Item.decode(raw)
        assert item.priority == 0
        assert item.encode() == raw
    # The priority lives in the flags byte's top bits and survives the lease rewrites.
    raw = Item(payload=b"p", priority=9, created_at=1, expire_deadline=2).encode()
    assert Item.decode(raw).priority == 9
    leased = with_lease(raw, read_state(raw), attempts=1, deadline=5, leased_at=4)
    assert Item.decode(leased).priority == 9 and Item.decode(leased).is_leased


def test_a_data_directory_without_priorities_serves_unchanged_and_takes_them(tmp_path: Path) -> None:
    """Items stored with no priority (byte for byte what the server wrote before
    priorities, see the test above) lease FIFO after a restart; items of a priority
    produced afterwards go first; an index entry an older server left pointing at an
    item it since leased is dropped, not served."""
    data = tmp_path / "data"
    server = ThreadServer(str(data))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            stubs.create("old", requested_partitions=1)
            ids = list(stubs.produce("old", [b"a", b"b", b"c"]).ids)
    finally:
        server.stop()
    # The index entry an older server would leave: it leased "b" (priority 3 for us)
    # knowing nothing of the index.
    store_dir = _queue_dir(data)
    env = lmdb.open(str(store_dir), max_dbs=1100, subdir=True)
    with env.begin(write=True) as txn:
        db = env.open_db(_partition_db(env, txn), txn=txn, create=False)
        seq = int(ids[1].rsplit(".", 1)[1], 16)
        raw = txn.get(item_key(seq), db=db)
        assert raw is not None and raw[0] >> 4 == 0
        txn.put(item_key(seq), with_lease(raw, read_state(raw), attempts=1, deadline=(1 << 62), leased_at=1), db=db)
        txn.put(priority_key(3, seq), b"", db=db)
    env.close()
    server = ThreadServer(str(data))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            _produce(stubs, "old", [(b"urgent", 2)])
            got = _lease(stubs, "old", 10)
            assert [(i.payload, i.priority) for i in got.items] == [(b"urgent", 2), (b"a", 0), (b"c", 0)]
    finally:
        server.stop()


def _queue_dir(data: Path) -> Path:
    """The LMDB directory holding queue "old" (its own, or its commit group's)."""
    found = [p.parent for p in data.rglob("data.mdb") if p.parent.name != "catalog"]
    assert len(found) == 1, found
    return found[0]


def _partition_db(env: lmdb.Environment, txn: lmdb.Transaction[bytes]) -> bytes:
    names = [bytes(key) for key, _ in txn.cursor()]
    (name,) = [n for n in names if n.endswith(b"p0")]
    return name


def test_kill9_keeps_the_priority_index(process_server: ProcessServer) -> None:
    """kill -9 right after each write point of the index (produce, lease, re-queue):
    after the restart every acknowledged item is there once, leased ones stay leased,
    and the ready ones come out in priority order."""
    proc = process_server
    for round_ in range(3):
        channel = grpc.insecure_channel(proc.address)
        stubs = Stubs(channel)
        name = f"k{round_}"
        stubs.create(name, requested_partitions=1, lease_timeout=dur(600))
        rng = random.Random(round_)
        items = [(f"{name}-{n}".encode(), rng.randrange(10)) for n in range(200)]
        _produce(stubs, name, items[:100])
        leased = _lease(stubs, name, 30)
        retried = leased.items[:10]
        stubs.queue.Retry(
            queue_pb2.RetryRequest(queue_name=name, partition=0, items=[queue_pb2.RetryItem(id=i.id) for i in retried]),
            timeout=10,
        )
        _produce(stubs, name, items[100:])
        channel.close()
        proc.kill9()
        proc.start()
        channel = grpc.insecure_channel(proc.address)
        stubs = Stubs(channel)
        try:
            still = {i.payload for i in stubs.list_items(name) if i.is_leased}
            assert still == {i.payload for i in leased.items[10:]}
            priorities = dict(items)
            expected = sorted((p for p in priorities if p not in still), key=lambda p: -priorities[p])
            got = [i.payload for i in _lease(stubs, name, 1000).items]
            assert sorted(got) == sorted(expected)
            assert [priorities[p] for p in got] == sorted((priorities[p] for p in got), reverse=True)
        finally:
            channel.close()


class _Load:
    """A producer (random priorities) and a consumer (leasing, completing, retrying
    some) on one queue, recording what the server acknowledged, by payload."""

    def __init__(self, stubs: Stubs, name: str, seed: int) -> None:
        self.stubs, self.name, self.rng = stubs, name, random.Random(seed)
        self.stop = threading.Event()
        self.acked: dict[bytes, int] = {}
        self.completed: set[bytes] = set()
        self.unsure_completed: set[bytes] = set()
        self.threads = [threading.Thread(target=self.produce), threading.Thread(target=self.consume)]

    def produce(self) -> None:
        n = 0
        while not self.stop.is_set() and n < 20_000:
            items = [(f"{self.name}-{n + i}".encode(), self.rng.randrange(10)) for i in range(20)]
            n += 20
            try:
                _produce(self.stubs, self.name, items)
            except grpc.RpcError:
                return
            self.acked.update(items)

    def consume(self) -> None:
        while not self.stop.is_set():
            try:
                got = _lease(self.stubs, self.name, 15)
                if not got.items:
                    continue
                back = [i for i in got.items if i.priority % 3 == 0][:2]
                done = [i for i in got.items if i not in back]
                if back:
                    items = [queue_pb2.RetryItem(id=i.id) for i in back]
                    self.stubs.queue.Retry(queue_pb2.RetryRequest(queue_name=self.name, partition=0, items=items), timeout=10)
                if done:
                    payloads = {i.payload for i in done}
                    self.unsure_completed |= payloads
                    self.stubs.complete(self.name, got.partition, [i.id for i in done])
                    self.completed |= payloads
                    self.unsure_completed -= payloads
            except grpc.RpcError:
                return


def _stored(stubs: Stubs, name: str) -> list[storage_pb2.StorageItem]:
    out: list[storage_pb2.StorageItem] = []
    token = ""
    while True:
        request = storage_pb2.ListItemsRequest(queue_name=name, partition=0, page_size=1000, page_token=token)
        page = stubs.storage.ListItems(request, timeout=10)
        out.extend(page.items)
        token = page.next_page_token
        if not token:
            return out


def test_kill9_under_load_of_ranked_produce_lease_and_retry(process_server: ProcessServer) -> None:
    """kill -9 at whatever the load is doing (produce with random priorities, lease,
    complete, retry): after the restart every acknowledged item not acknowledged
    completed is there exactly once (by payload), none acknowledged completed is, and
    the ready ones lease out in priority order. Three kills after bounded random times."""
    proc = process_server
    rng = random.Random(7)
    for round_ in range(3):
        name = f"load{round_}"
        channel = grpc.insecure_channel(proc.address)
        stubs = Stubs(channel)
        stubs.create(name, requested_partitions=1, lease_timeout=dur(600))
        load = _Load(stubs, name, round_)
        for thread in load.threads:
            thread.start()
        time.sleep(0.5 + rng.random())
        proc.kill9()
        load.stop.set()
        for thread in load.threads:
            thread.join(30)
        channel.close()
        proc.start()
        channel = grpc.insecure_channel(proc.address)
        stubs = Stubs(channel)
        try:
            listed = _stored(stubs, name)
            stored = [i.payload for i in listed]
            ready = sum(1 for i in listed if not i.is_leased)  # leases outlive the kill
            assert len(stored) == len(set(stored)), "an item stored twice"
            left = set(stored)
            assert not (left & load.completed), "a completed item came back"
            missing = set(load.acked) - load.completed - load.unsure_completed - left
            assert not missing, f"{len(missing)} acknowledged items lost"
            leased = 0
            for _ in range(100):
                got = _lease(stubs, name, 1000)
                if not got.items:
                    break
                priorities = [i.priority for i in got.items]
                assert priorities == sorted(priorities, reverse=True)
                leased += len(got.items)
            assert leased == ready
            assert all(i.is_leased for i in _stored(stubs, name))
        finally:
            channel.close()


def test_priorities_order_group_heads_and_ungrouped_items_never_a_group_inside(stubs: Stubs) -> None:
    """Groups and priorities together: FIFO and one in flight within a group always
    win; priority orders what is eligible (group heads and items of no group), FIFO
    within a priority. A group's later item of a high priority waits for its turn, and
    goes first once it is its group's head."""
    stubs.create("both", requested_partitions=1)

    def item(payload: bytes, priority: int, group: str = "") -> queue_pb2.ProduceItem:
        return queue_pb2.ProduceItem(payload=payload, priority=priority, group_key=group)

    produce = [item(b"A1", 0, "A"), item(b"A2", 9, "A"), item(b"B1", 5, "B"), item(b"B2", 0, "B"), item(b"U", 0), item(b"V", 7)]
    stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="both", items=produce), timeout=10)
    first = _lease(stubs, "both", 10)
    assert [(i.payload, i.priority) for i in first.items] == [(b"V", 7), (b"B1", 5), (b"A1", 0), (b"U", 0)]
    _produce(stubs, "both", [(b"W", 3), (b"Z", 0)])
    by_payload = {i.payload: i.id for i in first.items}
    stubs.complete("both", 0, [by_payload[b"A1"]])  # A2 (9) becomes A's head
    second = _lease(stubs, "both", 10)
    assert [(i.payload, i.priority) for i in second.items] == [(b"A2", 9), (b"W", 3), (b"Z", 0)]
    # B1 given back (Retry now): it stays B's head, in the priority index again, and
    # comes before everything of a lower priority; B2 still waits behind it.
    stubs.queue.Retry(
        queue_pb2.RetryRequest(queue_name="both", partition=0, items=[queue_pb2.RetryItem(id=by_payload[b"B1"])]), timeout=10
    )
    _produce(stubs, "both", [(b"late", 4)])
    third = _lease(stubs, "both", 10)
    assert [(i.payload, i.priority) for i in third.items] == [(b"B1", 5), (b"late", 4)]
    stubs.complete("both", 0, [i.id for i in third.items if i.payload == b"B1"])
    assert [i.payload for i in _lease(stubs, "both", 10).items] == [b"B2"]
