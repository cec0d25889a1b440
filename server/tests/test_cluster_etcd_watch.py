"""The catalog's etcd watch, against a real etcd: what a yielded revision promises."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from cluster_helpers import Etcd, with_etcd_client

from querator_server.cluster.etcd import Etcd as EtcdClient
from querator_server.cluster.etcd import Txn


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
