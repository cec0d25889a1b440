"""UpdateQueue of a replicated queue while its shard record changes under it (real
etcd and node processes). UpdateQueue changing ``min_in_sync`` or ``replicas`` rewrites
the record in the same transaction, compared with the revision it read; the record
also changes without any admin (the primary's in-sync set, a copy restored by the
primary, a copy claiming its entry). Here a thread rewrites the record in etcd, as
those compare-and-swaps of other nodes do, while UpdateQueue calls toggle the queue's
``min_in_sync``: every call must succeed (the node makes it again on the record as it
is now), and the record must end with what the last call asked."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
from cluster_helpers import Cluster
from google.protobuf import field_mask_pb2
from test_cluster_replicas_retire import _uid

from querator.v1 import queues_pb2

from conftest import wait_until

QUEUE = "raced"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("update-race")), size=2) as c:
        yield c


def _record_key(cluster: Cluster) -> bytes:
    return f"/{cluster.prefix}/shards/{_uid(cluster, QUEUE)}".encode()


def _read(cluster: Cluster, key: bytes) -> dict:
    from aetcd import rpc  # type: ignore[import-untyped]

    with cluster.etcd.channel() as channel:
        return json.loads(rpc.KVStub(channel).Range(rpc.RangeRequest(key=key), timeout=5).kvs[0].value)


@pytest.mark.timeout(120)
def test_update_queue_goes_through_while_the_shard_record_changes_under_it(cluster: Cluster) -> None:
    from aetcd import rpc

    n1 = cluster.nodes[0]
    n1.stubs.create(QUEUE, replicas=2)
    key = _record_key(cluster)
    wait_until(lambda: all(i for _, i in _read(cluster, key)["isr"]), 15)
    stop = threading.Event()
    rewrites = 0

    def rewrite() -> None:
        # The record as it is, written again: a new revision, the same contents (what a
        # node's compare-and-swap of it looks like to a transaction that read it before).
        nonlocal rewrites
        with cluster.etcd.channel() as channel:
            kv = rpc.KVStub(channel)
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline:
                value = kv.Range(rpc.RangeRequest(key=key), timeout=5).kvs[0].value
                kv.Put(rpc.PutRequest(key=key, value=value), timeout=5)
                rewrites += 1
                time.sleep(0.002)

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    failures: list[str] = []
    try:
        for i in range(30):
            wanted = 1 + i % 2
            request = queues_pb2.UpdateQueueRequest(
                queue=queues_pb2.QueueInfo(queue_name=QUEUE, min_in_sync=wanted),
                update_mask=field_mask_pb2.FieldMask(paths=["min_in_sync"]),
            )
            try:
                assert n1.stubs.queues.UpdateQueue(request, timeout=20).queue.min_in_sync == wanted
            except Exception as exc:  # noqa: BLE001 - each failure is reported below
                failures.append(str(exc)[:300])
    finally:
        stop.set()
        writer.join(10)
    assert failures == [], failures
    assert rewrites > 10, rewrites  # the record did change under the calls
    assert _read(cluster, key)["min_isr"] == 2  # the last call's (i = 29)
