"""In a cluster, a node whose partitions of a queue are all faulty (a damaged database,
a full disk) does not fail a Produce: it goes to another node's partitions of the queue
(ADR 19); nor a Lease while another node has items."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from cluster_helpers import Cluster, Node

from querator.v1 import queue_pb2
from querator_server.faults import FAULT_FILE_ENV

from conftest import wait_until


def _fault_line(node_dir: Path, item_id: str) -> str:
    uid, index = (int(part, 16) for part in item_id.split(".")[:2])
    groups = sorted((node_dir / "groups").glob("*")) if (node_dir / "groups").is_dir() else []
    if groups:
        return f"partition-error {node_dir.name}/groups/{groups[0].name} q{uid}.p{index}\n"
    return f"partition-error {node_dir.name}/queues/{uid} p{index}\n"


def _queue_with_an_item_on_n1(n1: Node, payload: bytes) -> tuple[list[str], queue_pb2.ProduceResponse]:
    """Queue "fq" with a partition on each node, and ``payload`` produced through n1, which
    stores it in its own: the partitions' homes, and the Produce answer."""
    n1.stubs.create("fq", requested_partitions=2)
    homes = list(next(q for q in n1.info().queues if q.queue_name == "fq").homes)
    first = n1.stubs.produce("fq", [payload])
    assert homes[first.partition] == "n1"
    return homes, first


def test_produce_to_a_node_whose_partitions_are_faulty_lands_on_another_node(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    cluster = Cluster(str(tmp_path / "cluster"), size=2, env={FAULT_FILE_ENV: str(fault)})
    try:
        cluster.start()
        n1, n2 = cluster.nodes
        homes, first = _queue_with_an_item_on_n1(n1, b"first")
        assert sorted(homes) == ["n1", "n2"]
        mine = first.partition
        fault.write_text(_fault_line(Path(cluster.root, "n1"), first.ids[0]))

        # n1's one partition of the queue fails under this produce: it is marked faulty,
        # and the produce is stored on n2's partition instead of failing.
        moved = n1.stubs.produce("fq", [b"second"])
        assert homes[moved.partition] == "n2"
        faulty = [s for s in n2.stubs.stats("fq").partitions if s.faulty]
        assert [s.partition for s in faulty] == [mine] and "injected fault" in faulty[0].failure
        assert all(homes[n1.stubs.produce("fq", [b"more-%d" % i]).partition] == "n2" for i in range(5))

        fault.unlink()
        wait_until(lambda: not any(s.faulty for s in n1.stubs.stats("fq").partitions), timeout=30)
        stored = n1.stubs.lease("fq", batch_size=10)
        assert stored.partition == mine and [i.payload for i in stored.items] == [b"first"]
    finally:
        cluster.stop()


def test_a_node_whose_disk_is_full_hands_produce_and_lease_to_the_others_and_shows_faulty(tmp_path: Path) -> None:
    """A full disk on n1: its Produce calls are stored on n2 (nothing of them was stored
    on n1), its Leases serve n2's items and, once there are none, answer the failure
    rather than "empty" while n1's items wait; stats show n1's partition faulty."""
    fault = tmp_path / "fault"
    cluster = Cluster(str(tmp_path / "cluster"), size=2, env={FAULT_FILE_ENV: str(fault)})
    try:
        cluster.start()
        n1, n2 = cluster.nodes
        homes, first = _queue_with_an_item_on_n1(n1, b"on-n1")
        mine = first.partition
        storage = next(p for p in Path(cluster.root, "n1").glob("*/*") if p.parent.name in ("groups", "queues"))
        fault.write_text(f"no-space n1/{storage.parent.name}/{storage.name}\n")

        moved = n1.stubs.produce("fq", [b"moved"])  # refused by n1's disk: stored on n2
        assert homes[moved.partition] == "n2"
        faulty = [s for s in n2.stubs.stats("fq").partitions if s.faulty]
        assert [s.partition for s in faulty] == [mine], faulty
        assert "no space left on device" in faulty[0].failure.lower()
        served = n1.stubs.lease("fq", batch_size=10, request_timeout={"nanos": 300_000_000})
        assert [i.payload for i in served.items] == [b"moved"]
        n1.stubs.complete("fq", served.partition, [i.id for i in served.items])
        with pytest.raises(grpc.RpcError) as failed:  # n1's item waits on its full disk
            n1.stubs.lease("fq", batch_size=10, request_timeout={"nanos": 300_000_000})
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no space left on device" in (failed.value.details() or "").lower()

        fault.unlink()
        wait_until(lambda: not any(s.faulty for s in n2.stubs.stats("fq").partitions), timeout=30)
        stored = n1.stubs.lease("fq", batch_size=10)
        assert stored.partition == mine and [i.payload for i in stored.items] == [b"on-n1"]
    finally:
        cluster.stop()
