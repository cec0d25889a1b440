"""The SDK and a replicated queue whose primary changes: a node that can neither serve
nor forward a call answers "not primary: <node> epoch <e>", and the client reads the
map again and goes on at the new primary (a cluster of its own: a node is killed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass

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
    with Cluster(str(tmp_path_factory.mktemp("cluster"))) as c:
        yield c


def _elect(cluster: Cluster, queue: str, primary: str) -> int:
    """An election made straight through the shard record's compare-and-swap, as the
    failover does, written under ``primary``'s own membership: the new epoch."""
    from querator_server.cluster.etcd import Etcd
    from querator_server.cluster.shard_table import ShardTable

    async def run() -> int:
        client = Etcd([cluster.etcd.endpoint])
        try:
            prefix = f"/{cluster.prefix}/".encode()
            _, entry = await client.get(prefix + b"queues/" + queue.encode())
            _, member = await client.get(prefix + b"members/" + primary.encode())
            assert entry is not None and member is not None
            table = ShardTable(client, prefix, _Writer(primary, member.create_revision))
            record = await table.fetch(json.loads(entry.value)["shard"])
            assert record is not None
            elected = await table.elect(record, primary, [(n, i) for n, i in record.isr if n == primary])
            return elected.epoch
        finally:
            await client.close()

    return asyncio.run(run())


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
    # The primary last: with it gone, the default channel reaches a live node.
    addresses = [nodes[bystander].address, nodes[new].address, nodes[old].address]
    with querator.Client(addresses, timeout=5, cluster_refresh=3600) as client:
        assert client.produce(name, ["before"]).ids
        assert client._transport.cluster.homes(name) == [old, old]

        nodes[old].kill9()
        wait_until(lambda: old not in cluster.live(nodes[bystander]), timeout=20)
        # No primary it can reach: the node that has the call names the one it knows.
        with pytest.raises(querator.Unavailable, match=f"not primary: {old} epoch 1"):
            client.produce(name, ["refused"])

        epoch = _elect(cluster, name, new)
        assert epoch == 2
        wait_until(lambda: _placement(cluster, int(bystander[1:]) - 1, name).primary == new, 10)
        # The refusal made the client read the map again before this call (its own
        # refresh is an hour away): it goes straight to the new primary.
        assert client.produce(name, ["after"]).ids
        assert client._transport.cluster.homes(name) == [new, new]
        leased = client.lease(name, batch_size=10, wait=1)
        assert [item.payload for item in leased] == [b"after"]  # the new primary's copy
