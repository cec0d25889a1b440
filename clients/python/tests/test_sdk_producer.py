"""Producer / AsyncProducer: single items in, batches out, futures resolved, flow control."""

from __future__ import annotations

import asyncio
import threading

import pytest

import querator
from querator.embedded import EmbeddedServer

from sdk_helpers import client, queue, run, srv, unique  # noqa: F401 (fixtures)


def test_producer_batches_and_resolves_futures(client: querator.Client, queue: str) -> None:
    # One batch in flight at a time: batches are stored in order.
    with querator.Producer(client, queue, max_items=100, max_latency=0.005, max_in_flight=1, kind="event") as producer:
        futures = [producer.produce(f"e{i}") for i in range(3000)]
    ids = [f.result(timeout=10) for f in futures]
    assert len(set(ids)) == 3000
    assert producer.pending == 0
    listed = list(client.list_items(queue, page_size=1000))
    assert [i.payload for i in listed] == [f"e{i}".encode() for i in range(3000)]  # one partition: in order
    assert {i.kind for i in listed} == {"event"} and [i.id for i in listed] == ids


def test_producer_latency_flush_and_flow_control(client: querator.Client, queue: str) -> None:
    producer = querator.Producer(client, queue, max_items=1000, max_latency=0.02, max_pending=50)
    try:
        single = producer.produce(b"alone")
        assert single.result(timeout=5)  # sent after max_latency, although the batch is not full
        seen: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                seen.append(producer.pending)

        watcher = threading.Thread(target=watch)
        watcher.start()
        futures = [producer.produce(querator.Item(b"x" * 100, reference=str(i))) for i in range(500)]
        producer.flush(timeout=10)
        stop.set()
        watcher.join()
        assert all(f.done() and f.exception() is None for f in futures)
        assert max(seen) <= 50  # max_pending bounds what is buffered or in flight
    finally:
        producer.close()
    with pytest.raises(RuntimeError):
        producer.produce(b"late")
    assert client.queue_stats(queue).total == 501


def test_producer_errors_reach_the_futures(client: querator.Client) -> None:
    with querator.Producer(client, unique("missing")) as producer:
        future = producer.produce("x")
    with pytest.raises(querator.QueueNotFound):
        future.result(timeout=5)


def test_async_producer(srv: EmbeddedServer) -> None:
    async def main() -> None:
        async with srv.async_client() as c:
            name = unique()
            await c.create_queue(name)
            async with querator.AsyncProducer(c, name, max_items=250, max_pending=600) as producer:
                futures = [await producer.produce(f"a{i}") for i in range(2000)]
                assert producer.pending <= 600
                first = await futures[0]
                assert first
            ids = await asyncio.gather(*futures)
            assert len(set(ids)) == 2000 and ids[0] == first
            listed = await c.list_items(name, page_size=1000).collect()
            # Several batches in flight: each batch in order, batches in any order.
            assert sorted(i.payload for i in listed) == sorted(f"a{i}".encode() for i in range(2000))
            assert sorted(i.id for i in listed) == sorted(ids)

            async with querator.AsyncProducer(c, unique("missing")) as failing:
                bad = await failing.produce("x")
            with pytest.raises(querator.QueueNotFound):
                await bad
            with pytest.raises(RuntimeError):
                await failing.produce("y")

    run(main())
