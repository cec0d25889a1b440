"""Item priorities through the SDK: produce (Item, produce(priority=), producers),
lease, list, import, the CLI, and a cluster through a node that homes nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import Cluster

import querator
from querator.cli import main
from querator.embedded import EmbeddedServer

from conftest import wait_until
from sdk_helpers import client, queue, run, srv, unique  # noqa: F401 (fixtures)


def test_priorities_round_trip_and_order_leases(client: querator.Client, queue: str) -> None:
    client.create_queue(other := unique())
    client.produce(queue, [querator.Item("low"), querator.Item("high", priority=9), "plain"])
    client.produce(queue, ["mid-a", "mid-b"], priority=5)
    with querator.Producer(client, queue, max_latency=0.001, priority=7) as producer:
        producer.produce("producer")
        producer.produce(querator.Item("own", priority=2))
    listed = {i.payload.decode(): i.priority for i in client.list_items(queue)}
    assert listed == {"low": 0, "high": 9, "plain": 0, "mid-a": 5, "mid-b": 5, "producer": 7, "own": 2}
    leased = client.lease(queue, batch_size=10, wait=0)
    assert [(i.text, i.priority) for i in leased] == [
        ("high", 9), ("producer", 7), ("mid-a", 5), ("mid-b", 5), ("own", 2), ("low", 0), ("plain", 0)
    ]  # fmt: skip
    client.retry(leased[0])
    [again] = client.lease(queue, batch_size=1, wait=1)
    assert (again.text, again.priority) == ("high", 9)
    client.import_items(other, [querator.StoredItem(payload=b"s", priority=3), querator.Item("i", priority=4)])
    assert [(i.payload, i.priority) for i in client.list_items(other)] == [(b"s", 3), (b"i", 4)]


def test_a_priority_out_of_range_names_the_field(client: querator.Client, queue: str) -> None:
    with pytest.raises(querator.InvalidRequest) as caught:
        client.produce(queue, [querator.Item("ok", priority=9), querator.Item("x", priority=10)])
    assert caught.value.field_violations[0].field == "items[1].priority"


def test_async_priorities(srv: EmbeddedServer) -> None:
    async def main() -> None:
        async with srv.async_client() as c:
            name = unique()
            await c.create_queue(name)
            await c.produce(name, ["zero", querator.Item("one", priority=1)])
            async with querator.AsyncProducer(c, name, max_latency=0.001, priority=6) as producer:
                await producer.produce("six")
            leased = await c.lease(name, batch_size=10, wait=0)
            assert [(i.text, i.priority) for i in leased] == [("six", 6), ("one", 1), ("zero", 0)]

    run(main())


def cli(capsys: pytest.CaptureFixture[str], srv: EmbeddedServer, *args: str) -> tuple[int, str, str]:
    code = main([*args, "--address", srv.address])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_priorities(capsys: pytest.CaptureFixture[str], srv: EmbeddedServer, tmp_path: Path) -> None:
    name = unique()
    assert cli(capsys, srv, "queues", "create", name)[0] == 0
    assert cli(capsys, srv, "produce", name, "urgent", "--priority", "8")[0] == 0
    lines = tmp_path / "items.jsonl"
    lines.write_text(json.dumps({"payload": "two", "priority": 2}) + "\n" + json.dumps({"payload": "zero"}) + "\n")
    assert cli(capsys, srv, "produce", name, "--file", str(lines))[0] == 0
    code, out, _ = cli(capsys, srv, "items", "list", name)
    header, *rows = out.splitlines()
    assert header.split()[4] == "PRIORITY"
    assert sorted(row.split()[4] for row in rows) == ["0", "2", "8"]
    code, out, _ = cli(capsys, srv, "lease", name, "-n", "5", "--json")
    assert [(i["payload"], i["priority"]) for i in json.loads(out)["items"]] == [("urgent", 8), ("two", 2), ("zero", 0)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with Cluster(str(tmp_path_factory.mktemp("cluster"))) as c:
        yield c


def test_priorities_in_a_cluster_through_a_node_homing_nothing(cluster: Cluster) -> None:
    name = unique("cq")
    with querator.Client(cluster.nodes[0].address) as admin:
        admin.create_queue(name, partitions=1)
    wait_until(lambda: any(q.queue_name == name and q.homes for q in cluster.nodes[0].info().queues), timeout=20)
    (home,) = next(q.homes for q in cluster.nodes[0].info().queues if q.queue_name == name)
    outsider = next(n for n in cluster.nodes if n.node_id != home)
    with querator.Client(outsider.address) as c:
        c.produce(name, ["a", querator.Item("b", priority=3), querator.Item("c", priority=9)])
        leased = c.lease(name, batch_size=10, wait=1)
        assert [(i.text, i.priority) for i in leased] == [("c", 9), ("b", 3), ("a", 0)]
        c.complete(leased)
