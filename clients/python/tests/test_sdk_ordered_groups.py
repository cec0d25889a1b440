"""Ordered groups in the Python SDK (sync and async twins, Producer and AsyncProducer)
and the command line, against a real server. Deliveries are checked by payload."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

import pytest

import querator
from querator.cli import main
from querator.embedded import EmbeddedServer

from sdk_helpers import client, run, srv, unique  # noqa: F401 (fixtures)


def test_items_of_a_group_are_leased_one_at_a_time_in_order(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name, lease_timeout=60)
    client.produce(name, [querator.Item(b"A1", group_key="A"), querator.Item(b"A2", group_key="A")])
    client.produce(name, [querator.Item(b"B1", group_key="B"), b"plain"])
    first = client.lease(name, batch_size=10, wait=0.3)
    assert sorted(i.payload for i in first) == [b"A1", b"B1", b"plain"]
    assert {i.payload: i.group_key for i in first} == {b"A1": "A", b"B1": "B", b"plain": ""}
    assert client.lease(name, batch_size=10, wait=0.3) == []
    stats = client.queue_stats(name).partitions[0]
    assert (stats.total, stats.groups_in_flight) == (4, 2) and stats.oldest_waiting_in_group is not None
    a1 = next(i for i in first if i.payload == b"A1")
    a1.complete()
    assert [i.payload for i in client.lease(name, batch_size=10, wait=0.3)] == [b"A2"]
    listed = {i.payload: i.group_key for i in client.list_items(name)}
    assert listed[b"A2"] == "A"


def test_a_too_long_group_key_is_refused_naming_the_field(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    with pytest.raises(querator.InvalidRequest, match=r"items\[0\]\.group_key"):
        client.produce(name, [querator.Item(b"x", group_key="k" * 513)])


def test_the_producer_keeps_each_groups_order_across_batches(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name, partitions=3, lease_timeout=60)
    rng = random.Random(7)
    produced: dict[str, list[int]] = {f"g{i}": [] for i in range(12)}
    with querator.Producer(client, name, max_items=7, max_in_flight=4) as producer:
        for n in range(600):
            key = rng.choice(list(produced))
            produced[key].append(n)
            producer.produce(f"{key}/{n}".encode(), group_key=key)
    seen: dict[str, list[int]] = {k: [] for k in produced}
    for _ in range(2000):
        batch = client.lease(name, batch_size=50, wait=0.3)
        if not batch and sum(map(len, seen.values())) == 600:
            break
        for item in batch:
            key, n = item.text.split("/")
            seen[key].append(int(n))
            item.complete()
    assert seen == produced


def test_async_twins(srv: EmbeddedServer) -> None:
    async def scenario() -> None:
        name = unique()
        async with querator.AsyncClient(srv.address) as aclient:
            await aclient.create_queue(name, partitions=2, lease_timeout=60)
            async with querator.AsyncProducer(aclient, name, max_items=5, max_in_flight=4) as producer:
                for n in range(200):
                    await producer.produce(f"{n % 5}/{n}".encode(), group_key=f"g{n % 5}")
            seen: dict[str, list[int]] = {}
            for _ in range(1000):
                batch = await aclient.lease(name, batch_size=20, wait=0.3)
                if not batch and sum(map(len, seen.values())) == 200:
                    break
                for item in batch:
                    key, n = item.text.split("/")
                    seen.setdefault(key, []).append(int(n))
                    assert item.group_key == f"g{key}"
                    await item.complete()
            assert seen == {str(k): list(range(k, 200, 5)) for k in range(5)}
            stats = await aclient.queue_stats(name)
            assert sum(p.groups_in_flight for p in stats.partitions) == 0

    run(scenario(), timeout=90)


def test_cli_stats_shows_groups(client: querator.Client, srv: EmbeddedServer, capsys: pytest.CaptureFixture[str]) -> None:
    name = unique()
    client.create_queue(name, lease_timeout=60)
    client.produce(name, [querator.Item(b"A1", group_key="A"), querator.Item(b"A2", group_key="A")])
    client.lease(name, batch_size=10, wait=0.3)
    assert main(["queues", "stats", name, "--address", srv.address]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[7:9] == ["GROUPS_IN_FLIGHT", "OLDEST_WAITING_IN_GROUP"]
    assert table[1].split()[7] == "1"
    assert main(["queues", "stats", name, "--json", "--address", srv.address]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["partitions"][0]["groups_in_flight"] == 1


def test_a_groups_batches_are_never_in_flight_together(client: querator.Client, srv: EmbeddedServer) -> None:
    """With room for four batches in flight, a group's next batch still waits for the
    answer to the one before it (else the server could store them in either order);
    another group's batch goes meanwhile."""
    name = unique()
    client.create_queue(name)
    in_flight: dict[str, int] = {}
    most: dict[str, int] = {}
    lock = threading.Lock()
    producer = querator.Producer(client, name, max_items=3, max_in_flight=4, max_latency=0.001)
    start = producer._transport.start  # the real transport, watched

    def watched(call: Any) -> Any:
        groups = {item.group_key for item in call.request.items if item.group_key} | {"*"}
        with lock:
            for g in groups:
                in_flight[g] = in_flight.get(g, 0) + 1
                most[g] = max(most.get(g, 0), in_flight[g])
        future = start(call)

        def done(_f: Any) -> None:
            with lock:
                for g in groups:
                    in_flight[g] -= 1

        future.add_done_callback(done)
        return future

    producer._transport = type("Watched", (), {"__getattr__": lambda self, n: getattr(client._transport, n), "start": staticmethod(watched)})()
    with producer:
        for n in range(300):
            producer.produce(f"{n}".encode(), group_key="one" if n % 2 else "two")
    assert (most["one"], most["two"]) == (1, 1)
    assert most["*"] > 1  # batches of two groups did overlap: the limit was there to use


def test_an_async_groups_batches_are_never_in_flight_together(srv: EmbeddedServer) -> None:
    async def scenario() -> None:
        name = unique()
        async with querator.AsyncClient(srv.address) as aclient:
            await aclient.create_queue(name)
            producer = querator.AsyncProducer(aclient, name, max_items=3, max_in_flight=4, max_latency=0.001)
            invoke = aclient._transport.invoke
            in_flight: dict[str, int] = {}
            most: dict[str, int] = {}

            async def watched(call: Any) -> Any:
                groups = {item.group_key for item in call.request.items if item.group_key} | {"*"}
                for g in groups:
                    in_flight[g] = in_flight.get(g, 0) + 1
                    most[g] = max(most.get(g, 0), in_flight[g])
                try:
                    return await invoke(call)
                finally:
                    for g in groups:
                        in_flight[g] -= 1

            producer._transport = type("Watched", (), {"__getattr__": lambda self, n: getattr(aclient._transport, n), "invoke": staticmethod(watched)})()
            async with producer:
                for n in range(300):
                    await producer.produce(f"{n}".encode(), group_key="one" if n % 2 else "two")
            assert (most["one"], most["two"]) == (1, 1)
            assert most["*"] > 1

    run(scenario(), timeout=90)
