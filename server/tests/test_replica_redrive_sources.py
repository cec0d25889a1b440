"""RedriveItems from a replicated dead-letter queue, with real etcd and node processes:
where the items of one-copy sources go, and an explicit target_queue whose primary is
on another node.

A one-copy queue's item ids carry its node's own storage uid, counted from 1 on every
node: the same uid names another queue on the dead-letter queue's primary. Its dead
letters in a replicated dead-letter queue are named with their node's id, so they go
back only from that node, to their own queue, and never into the other one.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from cluster_helpers import Cluster, Node
from replication_helpers import claimed, dead_letter, lease_back, move_primary, placement, redrive, total

from conftest import wait_until

TTL = 2
DLQ = "shared-dead-letters"
SOURCE = "one-copy-source"
OTHER = "one-copy-bystander"
TARGET = "replicated-target"


def _uid(node: Node, queue: str) -> str:
    """The storage uid in the ids of ``queue``'s items (it holds one, at least)."""
    items = node.stubs.list_items(queue)
    assert items, f"{queue} holds no item"
    return items[0].id.split(".")[0]


def _payloads(node: Node, queue: str) -> Counter[bytes]:
    return Counter(i.payload for i in node.stubs.list_items(queue))


@pytest.mark.timeout(120)
def test_a_one_copy_sources_dead_letter_in_a_replicated_queue_never_goes_to_a_queue_of_the_same_local_uid(
    tmp_path: Path,
) -> None:
    with Cluster(str(tmp_path), size=2, ttl=TTL) as cluster:
        n1 = cluster.nodes[0]
        n1.stubs.create(DLQ, replicas=2)
        wait_until(lambda: claimed(cluster, DLQ), 15)
        # Two one-copy queues of one partition: the second goes to the node holding fewer.
        n1.stubs.create(SOURCE, requested_partitions=1, dead_queue=DLQ)
        n1.stubs.create(OTHER, requested_partitions=1)
        here = placement(n1, SOURCE).homes[0]
        there = placement(n1, OTHER).homes[0]
        assert here != there, "the two one-copy queues are on one node"
        move_primary(cluster, DLQ, there)  # the dead letters are held where OTHER lives

        n1.stubs.produce(OTHER, [b"bystander"])
        payloads = [f"dead-{i}".encode() for i in range(5)]
        n1.stubs.produce(SOURCE, payloads)
        # The premise: both queues' items carry the same uid (each the first one-copy
        # queue of its node).
        assert _uid(n1, SOURCE) == _uid(n1, OTHER)
        assert dead_letter(n1, SOURCE, len(payloads)) == Counter(payloads)
        wait_until(lambda: total(n1, DLQ) == len(payloads), 15)

        moved, skipped = redrive(n1, DLQ)
        # Nothing may reach OTHER: held on OTHER's node, the dead letters name SOURCE's
        # node, which alone can tell its queue of that uid; they stay.
        assert _payloads(n1, OTHER) == Counter([b"bystander"])
        assert (moved, skipped) == ([], len(payloads))
        assert _payloads(n1, DLQ) == Counter(payloads)

        # Served on SOURCE's node, the dead letters go back to SOURCE, each once.
        move_primary(cluster, DLQ, here)
        moved, skipped = redrive(n1, DLQ)
        assert (len(set(moved)), skipped) == (len(payloads), 0), (moved, skipped)
        assert _payloads(n1, SOURCE) == Counter(payloads)
        assert _payloads(n1, OTHER) == Counter([b"bystander"])
        assert total(n1, DLQ) == 0


@pytest.mark.timeout(120)
def test_redrive_to_an_explicit_target_queue_whose_primary_is_on_another_node(tmp_path: Path) -> None:
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        n1 = cluster.nodes[0]
        n1.stubs.create(DLQ, replicas=2)
        n1.stubs.create(TARGET, replicas=2)
        n1.stubs.create(SOURCE, replicas=2, dead_queue=DLQ)
        wait_until(lambda: all(claimed(cluster, q) for q in (DLQ, TARGET, SOURCE)), 15)
        # The DLQ's primary holds no copy of TARGET: it knows TARGET from the catalog
        # alone, and reaches it only through TARGET's primary.
        target = placement(n1, TARGET)
        away = [n for n in placement(n1, DLQ).replicas if n not in target.replicas]
        assert away, "the two queues' copies are on the same nodes"
        move_primary(cluster, DLQ, away[0])
        by_id = {n.node_id: n for n in cluster.nodes}
        # Taken by a node that is not the DLQ's primary: forwarded there.
        via = by_id[target.primary]

        payloads = [f"item-{i}".encode() for i in range(10)]
        n1.stubs.produce(SOURCE, payloads)
        assert dead_letter(n1, SOURCE, len(payloads)) == Counter(payloads)
        wait_until(lambda: total(n1, DLQ) == len(payloads), 15)

        moved, skipped = redrive(via, DLQ, TARGET)
        assert skipped == 0 and len(set(moved)) == len(payloads), (moved, skipped)
        assert total(n1, DLQ) == 0 and total(n1, SOURCE) == 0

        back = lease_back(n1, TARGET, len(payloads))
        assert back == Counter(payloads)
