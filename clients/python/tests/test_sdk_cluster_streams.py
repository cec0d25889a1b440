"""The AsyncClient's Produce and Lease streams in a cluster: real etcd and three real
node processes serving metrics, one cluster for the module (its last test kills a node).

Where each request went, and as what, is read from the nodes' own metrics:
``querator_rpc_requests_total`` counts each message of a stream under ProduceStream /
LeaseStream and each unary call under its method (a forwarded request on the node that
forwarded it and, as a unary call, on the node that served it).

Items are counted by ``(partition, message_id)``: a Produce answers the id each item was
produced with, which every later lease keeps as ``message_id``, while the item's ``id``
changes when it is delivered again (a lease that ran out, its answer lost with its node).
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from cluster_helpers import Cluster, Node, Proxy
from prometheus_client.parser import text_string_to_metric_families

import querator
from querator.v1 import queue_pb2, queue_pb2_grpc, queues_pb2, queues_pb2_grpc

from conftest import wait_until
from sdk_helpers import run, unique


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("cluster")), metrics=True) as c:
        yield c


def _requests(node: Node, queue: str) -> dict[str, float]:
    """querator_rpc_requests_total of ``queue`` on ``node``, by method (every code)."""
    with urllib.request.urlopen(f"http://{node.metrics_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "querator_rpc_requests_total" and sample.labels["queue"] == queue:
                method = sample.labels["method"]
                out[method] = out.get(method, 0.0) + sample.value
    return out


def _homes(cluster: Cluster, name: str) -> list[str]:
    for q in cluster.nodes[0].info().queues:
        if q.queue_name == name:
            return list(q.homes)
    return []


def _new_queue(cluster: Cluster, **settings: object) -> str:
    name = unique("cs")
    wait_until(lambda: len(cluster.live(cluster.nodes[0])) == 3, timeout=60)
    with querator.Client(cluster.nodes[0].address) as admin:
        admin.create_queue(name, partitions=6, **settings)  # type: ignore[arg-type]
    wait_until(lambda: len({*_homes(cluster, name)}) == 3, timeout=20)
    return name


def test_produce_lease_and_completes_riding_on_leases_travel_on_a_stream_per_node(cluster: Cluster) -> None:
    name = _new_queue(cluster, lease_timeout="30s")
    homes = _homes(cluster, name)

    async def main() -> tuple[list[tuple[int, str]], list[tuple[int, str]], dict[str, dict[str, float]], set[tuple[str, str]]]:
        async with querator.AsyncClient([n.address for n in cluster.nodes], timeout=10) as client:
            produced: list[tuple[int, str]] = []
            for b in range(30):
                result = await client.produce(name, [f"{b}-{k}" for k in range(10)])
                produced.extend(zip(result.partitions, result.ids))
            # While every node still holds ready items (each has about 100: a node with
            # none would forward the Lease to another, which counts it as a unary Lease):
            # a Lease to a node chosen by the counts, then one that completes its items
            # at their home and leases there, then their Complete.
            leased: list[tuple[int, str]] = []
            for _ in range(6):
                items = await client.lease(name, batch_size=10, wait=0)
                more = await client.lease(name, batch_size=10, wait=0, complete=items)
                await client.complete(more)
                leased.extend((i.partition, i.message_id) for i in [*items, *more])
            counts = {node.node_id: await asyncio.to_thread(_requests, node, name) for node in cluster.nodes}
            # Then the rest, wherever it is.
            deadline = time.monotonic() + 60
            while len(leased) < len(produced) and time.monotonic() < deadline:
                items = await client.lease(name, batch_size=50, wait=0.5)
                leased.extend((i.partition, i.message_id) for i in items)
                await client.complete(items)
            streams = {(a, m) for a, m, q in client._transport.streams._streams if q == name}
            return produced, leased, counts, streams

    produced, leased, counts, streams = run(main(), timeout=120)
    assert sorted(leased) == sorted(produced) and len(produced) == 300  # each item leased once
    assert {homes[p] for p, _ in leased} == {"n1", "n2", "n3"}
    # Produce on a stream to each node; Lease on streams too, to more than one node; no
    # unary Produce or Lease anywhere, none forwarded (it would count as unary where served).
    assert {n.address for n in cluster.nodes} == {a for a, m in streams if m == "Produce"}
    assert len({a for a, m in streams if m == "Lease"}) >= 2
    assert sum(c.get("ProduceStream", 0) for c in counts.values()) == 30, counts
    assert all(c.get("ProduceStream", 0) > 0 for c in counts.values()), counts
    assert sum(c.get("LeaseStream", 0) for c in counts.values()) == 12, counts
    assert not [(n, m) for n, c in counts.items() for m in c if m in ("Produce", "Lease")], counts
    with querator.Client(cluster.nodes[0].address) as client:
        wait_until(lambda: client.queue_stats(name).total == 0, timeout=30)


def _stream_addresses(client: querator.AsyncClient) -> set[str]:
    return {address for address, _, _ in client._transport.streams._streams}


def test_a_node_killed_between_requests_costs_an_unretried_produce_no_error_and_stores_nothing_twice(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Produce without retries: a request that meets the dead node's stream before the
    stream learnt of the death is never sent (a new stream is opened and refused), so it
    goes to another node instead of failing; nothing is sent twice."""
    name = _new_queue(cluster, lease_timeout="5s")
    victim = cluster.nodes[2]
    caplog.set_level(logging.WARNING, logger="querator.cluster")

    async def main() -> list[tuple[int, str]]:
        acknowledged: list[tuple[int, str]] = []
        async with querator.AsyncClient([n.address for n in cluster.nodes[:2]], timeout=5, cluster_refresh=1) as client:
            b = 0
            while victim.address not in _stream_addresses(client) or b < 10:
                result = await client.produce(name, [f"{b}-{k}" for k in range(5)])
                acknowledged.extend(zip(result.partitions, result.ids))
                b += 1
                assert b < 200
            channel = client._transport._node(victim.address)[0]
            victim.kill9()
            # Blocking, so the client's event loop has not run since the kill: gRPC knows
            # the connection is gone, the stream's call does not know it yet.
            deadline = time.monotonic() + 10
            while channel.get_state() is grpc.ChannelConnectivity.READY and time.monotonic() < deadline:
                time.sleep(0.01)
            for after in range(40):
                result = await client.produce(name, [f"after-{after}-{k}" for k in range(5)])
                acknowledged.extend(zip(result.partitions, result.ids))
            # Once the cluster no longer lists its address (its membership ran out), the
            # node's streams and channel are closed.
            deadline = time.monotonic() + 30
            while victim.address in _stream_addresses(client) and time.monotonic() < deadline:
                result = await client.produce(name, ["late"])
                acknowledged.extend(zip(result.partitions, result.ids))
                await asyncio.sleep(0.1)
            assert victim.address not in _stream_addresses(client)
            assert victim.address not in client._transport._nodes
        return acknowledged

    acknowledged = run(main(), timeout=120)  # no produce raised
    assert any("is down" in r.getMessage() and victim.node_id in r.getMessage() for r in caplog.records)
    victim.start()
    wait_until(lambda: len(cluster.live(cluster.nodes[0])) == 3, timeout=60)
    leased: list[tuple[int, str]] = []
    with querator.Client([n.address for n in cluster.nodes]) as client:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (len(leased) < len(acknowledged) or client.queue_stats(name).total):
            items = client.lease(name, batch_size=50, wait=0.5)
            leased.extend((i.partition, i.message_id) for i in items)
            client.complete(items)
    assert sorted(leased) == sorted(acknowledged)  # nothing lost, nothing stored twice


