"""Cluster mode through real etcd and three real node processes on loopback.

One cluster serves the whole module (starting one costs seconds); each test uses
queues of its own. Fault tests (kill -9, SIGSTOP, etcd down) are in
test_cluster_faults.py.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from cluster_helpers import Cluster
from google.protobuf import field_mask_pb2

from querator.v1 import cluster_pb2, cluster_pb2_grpc, queue_pb2, queues_pb2, storage_pb2

from conftest import ThreadServer, wait_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("cluster"))) as c:
        yield c


def _drain(node, name: str, expect: int, timeout: float = 60) -> list[tuple[int, queue_pb2.LeaseItem]]:
    """Lease through ``node`` until ``expect`` items came (or the time is up)."""
    got: list[tuple[int, queue_pb2.LeaseItem]] = []
    deadline = time.monotonic() + timeout
    while len(got) < expect and time.monotonic() < deadline:
        reply = node.stubs.lease(name, 50, timeout=10, request_timeout=_dur(1))
        got.extend((reply.partition, item) for item in reply.items)
    return got


def _dur(seconds: float):
    from conftest import dur

    return dur(seconds)


def test_create_on_n1_produce_on_n2_lease_on_n3_complete_on_n1_every_item_once(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("flow", requested_partitions=6)
    payloads = [f"item-{i}".encode() for i in range(300)]
    for start in range(0, len(payloads), 25):
        n2.stubs.produce("flow", payloads[start : start + 25])
    leased = _drain(n3, "flow", len(payloads))
    assert sorted(item.payload for _, item in leased) == sorted(payloads)
    by_partition: dict[int, list[str]] = {}
    for partition, item in leased:
        by_partition.setdefault(partition, []).append(item.id)
    # Produced on n2 (its own partitions), leased on n3: n3 served n2's items by forwarding.
    homes = dict(enumerate([q for q in n1.info().queues if q.queue_name == "flow"][0].homes))
    for partition, ids in by_partition.items():
        n1.stubs.complete("flow", partition, ids)
    stats = n2.stubs.stats("flow")
    assert [s.partition for s in stats.partitions] == list(range(6))
    assert sum(s.total for s in stats.partitions) == 0
    assert n3.stubs.lease("flow", 10, request_timeout=_dur(0)).items == []
    assert set(homes.values()) == {"n1", "n2", "n3"}


def test_cluster_info_lists_members_and_homes_so_a_client_can_route(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n2.stubs.create("routed", requested_partitions=4)
    info = n3.info()
    assert info.clustered and info.node_id == "n3" and info.admin_writable
    assert {(m.node_id, m.address, m.live) for m in info.members} == {(n.node_id, n.address, True) for n in cluster.nodes}
    (placement,) = [q for q in info.queues if q.queue_name == "routed"]
    assert len(placement.homes) == 4 and set(placement.homes) == {"n1", "n2", "n3"}
    addresses = {m.node_id: m.address for m in info.members}
    nodes = {n.address: n for n in cluster.nodes}
    # Straight to a partition's home: produce there lands in one of its partitions.
    for partition, home in enumerate(placement.homes):
        node = nodes[addresses[home]]
        reply = node.stubs.produce("routed", [f"p{partition}".encode()])
        assert placement.homes[reply.partition] == home
    only = cluster_pb2_grpc.ClusterServiceStub(n1.channel).ClusterInfo(
        cluster_pb2.ClusterInfoRequest(queue_names=["routed"]), timeout=10
    )
    assert [q.queue_name for q in only.queues] == ["routed"] and only.revision >= info.revision - 10


def test_complete_with_the_wrong_partition_or_a_bad_one_is_refused_clearly(cluster: Cluster) -> None:
    n1, n2, _ = cluster.nodes
    n1.stubs.create("checked", requested_partitions=3)
    with pytest.raises(grpc.RpcError) as error:
        n2.stubs.complete("checked", 7, ["1.0.1"])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "partition" in (error.value.details() or "")


def _update(
    node, field: str, info: queues_pb2.QueueInfo, barrier: threading.Barrier, outcome: dict[str, grpc.StatusCode]
) -> None:
    barrier.wait()
    try:
        node.stubs.queues.UpdateQueue(
            queues_pb2.UpdateQueueRequest(queue=info, update_mask=field_mask_pb2.FieldMask(paths=[field])), timeout=15
        )
        outcome[field] = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        outcome[field] = exc.code()


def _get(node, name: str) -> queues_pb2.QueueInfo:
    return node.stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name=name), timeout=10).queue


def test_two_admins_racing_update_queue_on_two_nodes_lose_no_update(cluster: Cluster) -> None:
    n1, n2, _ = cluster.nodes
    n1.stubs.create("raced")
    conflicts = 0
    for round_ in range(1, 101):
        barrier = threading.Barrier(2)
        outcome: dict[str, grpc.StatusCode] = {}
        threads = [
            threading.Thread(
                target=_update,
                args=(n1, "reference", queues_pb2.QueueInfo(queue_name="raced", reference=f"r{round_}"), barrier, outcome),
            ),
            threading.Thread(
                target=_update,
                args=(n2, "max_attempts", queues_pb2.QueueInfo(queue_name="raced", max_attempts=round_), barrier, outcome),
            ),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert set(outcome.values()) <= {grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION}, outcome
        assert grpc.StatusCode.OK in outcome.values()  # one always wins
        # Every update answered OK is in the queue, on every node: none overwritten by the other.
        for node in cluster.nodes:
            if outcome["reference"] == grpc.StatusCode.OK:
                wait_until(lambda node=node, r=round_: _get(node, "raced").reference == f"r{r}", timeout=10)
            if outcome["max_attempts"] == grpc.StatusCode.OK:
                wait_until(lambda node=node, r=round_: _get(node, "raced").max_attempts == r, timeout=10)
        if grpc.StatusCode.FAILED_PRECONDITION in outcome.values():
            conflicts += 1
            if conflicts >= 2:
                break
    assert conflicts >= 1, "a hundred rounds of simultaneous updates and never a conflict"


def test_an_idempotency_key_dedups_whichever_node_receives_it(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("keyed", requested_partitions=5)
    item = queue_pb2.ProduceItem(payload=b"once", idempotency_key="order-42")
    replies = [
        node.stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="keyed", items=[item]), timeout=10)
        for node in (n1, n2, n3, n2)
    ]
    assert len({r.ids[0] for r in replies}) == 1
    assert [r.duplicates for r in replies] == [0, 1, 1, 1]
    assert sum(s.total for s in n3.stubs.stats("keyed").partitions) == 1


def test_a_forwarded_lease_keeps_the_callers_deadline(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("lonely", requested_partitions=1)
    (home,) = [q for q in n1.info().queues if q.queue_name == "lonely"][0].homes
    elsewhere = next(n for n in cluster.nodes if n.node_id != home)
    start = time.monotonic()
    # No request_timeout: the lease waits as long as the call allows. Were the deadline
    # lost on the way, the home would wait its 30 s default and the call time out.
    reply = elsewhere.stubs.queue.Lease(queue_pb2.LeaseRequest(queue_name="lonely", batch_size=1), timeout=2.5)
    assert reply.items == [] and time.monotonic() - start < 2.5
    elsewhere.stubs.produce("lonely", [b"x"])
    got = elsewhere.stubs.queue.Lease(queue_pb2.LeaseRequest(queue_name="lonely", batch_size=1), timeout=5)
    assert [i.payload for i in got.items] == [b"x"]


def test_queues_of_one_partition_are_spread_over_the_nodes(cluster: Cluster) -> None:
    n1 = cluster.nodes[0]
    homes: dict[str, str] = {}
    for i in range(6):
        load = Counter(h for q in n1.info().queues for h in q.homes)
        name = f"single-{i}"
        n1.stubs.create(name, requested_partitions=1)
        (home,) = [q.homes[0] for q in n1.info().queues if q.queue_name == name]
        # The node homing the fewest partitions overall (before: always n1, by node id).
        assert load[home] == min(load[n.node_id] for n in cluster.nodes), (home, load)
        homes[name] = home
    assert set(homes.values()) == {"n1", "n2", "n3"}
    for name, home in homes.items():  # each one works through a node that does not home it
        via = next(n for n in cluster.nodes if n.node_id != home)
        via.stubs.produce(name, [name.encode()])
        assert [item.payload for _, item in _drain(via, name, 1)] == [name.encode()]


def test_update_adding_partitions_places_them_over_the_nodes(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("grows", requested_partitions=1)
    n3.stubs.queues.UpdateQueue(
        queues_pb2.UpdateQueueRequest(
            queue=queues_pb2.QueueInfo(queue_name="grows", requested_partitions=6),
            update_mask=field_mask_pb2.FieldMask(paths=["requested_partitions"]),
        ),
        timeout=15,
    )
    wait_until(lambda: len([q for q in n2.info().queues if q.queue_name == "grows"][0].homes) == 6, timeout=10)
    homes = list([q for q in n2.info().queues if q.queue_name == "grows"][0].homes)
    assert sorted(homes.count(n) for n in ("n1", "n2", "n3")) == [2, 2, 2]
    for node in cluster.nodes:
        node.stubs.produce("grows", [node.node_id.encode()])
    assert len(_drain(n2, "grows", 3)) == 3


def test_delete_on_one_node_deletes_everywhere_and_the_name_can_be_reused(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("doomed", requested_partitions=3)
    for node in cluster.nodes:
        node.stubs.produce("doomed", [b"left"])
    with pytest.raises(grpc.RpcError) as error:
        n3.stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="doomed"), timeout=15)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    n3.stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="doomed", force=True), timeout=15)
    for node in cluster.nodes:
        wait_until(lambda node=node: "doomed" not in [q.queue_name for q in node.info().queues], timeout=10)
        with pytest.raises(grpc.RpcError) as missing:
            node.stubs.produce("doomed", [b"x"])
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    n2.stubs.create("doomed", requested_partitions=3)
    assert sum(s.total for s in n1.stubs.stats("doomed").partitions) == 0


def test_dead_letters_reach_the_dead_letter_queue_from_every_node(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("dlq", requested_partitions=1)
    n2.stubs.create("sick", requested_partitions=3, dead_queue="dlq", max_attempts=1)
    # The dead-letter queue now has a partition on every node that homes one of "sick".
    homes = {q.queue_name: list(q.homes) for q in n3.info().queues}
    assert set(homes["dlq"]) == set(homes["sick"]) == {"n1", "n2", "n3"}
    assert n3.stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="dlq"), timeout=10).queue.requested_partitions == 3
    for node in cluster.nodes:
        node.stubs.produce("sick", [f"bad-{node.node_id}".encode()])
    dead = 0
    deadline = time.monotonic() + 30
    while dead < 3 and time.monotonic() < deadline:
        leased = n2.stubs.lease("sick", 10, request_timeout=_dur(0.5))
        if leased.items:
            n3.stubs.queue.Retry(  # forwarded to the items' home unless that is n3
                queue_pb2.RetryRequest(
                    queue_name="sick",
                    partition=leased.partition,
                    items=[
                        queue_pb2.RetryItem(id=i.id, dead=True, error=f"ValueError: {i.payload.decode()} is bad")
                        for i in leased.items
                    ],
                ),
                timeout=10,
            )
            dead += len(leased.items)
    assert dead == 3
    letters = _drain(n1, "dlq", 3)
    assert sorted(item.payload for _, item in letters) == [b"bad-n1", b"bad-n2", b"bad-n3"]
    # Each says why it died and keeps its message id, whichever node it died on.
    assert all(item.dead_reason == queue_pb2.DEAD_REASON_RETRY_DEAD for _, item in letters)
    assert all(item.message_id and item.source_id and item.dead_attempts == 1 for _, item in letters)
    # And the error that killed it, sent to n3 with the Retry, wherever its home was.
    assert sorted(item.last_error for _, item in letters) == [f"ValueError: bad-{n} is bad" for n in ("n1", "n2", "n3")]
    # Leased dead letters stay where they are (test_cluster_redrive.py moves ready ones).
    kept = n2.stubs.storage.RedriveItems(storage_pb2.RedriveItemsRequest(queue_name="dlq"), timeout=10)
    assert (kept.moved, kept.skipped, kept.next_page_token) == (0, 0, "")
    with pytest.raises(grpc.RpcError) as in_use:
        n1.stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="dlq", force=True), timeout=15)
    assert in_use.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as missing:
        n1.stubs.create("sick-too", dead_queue="no-such-dlq")
    assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dead_queue" in (missing.value.details() or "")


def test_retiring_a_live_node_is_refused(cluster: Cluster) -> None:
    stub = cluster_pb2_grpc.ClusterServiceStub(cluster.nodes[0].channel)
    with pytest.raises(grpc.RpcError) as error:
        stub.RetireNodeDiscardingData(cluster_pb2.RetireNodeDiscardingDataRequest(node_id="n2"), timeout=10)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_single_server_answers_cluster_info_as_one_node(tmp_path) -> None:
    server = ThreadServer(str(tmp_path / "data"))
    try:
        channel = grpc.insecure_channel(server.address)
        from conftest import Stubs

        Stubs(channel).create("solo", requested_partitions=2)
        info = cluster_pb2_grpc.ClusterServiceStub(channel).ClusterInfo(cluster_pb2.ClusterInfoRequest(), timeout=10)
        assert not info.clustered and info.revision == 0
        assert [(m.address, m.live) for m in info.members] == [(server.address, True)]
        assert [(q.queue_name, list(q.homes)) for q in info.queues] == [("solo", ["", ""])]
        channel.close()
    finally:
        server.stop()


def test_forwarded_calls_carry_the_callers_api_key_and_keys_reach_every_node(tmp_path) -> None:
    from querator.v1 import keys_pb2, keys_pb2_grpc

    admin = [("authorization", "Bearer " + "cluster-admin-token-for-the-test-" + "x" * 20)]
    auth = Cluster(str(tmp_path / "auth"), size=2, env={"QUERATOR_AUTH": "true", "QUERATOR_ADMIN_TOKEN": admin[0][1][7:]})
    try:
        auth.start()
        n1, n2 = auth.nodes
        n1.stubs.queues.CreateQueue(
            queues_pb2.CreateQueueRequest(queue=queues_pb2.QueueInfo(queue_name="secure", requested_partitions=1)),
            timeout=15,
            metadata=admin,
        )
        info = cluster_pb2_grpc.ClusterServiceStub(n1.channel).ClusterInfo(
            cluster_pb2.ClusterInfoRequest(), timeout=10, metadata=admin
        )
        (home,) = info.queues[0].homes
        nodes = {n.node_id: n for n in auth.nodes}
        other = nodes["n2" if home == "n1" else "n1"]
        made = keys_pb2_grpc.KeysServiceStub(other.channel).CreateKey(
            keys_pb2.CreateKeyRequest(role=keys_pb2.ROLE_PRODUCER, queues=["secure"]), timeout=15, metadata=admin
        )
        producer = [("authorization", f"Bearer {made.token}")]
        request = queue_pb2.ProduceRequest(queue_name="secure", payloads=[b"signed"])
        # Sent to the node without the partition: forwarded with the key, which the home
        # (that learnt of the key through the catalog) accepts.
        wait_until(lambda: _produces(nodes[home], request, producer), timeout=10)
        assert other.stubs.queue.Produce(request, timeout=10, metadata=producer).partition == 0
        # A stream is checked once, as it opens, by the node it reaches: the producer key's
        # LeaseStream ends PERMISSION_DENIED on either node, with no answer to its message;
        # its ProduceStream is served (forwarded message by message from the other node).
        lease = queue_pb2.LeaseStreamRequest(request=queue_pb2.LeaseRequest(queue_name="secure", batch_size=1))
        for node in auth.nodes:
            with pytest.raises(grpc.RpcError) as refused:
                list(node.stubs.queue.LeaseStream(iter([lease]), timeout=10, metadata=producer))
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert refused.value.details() == f"key {made.key.key_id} (producer) may not consume"
            streamed = queue_pb2.ProduceStreamRequest(request=request)
            answers = list(node.stubs.queue.ProduceStream(iter([streamed]), timeout=10, metadata=producer))
            assert [a.WhichOneof("result") for a in answers] == ["response"]
        with pytest.raises(grpc.RpcError) as denied:
            other.stubs.queue.Produce(request, timeout=10)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        keys_pb2_grpc.KeysServiceStub(nodes[home].channel).RevokeKey(
            keys_pb2.RevokeKeyRequest(key_id=made.key.key_id), timeout=15, metadata=admin
        )
        wait_until(lambda: not _produces(other, request, producer), timeout=10)
    finally:
        auth.stop()


def _produces(node, request: queue_pb2.ProduceRequest, metadata: list[tuple[str, str]]) -> bool:
    try:
        node.stubs.queue.Produce(request, timeout=10, metadata=metadata)
        return True
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
        return False


def _one_home(cluster: Cluster, name: str):
    n1 = cluster.nodes[0]
    n1.stubs.create(name, requested_partitions=1)
    (home,) = [q for q in n1.info().queues if q.queue_name == name][0].homes
    others = [n for n in cluster.nodes if n.node_id != home]
    return next(n for n in cluster.nodes if n.node_id == home), others


def test_retry_and_extend_sent_to_any_node_reach_the_items_home(cluster: Cluster) -> None:
    home, (a, b) = _one_home(cluster, "far")
    a.stubs.produce("far", [b"job"])
    leased = b.stubs.lease("far", 1)
    (item,) = leased.items
    asked = time.time()
    extended = a.stubs.queue.Extend(
        queue_pb2.ExtendRequest(queue_name="far", partition=leased.partition, ids=[item.id], lease_timeout=_dur(5)),
        timeout=10,
    )
    # The home applied it: the lease now ends 5 s after the call, not 60 s after the lease.
    assert abs(extended.lease_deadlines[0].seconds - (asked + 5)) < 3
    assert extended.lease_deadlines[0].seconds < item.lease_deadline.seconds - 30
    # b is not the home: the Retry, with its error text, is forwarded there.
    b.stubs.queue.Retry(
        queue_pb2.RetryRequest(
            queue_name="far", partition=leased.partition, items=[queue_pb2.RetryItem(id=item.id, error="OSError: far away")]
        ),
        timeout=10,
    )
    again = a.stubs.lease("far", 1)
    assert [(i.payload, i.attempts, i.last_error) for i in again.items] == [(b"job", 2, "OSError: far away")]
    b.stubs.complete("far", again.partition, [again.items[0].id])
    assert home.stubs.lease("far", 1, request_timeout=_dur(0)).items == []


def test_a_lease_key_works_whichever_node_each_call_reaches(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("keyed-leases", requested_partitions=3)
    for node in cluster.nodes:
        node.stubs.produce("keyed-leases", [f"k-{node.node_id}-{i}".encode() for i in range(3)])
    first = n1.stubs.lease("keyed-leases", 2, lease_key="worker-7")
    again = n2.stubs.lease("keyed-leases", 2, lease_key="worker-7")
    assert len(first.items) == 2
    assert [i.id for i in again.items] == [i.id for i in first.items] and again.partition == first.partition
    n3.stubs.queue.Complete(queue_pb2.CompleteRequest(queue_name="keyed-leases", lease_keys=["worker-7"]), timeout=10)
    left = sum(s.total for s in n2.stubs.stats("keyed-leases").partitions)
    assert left == 9 - 2


@pytest.mark.parametrize("via_home", [True, False])
def test_a_lease_that_completes_earlier_items_completes_them_at_their_home(cluster: Cluster, via_home: bool) -> None:
    name = f"piggyback-{via_home}"
    home, (a, b) = _one_home(cluster, name)
    a.stubs.produce(name, [b"first", b"second"])
    first = b.stubs.lease(name, 1)
    caller = home if via_home else a
    # Completes "first" (on its home) and leases "second", in one call to any node.
    second = caller.stubs.lease(
        name, 1, complete_ids=[first.items[0].id], complete_partition=first.partition
    )
    assert [i.payload for i in second.items] == [b"second"]
    stats = b.stubs.stats(name)
    assert (stats.partitions[0].total, stats.partitions[0].total_leased) == (1, 1)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--cluster", "http://127.0.0.1:2379/prod", "--node-id", "n1"], 1, "etcd://host:port/prefix"),
        (["--cluster", "etcd://127.0.0.1:2379", "--node-id", "n1"], 1, "prefix"),
        (["--cluster", "etcd://127.0.0.1:2379/prod"], 2, "--node-id"),
        (["--cluster", "etcd://127.0.0.1:{free}/prod", "--node-id", "n1"], 1, "cannot reach the cluster catalog"),
        (["--cluster", "etcd://127.0.0.1:{free}/prod", "--node-id", "n1", "--tls-cert", "nope.pem", "--tls-key", "nope.key"], 1, "cannot read the TLS"),
        (["--cluster", "etcd://127.0.0.1:2379/prod", "--node-id", "n1", "--cluster-lease-ttl", "1"], 2, "at least 2"),
        (["--replicas", "2"], 2, "--replicas above 1 keeps copies on other nodes: give --cluster too"),
        (["--min-in-sync", "1"], 2, "--min-in-sync applies to replicated queues of a cluster"),
        (["--cluster", "etcd://127.0.0.1:2379/prod", "--node-id", "n1", "--replicas", "0"], 2, "at least 1"),
    ],
)
def test_bad_cluster_settings_stop_the_server_with_a_clear_message(tmp_path, args, code, message) -> None:
    import subprocess
    import sys

    from conftest import free_port

    args = [a.replace("{free}", str(free_port())) for a in args]
    result = subprocess.run(
        [sys.executable, "-m", "querator_server.cli", "--address", f"127.0.0.1:{free_port()}",
         "--data-dir", str(tmp_path / "data"), *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == code, result.stderr
    assert message in result.stderr


def test_streams_sent_to_a_node_without_the_partition_are_forwarded_message_by_message(cluster: Cluster) -> None:
    home, (a, _) = _one_home(cluster, "streamed")
    produce = [
        queue_pb2.ProduceStreamRequest(request=queue_pb2.ProduceRequest(queue_name="streamed", payloads=[f"s{n}".encode()]))
        for n in range(20)
    ] + [queue_pb2.ProduceStreamRequest(request=queue_pb2.ProduceRequest(queue_name="no-such-queue", payloads=[b"x"]))]
    answers = list(a.stubs.queue.ProduceStream(iter(produce), timeout=30))
    assert [x.WhichOneof("result") for x in answers] == ["response"] * 20 + ["error"]
    assert answers[-1].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    lease = [queue_pb2.LeaseStreamRequest(request=queue_pb2.LeaseRequest(queue_name="streamed", batch_size=5)) for _ in range(4)]
    leased = [i.payload for x in a.stubs.queue.LeaseStream(iter(lease), timeout=30) for i in x.response.items]
    assert sorted(leased) == sorted(f"s{n}".encode() for n in range(20))
    assert sum(s.total_leased for s in home.stubs.stats("streamed").partitions) == 20


def test_a_former_single_servers_queues_are_kept_and_never_served_as_the_clusters(tmp_path) -> None:
    from cluster_helpers import Node

    data = str(tmp_path / "legacy")
    single = ThreadServer(data)
    try:
        from conftest import Stubs

        channel = grpc.insecure_channel(single.address)
        Stubs(channel).create("legacy", requested_partitions=1)
        Stubs(channel).produce("legacy", [b"from-before"])
        channel.close()
    finally:
        single.stop()
    small = Cluster(str(tmp_path / "c"), size=0)
    node = None
    try:
        small.start()
        node = Node("old", data, small.url)
        node.start()
        node.stubs.create("legacy", requested_partitions=2)  # the cluster's own queue of that name
        with pytest.raises(grpc.RpcError) as refused:
            node.stubs.produce("legacy", [b"new"])
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "before it joined" in (refused.value.details() or "")
        assert "cluster_queue_name_taken_here" in node.stderr_text()
    finally:
        if node is not None:
            node.stop()
        small.stop()
    # The old queue and its item are still in the data directory.
    again = ThreadServer(data)
    try:
        channel = grpc.insecure_channel(again.address)
        from conftest import Stubs

        assert [i.payload for i in Stubs(channel).lease("legacy", 10).items] == [b"from-before"]
        channel.close()
    finally:
        again.stop()


def test_a_forwarded_calls_invalid_argument_names_the_field_as_a_local_one_does(cluster: Cluster) -> None:
    from conftest import bad_request_fields

    home, (a, _) = _one_home(cluster, "validated")
    from google.protobuf import duration_pb2

    bad = queue_pb2.ExtendRequest(
        queue_name="validated", partition=0, ids=["1.0.1"], lease_timeout=duration_pb2.Duration(seconds=-5)
    )
    for node in (home, a):  # served at the home, and forwarded there
        with pytest.raises(grpc.RpcError) as error:
            node.stubs.queue.Extend(bad, timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_fields(error.value) == ["lease_timeout"]


def test_an_unreadable_catalog_key_is_skipped_and_the_watch_goes_on(cluster: Cluster) -> None:
    from aetcd import rpc  # type: ignore[import-untyped]

    n1, n2, _ = cluster.nodes
    channel = grpc.insecure_channel(cluster.etcd.endpoint)
    try:
        kv = rpc.KVStub(channel)
        for key, value in ((b"queues/garbled", b"not json"), (b"members/ghost", b"{}")):
            kv.Put(rpc.PutRequest(key=f"/{cluster.prefix}/".encode() + key, value=value), timeout=5)
    finally:
        channel.close()
    n1.stubs.create("after-garbage")
    wait_until(lambda: "after-garbage" in [q.queue_name for q in n2.info().queues], timeout=10)
    assert "garbled" not in [q.queue_name for q in n2.info().queues]
    n2.stubs.produce("after-garbage", [b"fine"])
    assert "catalog_key_unreadable" in n2.stderr_text()


def test_nodes_with_mutual_tls_forward_to_each_other_over_tls(tmp_path) -> None:
    import subprocess

    pki = tmp_path / "pki"
    pki.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=pki, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=test-ca")  # fmt: skip
    for name in ("node", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        (pki / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")  # fmt: skip
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes(),
        certificate_chain=(pki / "client.pem").read_bytes(),
    )
    args = ["--tls-cert", str(pki / "node.pem"), "--tls-key", str(pki / "node.key"), "--tls-client-ca", str(pki / "ca.pem")]
    secure = Cluster(str(tmp_path / "tls"), size=2, args=args, channel_credentials=credentials)
    try:
        secure.start()
        n1, n2 = secure.nodes
        n1.stubs.create("sealed", requested_partitions=1)
        (home,) = [q for q in n1.info().queues if q.queue_name == "sealed"][0].homes
        other = n2 if home == "n1" else n1
        # Forwarded to the home over mutual TLS (the node presents its own certificate).
        assert other.stubs.produce("sealed", [b"over-tls"]).partition == 0
        assert [i.payload for i in other.stubs.lease("sealed", 1).items] == [b"over-tls"]
    finally:
        secure.stop()


def test_a_listing_started_on_one_node_goes_on_on_another(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    for i in range(3):
        n1.stubs.create(f"paged-{i}")
    first = n1.stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(page_size=1), timeout=10)
    assert first.next_page_token
    second = n2.stubs.queues.ListQueues(
        queues_pb2.ListQueuesRequest(page_size=1, page_token=first.next_page_token), timeout=10
    )
    assert second.queues[0].queue_name > first.queues[0].queue_name
    # Items of a partition page the same way through any node.
    home, (a, b) = _one_home(cluster, "paged-items")
    a.stubs.produce("paged-items", [b"1", b"2", b"3"])
    from querator.v1 import storage_pb2

    page = a.stubs.storage.ListItems(storage_pb2.ListItemsRequest(queue_name="paged-items", page_size=2), timeout=10)
    rest = b.stubs.storage.ListItems(
        storage_pb2.ListItemsRequest(queue_name="paged-items", page_size=2, page_token=page.next_page_token), timeout=10
    )
    assert [i.payload for i in page.items] + [i.payload for i in rest.items] == [b"1", b"2", b"3"]
