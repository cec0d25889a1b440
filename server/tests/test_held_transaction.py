"""The held write transaction: begun and committed on a queue's storage lane, filled elsewhere.

A cycle fills the held transaction on the event loop while only the lane thread ever
begins or ends it (LMDB ties its writer lock to that thread). These tests drive the
store the same way, with a real single-thread executor as the lane.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import lmdb
import pytest

from querator.v1 import queues_pb2
from querator_server.storage import MapFull, QueueStore, StorageError

from conftest import Stubs, ThreadServer


@pytest.fixture
def lane() -> Iterator[ThreadPoolExecutor]:
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=True)


def _on(lane: ThreadPoolExecutor, fn: object) -> object:
    return lane.submit(fn).result(10)  # type: ignore[arg-type]


def _put(key: bytes, value: bytes, store: QueueStore) -> object:
    return lambda txn: txn.put(key, value, db=store.db(0))


def _get(store: QueueStore, key: bytes) -> bytes | None:
    return store.read(lambda txn: txn.get(key, db=store.db(0)))


def test_filled_on_one_thread_committed_on_the_lane_and_the_next_one_is_held(tmp_path: Path, lane: ThreadPoolExecutor) -> None:
    store = QueueStore(str(tmp_path / "q"), 1, sync=False)
    try:
        _on(lane, store.hold)
        assert store.held
        assert threading.current_thread() is threading.main_thread()
        store.run_held(_put(b"k1", b"v1", store))  # type: ignore[arg-type]
        assert _get(store, b"k1") is None  # not committed yet
        _on(lane, store.commit_held)
        assert _get(store, b"k1") == b"v1"
        assert store.held  # the lane began the next one right after the commit
        store.run_held(_put(b"k2", b"v2", store))  # type: ignore[arg-type]
        _on(lane, store.abort_held)
        assert not store.held
        assert _get(store, b"k2") is None
    finally:
        _on(lane, store.close)
    reopened = QueueStore(str(tmp_path / "q"), 1, sync=False)
    try:
        assert _get(reopened, b"k1") == b"v1"
        assert _get(reopened, b"k2") is None
    finally:
        reopened.close()


def test_a_full_map_asks_to_grow_and_the_cycle_runs_again(tmp_path: Path, lane: ThreadPoolExecutor) -> None:
    store = QueueStore(str(tmp_path / "q"), 1, map_size=1 << 20, sync=False)
    payloads = [os.urandom(100_000) for _ in range(30)]  # 3 MB into a 1 MiB map

    def fill(txn: lmdb.Transaction) -> int:
        for i, p in enumerate(payloads):
            txn.put(i.to_bytes(4, "big"), p, db=store.db(0))
        return len(payloads)

    try:
        grown = 0
        for _ in range(12):
            _on(lane, store.hold)
            try:
                assert store.run_held(fill) == len(payloads)
                _on(lane, store.commit_held)
                break
            except MapFull:
                _on(lane, store.grow)
                assert not store.held
                grown += 1
        assert grown >= 2
        assert all(_get(store, i.to_bytes(4, "big")) == p for i, p in enumerate(payloads))
    finally:
        _on(lane, store.close)


def test_a_plain_write_on_the_lane_gives_up_the_held_transaction_instead_of_deadlocking(
    tmp_path: Path, lane: ThreadPoolExecutor
) -> None:
    store = QueueStore(str(tmp_path / "q"), 1, sync=False)
    try:
        _on(lane, store.hold)
        store.run_held(_put(b"dropped", b"x", store))  # type: ignore[arg-type]
        _on(lane, lambda: store.ensure_partitions(3))  # opens databases in its own transaction
        assert not store.held
        assert store.partitions == 3
        assert _get(store, b"dropped") is None
        with pytest.raises(StorageError, match="no write transaction is held"):
            store.run_held(_put(b"k", b"v", store))  # type: ignore[arg-type]
    finally:
        _on(lane, store.close)


def test_more_queues_than_storage_lanes_work_side_by_side_and_survive_delete_and_restart(data_dir: str) -> None:
    names = [f"q{i}" for i in range(12)]  # the server has 8 lanes: some queues share one
    srv = ThreadServer(data_dir)
    stubs = Stubs(grpc.insecure_channel(srv.address))
    try:
        for name in names:
            stubs.create(name)
        errors: list[Exception] = []

        def work(name: str) -> None:
            try:
                for round_ in range(5):
                    stubs.produce(name, [f"{name}-{round_}-{i}".encode() for i in range(20)])
                    lease = stubs.lease(name, 10, client_id=f"{name}-c")
                    stubs.complete(name, lease.partition, [item.id for item in lease.items])
            except Exception as exc:  # reported below, in the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        for name in names:
            assert stubs.stats(name).partitions[0].total == 5 * 10
        for name in names[:3]:
            stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name=name, force=True), timeout=10)
            stubs.create(name)
            stubs.produce(name, [b"again"])
    finally:
        stubs.channel.close()
        srv.stop()

    srv = ThreadServer(data_dir)
    stubs = Stubs(grpc.insecure_channel(srv.address))
    try:
        totals = {name: stubs.stats(name).partitions[0].total for name in names}
        assert totals == {name: (1 if name in names[:3] else 50) for name in names}
    finally:
        stubs.channel.close()
        srv.stop()


def test_queues_spread_over_the_lanes_and_a_deleted_queue_frees_its_lane(data_dir: str) -> None:
    srv = ThreadServer(data_dir)
    stubs = Stubs(grpc.insecure_channel(srv.address))
    try:
        manager = srv.server.manager
        lanes = len(manager._lanes)
        for i in range(2 * lanes):
            stubs.create(f"s{i}")
        users = [list(manager._lane_of.values()).count(lane) for lane in range(lanes)]
        assert users == [2] * lanes
        stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="s3", force=True), timeout=10)
        freed = [lane for lane in range(lanes) if list(manager._lane_of.values()).count(lane) == 1]
        assert len(freed) == 1
        stubs.create("after")
        assert [list(manager._lane_of.values()).count(lane) for lane in range(lanes)] == [2] * lanes
    finally:
        stubs.channel.close()
        srv.stop()