def test_a_node_killed_with_requests_in_flight_on_its_streams_costs_no_error_and_loses_nothing(cluster: Cluster) -> None:
    name = _new_queue(cluster, lease_timeout="3s")
    victim = cluster.nodes[1]
    addresses = [victim.address, *(n.address for n in cluster.nodes if n is not victim)]

    async def main() -> tuple[set[tuple[int, str]], set[tuple[int, str]]]:
        acknowledged: set[tuple[int, str]] = set()
        leased: set[tuple[int, str]] = set()
        produced = asyncio.Event()
        # retry_produce: a batch in flight when the node died has an unknown outcome; it
        # is sent again (maybe stored twice, never lost). Leases are retried anyway.
        async with querator.AsyncClient(addresses, retry_produce=True, timeout=5) as client:

            async def produce(worker: int) -> None:
                for b in range(60):
                    result = await client.produce(name, [f"{worker}-{b}-{k}" for k in range(5)])
                    acknowledged.update(zip(result.partitions, result.ids))
                    if worker == 0 and b == 20:
                        assert victim.address in _stream_addresses(client)
                        await asyncio.to_thread(victim.kill9)  # the others go on meanwhile

            async def consume() -> None:
                while not produced.is_set() or len(leased) < 100:
                    items = await client.lease(name, batch_size=10, wait=0.2)
                    leased.update((i.partition, i.message_id) for i in items)
                    if items:
                        try:
                            await client.complete(items)
                        except querator.Unavailable:
                            pass  # their home is dead: they come back after it returns

            async def producers() -> None:
                await asyncio.gather(produce(0), produce(1))
                produced.set()

            await asyncio.gather(producers(), consume())
        return acknowledged, leased

    acknowledged, leased = run(main(), timeout=180)  # no produce and no lease raised
    assert len(acknowledged) == 600
    victim.start()
    wait_until(lambda: len(cluster.live(cluster.nodes[0])) == 3, timeout=60)
    with querator.Client([n.address for n in cluster.nodes]) as client:
        deadline = time.monotonic() + 60
        while not acknowledged <= leased and time.monotonic() < deadline:
            items = client.lease(name, batch_size=50, wait=0.5)
            leased.update((i.partition, i.message_id) for i in items)
            client.complete(items)
        missing = acknowledged - leased
        # Where the missing items are, to tell lost from held (leased, or on a node away).
        where = {
            p: [(i.id, i.message_id, i.is_leased, i.lease_deadline, i.attempts) for i in client.list_items(name, partition=p)]
            for p in sorted({p for p, _ in missing})
        }
        homes = _homes(cluster, name)
        live = cluster.live(cluster.nodes[0])
    assert missing == set(), (sorted(missing), where, homes, live)


