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

import pytest
from failover_helpers import Run, create_queue, digests, in_sync, wait_in_sync, wait_primary
from network_chaos import Flaps, Network, epochs, gaps, overlaps

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
        for node in cluster.nodes:
            node.stop()
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
