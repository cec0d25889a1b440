"""A move of a replicated queue's primary copy cut short by kill -9 of the node running
it, at each of its steps, with real etcd and node processes under the audit's load; the
node running it is the queue's primary (the most demanding place: up to the hand-over
its death is also a failover). Nobody runs the command again: the queue's primary
finishes the move by itself (cluster/move_finish.py), so the queue ends with exactly
its two copies, the new one serving, both in sync, nothing acknowledged lost (the
audit's checker) and the copies' digests equal.

The node kills itself at the named step (``QUERATOR_CRASH_AT``, faults.py): after the
new copy was added to the shard record; while it waits for the copy to catch up; once
the copy is in sync, before the hand-over; after the hand-over, before the old copy is
dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from cluster_helpers import Cluster, Node
from failover_helpers import QUEUE, Run, create_queue, digests, events, placement, stop_quietly, wait_in_sync
from replication_helpers import shard_of

from querator.v1 import cluster_pb2, cluster_pb2_grpc
from querator_server.faults import (
    REPLICA_MOVE_ADDED,
    REPLICA_MOVE_CATCHING_UP,
    REPLICA_MOVE_HANDED_OVER,
    REPLICA_MOVE_IN_SYNC,
)

from conftest import dur, wait_until

TTL = 2


def _queue_placement(node: Node, name: str = "paused") -> cluster_pb2.QueuePlacement:
    stub = cluster_pb2_grpc.ClusterServiceStub(node.channel)
    (found,) = stub.ClusterInfo(cluster_pb2.ClusterInfoRequest(queue_names=[name]), timeout=10).queues
    return found


def _settled(record: dict[str, Any], copies: set[str]) -> bool:
    """The record holds exactly ``copies``, each claimed in sync, and no move."""
    in_sync = {node for node, incarnation in record["isr"] if incarnation}
    return not record.get("move") and set(record["replicas"]) == copies and in_sync == copies


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("step", "drain"),
    [
        (REPLICA_MOVE_ADDED, False),
        (REPLICA_MOVE_CATCHING_UP, False),
        (REPLICA_MOVE_IN_SYNC, False),
        (REPLICA_MOVE_HANDED_OVER, False),
        (REPLICA_MOVE_ADDED, True),
    ],
    ids=["move-added", "move-catching-up", "move-in-sync", "move-handed-over", "drain-added"],
)
def test_a_move_whose_node_is_killed_at_each_step_is_finished_by_the_cluster(
    tmp_path: Path, step: str, drain: bool, record_property: Callable[[str, object], None]
) -> None:
    """``drain``: the move is the one a drain of the queue's other copy makes, run by
    that copy's node (drained), killed once the new copy is added; the primary stays."""
    with Cluster(str(tmp_path), size=3, ttl=TTL, env={"QUERATOR_CRASH_AT": step}) as cluster:
        by_id = {n.node_id: n for n in cluster.nodes}
        create_queue(cluster.nodes[0], replicas=2)
        wait_in_sync(cluster, cluster.nodes[0], 2)
        first = placement(cluster.nodes[0])
        assert first is not None
        other = next(n for n in first.replicas if n != first.primary)
        target = next(n for n in by_id if n not in first.replicas)
        # The node running the move (killed), the copy that stays, and who serves after.
        driver, kept, serving = (by_id[other], first.primary, first.primary) if drain else (by_id[first.primary], other, target)
        run = Run(cluster)
        run.start()
        run.load_for(1.0, calls=50)

        answer: list[object] = []

        def move() -> None:
            stub = cluster_pb2_grpc.ClusterServiceStub(driver.channel)
            try:
                if drain:
                    answer.append(stub.DrainNode(cluster_pb2.DrainNodeRequest(node_id=driver.node_id), timeout=30))
                else:
                    answer.append(stub.MoveQueue(cluster_pb2.MoveQueueRequest(queue_name=QUEUE, node_id=target), timeout=30))
            except grpc.RpcError as exc:
                answer.append(exc)

        mover = threading.Thread(target=move, daemon=True)
        mover.start()
        assert driver.proc is not None
        driver.proc.wait(30)  # it kills itself at ``step``
        killed = time.monotonic()
        mover.join(30)
        assert answer and isinstance(answer[0], grpc.RpcError), answer  # the call died with its node
        cut = shard_of(cluster, QUEUE)
        assert target in cut["replicas"] and cut.get("move"), cut  # cut short: the move under way

        # Nobody runs the move again: the cluster finishes it.
        deadline = time.monotonic() + 30
        record = shard_of(cluster, QUEUE)
        while not _settled(record, {kept, target}) and time.monotonic() < deadline:
            time.sleep(0.05)
            record = shard_of(cluster, QUEUE)
        took = time.monotonic() - killed
        assert _settled(record, {kept, target}), record
        assert record["primary"] == serving, record  # the move's intent: the new copy serves if the primary's moved
        final = placement(by_id[kept])
        assert final is not None and set(final.in_sync) == {kept, target}, final
        run.load_for(0.5, calls=20)

        run.load.addresses.pop(driver.node_id)  # the drain after the load leases from the live nodes
        verdict = run.finish()
        assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10]))
        assert verdict.acknowledged > 50, verdict.figures()
        stop_quietly(cluster.nodes)
        found = {n: digests(by_id[n]) for n in (kept, target)}
        assert len({str(d["digest"]) for d in found.values()}) == 1, found
        assert len({str(d["position"]) for d in found.values()}) == 1, found
        what = "drain" if drain else "move"
        record_property("figures", f"{what} {step}: finished {took:.2f} s after the kill; {verdict.figures()}")


