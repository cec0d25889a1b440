"""AsyncClient: the same calls as Client, awaited, against a real server."""

from __future__ import annotations

import socket
from datetime import UTC, datetime, timedelta

import pytest

import querator
from querator import ItemRef
from querator.embedded import EmbeddedServer

from sdk_helpers import run, srv, unique  # noqa: F401 (fixtures)


def test_async_queue_admin(srv: EmbeddedServer) -> None:
    async def main() -> None:
        async with srv.async_client() as c:
            dlq, name = unique("dlq"), unique()
            await c.create_queue(dlq)
            info = await c.create_queue(name, dead_queue=dlq, max_attempts=2, lease_timeout=15, partitions=2)
            assert (info.dead_queue, info.max_attempts, info.partitions) == (dlq, 2, 2)
            assert await c.get_queue(name) == info
            assert (await c.update_queue(name, reference="note")).reference == "note"
            with pytest.raises(querator.QueueExists):
                await c.create_queue(name)
            names = [q.name async for q in c.list_queues(page_size=2)]
            assert name in names and dlq in names and names == sorted(names)
            pages = [page async for page in c.list_queues(page_size=1).pages()]
            assert len(pages) >= 2
            assert name in [q.name for q in await c.list_queues().collect()]
            stats = await c.queue_stats(name)
            assert [p.partition for p in stats.partitions] == [0, 1]
            await c.produce(name, ["x"])
            await c.clear_queue(name)
            assert (await c.queue_stats(name)).total == 0
            with pytest.raises(querator.FailedPrecondition):
                await c.delete_queue(dlq)  # it is name's dead-letter queue
            await c.delete_queue(name)
            with pytest.raises(querator.QueueNotFound):
                await c.get_queue(name)
            with pytest.raises(querator.InvalidRequest) as bad:
                await c.create_queue("a/b")
            assert bad.value.field_violations[0].field == "queue.queue_name"

    run(main())


def test_async_produce_lease_settle(srv: EmbeddedServer) -> None:
    async def main() -> None:
        async with srv.async_client() as c:
            dlq, name = unique("dlq"), unique()
            await c.create_queue(dlq)
            await c.create_queue(name, dead_queue=dlq, lease_timeout=10)
            result = await c.produce(name, (f"item-{i}" for i in range(2345)), kind="bulk", max_in_flight=3)
            assert len(result) == 2345 and len(set(result.ids)) == 2345
            items = await c.lease(name, batch_size=5, wait=0)
            numbers = [int(i.text.split("-")[1]) for i in items]
            # FIFO within a request; requests in flight together may be stored in any order.
            assert numbers == list(range(numbers[0], numbers[0] + 5)) and numbers[0] % 1000 == 0
            assert all(i.kind == "bulk" and i.attempts == 1 for i in items)
            a, b, d, e, f = items
            await a.complete()
            await b.retry(in_=timedelta(hours=1))
            await d.dead()
            deadline = await e.extend(lease_timeout=60)
            assert e.lease_deadline == deadline > datetime.now(UTC) + timedelta(seconds=50)
            async with f:
                pass
            assert (a.state, b.state, d.state, f.state) == ("completed", "retried", "dead", "completed")
            await c.complete(a)  # sent again: answered as done
            with pytest.raises(querator.ItemNotFound):
                await c.complete(b)  # retried, not completed
            with pytest.raises(querator.NotLeased):
                await c.retry(ItemRef(name, 0, result.ids[100]))
            scheduled = await c.list_scheduled_items(name).collect()
            assert [s.payload for s in scheduled] == [b.payload]
            dead = await c.list_items(dlq).collect()
            assert [s.payload for s in dead] == [d.payload] and dead[0].source_id == d.id
            listed = [i async for i in c.list_items(name, page_size=500)]
            assert len(listed) == 2345 - 4  # completed two, one scheduled, one dead

            big = await c.produce(name, [b"y" * 1_200_000] * 5)  # 6 MB: needs two requests
            assert len(big) == 5 and all(big.ids)

    run(main())


def test_async_leased_item_context_manager_and_errors(srv: EmbeddedServer) -> None:
    async def main() -> None:
        async with srv.async_client() as c:
            dlq, name = unique("dlq"), unique()
            await c.create_queue(dlq)
            await c.create_queue(name, dead_queue=dlq)
            await c.produce(name, ["boom", "poison"])
            boom, poison = await c.lease(name, batch_size=2, wait=0)
            with pytest.raises(KeyError):
                async with boom:
                    raise KeyError("x")
            async with poison:
                raise querator.DeadLetter()
            assert (boom.state, poison.state) == ("retried", "dead")
            assert [i.payload async for i in c.list_items(dlq)] == [b"poison"]
            with pytest.raises(querator.QueueNotFound) as missing:
                await c.produce(unique("missing"), ["a"])
            assert missing.value.produced is None

    run(main())


def test_async_storage_and_empty_lease(srv: EmbeddedServer) -> None:
    async def main() -> None:
        async with srv.async_client() as c:
            name = unique()
            await c.create_queue(name)
            ids = await c.import_items(name, [querator.StoredItem(payload=b"imp", attempts=3), querator.Item("it")])
            assert len(ids) == 2
            items = await c.list_items(name).collect()
            assert [(i.payload, i.attempts) for i in items] == [(b"imp", 3), (b"it", 0)]
            await c.delete_items(name, ids[:1])
            assert [i.payload for i in await c.list_items(name).collect()] == [b"it"]
            await c.produce(name, ["later"], enqueue_at=datetime.now(UTC) + timedelta(minutes=10))
            assert len(await c.list_scheduled_items(name).collect()) == 1
            leased = await c.lease(name, batch_size=10, wait=0.2)
            assert [i.payload for i in leased] == [b"it"]
            assert await c.lease(name, wait=0.3) == []

    run(main())


def test_async_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        backoff = querator.Backoff(initial=timedelta(milliseconds=10), maximum=timedelta(milliseconds=20))
        async with querator.AsyncClient(f"127.0.0.1:{port}", retries=1, backoff=backoff, timeout=2) as c:
            with pytest.raises(querator.Unavailable):
                await c.queue_stats("x")
            with pytest.raises(querator.Unavailable):
                await c.wait_ready(timeout=0.2)

    run(main())
