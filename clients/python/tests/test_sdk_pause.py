"""pause_queue / resume_queue in the SDK (sync and async) and the command line, against
a real server."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

import querator
from querator.cli import main
from querator.embedded import EmbeddedServer

from sdk_helpers import client, run, srv, unique, wait_until  # noqa: F401 (fixtures)


def test_pause_holds_leases_keeps_produce_and_resume_serves_the_waiting_lease(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    info = client.pause_queue(name)
    assert (info.paused, info.produce_paused) == (True, False)
    assert client.get_queue(name).paused is True
    assert [q.paused for q in client.list_queues() if q.name == name] == [True]
    client.produce(name, [b"a", b"b"])
    assert client.lease(name, batch_size=5, wait=0.3) == []
    got: list[list[querator.LeasedItem]] = []
    waiting = threading.Thread(target=lambda: got.append(client.lease(name, batch_size=5, wait=20)))
    waiting.start()
    wait_until(lambda: client.queue_stats(name).lease_waiting == 1)
    started = time.monotonic()
    info = client.resume_queue(name)
    assert (info.paused, info.produce_paused) == (False, False)
    waiting.join(15)
    assert [item.payload for item in got[0]] == [b"a", b"b"]
    assert time.monotonic() - started < 10


def test_pause_for_produce_raises_failed_precondition(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    assert client.pause_queue(name, produce=True).produce_paused is True
    with pytest.raises(querator.FailedPrecondition, match="paused for produce"):
        client.produce(name, [b"x"])
    client.resume_queue(name)
    assert client.produce(name, [b"x"]).ids


def test_pause_of_a_missing_queue_raises_not_found(client: querator.Client) -> None:
    with pytest.raises(querator.QueueNotFound):
        client.pause_queue(unique("missing"))
    with pytest.raises(querator.QueueNotFound):
        client.resume_queue(unique("missing"))


def test_async_twins(srv: EmbeddedServer) -> None:
    async def scenario() -> None:
        name = unique()
        async with querator.AsyncClient(srv.address) as client:
            await client.create_queue(name)
            assert (await client.pause_queue(name)).paused is True
            await client.produce(name, [b"a"])
            waiting = asyncio.create_task(client.lease(name, wait=20))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            assert (await client.resume_queue(name)).paused is False
            assert [item.payload for item in await asyncio.wait_for(waiting, 10)] == [b"a"]
            assert (await client.pause_queue(name, produce=True)).produce_paused is True
            with pytest.raises(querator.FailedPrecondition):
                await client.produce(name, [b"b"])

    run(scenario())


def test_cli_pause_and_resume(srv: EmbeddedServer, capsys: pytest.CaptureFixture[str]) -> None:
    name = unique()
    assert main(["queues", "create", name, "--address", srv.address]) == 0
    capsys.readouterr()
    assert main(["queues", "pause", name, "--address", srv.address]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[6] == "PAUSED" and table[1].split()[6] == "leases"
    assert main(["queues", "pause", name, "--produce", "--json", "--address", srv.address]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["paused"], shown["produce_paused"]) == (True, True)
    assert main(["queues", "get", name, "--address", srv.address]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[6] == "leases+produce"
    assert main(["queues", "resume", name, "--address", srv.address]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[6] == "-"
