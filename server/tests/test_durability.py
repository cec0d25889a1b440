"""Durability: what an OK promised is still there after a restart or a ``kill -9``.

API.md, "Durability": an OK from Produce, Complete, Retry or a queue admin call means
the change is on disk and survives ``kill -9``; a Lease reply means the lease is on
disk. These tests use real servers on real LMDB directories; the crash tests really
``kill -9`` a ``querator serve`` child process.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf import field_mask_pb2

from querator.v1 import queue_pb2, queues_pb2, storage_pb2, storage_pb2_grpc

from conftest import ProcessServer, Stubs, ThreadServer, wait_until

LONG_LEASE = {"seconds": 600}  # no lease may expire while a test runs


# -- helpers ------------------------------------------------------------------------


@pytest.fixture
def proc(process_server: ProcessServer) -> ProcessServer:
    """A ``querator serve`` child, started (conftest's process_server)."""
    return process_server


def connect(address: str) -> Stubs:
    return Stubs(grpc.insecure_channel(address))


def partitions_of(stubs: Stubs, name: str) -> int:
    info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name=name), timeout=10).queue
    return info.requested_partitions


def list_partition(stubs: Stubs, name: str, partition: int, *, scheduled: bool = False) -> list[storage_pb2.StorageItem]:
    """Every ready+leased (or scheduled) item of one partition, following page tokens."""
    items: list[storage_pb2.StorageItem] = []
    token = ""
    for _ in range(10_000):
        if scheduled:
            request = storage_pb2.ListScheduledItemsRequest(
                queue_name=name, partition=partition, page_size=100, page_token=token
            )
            page = stubs.storage.ListScheduledItems(request, timeout=10)
        else:
            request = storage_pb2.ListItemsRequest(queue_name=name, partition=partition, page_size=100, page_token=token)
            page = stubs.storage.ListItems(request, timeout=10)
        items.extend(page.items)
        token = page.next_page_token
        if not token:
            return items
    raise AssertionError("ListItems paging did not end")


def list_all(stubs: Stubs, name: str, *, scheduled: bool = False) -> dict[int, list[storage_pb2.StorageItem]]:
    return {
        p: list_partition(stubs, name, p, scheduled=scheduled) for p in range(partitions_of(stubs, name))
    }


def counts(stats: queues_pb2.GetQueueStatsResponse) -> list[tuple[int, int, int, int]]:
    return [(p.partition, p.total, p.total_leased, p.scheduled) for p in stats.partitions]


def assert_stats_match_storage(stubs: Stubs, name: str) -> None:
    """GetQueueStats counters equal what ListItems / ListScheduledItems show."""
    ready_and_leased = list_all(stubs, name)
    scheduled = list_all(stubs, name, scheduled=True)
    expected = [
        (p, len(items), sum(1 for i in items if i.is_leased), len(scheduled[p]))
        for p, items in ready_and_leased.items()
    ]
    assert counts(stubs.stats(name)) == expected