@pytest.mark.timeout(120)
def test_a_move_cut_short_whose_new_copy_dies_before_it_caught_up_is_undone(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """The node running the move (the primary) killed once the new copy is added, and the
    new copy's node killed before anything filled it: the move cannot be finished, so the
    new primary drops the new copy (never in sync, so nothing acknowledged depends on it)
    and the queue is back on its two copies once the killed primary's node returns."""
    with Cluster(str(tmp_path), size=3, ttl=TTL, env={"QUERATOR_CRASH_AT": REPLICA_MOVE_ADDED}) as cluster:
        by_id = {n.node_id: n for n in cluster.nodes}
        create_queue(cluster.nodes[0], replicas=2)
        wait_in_sync(cluster, cluster.nodes[0], 2)
        first = placement(cluster.nodes[0])
        assert first is not None
        source = by_id[first.primary]
        other = next(n for n in first.replicas if n != first.primary)
        target = next(n for n in by_id if n not in first.replicas)
        run = Run(cluster)
        run.start()
        run.load_for(1.0, calls=50)

        answer: list[object] = []

        def move() -> None:
            stub = cluster_pb2_grpc.ClusterServiceStub(source.channel)
            try:
                answer.append(stub.MoveQueue(cluster_pb2.MoveQueueRequest(queue_name=QUEUE, node_id=target), timeout=30))
            except grpc.RpcError as exc:
                answer.append(exc)

        mover = threading.Thread(target=move, daemon=True)
        mover.start()
        assert source.proc is not None
        source.proc.wait(30)  # it kills itself once the new copy is in the record
        by_id[target].kill9()  # before the next primary (a failover away) fills it
        killed = time.monotonic()
        mover.join(30)
        assert answer and isinstance(answer[0], grpc.RpcError), answer  # the call died with its node
        cut = shard_of(cluster, QUEUE)
        assert target in cut["replicas"] and cut["move"]["target"] == target, cut

        deadline = time.monotonic() + 30
        record = shard_of(cluster, QUEUE)
        while (record.get("move") or target in record["replicas"]) and time.monotonic() < deadline:
            time.sleep(0.05)
            record = shard_of(cluster, QUEUE)
        took = time.monotonic() - killed
        assert not record.get("move") and sorted(record["replicas"]) == sorted([source.node_id, other]), record
        assert record["primary"] == other, record

        source.start()  # back as a copy of the queue, caught up by the new primary
        wait_in_sync(cluster, by_id[other], 2)
        assert _settled(shard_of(cluster, QUEUE), {source.node_id, other})
        run.load_for(0.5, calls=20)
        run.load.addresses.pop(target)  # the drain after the load leases from the live nodes
        verdict = run.finish()
        assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10]))
        stop_quietly(cluster.nodes)
        found = {n: digests(by_id[n]) for n in (source.node_id, other)}
        assert len({str(d["digest"]) for d in found.values()}) == 1, found
        assert len({str(d["position"]) for d in found.values()}) == 1, found
        record_property("figures", f"undone {took:.2f} s after the kills; {verdict.figures()}")


def _two_copies_filled(cluster: Cluster, items: int) -> tuple[Node, str, list[bytes]]:
    """Queue "paused" with 2 copies in sync holding ``items`` items (a snapshot to fill a
    new copy): the node of its copy that is not primary, a node without a copy, the payloads."""
    by_id = {n.node_id: n for n in cluster.nodes}
    n1 = cluster.nodes[0]
    n1.stubs.create("paused", replicas=2, requested_partitions=2)
    wait_until(lambda: len(_queue_placement(n1).in_sync) == 2, 20)
    first = _queue_placement(n1)
    source = by_id[first.primary]
    other = by_id[next(n for n in first.replicas if n != first.primary)]
    target = next(n for n in by_id if n not in first.replicas)
    payloads = [b"item-%06d" % i + b"." * 50 for i in range(items)]
    for start in range(0, len(payloads), 1000):
        source.stubs.produce("paused", payloads[start : start + 1000])
    return other, target, payloads


