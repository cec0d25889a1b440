"""The catalog's etcd watch, against a real etcd: what a yielded revision promises."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from cluster_helpers import Etcd, with_etcd_client

from querator_server.cluster.catalog import CatalogCache, Keys
from querator_server.cluster.etcd import Etcd as EtcdClient
from querator_server.cluster.etcd import Txn
from querator_server.errors import Unavailable


@pytest.fixture
def etcd(tmp_path) -> Iterator[Etcd]:
    with Etcd(str(tmp_path / "etcd")) as server:
        yield server


def test_a_watch_from_an_old_revision_never_claims_a_revision_before_its_changes_arrive(etcd: Etcd) -> None:
    """A watch that starts behind gets a 'created' answer carrying the current revision
    before the history; taken as 'caught up to here', it let a node read its catalog
    before a queue it had just created was in it (the create answered NOT_FOUND)."""

    async def run(client: EtcdClient) -> list[tuple[int, int]]:
        first = 0
        for i in range(5):
            _, revision = await client.txn(Txn().put(b"/w/q%d" % i, b"x" * i))
            first = first or revision
        claims: list[tuple[int, int]] = []  # (revision claimed, newest change seen by then)
        newest = 0
        async with asyncio.timeout(10):
            async for revision, events in client.watch(b"/w/", first):
                newest = max([newest, *(e.kv.mod_revision for e in events)])
                claims.append((revision, newest))
                if newest >= revision and newest == first + 4:
                    break
        return claims

    claims = with_etcd_client(etcd, run)
    assert claims, "the watch yielded nothing"
    assert all(claimed <= seen for claimed, seen in claims), claims


def test_a_rewatch_asked_for_while_a_change_is_applied_waits_for_the_apply(etcd: Etcd) -> None:
    """A node's standing regained (rewatch: the stream is started again) while the
    catalog applies a change: the apply finishes and the change counts as applied.
    Cancelled half-way, as before, the change was never applied (the new watch starts
    after its events) and a call waiting for it hung until the apply timeout: a first
    CreateQueue answered DEADLINE_EXCEEDED in 2 of 3 loaded runs of the contract suite."""

    async def run(client: EtcdClient) -> tuple[int, int, list[str]]:
        hold = asyncio.Event()
        held = asyncio.Event()
        done: list[str] = []

        async def on_change() -> None:
            if not hold.is_set():
                return
            held.set()
            await asyncio.sleep(0.3)  # the apply is under way when rewatch comes
            done.append("applied")

        catalog = CatalogCache(client, Keys("/c/"), on_change)
        await catalog.load()
        catalog.start()
        try:
            hold.set()
            _, revision = await client.txn(Txn().put(b"/c/deleted/q", b"{}"))
            async with asyncio.timeout(5):
                await held.wait()
            catalog.rewatch()
            try:
                await catalog.wait_applied(revision, 5)
            except Unavailable:
                pass
            return revision, catalog.applied, done
        finally:
            await catalog.stop()

    revision, applied, done = with_etcd_client(etcd, run)
    assert done == ["applied"], done
    assert applied >= revision, (applied, revision)
