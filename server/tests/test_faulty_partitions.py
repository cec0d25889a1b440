"""A partition whose storage fails fails alone: it is marked faulty, left out of produce
and lease, reported, probed, and back in distribution with its items once it works.

The fault is injected with ``partition-error <storage> <database>`` in the fault file
(faults.py): every step that works on that one partition's database fails as on a
damaged database, while the rest of the environment (the queue's other partitions, the
other queues of its commit group) works.
"""

from __future__ import annotations

import os
import struct
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from querator.v1 import queue_pb2, queues_pb2, storage_pb2
from querator_server.faults import FAULT_FILE_ENV
from querator_server.server import PARTITIONS_HEALTH

from conftest import ProcessServer, Stubs, ThreadServer, dur, wait_until

PARTITIONS = 3
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _partition_of(item_id: str) -> int:
    return int(item_id.split(".")[1], 16)


def _uid_of(item_id: str) -> int:
    return int(item_id.split(".")[0], 16)


def _fault_line(data_dir: str, uid: int, partition: int) -> str:
    """The fault file line that damages one partition of queue ``uid``."""
    groups = sorted(Path(data_dir, "groups").glob("*")) if Path(data_dir, "groups").is_dir() else []
    if groups:
        return f"partition-error groups/{groups[0].name} q{uid}.p{partition}\n"
    return f"partition-error queues/{uid} p{partition}\n"


def _faulty(stubs: Stubs, name: str = "q") -> dict[int, queues_pb2.PartitionStats]:
    return {s.partition: s for s in stubs.stats(name).partitions if s.faulty}