def code_of(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# -- graceful restart -------------------------------------------------------------------


def test_restart_keeps_items_leases_ids_stats_and_settings(data_dir: str) -> None:
    srv = ThreadServer(data_dir)
    stubs = connect(srv.address)
    try:
        stubs.create("dlq")
        stubs.create(
            "keep",
            dead_queue="dlq",
            reference="ref-1",
            lease_timeout=LONG_LEASE,
            expire_timeout={"seconds": 7200},
            max_attempts=7,
            requested_partitions=3,
        )
        # An update must persist too (admin calls are durable).
        update = queues_pb2.UpdateQueueRequest(
            queue=queues_pb2.QueueInfo(queue_name="keep", max_attempts=9, reference="ref-2", requested_partitions=4),
            update_mask=field_mask_pb2.FieldMask(paths=["max_attempts", "reference", "requested_partitions"]),
        )
        stubs.queues.UpdateQueue(update, timeout=10)

        produced: list[str] = []
        for batch in range(6):
            payloads = [f"b{batch}-{i}".encode() for i in range(5)]
            items = [queue_pb2.ProduceItem(payload=p, kind="k", encoding="e", reference=f"r{batch}") for p in payloads]
            produced += stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="keep", items=items), timeout=10).ids
        due = int(time.time()) + 3600
        scheduled_ids = list(
            stubs.queue.Produce(
                queue_pb2.ProduceRequest(
                    queue_name="keep",
                    items=[queue_pb2.ProduceItem(utf8="later", enqueue_at={"seconds": due})],
                ),
                timeout=10,
            ).ids
        )
        leases = [stubs.lease("keep", batch_size=4, client_id=f"c{n}") for n in range(3)]
        leased_ids = {i.id for lease in leases for i in lease.items}
        assert len(leased_ids) == 12
        # Complete half of each lease.
        completed: dict[str, int] = {}
        still_leased: dict[str, int] = {}
        for lease in leases:
            ids = [i.id for i in lease.items]
            stubs.complete("keep", lease.partition, ids[:2])
            completed.update(dict.fromkeys(ids[:2], lease.partition))
            still_leased.update({i: lease.partition for i in ids[2:]})

        before_info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="keep"), timeout=10).queue
        before_list = stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(), timeout=10)
        before_items = list_all(stubs, "keep")
        before_scheduled = list_all(stubs, "keep", scheduled=True)
        before_counts = counts(stubs.stats("keep"))
        assert sum(len(v) for v in before_items.values()) == len(produced) - len(completed)
        assert sum(c[2] for c in before_counts) == len(still_leased)
    finally:
        stubs.channel.close()
        srv.stop()

    srv = ThreadServer(data_dir)
    stubs = connect(srv.address)
    try:
        after_info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="keep"), timeout=10).queue
        assert after_info == before_info
        assert after_info.max_attempts == 9 and after_info.reference == "ref-2"
        assert after_info.dead_queue == "dlq" and after_info.requested_partitions == 4
        assert stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(), timeout=10) == before_list
        after_items = list_all(stubs, "keep")
        assert len(after_items) == 4 and all(after_items.values())  # items on the added partition too
        assert after_items == before_items  # same ids, order, lease state, deadlines, payloads
        assert list_all(stubs, "keep", scheduled=True) == before_scheduled
        assert [i.id for items in before_scheduled.values() for i in items] == scheduled_ids
        assert counts(stubs.stats("keep")) == before_counts
        stored = {i.id: i for items in after_items.values() for i in items}
        assert not completed.keys() & stored.keys()
        assert all(stored[i].is_leased for i in still_leased)
        assert set(stored) == set(produced) - completed.keys()

        # A completed id stays gone (sent again, it is answered as done: that record
        # survived too); the leases taken before the restart still hold.
        for done_id, p in completed.items():
            again = stubs.queue.Complete(queue_pb2.CompleteRequest(queue_name="keep", partition=p, ids=[done_id]), timeout=10)
            assert list(again.already_completed) == [done_id]
        assert set(i.id for items in list_all(stubs, "keep").values() for i in items) == set(produced) - completed.keys()
        by_partition: dict[int, list[str]] = {}
        for item_id, p in still_leased.items():
            by_partition.setdefault(p, []).append(item_id)
        for p, ids in by_partition.items():
            stubs.complete("keep", p, ids)
        # The ready items are leased with the ids they had before the restart.
        ready_ids = {i.id for i in stored.values() if not i.is_leased}
        leased_now: set[str] = set()
        for _ in range(10):
            reply = stubs.lease("keep", batch_size=100, request_timeout={"nanos": 100_000_000})
            if not reply.items:
                break
            leased_now.update(i.id for i in reply.items)
        assert leased_now == ready_ids
        assert_stats_match_storage(stubs, "keep")
    finally:
        stubs.channel.close()
        srv.stop()


# -- kill -9 ------------------------------------------------------------------------------


