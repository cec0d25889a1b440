"""Retiring the dead primary of replicated queues none of whose copies is on a live
node (real etcd, node processes, kill -9): the plain retire is refused naming the
queue; the data-loss retire re-makes each such queue, empty, on the live nodes, as for
a queue of one copy, and counts its partitions as recreated. A dead node that kept a
copy of the old shard and comes back drops it and gets a copy of the new one."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Cluster, Node
from failover_helpers import events
from test_cluster_operator import querator
from test_cluster_replicas_retire import _uid
from test_replica_copies_added import local_copies

from querator.v1 import cluster_pb2, cluster_pb2_grpc

from conftest import dur, wait_until

TTL = 2


def _placement(node: Node, queue: str) -> cluster_pb2.QueuePlacement:
    stub = cluster_pb2_grpc.ClusterServiceStub(node.channel)
    (found,) = stub.ClusterInfo(cluster_pb2.ClusterInfoRequest(queue_names=[queue]), timeout=10).queues
    return found


def _drain(node: Node, queue: str, want: int) -> list[bytes]:
    got: list[bytes] = []
    for _ in range(20):
        got += [i.payload for i in node.stubs.lease(queue, 100, timeout=5, request_timeout=dur(0.3)).items]
        if len(got) >= want:
            break
    return got


@pytest.mark.timeout(180)
def test_the_data_loss_retire_remakes_a_replicated_queue_with_no_live_copy_empty_on_the_live_nodes(tmp_path: Path) -> None:
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        n1 = cluster.nodes[0]
        queues = {"lost-three": 3, "lost-two": 2}
        for name, replicas in queues.items():
            n1.stubs.create(name, replicas=replicas, requested_partitions=2)
            wait_until(lambda name=name, r=replicas: len(_placement(n1, name).in_sync) == r, 20)
            n1.stubs.produce(name, [b"old-%d" % i for i in range(20)])
        before = {name: _placement(n1, name) for name in queues}
        old_uids = {name: _uid(cluster, name) for name in queues}
        # A node that joins now keeps no copy of either queue: the only survivor.
        n4 = Node("n4", str(tmp_path / "n4"), cluster.url, TTL)
        cluster.nodes.append(n4)
        n4.start()
        for node in cluster.nodes[:3]:
            node.kill9()
        wait_until(lambda: cluster.live(n4) == {"n4"}, 30)
        stub = cluster_pb2_grpc.ClusterServiceStub(n4.channel)
        status = querator("--address", n4.address, "cluster", "status")
        assert status.returncode == 3, status.stderr
        for name, old in before.items():
            hint = f"queue {name}: no live node keeps a copy of it; if its nodes are gone for good, 'querator cluster retire {old.primary} --discard-data'"
            assert hint in status.stderr, status.stderr

        primaries = sorted({p.primary for p in before.values()})
        for primary in primaries:
            with pytest.raises(grpc.RpcError) as refused:
                stub.RetireNodeDiscardingData(cluster_pb2.RetireNodeDiscardingDataRequest(node_id=primary), timeout=20)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = refused.value.details() or ""
            assert "no live node keeps a copy of it" in details and "nothing was retired" in details, details
            assert any(f"queue {name!r}" in details for name, p in before.items() if p.primary == primary), details
        assert {m.node_id for m in n4.info().members} >= set(primaries)  # none retired

        for primary in primaries:
            retired = querator("--address", n4.address, "cluster", "retire", primary, "--discard-data", "--yes", "--json")
            assert retired.returncode == 0, retired.stderr
            answer = json.loads(retired.stdout)
            ours = [name for name, p in before.items() if p.primary == primary]
            assert answer["partitions_recreated"] == 2 * len(ours), answer
            assert answer["copies_recreated"] == 0 and answer["copies_promoted"] == [], answer
        for name, old in before.items():
            now = _placement(n4, name)
            assert now.primary == "n4" and list(now.replicas) == ["n4"] and now.min_in_sync == 1, now
            assert now.epoch == old.epoch + 1, (old, now)
        assert len(events(n4, "shard_remade_empty")) == len(queues)
        for name in queues:
            wait_until(lambda name=name: list(_placement(n4, name).in_sync) == ["n4"], 15)
            assert n4.stubs.produce(name, [b"new"]).ids
            assert _drain(n4, name, 1) == [b"new"]  # the old items are gone, as the retire said

        # A dead node that kept a copy and was not retired comes back: it drops the old
        # shard's copy (its items never served again) and the primary gives it a copy of
        # the new one.
        back = next(n for n in cluster.nodes[:3] if n.node_id not in primaries)
        back.start()
        for name in queues:
            wait_until(lambda name=name: set(_placement(n4, name).in_sync) == {"n4", back.node_id}, 30)
            assert n4.stubs.produce(name, [b"after"]).ids
        for name in queues:
            assert _drain(n4, name, 1) == [b"after"]
        new_uids = {name: _uid(cluster, name) for name in queues}
        assert all(new_uids[name] != old_uids[name] for name in queues), (old_uids, new_uids)
        back.stop()
        kept = sorted(tuple(c) for c in local_copies(back) if c[0] in queues)
        assert kept == sorted((name, uid) for name, uid in new_uids.items()), (kept, old_uids)
