"""Replicated queues under node faults, with real etcd and real node processes: the
primary killed (kill -9) or paused past its TTL under load, and what the audit's
checker (bench/history.py) says of every call made meanwhile: nothing acknowledged lost,
nothing delivered after its Complete was acknowledged, nothing unexpected. After each
case the nodes are stopped and the in-sync copies' digests compared.

Each case is one cluster of three nodes (TTL 2 s), bounded in time; the failover gap
(the fault to the first acknowledged Produce sent after it) is recorded as a property.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Cluster, Node
from failover_helpers import (
    QUEUE,
    Run,
    create_queue,
    digests,
    errors_logged,
    events,
    in_sync,
    placement,
    stop_quietly,
    wait_in_sync,
    wait_primary,
)

from history import Verdict
from querator.v1 import queue_pb2

TTL = 2
# The bound: the shard serves again within the TTL + 3 s of the primary's lapse.
GAP_BOUND_S = TTL + 3


def _node(cluster: Cluster, node_id: str) -> Node:
    return next(n for n in cluster.nodes if n.node_id == node_id)


def _primary_and_replica(cluster: Cluster, primary_id: str) -> tuple[Node, Node]:
    """The primary's node, and another node holding a copy of the queue."""
    primary = _node(cluster, primary_id)
    found = placement(primary)
    assert found is not None
    return primary, _node(cluster, next(n for n in found.replicas if n != primary_id))


def _two_copies_in_sync(cluster: Cluster) -> tuple[Node, Node]:
    """The queue created with two copies, both in sync: its primary's node and its replica's."""
    create_queue(cluster.nodes[0], 2)
    primary_id, _ = wait_primary(cluster, cluster.nodes[0])
    primary, replica = _primary_and_replica(cluster, primary_id)
    wait_in_sync(cluster, primary, 2)
    return primary, replica


def _fail_over_to(cluster: Cluster, run: Run, replica: Node, primary: Node) -> Verdict:
    """``primary`` killed: ``replica`` takes over; the old primary restarted and back in
    sync; the run's history then checked, and found good."""
    primary.kill9()
    wait_primary(cluster, replica, not_on=primary.node_id, timeout=GAP_BOUND_S + 10)
    time.sleep(2)
    primary.start()
    wait_in_sync(cluster, replica, 2)
    verdict = run.finish()
    assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10]))
    return verdict


def _other(cluster: Cluster, *not_these: str) -> Node:
    return next(n for n in cluster.nodes if n.node_id not in not_these)


def _check_digests(cluster: Cluster, observer: Node) -> dict[str, object]:
    """Stop every node; the copies in the in-sync set must have equal digests."""
    time.sleep(1)  # the last acks: the primary's links ship the drain's changes
    members = in_sync(cluster, observer)
    stop_quietly(cluster.nodes)
    found = {n: digests(_node(cluster, n)) for n in members}
    assert len({str(d["digest"]) for d in found.values()}) == 1, found
    assert len({str(d["position"]) for d in found.values()}) == 1, found
    return {n: d["digest"] for n, d in found.items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("replicas", [2, 3])
def test_kill_9_of_the_primary_under_load_loses_nothing_and_the_queue_serves_again_within_the_ttl_and_3_s(
    tmp_path: Path, replicas: int, record_property: Callable[[str, object], None]
) -> None:
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        create_queue(cluster.nodes[0], replicas)
        primary, epoch = wait_primary(cluster, cluster.nodes[0])
        run = Run(cluster)
        run.start()
        run.load_for()
        assert run.acknowledged_since(0) > 20, "no load before the fault"
        victim = _node(cluster, primary)
        victim.kill9()
        killed_at = time.monotonic()
        observer = _other(cluster, primary)
        new_primary, new_epoch = wait_primary(cluster, observer, not_on=primary, timeout=GAP_BOUND_S + 10)
        assert new_epoch == epoch + 1
        run.load_for()  # the new primary under load
        gap = run.gap_after(killed_at)
        record_property("failover_gap_s", round(gap, 3))
        victim.start()  # back as a replica: caught up by the new primary (its copy diverged: a snapshot)
        rejoined = wait_in_sync(cluster, observer, replicas)
        verdict = run.finish()
        assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10]))
        assert verdict.acknowledged > 100, verdict.figures()
        assert gap <= GAP_BOUND_S, f"served again {gap:.2f} s after the kill"
        found = _check_digests(cluster, observer)
        record_property(
            "figures",
            f"R={replicas}: failover gap {gap:.2f} s (kill -9 to the first acknowledged Produce); the old primary back in sync {rejoined:.1f} s after its restart; {verdict.figures()}; in-sync digests {found}",
        )


