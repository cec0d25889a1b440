"""Ordered groups in a cluster: a group lives at its key's home (as an idempotency key
does), calls through a node that homes nothing of it are forwarded, and a replicated
queue keeps each group's order across a failover.

A real etcd and real node processes (cluster_helpers.py); deliveries are told apart by
payload.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cluster_helpers import Cluster, Node
from failover_helpers import QUEUE, digests, in_sync, stop_quietly, wait_in_sync, wait_primary

from querator.v1 import queue_pb2, queues_pb2

from conftest import bad_request_fields, dur, wait_until


def _produce(node: Node, name: str, items: list[tuple[str, bytes]]) -> queue_pb2.ProduceResponse:
    request = queue_pb2.ProduceRequest(queue_name=name, items=[queue_pb2.ProduceItem(group_key=g, payload=p) for g, p in items])
    return node.stubs.queue.Produce(request, timeout=15)


def _lease(node: Node, name: str, wait: float = 0.3) -> queue_pb2.LeaseResponse:
    return node.stubs.lease(name, 10, timeout=wait + 10, request_timeout=dur(wait))


def _homes(node: Node, name: str) -> list[str]:
    return list(next(q for q in node.info().queues if q.queue_name == name).homes)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("groups"))) as c:
        yield c


def test_a_group_lives_at_its_keys_home_and_goes_one_at_a_time_through_any_node(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("grouped", requested_partitions=3, lease_timeout=dur(60), replicas=1)
    homes = _homes(n1, "grouped")
    home_a = homes[zlib.crc32(b"A") % 3]
    elsewhere = next(n for n in cluster.nodes if n.node_id != home_a)
    # Produced through a node that is not the group's home: forwarded there.
    for payload in (b"A1", b"A2", b"A3"):
        placed = _produce(elsewhere, "grouped", [("A", payload)])
        assert homes[placed.partition] == home_a
    _produce(elsewhere, "grouped", [("B", b"B1")])
    # Each node's Lease: A1 goes out once, A2 to nobody while A1 is leased.
    got: dict[bytes, tuple[int, str]] = {}
    for _ in range(3):
        for node in cluster.nodes:
            for item in (r := _lease(node, "grouped", 0.1)).items:
                assert item.payload not in got
                got[item.payload] = (r.partition, item.id)
    assert set(got) == {b"A1", b"B1"}
    # Completed through a node that homes nothing of A's: A2 goes next, then A3.
    p, item_id = got[b"A1"]
    elsewhere.stubs.complete("grouped", p, [item_id])
    for expected in (b"A2", b"A3"):
        found = [i for node in cluster.nodes for i in _lease(node, "grouped", 0.1).items]
        assert [i.payload for i in found] == [expected]
        assert found[0].group_key == "A"
        n3.stubs.complete("grouped", p, [found[0].id])
    stats = n2.stubs.stats("grouped")
    assert sum(s.total for s in stats.partitions) == 1 and sum(s.groups_in_flight for s in stats.partitions) == 1


def test_a_request_whose_groups_live_on_two_nodes_is_refused_naming_the_item(cluster: Cluster) -> None:
    n1 = cluster.nodes[0]
    n1.stubs.create("split", requested_partitions=3, replicas=1)
    homes = _homes(n1, "split")
    keys = [f"k{i}" for i in range(40)]
    first = keys[0]
    other = next(k for k in keys if homes[zlib.crc32(k.encode()) % 3] != homes[zlib.crc32(first.encode()) % 3])
    with pytest.raises(grpc.RpcError) as err:
        _produce(n1, "split", [(first, b"1"), ("", b"plain"), (other, b"2")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["items[2].group_key"]
    assert sum(s.total for s in n1.stubs.stats("split").partitions) == 0


def _etcd(cluster: Cluster, key: str) -> dict[str, Any] | None:
    from aetcd import rpc  # type: ignore[import-untyped]

    with cluster.etcd.channel() as channel:
        reply = rpc.KVStub(channel).Range(rpc.RangeRequest(key=f"/{cluster.prefix}/{key}".encode()), timeout=5)
    return json.loads(reply.kvs[0].value) if reply.kvs else None


def _claimed(cluster: Cluster) -> bool:
    entry = _etcd(cluster, f"queues/{QUEUE}")
    record = _etcd(cluster, f"shards/{entry['shard']}") if entry else None
    return record is not None and all(incarnation for _, incarnation in record["isr"])


@pytest.mark.timeout(180)
def test_a_groups_order_and_its_item_in_flight_hold_across_a_failover(tmp_path: Path) -> None:
    with Cluster(str(tmp_path), size=3, ttl=2) as cluster:
        n1 = cluster.nodes[0]
        n1.stubs.queues.CreateQueue(
            queues_pb2.CreateQueueRequest(
                queue=queues_pb2.QueueInfo(queue_name=QUEUE, requested_partitions=2, replicas=2, lease_timeout=dur(60))
            ),
            timeout=20,
        )
        primary, epoch = wait_primary(cluster, n1)
        wait_in_sync(cluster, n1, 2)
        # Until each copy has claimed its in-sync entry with its incarnation, none can
        # stand for election: a kill before that leaves the queue waiting.
        wait_until(lambda: _claimed(cluster), timeout=20, interval=0.2)
        via = next(n for n in cluster.nodes if n.node_id != primary)
        _produce(via, QUEUE, [("A", f"A{i}".encode()) for i in range(1, 6)])
        _produce(via, QUEUE, [("B", f"B{i}".encode()) for i in range(1, 4)])
        first = _lease(via, QUEUE)
        assert sorted(i.payload for i in first.items) == [b"A1", b"B1"]
        a1 = next(i for i in first.items if i.payload == b"A1")
        b1 = next(i for i in first.items if i.payload == b"B1")
        via.stubs.complete(QUEUE, first.partition, [b1.id])  # B moves on: B2 is B's head now
        victim = next(n for n in cluster.nodes if n.node_id == primary)
        victim.kill9()
        observer = next(n for n in cluster.nodes if n.node_id != primary)
        new_primary, new_epoch = wait_primary(cluster, observer, not_on=primary, timeout=30)
        assert new_epoch > epoch
        # A1 is still leased on the new primary: A waits; B2 goes.
        deadline = time.monotonic() + 20
        while True:
            try:
                got = _lease(observer, QUEUE)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert [i.payload for i in got.items] == [b"B2"]
        stats = observer.stubs.stats(QUEUE)
        assert sum(s.groups_in_flight for s in stats.partitions) == 2
        # The lease taken before the failover completes on the new primary, and A goes on in order.
        observer.stubs.complete(QUEUE, first.partition, [a1.id])
        observer.stubs.complete(QUEUE, got.partition, [got.items[0].id])
        seen: list[bytes] = []
        while len(seen) < 5:
            batch = _lease(observer, QUEUE, 1)
            assert batch.items, seen
            seen += [i.payload for i in batch.items]
            observer.stubs.complete(QUEUE, batch.partition, [i.id for i in batch.items])
        assert [s for s in seen if s.startswith(b"A")] == [b"A2", b"A3", b"A4", b"A5"]
        assert [s for s in seen if s.startswith(b"B")] == [b"B3"]
        victim.start()  # back as a copy, caught up by the new primary
        wait_in_sync(cluster, observer, 2)
        time.sleep(1)
        members = in_sync(cluster, observer)
        stop_quietly(cluster.nodes)
        found = {n: digests(next(x for x in cluster.nodes if x.node_id == n)) for n in members}
        assert len({str(d["digest"]) for d in found.values()}) == 1, found
        assert new_primary in members
