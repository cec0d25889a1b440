"""Retiring a dead node that kept copies of replicated queues: its copies leave the
shard records, the queues go on with the copies left (a cluster of its own: a node is
killed and retired)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from cluster_helpers import Cluster
from test_cluster_operator import querator

from conftest import dur, wait_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("retire"))) as c:
        yield c


def _record(cluster: Cluster, queue: str) -> dict:
    from aetcd import rpc  # type: ignore[import-untyped]

    with cluster.etcd.channel() as channel:
        kv = rpc.KVStub(channel)
        entry = kv.Range(rpc.RangeRequest(key=f"/{cluster.prefix}/queues/{queue}".encode()), timeout=5).kvs[0]
        uid = json.loads(entry.value)["shard"]
        shard = kv.Range(rpc.RangeRequest(key=f"/{cluster.prefix}/shards/{uid}".encode()), timeout=5).kvs[0]
    return json.loads(shard.value)


def test_retiring_a_dead_node_drops_its_copies_and_the_queues_go_on(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("kept-two", replicas=2)
    n1.stubs.create("kept-three", replicas=3)
    for name in ("kept-two", "kept-three"):
        wait_until(lambda name=name: all(i for _, i in _record(cluster, name)["isr"]), 15)
    two = _record(cluster, "kept-two")
    by_id = {n.node_id: n for n in cluster.nodes}
    dead = by_id[next(n for n in two["replicas"] if n != two["primary"])]  # a copy, not the primary
    alive = [n for n in cluster.nodes if n is not dead]
    for name in ("kept-two", "kept-three"):
        n1.stubs.produce(name, [b"before"])
    dead.kill9()
    wait_until(lambda: dead.node_id not in cluster.live(alive[0]), 20)
    retired = querator("--address", alive[0].address, "cluster", "retire", dead.node_id, "--discard-data", "--yes")
    assert retired.returncode == 0, retired.stderr
    for name, copies in (("kept-two", 1), ("kept-three", 2)):
        record = _record(cluster, name)
        assert dead.node_id not in record["replicas"] and dead.node_id not in [n for n, _ in record["isr"]], record
        assert len(record["replicas"]) == copies and record["min_isr"] <= copies
        (placement,) = [q for q in alive[0].info().queues if q.queue_name == name]
        assert dead.node_id not in placement.replicas
        assert alive[1].stubs.produce(name, [b"after"]).ids
        got: list[bytes] = []
        for _ in range(10):
            got += [i.payload for i in alive[1].stubs.lease(name, 10, request_timeout=dur(0.5)).items]
            if len(got) >= 2:
                break
        assert sorted(got) == [b"after", b"before"]
    status = querator("--address", alive[0].address, "cluster", "status", "--json")
    assert dead.node_id not in {m["node_id"] for m in json.loads(status.stdout)["members"]}