def _health(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status  # type: ignore[no-any-return]


def _faulty_gauge(port: int, queue: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "querator_queue_partitions_faulty" and sample.labels.get("queue") == queue:
                return float(sample.value)
    raise AssertionError("no querator_queue_partitions_faulty sample for the queue")


# LMDB's page header: pgno (8), pad (2), flags (2), lower (2), upper (2); then the node
# offsets. A branch node starts with its child's page number in three u16s.
_PAGE_HEADER = 16
_P_BRANCH, _P_LEAF = 0x01, 0x02


def _branch_pages_over(data: bytes, page_size: int, marker: bytes, other: bytes) -> list[int]:
    """The B-tree branch pages of ``data`` (an LMDB file) whose children are mostly leaf
    pages holding ``marker`` rather than ``other``: the inner pages of the database whose
    items carry ``marker`` (stale copies of them too, which are free pages)."""
    pages = len(data) // page_size
    found: list[int] = []
    for n in range(2, pages):  # pages 0 and 1 are the meta pages
        page = data[n * page_size : (n + 1) * page_size]
        flags, lower = struct.unpack_from("<HH", page, 10)
        if not flags & _P_BRANCH:
            continue
        children = []
        for i in range((lower - _PAGE_HEADER) // 2):
            (offset,) = struct.unpack_from("<H", page, _PAGE_HEADER + 2 * i)
            lo, hi, top = struct.unpack_from("<HHH", page, offset)
            child = lo | hi << 16 | top << 32
            children.append(data[child * page_size : (child + 1) * page_size] if child < pages else b"")
        # A reused page keeps stale bytes between its entries: count, don't exclude.
        if sum(marker in c for c in children) > sum(other in c for c in children):
            found.append(n)
    return found


@dataclass
class Env:
    server: ThreadServer
    stubs: Stubs
    fault: Path


@pytest.fixture(params=[True, False], ids=["commit-group", "own-environment"])
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Env]:
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    server = ThreadServer(str(tmp_path / "data"), commit_groups=request.param, metrics_address="127.0.0.1:0")
    stubs = Stubs(grpc.insecure_channel(server.address))
    try:
        yield Env(server, stubs, fault)
    finally:
        fault.unlink(missing_ok=True)
        stubs.channel.close()
        server.stop()


def _fill(stubs: Stubs, name: str, calls: int) -> None:
    """Produce ``calls`` batches of 5; each goes to the partition with the fewest ready."""
    for i in range(calls):
        stubs.produce(name, [b"%s-%d-%d" % (name.encode(), i, k) for k in range(5)])


def test_a_faulty_partition_fails_alone_and_comes_back_with_its_items(env: Env) -> None:
    stubs = env.stubs
    stubs.create("q", requested_partitions=PARTITIONS, lease_timeout=dur(120))
    stubs.create("neighbour")  # shares the commit group, if there is one
    _fill(stubs, "q", 6)
    held = stubs.lease("q", batch_size=2)
    bad = held.partition
    uid = _uid_of(held.items[0].id)
    before = {i.id: (i.payload, i.is_leased) for i in stubs.list_items("q", bad)}
    assert len(before) == 10

    env.fault.write_text(_fault_line(env.server.data_dir, uid, bad))
    # The first step that works on the partition finds it damaged: the partition is
    # marked faulty and the call answers UNAVAILABLE with why.
    with pytest.raises(grpc.RpcError) as failed:
        stubs.complete("q", bad, [held.items[0].id])
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"partition {bad} of queue 'q' is faulty" in (failed.value.details() or "")
    assert "injected fault" in (failed.value.details() or "")

    faulty = _faulty(stubs)
    assert list(faulty) == [bad]
    assert "InjectedPartitionFault" in faulty[bad].failure and faulty[bad].HasField("faulty_since")
    healthy = [s for s in stubs.stats("q").partitions if s.partition != bad]
    assert all(not s.faulty and not s.failure and not s.HasField("faulty_since") for s in healthy)
    assert _faulty_gauge(env.server.server.metrics.port, "q") == 1
    assert _faulty_gauge(env.server.server.metrics.port, "neighbour") == 0
    assert _health(stubs.channel, PARTITIONS_HEALTH) == NOT_SERVING
    assert _health(stubs.channel, "") == SERVING

    # Produce keeps succeeding, never on the faulty partition; the neighbour is untouched.
    produced = [stubs.produce("q", [b"new-%d" % i]) for i in range(12)]
    assert all(r.partition != bad for r in produced)
    assert stubs.produce("neighbour", [b"n"]).ids
    # Leases drain the healthy partitions and never hand out an item of the faulty one.
    leased: list[queue_pb2.LeaseResponse] = []
    while True:
        reply = stubs.lease("q", batch_size=7, timeout=5, request_timeout=dur(0, 200_000_000))
        if not reply.items:
            break
        leased.append(reply)
    assert leased and all(r.partition != bad for r in leased)
    assert sum(len(r.items) for r in leased) == 6 * 5 - 10 + 12
    # Everything naming the faulty partition answers UNAVAILABLE with the reason.
    item = held.items[1].id
    calls = {
        "Retry": lambda: stubs.queue.Retry(
            queue_pb2.RetryRequest(queue_name="q", partition=bad, items=[queue_pb2.RetryItem(id=item)]), timeout=10
        ),
        "Extend": lambda: stubs.queue.Extend(
            queue_pb2.ExtendRequest(queue_name="q", partition=bad, ids=[item]), timeout=10
        ),
        "ListItems": lambda: stubs.list_items("q", bad),
        "Lease with complete_ids": lambda: stubs.lease("q", complete_ids=[item], complete_partition=bad),
    }
    for call, send in calls.items():
        with pytest.raises(grpc.RpcError) as refused:
            send()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, call
        assert "is faulty" in (refused.value.details() or ""), call
    # Completing items of the healthy partitions still works.
    for reply in leased:
        stubs.complete("q", reply.partition, [i.id for i in reply.items])

    # Once its storage works again a probe puts it back, with its items as they were.
    env.fault.unlink()
    wait_until(lambda: not _faulty(stubs), timeout=30)
    assert _health(stubs.channel, PARTITIONS_HEALTH) == SERVING
    assert _faulty_gauge(env.server.server.metrics.port, "q") == 0
    after = {i.id: (i.payload, i.is_leased) for i in stubs.list_items("q", bad)}
    assert after == before
    stubs.complete("q", bad, [i.id for i in held.items])
    rest = stubs.lease("q", batch_size=100)
    assert rest.partition == bad and len(rest.items) == 8
    assert {i.id for i in rest.items} == {i for i, (_p, is_leased) in before.items() if not is_leased}
    # And it takes produce again.
    assert bad in {stubs.produce("q", [b"again-%d" % i]).partition for i in range(PARTITIONS * 2)}


def test_a_database_damaged_on_disk_is_faulty_until_its_pages_are_restored(env: Env) -> None:
    """No injected fault: one partition's B-tree pages are really damaged in the file
    (under the running server, which maps it), so LMDB reports MDB_CORRUPTED for that
    database alone; restoring the bytes is the repair."""
    stubs = env.stubs
    stubs.create("q", requested_partitions=2, lease_timeout=dur(120))
    markers = {}
    for tag in (b"AAAA", b"BBBB"):
        reply = stubs.produce("q", [tag * 60 + b"-%d" % i for i in range(100)])
        markers[reply.partition] = tag
    assert sorted(markers) == [0, 1]
    held = stubs.lease("q", batch_size=10)
    bad, uid = held.partition, _uid_of(held.items[0].id)
    groups = Path(env.server.data_dir, "groups")
    home = sorted(groups.iterdir())[0] if groups.is_dir() else Path(env.server.data_dir, "queues", str(uid))
    path = home / "data.mdb"
    data = path.read_bytes()
    page_size = os.sysconf("SC_PAGE_SIZE")
    damaged = _branch_pages_over(data, page_size, markers[bad] * 60, markers[1 - bad] * 60)
    assert damaged
    original = {n: data[n * page_size + 10 : n * page_size + 12] for n in damaged}
    fd = os.open(path, os.O_RDWR)
    try:
        for n in damaged:
            os.pwrite(fd, b"\x00\x00", n * page_size + 10)  # neither branch nor leaf

        with pytest.raises(grpc.RpcError) as failed:
            stubs.complete("q", bad, [i.id for i in held.items])
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "is faulty" in (failed.value.details() or "") and "MDB_CORRUPTED" in (failed.value.details() or "")
        assert list(_faulty(stubs)) == [bad]
        assert all(stubs.produce("q", [b"new-%d" % i]).partition != bad for i in range(5))
        other = stubs.lease("q", batch_size=200)
        assert other.partition != bad and len(other.items) == 105
        stubs.complete("q", other.partition, [i.id for i in other.items])
        time.sleep(1.0)  # probes meanwhile find it still damaged
        assert list(_faulty(stubs)) == [bad]

        for n, flags in original.items():
            os.pwrite(fd, flags, n * page_size + 10)
    finally:
        os.close(fd)
    wait_until(lambda: not _faulty(stubs), timeout=30)
    stored = stubs.list_items("q", bad)
    assert len(stored) == 100 and sum(i.is_leased for i in stored) == 10
    stubs.complete("q", bad, [i.id for i in held.items])
    assert len(stubs.lease("q", batch_size=200).items) == 90


def test_every_partition_faulty_refuses_produce_and_a_failed_commit_marks_all_while_it_lasts(env: Env) -> None:
    stubs = env.stubs
    stubs.create("q", requested_partitions=2)
    uid = _uid_of(stubs.produce("q", [b"a"]).ids[0])
    env.fault.write_text(_fault_line(env.server.data_dir, uid, 0) + _fault_line(env.server.data_dir, uid, 1))
    with pytest.raises(grpc.RpcError) as refused:
        stubs.produce("q", [b"b"])
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "every partition of queue 'q' is faulty" in (refused.value.details() or "")
    assert sorted(_faulty(stubs)) == [0, 1]
    # A Lease finds nothing to take and waits (answering empty), as on a full disk.
    assert not stubs.lease("q", batch_size=5, request_timeout=dur(0, 300_000_000)).items
    env.fault.unlink()
    wait_until(lambda: not _faulty(stubs), timeout=30)
    assert stubs.produce("q", [b"c"]).ids

    # A commit that fails is the whole environment's: every partition is reported
    # faulty while it lasts, and none is left out (each call tries the storage again).
    env.fault.write_text("io-error\n")
    with pytest.raises(grpc.RpcError) as failed:
        stubs.produce("q", [b"d"])
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "storage failed" in (failed.value.details() or "")
    faulty = _faulty(stubs)
    assert sorted(faulty) == [0, 1] and all("Input/output error" in p.failure for p in faulty.values()), faulty
    env.fault.unlink()
    assert stubs.produce("q", [b"e"]).ids
    assert not _faulty(stubs)
    assert [i.payload for p in range(2) for i in stubs.list_items("q", p)].count(b"d") == 0


def test_a_lease_that_ran_out_on_a_faulty_partition_is_handled_once_it_works(env: Env) -> None:
    stubs = env.stubs
    stubs.create("q", requested_partitions=2, lease_timeout=dur(1))
    _fill(stubs, "q", 2)
    held = stubs.lease("q", batch_size=5)
    bad, uid = held.partition, _uid_of(held.items[0].id)
    env.fault.write_text(_fault_line(env.server.data_dir, uid, bad))
    with pytest.raises(grpc.RpcError):
        stubs.complete("q", bad, [held.items[0].id])
    time.sleep(1.5)  # the lease runs out while the partition is faulty: nothing touches it
    assert _faulty(stubs)[bad].total_leased == 5
    env.fault.unlink()
    wait_until(lambda: not _faulty(stubs), timeout=30)
    # Read again from storage, the expired lease is found and its items are ready again.
    wait_until(lambda: stubs.stats("q").partitions[bad].total_leased == 0, timeout=10)
    again = stubs.lease("q", batch_size=5)
    assert again.partition == bad and {i.payload for i in again.items} == {i.payload for i in held.items}
    assert all(i.attempts == 2 for i in again.items)


def test_an_item_that_dies_on_a_faulty_partition_is_dead_lettered_once_it_works(env: Env) -> None:
    stubs = env.stubs
    stubs.create("dlq")
    stubs.create("q", requested_partitions=2, lease_timeout=dur(1), max_attempts=1, dead_queue="dlq")
    _fill(stubs, "q", 2)
    held = stubs.lease("q", batch_size=5)
    bad, uid = held.partition, _uid_of(held.items[0].id)
    env.fault.write_text(_fault_line(env.server.data_dir, uid, bad))
    with pytest.raises(grpc.RpcError):
        stubs.complete("q", bad, [held.items[0].id])
    time.sleep(1.5)  # the leases run out, out of attempts, while the partition is faulty
    assert sum(s.total for s in stubs.stats("dlq").partitions) == 0
    assert _faulty(stubs)[bad].total_leased == 5
    env.fault.unlink()
    wait_until(lambda: not _faulty(stubs), timeout=30)
    wait_until(lambda: sum(s.total for s in stubs.stats("dlq").partitions) == 5, timeout=10)
    dead = stubs.lease("dlq", batch_size=10)
    assert sorted(i.payload for i in dead.items) == sorted(i.payload for i in held.items)
    assert stubs.stats("q").partitions[bad].total == 0


def test_a_partition_damaged_at_start_is_faulty_and_the_rest_serves(tmp_path: Path) -> None:
    """A restart: the partition cannot be read at start, so the queue starts without it."""
    data_dir, fault = str(tmp_path / "data"), tmp_path / "fault"
    server = ProcessServer(data_dir, extra_args=["--no-commit-groups"], env={FAULT_FILE_ENV: str(fault)})
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            stubs.create("q", requested_partitions=2)
            ids = [i for k in range(4) for i in stubs.produce("q", [b"p-%d-%d" % (k, j) for j in range(3)]).ids]
        stored = {p: sorted(i for i in ids if _partition_of(i) == p) for p in range(2)}
        assert len(stored[0]) == len(stored[1]) == 6
        server.kill9()
        fault.write_text(f"partition-error queues/{_uid_of(ids[0])} p1\n")
        server.start()
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            faulty = _faulty(stubs)
            assert list(faulty) == [1] and "InjectedPartitionFault" in faulty[1].failure
            assert _health(channel, PARTITIONS_HEALTH) == NOT_SERVING
            assert all(stubs.produce("q", [b"x-%d" % k]).partition == 0 for k in range(5))
            drained = stubs.lease("q", batch_size=100)
            assert drained.partition == 0 and len(drained.items) == 11
            with pytest.raises(grpc.RpcError) as refused:
                stubs.storage.ListItems(storage_pb2.ListItemsRequest(queue_name="q", partition=1), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # What the faulty partition holds is unknown to the server (it shows none): the
            # queue looks empty once partition 0 is done with, yet is not deleted without force.
            stubs.complete("q", 0, [i.id for i in drained.items])
            assert sum(p.total + p.scheduled for p in stubs.stats("q").partitions) == 0
            with pytest.raises(grpc.RpcError) as kept:
                stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="q"), timeout=10)
            assert kept.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            fault.unlink()
            wait_until(lambda: not _faulty(stubs), timeout=30)
            assert _health(channel, PARTITIONS_HEALTH) == SERVING
            assert sorted(i.id for i in stubs.list_items("q", 1)) == stored[1]
            back = stubs.lease("q", batch_size=100)
            assert back.partition == 1 and sorted(i.id for i in back.items) == stored[1]
    finally:
        server.stop()