@pytest.mark.timeout(180)
def test_a_primary_paused_past_its_ttl_acknowledges_nothing_under_its_old_epoch_once_another_was_elected(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        create_queue(cluster.nodes[0], 2)
        primary, epoch = wait_primary(cluster, cluster.nodes[0])
        run = Run(cluster)
        run.start()
        run.load_for()
        victim = _node(cluster, primary)
        victim.signal(signal.SIGSTOP)
        paused_at = time.monotonic()
        # Calls that reach it while it is paused, with deadlines long enough to be answered
        # after it resumes: none may be acknowledged unless its item survives.
        run.produce_to(victim, 5, timeout=30)
        observer = _other(cluster, primary)
        new_primary, new_epoch = wait_primary(cluster, observer, not_on=primary, timeout=GAP_BOUND_S + 10)
        elected_at = time.monotonic()
        assert new_epoch == epoch + 1
        time.sleep(1)
        victim.signal(signal.SIGCONT)  # its waiting calls, and those sent to it, must not be acknowledged
        rejoined = wait_in_sync(cluster, observer, 2)
        gap = run.gap_after(paused_at)
        record_property("failover_gap_s", round(gap, 3))
        verdict = run.finish()
        assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10]))
        # No call the paused primary answered OK after the election was served under its epoch:
        # every OK answer after the election is in the history the checker found clean, and the
        # old primary serves nothing now (it is a replica of the new epoch).
        assert wait_primary(cluster, victim)[0] == new_primary
        assert elected_at - paused_at <= GAP_BOUND_S + 1
        assert not errors_logged(victim), errors_logged(victim)  # deposed: a warning, not a fault
        found = _check_digests(cluster, observer)
        record_property(
            "figures",
            f"SIGSTOP: failover gap {gap:.2f} s; the old primary back in sync {rejoined:.1f} s after SIGCONT; {verdict.figures()}; in-sync digests {found}",
        )


RING = 300  # --replica-ring: small, so a replica away under load needs a snapshot
LAG_S = 2.0  # --replica-lag's default


def _syncs(primary: Node, replica: str) -> list[tuple[str, int]]:
    """The primary's catch-up decisions for ``replica``: (path, change sets it lacked)."""
    out = []
    for e in events(primary, "replica_sync"):
        if e.get("node") == replica:
            lacked = int(e["primary_position"][1]) - int(e["position"][1])  # type: ignore[index]
            out.append((str(e["path"]), lacked))
    return out


