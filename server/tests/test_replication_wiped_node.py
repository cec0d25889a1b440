"""Case 4 of replication: a node's whole data directory wiped and the node restarted
under its id, with real etcd and real node processes (cluster_helpers.py).

When every copy the id held has another in-sync copy, the node starts: it is bound to
the new data directory, its copies come up empty under new incarnations, the queue it
was primary of is handed to an in-sync copy, and it is rebuilt by snapshot. Until then
no shard record names it primary under a new epoch nor lists its new copy in sync
(the records are read from etcd every 50 ms meanwhile). Then the other copy's node is
killed: the rebuilt copy takes over, and the audit's checker finds nothing lost.
When an id holds a one-copy partition, or a queue's only in-sync copy, the empty start
is refused, naming what would be lost.
"""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from aetcd import rpc  # type: ignore[import-untyped]
from cluster_helpers import Cluster, Node
from failover_helpers import QUEUE, Run, create_queue, digests, events, placement, stop_quietly, wait_in_sync, wait_primary

from querator.v1 import queues_pb2

TTL = 2
GAP_BOUND_S = TTL + 3
RING = 50  # --replica-ring: an empty copy lacks more than this after a few seconds of load


def _node(cluster: Cluster, node_id: str) -> Node:
    return next(n for n in cluster.nodes if n.node_id == node_id)


def _records(cluster: Cluster) -> dict[str, dict[str, object]]:
    """Every shard record in etcd, by queue."""
    prefix = f"/{cluster.prefix}/shards/".encode()
    with cluster.etcd.channel() as channel:
        reply = rpc.KVStub(channel).Range(rpc.RangeRequest(key=prefix, range_end=prefix[:-1] + b"0"), timeout=5)
    found = {}
    for kv in reply.kvs:
        doc = json.loads(kv.value)
        found[doc["queue"]] = doc
    return found


@dataclass
class Watch:
    """The queue's shard record, read from etcd every 50 ms on a thread."""

    cluster: Cluster
    seen: list[tuple[float, int, str, dict[str, str]]] = field(default_factory=list)  # (when, epoch, primary, isr)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Watch:
        def run() -> None:
            while not self.stop.is_set():
                try:
                    doc = _records(self.cluster)[QUEUE]
                    isr = {str(n): str(i) for n, i in doc["isr"]}  # type: ignore[attr-defined]
                    self.seen.append((time.monotonic(), int(doc["epoch"]), str(doc["primary"]), isr))  # type: ignore[call-overload]
                except (grpc.RpcError, KeyError):
                    pass
                self.stop.wait(0.05)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(10)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("replicas", [2, 3])
