"""Dead letters of a replicated queue, with real etcd and node processes: its
dead_queue is a replicated queue served by another node, the source's primary is
killed (kill -9) while its consumers dead-letter items, and afterwards every item is in
the dead-letter queue exactly once (counted by payload), the source is empty, and the
source's copies' digests are equal.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Cluster, Node
from failover_helpers import LEASE_TIMEOUT_S, QUEUE, digests, stop_quietly, wait_in_sync, wait_primary
from replication_helpers import claimed

from querator.v1 import queue_pb2

from conftest import wait_until

TTL = 2
DLQ = "dead-letters"
ITEMS = 400


def _dead_letter_all(nodes: list[Node], stop: threading.Event, dead: Counter[bytes], errors: list[str]) -> None:
    """Lease from the source through any live node and send every item to its
    dead-letter queue (Retry with dead), until ``stop``."""
    turn = 0
    while not stop.is_set():
        node = nodes[turn % len(nodes)]
        turn += 1
        if node.proc is None or node.proc.poll() is not None:
            continue
        try:
            leased = node.stubs.queue.Lease(
                queue_pb2.LeaseRequest(queue_name=QUEUE, batch_size=20, request_timeout={"nanos": 200_000_000}), timeout=3
            )
            if not leased.items:
                continue
            items = [queue_pb2.RetryItem(id=i.id, dead=True) for i in leased.items]
            node.stubs.queue.Retry(queue_pb2.RetryRequest(queue_name=QUEUE, partition=leased.partition, items=items), timeout=3)
            dead.update(i.payload for i in leased.items)
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND):
                errors.append(f"{exc.code().name}: {exc.details()}")
            time.sleep(0.05)


def _drain_dead_letters(node: Node, expected: int, timeout: float = 40) -> Counter[bytes]:
    """Lease and complete the dead-letter queue until ``expected`` items came and a
    second of nothing more; the payloads seen, counted."""
    seen: Counter[bytes] = Counter()
    deadline = time.monotonic() + timeout
    quiet_since: float | None = None
    while time.monotonic() < deadline:
        try:
            leased = node.stubs.queue.Lease(
                queue_pb2.LeaseRequest(queue_name=DLQ, batch_size=100, request_timeout={"nanos": 200_000_000}), timeout=5
            )
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc.details()
            continue
        if leased.items:
            seen.update(i.payload for i in leased.items)
            node.stubs.complete(DLQ, leased.partition, [i.id for i in leased.items])
            quiet_since = None
        elif sum(seen.values()) >= expected:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 1.0:
                break
    return seen


@pytest.mark.timeout(180)
def test_a_replicated_queues_dead_letters_reach_its_replicated_dead_queue_once_across_a_failover(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    with Cluster(str(tmp_path), size=3, ttl=TTL) as cluster:
        n1 = cluster.nodes[0]
        by_id = {n.node_id: n for n in cluster.nodes}
        n1.stubs.create(DLQ, replicas=2)
        n1.stubs.create(QUEUE, replicas=2, requested_partitions=2, dead_queue=DLQ, lease_timeout={"seconds": LEASE_TIMEOUT_S})
        primary, epoch = wait_primary(cluster, n1)
        # Both copies claimed (their own incarnations in the in-sync set): else the
        # survivor may not take over (it could lack acknowledged changes).
        wait_until(lambda: claimed(cluster, QUEUE), 15)
        payloads = [f"item-{i}".encode() for i in range(ITEMS)]
        for start in range(0, ITEMS, 100):
            n1.stubs.produce(QUEUE, payloads[start : start + 100])
        stop = threading.Event()
        dead: Counter[bytes] = Counter()
        errors: list[str] = []
        workers = [
            threading.Thread(target=_dead_letter_all, args=(cluster.nodes, stop, dead, errors), daemon=True) for _ in range(2)
        ]
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + 20
        while sum(dead.values()) < ITEMS // 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        victim = by_id[primary]
        victim.kill9()  # the source's primary, in the middle of its dead letters
        observer = next(n for n in cluster.nodes if n is not victim)
        new_primary, new_epoch = wait_primary(cluster, observer, not_on=primary, timeout=TTL + 10)
        assert new_epoch == epoch + 1
        deadline = time.monotonic() + 40  # the items the dead primary had leased come back after their lease
        while time.monotonic() < deadline:
            stats = observer.stubs.stats(QUEUE)
            if sum(p.total for p in stats.partitions) == 0:
                break
            time.sleep(0.2)
        stop.set()
        for worker in workers:
            worker.join(10)
        assert not errors, errors[:5]
        assert sum(p.total for p in observer.stubs.stats(QUEUE).partitions) == 0
        seen = _drain_dead_letters(observer, ITEMS)
        assert set(seen) == set(payloads), f"missing {len(set(payloads) - set(seen))} dead letters"
        twice = {p: n for p, n in seen.items() if n > 1}
        assert not twice, f"{len(twice)} dead letters stored more than once, e.g. {list(twice.items())[:3]}"
        victim.start()
        wait_in_sync(cluster, observer, 2)
        time.sleep(1)
        stop_quietly(cluster.nodes)
        found = {n.node_id: digests(n) for n in cluster.nodes if n.node_id in (primary, new_primary)}
        assert len({str(d["digest"]) for d in found.values()}) == 1, found
        record_property("figures", f"{ITEMS} dead letters, the source's primary killed after {ITEMS // 3}: each stored once")


def test_a_replicated_queue_refuses_a_dead_queue_of_one_copy(tmp_path: Path) -> None:
    with Cluster(str(tmp_path), size=2, ttl=TTL) as cluster:
        n1 = cluster.nodes[0]
        n1.stubs.create("single-dlq", replicas=1)
        with pytest.raises(grpc.RpcError) as caught:
            n1.stubs.create("copied", replicas=2, dead_queue="single-dlq")
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "the dead_queue of a replicated queue (replicas > 1) must be replicated too" in (caught.value.details() or "")
        # A queue of one copy may send its dead letters to a replicated queue.
        n1.stubs.create("copied-dlq", replicas=2)
        n1.stubs.create("single", replicas=1, dead_queue="copied-dlq", requested_partitions=2)
        n1.stubs.produce("single", [b"a", b"b"])
        deadline = time.monotonic() + 10
        sent = 0
        while sent < 2 and time.monotonic() < deadline:  # each partition's home sends its dead letter to the primary
            leased = n1.stubs.lease("single", 10, request_timeout={"nanos": 200_000_000})
            if leased.items:
                items = [queue_pb2.RetryItem(id=i.id, dead=True) for i in leased.items]
                n1.stubs.queue.Retry(
                    queue_pb2.RetryRequest(queue_name="single", partition=leased.partition, items=items), timeout=5
                )
                sent += len(items)
        got: list[bytes] = []
        while len(got) < 2 and time.monotonic() < deadline:
            got += [i.payload for i in n1.stubs.lease("copied-dlq", 10, request_timeout={"nanos": 200_000_000}).items]
        assert sorted(got) == [b"a", b"b"]
