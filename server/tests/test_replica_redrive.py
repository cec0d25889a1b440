"""RedriveItems from a replicated dead-letter queue whose sources' primaries are on
other nodes, with real etcd and node processes: each dead letter goes back to its
source's primary (one hop), once, and the call answers once they are stored there.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from cluster_helpers import Cluster
from replication_helpers import claimed, dead_letter, lease_back, move_primary, placement, redrive, total

from conftest import wait_until

TTL = 2
DLQ = "redriven-dead-letters"
SOURCE = "redriven-source"
ITEMS = 30


@pytest.mark.timeout(120)
def test_a_replicated_dead_letter_queue_redrives_to_a_source_whose_primary_is_on_another_node(tmp_path: Path) -> None:
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        n1 = cluster.nodes[0]
        n1.stubs.create(DLQ, replicas=2)
        n1.stubs.create(SOURCE, replicas=2, requested_partitions=2, dead_queue=DLQ)
        wait_until(lambda: claimed(cluster, DLQ) and claimed(cluster, SOURCE), 15)
        dlq, source = placement(n1, DLQ), placement(n1, SOURCE)
        # The dead-letter queue's primary on a node holding no copy of the source: the
        # redrive can reach the source only through another node.
        if dlq.primary in source.replicas:
            move_primary(cluster, DLQ, next(n for n in dlq.replicas if n not in source.replicas))
        dlq = placement(n1, DLQ)
        assert dlq.primary not in source.replicas, (dlq, source)

        payloads = [f"item-{i}".encode() for i in range(ITEMS)]
        n1.stubs.produce(SOURCE, payloads)
        assert dead_letter(n1, SOURCE, ITEMS) == Counter(payloads)
        wait_until(lambda: total(n1, DLQ) == ITEMS and total(n1, SOURCE) == 0, 15)

        by_id = {n.node_id: n for n in cluster.nodes}
        via = by_id[next(n for n in by_id if n != dlq.primary)]  # the call is forwarded to the primary too
        moved, skipped = redrive(via, DLQ, max_items=ITEMS)
        assert skipped == 0 and len(moved) == ITEMS, f"moved {len(moved)}, skipped {skipped}"
        assert len(set(moved)) == ITEMS
        assert total(n1, DLQ) == 0
        assert total(n1, SOURCE) == ITEMS

        back = lease_back(n1, SOURCE, ITEMS)
        assert back == Counter(payloads)
