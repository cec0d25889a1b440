"""Case 6 of replication: network faults between the processes of one machine, with
real etcd, real node processes and loopback proxies on every node-to-node and
node-to-etcd connection (network_chaos.py).

For about 20 s under the audit's recorded load, one node's links at a time are cut,
blackholed, broken one way or delayed (etcd only, peers only, or both; the primary more
often than not), on and off. Then every link is restored, the copies come back in sync
and the queue is drained: the history checker finds nothing lost, nothing delivered
after its Complete, nothing resurrected; at most one epoch's primary acknowledged at a
time (every acknowledged cycle is logged by the node that answered it, with its epoch);
the in-sync copies' digests are equal. bench/replication_network.py runs it longer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from failover_helpers import QUEUE, Run, create_queue, digests, events, in_sync, stop_quietly, wait_in_sync, wait_primary
from network_chaos import Flaps, Network, apply, epochs, gaps, overlaps

TTL = 2
FLAP_S = float(os.environ.get("QUERATOR_FLAP_SECONDS", "20"))
SEED = int(os.environ.get("QUERATOR_FLAP_SEED", "1"))


def flap_run(root: str, seconds: float, seed: int, replicas: int = 3) -> dict[str, object]:
    """One cluster, ``seconds`` of flapping under load; asserts the checks, returns the figures."""
    with Network(root, ttl=TTL) as network:
        cluster = network.cluster
        first = cluster.nodes[0]
        create_queue(first, replicas)
        wait_primary(cluster, first)
        wait_in_sync(cluster, first, replicas)
        run = Run(cluster)
        run.start()
        time.sleep(2)
        started = time.monotonic()
        with Flaps(network, seconds, seed=seed) as flaps:
            while time.monotonic() < started + seconds + 1 and flaps._thread is not None and flaps._thread.is_alive():
                time.sleep(0.5)
        network.restore()
        primary, _ = wait_primary(cluster, first, timeout=60)
        observer = next(n for n in cluster.nodes if n.node_id == primary)
        wait_in_sync(cluster, observer, replicas, timeout=60)
        verdict = run.finish(drain_s=60)
        assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10])) + "\n" + "\n".join(flaps.log)
        time.sleep(1)  # the drain's last changes reach every copy
        members = in_sync(cluster, observer)
        found = epochs(cluster.nodes)
        bad = overlaps(found)
        assert not bad, "\n".join(bad) + "\n" + "\n".join(flaps.log)
        stop_quietly(cluster.nodes)
        copies = {n: digests(next(x for x in cluster.nodes if x.node_id == n)) for n in members}
        assert len(members) == replicas, members
        assert len({str(d["digest"]) for d in copies.values()}) == 1, copies
        between = gaps(found)
        return {
            "faults": len(flaps.log),
            "fault_kinds": dict(sorted(flaps.counts.items())),
            "epochs": [(e.epoch, sorted(e.nodes), e.cycles, e.answers) for e in found],
            "acknowledged_cycles": sum(e.cycles for e in found),
            "acknowledged_produces": run.acknowledged_since(0),
            "smallest_gap_s": round(min(between), 3) if between else None,
            "gaps_s": [round(g, 3) for g in between],
            "verdict": verdict.figures(),
            "log": flaps.log,
        }


@pytest.mark.timeout(240)
def test_flapping_network_faults_lose_nothing_and_one_epochs_primary_acknowledges_at_a_time(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    figures = flap_run(str(tmp_path), FLAP_S, SEED)
    record_property("figures", {k: v for k, v in figures.items() if k != "log"})


def test_the_epoch_check_finds_two_epochs_acknowledging_at_once_or_one_epoch_on_two_nodes() -> None:
    from network_chaos import Epoch

    apart = [Epoch(1, {"n1"}, 10.0, 12.0, 5, 9), Epoch(2, {"n2"}, 12.5, 20.0, 7, 7)]
    assert overlaps(apart) == [] and gaps(apart) == [0.5]
    late = [Epoch(1, {"n1"}, 10.0, 12.6, 5, 9), Epoch(2, {"n2"}, 12.5, 20.0, 7, 7)]
    assert overlaps(late) == ["epoch 2 (['n2']) acknowledged from 12.500, epoch 1 (['n1']) until 12.600"]
    split = [Epoch(3, {"n1", "n3"}, 1.0, 2.0, 2, 2)]
    assert overlaps(split) == ["epoch 3 acknowledged on ['n1', 'n3']"]


@pytest.mark.timeout(180)
def test_a_primary_blackholed_past_its_ttl_acknowledges_nothing_once_the_new_primary_does(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Every link of the primary (etcd and peers) silent for 4.5 s, twice: a replica is
    elected meanwhile. When the links come back, the answers its replica sent before the
    election, held on the way, reach the old primary. Before the primary's releases were
    bounded by its membership lease, it then acknowledged those cycles 2.4-2.8 s after the
    new primary had begun to acknowledge (nothing lost: the new primary held them)."""
    with Network(str(tmp_path), ttl=TTL) as network:
        cluster = network.cluster
        first = cluster.nodes[0]
        create_queue(first, 2)
        wait_primary(cluster, first)
        wait_in_sync(cluster, first, 2)
        run = Run(cluster)
        run.start()
        time.sleep(2)
        for _ in range(2):
            primary, epoch = wait_primary(cluster, first, timeout=30)
            observer = next(n for n in cluster.nodes if n.node_id != primary)
            wait_in_sync(cluster, observer, 2)  # else no copy could take over
            apply(network.links(primary, "all"), "blackhole")
            time.sleep(4.5)
            network.restore()
            deadline = time.monotonic() + 30
            while wait_primary(cluster, observer)[1] == epoch:
                assert time.monotonic() < deadline, f"no election while {primary} was cut off"
                time.sleep(0.2)
            time.sleep(2)
        primary, _ = wait_primary(cluster, first, timeout=60)
        wait_in_sync(cluster, next(n for n in cluster.nodes if n.node_id == primary), 2, timeout=60)
        verdict = run.finish(drain_s=60)
        assert verdict.ok, verdict.figures() + "\n" + "\n".join(map(str, verdict.findings[:10]))
        found = epochs(cluster.nodes)
        assert len(found) >= 3, found
        bad = overlaps(found)
        assert not bad, "\n".join(bad)
        record_property(
            "figures", f"epochs {[(e.epoch, sorted(e.nodes), e.cycles) for e in found]}; gaps {gaps(found)}; {verdict.figures()}"
        )


