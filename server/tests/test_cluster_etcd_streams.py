"""The etcd client's streaming calls (watch, lease keepalive) against a real etcd that
dies: a call that failed leaves nothing of itself running."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from cluster_helpers import Etcd, with_etcd_client

from querator_server.cluster.etcd import Etcd as EtcdClient
from querator_server.cluster.etcd import EtcdError


@pytest.fixture
def etcd(tmp_path) -> Iterator[Etcd]:
    with Etcd(str(tmp_path / "etcd")) as server:
        yield server


def _request_readers() -> list[asyncio.Task[object]]:
    """grpc's tasks reading a streaming call's requests, still running."""
    return [t for t in asyncio.all_tasks() if not t.done() and "_consume_request_iterator" in repr(t.get_coro())]


def test_a_watch_and_a_keepalive_that_fail_when_etcd_dies_leave_no_request_stream_waiting(etcd: Etcd) -> None:
    """grpc leaves the reader of a finished call's request stream waiting on it, and
    cancelling a finished call does nothing: the client's endless request streams kept
    one task per failed call waiting for ever, until the garbage collector destroyed it
    pending ("Task was destroyed but it is pending!", "aclose(): asynchronous generator
    is already running": error lines in every node's log after each etcd outage)."""

    async def run(client: EtcdClient) -> list[str]:
        lease = await client.grant(10)
        assert await client.keep_alive(lease, timeout=5) > 0
        watching = asyncio.get_running_loop().create_task(anext(client.watch(b"/s/", 1)))
        await asyncio.sleep(0.5)  # the watch is open, waiting for a change
        assert not watching.done()
        etcd.kill9()
        with pytest.raises(EtcdError):
            async with asyncio.timeout(10):
                await watching
        for _ in range(3):  # each attempt while etcd is away is one failed call
            with pytest.raises(EtcdError):
                await client.keep_alive(lease, timeout=2)
        await asyncio.sleep(0.2)  # a reader told to stop ends within a turn or two
        return [repr(t.get_coro()) for t in _request_readers()]

    assert with_etcd_client(etcd, run) == []