@pytest.mark.timeout(180)
def test_a_replica_killed_stalls_writes_at_most_the_lag_and_catches_up_by_tail_or_snapshot_then_the_primary_dies_losing_nothing(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    with Cluster(
        str(tmp_path), size=3, ttl=TTL, env={"QUERATOR_LOG_LEVEL": "info"}, args=["--replica-ring", str(RING)]
    ) as cluster:
        primary, replica = _two_copies_in_sync(cluster)
        run = Run(cluster)

        # Tail: the replica killed and restarted at once; a few writes meanwhile.
        replica.kill9()
        killed = time.monotonic()
        for thread in run.produce_to(primary, 40, timeout=20):
            thread.join(30)
        replica.start()
        wait_in_sync(cluster, primary, 2)
        tail_stall = run.slowest_produce_since(killed)

        # Snapshot: killed under load, away well past the ring.
        run.start()
        time.sleep(2)
        replica.kill9()
        killed = time.monotonic()
        time.sleep(6)
        replica.start()
        rejoined = wait_in_sync(cluster, primary, 2)
        load_stall = run.slowest_produce_since(killed)

        syncs = _syncs(primary, replica.node_id)
        tails = [lacked for path, lacked in syncs if path == "tail"]
        snapshots = [lacked for path, lacked in syncs if path == "snapshot"]
        assert tails and snapshots, syncs
        assert all(lacked <= RING for lacked in tails), syncs
        assert max(snapshots) > RING, syncs

        # Then the primary dies: the replica, back in sync, takes over with everything.
        verdict = _fail_over_to(cluster, run, replica, primary)
        # Writes waited for the dead replica at most the lag (and the CAS that drops it).
        assert tail_stall <= LAG_S + 2.5 and load_stall <= LAG_S + 2.5, (tail_stall, load_stall)
        digests_found = _check_digests(cluster, replica)
        record_property(
            "figures",
            f"replica killed: writes waited {tail_stall:.2f} s (idle, tail) and {load_stall:.2f} s (under load, then "
            f"snapshot); back in sync {rejoined:.1f} s after restart; catch-ups {syncs}; {verdict.figures()}; "
            f"digests {digests_found}",
        )


@pytest.mark.timeout(180)
def test_a_rapid_double_failover_loses_nothing_and_leaves_the_copies_equal(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """KIP-279's case: the first primary killed, the one elected killed right after its
    election, the first restarted: the third copy takes over with everything."""
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        create_queue(cluster.nodes[0], 3)
        first, epoch = wait_primary(cluster, cluster.nodes[0])
        wait_in_sync(cluster, cluster.nodes[0], 3)
        run = Run(cluster)
        run.start()
        run.load_for()
        _node(cluster, first).kill9()
        killed = time.monotonic()
        second, second_epoch = wait_primary(cluster, _other(cluster, first), not_on=first, timeout=GAP_BOUND_S + 10)
        _node(cluster, second).kill9()
        third_node = _other(cluster, first, second)
        _node(cluster, first).start()  # diverged or behind: rebuilt from whoever serves
        try:
            third, third_epoch = wait_primary(cluster, third_node, not_on=second, timeout=GAP_BOUND_S + 10)
            outcome = f"{third} took over at epoch {third_epoch}"
            assert third == third_node.node_id and third_epoch == epoch + 2, (first, second, third, third_epoch)
        except AssertionError:
            # The third copy was not in the in-sync set the second was elected with (it did
            # not answer the election in time): it must not take over; the queue waits for
            # the second, which has everything acknowledged.
            assert third_node.node_id not in in_sync(cluster, third_node), in_sync(cluster, third_node)
            outcome = f"{third_node.node_id} not in sync: the queue waited for {second}"
        _node(cluster, second).start()
        serving, _ = wait_primary(cluster, third_node, timeout=30)
        rejoined = wait_in_sync(cluster, _node(cluster, serving), 3)
        time.sleep(2)
        verdict = run.finish()
        assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10]))
        gap = run.gap_after(killed)
        found = _check_digests(cluster, _node(cluster, serving))
        assert len(found) == 3
        record_property(
            "figures",
            f"double failover {first} -> {second}, then {outcome}: first acknowledged Produce {gap:.2f} s after the first kill; "
            f"all three in sync {rejoined:.1f} s after the restarts; {verdict.figures()}; digests {found}",
        )


