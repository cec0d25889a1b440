"""Keyed calls in a cluster: every key reaches its home, and a key's home does not
move when partitions are added (etcd + three real nodes on loopback)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import grpc
import pytest
from cluster_helpers import Cluster
from google.protobuf import field_mask_pb2

from querator.v1 import queue_pb2, queues_pb2

from conftest import Stubs, ThreadServer, wait_until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("cluster"))) as c:
        yield c


def _homes(cluster: Cluster, name: str) -> list[str]:
    return list(next(q for q in cluster.nodes[0].info().queues if q.queue_name == name).homes)


def _key_homed_on(homes: list[str], node: str, prefix: str) -> str:
    """A key whose partition (crc32 % len(homes)) is homed on ``node``."""
    return next(k for k in (f"{prefix}-{i}" for i in range(10_000)) if homes[zlib.crc32(k.encode()) % len(homes)] == node)


def _total(cluster: Cluster, name: str) -> int:
    return sum(s.total for s in cluster.nodes[0].stubs.stats(name).partitions)


def _leased_under_keys(cluster: Cluster, name: str) -> list[str]:
    """One lease key per node, each homed there, each holding that node's 2 items."""
    homes = _homes(cluster, name)
    assert sorted(homes) == ["n1", "n2", "n3"]
    for node in cluster.nodes:  # a node homing the queue stores what it receives
        node.stubs.produce(name, [f"{node.node_id}-{i}".encode() for i in range(2)])
    keys = [_key_homed_on(homes, node.node_id, "worker") for node in cluster.nodes]
    for key in keys:
        leased = cluster.nodes[0].stubs.lease(name, 5, lease_key=key)
        assert len(leased.items) == 2, key
    return keys


