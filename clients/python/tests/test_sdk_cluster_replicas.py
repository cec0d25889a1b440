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


class _Blocking:
    """The sync or the async client behind one blocking face (the async one on a loop
    of its own, over its ProduceStream and LeaseStream)."""

    def __init__(self, kind: str, addresses: list[str]) -> None:
        self.loop = asyncio.new_event_loop() if kind == "async" else None
        options = {"timeout": 5, "cluster_refresh": 3600}
        self.client = querator.AsyncClient(addresses, **options) if self.loop else querator.Client(addresses, **options)

    def __call__(self, method: str, *args: object, **kw: object):  # type: ignore[no-untyped-def]
        result = getattr(self.client, method)(*args, **kw)
        return self.loop.run_until_complete(result) if self.loop else result

    def homes(self, queue: str) -> list[str]:
        return self.client._transport.cluster.homes(queue)

    def close(self) -> None:
        if self.loop:
            self.loop.run_until_complete(self.client.close())
            self.loop.close()
        else:
            self.client.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_call_refused_by_a_node_that_is_not_the_primary_rereads_the_map_and_goes_on(cluster: Cluster, kind: str) -> None:
    for node in cluster.nodes:  # the test before killed one: back, and live everywhere
        if node.proc is None or node.proc.poll() is not None:
            node.start()
    wait_until(lambda: cluster.live(cluster.nodes[0]) == {n.node_id for n in cluster.nodes}, timeout=30)
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
    client = _Blocking(kind, [nodes[bystander].address, nodes[new].address, nodes[old].address])
    try:
        assert client("produce", name, ["before"]).ids
        assert client.homes(name) == [old, old]

        # The primary dies, and its in-sync set is left with itself alone (as a primary
        # drops a silent copy): no copy may take over by itself, so the shard waits.
        nodes[old].kill9()
        assert _change(cluster, name, bystander, "shrink", new) == 1
        wait_until(lambda: old not in cluster.live(nodes[bystander]), timeout=30)
        # No primary it can reach: the node that has the call names the one it knows.
        with pytest.raises(querator.Unavailable, match=f"not primary: {old} epoch 1"):
            client("produce", name, ["refused"])

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
        assert client("produce", name, ["after"]).ids
        assert client.homes(name) == [new, new]
        got: list[bytes] = []
        for _ in range(10):  # a lease answers from one partition at a time
            got += [item.payload for item in client("lease", name, batch_size=10, wait=0.5)]
            if len(got) >= 2:
                break
        assert sorted(got) == [b"after", b"before"]  # the copy kept what the old primary acknowledged
    finally:
        client.close()
