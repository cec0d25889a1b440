"""In a cluster, a node whose partitions of a queue are all faulty does not fail a
Produce: it goes to another node's partitions of the queue (ADR 19)."""

from __future__ import annotations

from pathlib import Path

from cluster_helpers import Cluster

from querator_server.faults import FAULT_FILE_ENV

from conftest import wait_until


def _fault_line(node_dir: Path, item_id: str) -> str:
    uid, index = (int(part, 16) for part in item_id.split(".")[:2])
    groups = sorted((node_dir / "groups").glob("*")) if (node_dir / "groups").is_dir() else []
    if groups:
        return f"partition-error {node_dir.name}/groups/{groups[0].name} q{uid}.p{index}\n"
    return f"partition-error {node_dir.name}/queues/{uid} p{index}\n"


def test_produce_to_a_node_whose_partitions_are_faulty_lands_on_another_node(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    cluster = Cluster(str(tmp_path / "cluster"), size=2, env={FAULT_FILE_ENV: str(fault)})
    try:
        cluster.start()
        n1, n2 = cluster.nodes
        n1.stubs.create("fq", requested_partitions=2)
        homes = list(next(q for q in n1.info().queues if q.queue_name == "fq").homes)
        assert sorted(homes) == ["n1", "n2"]
        first = n1.stubs.produce("fq", [b"first"])
        mine = first.partition
        assert homes[mine] == "n1"
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