def test_a_failover_election_applies_only_while_the_old_primary_holds_no_membership(tmp_path: Path) -> None:
    """The other half of the rule: a copy takes over from another node only while that
    node's member key is absent (one that registered again may be acknowledging under
    its lease); the election is refused (Deposed), the record unchanged, until it is."""
    import asyncio
    from dataclasses import dataclass

    from cluster_helpers import Etcd

    from querator_server.cluster.etcd import Etcd as EtcdClient
    from querator_server.cluster.etcd import Txn
    from querator_server.cluster.shard_cas import Deposed
    from querator_server.cluster.shard_record import ShardRecord
    from querator_server.cluster.shard_table import ShardTable

    prefix = b"/election-test/"

    @dataclass
    class Member:
        node: str
        create_revision: int

    async def run() -> None:
        client = EtcdClient([server.endpoint])
        try:
            _, revision = await client.txn(Txn().put(prefix + b"members/n2", b"{}"))
            table = ShardTable(client, prefix, Member("n2", revision))
            uid = await table.next_uid()
            await client.txn(Txn().put(table.key(uid), ShardRecord.new(uid, "q", ["n1", "n2"], 1).encode()))
            record = await table.fetch(uid)
            assert record is not None
            await client.txn(Txn().put(prefix + b"members/n1", b"{}"))  # n1 registered (again)
            with pytest.raises(Deposed, match="members/n1 exists again"):
                await table.elect(record, "n2", [("n2", "i2")], primary_gone=True)
            assert await table.fetch(uid) == record
            await client.txn(Txn().delete(prefix + b"members/n1"))  # its membership lapsed
            elected = await table.elect(record, "n2", [("n2", "i2")], primary_gone=True)
            assert (elected.epoch, elected.primary) == (2, "n2")
        finally:
            await client.close()

    server = Etcd(str(tmp_path / "etcd"))
    server.start()
    try:
        asyncio.run(run())
    finally:
        server.stop()


