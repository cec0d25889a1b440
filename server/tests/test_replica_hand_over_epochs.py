"""An admin hand-over (cluster move) lets one epoch's primary acknowledge at a time,
with real etcd and node processes whose links go through loopback proxies
(network_chaos.py).

The replicas' acknowledgements of a change the old primary made are held on their way
back to it, and its etcd link is held too (well within its membership lease, so the
lease rule lets it answer): it cannot learn of the move from the catalog. The move
hands the queue to another copy, which acknowledges a Produce of its own; then the held
acknowledgements are let through. The old primary must not answer its change OK after
the new primary's first acknowledgement.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from cluster_helpers import DOWN, HOLD, PASS, Node
from google.protobuf import field_mask_pb2
from network_chaos import Network
from replication_helpers import claimed, placement, shard_of

from querator.v1 import cluster_pb2, cluster_pb2_grpc, queues_pb2

from conftest import wait_until

TTL = 5
QUEUE = "handed-over"


def _move(via: Node, to: str, source: str, timeout: float) -> None:
    cluster_pb2_grpc.ClusterServiceStub(via.channel).MoveQueue(
        cluster_pb2.MoveQueueRequest(queue_name=QUEUE, node_id=to, from_node_id=source), timeout=timeout
    )


@pytest.mark.timeout(120)
def test_after_a_move_the_old_primary_answers_nothing_once_the_new_one_acknowledged(tmp_path: Path) -> None:
    with Network(str(tmp_path), size=3, ttl=TTL) as net:
        cluster = net.cluster
        n1 = cluster.nodes[0]
        n1.stubs.create(QUEUE, replicas=2)
        wait_until(lambda: claimed(cluster, QUEUE), 15)
        placed = placement(n1, QUEUE)
        by_id = {n.node_id: n for n in cluster.nodes}
        old = by_id[placed.primary]
        other = by_id[next(n for n in placed.replicas if n != old.node_id)]
        new = next(n for n in cluster.nodes if n.node_id not in placed.replicas)
        old.stubs.produce(QUEUE, [b"before"])

        # The copy on the new node first, in sync (a third copy: a move cut short would
        # be finished by the old primary itself as soon as that copy is in sync); the move
        # then only hands over.
        update = queues_pb2.UpdateQueueRequest(
            queue=queues_pb2.QueueInfo(queue_name=QUEUE, replicas=3),
            update_mask=field_mask_pb2.FieldMask(paths=["replicas"]),
        )
        other.stubs.queues.UpdateQueue(update, timeout=20)
        wait_until(lambda: any(n == new.node_id and i for n, i in shard_of(cluster, QUEUE)["isr"]), 20)

        # The copies' acknowledgements to the old primary held, and its etcd link.
        held = [net.proxies[(old.node_id, other.node_id)], net.proxies[(old.node_id, new.node_id)]]
        for proxy in held:
            proxy.mode(DOWN, HOLD)
        net.proxies[(old.node_id, "etcd")].blackhole()
        held_at = time.monotonic()
        answer: dict[str, object] = {}

        def produce_on_old() -> None:
            try:
                old.stubs.produce(QUEUE, [b"held"])
                answer["ok_at"] = time.monotonic()
            except grpc.RpcError as exc:
                answer["error"] = exc.code()

        producer = threading.Thread(target=produce_on_old, daemon=True)
        producer.start()
        time.sleep(0.3)  # shipped to both copies, applied there; their answers held

        _move(other, new.node_id, "", timeout=10)
        first_ack_at = 0.0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                new.stubs.produce(QUEUE, [b"new-epoch"])
                first_ack_at = time.monotonic()
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
                time.sleep(0.05)
        assert first_ack_at, "the new primary acknowledged nothing"
        assert first_ack_at - held_at < TTL - 1.5, "too slow: the old primary's membership lease may have run out"

        for proxy in held:
            proxy.mode(DOWN, PASS)
        producer.join(8)
        net.proxies[(old.node_id, "etcd")].restore()
        assert not producer.is_alive()
        ok_at = answer.get("ok_at")
        assert ok_at is None or float(ok_at) <= first_ack_at, (  # type: ignore[arg-type]
            f"the old primary answered OK {float(ok_at) - first_ack_at:.3f} s after the new primary's first acknowledgement"  # type: ignore[arg-type]
        )
        assert answer.get("error") in (None, grpc.StatusCode.UNAVAILABLE), answer