def _damage(node: Node, how: str) -> list[str]:
    """Truncate every LMDB file of the node's queues to half, or remove them ("wiped"),
    keeping the node's own catalog and identity."""
    import glob
    import os
    import shutil

    damaged = []
    for data in glob.glob(os.path.join(node.data_dir, "groups", "*", "data.mdb")) + glob.glob(
        os.path.join(node.data_dir, "queues", "*", "data.mdb")
    ):
        size = os.path.getsize(data)
        if how == "wiped":
            shutil.rmtree(os.path.dirname(data))
            damaged.append(f"{data} removed")
        else:
            with open(data, "r+b") as f:
                f.truncate(size // 2)
            damaged.append(f"{data} {size} -> {size // 2}")
    assert damaged, os.listdir(node.data_dir)
    return damaged


def _isr(cluster: Cluster) -> dict[str, str]:
    """The shard record's in-sync set in etcd: node -> incarnation."""
    import json

    from aetcd import rpc  # type: ignore[import-untyped]

    prefix = f"/{cluster.prefix}/shards/".encode()
    with cluster.etcd.channel() as channel:
        reply = rpc.KVStub(channel).Range(rpc.RangeRequest(key=prefix, range_end=prefix[:-1] + b"0"), timeout=5)
    (kv,) = reply.kvs
    return {node: incarnation for node, incarnation in json.loads(kv.value)["isr"]}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["truncated", "wiped"])
def test_a_replica_whose_storage_was_truncated_or_wiped_is_refused_rebuilt_and_never_in_sync_before(
    tmp_path: Path, how: str, record_property: Callable[[str, object], None]
) -> None:
    """Case 8 (a truncated data file) and case 4 (the copy's storage gone; the node's own
    catalog kept: a wholly empty data directory is refused by the node's identity check):
    the copy is dropped and made again empty under a new incarnation, stays out of the
    in-sync set until the primary rebuilt it, and then the primary dies: nothing lost."""
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        primary, replica = _two_copies_in_sync(cluster)
        run = Run(cluster)
        run.start()
        run.load_for()
        before = _isr(cluster)[replica.node_id]
        replica.kill9()
        damaged = _damage(replica, how)
        replica.start()
        restarted = time.monotonic()
        deadline = restarted + 30
        while _isr(cluster).get(replica.node_id) in (before, None) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _isr(cluster).get(replica.node_id) not in (before, None), f"not rebuilt: {_isr(cluster)}"
        rejoined = time.monotonic() - restarted
        assert events(replica, "shard_copy_rebuilt"), replica.stderr_text()
        # Then the primary dies: the rebuilt copy takes over with everything acknowledged.
        verdict = _fail_over_to(cluster, run, replica, primary)
        digests_found = _check_digests(cluster, replica)
        record_property(
            "figures",
            f"{how} {damaged}: rebuilt under a new incarnation, back in sync {rejoined:.1f} s after restart; "
            f"{verdict.figures()}; digests {digests_found}",
        )