@dataclass
class Ledger:
    """What the server acknowledged, and what was in flight when it died."""

    produced: dict[str, bytes] = field(default_factory=dict)  # acknowledged id -> payload
    completed: set[str] = field(default_factory=set)  # acknowledged
    leased: dict[str, int] = field(default_factory=dict)  # acknowledged lease, not completed: id -> partition
    unsure_payloads: set[bytes] = field(default_factory=set)  # produce in flight at the kill
    unsure_completed: dict[str, int] = field(default_factory=dict)  # complete in flight at the kill
    acks: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _worker(address: str, cycle: int, ledger: Ledger, errors: list[Exception], name: str = "crash") -> None:
    """Produce batches and complete leased items until the server dies under us."""
    rng = random.Random(f"{cycle}-{name}")
    stubs = connect(address)
    batch = 0
    try:
        while True:
            payloads = [f"{name}-c{cycle}-b{batch}-{i}".encode() for i in range(rng.randint(1, 25))]
            batch += 1
            try:
                reply = stubs.produce(name, payloads)
            except grpc.RpcError:
                with ledger.lock:
                    ledger.unsure_payloads.update(payloads)
                return
            with ledger.lock:
                ledger.produced.update(zip(reply.ids, payloads, strict=True))
                ledger.acks += 1
            try:
                lease = stubs.lease(name, batch_size=rng.randint(1, 30), request_timeout={"nanos": 50_000_000})
            except grpc.RpcError:
                return  # an unacknowledged lease may or may not be on disk; both are fine
            ids = [i.id for i in lease.items]
            with ledger.lock:
                ledger.leased.update(dict.fromkeys(ids, lease.partition))
                ledger.acks += 1
            done = ids[: max(0, len(ids) - rng.randint(0, 2))]  # leave a few leased
            if not done:
                continue
            try:
                stubs.complete(name, lease.partition, done)
            except grpc.RpcError:
                with ledger.lock:
                    ledger.unsure_completed.update(dict.fromkeys(done, lease.partition))
                    for i in done:
                        ledger.leased.pop(i, None)
                return
            with ledger.lock:
                ledger.completed.update(done)
                for i in done:
                    ledger.leased.pop(i, None)
                ledger.acks += 1
    except Exception as exc:  # noqa: BLE001 - surfaced by the test
        errors.append(exc)
    finally:
        stubs.channel.close()


def _check_after_crash(stubs: Stubs, ledger: Ledger, name: str) -> None:
    listed = list_all(stubs, name)
    items = [i for p in listed.values() for i in p]
    ids = [i.id for i in items]
    payloads = [i.payload for i in items]
    assert len(ids) == len(set(ids)), "an id is stored twice"
    assert len(payloads) == len(set(payloads)), "an item is stored twice"
    stored = {i.id: i for i in items}
    lost = [i for i in ledger.produced if i not in ledger.completed and i not in ledger.unsure_completed and i not in stored]
    assert not lost, f"{len(lost)} acknowledged items lost, e.g. {lost[:3]}"
    resurrected = ledger.completed & stored.keys()
    assert not resurrected, f"completed items came back: {sorted(resurrected)[:3]}"
    for item_id, item in stored.items():
        if item_id in ledger.produced:
            assert item.payload == ledger.produced[item_id]
        else:
            assert item.payload in ledger.unsure_payloads, f"unknown item {item_id} {item.payload!r}"
    for item_id in ledger.leased:
        assert stored[item_id].is_leased, f"acknowledged lease of {item_id} lost"
    for item_id in ledger.unsure_completed:
        assert item_id not in stored or stored[item_id].is_leased
    assert_stats_match_storage(stubs, name)