@pytest.mark.timeout(120)
def test_a_move_given_up_while_etcd_is_down_is_finished_once_etcd_is_back(tmp_path: Path) -> None:
    """The call running a move (on the queue's other copy) reaches its deadline while etcd
    is down (kill -9, started again 2 s later), so the node cannot say at once that it
    gave the move up; it says so once etcd is back (it tries again every 0.5 s), and the
    primary finishes the move then, rather than at the move's own time (the call's
    deadline + 15 s)."""
    with Cluster(str(tmp_path), size=3, ttl=3) as cluster:
        by_id = {n.node_id: n for n in cluster.nodes}
        other, target, payloads = _two_copies_filled(cluster, 20_000)

        answer: list[object] = []

        def move() -> None:
            stub = cluster_pb2_grpc.ClusterServiceStub(other.channel)
            try:
                answer.append(stub.MoveQueue(cluster_pb2.MoveQueueRequest(queue_name="paused", node_id=target), timeout=2.0))
            except grpc.RpcError as exc:
                answer.append(exc)

        mover = threading.Thread(target=move, daemon=True)
        mover.start()
        deadline = time.monotonic() + 10
        record = shard_of(cluster, "paused")
        while target not in record["replicas"] and time.monotonic() < deadline:
            time.sleep(0.005)
            record = shard_of(cluster, "paused")
        cluster.etcd.kill9()
        down = time.monotonic()
        try:
            assert target in record["replicas"] and record["move"]["by"] == other.node_id, record
            assert target not in [n for n, i in record["isr"] if i], record
            mover.join(10)
            assert answer and isinstance(answer[0], grpc.RpcError), answer  # its deadline, while etcd is down
            time.sleep(max(0.0, down + 2.0 - time.monotonic()))
        finally:
            cluster.etcd.start()
        back = time.monotonic()

        deadline = time.monotonic() + 10  # well before the move's own time runs out
        record = shard_of(cluster, "paused")
        while not _settled(record, {other.node_id, target}) and time.monotonic() < deadline:
            time.sleep(0.05)
            record = shard_of(cluster, "paused")
        took = time.monotonic() - back
        assert _settled(record, {other.node_id, target}) and record["primary"] == target, record
        print(f"finished {took:.2f} s after etcd was back")
        got: list[bytes] = []
        deadline = time.monotonic() + 60
        while len(got) < len(payloads) and time.monotonic() < deadline:
            got += [i.payload for i in by_id[target].stubs.lease("paused", 1000, timeout=10, request_timeout=dur(0.3)).items]
        assert len(got) == len(set(got)) == len(payloads) and set(got) == set(payloads)


@pytest.mark.timeout(120)
def test_a_move_whose_client_goes_away_is_finished_by_the_primary(tmp_path: Path) -> None:
    """The client of a move (run by the queue's other copy) cancels its call while the new
    copy catches up: the node lets the move go at once, and the primary finishes it."""
    with Cluster(str(tmp_path), size=3, ttl=TTL, env={"QUERATOR_LOG_LEVEL": "info"}) as cluster:
        by_id = {n.node_id: n for n in cluster.nodes}
        other, target, payloads = _two_copies_filled(cluster, 30_000)

        stub = cluster_pb2_grpc.ClusterServiceStub(other.channel)
        call = stub.MoveQueue.future(cluster_pb2.MoveQueueRequest(queue_name="paused", node_id=target), timeout=30)
        deadline = time.monotonic() + 10
        record = shard_of(cluster, "paused")
        while target not in record["replicas"] and time.monotonic() < deadline:
            time.sleep(0.005)
            record = shard_of(cluster, "paused")
        call.cancel()  # the client goes away
        assert target in record["replicas"] and record["move"]["by"] == other.node_id, record

        deadline = time.monotonic() + 20
        while not _settled(record, {other.node_id, target}) and time.monotonic() < deadline:
            time.sleep(0.05)
            record = shard_of(cluster, "paused")
        assert _settled(record, {other.node_id, target}) and record["primary"] == target, record
        # Its node let the move go (it finishes it itself only in the rare case of the
        # cancellation arriving as its step completes, which asyncio may then not raise).
        let_go = [e["target"] for e in events(other, "cluster_move_let_go")]
        assert let_go in ([target], []), let_go
        got: list[bytes] = []
        deadline = time.monotonic() + 60
        while len(got) < len(payloads) and time.monotonic() < deadline:
            got += [i.payload for i in by_id[target].stubs.lease("paused", 1000, timeout=10, request_timeout=dur(0.3)).items]
        assert len(got) == len(set(got)) == len(payloads) and set(got) == set(payloads)