def test_a_wiped_node_restarted_under_its_id_is_rebuilt_never_elected_before_then_its_other_copy_dies_losing_nothing(
    tmp_path: Path, replicas: int, record_property: Callable[[str, object], None]
) -> None:
    with Cluster(
        str(tmp_path), size=3, ttl=TTL, env={"QUERATOR_LOG_LEVEL": "info"}, args=["--replica-ring", str(RING)]
    ) as cluster:
        create_queue(cluster.nodes[0], replicas)
        primary_id, epoch = wait_primary(cluster, cluster.nodes[0])
        wait_in_sync(cluster, cluster.nodes[0], replicas)
        run = Run(cluster)
        run.start()
        # 3 s, then on until the calls checked below (and more changes than the ring
        # keeps, so the empty copy needs a snapshot) were acknowledged: 3 s alone answered
        # 7 on a loaded machine.
        run.load_for(3.0, calls=RING + 10, bound=40.0)
        assert run.acknowledged_since(0) > 20, "no load before the fault"
        # The primary's node loses its whole data directory: the hardest case, its queue
        # must be handed over before anything else. With R = 2 the other copy is paused
        # across the restart, so that the record still names the wiped node primary when
        # it starts (no failover by the others meanwhile): the node itself must hand over.
        victim = _node(cluster, primary_id)
        others = [n for n in cluster.nodes if n.node_id != primary_id]
        old_incarnation = _records(cluster)[QUEUE]["isr"]
        watch = Watch(cluster).start()
        paused = [n for n in others if n.node_id in _records(cluster)[QUEUE]["replicas"]] if replicas == 2 else []  # type: ignore[operator]
        for node in paused:
            node.signal(signal.SIGSTOP)
        victim.kill9()
        killed = time.monotonic()
        shutil.rmtree(victim.data_dir)
        try:
            victim.start()
        finally:
            for node in paused:
                node.signal(signal.SIGCONT)
        rebound = events(victim, "cluster_node_rebound")
        assert rebound, victim.stderr_text()
        if paused:
            assert rebound[0]["primary_of"] == [QUEUE], rebound
        # Rebuilt: the primary sent the empty copy a snapshot (its ring of recent changes
        # is kept small here: the copy lacks more), which came with another new
        # incarnation, and then added that copy to the in-sync set.
        old = {str(i) for n, i in old_incarnation if n == victim.node_id}  # type: ignore[attr-defined]
        deadline = time.monotonic() + 40
        rebuilt = None
        while rebuilt in old | {None}:
            assert time.monotonic() < deadline, f"not rebuilt within 40 s: {_records(cluster)}\n{victim.stderr_text()}"
            time.sleep(0.1)
            rebuilt = {str(n): str(i) for n, i in _records(cluster)[QUEUE]["isr"]}.get(victim.node_id)  # type: ignore[attr-defined]
        rebuilt_at = time.monotonic()
        watch.finish()
        opened = [str(e["incarnation"]) for e in events(victim, "shard_copy_opened")]
        installed = [str(e["incarnation"]) for e in events(victim, "replica_snapshot_installed")]
        assert opened and installed and rebuilt == installed[-1], (opened, installed, rebuilt, victim.stderr_text())
        serving, _ = wait_primary(cluster, victim)
        syncs = [
            (e["path"], e["position"]) for e in events(_node(cluster, serving), "replica_sync") if e["node"] == victim.node_id
        ]
        assert syncs and syncs[-1][0] == "snapshot", syncs
        # Before its rebuild: never primary under an epoch after the kill, and never in
        # sync but with the rebuilt copy (its empty copy never).
        after_kill = [s for s in watch.seen if s[0] >= killed]
        assert after_kill, watch.seen
        assert all(p != victim.node_id or e == epoch for _, e, p, _isr in after_kill), after_kill
        incarnations = {isr.get(victim.node_id) for _, _, _, isr in after_kill}
        assert incarnations <= old | {None, rebuilt}, (incarnations, old, rebuilt, opened)
        assert not set(opened) & incarnations, (opened, incarnations)
        assert not events(victim, "shard_promoted"), "the wiped node served before it was rebuilt"
        handed = [s for s in after_kill if s[2] != victim.node_id]
        assert handed and handed[0][1] == epoch + 1, after_kill[:5]
        by_itself = [e for e in events(victim, "shard_failover") if e["old_primary"] == victim.node_id]
        if paused:  # handed over by the wiped node, to the copy it could not be
            assert by_itself and by_itself[0]["primary"] == paused[0].node_id, victim.stderr_text()

        # Then the other copy's node dies (R = 2: the only other one; R = 3: the primary).
        assert serving != victim.node_id
        _node(cluster, serving).kill9()
        new_primary, _ = wait_primary(cluster, victim, not_on=serving, timeout=GAP_BOUND_S + 10)
        if replicas == 2:
            assert new_primary == victim.node_id
        time.sleep(2)
        _node(cluster, serving).start()
        wait_in_sync(cluster, victim, replicas)
        verdict = run.finish()
        assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10]))
        time.sleep(1)
        members = list(next(q for q in victim.info().queues if q.queue_name == QUEUE).in_sync)
        stop_quietly(cluster.nodes)
        found = {n: digests(_node(cluster, n)) for n in members}
        assert len({str(d["digest"]) for d in found.values()}) == 1, found
        record_property(
            "figures",
            f"R={replicas}: {victim.node_id} (primary) wiped and restarted; handed over at epoch {epoch + 1} "
            f"({'by itself' if by_itself else 'by a failover of the others'}); "
            f"rebuilt ({syncs[-1][0]}) {rebuilt_at - killed:.1f} s after the kill; then {serving} killed, {new_primary} took over; "
            f"{verdict.figures()}; digests {found}",
        )


def _refused(node: Node, timeout: float = 60) -> str:
    with pytest.raises(AssertionError, match=r"exited with [1-9]") as failed:
        node.start(timeout)
    return str(failed.value)


@pytest.mark.timeout(120)
def test_an_empty_data_dir_is_refused_when_it_would_lose_a_one_copy_partition_or_a_queues_only_in_sync_copy(
    tmp_path: Path,
) -> None:
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        n1 = cluster.nodes[0]
        create_queue(n1, 2)  # "audit": R = 2
        primary_id, _ = wait_primary(cluster, n1)
        wait_in_sync(cluster, n1, 2)
        primary = _node(cluster, primary_id)
        found = placement(primary)
        assert found is not None
        replica = _node(cluster, next(n for n in found.replicas if n != primary_id))
        # A one-copy queue with a partition on every node.
        n1.stubs.queues.CreateQueue(
            queues_pb2.CreateQueueRequest(
                queue=queues_pb2.QueueInfo(queue_name="single", lease_timeout={"seconds": 5}, requested_partitions=3)
            ),
            timeout=20,
        )
        primary.stubs.produce(QUEUE, [b"before"])
        # The replica dies and is dropped from the in-sync set: the primary's copy is the only one in sync.
        replica.kill9()
        primary.stubs.produce(QUEUE, [b"alone"])
        deadline = time.monotonic() + 20
        while _records(cluster)[QUEUE]["isr"] != [[primary_id, _records(cluster)[QUEUE]["isr"][0][1]]]:  # type: ignore[index]
            assert time.monotonic() < deadline, _records(cluster)
            time.sleep(0.1)
        primary.kill9()
        empty = Node(primary_id, str(tmp_path / "empty"), cluster.url, TTL)
        try:
            message = _refused(empty)
        finally:
            empty.stop()
        assert f"node id {primary_id!r} is bound to data directory" in message, message
        assert "partition(s) of queue 'single' (one copy, kept on this node only)" in message, message
        assert f"queue {QUEUE!r} (its only in-sync copy is this node's)" in message, message
        # Nothing was changed: the node's own data directory still starts and serves it all.
        primary.start()
        replica.start()
        wait_in_sync(cluster, primary, 2)
        payloads: list[bytes] = []
        for _ in range(10):  # a Lease answers from one partition
            payloads += [i.payload for i in primary.stubs.lease(QUEUE, batch_size=10, timeout=5).items]
            if len(payloads) >= 2:
                break
        assert sorted(payloads) == [b"alone", b"before"]