# One queue; four queues of one commit group, whose cycles share commits; and four
# queues with an environment each (commit groups off).
@pytest.mark.parametrize(
    ("names", "groups"),
    [(["crash"], "true"), (["crash-a", "crash-b", "crash-c", "crash-d"], "true"), (["crash-a", "crash-b", "crash-c", "crash-d"], "false")],
    ids=["one", "group", "own-environments"],
)
def test_kill9_loses_no_acknowledged_produce_or_complete(
    data_dir: str, names: list[str], groups: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QUERATOR_COMMIT_GROUPS", groups)
    proc = ProcessServer(data_dir)
    proc.start()
    try:
        _kill9_loop(proc, names)
    finally:
        proc.stop()
    where = "groups" if groups == "true" else "queues"
    assert os.listdir(os.path.join(data_dir, where)), f"the queues were not stored under {where}/"


def _kill9_loop(proc: ProcessServer, names: list[str]) -> None:
    stubs = connect(proc.address)
    for name in names:
        stubs.create(name, requested_partitions=2, lease_timeout=LONG_LEASE)
    stubs.channel.close()
    ledgers = {name: Ledger() for name in names}
    for cycle in range(5):
        errors: list[Exception] = []
        starts = {name: ledger.acks for name, ledger in ledgers.items()}
        workers = [
            threading.Thread(target=_worker, args=(proc.address, cycle, ledgers[name], errors, name), daemon=True)
            for name in names
        ]
        for worker in workers:
            worker.start()
        target = random.Random(100 + cycle).randint(3, 40)
        wait_until(
            lambda target=target, workers=workers, starts=starts: all(
                ledgers[n].acks - starts[n] >= target for n in names
            )
            or not all(w.is_alive() for w in workers),
            timeout=20,
        )
        proc.kill9()  # at whatever the workers are doing right now
        for worker in workers:
            worker.join(15)
            assert not worker.is_alive(), "a worker did not notice the dead server"
        assert not errors, errors
        assert all(ledgers[n].acks - starts[n] >= target for n in names)
        proc.start()
        stubs = connect(proc.address)
        try:
            for name, ledger in ledgers.items():
                _check_after_crash(stubs, ledger, name)
                _finish_leases(stubs, ledger, name)
        finally:
            stubs.channel.close()
    for ledger in ledgers.values():
        assert len(ledger.produced) >= 15 and len(ledger.completed) >= 5  # the loop really ran


def _finish_leases(stubs: Stubs, ledger: Ledger, name: str) -> None:
    """Leases acknowledged before the crash still hold and complete with the same ids;
    an in-flight complete that did not land can be finished now."""
    pending: dict[int, list[str]] = {}
    stored = {i.id for p in list_all(stubs, name).values() for i in p}
    for item_id, p in [*ledger.leased.items(), *ledger.unsure_completed.items()]:
        if item_id in stored:
            pending.setdefault(p, []).append(item_id)
        else:  # the in-flight complete landed before the kill
            ledger.completed.add(item_id)
    for p, ids in pending.items():
        stubs.complete(name, p, ids)
        ledger.completed.update(ids)
    ledger.leased.clear()
    ledger.unsure_completed.clear()
    assert_stats_match_storage(stubs, name)


def test_kill9_keeps_leases(proc: ProcessServer) -> None:
    stubs = connect(proc.address)
    stubs.create("leases", lease_timeout=LONG_LEASE)
    produced = list(stubs.produce("leases", [f"i{n}".encode() for n in range(10)]).ids)
    lease = stubs.lease("leases", batch_size=4, client_id="worker")
    leased = [i.id for i in lease.items]
    assert leased == produced[:4]
    deadlines = {i.id: i.lease_deadline for i in lease.items}
    stubs.channel.close()

    proc.kill9()
    proc.start()
    stubs = connect(proc.address)
    try:
        stats = stubs.stats("leases")
        assert (stats.partitions[0].total, stats.partitions[0].total_leased) == (10, 4)
        stored = {i.id: i for i in list_all(stubs, "leases")[0]}
        assert all(stored[i].is_leased and stored[i].lease_deadline == deadlines[i] for i in leased)
        # Not handed out again: the next lease gets the other six.
        again = stubs.lease("leases", batch_size=100, request_timeout={"nanos": 100_000_000})
        assert [i.id for i in again.items] == produced[4:]
        stubs.complete("leases", lease.partition, leased)
        stats = stubs.stats("leases")
        assert (stats.partitions[0].total, stats.partitions[0].total_leased) == (6, 6)
    finally:
        stubs.channel.close()


def test_kill9_after_admin_calls_keeps_them_and_deleted_queues_stay_deleted(proc: ProcessServer) -> None:
    stubs = connect(proc.address)
    stubs.create("gone", requested_partitions=2)
    stubs.create("stays")
    for n in range(3):
        stubs.produce("gone", [f"old-{n}-{i}".encode() for i in range(5)])
    stubs.produce("stays", [b"s"])
    stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="gone", force=True), timeout=10)
    # Other admin calls acknowledged just before the crash hold too.
    update = queues_pb2.UpdateQueueRequest(
        queue=queues_pb2.QueueInfo(queue_name="stays", max_attempts=3, lease_timeout={"seconds": 42}),
        update_mask=field_mask_pb2.FieldMask(paths=["max_attempts", "lease_timeout"]),
    )
    stubs.queues.UpdateQueue(update, timeout=10)
    stubs.create("cleared")
    stubs.produce("cleared", [b"c1", b"c2"])
    stubs.queues.ClearQueue(queues_pb2.ClearQueueRequest(queue_name="cleared", queue=True), timeout=10)
    stubs.channel.close()

    proc.kill9()
    proc.start()
    stubs = connect(proc.address)
    try:
        missing = lambda: stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="gone"), timeout=10)
        assert code_of(missing) == grpc.StatusCode.NOT_FOUND
        names = [q.queue_name for q in stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(), timeout=10).queues]
        assert names == ["cleared", "stays"]
        assert [i.payload for i in list_all(stubs, "stays")[0]] == [b"s"]
        stays = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="stays"), timeout=10).queue
        assert (stays.max_attempts, stays.lease_timeout.seconds) == (3, 42)
        assert list_all(stubs, "cleared") == {0: []}
        # A queue of the same name starts empty, on every partition.
        stubs.create("gone", requested_partitions=2)
        assert counts(stubs.stats("gone")) == [(0, 0, 0, 0), (1, 0, 0, 0)]
        assert list_all(stubs, "gone") == {0: [], 1: []}
        empty = stubs.lease("gone", batch_size=10, request_timeout={"nanos": 100_000_000})
        assert list(empty.items) == []
        stubs.produce("gone", [b"new"])
    finally:
        stubs.channel.close()

    proc.kill9()
    proc.start()
    stubs = connect(proc.address)
    try:
        items = [i.payload for p in list_all(stubs, "gone").values() for i in p]
        assert items == [b"new"]
    finally:
        stubs.channel.close()


