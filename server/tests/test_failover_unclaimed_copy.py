"""A replicated queue's primary killed (kill -9) right after the queue's creation and a
first acknowledged Produce, while the in-sync set may still hold the entries it was
created with (unclaimed, incarnation ""): the replica must take over within the TTL + 3 s
with every acknowledged item (the primary acknowledges nothing while an entry is
unclaimed, so an unclaimed copy holds every acknowledged change).
Real etcd and real node processes (cluster_helpers.py)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Cluster
from failover_helpers import QUEUE, create_queue, placement, wait_primary

from querator.v1 import queue_pb2, queue_pb2_grpc

TTL = 2
GAP_BOUND_S = TTL + 3


def _drain(stub: queue_pb2_grpc.QueueServiceStub, want: set[bytes], timeout: float) -> set[bytes]:
    got: set[bytes] = set()
    deadline = time.monotonic() + timeout
    while not want <= got and time.monotonic() < deadline:
        request = queue_pb2.LeaseRequest(queue_name=QUEUE, batch_size=10, request_timeout={"nanos": 300_000_000})
        try:
            reply = stub.Lease(request, timeout=5)
        except grpc.RpcError:
            time.sleep(0.1)
            continue
        got |= {item.payload for item in reply.items}
    return got


@pytest.mark.timeout(90)
@pytest.mark.parametrize("produced", [False, True], ids=["created", "produced"])
def test_the_primary_killed_before_its_replica_claimed_its_entry_fails_over_with_every_acknowledged_item(
    tmp_path: Path, produced: bool
) -> None:
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        create_queue(cluster.nodes[0], replicas=2, partitions=1)
        found = placement(cluster.nodes[0])
        assert found is not None
        primary, epoch = found.primary, found.epoch
        victim = next(n for n in cluster.nodes if n.node_id == primary)
        payloads = [f"early-{i}".encode() for i in range(5)]
        if produced:
            queue_pb2_grpc.QueueServiceStub(victim.channel).Produce(
                queue_pb2.ProduceRequest(queue_name=QUEUE, payloads=payloads), timeout=10
            )
        victim.kill9()
        observer = next(n for n in cluster.nodes if n.node_id != primary)
        new_primary, new_epoch = wait_primary(cluster, observer, not_on=primary, timeout=GAP_BOUND_S)
        assert new_epoch == epoch + 1
        stub = queue_pb2_grpc.QueueServiceStub(observer.channel)
        if not produced:
            stub.Produce(queue_pb2.ProduceRequest(queue_name=QUEUE, payloads=payloads), timeout=10)
        got = _drain(stub, set(payloads), timeout=10)
        assert set(payloads) <= got, f"acknowledged items missing on {new_primary}: {set(payloads) - got}"
