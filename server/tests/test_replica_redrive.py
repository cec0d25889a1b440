"""RedriveItems from a replicated dead-letter queue whose sources' primaries are on
other nodes, with real etcd and node processes: each dead letter goes back to its
source's primary (one hop), once, and the call answers once they are stored there.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Cluster, Node
from test_cluster_replicas_retire import _record

from querator.v1 import cluster_pb2, cluster_pb2_grpc, queue_pb2, storage_pb2

from conftest import wait_until

TTL = 2
DLQ = "redriven-dead-letters"
SOURCE = "redriven-source"
ITEMS = 30


def _placement(node: Node, queue: str) -> cluster_pb2.QueuePlacement:
    found = next((q for q in node.info().queues if q.queue_name == queue), None)
    assert found is not None, f"{queue} is not in ClusterInfo"
    return found


def _claimed(cluster: Cluster, queue: str) -> bool:
    return all(incarnation for _, incarnation in _record(cluster, queue)["isr"])


def _total(node: Node, queue: str) -> int:
    return sum(p.total for p in node.stubs.stats(queue).partitions)


def _dead_letter(node: Node, queue: str, count: int) -> Counter[bytes]:
    """Lease ``count`` items of ``queue`` and retry each as dead."""
    dead: Counter[bytes] = Counter()
    deadline = time.monotonic() + 20
    while sum(dead.values()) < count and time.monotonic() < deadline:
        leased = node.stubs.lease(queue, 10, request_timeout={"nanos": 200_000_000})
        if leased.items:
            items = [queue_pb2.RetryItem(id=i.id, dead=True) for i in leased.items]
            node.stubs.queue.Retry(queue_pb2.RetryRequest(queue_name=queue, partition=leased.partition, items=items), timeout=5)
            dead.update(i.payload for i in leased.items)
    return dead


@pytest.mark.timeout(120)
def test_a_replicated_dead_letter_queue_redrives_to_a_source_whose_primary_is_on_another_node(tmp_path: Path) -> None:
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        n1 = cluster.nodes[0]
        n1.stubs.create(DLQ, replicas=2)
        n1.stubs.create(SOURCE, replicas=2, requested_partitions=2, dead_queue=DLQ)
        wait_until(lambda: _claimed(cluster, DLQ) and _claimed(cluster, SOURCE), 15)
        dlq, source = _placement(n1, DLQ), _placement(n1, SOURCE)
        # The dead-letter queue's primary on a node holding no copy of the source: the
        # redrive can reach the source only through another node.
        if dlq.primary in source.replicas:
            other = next(n for n in dlq.replicas if n not in source.replicas)
            cluster_pb2_grpc.ClusterServiceStub(n1.channel).MoveQueue(
                cluster_pb2.MoveQueueRequest(queue_name=DLQ, node_id=other), timeout=20
            )
            wait_until(lambda: _placement(n1, DLQ).primary == other, 10)
        dlq = _placement(n1, DLQ)
        assert dlq.primary not in source.replicas, (dlq, source)

        payloads = [f"item-{i}".encode() for i in range(ITEMS)]
        n1.stubs.produce(SOURCE, payloads)
        assert _dead_letter(n1, SOURCE, ITEMS) == Counter(payloads)
        wait_until(lambda: _total(n1, DLQ) == ITEMS and _total(n1, SOURCE) == 0, 15)

        by_id = {n.node_id: n for n in cluster.nodes}
        via = by_id[next(n for n in by_id if n != dlq.primary)]  # the call is forwarded to the primary too
        moved: list[str] = []
        token = ""
        skipped = 0
        for _ in range(10):
            answer = via.stubs.storage.RedriveItems(
                storage_pb2.RedriveItemsRequest(queue_name=DLQ, max_items=ITEMS, page_token=token), timeout=20
            )
            moved += answer.message_ids
            skipped += answer.skipped
            token = answer.next_page_token
            if not token:
                break
        assert skipped == 0 and len(moved) == ITEMS, f"moved {len(moved)}, skipped {skipped}"
        assert len(set(moved)) == ITEMS
        assert _total(n1, DLQ) == 0
        assert _total(n1, SOURCE) == ITEMS

        back: Counter[bytes] = Counter()
        deadline = time.monotonic() + 20
        while sum(back.values()) < ITEMS and time.monotonic() < deadline:
            try:
                leased = n1.stubs.lease(SOURCE, 10, request_timeout={"nanos": 200_000_000})
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
                continue
            back.update(i.payload for i in leased.items)
            if leased.items:
                n1.stubs.complete(SOURCE, leased.partition, [i.id for i in leased.items])
        assert back == Counter(payloads)
