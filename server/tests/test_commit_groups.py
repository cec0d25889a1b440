"""Where queues keep their storage: commit groups, directories of their own, and moves."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import grpc
import lmdb
import pytest
from grpc import StatusCode as Code

from querator.v1 import queue_pb2, queues_pb2
from querator_server.actor import LogicalQueue
from querator_server.storage import StorageError
from querator_server.storage.group_layout import GROUP_MAX_PARTITIONS, GROUP_QUEUES

from conftest import ProcessServer, Stubs, ThreadServer


def _databases(path: str) -> set[bytes]:
    """The named databases of an environment (read with no server on it: LMDB must not
    open an environment twice in one process)."""
    env = lmdb.open(path, max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return {bytes(key) for key, _ in txn.cursor()}
    finally:
        env.close()


def _listing(data_dir: str, folder: str) -> list[str]:
    path = os.path.join(data_dir, folder)
    return sorted(os.listdir(path), key=int) if os.path.isdir(path) else []


def _update_partitions(stubs: Stubs, name: str, partitions: int) -> queues_pb2.QueueInfo:
    request = queues_pb2.UpdateQueueRequest(
        queue=queues_pb2.QueueInfo(queue_name=name, requested_partitions=partitions),
        update_mask={"paths": ["requested_partitions"]},
    )
    return stubs.queues.UpdateQueue(request, timeout=30).queue


def _produce_keyed(stubs: Stubs, name: str, key: str) -> queue_pb2.ProduceResponse:
    item = queue_pb2.ProduceItem(payload=b"keyed", idempotency_key=key)
    return stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, items=[item]), timeout=10)


@contextlib.contextmanager
def _serving(data_dir: str, **settings: object) -> Iterator[Stubs]:
    """A server on ``data_dir`` and stubs on a channel to it, both closed at the end."""
    server = ThreadServer(data_dir, **settings)
    try:
        with grpc.insecure_channel(server.address) as channel:
            yield Stubs(channel)
    finally:
        server.stop()


def _total(stubs: Stubs, name: str) -> tuple[int, int]:
    stats = stubs.stats(name)
    return sum(p.total for p in stats.partitions), sum(p.total_leased for p in stats.partitions)


def test_small_queues_share_a_group_and_keep_their_items_across_a_restart(data_dir: str) -> None:
    names = [f"q{i}" for i in range(6)]
    with _serving(data_dir) as stubs:
        for name in names:
            stubs.create(name, requested_partitions=2)

        def produce(name: str) -> None:
            for batch in range(20):
                stubs.produce(name, [f"{name}-{batch}-{i}".encode() for i in range(10)])

        threads = [threading.Thread(target=produce, args=(name,)) for name in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        leased = stubs.lease("q0", batch_size=5)
        assert len(stubs.lease("q1", batch_size=7).items) == 7
    assert _listing(data_dir, "groups") == ["0"] and _listing(data_dir, "queues") == []
    uids = {name.split(b".")[0] for name in _databases(os.path.join(data_dir, "groups", "0"))}
    assert uids == {f"q{uid}".encode() for uid in range(1, 7)}

    with _serving(data_dir) as stubs:
        assert _total(stubs, "q0") == (200, 5)
        assert _total(stubs, "q1") == (200, 7)
        for name in names[2:]:
            assert _total(stubs, name) == (200, 0)
        stubs.complete("q0", leased.partition, [item.id for item in leased.items])
        assert _total(stubs, "q0") == (195, 0)


def test_a_full_group_sends_new_queues_to_the_next_and_wide_queues_get_a_directory(data_dir: str) -> None:
    with _serving(data_dir) as stubs:
        for i in range(GROUP_QUEUES + 1):
            stubs.create(f"q{i:02d}")
        stubs.create("wide", requested_partitions=GROUP_MAX_PARTITIONS + 1)
        stubs.create("edge", requested_partitions=GROUP_MAX_PARTITIONS)
        for name in ("q00", f"q{GROUP_QUEUES:02d}", "wide", "edge"):
            stubs.produce(name, [name.encode()])
            assert [item.payload for item in stubs.lease(name).items] == [name.encode()]
    assert _listing(data_dir, "groups") == ["0", "1"]
    wide_uid = GROUP_QUEUES + 2
    assert _listing(data_dir, "queues") == [str(wide_uid)]
    second = {name.split(b".")[0] for name in _databases(os.path.join(data_dir, "groups", "1"))}
    assert second == {f"q{GROUP_QUEUES + 1}".encode(), f"q{GROUP_QUEUES + 3}".encode()}


def test_without_commit_groups_every_new_queue_has_a_directory_and_old_ones_stay(data_dir: str) -> None:
    with _serving(data_dir) as stubs:
        stubs.create("grouped")
        stubs.produce("grouped", [b"g"])
    with _serving(data_dir, commit_groups=False) as stubs:
        stubs.create("alone")
        stubs.produce("alone", [b"a"])
        assert _total(stubs, "grouped") == (1, 0)
        assert [item.payload for item in stubs.lease("alone").items] == [b"a"]
    assert _listing(data_dir, "groups") == ["0"] and _listing(data_dir, "queues") == ["2"]


def test_a_deleted_queue_leaves_nothing_in_its_group_and_its_name_starts_empty(data_dir: str) -> None:
    with _serving(data_dir) as stubs:
        stubs.create("keep")
        stubs.create("doomed", requested_partitions=3)
        stubs.produce("keep", [b"k"])
        stubs.produce("doomed", [b"d"] * 10)
        stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="doomed", force=True), timeout=10)
        stubs.create("doomed")
        assert _total(stubs, "doomed") == (0, 0)
        assert _total(stubs, "keep") == (1, 0)
    uids = {name.split(b".")[0] for name in _databases(os.path.join(data_dir, "groups", "0"))}
    assert uids == {b"q1", b"q3"}


def test_a_grouped_queue_given_more_partitions_than_a_group_allows_moves_to_a_directory(data_dir: str) -> None:
    with _serving(data_dir) as stubs:
        stubs.create("other")
        stubs.create("growing", requested_partitions=2, lease_timeout={"seconds": 600})
        stubs.produce("growing", [f"item {i}".encode() for i in range(49)])
        first = _produce_keyed(stubs, "growing", "key-1")
        stubs.produce("other", [b"o"])
        leased = stubs.lease("growing", batch_size=5)
        assert _update_partitions(stubs, "growing", GROUP_MAX_PARTITIONS + 8).requested_partitions == 40
        # Everything came along: items, the lease, the idempotency key, and the
        # new partitions work.
        assert _total(stubs, "growing") == (50, 5)
        again = _produce_keyed(stubs, "growing", "key-1")
        assert (again.duplicates, list(again.ids)) == (1, list(first.ids))
        stubs.complete("growing", leased.partition, [item.id for item in leased.items])
        stubs.produce("growing", [b"new"] * 100)
        assert _total(stubs, "growing") == (145, 0)
        assert _total(stubs, "other") == (1, 0)
    assert _listing(data_dir, "queues") == ["2"]
    uids = {name.split(b".")[0] for name in _databases(os.path.join(data_dir, "groups", "0"))}
    assert uids == {b"q1"}
    assert b"p39" in _databases(os.path.join(data_dir, "queues", "2"))

    with _serving(data_dir) as stubs:
        assert _total(stubs, "growing") == (145, 0)
        info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="growing"), timeout=10).queue
        assert info.requested_partitions == 40


def test_a_move_that_cannot_write_changes_nothing_and_can_be_retried(data_dir: str) -> None:
    with _serving(data_dir) as stubs:
        stubs.create("growing")
        stubs.produce("growing", [b"x"] * 3)
        blocker = os.path.join(data_dir, "queues", "1")
        os.makedirs(os.path.dirname(blocker), exist_ok=True)
        with open(blocker, "w") as f:
            f.write("in the way")
        with pytest.raises(grpc.RpcError) as failed:
            _update_partitions(stubs, "growing", 64)
        assert failed.value.code() == Code.UNAVAILABLE
        info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="growing"), timeout=10).queue
        assert info.requested_partitions == 1
        stubs.produce("growing", [b"y"])
        assert _total(stubs, "growing") == (4, 0)
        os.remove(blocker)
        assert _update_partitions(stubs, "growing", 64).requested_partitions == 64
        assert _total(stubs, "growing") == (4, 0)
    assert _listing(data_dir, "queues") == ["1"]
    assert not any(name.startswith(b"q1.") for name in _databases(os.path.join(data_dir, "groups", "0")))


@pytest.mark.parametrize("crash_at", ["move-copied", "move-recorded"])
def test_kill9_in_the_middle_of_a_move_leaves_the_queue_whole_in_one_place(
    data_dir: str, monkeypatch: pytest.MonkeyPatch, crash_at: str
) -> None:
    monkeypatch.setenv("QUERATOR_CRASH_AT", crash_at)
    proc = ProcessServer(data_dir)
    proc.start()
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        stubs.create("neighbour")
        stubs.create("growing", requested_partitions=2, lease_timeout={"seconds": 600})
        stubs.produce("neighbour", [b"n"])
        stubs.produce("growing", [f"item {i}".encode() for i in range(30)])
        leased = stubs.lease("growing", batch_size=4)
        with pytest.raises(grpc.RpcError):
            _update_partitions(stubs, "growing", 48)
        assert proc.proc is not None and proc.proc.wait(20) == -9, "the crash point did not fire"
    finally:
        stubs.channel.close()
        proc.stop()
    monkeypatch.delenv("QUERATOR_CRASH_AT")
    proc.start()
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        moved = crash_at == "move-recorded"
        info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="growing"), timeout=10).queue
        assert info.requested_partitions == (48 if moved else 2)
        assert _total(stubs, "growing") == (30, 4)
        assert _total(stubs, "neighbour") == (1, 0)
        stubs.complete("growing", leased.partition, [item.id for item in leased.items])
        assert _total(stubs, "growing") == (26, 0)
        if not moved:  # the move can be asked again and now completes
            assert _update_partitions(stubs, "growing", 48).requested_partitions == 48
            assert _total(stubs, "growing") == (26, 0)
    finally:
        stubs.channel.close()
        proc.terminate()
        proc.stop()
    # One copy of the queue, where the catalog says, and none left in the group.
    assert _listing(data_dir, "queues") == ["2"]
    assert {name.split(b".")[0] for name in _databases(os.path.join(data_dir, "groups", "0"))} == {b"q1"}


@pytest.mark.parametrize("failing", ["catalog write", "actor start"])
def test_a_create_that_fails_leaves_nothing_in_the_group(
    data_dir: str, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    # The new queue's databases are made, then the create fails: they must not stay,
    # holding slots of the group's max_dbs until the next start.
    server = ThreadServer(data_dir)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            stubs.create("first")

            def disk_full(*_args: object) -> None:
                raise StorageError("storage write failed: No space left on device (as if)")

            async def unreadable(self: LogicalQueue, keyed: object = None) -> None:
                raise StorageError("storage read failed: Input/output error (as if)")

            if failing == "catalog write":
                monkeypatch.setattr(server.server.manager._catalog, "put", disk_full)
            else:
                monkeypatch.setattr(LogicalQueue, "start", unreadable)
            with pytest.raises(grpc.RpcError) as failed:
                stubs.create("second")
            assert failed.value.code() == Code.UNAVAILABLE
            monkeypatch.undo()
            stubs.create("third")
            stubs.produce("third", [b"t"])
            assert [i.payload for i in stubs.lease("third").items] == [b"t"]
            assert _total(stubs, "first") == (0, 0)
    finally:
        server.stop()
    # uid 2 was "second": none of its databases stayed behind in the group.
    assert {name.split(b".")[0] for name in _databases(os.path.join(data_dir, "groups", "0"))} == {b"q1", b"q3"}
