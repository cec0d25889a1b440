"""A primary told by a replica that a later epoch began (an election under way) is
deposed, and stays deposed under its old epoch: real etcd, three node processes and
loopback proxies on every link (network_chaos.py)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from failover_helpers import QUEUE, create_queue, events, wait_in_sync, wait_primary
from network_chaos import Network, apply

TTL = 2


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
def test_a_primary_deposed_by_a_replicas_later_epoch_is_never_promoted_again_under_its_old_one(tmp_path: Path) -> None:
    """R = 3, the two replicas unable to hear each other and every link of the primary
    silent for 3.1 s: its membership lapses and both replicas promise epoch 2, but their
    elections fail (the primary registers again first). The primary's replicas then
    answer it that epoch 2 began: it is deposed, and must not serve epoch 1 again.

    It did, every time: the deposed primary's own refollow ran before its copy promised
    epoch 2, found the record still naming it at epoch 1 and promoted it again (a
    change then stored on it alone, refused by the replicas: a call answered
    UNAVAILABLE and a copy that the next primary must rebuild), or the promotion was
    refused half-way ("shard_promote_failed", at error level, on SIGTERM hand-overs)."""
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
        deposed = [e for e in events(node, "shard_deposed") if e.get("epoch") == epoch]
        assert deposed, "the primary was never deposed: the case did not happen"
        promoted = [e for e in events(node, "shard_promoted") if e.get("epoch") == epoch]
        assert len(promoted) == 1, f"promoted {len(promoted)} times under epoch {epoch}: {promoted}"
        assert not events(node, "shard_promote_failed"), events(node, "shard_promote_failed")


@pytest.mark.timeout(120)
def test_a_record_naming_a_node_that_does_not_serve_the_queue_logs_no_reconcile_error(tmp_path: Path) -> None:
    """The same case: while the record still names the deposed primary, the catalog's
    reconcile on it went on to give the serving copy the catalog's settings, found
    none serving, and logged cluster_reconcile_failed at error level."""
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
        assert [e for e in events(node, "shard_deposed") if e.get("epoch") == epoch], "the case did not happen"
        assert not events(node, "cluster_reconcile_failed"), events(node, "cluster_reconcile_failed")