def test_complete_by_lease_keys_homed_on_three_nodes_completes_at_every_home(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("keys-complete", requested_partitions=3)
    keys = _leased_under_keys(cluster, "keys-complete")
    assert _total(cluster, "keys-complete") == 6
    n2.stubs.queue.Complete(queue_pb2.CompleteRequest(queue_name="keys-complete", lease_keys=keys), timeout=10)
    assert _total(cluster, "keys-complete") == 0


def test_extend_by_lease_keys_homed_on_three_nodes_extends_at_every_home(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("keys-extend", requested_partitions=3)
    keys = _leased_under_keys(cluster, "keys-extend")
    reply = n3.stubs.queue.Extend(queue_pb2.ExtendRequest(queue_name="keys-extend", lease_keys=keys), timeout=10)
    assert reply.key_items_extended == 6


def test_complete_with_ids_and_lease_keys_on_other_homes_does_both(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("keys-and-ids", requested_partitions=3)
    keys = _leased_under_keys(cluster, "keys-and-ids")
    n1.stubs.produce("keys-and-ids", [b"by-id"])
    leased = n1.stubs.lease("keys-and-ids", 1)
    assert [i.payload for i in leased.items] == [b"by-id"]
    n3.stubs.queue.Complete(
        queue_pb2.CompleteRequest(
            queue_name="keys-and-ids", partition=leased.partition, ids=[leased.items[0].id], lease_keys=keys
        ),
        timeout=10,
    )
    assert _total(cluster, "keys-and-ids") == 0


def _grow(node: Stubs, name: str, partitions: int) -> None:
    node.queues.UpdateQueue(
        queues_pb2.UpdateQueueRequest(
            queue=queues_pb2.QueueInfo(queue_name=name, requested_partitions=partitions),
            update_mask=field_mask_pb2.FieldMask(paths=["requested_partitions"]),
        ),
        timeout=15,
    )


def test_an_idempotency_key_still_dedups_after_partitions_are_added(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("keyed-grows", requested_partitions=1)
    (first_home,) = _homes(cluster, "keyed-grows")
    keys = [f"order-{i}" for i in range(20)]
    requests = [
        queue_pb2.ProduceRequest(queue_name="keyed-grows", items=[queue_pb2.ProduceItem(payload=k.encode(), idempotency_key=k)])
        for k in keys
    ]
    first = [n2.stubs.queue.Produce(r, timeout=10).ids[0] for r in requests]
    _grow(n3.stubs, "keyed-grows", 6)
    wait_until(lambda: len(_homes(cluster, "keyed-grows")) == 6, timeout=10)
    homes = _homes(cluster, "keyed-grows")
    # Some keys' crc32 % 6 lands on a partition of another node than the first one's.
    assert any(homes[zlib.crc32(k.encode()) % 6] != first_home for k in keys)
    for node in (n1, n2, n3):
        replies = [node.stubs.queue.Produce(r, timeout=10) for r in requests]
        assert [r.duplicates for r in replies] == [1] * len(keys), node.node_id
        assert [r.ids[0] for r in replies] == first
    assert _total(cluster, "keyed-grows") == len(keys)


def test_a_lease_key_finds_its_items_after_partitions_are_added(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("lease-key-grows", requested_partitions=1)
    n1.stubs.produce("lease-key-grows", [b"a", b"b"])
    key = next(k for k in (f"w-{i}" for i in range(10_000)) if zlib.crc32(k.encode()) % 6 >= 1)
    first = n2.stubs.lease("lease-key-grows", 2, lease_key=key)
    assert len(first.items) == 2
    _grow(n3.stubs, "lease-key-grows", 6)
    wait_until(lambda: len(_homes(cluster, "lease-key-grows")) == 6, timeout=10)
    again = n3.stubs.lease("lease-key-grows", 2, lease_key=key)
    assert [i.id for i in again.items] == [i.id for i in first.items]
    n1.stubs.queue.Complete(queue_pb2.CompleteRequest(queue_name="lease-key-grows", lease_keys=[key]), timeout=10)
    assert _total(cluster, "lease-key-grows") == 0


def test_a_single_server_dedups_a_key_across_added_partitions(tmp_path) -> None:
    """One server keeps one dedup index per queue, whatever its partitions."""
    server = ThreadServer(str(tmp_path / "data"))
    try:
        channel = grpc.insecure_channel(server.address)
        stubs = Stubs(channel)
        stubs.create("grows", requested_partitions=1)
        request = queue_pb2.ProduceRequest(
            queue_name="grows", items=[queue_pb2.ProduceItem(payload=b"once", idempotency_key="order-1")]
        )
        first = stubs.queue.Produce(request, timeout=10)
        _grow(stubs, "grows", 4)
        # The produce goes to an empty partition (the fewest ready), not the key's first one.
        again = stubs.queue.Produce(request, timeout=10)
        assert (again.duplicates, list(again.ids)) == (1, list(first.ids))
        assert sum(s.total for s in stubs.stats("grows").partitions) == 1
        channel.close()
    finally:
        server.stop()


def test_a_partial_failure_names_what_was_done_and_what_was_not() -> None:
    from querator_server.cluster.policy import Part
    from querator_server.cluster.router import _partial
    from querator_server.errors import DeadlineExceeded

    error = _partial(
        [(Part("n3", ("b",)), DeadlineExceeded("the deadline passed"))], [Part("n1", ("a",))], Part("n2", ("g",), ids=True)
    )
    assert isinstance(error, DeadlineExceeded)
    assert error.message == (
        "the deadline passed; not done: lease_keys ['b'] on node 'n3'; the ids (and lease_keys ['g']) on node 'n2'; "
        "done: lease_keys ['a'] on node 'n1'; sending the same request again is safe (a key already done is no error)"
    )


def test_a_complete_sent_again_through_other_nodes_answers_the_done_ids_as_done(cluster: Cluster) -> None:
    """A Complete (ids and lease keys on several homes) whose answer was lost, sent again
    through nodes that do not home the ids: the keys and ids done the first time are no
    error, the rest is completed; the same for a Retry."""
    n1 = cluster.nodes[0]
    n1.stubs.create("sent-again", requested_partitions=3, lease_timeout={"seconds": 600})
    homes = _homes(cluster, "sent-again")
    keys = []
    for node_id in sorted(set(homes)):
        node = next(n for n in cluster.nodes if n.node_id == node_id)
        node.stubs.produce("sent-again", [f"{node_id}-{i}".encode() for i in range(2)])
        keys.append(_key_homed_on(homes, node_id, "worker"))
        assert len(n1.stubs.lease("sent-again", 5, lease_key=keys[-1]).items) == 2
    home = next(n for n in cluster.nodes if n.node_id == homes[0])
    home.stubs.produce("sent-again", [b"a", b"b", b"c"])
    leased = home.stubs.lease("sent-again", 3)
    assert homes[leased.partition] == home.node_id
    a, b, c = (i.id for i in leased.items)
    away, other = [n for n in cluster.nodes if n is not home][:2]  # neither homes the ids
    first = away.stubs.queue.Complete(
        queue_pb2.CompleteRequest(queue_name="sent-again", partition=leased.partition, ids=[a], lease_keys=keys),
        timeout=10,
    )
    assert (first.key_items_completed, list(first.already_completed)) == (2 * len(keys), [])
    again = other.stubs.queue.Complete(
        queue_pb2.CompleteRequest(queue_name="sent-again", partition=leased.partition, ids=[a, b], lease_keys=keys),
        timeout=10,
    )
    assert (again.key_items_completed, list(again.already_completed)) == (0, [a])
    retry = queue_pb2.RetryRequest(queue_name="sent-again", partition=leased.partition, items=[queue_pb2.RetryItem(id=c)])
    assert list(away.stubs.queue.Retry(retry, timeout=10).already_retried) == []
    assert list(other.stubs.queue.Retry(retry, timeout=10).already_retried) == [c]
    assert _total(cluster, "sent-again") == 1  # c, back once
    with pytest.raises(grpc.RpcError) as never:
        away.stubs.queue.Complete(
            queue_pb2.CompleteRequest(queue_name="sent-again", partition=leased.partition, ids=[a, f"{c}0"]), timeout=10
        )
    assert never.value.code() == grpc.StatusCode.NOT_FOUND


# Last in the module: it kills n3.
def test_lease_keys_with_a_home_down_fail_naming_it_and_change_nothing_elsewhere(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.nodes
    n1.stubs.create("keys-down", requested_partitions=3)
    keys = _leased_under_keys(cluster, "keys-down")
    n3.kill9()
    wait_until(lambda: "n3" not in cluster.live(n1), timeout=30)
    request = queue_pb2.CompleteRequest(queue_name="keys-down", lease_keys=keys)
    with pytest.raises(grpc.RpcError) as raised:
        n2.stubs.queue.Complete(request, timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "'n3'" in raised.value.details() and repr(keys[2]) in raised.value.details()
    # Nothing was completed on the live homes: their keys' items are still leased.
    extended = n1.stubs.queue.Extend(queue_pb2.ExtendRequest(queue_name="keys-down", lease_keys=keys[:2]), timeout=10)
    assert extended.key_items_extended == 4
