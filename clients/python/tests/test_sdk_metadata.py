"""Item metadata through the SDK: produce, lease, list, import, producers and the CLI."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import querator
from querator.cli import main
from querator.embedded import EmbeddedServer

from sdk_helpers import client, queue, run, srv, unique  # noqa: F401 (fixtures)

META = {"team": "billing", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "ü": "✓"}


def test_item_metadata_is_a_copy_and_leaves_hash_alone() -> None:
    given = {"a": "1"}
    item = querator.Item(b"x", metadata=given)
    given["b"] = "2"
    assert item.metadata == {"a": "1"}
    assert querator.Item(b"x", metadata={"a": "1"}) == item != querator.Item(b"x")
    assert hash(item) == hash(querator.Item(b"x"))  # still hashable: metadata is not hashed
    assert querator.Item(b"x").metadata == {} and querator.StoredItem().metadata == {}


def test_metadata_round_trip(client: querator.Client, queue: str) -> None:
    client.produce(queue, [querator.Item("with", metadata=META), "without"])
    with querator.Producer(client, queue, max_latency=0.001) as producer:
        producer.produce(querator.Item("producer", metadata={"a": "1", "b": "2"}), metadata={"b": "3"})
        producer.produce(b"keyword", metadata={"c": "4"})

    listed = list(client.list_items(queue))
    assert [(i.payload, i.metadata) for i in listed] == [
        (b"with", META),
        (b"without", {}),
        (b"producer", {"a": "1", "b": "3"}),  # the keyword's pairs win
        (b"keyword", {"c": "4"}),
    ]
    leased = client.lease(queue, batch_size=10, wait=0)
    assert [i.metadata for i in leased] == [i.metadata for i in listed]

    # Retry keeps it (a new id, same fields); import stores it as given.
    client.retry(leased[0])
    [again] = client.lease(queue, batch_size=1, wait=1)
    assert again.text == "with" and again.metadata == META and again.id != leased[0].id
    other = unique()
    client.create_queue(other)
    client.import_items(
        other, [querator.StoredItem(payload=b"s", metadata={"x": "y"}), querator.Item("i", metadata={"k": "v"})]
    )
    assert [(i.payload, i.metadata) for i in client.list_items(other)] == [(b"s", {"x": "y"}), (b"i", {"k": "v"})]


def test_metadata_limits_come_back_as_field_violations(client: querator.Client, queue: str) -> None:
    with pytest.raises(querator.InvalidRequest) as caught:
        client.produce(queue, [querator.Item("x", metadata={f"k{i}": "v" for i in range(65)})])
    assert caught.value.field_violations[0].field == "items[0].metadata"
    with pytest.raises(querator.InvalidRequest):
        client.produce(queue, [querator.Item("x", metadata={"": "empty key"})])
    client.produce(queue, [querator.Item("x", metadata={f"k{i}": "v" for i in range(64)})])


def test_async_metadata_round_trip(srv: EmbeddedServer) -> None:
    async def main() -> None:
        async with srv.async_client() as c:
            name = unique()
            await c.create_queue(name)
            await c.produce(name, [querator.Item("one", metadata={"a": "1"}), "two"])
            async with querator.AsyncProducer(c, name, max_latency=0.001) as producer:
                await producer.produce("three", metadata={"c": "3"})
            leased = await c.lease(name, batch_size=10, wait=0)
            assert [(i.text, i.metadata) for i in leased] == [("one", {"a": "1"}), ("two", {}), ("three", {"c": "3"})]
            assert [i.metadata for i in await c.list_items(name).collect()] == [{"a": "1"}, {}, {"c": "3"}]
            await c.import_items(name, [querator.StoredItem(payload=b"four", metadata={"d": "4"})])
            assert (await c.list_items(name).collect())[-1].metadata == {"d": "4"}

    run(main())


def test_async_worker_hands_over_metadata(srv: EmbeddedServer) -> None:
    seen: dict[str, dict[str, str]] = {}

    def sync_handler(item: querator.LeasedItem) -> None:  # a sync handler gets a sync twin
        seen[item.text] = dict(item.metadata)

    async def main() -> None:
        async with srv.async_client() as c:
            name = unique()
            await c.create_queue(name)
            await c.produce(name, [querator.Item("a", metadata={"k": "v"}), "b"])
            async with querator.AsyncWorker(c, name, sync_handler, concurrency=2, lease_wait=0.2) as worker:
                while worker.stats.completed < 2:
                    await asyncio.sleep(0.01)

    run(main(), timeout=10)
    assert seen == {"a": {"k": "v"}, "b": {}}


def cli(capsys: pytest.CaptureFixture[str], srv: EmbeddedServer, *args: str) -> tuple[int, str, str]:
    code = main([*args, "--address", srv.address])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_metadata_in_json_lines(capsys: pytest.CaptureFixture[str], srv: EmbeddedServer, tmp_path: Path) -> None:
    name, copy = unique(), unique()
    assert cli(capsys, srv, "queues", "create", name)[0] == 0
    assert cli(capsys, srv, "queues", "create", copy)[0] == 0
    lines = tmp_path / "items.jsonl"
    lines.write_text(json.dumps({"payload": "one", "metadata": META}) + "\n" + json.dumps({"payload": "two"}) + "\n")
    code, out, err = cli(capsys, srv, "produce", name, "--file", str(lines), "--json")
    assert code == 0 and json.loads(out)["count"] == 2, err

    code, out, _ = cli(capsys, srv, "items", "list", name, "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["payload"], r["metadata"]) for r in rows] == [("one", META), ("two", {})]

    export = tmp_path / "export.jsonl"
    export.write_text(out)
    assert cli(capsys, srv, "items", "import", copy, str(export))[0] == 0
    code, out, _ = cli(capsys, srv, "lease", copy, "-n", "5", "--json")
    assert [(i["payload"], i["metadata"]) for i in json.loads(out)["items"]] == [("one", META), ("two", {})]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"payload": "x", "metadata": {"n": 1}}) + "\n")
    code, _, err = cli(capsys, srv, "produce", name, "--file", str(bad))
    assert code == 2 and "bad.jsonl:1: metadata must be an object of strings" in err
