"""The pipeline additions: idempotent produce, complete-and-lease, lease keys (sync and async)."""

from __future__ import annotations

from datetime import timedelta

import pytest

import querator
from querator import Item, ItemRef
from querator.embedded import EmbeddedServer

from sdk_helpers import client, queue, run, srv, unique  # noqa: F401 (fixtures)


def test_queue_settings_for_keys(client: querator.Client) -> None:
    name = unique()
    info = client.create_queue(name)
    assert info.dedup_window == timedelta(hours=24) and info.lease_key_ttl == timedelta(hours=1)
    info = client.update_queue(name, dedup_window=timedelta(minutes=5), lease_key_ttl=90)
    assert info.dedup_window == timedelta(minutes=5) and info.lease_key_ttl == timedelta(seconds=90)
    assert client.get_queue(name) == info
    other = client.create_queue(unique(), dedup_window=60, lease_key_ttl=timedelta(minutes=2))
    assert (other.dedup_window, other.lease_key_ttl) == (timedelta(minutes=1), timedelta(minutes=2))


def test_idempotent_produce(client: querator.Client, queue: str) -> None:
    first = client.produce(queue, [Item("a", idempotency_key="k-a"), Item("b", idempotency_key="k-b"), "plain"])
    assert first.duplicates == 0 and len(set(first.ids)) == 3
    again = client.produce(queue, [Item("a again", idempotency_key="k-a"), Item("c", idempotency_key="k-c")])
    assert again.duplicates == 1 and again.ids[0] == first.ids[0]
    leased = client.lease(queue, batch_size=10, wait=0)
    assert [i.text for i in leased] == ["a", "b", "plain", "c"]  # the duplicate stored nothing


def test_lease_completes_the_previous_batch(client: querator.Client, queue: str) -> None:
    client.produce(queue, [f"item-{i}" for i in range(5)])
    first = client.lease(queue, batch_size=2, wait=0)
    second = client.lease(queue, batch_size=2, wait=0, complete=first)
    assert [i.text for i in second] == ["item-2", "item-3"]
    assert all(i.state == "completed" for i in first) and client.queue_stats(queue).total == 3

    # All or nothing: one lost id (never leased) fails the call, nothing is completed or leased.
    never = querator.ItemRef(queue, 0, first[0].id.rsplit(".", 1)[0] + ".fffffff")
    with pytest.raises(querator.ItemNotFound):
        client.lease(queue, batch_size=5, wait=0, complete=[*second, never])
    assert second[0].state is None and client.queue_stats(queue).total_leased == 2

    # The completion is durable even when nothing is leased (wait=0, queue drained).
    third = client.lease(queue, batch_size=5, wait=0, complete=second)
    assert [i.text for i in third] == ["item-4"]
    assert client.lease(queue, batch_size=5, wait=0, complete=third) == []
    assert client.queue_stats(queue).total == 0

    with pytest.raises(ValueError, match="one partition"):
        client.lease(queue, wait=0, complete=[ItemRef(queue, 0, "a"), ItemRef(queue, 1, "b")])
    with pytest.raises(ValueError, match="queue"):
        client.lease(queue, wait=0, complete=ItemRef("other", 0, "a"))


def test_lease_keys(client: querator.Client, queue: str) -> None:
    client.produce(queue, ["a", "b", "c"])
    leased = client.lease(queue, batch_size=2, wait=0, lease_key="batch-1")
    again = client.lease(queue, batch_size=2, wait=0, lease_key="batch-1")
    assert [i.text for i in again] == [i.text for i in leased] == ["a", "b"]  # the same items, not new ones

    extended = client.extend(lease_keys=["batch-1"], queue_name=queue, lease_timeout=120)
    assert extended == [] and extended.key_items_extended == 2
    mixed = client.extend(leased[0], lease_keys="batch-1", queue_name=queue)
    assert len(mixed) == 1 and mixed.key_items_extended == 2

    client.complete(lease_keys="batch-1", queue_name=queue)
    client.complete(lease_keys=["batch-1"], queue_name=queue)  # idempotent
    assert client.queue_stats(queue).total == 1
    with pytest.raises(ValueError, match="queue_name"):
        client.complete(lease_keys=["batch-1"])


def test_async_pipeline_calls(srv: EmbeddedServer) -> None:
    async def main() -> None:
        async with srv.async_client() as client:
            name = unique()
            await client.create_queue(name, dedup_window=30)
            result = await client.produce(name, [Item(f"x{i}", idempotency_key=f"k{i % 3}") for i in range(6)])
            assert result.duplicates == 3 and result.ids[3:] == result.ids[:3]
            first = await client.lease(name, batch_size=1, wait=0, lease_key="key")
            second = await client.lease(name, batch_size=1, wait=0, complete=first)
            assert [i.text for i in second] == ["x1"] and first[0].state == "completed"
            assert (await client.extend(second, lease_timeout=60))[0] == second[0].lease_deadline
            keyed = await client.extend(lease_keys=["key"], queue_name=name)
            assert keyed.key_items_extended == 0  # its item is completed
            await client.complete(second)
            await client.complete(lease_keys=["key"], queue_name=name)
            assert (await client.queue_stats(name)).total == 1

    run(main())


def test_producers_carry_idempotency_keys(srv: EmbeddedServer, client: querator.Client, queue: str) -> None:
    with querator.Producer(client, queue, max_items=10, max_latency=0.005) as producer:
        futures = [producer.produce(f"p{i}", idempotency_key=f"k{i % 4}") for i in range(8)]
        keyed = producer.produce(Item("own", idempotency_key="k0"))
    ids = [f.result(timeout=5) for f in futures]
    assert ids[4:] == ids[:4] and keyed.result() == ids[0] and producer.duplicates == 5
    assert client.queue_stats(queue).total == 4

    async def main() -> None:
        async with srv.async_client() as aclient, querator.AsyncProducer(aclient, queue, max_latency=0.005) as ap:
            first = await ap.produce("again", idempotency_key="k1")
            fresh = await ap.produce(Item("new", idempotency_key="k-new"))
            assert await first == ids[1] and await fresh not in ids
            await ap.flush()
            assert ap.duplicates == 1

    run(main())
    assert client.queue_stats(queue).total == 5
