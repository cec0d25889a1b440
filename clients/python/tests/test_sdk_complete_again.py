"""Complete and Retry after a lost answer: both clients send them again on UNAVAILABLE
and the server answers the ids the first send settled as done.

The answer is really lost: the client talks to the server through a loopback proxy
that throws the server's replies away, and once the server has applied the call the
proxy cuts the connection (the client sees UNAVAILABLE) and lets the next one through.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cluster_helpers import DOWN, PASS, Proxy

import querator
from querator.embedded import EmbeddedServer

from sdk_helpers import client, srv, unique, wait_until  # noqa: F401 (fixtures)


@pytest.fixture
def proxy(srv: EmbeddedServer) -> Iterator[Proxy]:
    front = Proxy(srv.address)
    yield front
    front.close()


def _lose_the_answer(proxy: Proxy, applied: Callable[[], bool]) -> None:
    """Once ``applied``, cut the connection whose reply was dropped, then let calls pass."""
    wait_until(applied, timeout=10)
    proxy.cut()
    proxy.mode(DOWN, PASS)
    proxy.restore()


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def body() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            out.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def test_a_complete_whose_answer_was_lost_is_sent_again_and_succeeds(
    client: querator.Client, proxy: Proxy
) -> None:
    name = unique()
    client.create_queue(name, lease_timeout=600)
    client.produce(name, ["a", "b", "c"])
    with querator.Client(proxy.address, retries=5) as far:
        items = far.lease(name, batch_size=3, wait=1)
        assert len(items) == 3
        proxy.drop_replies()
        thread, out = _in_thread(lambda: far.complete(items[:2]))
        _lose_the_answer(proxy, lambda: client.queue_stats(name).partitions[0].total_leased == 1)
        thread.join(20)
        # The repeat is answered OK and names the ids the lost first send completed.
        assert out == [querator.CompleteResult(already_completed=(items[0].id, items[1].id))], out
        assert [i.state for i in items[:2]] == ["completed", "completed"]
        # Retry the same way: the one left goes back once, not twice.
        proxy.drop_replies()
        thread, out = _in_thread(lambda: far.retry(items[2:]))
        _lose_the_answer(proxy, lambda: client.queue_stats(name).partitions[0].total_leased == 0)
        thread.join(20)
        assert out == [[]], out  # nothing dead-lettered
        assert out[0].already_retried == (items[2].id,)
        assert items[2].state == "retried"
    stats = client.queue_stats(name).partitions[0]
    assert (stats.total, stats.total_leased) == (1, 0)
    (again,) = client.lease(name, batch_size=10, wait=1)
    assert again.payload == b"c" and again.attempts == 2


def test_the_async_client_sends_a_complete_again_after_a_lost_answer(client: querator.Client, proxy: Proxy) -> None:
    name = unique()
    client.create_queue(name, lease_timeout=600)
    client.produce(name, ["a", "b"])

    async def main() -> None:
        async with querator.AsyncClient(proxy.address, retries=5) as far:
            items = await far.lease(name, batch_size=2, wait=1)
            assert len(items) == 2
            proxy.drop_replies()
            completing = asyncio.ensure_future(far.complete(items))
            await asyncio.to_thread(
                _lose_the_answer, proxy, lambda: client.queue_stats(name).partitions[0].total_leased == 0
            )
            done = await asyncio.wait_for(completing, 20)
            assert sorted(done.already_completed) == sorted(i.id for i in items)
            assert [i.state for i in items] == ["completed", "completed"]

    asyncio.run(asyncio.wait_for(main(), 60))
    assert client.queue_stats(name).partitions[0].total == 0


def test_a_first_send_reports_nothing_done_before(client: querator.Client) -> None:
    """What complete and retry return when no answer was lost: nothing already done;
    lease_keys count the items they completed; a retry lists only the dead."""
    name = unique()
    client.create_queue(name, lease_timeout=600)
    client.produce(name, ["a", "b", "c", "d"])
    a, b = client.lease(name, batch_size=2, wait=1)
    assert a.complete() == querator.CompleteResult()
    retried = client.retry([b])
    assert (retried, retried.already_retried, b.state) == ([], (), "retried")
    leased = client.lease(name, batch_size=2, wait=1, lease_key="k")
    (last,) = client.lease(name, batch_size=1, wait=1)
    dead = last.dead()
    assert (dead, dead.already_retried, last.state) == ([last.id], (), "dead")
    assert client.complete(lease_keys="k", queue_name=name) == querator.CompleteResult(key_items_completed=len(leased))
    assert client.complete(lease_keys="k", queue_name=name) == querator.CompleteResult()


async def _async_first_send(address: str, name: str) -> tuple[querator.CompleteResult, list[str], tuple[str, ...]]:
    async with querator.AsyncClient(address) as aclient:
        a, b = await aclient.lease(name, batch_size=2, wait=1)
        retried = await b.retry()
        return await a.complete(), list(retried), retried.already_retried


def test_the_async_client_returns_the_same_results(client: querator.Client, srv: EmbeddedServer) -> None:
    name = unique()
    client.create_queue(name, lease_timeout=600)
    client.produce(name, ["a", "b"])
    assert asyncio.run(_async_first_send(srv.address, name)) == (querator.CompleteResult(), [], ())


def test_with_retry_complete_off_the_lost_answer_surfaces(client: querator.Client, proxy: Proxy) -> None:
    """The switch for older servers: the call fails UNAVAILABLE (what the test above
    would see without the retry), though the server did complete the item."""
    name = unique()
    client.create_queue(name, lease_timeout=600)
    client.produce(name, ["a"])
    with querator.Client(proxy.address, retries=5, retry_complete=False) as far:
        items = far.lease(name, batch_size=1, wait=1)
        proxy.drop_replies()
        thread, out = _in_thread(lambda: far.complete(items))
        _lose_the_answer(proxy, lambda: client.queue_stats(name).partitions[0].total_leased == 0)
        thread.join(20)
        assert len(out) == 1 and isinstance(out[0], querator.Unavailable), out


def test_a_worker_whose_completion_answer_was_lost_counts_it_completed_once(client: querator.Client, proxy: Proxy) -> None:
    """The worker sends the completion again and the server answers it as done (against a
    server that answered NOT_FOUND, the worker never counted the item completed)."""
    name = unique()
    client.create_queue(name, lease_timeout=600)
    client.produce(name, ["job"])
    calls: list[str] = []

    def handler(item: querator.LeasedItem) -> None:
        calls.append(item.text)
        proxy.drop_replies()  # the answer to the completion that follows is lost

    with querator.Client(proxy.address, retries=5) as far:
        with querator.Worker(far, name, handler, concurrency=1, batch_size=1, lease_wait=1) as worker:
            _lose_the_answer(proxy, lambda: calls == ["job"] and client.queue_stats(name).total == 0)
            wait_until(lambda: worker.stats.completed == 1, timeout=20)
            stats = worker.stats
    # (A Lease cut with the connection may count in stats.errors: its client_id is still
    # waiting on the server when it is sent again; that is not the completion's doing.)
    assert (stats.completed, stats.lost, calls) == (1, 0, ["job"]), stats
