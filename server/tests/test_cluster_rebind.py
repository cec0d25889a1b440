"""An empty data directory under a node id that holds data (cluster/rebind.py), against
a real etcd: what the id holds and what starting empty would lose, the rebind's
compare-and-swap (refused while a live process holds the id, or when the catalog
changed since it was judged), and the range comparison it relies on."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from cluster_helpers import Etcd, with_etcd_client

from querator_server.cluster import rebind
from querator_server.cluster.catalog import Keys
from querator_server.cluster.etcd import Etcd as EtcdClient
from querator_server.cluster.etcd import Txn
from querator_server.cluster.shard_record import SHARD_UID_BASE, ShardRecord

KEYS = Keys("/rebind-test/")


@pytest.fixture
def etcd(tmp_path) -> Iterator[Etcd]:
    with Etcd(str(tmp_path / "etcd")) as server:
        yield server


def _entry(homes: list[str], shard: int = 0) -> bytes:
    doc: dict[str, object] = {"settings": {}, "homes": [[n, i] for i, n in enumerate(homes)], "key_partitions": len(homes)}
    if shard:
        doc.update(replicas=2, min_isr=1, shard=shard)
    return json.dumps(doc).encode()


async def _put(client: EtcdClient, key: bytes, value: bytes) -> None:
    await client.txn(Txn().put(key, value))


async def _shard(client: EtcdClient, uid: int, queue: str, primary: str, copies: list[str], isr: list[str]) -> None:
    record = ShardRecord(uid, queue, 1, 3, primary, tuple(copies), tuple((n, f"inc-{n}") for n in isr), 1)
    await _put(client, KEYS.queue(queue), _entry(copies, uid))
    await _put(client, KEYS.shard(str(uid)), record.encode())


def test_what_an_empty_start_would_lose_is_named_and_only_a_start_losing_nothing_rebinds(etcd: Etcd) -> None:
    async def run(client: EtcdClient) -> None:
        await _put(client, KEYS.binding("n1"), b"old-uuid")
        await _put(client, KEYS.queue("single"), _entry(["n1", "n2", "n1"]))
        await _shard(client, SHARD_UID_BASE, "both", "n1", ["n1", "n2"], ["n1", "n2"])
        await _shard(client, SHARD_UID_BASE + 1, "alone", "n2", ["n2", "n1"], ["n1"])
        await _shard(client, SHARD_UID_BASE + 2, "behind", "n2", ["n2", "n1"], ["n2"])
        await _shard(client, SHARD_UID_BASE + 3, "elsewhere", "n2", ["n2", "n3"], ["n2", "n3"])
        held = await rebind.holdings(client, KEYS, "n1")
        assert held.one_copy == {"single": 2}
        assert held.only_in_sync == ["alone"]
        assert sorted(held.copies) == ["alone", "behind", "both"]
        assert held.primary_of == ["both"]
        assert held.losses() == (
            "2 partition(s) of queue 'single' (one copy, kept on this node only); "
            "queue 'alone' (its only in-sync copy is this node's)"
        )
        with pytest.raises(rebind.Refused, match="'single'.*'alone'"):
            await rebind.rebind(client, KEYS, "n1", timeout=1)
        _, kv = await client.get(KEYS.binding("n1"))
        assert kv is not None and kv.value == b"old-uuid"  # refused: nothing changed

        # Once nothing would be lost (the one-copy queue gone, the lone copy joined by
        # another): rebound, unless a live process holds the id.
        await client.txn(Txn().delete(KEYS.queue("single")))
        await _shard(client, SHARD_UID_BASE + 1, "alone", "n2", ["n2", "n1"], ["n1", "n2"])
        await _put(client, KEYS.member("n1"), b'{"address": "x"}')
        with pytest.raises(rebind.Refused, match="registered by another live process"):
            await rebind.rebind(client, KEYS, "n1", timeout=0.6)
        await client.txn(Txn().delete(KEYS.member("n1")))
        new, held = await rebind.rebind(client, KEYS, "n1", timeout=1)
        _, kv = await client.get(KEYS.binding("n1"))
        assert kv is not None and kv.value == new.encode() and new != "old-uuid"
        assert held.primary_of == ["both"] and not held.losses()

    with_etcd_client(etcd, run)


def test_unchanged_since_compares_every_key_under_a_prefix(etcd: Etcd) -> None:
    async def run(client: EtcdClient) -> None:
        await _put(client, KEYS.shard("1"), b"a")
        revision, _ = await client.range_prefix(KEYS.shard(""))
        target = KEYS.binding("n1")
        ok, _ = await client.txn(Txn().unchanged_since(KEYS.shard(""), revision).put(target, b"first"))
        assert ok
        await _put(client, KEYS.shard("2"), b"b")  # a new key under the prefix
        ok, _ = await client.txn(Txn().unchanged_since(KEYS.shard(""), revision).put(target, b"second"))
        assert not ok
        _, kv = await client.get(target)
        assert kv is not None and kv.value == b"first"
        # An empty prefix holds nothing changed.
        ok, _ = await client.txn(Txn().unchanged_since(KEYS.queue(""), 1).put(target, b"third"))
        assert ok

    with_etcd_client(etcd, run)
