"""The SDK when a cluster node is killed -9 mid-run (a cluster of its own: the kill
changes it for whatever test would come next)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
from cluster_helpers import Cluster

import querator

from conftest import wait_until
from sdk_helpers import run, unique


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("cluster"))) as c:
        yield c


def test_a_node_killed_mid_run_costs_produce_and_lease_no_error_and_loses_nothing_acknowledged(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    name = unique("cq")
    addresses = [n.address for n in cluster.nodes]
    with querator.Client(addresses[0]) as admin:
        admin.create_queue(name, partitions=6, lease_timeout="3s")
    wait_until(lambda: any(q.queue_name == name for q in cluster.nodes[0].info().queues), timeout=20)
    victim = cluster.nodes[1]
    acknowledged: set[tuple[int, str]] = set()
    completed: set[tuple[int, str]] = set()
    lock = threading.Lock()
    errors: list[BaseException] = []
    killed = threading.Event()
    stop_consuming = threading.Event()
    caplog.set_level(logging.WARNING, logger="querator.cluster")

    def produce() -> None:
        # retry_produce: a batch whose reply the kill lost is sent again (it may be stored
        # twice; never lost). Bootstrapped through the victim: it must be left for the others.
        try:
            with querator.Client([victim.address, *addresses], retry_produce=True, timeout=5) as client:
                for b in range(80):
                    result = client.produce(name, [f"{b}-{k}" for k in range(10)])
                    with lock:
                        acknowledged.update(zip(result.partitions, result.ids))
                    if b == 30:
                        victim.kill9()
                        killed.set()
        except BaseException as exc:
            errors.append(exc)

    def consume() -> None:
        try:
            with querator.Client([victim.address, *addresses], timeout=5) as client:
                while not stop_consuming.is_set():
                    items = client.lease(name, batch_size=20, wait=0.5)
                    try:
                        client.complete(items)
                    except querator.Unavailable:
                        continue  # their home is dead: they come back once it returns
                    with lock:
                        completed.update((i.partition, i.message_id) for i in items)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    threads[0].join(120)
    assert killed.is_set()
    assert not errors, errors  # no produce and no lease failed for the user
    # The dead node's partitions come back with it; then every acknowledged item drains.
    victim.start()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        with lock:
            if acknowledged <= completed:
                break
        time.sleep(0.2)
    stop_consuming.set()
    threads[1].join(60)
    assert not errors, errors
    assert len(acknowledged) >= 800
    homes = next(list(q.homes) for q in cluster.nodes[0].info().queues if q.queue_name == name)
    assert any(homes[p] == victim.node_id for p, _ in acknowledged)  # the victim had its share
    assert acknowledged - completed == set()
    assert any("is down" in r.getMessage() and victim.node_id in r.getMessage() for r in caplog.records)


def test_the_async_client_rides_over_a_node_killed_mid_run(cluster: Cluster) -> None:
    name = unique("cq")
    victim = cluster.nodes[2]
    with querator.Client(cluster.nodes[0].address) as admin:
        admin.create_queue(name, partitions=6, lease_timeout="3s")
    wait_until(lambda: all(m.live for m in cluster.nodes[0].info().members), timeout=60)

    async def main() -> tuple[set[tuple[int, str]], set[tuple[int, str]]]:
        acknowledged: set[tuple[int, str]] = set()
        leased: set[tuple[int, str]] = set()
        addresses = [victim.address, *(n.address for n in cluster.nodes[:2])]
        async with querator.AsyncClient(addresses, retry_produce=True, timeout=5) as client:
            for b in range(40):
                result = await client.produce(name, [f"a{b}-{k}" for k in range(5)])
                acknowledged.update(zip(result.partitions, result.ids))
                items = await client.lease(name, batch_size=5, wait=0.2)
                leased.update((i.partition, i.message_id) for i in items)
                if b == 15:
                    victim.kill9()
        return acknowledged, leased

    acknowledged, leased = run(main(), timeout=120)  # no produce and no lease raised
    assert len(acknowledged) == 200 and leased
    victim.start()
    wait_until(lambda: all(m.live for m in cluster.nodes[0].info().members), timeout=60)
    with querator.Client([n.address for n in cluster.nodes]) as client:
        deadline = time.monotonic() + 60
        while not acknowledged <= leased and time.monotonic() < deadline:
            items = client.lease(name, batch_size=50, wait=0.5)
            leased.update((i.partition, i.message_id) for i in items)
            client.complete(items)
    assert acknowledged - leased == set()


def test_burst_mode_waits_for_the_items_of_a_killed_node_and_drains_them_once_it_is_back(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """run(until_empty=True) with a node down: its partitions read as faulty with counts
    of 0 while they hold items. The worker neither returns early nor reports done: with
    faulty_timeout it raises Unavailable naming them; without, it waits, logging what for,
    and drains them once the node is back."""
    name = unique("burst")
    wait_until(lambda: all(m.live for m in cluster.nodes[0].info().members), timeout=60)
    addresses = [n.address for n in cluster.nodes]
    with querator.Client(addresses) as client:
        client.create_queue(name, partitions=6, lease_timeout="30s")
        produced = {f"item-{n}" for n in range(300)}
        for b in range(30):  # batches spread over the partitions, and so over the nodes
            client.produce(name, [f"item-{n}" for n in range(b * 10, b * 10 + 10)])
        homes = next(list(q.homes) for q in cluster.nodes[0].info().queues if q.queue_name == name)
        held = {n.node_id: 0 for n in cluster.nodes[1:]}
        for p in client.queue_stats(name).partitions:
            if homes[p.partition] in held:
                held[homes[p.partition]] += p.total
        victim = next(n for n in cluster.nodes if n.node_id == max(held, key=held.__getitem__))
        on_victim = held[victim.node_id]
        assert on_victim > 0
    victim.kill9()
    live = [n.address for n in cluster.nodes if n is not victim]
    handled: list[str] = []
    lock = threading.Lock()

    def handle(item: querator.LeasedItem) -> None:
        with lock:
            handled.append(item.text)

    with querator.Client(live, timeout=5) as client:
        wait_until(lambda: any(p.faulty for p in client.queue_stats(name).partitions), timeout=30)
        hasty = querator.Worker(client, name, handle, concurrency=8, lease_wait=1, faulty_timeout=1.5)
        with pytest.raises(querator.Unavailable, match="stayed faulty") as gave_up:
            hasty.run(until_empty=True)
        assert victim.node_id in str(gave_up.value)
        assert len(handled) == len(produced) - on_victim  # what the live nodes held

    caplog.set_level(logging.WARNING, logger="querator.worker")
    returned = threading.Event()
    errors: list[BaseException] = []

    def burst() -> None:
        try:
            with querator.Client(addresses, timeout=5) as client:
                querator.Worker(client, name, handle, concurrency=8, lease_wait=1).run(until_empty=True)
        except BaseException as exc:
            errors.append(exc)
        returned.set()

    thread = threading.Thread(target=burst)
    thread.start()
    try:
        assert not returned.wait(3.0), f"run(until_empty=True) returned with {on_victim} items on a dead node: {errors}"
        assert any("waiting for" in r.getMessage() and victim.node_id in r.getMessage() for r in caplog.records)
        victim.start()
        assert returned.wait(90), "the worker did not return once the node was back and drained"
    finally:
        if victim.proc is None or victim.proc.poll() is not None:
            victim.start()
        thread.join(30)
    assert not errors, errors
    assert len(handled) == len(produced) and set(handled) == produced