def _depose_through_a_failed_election(network: Network, primary: str) -> None:
    """The two replicas unable to hear each other and every link of ``primary`` silent
    for 3.1 s: its membership lapses and both replicas promise the next epoch, but their
    elections fail (the primary registers again first), and they answer it with that
    epoch once its links are back; then, once a write is taken, every link restored."""
    cluster = network.cluster
    node = next(n for n in cluster.nodes if n.node_id == primary)
    node.stubs.produce(QUEUE, [b"before"])
    time.sleep(1.5)  # every copy claimed its entry in the in-sync set
    a, b = [n.node_id for n in cluster.nodes if n.node_id != primary]
    network.proxies[(a, b)].blackhole()
    network.proxies[(b, a)].blackhole()
    apply(network.links(primary, "all"), "blackhole")
    time.sleep(3.1)
    for key, proxy in network.proxies.items():
        if key not in ((a, b), (b, a)):
            proxy.restore()
    restored = time.monotonic()
    while True:
        try:
            cluster.nodes[0].stubs.produce(QUEUE, [b"after"])
            break
        except grpc.RpcError as exc:
            assert time.monotonic() < restored + 20, f"no write taken 20 s after the links came back: {exc.details()}"
            time.sleep(0.2)
    network.restore()


@pytest.mark.timeout(120)
def test_a_primary_back_before_the_election_that_fenced_its_replicas_completed_elects_itself(tmp_path: Path) -> None:
    """R = 3, the two replicas unable to hear each other (so each candidate waits out its
    gathering) and every link of the primary silent for 3.1 s: its membership lapses,
    both replicas promise epoch 2 and try to take over, but the primary registers again
    before their elections' transactions, which then fail (the old primary is back).
    Its replicas now refuse epoch 1: the primary must promise epoch 2 too and run the
    election itself. Before it did, it was promoted and deposed again thousands of times
    and the queue took no write.

    Deposed, it stays deposed under epoch 1. Its own refollow once ran before its copy
    promised epoch 2, found the record still naming it at epoch 1 and promoted it again
    (a change then stored on it alone, refused by the replicas: a call answered
    UNAVAILABLE and a copy the next primary must rebuild), or the promotion was refused
    half-way ("shard_promote_failed", at error level, also on SIGTERM hand-overs). And
    while the record still named it, the catalog's reconcile looked for its serving copy
    to give the catalog's settings, found none, and logged cluster_reconcile_failed."""
    with Network(str(tmp_path), ttl=TTL) as network:
        cluster = network.cluster
        first = cluster.nodes[0]
        create_queue(first, 3)
        primary, epoch = wait_primary(cluster, first)
        wait_in_sync(cluster, first, 3)
        node = next(n for n in cluster.nodes if n.node_id == primary)
        _depose_through_a_failed_election(network, primary)
        now, new_epoch = wait_primary(cluster, first)
        assert new_epoch > epoch, (now, new_epoch)
        deposed = events(node, "shard_deposed")
        assert len(deposed) < 20, f"{len(deposed)} times deposed: {deposed[:3]}"
        assert [e for e in deposed if e.get("epoch") == epoch], "the primary was never deposed: the case did not happen"
        promoted = [e for e in events(node, "shard_promoted") if e.get("epoch") == epoch]
        assert len(promoted) == 1, f"promoted {len(promoted)} times under epoch {epoch}: {promoted}"
        assert not events(node, "shard_promote_failed"), events(node, "shard_promote_failed")
        assert not events(node, "cluster_reconcile_failed"), events(node, "cluster_reconcile_failed")