def test_items_whose_lease_answer_was_lost_and_whose_home_was_killed_are_all_delivered_again(cluster: Cluster) -> None:
    """A Lease the home committed and answered, the answer lost on its way (a proxy drops
    it, the connection stays up); then kill -9 of the home and a restart. Every item comes
    back once the lost lease runs out: the same (partition, message_id), a new id, its
    second attempt."""
    name = unique("cs")
    wait_until(lambda: len(cluster.live(cluster.nodes[0])) == 3, timeout=60)
    with querator.Client(cluster.nodes[0].address) as admin:
        admin.create_queue(name, partitions=3, lease_timeout="3s")  # one per node
    wait_until(lambda: len({*_homes(cluster, name)}) == 3, timeout=20)
    home = next(n for n in cluster.nodes if n.node_id == _homes(cluster, name)[0])

    async def produce() -> set[tuple[int, str]]:
        async with querator.AsyncClient([n.address for n in cluster.nodes], timeout=10) as client:
            acknowledged: set[tuple[int, str]] = set()
            for b in range(30):  # one partition per Produce: spread over the nodes
                result = await client.produce(name, [f"item-{b}-{k}" for k in range(3)])
                acknowledged.update(zip(result.partitions, result.ids))
        return acknowledged

    acknowledged = run(produce(), timeout=60)
    mine = {(p, i) for p, i in acknowledged if _homes(cluster, name)[p] == home.node_id}
    assert mine  # its one partition's

    proxy = Proxy(home.address)
    try:
        with grpc.insecure_channel(proxy.address) as channel:
            queues_pb2_grpc.QueuesServiceStub(channel).GetQueueStats(
                queues_pb2.GetQueueStatsRequest(queue_name=name), timeout=10
            )  # the connection is up before its answers are dropped
            proxy.drop_replies()
            request = queue_pb2.LeaseRequest(queue_name=name, batch_size=len(mine), request_timeout={"seconds": 0})
            with pytest.raises(grpc.RpcError) as lost:
                queue_pb2_grpc.QueueServiceStub(channel).Lease(request, timeout=2)
            assert lost.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        proxy.close()
    with querator.Client(home.address) as client:
        # The home leased its items (its own partitions only: no call is forwarded).
        stats = client.queue_stats(name)
        assert sum(p.total_leased for p in stats.partitions) == len(mine), stats
    home.kill9()
    home.start()
    wait_until(lambda: len(cluster.live(cluster.nodes[0])) == 3, timeout=60)

    async def drain() -> list[querator.AsyncLeasedItem]:
        got: list[querator.AsyncLeasedItem] = []
        async with querator.AsyncClient([n.address for n in cluster.nodes], timeout=10) as client:
            deadline = time.monotonic() + 60
            while {(i.partition, i.message_id) for i in got} != acknowledged and time.monotonic() < deadline:
                items = await client.lease(name, batch_size=50, wait=0.5)
                got.extend(items)
                await client.complete(items)
        return got

    delivered = run(drain(), timeout=120)
    again = [i for i in delivered if (i.partition, i.message_id) in mine]
    assert sorted((i.partition, i.message_id) for i in delivered) == sorted(acknowledged)  # each once, none lost
    assert all(i.attempts == 2 and i.id != i.message_id for i in again), [(i.id, i.message_id, i.attempts) for i in again]
    assert not {(i.partition, i.id) for i in again} & mine  # counted by id, they would read as lost
