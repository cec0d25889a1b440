"""Retiring a dead node that kept copies of replicated queues: its copies leave the
shard records and are made again on a live node without one, the queues go on (a
cluster of its own: a node is killed and retired); then deleting a replicated queue
removes every copy, on a node down at the time too."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from cluster_helpers import Cluster
from replication_helpers import shard_of
from test_cluster_operator import querator

from conftest import dur, wait_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("retire"))) as c:
        yield c


def test_retiring_a_dead_node_makes_its_copies_again_where_it_can_and_the_queues_go_on(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("kept-two", replicas=2)
    n1.stubs.create("kept-three", replicas=3)
    for name in ("kept-two", "kept-three"):
        wait_until(lambda name=name: all(i for _, i in shard_of(cluster, name)["isr"]), 15)
    two = shard_of(cluster, "kept-two")
    by_id = {n.node_id: n for n in cluster.nodes}
    dead = by_id[next(n for n in two["replicas"] if n != two["primary"])]  # a copy, not the primary
    alive = [n for n in cluster.nodes if n is not dead]
    for name in ("kept-two", "kept-three"):
        n1.stubs.produce(name, [b"before"])
    dead.kill9()
    wait_until(lambda: dead.node_id not in cluster.live(alive[0]), 20)
    # It homes no partition of a one-copy queue: nothing is lost, no --discard-data asked for.
    retired = querator("--address", alive[0].address, "cluster", "retire", dead.node_id)
    assert retired.returncode == 0, retired.stderr
    # kept-two's copy is made again on the live node that had none, filled from the
    # survivor; kept-three had a copy on every node: it keeps one fewer.
    for name, copies in (("kept-two", 2), ("kept-three", 2)):
        record = shard_of(cluster, name)
        assert dead.node_id not in record["replicas"] and dead.node_id not in [n for n, _ in record["isr"]], record
        assert sorted(record["replicas"]) == sorted(n.node_id for n in alive) and record["min_isr"] <= copies, record
        wait_until(lambda name=name, copies=copies: len([i for _, i in shard_of(cluster, name)["isr"] if i]) == copies, 15)
        (placement,) = [q for q in alive[0].info().queues if q.queue_name == name]
        assert dead.node_id not in placement.replicas
    # The copy made again holds what the dead one held: it serves it once it is the primary.
    remade = next(n for n in shard_of(cluster, "kept-two")["replicas"] if n not in two["replicas"])
    moved = querator("--address", alive[0].address, "cluster", "move", "kept-two", remade)
    assert moved.returncode == 0, moved.stderr
    for name in ("kept-two", "kept-three"):
        assert alive[1].stubs.produce(name, [b"after"]).ids
        got: list[bytes] = []
        for _ in range(10):
            got += [i.payload for i in alive[1].stubs.lease(name, 10, request_timeout=dur(0.5)).items]
            if len(got) >= 2:
                break
        assert sorted(got) == [b"after", b"before"]
    status = querator("--address", alive[0].address, "cluster", "status", "--json")
    assert dead.node_id not in {m["node_id"] for m in json.loads(status.stdout)["members"]}


def test_deleting_a_replicated_queue_removes_every_copy_also_on_a_node_down_meanwhile(cluster: Cluster) -> None:
    """After the retire above: two nodes left."""
    from test_replica_copies_added import local_copies

    from querator.v1 import queues_pb2

    a, b = [n for n in cluster.nodes if n.proc is not None and n.proc.poll() is None]
    for name in ("everywhere", "while-away"):
        a.stubs.create(name, replicas=2)
        wait_until(lambda name=name: all(i for _, i in shard_of(cluster, name)["isr"]), 15)
        a.stubs.produce(name, [b"held"])
    a.stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="everywhere", force=True), timeout=10)
    b.stop()
    wait_until(lambda: b.node_id not in cluster.live(a), 20)
    a.stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="while-away", force=True), timeout=10)
    b.start()  # its copy of while-away comes back with its data directory, and goes
    wait_until(lambda: b.node_id in cluster.live(a), 20)
    a.stubs.create("while-away", replicas=2)  # another generation of the name: a copy of its own
    wait_until(lambda: all(i for _, i in shard_of(cluster, "while-away")["isr"]), 15)
    uid = _uid(cluster, "while-away")
    for node in (a, b):
        node.stop()
    for node in (a, b):
        mine = [c for c in local_copies(node) if c[0] in ("everywhere", "while-away")]
        assert mine == [["while-away", uid]], (node.node_id, mine)
    for node in (a, b):
        node.start()


def _uid(cluster: Cluster, queue: str) -> int:
    from aetcd import rpc  # type: ignore[import-untyped]

    with cluster.etcd.channel() as channel:
        kv = rpc.KVStub(channel)
        entry = kv.Range(rpc.RangeRequest(key=f"/{cluster.prefix}/queues/{queue}".encode()), timeout=5).kvs[0]
    return int(json.loads(entry.value)["shard"])