def test_stats_after_kill9_equal_what_list_items_shows(proc: ProcessServer) -> None:
    stubs = connect(proc.address)
    stubs.create("mixed", requested_partitions=3, lease_timeout=LONG_LEASE)
    due = int(time.time()) + 3600
    for n in range(9):
        items = [queue_pb2.ProduceItem(payload=f"{n}-{i}".encode()) for i in range(n + 1)]
        if n % 3 == 0:
            items.append(queue_pb2.ProduceItem(utf8=f"later-{n}", enqueue_at={"seconds": due + n}))
        stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="mixed", items=items), timeout=10)
    for n in range(4):
        lease = stubs.lease("mixed", batch_size=3 + n)
        if n:
            stubs.complete("mixed", lease.partition, [i.id for i in lease.items][:n])
    before = counts(stubs.stats("mixed"))
    assert_stats_match_storage(stubs, "mixed")
    stubs.channel.close()

    proc.kill9()
    proc.start()
    stubs = connect(proc.address)
    try:
        assert counts(stubs.stats("mixed")) == before
        assert_stats_match_storage(stubs, "mixed")
        assert sum(c[3] for c in before) == 3 and sum(c[2] for c in before) > 0
    finally:
        stubs.channel.close()


# -- map growth ---------------------------------------------------------------------------


def test_small_map_grows_instead_of_failing(data_dir: str) -> None:
    srv = ThreadServer(data_dir, map_size=1 << 20)
    stubs = connect(srv.address)
    sent: list[tuple[str, bytes]] = []
    try:
        stubs.create("big")
        for batch in range(60):  # 60 x 10 x 10 KiB = 6 MB, six times the initial map
            payloads = [bytes([batch, i]) + os.urandom(10 * 1024 - 2) for i in range(10)]
            reply = stubs.produce("big", payloads)
            sent += zip(reply.ids, payloads, strict=True)
        listed = [(i.id, i.payload) for i in list_all(stubs, "big")[0]]
        assert listed == sent
        assert stubs.stats("big").partitions[0].total == len(sent)

        # One 4.5 MB item in a fresh 1 MiB map needs several doublings in one commit.
        stubs.create("huge")
        payload = os.urandom(4_500_000)
        huge_id = stubs.produce("huge", [payload]).ids[0]
        wide = grpc.insecure_channel(srv.address, options=[("grpc.max_receive_message_length", 16 << 20)])
        try:
            request = storage_pb2.ListItemsRequest(queue_name="huge", page_size=10)
            stored = list(storage_pb2_grpc.StorageServiceStub(wide).ListItems(request, timeout=10).items)
        finally:
            wide.close()
        assert [(i.id, i.payload) for i in stored] == [(huge_id, payload)]
    finally:
        stubs.channel.close()
        srv.stop()
    on_disk = sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(data_dir) for f in files
    )
    assert on_disk > sum(len(p) for _, p in sent) > 5_000_000

    # Reopening with the same small setting must not truncate or refuse the data.
    srv = ThreadServer(data_dir, map_size=1 << 20)
    stubs = connect(srv.address)
    try:
        assert [(i.id, i.payload) for i in list_all(stubs, "big")[0]] == sent
        stubs.produce("big", [os.urandom(100_000)])
        assert stubs.stats("big").partitions[0].total == len(sent) + 1
    finally:
        stubs.channel.close()
        srv.stop()


def test_a_second_server_on_the_same_data_dir_refuses_to_start(data_dir: str) -> None:
    first = ThreadServer(data_dir)
    try:
        with pytest.raises(OSError, match="another Querator server is using this data directory"):
            ThreadServer(data_dir)
    finally:
        first.stop()
    ThreadServer(data_dir).stop()  # free again once the first one stopped
