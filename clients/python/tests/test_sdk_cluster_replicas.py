"""The SDK and a replicated queue whose primary changes: a node that can neither serve
nor forward a call answers "not primary: <node> epoch <e>", and the client reads the
map again and goes on at the new primary (a cluster of its own: a node is killed)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster_helpers import Cluster

import querator

from conftest import wait_until
from sdk_helpers import unique


@dataclass
class _Writer:
    node: str
    create_revision: int


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # A membership TTL long enough that the survivor is out of the in-sync set well
    # before the killed primary's membership lapses (else it would take over itself).
    with Cluster(str(tmp_path_factory.mktemp("cluster")), ttl=6) as c:
        yield c


def _record(cluster: Cluster, queue: str):  # type: ignore[no-untyped-def]
    """The queue's shard record, read from etcd."""
    from querator_server.cluster.etcd import Etcd
    from querator_server.cluster.shard_table import ShardTable

    async def run():  # type: ignore[no-untyped-def]
        client = Etcd([cluster.etcd.endpoint])
        try:
            prefix = f"/{cluster.prefix}/".encode()
            _, entry = await client.get(prefix + b"queues/" + queue.encode())
            assert entry is not None
            return await ShardTable(client, prefix).fetch(json.loads(entry.value)["shard"])
        finally:
            await client.close()

    return asyncio.run(run())


def _change(cluster: Cluster, queue: str, writer: str, change: str, node: str) -> int:
    """One change of the queue's shard record through its compare-and-swap, as the
    primary or a failover makes it, written under ``writer``'s membership: ``shrink``
    drops ``node`` from the in-sync set; ``elect`` makes it primary (alone in sync) under
    the next epoch. Returns the record's epoch after."""
    from querator_server.cluster.etcd import Etcd
    from querator_server.cluster.shard_table import ShardTable

    async def run() -> int:
        client = Etcd([cluster.etcd.endpoint])
        try:
            prefix = f"/{cluster.prefix}/".encode()
            _, entry = await client.get(prefix + b"queues/" + queue.encode())
            _, member = await client.get(prefix + b"members/" + writer.encode())
            assert entry is not None and member is not None
            table = ShardTable(client, prefix, _Writer(writer, member.create_revision))
            record = await table.fetch(json.loads(entry.value)["shard"])
            assert record is not None
            if change == "shrink":
                return (await table.shrink_isr(record, node)).epoch
            return (await table.elect(record, node, [(node, _claimed[(queue, node)])])).epoch
        finally:
            await client.close()

    return asyncio.run(run())


# The incarnation each copy claimed in the in-sync set, remembered by the test before
# the copy was dropped from it.
_claimed: dict[tuple[str, str], str] = {}


def _placement(cluster: Cluster, node: int, queue: str):  # type: ignore[no-untyped-def]
    return next(q for q in cluster.nodes[node].info().queues if q.queue_name == queue)


def test_a_call_refused_by_a_node_that_is_not_the_primary_rereads_the_map_and_goes_on(cluster: Cluster) -> None:
    name = unique("rq")
    cluster.nodes[0].stubs.create(name, replicas=2, requested_partitions=2)
    placement = _placement(cluster, 0, name)
    old, new = placement.replicas
    assert (placement.primary, placement.epoch) == (old, 1)
    nodes = {n.node_id: n for n in cluster.nodes}
    bystander = next(n for n in nodes if n not in (old, new))
    # Both copies in step, each under its own incarnation.
    wait_until(lambda: all(i for _, i in _record(cluster, name).isr), timeout=20)
    _claimed.update(((name, n), i) for n, i in _record(cluster, name).isr)
    # The primary last: with it gone, the default channel reaches a live node.
    addresses = [nodes[bystander].address, nodes[new].address, nodes[old].address]
    with querator.Client(addresses, timeout=5, cluster_refresh=3600) as client:
        assert client.produce(name, ["before"]).ids
        assert client._transport.cluster.homes(name) == [old, old]

        # The primary dies, and its in-sync set is left with itself alone (as a primary
        # drops a silent copy): no copy may take over by itself, so the shard waits.
        nodes[old].kill9()
        assert _change(cluster, name, bystander, "shrink", new) == 1
        wait_until(lambda: old not in cluster.live(nodes[bystander]), timeout=30)
        # No primary it can reach: the node that has the call names the one it knows.
        with pytest.raises(querator.Unavailable, match=f"not primary: {old} epoch 1"):
            client.produce(name, ["refused"])

        # The operator's view says so too (and exits 3).
        status = subprocess.run(
            [str(Path(sys.executable).parent / "querator"), "--address", nodes[bystander].address, "cluster", "status", "--json"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert status.returncode == 3 and f"queue {name}: its primary {old} is not live" in json.loads(status.stdout)["problems"]

        assert _change(cluster, name, new, "elect", new) == 2
        wait_until(lambda: _placement(cluster, int(bystander[1:]) - 1, name).primary == new, 10)
        # The refusal made the client read the map again before this call (its own
        # refresh is an hour away): it goes straight to the new primary.
        assert client.produce(name, ["after"]).ids
        assert client._transport.cluster.homes(name) == [new, new]
        got: list[bytes] = []
        for _ in range(10):  # a lease answers from one partition at a time
            got += [item.payload for item in client.lease(name, batch_size=10, wait=0.5)]
            if len(got) >= 2:
                break
        assert sorted(got) == [b"after", b"before"]  # the copy kept what the old primary acknowledged