def _renewed_since(run: Run, back: float, bound: float = 30.0) -> None:
    """Until a Produce sent a TTL after ``back`` (etcd answering again) was acknowledged:
    the primary answers only within a TTL of a renewal, so it renewed since ``back``."""
    deadline = time.monotonic() + bound
    while run.acknowledged_since(back + TTL) == 0:
        assert time.monotonic() < deadline, f"no Produce sent {TTL} s after etcd was back acknowledged within {bound} s"
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_etcd_paused_or_killed_alone_with_a_primary_kill_and_with_a_replica_kill(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Case 5: (a) etcd paused, then killed: writes go on (nothing to change in the
    in-sync set); (b) etcd killed and the primary killed: the queue waits, loses nothing,
    and fails over once etcd is back; (c) etcd killed and a replica killed: the primary
    cannot drop it from the in-sync set, so no write is acknowledged until etcd is back."""
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        create_queue(cluster.nodes[0], 2)
        primary_id, epoch = wait_primary(cluster, cluster.nodes[0])
        wait_in_sync(cluster, cluster.nodes[0], 2)
        run = Run(cluster)
        run.start()
        time.sleep(2)
        notes = []

        # (a) etcd paused for a second, then killed for a second: writes go on. A primary
        # acknowledges only while its membership surely stands: up to the TTL after its
        # last renewal, sent every TTL / 3 while etcd answers. So each fault begins once
        # the primary renewed since etcd was last back (a Produce sent a TTL after that
        # was acknowledged). Begun at once after the pause, the kill could come while the
        # last renewal was one from before the pause (the one due in it failed), leaving
        # the primary a fraction of a second to acknowledge in (none, once, under load).
        back = 0.0
        for fault in ("pause", "kill"):
            _renewed_since(run, back)
            started = time.monotonic()
            cluster.etcd.pause() if fault == "pause" else cluster.etcd.kill9()
            time.sleep(1.0)
            during = run.acknowledged_since(started)
            cluster.etcd.resume() if fault == "pause" else cluster.etcd.start()
            back = time.monotonic()
            assert during > 0, f"no write acknowledged while etcd was {fault}d"
            notes.append(f"etcd {'paused' if fault == 'pause' else 'killed'} 1 s: {during} Produces acknowledged meanwhile")
            wait_in_sync(cluster, cluster.nodes[0], 2)
            primary_id, epoch = wait_primary(cluster, cluster.nodes[0])

        # (b) etcd killed, then the primary: no failover without etcd; once it is back, one.
        cluster.etcd.kill9()
        primary = _node(cluster, primary_id)
        primary.kill9()
        time.sleep(TTL + 2)
        cluster.etcd.start()
        back = time.monotonic()
        observer = _other(cluster, primary_id)
        new_primary, new_epoch = wait_primary(cluster, observer, not_on=primary_id, timeout=GAP_BOUND_S + 15)
        assert new_epoch > epoch
        notes.append(f"etcd and primary killed: {new_primary} elected {time.monotonic() - back:.1f} s after etcd was back")
        primary.start()
        wait_in_sync(cluster, observer, 2)

        # (c) etcd killed, then the replica: nothing acknowledged without it until etcd is back.
        primary_id, epoch = wait_primary(cluster, observer)
        primary, replica = _primary_and_replica(cluster, primary_id)
        cluster.etcd.kill9()
        time.sleep(0.3)
        replica.kill9()
        killed = time.monotonic()
        time.sleep(LAG_S + 2)
        back = time.monotonic()  # from here on etcd may answer (its start returns a little later)
        cluster.etcd.start()
        early = [
            c
            for c in run.load.history.calls()
            if c.kind == "produce" and c.outcome == "ok" and c.invoked >= killed + 0.1 and c.ended < back
        ]
        assert not early, f"{len(early)} Produce calls acknowledged without the killed replica, etcd down: {early[:3]}"
        wait_primary(cluster, primary)
        time.sleep(LAG_S + 2)  # the shrink goes through now: writes go on without it
        assert run.acknowledged_since(back) > 0
        replica.start()
        wait_in_sync(cluster, primary, 2)
        verdict = run.finish()
        assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10]))
        digests_found = _check_digests(cluster, primary)
        record_property("figures", "; ".join(notes) + f"; {verdict.figures()}; digests {digests_found}")


@pytest.mark.timeout(180)
def test_sigterm_of_the_primary_hands_the_queue_over_to_a_replica_losing_nothing(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    with Cluster(str(tmp_path), size=3, ttl=TTL, env={"QUERATOR_LOG_LEVEL": "info"}) as cluster:
        create_queue(cluster.nodes[0], 2)
        primary_id, epoch = wait_primary(cluster, cluster.nodes[0])
        wait_in_sync(cluster, cluster.nodes[0], 2)
        run = Run(cluster)
        run.start()
        run.load_for()
        primary = _node(cluster, primary_id)
        observer = _other(cluster, primary_id)
        primary.signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        new_primary, new_epoch = wait_primary(cluster, observer, not_on=primary_id, timeout=GAP_BOUND_S + 10)
        elected = time.monotonic() - stopped_at
        assert primary.proc is not None
        primary.proc.wait(30)
        time.sleep(2)
        gap = run.gap_after(stopped_at)
        # Handed over by the stopping primary itself (not a failover by the replicas
        # once its lease was revoked): the most advanced copy, without a fencing round.
        handed = events(primary, "cluster_primaries_handed_over")
        assert handed and handed[0]["moved"] == ["audit"], primary.stderr_text()
        assert not errors_logged(primary), errors_logged(primary)  # a hand-over is no fault
        primary.start()
        wait_in_sync(cluster, observer, 2)
        verdict = run.finish()
        assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10]))
        assert new_epoch == epoch + 1
        # Handed over, not failed over: well before the TTL would have run out.
        assert elected < TTL, f"the new primary was elected {elected:.2f} s after SIGTERM"
        found = _check_digests(cluster, observer)
        record_property(
            "figures",
            f"SIGTERM: {new_primary} primary {elected:.2f} s after, first acknowledged Produce {gap:.2f} s after, "
            f"the slowest acknowledged Produce waited {run.slowest_produce_since(stopped_at):.2f} s; "
            f"{verdict.figures()}; digests {found}",
        )


@pytest.mark.timeout(120)
def test_below_the_minimum_in_sync_count_writes_are_refused_unavailable_and_none_is_acknowledged(tmp_path: Path) -> None:
    """R = 2 with min_in_sync 2: the replica killed, the primary may not drop it from the
    in-sync set, so it refuses writes UNAVAILABLE (at once, before storing them), answers
    reads, and acknowledges nothing until the replica is back in step. Before the
    refusal, a Produce sent then waited for the dead copy until its deadline
    (DEADLINE_EXCEEDED: its caller could not tell whether it was stored)."""
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        create_queue(cluster.nodes[0], 2, min_in_sync=2)
        primary_id, _epoch = wait_primary(cluster, cluster.nodes[0])
        wait_in_sync(cluster, cluster.nodes[0], 2)
        primary = _node(cluster, primary_id)
        found = placement(primary)
        assert found is not None and found.min_in_sync == 2
        before = [b"before-%d" % i for i in range(20)]
        primary.stubs.produce(QUEUE, before)
        replica = _node(cluster, next(n for n in found.replicas if n != primary_id))
        replica.kill9()
        killed = time.monotonic()
        codes: list[grpc.StatusCode] = []
        refused: grpc.RpcError | None = None
        while refused is None and time.monotonic() < killed + 20:
            try:
                primary.stubs.queue.Produce(
                    queue_pb2.ProduceRequest(queue_name=QUEUE, items=[queue_pb2.ProduceItem(payload=b"during")]), timeout=3
                )
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    refused = exc
        assert grpc.StatusCode.OK not in codes, f"a Produce was acknowledged with the only other copy dead: {codes}"
        assert refused is not None, f"no Produce refused UNAVAILABLE within 20 s of the kill: {codes}"
        assert "below its minimum of 2" in str(refused.details()), refused.details()
        # Refused at once from then on, and reads go on.
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as again:
            primary.stubs.produce(QUEUE, [b"again"])
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 2
        assert sum(p.total for p in primary.stubs.stats(QUEUE).partitions) >= len(before)
        replica.start()
        wait_in_sync(cluster, primary, 2)
        deadline = time.monotonic() + 20
        while True:
            try:
                primary.stubs.produce(QUEUE, [b"after"])
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
                time.sleep(0.2)
        payloads: list[bytes] = []
        while True:
            items = primary.stubs.lease(QUEUE, batch_size=100, timeout=2).items
            if not items:
                break
            payloads.extend(i.payload for i in items)
        assert sorted(p for p in payloads if p.startswith(b"before-")) == sorted(before)
        assert b"after" in payloads
