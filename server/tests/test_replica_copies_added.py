"""Copies of a replicated queue added on nodes that had none, with real etcd and node
processes under the audit's load: UpdateQueue raising replicas, a move to a node
without a copy, a drain that moves copies too. After each step the copies are in
sync; at the end the audit's checker judges every call (nothing acknowledged lost,
nothing delivered after its Complete) and the copies' digests are equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Cluster, Node
from failover_helpers import QUEUE, Run, create_queue, digests, events, placement, stop_quietly, wait_in_sync
from google.protobuf import field_mask_pb2
from test_cluster_operator import querator

from querator.v1 import cluster_pb2, cluster_pb2_grpc, queues_pb2

TTL = 2

_LOCAL_COPIES = """
import asyncio, json, sys
from querator_server.manager import QueuesManager

async def main(path):
    manager = QueuesManager(path)
    await manager.start()
    try:
        return sorted([c.name, c.uid] for c in manager.copy_configs())
    finally:
        await manager.stop()

print(json.dumps(asyncio.run(main(sys.argv[1]))))
"""


def local_copies(node: Node) -> list[list[object]]:
    """The copies of replicated queues in ``node``'s data directory (the node stopped):
    [name, shard uid] each."""
    assert node.proc is None or node.proc.poll() is not None, "stop the node first"
    out = subprocess.run(
        [sys.executable, "-c", _LOCAL_COPIES, node.data_dir], capture_output=True, text=True, timeout=60, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def update_replicas(node: Node, name: str, replicas: int) -> queues_pb2.QueueInfo:
    request = queues_pb2.UpdateQueueRequest(
        queue=queues_pb2.QueueInfo(queue_name=name, replicas=replicas),
        update_mask=field_mask_pb2.FieldMask(paths=["replicas"]),
    )
    return node.stubs.queues.UpdateQueue(request, timeout=20).queue


def placed(node: Node, name: str = QUEUE) -> cluster_pb2.QueuePlacement:
    stub = cluster_pb2_grpc.ClusterServiceStub(node.channel)
    info = stub.ClusterInfo(cluster_pb2.ClusterInfoRequest(queue_names=[name]), timeout=5)
    (found,) = info.queues
    return found


def wait_copies(node: Node, name: str, copies: set[str], timeout: float = 30) -> float:
    """Seconds until ``node`` sees exactly ``copies`` as the queue's copies, all in sync."""
    started = time.monotonic()
    seen: object = None
    while time.monotonic() < started + timeout:
        found = placed(node, name)
        seen = (list(found.replicas), list(found.in_sync))
        if set(found.replicas) == copies and set(found.in_sync) == copies:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"copies {sorted(copies)} not all in sync after {timeout} s: {seen}")


@pytest.mark.timeout(240)
def test_copies_move_to_nodes_without_one_under_load_and_nothing_is_lost(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        n1 = cluster.nodes[0]
        by_id = {n.node_id: n for n in cluster.nodes}
        create_queue(n1, 2)
        wait_in_sync(cluster, n1, 2)
        first = placed(n1)
        spare = next(n for n in by_id if n not in first.replicas)
        run = Run(cluster)
        run.start()
        time.sleep(1.5)
        assert run.acknowledged_since(0) > 10, "no load before the moves"

        # A move to a node without a copy: the primary's copy goes there, and NODE serves.
        started = time.monotonic()
        moved = querator("--address", n1.address, "cluster", "move", QUEUE, spare, "--json")
        took_move = time.monotonic() - started
        assert moved.returncode == 0, moved.stderr
        shown = json.loads(moved.stdout)
        other = next(n for n in first.replicas if n != first.primary)
        assert shown["primary"] == spare and sorted(shown["replicas"]) == sorted([other, spare]), shown
        assert shown["epoch"] == first.epoch + 1, shown
        wait_copies(n1, QUEUE, {other, spare})
        time.sleep(1)

        # A drain moves the copies too: the primary to the other in-sync copy, the copy to
        # the node without one (the old primary's, dropped by the move).
        drained = querator("--address", n1.address, "cluster", "drain", spare, "--json")
        report = json.loads(drained.stdout)
        assert drained.returncode == 0 and report["moved"] == [QUEUE] and report["kept"] == [], drained.stdout
        wait_copies(n1, QUEUE, {other, first.primary})
        # The other copy serves, or, if the load had it out of the in-sync set at the
        # drain, the drained copy's replacement (handed the primary once caught up).
        assert placed(n1).primary in (other, first.primary)
        time.sleep(1)

        # Raising replicas adds the missing copy where there is none (the drained node).
        assert update_replicas(n1, QUEUE, 3).replicas == 3
        took_raise = wait_copies(n1, QUEUE, set(by_id))
        time.sleep(1)
        verdict = run.finish()
        assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10]))
        assert verdict.acknowledged > 50, verdict.figures()
        final = placement(n1)
        assert final is not None and sorted(final.in_sync) == sorted(by_id)
        time.sleep(1)  # the last acks of the drain's changes
        stop_quietly(cluster.nodes)
        found = {n: digests(by_id[n]) for n in by_id}
        assert len({str(d["digest"]) for d in found.values()}) == 1, found
        assert len({str(d["position"]) for d in found.values()}) == 1, found
        record_property(
            "figures",
            f"move to a node without a copy {took_move:.2f} s; copy in sync {took_raise:.2f} s after the raise; "
            f"{verdict.figures()}",
        )


