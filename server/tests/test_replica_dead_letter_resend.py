"""A dead letter handed to a replicated dead-letter queue, then completed there, and
sent again by the source's new primary after a failover: stored once, with real etcd
and node processes.

The source's two copies run on nodes that kill themselves (kill -9, a crash point)
right after the dead-letter queue answered a hand-over, before the source recorded it:
the first primary dies with the dead letter still in its outbox, the dead letter is
leased and completed in the dead-letter queue, and the source's next primary hands
over the same outbox entry again (and dies the same way, so the resend is known to
have been answered). The dead-letter queue must recognise it though it no longer
holds the item.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Cluster, Node
from replication_helpers import claimed, placement

from querator.v1 import queue_pb2

from conftest import wait_until

TTL = 2
DLQ = "resent-dead-letters"
SOURCE = "resent-source"
CRASH_AFTER_HAND_OVER = {"QUERATOR_CRASH_AT": "dead-letter-stored"}


def _lease_all(node: Node, queue: str, for_s: float) -> list[queue_pb2.LeaseResponse]:
    """Every non-empty Lease answer of ``queue`` through ``node`` within ``for_s``."""
    got: list[queue_pb2.LeaseResponse] = []
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        try:
            leased = node.stubs.lease(queue, 10, request_timeout={"nanos": 200_000_000})
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc.details()
            time.sleep(0.05)
            continue
        if leased.items:
            got.append(leased)
    return got


@pytest.mark.timeout(120)
def test_a_dead_letter_completed_before_the_sources_new_primary_sends_it_again_is_not_stored_again(
    tmp_path: Path,
) -> None:
    with Cluster(str(tmp_path), size=2, ttl=TTL) as cluster:
        n1 = cluster.nodes[0]
        n1.stubs.create(DLQ, replicas=2)  # on n1 and n2, the only nodes yet
        wait_until(lambda: claimed(cluster, DLQ), 15)
        for name in ("n3", "n4"):
            node = Node(name, os.path.join(str(tmp_path), name), cluster.url, TTL, dict(CRASH_AFTER_HAND_OVER))
            cluster.nodes.append(node)
            node.launch()
        for node in cluster.nodes[2:]:
            node.wait_ready()
        by_id = {n.node_id: n for n in cluster.nodes}
        # A new queue's copies go to the nodes keeping the fewest copies: n3 and n4.
        n1.stubs.create(SOURCE, replicas=2, dead_queue=DLQ)
        source = placement(n1, SOURCE)
        assert set(source.replicas) == {"n3", "n4"}, source
        wait_until(lambda: claimed(cluster, SOURCE), 15)
        first = by_id[source.primary]
        heir = by_id[next(n for n in source.replicas if n != source.primary)]

        n1.stubs.produce(SOURCE, [b"letter"])
        leased = first.stubs.lease(SOURCE, 1)
        assert [i.payload for i in leased.items] == [b"letter"]
        try:
            first.stubs.queue.Retry(
                queue_pb2.RetryRequest(
                    queue_name=SOURCE, partition=leased.partition, items=[queue_pb2.RetryItem(id=leased.items[0].id, dead=True)]
                ),
                timeout=5,
            )
        except grpc.RpcError as exc:  # the answer may lose the race with the crash after the hand-over
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
        assert first.proc is not None
        # It dies once the dead-letter queue answered the hand-over, before it recorded it.
        assert first.proc.wait(15) == -9, first.stderr_text()

        got = _lease_all(n1, DLQ, 0.5)
        assert [i.payload for r in got for i in r.items] == [b"letter"], got
        n1.stubs.complete(DLQ, got[0].partition, [i.id for i in got[0].items])
        # Still before the failover: the resend below comes after the completion.
        assert placement(n1, SOURCE).primary == first.node_id

        # The next primary sends the outbox entry again, and dies once it is answered.
        assert heir.proc is not None
        assert heir.proc.wait(TTL + 20) == -9, heir.stderr_text()
        again = _lease_all(n1, DLQ, 1.5)
        assert not again, f"the dead letter was stored again: {[i.payload for r in again for i in r.items]}"
        assert sum(p.total for p in n1.stubs.stats(DLQ).partitions) == 0


def test_taken_source_ids_are_forgotten_after_their_window_and_a_later_take_is_kept(tmp_path: Path) -> None:
    import lmdb

    from querator_server.storage import accepted_sources

    env = lmdb.open(str(tmp_path / "env"), max_dbs=2, subdir=True)
    db = env.open_db(b"p0")
    with env.begin(write=True) as txn:
        accepted_sources.note(txn, db, "1.0.1", 100)
        accepted_sources.note(txn, db, "1.0.2", 200)
        accepted_sources.note(txn, db, "1.0.1", 300)  # taken again (after it was forgotten, say)
        txn.put(b"i" + bytes(8), b"an item", db=db)  # another tag: the walk stops there
    with env.begin(write=True) as txn:
        assert accepted_sources.forget_before(txn, db, 250, 1000) == 2
        assert accepted_sources.seen(txn, [db], "1.0.1")  # its take at 300 stays
        assert not accepted_sources.seen(txn, [db], "1.0.2")
        assert accepted_sources.forget_before(txn, db, 250, 1000) == 0
        assert accepted_sources.forget_before(txn, db, 301, 1) == 1
        assert not accepted_sources.seen(txn, [db], "1.0.1")
        assert txn.get(b"i" + bytes(8), db=db) == b"an item"
        keys = [bytes(k) for k in txn.cursor(db=db).iternext(values=False)]
    assert keys == [b"i" + bytes(8)]
    env.close()
