"""Cluster faults with real processes: kill -9 a node under load, SIGSTOP a node past
its membership TTL, etcd killed and restarted, etcd paused, a dead node retired.

One cluster (etcd + three nodes, TTL 3 s) serves the module; each test leaves it
whole again for the next, except the last (retire), which retires n3 for good.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from aetcd import rpc  # type: ignore[import-untyped]
from cluster_helpers import Cluster, Node
from grpc_health.v1 import health_pb2, health_pb2_grpc

from querator.v1 import cluster_pb2, cluster_pb2_grpc, queue_pb2, queues_pb2

from conftest import dur, wait_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("faults")), ttl=3) as c:
        yield c


def _etcd_get(cluster: Cluster, key: str) -> rpc.KeyValue | None:
    channel = grpc.insecure_channel(cluster.etcd.endpoint)
    try:
        reply = rpc.KVStub(channel).Range(rpc.RangeRequest(key=f"/{cluster.prefix}/{key}".encode()), timeout=5)
        return reply.kvs[0] if reply.kvs else None
    finally:
        channel.close()


def _live(observer: Node) -> set[str]:
    try:
        return {m.node_id for m in observer.info(timeout=5).members if m.live}
    except grpc.RpcError:
        return set()


class Load:
    """A producer and a consumer per node, each through its own node, with a ledger."""

    def __init__(self, cluster: Cluster, queue: str) -> None:
        self.queue = queue
        self.lock = threading.Lock()
        self.acked: set[bytes] = set()
        self.completed: Counter[bytes] = Counter()
        # Completes that failed (their home died meanwhile): done or not, nobody knows.
        self.unsure: set[bytes] = set()
        self.errors: dict[str, list[str]] = {n.node_id: [] for n in cluster.nodes}
        self.stop = threading.Event()
        self.down: set[str] = set()
        self.threads = []
        for node in cluster.nodes:
            self.threads.append(threading.Thread(target=self._produce, args=(node,), daemon=True))
            self.threads.append(threading.Thread(target=self._consume, args=(node,), daemon=True))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _note(self, node: Node, what: str, exc: grpc.RpcError) -> None:
        with self.lock:
            if node.node_id not in self.down:
                self.errors[node.node_id].append(f"{what}: {exc.code().name} {exc.details()}")

    def _produce(self, node: Node) -> None:
        channel = grpc.insecure_channel(node.address)
        stub = node.stubs.queue.__class__(channel)
        n = 0
        while not self.stop.is_set() and node.node_id not in self.down:
            payloads = [f"{node.node_id}-{n + i}".encode() for i in range(5)]
            n += 5
            try:
                stub.Produce(queue_pb2.ProduceRequest(queue_name=self.queue, payloads=payloads), timeout=10)
            except grpc.RpcError as exc:
                self._note(node, "Produce", exc)
                break
            with self.lock:
                self.acked.update(payloads)
            time.sleep(0.01)
        channel.close()

    def _consume(self, node: Node) -> None:
        channel = grpc.insecure_channel(node.address)
        stub = node.stubs.queue.__class__(channel)
        while not self.stop.is_set() and node.node_id not in self.down:
            try:
                reply = stub.Lease(
                    queue_pb2.LeaseRequest(queue_name=self.queue, batch_size=20, request_timeout=dur(0.2)), timeout=10
                )
            except grpc.RpcError as exc:
                self._note(node, "Lease", exc)
                break
            if not reply.items:
                continue
            try:
                stub.Complete(
                    queue_pb2.CompleteRequest(queue_name=self.queue, partition=reply.partition, ids=[i.id for i in reply.items]),
                    timeout=10,
                )
            except grpc.RpcError:
                with self.lock:  # the items' home died meanwhile: done or not, it is unknown
                    self.unsure.update(i.payload for i in reply.items)
                continue
            with self.lock:
                self.completed.update(i.payload for i in reply.items)
        channel.close()


def _drain(node: Node, queue: str, timeout: float = 60) -> Counter[bytes]:
    """Lease and complete through ``node`` until nothing is stored."""
    got: Counter[bytes] = Counter()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = node.stubs.lease(queue, 100, timeout=10, request_timeout=dur(0.5))
        if reply.items:
            node.stubs.complete(queue, reply.partition, [i.id for i in reply.items])
            got.update(i.payload for i in reply.items)
            continue
        if sum(s.total for s in node.stubs.stats(queue).partitions) == 0:
            return got
    raise AssertionError(f"{queue} did not drain within {timeout}s")


def test_kill9_a_node_under_load_others_keep_serving_and_nothing_is_lost(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("load", requested_partitions=6, lease_timeout=dur(2))
    load = Load(cluster, "load")
    load.start()
    time.sleep(1.0)
    with load.lock:
        load.down.add("n3")
        before = len(load.acked)
    n3.kill9()
    wait_until(lambda: "n3" not in _live(n1), timeout=20, interval=0.2)
    time.sleep(0.5)
    with load.lock:
        during = len(load.acked)
    n3.start()
    wait_until(lambda: _live(n1) == {"n1", "n2", "n3"}, timeout=20, interval=0.2)
    time.sleep(0.5)
    load.finish()
    assert load.errors["n1"] == [] and load.errors["n2"] == [], load.errors
    assert during > before + 20  # n1 and n2 kept producing while n3 was dead
    # n3 serves its partitions again, and every acknowledged item is accounted for.
    drained = _drain(n3, "load")
    twice = [p for p, count in load.completed.items() if count > 1]
    assert twice == []  # no item completed twice
    assert [p for p in drained if load.completed[p]] == []  # none delivered after its complete
    lost = load.acked - set(load.completed) - set(drained) - load.unsure
    assert lost == set(), sorted(lost)[:5]
    assert len(load.unsure) <= 3 * 20  # at most one batch per consumer, in flight when n3 died


def test_sigstop_a_node_past_its_ttl_then_sigcont_fences_then_rejoins(cluster: Cluster) -> None:
    n1, n2, _ = cluster.nodes
    member = _etcd_get(cluster, "members/n2")
    assert member is not None
    health = health_pb2_grpc.HealthStub(n2.channel)
    n2.signal(signal.SIGSTOP)
    try:
        wait_until(lambda: "n2" not in _live(n1), timeout=20, interval=0.2)
        outcome: list[grpc.StatusCode] = []

        def create_while_fenced() -> None:
            try:
                n2.stubs.create("made-by-n2", requested_partitions=3)
                outcome.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                outcome.append(exc.code())

        caller = threading.Thread(target=create_while_fenced)
        caller.start()
        time.sleep(0.3)  # the call waits in n2's socket
    finally:
        n2.signal(signal.SIGCONT)
    caller.join(30)
    assert outcome and outcome[0] in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), outcome
    # It noticed, registered again (a new member key) and is live and writable again.
    wait_until(lambda: "n2" in _live(n1), timeout=20, interval=0.2)
    again = _etcd_get(cluster, "members/n2")
    assert again is not None and again.create_revision > member.create_revision
    wait_until(lambda: n2.info().admin_writable, timeout=20, interval=0.2)
    status = health.Check(health_pb2.HealthCheckRequest(service="querator.v1.ClusterService"), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    made = _etcd_get(cluster, "queues/made-by-n2")
    if outcome[0] == grpc.StatusCode.OK:
        # Applied only under the new membership, never under the lapsed one.
        assert made is not None and made.mod_revision > again.create_revision
    else:
        assert made is None
    # And it serves data again.
    n1.stubs.create("after-stop", requested_partitions=3)
    n2.stubs.produce("after-stop", [b"a", b"b", b"c"])
    assert sum(len(n2.stubs.lease("after-stop", 10, request_timeout=dur(0)).items) for _ in range(6)) == 3


def _admin_code(node: Node, name: str) -> grpc.StatusCode:
    try:
        node.stubs.queues.CreateQueue(
            queues_pb2.CreateQueueRequest(queue=queues_pb2.QueueInfo(queue_name=name)), timeout=15
        )
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def _data_round(cluster: Cluster, queue: str, tag: str) -> None:
    """Produce on every node and lease + complete on every node: all must work."""
    for node in cluster.nodes:
        node.stubs.produce(queue, [f"{tag}-{node.node_id}".encode()])
    seen: list[bytes] = []
    for node in cluster.nodes * 3:
        reply = node.stubs.lease(queue, 10, timeout=10, request_timeout=dur(0.3))
        if reply.items:
            node.stubs.complete(queue, reply.partition, [i.id for i in reply.items])
            seen += [i.payload for i in reply.items]
    assert sorted(seen) == sorted(f"{tag}-{n.node_id}".encode() for n in cluster.nodes)


def test_etcd_killed_data_calls_work_admin_calls_unavailable_then_all_recover(cluster: Cluster) -> None:
    n1, _, n3 = cluster.nodes
    n1.stubs.create("steady", requested_partitions=3)
    wait_until(lambda: all("steady" in [q.queue_name for q in n.info().queues] for n in cluster.nodes), timeout=10)
    cluster.etcd.kill9()
    try:
        _data_round(cluster, "steady", "without-etcd")
        # Fenced within the TTL, and it says so in health; data still flows.
        health = health_pb2_grpc.HealthStub(n1.channel)
        wait_until(
            lambda: health.Check(health_pb2.HealthCheckRequest(service="querator.v1.ClusterService"), timeout=5).status
            == health_pb2.HealthCheckResponse.NOT_SERVING,
            timeout=15,
            interval=0.2,
        )
        assert not n1.info().admin_writable
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        for node in cluster.nodes:
            assert _admin_code(node, f"refused-{node.node_id}") == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.etcd.start()
    for node in cluster.nodes:
        wait_until(lambda node=node: node.info().admin_writable, timeout=30, interval=0.2)
    assert _admin_code(n1, "after-etcd") == grpc.StatusCode.OK
    # The watches came back: n3 learns of the queue n1 just made.
    wait_until(lambda: "after-etcd" in [q.queue_name for q in n3.info().queues], timeout=15, interval=0.1)
    n3.stubs.produce("after-etcd", [b"x"])
    _data_round(cluster, "steady", "etcd-back")


def test_etcd_paused_data_calls_work_admin_calls_unavailable_then_all_recover(cluster: Cluster) -> None:
    n1, n2, _ = cluster.nodes
    cluster.etcd.pause()
    try:
        _data_round(cluster, "steady", "etcd-paused")
        assert _admin_code(n2, "refused-paused") == grpc.StatusCode.UNAVAILABLE
    finally:
        cluster.etcd.resume()
    for node in cluster.nodes:
        wait_until(lambda node=node: node.info().admin_writable, timeout=30, interval=0.2)
    assert _admin_code(n2, "after-pause") == grpc.StatusCode.OK
    wait_until(lambda: "after-pause" in [q.queue_name for q in n1.info().queues], timeout=15, interval=0.1)


def test_a_node_that_was_down_brings_its_local_queues_in_step_with_the_catalog(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("reborn", requested_partitions=3)
    n1.stubs.create("tuned", requested_partitions=3)
    for node in cluster.nodes:
        node.stubs.produce("reborn", [f"old-{node.node_id}".encode()])
    n2.kill9()
    wait_until(lambda: "n2" not in _live(n1), timeout=20, interval=0.2)
    # While n2 is away: a queue deleted and made again under the same name, and a
    # setting changed.
    n1.stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="reborn", force=True), timeout=15)
    n3.stubs.create("reborn", requested_partitions=2)
    from google.protobuf import field_mask_pb2

    n1.stubs.queues.UpdateQueue(
        queues_pb2.UpdateQueueRequest(
            queue=queues_pb2.QueueInfo(queue_name="tuned", lease_timeout=dur(7)),
            update_mask=field_mask_pb2.FieldMask(paths=["lease_timeout"]),
        ),
        timeout=15,
    )
    n2.start()
    wait_until(lambda: _live(n1) == {"n1", "n2", "n3"}, timeout=20, interval=0.2)
    # The new "reborn" grows onto n2: none of the old queue's items may show up there.
    n1.stubs.queues.UpdateQueue(
        queues_pb2.UpdateQueueRequest(
            queue=queues_pb2.QueueInfo(queue_name="reborn", requested_partitions=4),
            update_mask=field_mask_pb2.FieldMask(paths=["requested_partitions"]),
        ),
        timeout=15,
    )
    homes = list([q for q in n2.info().queues if q.queue_name == "reborn"][0].homes)
    assert "n2" in homes
    assert sum(s.total for s in n2.stubs.stats("reborn").partitions) == 0
    # n2's part of "tuned" took the new lease timeout.
    produced = n2.stubs.produce("tuned", [b"t"])
    assert list(n2.info().queues[[q.queue_name for q in n2.info().queues].index("tuned")].homes)[produced.partition] == "n2"
    before = time.time()
    leased = n2.stubs.lease("tuned", 1, request_timeout=dur(0))
    while not leased.items:  # the lease may come from another home first: it has none
        leased = n2.stubs.lease("tuned", 1, request_timeout=dur(0.2))
    deadline = leased.items[0].lease_deadline.seconds + leased.items[0].lease_deadline.nanos / 1e9
    assert 5 < deadline - before < 9


def test_a_members_lease_revoked_by_hand_makes_it_register_again(cluster: Cluster) -> None:
    n1, n2, _ = cluster.nodes
    member = _etcd_get(cluster, "members/n2")
    assert member is not None and member.lease
    channel = grpc.insecure_channel(cluster.etcd.endpoint)
    try:
        rpc.LeaseStub(channel).LeaseRevoke(rpc.LeaseRevokeRequest(ID=member.lease), timeout=5)
    finally:
        channel.close()
    # n2 notices (its key's deletion, or a renewal answered with TTL 0) and registers
    # under a new lease and a new fencing token.
    wait_until(
        lambda: (m := _etcd_get(cluster, "members/n2")) is not None and m.create_revision > member.create_revision,
        timeout=15,
        interval=0.1,
    )
    assert _etcd_get(cluster, "members/n2").lease != member.lease
    wait_until(lambda: n2.info().admin_writable and "n2" in _live(n1), timeout=15, interval=0.1)
    assert _admin_code(n2, "after-revoke") == grpc.StatusCode.OK


def test_sigterm_leaves_the_cluster_at_once_and_a_restart_needs_no_wait(cluster: Cluster) -> None:
    n1, n2, _ = cluster.nodes
    n1.stubs.create("graceful", requested_partitions=3)
    n2.stubs.produce("graceful", [b"kept"])
    assert n2.proc is not None
    n2.signal(signal.SIGTERM)
    assert n2.proc.wait(30) == 0
    # The lease was revoked on the way out: the member key is gone the moment it exits,
    # not when its TTL runs out.
    assert _etcd_get(cluster, "members/n2") is None
    wait_until(lambda: "n2" not in _live(n1), timeout=10, interval=0.05)
    n2.start()
    wait_until(lambda: "n2" in _live(n1), timeout=10, interval=0.05)
    leased = [i.payload for _ in range(6) for i in n1.stubs.lease("graceful", 10, request_timeout=dur(0.2)).items]
    assert leased == [b"kept"]


def test_retire_a_dead_node_recreates_its_partitions_empty_elsewhere(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("orphaned", requested_partitions=3)
    n3.stubs.produce("orphaned", [b"kept-on-n3"])  # n3 homes a partition: served there
    n1.stubs.create("orphaned-dlq", requested_partitions=1)
    n1.stubs.create("orphaned-src", requested_partitions=3, dead_queue="orphaned-dlq")
    stub = cluster_pb2_grpc.ClusterServiceStub(n1.channel)
    n3.kill9()
    wait_until(lambda: "n3" not in _live(n1), timeout=20, interval=0.2)
    homes = list([q for q in n1.info().queues if q.queue_name == "orphaned"][0].homes)
    gone = homes.index("n3")
    # Its partition is unavailable, not an error for producers.
    n1.stubs.produce("orphaned", [b"on-n1"])
    with pytest.raises(grpc.RpcError) as down:
        n1.stubs.complete("orphaned", gone, ["1.0.1"])
    assert down.value.code() == grpc.StatusCode.UNAVAILABLE
    reply = stub.RetireNodeDiscardingData(cluster_pb2.RetireNodeDiscardingDataRequest(node_id="n3"), timeout=15)
    assert reply.partitions_recreated >= 1
    wait_until(lambda: "n3" not in {h for q in n2.info().queues for h in q.homes}, timeout=10)
    info = n2.info()
    assert "n3" not in {m.node_id for m in info.members}
    # A dead-letter queue still has a partition on every node its user's partitions are on.
    placed = {q.queue_name: list(q.homes) for q in n2.info().queues}
    assert "n3" not in placed["orphaned-src"] + placed["orphaned-dlq"]
    assert set(placed["orphaned-src"]) <= set(placed["orphaned-dlq"])
    n2.stubs.produce("orphaned-src", [b"s"] * 3)
    # The recreated partition is empty and in service.
    stats = n2.stubs.stats("orphaned")
    assert [s.partition for s in stats.partitions] == [0, 1, 2]
    assert stats.partitions[gone].total == 0
    # A retired node never comes back with its old partitions.
    with pytest.raises(AssertionError, match="retired"):
        n3.start(timeout=30)
    record = _etcd_get(cluster, "retired/n3")
    assert record is not None and json.loads(record.value) == {}


def test_a_node_cut_off_while_history_is_compacted_lists_the_catalog_again(tmp_path) -> None:
    from cluster_helpers import Proxy

    small = Cluster(str(tmp_path / "cut"), size=1, ttl=3)
    proxy = None
    cut_off = None
    try:
        small.start()
        (n1,) = small.nodes
        proxy = Proxy(small.etcd.endpoint)
        cut_off = Node("n2", str(tmp_path / "cut" / "n2"), f"etcd://{proxy.address}/{small.prefix}", ttl=3)
        cut_off.start()
        n1.stubs.create("seen", requested_partitions=2)
        wait_until(lambda: "seen" in [q.queue_name for q in cut_off.info().queues], timeout=10)
        proxy.cut()
        n1.stubs.create("missed", requested_partitions=2)
        n1.stubs.create("missed-too")  # compacting at the last revision removes the one before
        channel = grpc.insecure_channel(small.etcd.endpoint)
        try:
            kv = rpc.KVStub(channel)
            revision = kv.Range(rpc.RangeRequest(key=b"/"), timeout=5).header.revision
            kv.Compact(rpc.CompactionRequest(revision=revision, physical=True), timeout=10)
        finally:
            channel.close()
        # The cut-off node still serves what it knew, from its cached catalog.
        assert "missed" not in [q.queue_name for q in cut_off.info().queues]
        cut_off.stubs.produce("seen", [b"while-cut"])
        proxy.restore()
        # Its watch resumes from a compacted revision: it must list everything again.
        wait_until(lambda: "missed" in [q.queue_name for q in cut_off.info().queues], timeout=20, interval=0.2)
        assert "missed-too" in [q.queue_name for q in cut_off.info().queues]
        assert "catalog_watch_compacted" in cut_off.stderr_text()
        cut_off.stubs.produce("missed", [b"after"])
    finally:
        if cut_off is not None:
            cut_off.stop()
        if proxy is not None:
            proxy.close()
        small.stop()


def test_stats_list_a_down_homes_partitions_as_faulty_and_delete_without_force_names_it(cluster: Cluster) -> None:
    """A queue whose items wait on a node that is away never reads as empty."""
    n1, n2 = cluster.nodes[:2]
    live = [n for n in cluster.nodes if n.node_id in _live(n1)]  # an earlier test may have retired n3
    n1.stubs.create("away", requested_partitions=3)
    wait_until(lambda: all("away" in [q.queue_name for q in n.info().queues] for n in live), timeout=10)
    homes = list([q for q in n1.info().queues if q.queue_name == "away"][0].homes)
    on_n2 = [p for p, home in enumerate(homes) if home == "n2"]
    assert on_n2, homes
    for node in live:
        node.stubs.produce("away", [f"on-{node.node_id}".encode()])
    before = {s.partition: s.total for s in n1.stubs.stats("away").partitions}
    assert sum(before.values()) == len(live) and sum(before[p] for p in on_n2) >= 1, before
    n2.kill9()
    try:
        wait_until(lambda: "n2" not in _live(n1), timeout=20, interval=0.2)
        stats = n1.stubs.stats("away")
        assert [s.partition for s in stats.partitions] == list(range(len(homes)))
        for s in stats.partitions:
            if s.partition in on_n2:
                assert s.faulty and "'n2'" in s.failure and s.total == 0
            else:
                assert not s.faulty and s.total == before[s.partition]
        with pytest.raises(grpc.RpcError) as refused:
            n1.stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="away"), timeout=15)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "n2" in (refused.value.details() or "")
    finally:
        n2.start()
    wait_until(lambda: "n2" in _live(n1), timeout=20, interval=0.2)
    wait_until(lambda: not any(s.faulty for s in n1.stubs.stats("away").partitions), timeout=15, interval=0.2)
    assert sum(s.total for s in n1.stubs.stats("away").partitions) == len(live)