@pytest.mark.timeout(120)
def test_a_move_cut_short_is_finished_by_the_cluster_and_raising_replicas_fills_a_copy_by_snapshot(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    # A ring of 4 change sets: the new copy, 20 behind, is filled by a snapshot.
    info = {"QUERATOR_LOG_LEVEL": "info"}  # for the snapshot's log event
    with Cluster(str(tmp_path), size=3, ttl=TTL, args=["--replica-ring", "4"], env=info) as cluster:
        n1, n2, _ = cluster.nodes
        n1.stubs.create("bulk", replicas=2, requested_partitions=2)
        before = set(placed(n1, "bulk").replicas)
        wait_copies(n1, "bulk", before)
        (added,) = {"n1", "n2", "n3"} - before
        items = 20_000
        for i in range(items // 1000):
            n1.stubs.produce("bulk", [f"{i}-{j}".encode().ljust(100, b".") for j in range(1000)])
        # A move its deadline cuts short leaves the new copy catching up (the queue has
        # a copy more than it keeps); the queue's primary finishes it once the copy is in
        # sync, and the same command again answers the queue as it then is.
        old = placed(n1, "bulk").primary
        short = querator("--address", n1.address, "--timeout", "1s", "cluster", "move", "bulk", added)
        assert short.returncode != 0 and "still catching up" in short.stderr, short.stderr
        assert added in placed(n1, "bulk").replicas
        wait_copies(n1, "bulk", before - {old} | {added}, timeout=60)
        assert placed(n1, "bulk").primary == added
        again = querator("--address", n1.address, "cluster", "move", "bulk", added)
        assert again.returncode == 0, again.stderr
        assert placed(n1, "bulk").primary == added and set(placed(n1, "bulk").replicas) == before - {old} | {added}
        # Every item is on the new copy: it serves them now.
        assert sum(p.total for p in n1.stubs.stats("bulk").partitions) == items
        # Raising replicas makes a copy again on the node the move left.
        started = time.monotonic()
        assert update_replicas(n2, "bulk", 3).replicas == 3
        took = wait_copies(n1, "bulk", {"n1", "n2", "n3"}, timeout=60)
        total = time.monotonic() - started
        sent = {str(e.get("node")) for n in cluster.nodes for e in events(n, "replica_snapshot_sent")}
        assert {added, old} <= sent, f"the new copies were not filled by snapshots: {sent}"
        record_property("figures", f"a copy of {items} items of 100 bytes in sync {total:.2f} s after UpdateQueue")
        print(f"copy of {items} items in sync {total:.2f} s after UpdateQueue ({took:.2f} s after it answered)")
        for name, replicas, code, text in (
            ("bulk", 4, grpc.StatusCode.FAILED_PRECONDITION, "needs 4 live nodes for its replicas, the cluster has 3 live"),
            ("single", 2, grpc.StatusCode.INVALID_ARGUMENT, "queue.replicas: a queue of one copy cannot gain copies"),
            ("bulk", 2, grpc.StatusCode.INVALID_ARGUMENT, "queue.replicas: cannot be lowered (from 3 to 2)"),
        ):
            if name == "single" and not any(q.queue_name == "single" for q in n1.info().queues):
                n1.stubs.create("single", replicas=1)
            with pytest.raises(grpc.RpcError) as caught:
                update_replicas(n1, name, replicas)
            assert caught.value.code() == code and text in (caught.value.details() or ""), caught.value.details()
