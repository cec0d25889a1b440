"""Replicated queues left short of copies, with real etcd and node processes.

A module-scoped cluster of two nodes goes through one story: a queue of two copies
whose copy node is killed, so the primary goes on alone (the copy leaves the in-sync
set), then whose primary is killed and whose copy comes back. No live copy can take
over: ``querator cluster status`` says why (the copy is not in the in-sync set), and a
plain retire of the dead primary is refused; the explicit data-loss retire promotes
the surviving copy, saying at which position. A cluster of its own: a node retired
leaves a queue of two copies with one, and a node that joins later gets its copy back.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Cluster, Node
from failover_helpers import QUEUE, create_queue, digests, events, placement
from test_cluster_operator import querator

from querator.v1 import cluster_pb2, cluster_pb2_grpc

from conftest import dur, wait_until

TTL = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("short")), size=2, ttl=TTL) as c:
        yield c


def _by_id(cluster: Cluster) -> dict[str, Node]:
    return {n.node_id: n for n in cluster.nodes}


def _blocked(node: Node) -> cluster_pb2.QueuePlacement:
    stub = cluster_pb2_grpc.ClusterServiceStub(node.channel)
    info = stub.ClusterInfo(cluster_pb2.ClusterInfoRequest(queue_names=[QUEUE], check_members=True), timeout=10)
    (found,) = info.queues
    return found


@pytest.mark.timeout(90)
def test_status_says_why_a_live_copy_cannot_take_over_from_a_dead_primary(cluster: Cluster) -> None:
    by_id = _by_id(cluster)
    create_queue(cluster.nodes[0], replicas=2, partitions=1)
    wait_until(lambda: len((placement(cluster.nodes[0]) or cluster_pb2.QueuePlacement()).in_sync) == 2, 15)
    found = placement(cluster.nodes[0])
    assert found is not None
    primary, copy = by_id[found.primary], by_id[next(n for n in found.replicas if n != found.primary)]
    primary.stubs.produce(QUEUE, [b"both-1", b"both-2"])
    copy.kill9()
    # The primary waits for the silent copy up to the lag bound, then drops it from the
    # in-sync set and acknowledges alone: "alone" is on the primary only.
    primary.stubs.produce(QUEUE, [b"alone"])
    wait_until(lambda: list((placement(primary) or cluster_pb2.QueuePlacement()).in_sync) == [primary.node_id], 15)
    assert _blocked(primary).failover_blocked == ""  # the primary is live: nothing is blocked
    primary.kill9()
    copy.start()
    wait_until(lambda: copy.node_id in cluster.live(copy) and primary.node_id not in cluster.live(copy), 30)
    reason = _blocked(copy).failover_blocked
    assert f"node {copy.node_id!r} is not in the in-sync set" in reason, reason
    status = querator("--address", copy.address, "cluster", "status")
    assert status.returncode == 3, status.stderr
    assert "is not in the in-sync set" in status.stderr and "no live in-sync copy can take over" in status.stderr, status.stderr
    as_json = json.loads(querator("--address", copy.address, "cluster", "status", "--json").stdout)
    (replicated,) = as_json["replicated"]
    assert replicated["failover_blocked"] == reason
    # Still blocked a few ticks later: nothing elects a copy that may lack acknowledged writes.
    time.sleep(1.5)
    assert _blocked(copy).primary == primary.node_id


@pytest.mark.timeout(120)
def test_a_node_that_joins_gets_the_copy_a_retire_left_a_queue_short_of(tmp_path: Path) -> None:
    with Cluster(str(tmp_path), size=2, ttl=TTL) as cluster:
        by_id = _by_id(cluster)
        # min_in_sync 2: the retire caps it at the one copy left, the copy made again restores it.
        create_queue(cluster.nodes[0], replicas=2, partitions=2, min_in_sync=2)
        wait_until(lambda: len((placement(cluster.nodes[0]) or cluster_pb2.QueuePlacement()).in_sync) == 2, 15)
        found = placement(cluster.nodes[0])
        assert found is not None and found.min_in_sync == 2
        primary, dead = by_id[found.primary], by_id[next(n for n in found.replicas if n != found.primary)]
        primary.stubs.produce(QUEUE, [b"before-%d" % i for i in range(50)])
        dead.kill9()
        wait_until(lambda: dead.node_id not in cluster.live(primary), 20)
        retired = querator("--address", primary.address, "cluster", "retire", dead.node_id)
        assert retired.returncode == 0, retired.stderr
        # No live node without a copy: the queue keeps one copy, fewer than its replicas.
        short = placement(primary)
        assert short is not None and list(short.replicas) == [primary.node_id] and short.min_in_sync == 1, short
        primary.stubs.produce(QUEUE, [b"short-%d" % i for i in range(50)])

        joined = Node("n3", str(tmp_path / "n3"), cluster.url, TTL)
        cluster.nodes.append(joined)
        joined.start()
        both = {primary.node_id, "n3"}

        def restored() -> bool:
            now = placement(primary)
            return now is not None and set(now.replicas) == both and set(now.in_sync) == both and now.min_in_sync == 2

        wait_until(restored, 30)
        assert len([e for n in cluster.nodes for e in events(n, "cluster_copy_restored")]) == 1
        primary.stubs.produce(QUEUE, [b"after-%d" % i for i in range(50)])  # acknowledged by both copies
        for node in (primary, joined):
            node.signal(signal.SIGKILL)
        for node in (primary, joined):
            node.stop()
        one, two = digests(primary), digests(joined)
        assert one["digest"] == two["digest"] and one["position"] == two["position"], (one, two)


@pytest.mark.timeout(90)
def test_a_plain_retire_of_a_node_holding_the_only_in_sync_copy_is_refused_the_data_loss_retire_promotes_the_copy_behind(
    cluster: Cluster,
) -> None:
    """After the test above: the primary is dead, its copy live and out of the in-sync set."""
    found = placement(cluster.nodes[0] if cluster.nodes[0].proc and cluster.nodes[0].proc.poll() is None else cluster.nodes[1])
    by_id = _by_id(cluster)
    assert found is not None
    dead = by_id[found.primary]
    copy = by_id[next(n for n in found.replicas if n != found.primary)]
    stub = cluster_pb2_grpc.ClusterServiceStub(copy.channel)
    with pytest.raises(grpc.RpcError) as refused:
        stub.RetireNodeDiscardingData(cluster_pb2.RetireNodeDiscardingDataRequest(node_id=dead.node_id), timeout=20)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"node {dead.node_id!r} holds its only in-sync copy; nothing was retired" in (refused.value.details() or "")
    assert dead.node_id in {m.node_id for m in copy.info().members}  # not retired
    assert placement(copy).primary == dead.node_id  # type: ignore[union-attr]

    retired = querator("--address", copy.address, "cluster", "retire", dead.node_id, "--discard-data", "--yes", "--json")
    assert retired.returncode == 0, retired.stderr
    answer = json.loads(retired.stdout)
    (promoted,) = answer["copies_promoted"]
    assert promoted["queue_name"] == QUEUE and promoted["node_id"] == copy.node_id, answer
    assert promoted["epoch"] == found.epoch and promoted["lsn"] > 0 and promoted["new_epoch"] == found.epoch + 1, answer
    now = placement(copy)
    assert now is not None and now.primary == copy.node_id and list(now.replicas) == [copy.node_id], now
    # The copy serves what it held: both acknowledged by both copies; "alone" (acknowledged
    # by the dead primary after the copy left the in-sync set) is the loss the answer named.
    got: list[bytes] = []
    wait_until(lambda: got.extend(i.payload for i in copy.stubs.lease(QUEUE, 10, timeout=5, request_timeout=dur(0.3)).items) or len(got) >= 2, 20)
    time.sleep(0.5)
    got += [i.payload for i in copy.stubs.lease(QUEUE, 10, timeout=5, request_timeout=dur(0.3)).items]
    assert sorted(got) == [b"both-1", b"both-2"]
    assert copy.stubs.produce(QUEUE, [b"after"]).ids
