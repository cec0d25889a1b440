"""The SDK against a cluster: real etcd and three real node processes on loopback.

One cluster serves the module (starting one costs seconds); each test uses queues of its
own. The node-kill test is in test_sdk_cluster_faults.py (a cluster of its own).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import zlib
from collections.abc import Iterator

import pytest
from cluster_helpers import Cluster

import querator
from querator.embedded import EmbeddedServer
from querator.v1 import queue_pb2

from conftest import wait_until
from sdk_helpers import run, unique


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # metrics: each node's querator_queue_paused gauge shows what its actors apply.
    with Cluster(str(tmp_path_factory.mktemp("cluster")), metrics=True) as c:
        yield c


def _homes(cluster: Cluster, name: str) -> list[str]:
    for q in cluster.nodes[0].info().queues:
        if q.queue_name == name:
            return list(q.homes)
    raise AssertionError(f"queue {name} not in the map")


def _new_queue(cluster: Cluster, partitions: int = 6, **settings: object) -> str:
    name = unique("cq")
    with querator.Client(cluster.nodes[0].address) as admin:
        admin.create_queue(name, partitions=partitions, **settings)  # type: ignore[arg-type]
    wait_until(lambda: len({*_homes(cluster, name)}) == 3, timeout=20)
    return name


def test_one_bootstrap_address_finds_every_node_and_opens_a_channel_per_node(cluster: Cluster) -> None:
    name = _new_queue(cluster)
    with querator.Client(cluster.nodes[1].address) as client:
        result = client.produce(name, [b"x"] * 10, batch_size=1)
        assert client._transport.cluster.clustered is True
        assert set(client._transport.cluster.homes(name)) == {"n1", "n2", "n3"}
        # Batches went to nodes homing partitions, and each node serves them locally:
        # the partitions used belong to more than the bootstrap node alone.
        used = {_homes(cluster, name)[p] for p in result.partitions}
        assert len(used) >= 2, used
        opened = set(client._transport._nodes) | {client.config.address}
        assert opened >= {cluster.nodes[0].address, cluster.nodes[2].address} or len(opened) >= 2


def test_a_single_server_asks_cluster_info_once_and_then_routes_nothing(querator_server: EmbeddedServer) -> None:
    with querator.Client(querator_server.address) as client:
        name = unique()
        client.create_queue(name)
        transport = client._transport
        assert transport.cluster.clustered is False
        refreshed = transport.cluster.refreshed_at
        client.produce(name, [b"a", b"b"])
        items = client.lease(name, batch_size=2, wait=1)
        client.complete(items)
        # Nothing more to ask: no refresh is ever due, no other channel opened.
        assert not transport.cluster.needs_info(time.monotonic() + 10_000)
        assert transport.cluster.refreshed_at == refreshed
        assert transport._nodes == {}


def test_a_w2_like_run_spreads_the_items_evenly_over_the_nodes(cluster: Cluster) -> None:
    """2 producers and 2 consumers through the SDK: no node's partitions get more than
    1.5x the mean of what was produced, and every item is consumed exactly once."""
    name = _new_queue(cluster, lease_timeout="30s")
    addresses = [n.address for n in cluster.nodes]
    homes = _homes(cluster, name)
    per_node: collections.Counter[str] = collections.Counter()
    produced: set[tuple[int, str]] = set()
    consumed: list[tuple[int, str]] = []
    lock = threading.Lock()
    batches, batch = 60, 20
    done_producing = threading.Event()
    errors: list[BaseException] = []

    def produce(i: int) -> None:
        try:
            with querator.Client(addresses[i:] + addresses[:i]) as client:
                for b in range(batches):
                    result = client.produce(name, [f"{i}-{b}-{k}" for k in range(batch)])
                    with lock:
                        produced.update(zip(result.partitions, result.ids))
                        per_node.update(homes[p] for p in result.partitions)
        except BaseException as exc:
            errors.append(exc)

    def consume(i: int) -> None:
        try:
            with querator.Client(addresses[i + 1 :] + addresses[: i + 1]) as client:
                while True:
                    items = client.lease(name, batch_size=50, wait=0.5)
                    if items:
                        client.complete(items)
                        with lock:
                            consumed.extend((item.partition, item.message_id) for item in items)
                    elif done_producing.is_set():
                        with lock:
                            if len(consumed) >= len(produced):
                                return
        except BaseException as exc:
            errors.append(exc)

    producers = [threading.Thread(target=produce, args=(i,)) for i in range(2)]
    consumers = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join(120)
    done_producing.set()
    for t in consumers:
        t.join(120)
    assert not errors, errors
    assert len(produced) == 2 * batches * batch
    assert sorted(consumed) == sorted(produced)
    mean = sum(per_node.values()) / 3
    assert set(per_node) == {"n1", "n2", "n3"}
    assert max(per_node.values()) <= 1.5 * mean, per_node


def test_no_consumer_waits_on_an_empty_node_while_another_has_ready_items(cluster: Cluster) -> None:
    """A long Lease started before anything is produced: the items then go to one node's
    partition only, and the Lease finds them well before its wait is over."""
    name = _new_queue(cluster, partitions=3)
    homes = _homes(cluster, name)
    with querator.Client([n.address for n in cluster.nodes]) as client:
        client.lease(name, wait=0)  # the map and counts known: nothing anywhere
        # The first Lease goes to n1 (no counts: the homing nodes in turn); the items
        # go to the partition n3 homes, through n3 itself (served locally).
        got: list[querator.LeasedItem] = []
        started = time.monotonic()
        leasing = threading.Thread(target=lambda: got.extend(client.lease(name, batch_size=5, wait=60)))
        leasing.start()
        time.sleep(0.3)
        target = cluster.nodes[2]
        partition = homes.index(target.node_id)
        target.stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name=name, payloads=[b"here"] * 3), timeout=10)
        leasing.join(70)
        took = time.monotonic() - started
        assert [item.partition for item in got] and {item.partition for item in got} == {partition}
        # Without moving on it would sit on an empty node for the whole 60 s.
        assert took < 30, took
        client.complete(got)


def test_complete_retry_and_extend_go_straight_to_the_items_home(cluster: Cluster) -> None:
    """Every node but the items' home stopped: Complete, Retry and Extend still succeed,
    so none of them went through another node."""
    name = _new_queue(cluster, partitions=3)
    with querator.Client(cluster.nodes[0].address) as leaser:
        leaser.produce(name, [b"a", b"b", b"c", b"d"] * 5)
        items = leaser.lease(name, batch_size=4, wait=5)
    assert items
    home = _homes(cluster, name)[items[0].partition]
    others = [n for n in cluster.nodes if n.node_id != home]
    # Bootstrapped through a node that is not the home: it is stopped below.
    with querator.Client([others[0].address], timeout=3) as client:
        client.get_queue(name)  # the map read while every node answers
        client.lease(name, wait=0)
        for node in others:
            node.signal(19)  # SIGSTOP: it neither answers nor forwards
        try:
            client.extend(items[:1], lease_timeout=60)
            client.retry(items[1:2])
            client.complete(items[2:])
        finally:
            for node in others:
                node.signal(18)  # SIGCONT
    assert [i.state for i in items] == [None, "retried", *["completed"] * (len(items) - 2)]


def test_the_async_client_routes_the_same_way(cluster: Cluster) -> None:
    name = _new_queue(cluster, partitions=3)

    async def main() -> tuple[list[int], list[str]]:
        async with querator.AsyncClient([n.address for n in cluster.nodes], timeout=3) as client:
            result = await client.produce(name, [b"x"] * 30, batch_size=1)
            items = await client.lease(name, batch_size=30, wait=5)
            await client.complete(items)
            return result.partitions, list(client._transport._nodes)

    partitions, opened = run(main(), timeout=60)
    assert len({_homes(cluster, name)[p] for p in partitions}) >= 2
    assert opened


def test_a_producer_and_a_worker_spread_over_the_nodes_and_handle_every_item_once(cluster: Cluster) -> None:
    name = _new_queue(cluster)
    homes = _homes(cluster, name)
    handled: list[bytes] = []
    lock = threading.Lock()

    def handle(item: querator.LeasedItem) -> None:
        with lock:
            handled.append(item.payload)

    with querator.Client([n.address for n in cluster.nodes]) as client:
        with querator.Producer(client, name, max_items=10, max_latency=0.005) as producer:
            futures = [producer.produce(f"p{k}") for k in range(300)]
        ids = [f.result(30) for f in futures]
        assert len(ids) == 300
        stats = client.queue_stats(name)
        assert len({homes[p.partition] for p in stats.partitions if p.total}) >= 2
        worker = querator.Worker(client, name, handle, concurrency=4, lease_wait=5, handle_signals=False)
        with worker:
            wait_until(lambda: len(handled) >= 300, timeout=60)
        assert sorted(handled) == sorted(f"p{k}".encode() for k in range(300))
        wait_until(lambda: sum(p.total for p in client.queue_stats(name).partitions) == 0, timeout=30)


def _one_id_in_two_partitions(cluster: Cluster, **settings: object) -> str:
    """A queue whose partitions 0 and 1 (on two nodes) hold one item each under the same
    id: each node issues ids from its own counters (docs/cluster.md, Limits), so an item
    is named by its partition and its id together."""
    name = _new_queue(cluster, partitions=3, **settings)
    with querator.Client(cluster.nodes[0].address) as admin:
        ids = [admin.import_items(name, [f"in {p}"], partition=p)[0] for p in (0, 1)]
    assert ids[0] == ids[1], f"the test needs one id in two partitions, got {ids}"
    return name


def test_a_worker_stopping_completes_an_item_whose_id_another_partitions_item_has(cluster: Cluster) -> None:
    """Two items of one id (partitions 0 and 1): the first handled and completed while the
    other runs, the other returning only once the worker is stopping. stop() returns with
    both completed: it waited for the second (nothing is left leased until its lease
    timeout, then pending with no one to take it)."""
    name = _one_id_in_two_partitions(cluster)
    second_started, stopping = threading.Event(), threading.Event()
    started: list[str] = []
    lock = threading.Lock()

    def handle(item: querator.LeasedItem) -> None:
        with lock:
            started.append(item.payload.decode())
            first = len(started) == 1
        if first:  # held until the other is held too
            assert second_started.wait(20)
            return
        second_started.set()
        assert stopping.wait(20)
        time.sleep(0.5)  # still running once the worker stopped leasing (lease_grace)

    with querator.Client([n.address for n in cluster.nodes]) as client:
        worker = querator.Worker(
            client, name, handle, concurrency=2, lease_wait=5, lease_grace=0.05, handle_signals=False
        )
        with worker:
            assert second_started.wait(30)
            wait_until(lambda: worker.stats.completed == 1, timeout=20)
            stopping.set()
        assert sorted(started) == ["in 0", "in 1"]
        assert worker.stats.completed == 2, worker.stats
        assert [(p.partition, p.total) for p in client.queue_stats(name).partitions] == [(0, 0), (1, 0), (2, 0)]


def test_a_worker_keeps_alive_each_of_two_items_of_one_id_in_two_partitions(cluster: Cluster) -> None:
    """Two items of one id (partitions 0 and 1), the first handled for 2.5 lease
    timeouts while the other is handled at once: the first's lease is extended all along
    and it is completed, not lost and handled again."""
    name = _one_id_in_two_partitions(cluster, lease_timeout="2s")
    second_done = threading.Event()
    started: list[str] = []
    lock = threading.Lock()

    def handle(item: querator.LeasedItem) -> None:
        with lock:
            started.append(item.payload.decode())
            first = len(started) == 1
        if first:
            assert second_done.wait(20)
            time.sleep(5)  # 2.5 lease timeouts
            return
        second_done.set()

    with querator.Client([n.address for n in cluster.nodes]) as client:
        worker = querator.Worker(client, name, handle, concurrency=2, lease_wait=5, handle_signals=False)
        with worker:
            # Every item started is settled (an item handled again adds one to both).
            wait_until(lambda: len(started) >= 2 and worker.stats.completed + worker.stats.lost >= len(started), timeout=30)
        assert (worker.stats.completed, worker.stats.lost) == (2, 0), worker.stats
        assert sorted(started) == ["in 0", "in 1"]
        assert sum(p.total for p in client.queue_stats(name).partitions) == 0


def test_the_spark_connectors_calls_take_a_list_of_addresses_and_are_routed(cluster: Cluster) -> None:
    pytest.importorskip("pyspark", reason="the Spark connector needs: pip install 'querator-client[spark]'")
    from querator.spark._options import Connection
    from querator.spark._rpc import Rpc

    name = _new_queue(cluster, partitions=3)
    conn = Connection(
        address=",".join(n.address for n in cluster.nodes),
        queue=name,
        token="",
        tls=False,
        root_certificates=None,
        timeout=10.0,
        retries=3,
    )
    rpc = Rpc(conn)
    try:
        for k in range(12):
            rpc.produce([queue_pb2.ProduceItem(payload=f"s{k}".encode())])
        assert rpc.transport.cluster.clustered is True
        request = rpc.lease_request("spark-key", 20, 1)
        route = rpc.transport.cluster.route(rpc._call("queue", "Lease", request, None), time.monotonic())
        homes = _homes(cluster, name)
        assert route.node == homes[zlib.crc32(b"spark-key") % len(homes)]
        leased = rpc.call("queue", "Lease", request)
        rpc.complete_keys(["spark-key"])
        assert len(leased.columns.ids) >= 1
    finally:
        rpc.close()


def test_concurrent_first_calls_share_one_cluster_info(cluster: Cluster) -> None:
    name = _new_queue(cluster, partitions=3)

    async def main() -> list[str]:
        async with querator.AsyncClient([n.address for n in cluster.nodes]) as client:
            transport = client._transport
            asked: list[str] = []
            once = transport._once

            async def counting(call: object, address: str = "") -> object:
                if getattr(call, "method", "") == "ClusterInfo":
                    asked.append(",".join(call.request.queue_names))  # type: ignore[attr-defined]
                return await once(call, address)  # type: ignore[arg-type]

            transport._once = counting  # type: ignore[method-assign]
            await asyncio.gather(*(client.produce(name, [b"x"]) for _ in range(20)))
            await client.produce(name, [b"y"])
            return asked

    asked = run(main(), timeout=60)
    # One for the whole map (the queue is in it already): not one per concurrent caller.
    assert asked == [""], asked


def test_a_pause_set_through_one_node_holds_for_a_client_of_the_whole_cluster(cluster: Cluster) -> None:
    name = _new_queue(cluster, partitions=3)
    with querator.Client(cluster.nodes[2].address) as client, querator.Client(cluster.nodes[0].address) as admin:
        client.produce(name, [b"a", b"b", b"c"], batch_size=1)
        assert admin.pause_queue(name).paused is True
        # Applied by every node homing a partition (the client leases from each in turn).
        for node in cluster.nodes:
            wait_until(lambda node=node: node.gauge(f'querator_queue_paused{{queue="{name}"}}') == 1.0, timeout=15)
        assert client.lease(name, batch_size=10, wait=1) == []
        assert client.pause_queue(name, produce=True).produce_paused is True
        for node in cluster.nodes:
            wait_until(lambda node=node: node.gauge(f'querator_queue_paused{{queue="{name}"}}') == 2.0, timeout=15)
        for _ in range(3):
            with pytest.raises(querator.FailedPrecondition, match="paused for produce"):
                client.produce(name, [b"refused"])
        admin.resume_queue(name)
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            got += [item.payload for item in client.lease(name, batch_size=10, wait=1)]
        assert sorted(got) == [b"a", b"b", b"c"]


def test_a_complete_sent_again_through_another_node_is_ok_and_reported_done(cluster: Cluster) -> None:
    """Items leased through a node that does not home them (the Lease is forwarded),
    completed and retried by a client of that node, then sent again by a client of
    another node: no error, and the results name the ids already completed and
    retried; an id never produced is still ItemNotFound."""
    name = _new_queue(cluster, partitions=3, lease_timeout="600s")
    homes = _homes(cluster, name)
    home = cluster.nodes[1]
    away, other = (n for n in cluster.nodes if n is not home)
    home.stubs.produce(name, [b"a", b"b", b"c"])
    key = next(k for k in (f"k{i}" for i in range(10_000)) if homes[zlib.crc32(k.encode()) % 3] == home.node_id)
    leased = away.stubs.lease(name, 3, lease_key=key)  # away forwards it to home
    assert homes[leased.partition] == home.node_id != away.node_id
    a, b, c = (querator.ItemRef(name, leased.partition, item.id) for item in leased.items)
    with querator.Client(away.address, timeout=10) as first, querator.Client(other.address, timeout=10) as second:
        assert first.complete([a, b]) == querator.CompleteResult()
        retried = first.retry([c])
        assert (retried, retried.already_retried) == ([], ())
        # Sent again: OK, and reported done.
        assert sorted(second.complete([a, b]).already_completed) == sorted([a.id, b.id])
        retried = second.retry([c])
        assert (retried, retried.already_retried) == ([], (c.id,))  # back once
        with pytest.raises(querator.ItemNotFound):
            second.complete([a, querator.ItemRef(name, leased.partition, f"{a.id}0")])
        assert sum(p.total for p in second.queue_stats(name).partitions) == 1
