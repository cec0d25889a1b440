"""Shard records changed by compare-and-swap, against a real etcd: ISR shrink and
expand, elections, and who wins a race."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from cluster_helpers import Etcd, with_etcd_client

from querator_server.cluster.etcd import Etcd as EtcdClient
from querator_server.cluster.etcd import Txn
from querator_server.cluster.shard_cas import BelowMinIsr, Deposed
from querator_server.cluster.shard_record import SHARD_UID_BASE, Move, ShardRecord
from querator_server.cluster.shard_table import ShardTable

PREFIX = b"/shards-test/"


@dataclass
class Member:
    node: str
    create_revision: int


@pytest.fixture
def etcd(tmp_path) -> Iterator[Etcd]:
    with Etcd(str(tmp_path / "etcd")) as server:
        yield server


async def _member(client: EtcdClient, node: str) -> Member:
    _, revision = await client.txn(Txn().put(PREFIX + b"members/" + node.encode(), b'{"address": "x"}'))
    return Member(node, revision)


async def _shard(client: EtcdClient, table: ShardTable, copies: list[str], min_isr: int) -> ShardRecord:
    uid = await table.next_uid()
    record = ShardRecord.new(uid, "q", copies, min_isr)
    await client.txn(Txn().created_at(table.key(uid), 0).put(table.key(uid), record.encode()))
    fetched = await table.fetch(uid)
    assert fetched is not None
    return fetched


def test_a_shrink_and_an_election_from_one_version_race_and_exactly_one_wins(etcd: Etcd) -> None:
    async def run(client: EtcdClient) -> list[tuple[str, object]]:
        n1, n2 = await _member(client, "n1"), await _member(client, "n2")
        await _member(client, "n3")
        primary = ShardTable(client, PREFIX, n1)
        candidate = ShardTable(client, PREFIX, n2)
        outcomes: list[tuple[str, object]] = []
        for _ in range(10):
            record = await _shard(client, primary, ["n1", "n2", "n3"], 1)
            results = await asyncio.gather(
                primary.shrink_isr(record, "n3"),
                candidate.elect(record, "n2", [("n2", "i2"), ("n3", "i3")]),
                return_exceptions=True,
            )
            won = [r for r in results if isinstance(r, ShardRecord)]
            lost = [r for r in results if isinstance(r, Deposed)]
            assert len(won) == 1 and len(lost) == 1, results
            now = await primary.fetch(record.uid)
            assert now == won[0], (now, won)
            assert lost[0].current == now
            outcomes.append(("shrink" if now.epoch == 1 else "elect", now))
        return outcomes

    outcomes = with_etcd_client(etcd, run)
    for kind, record in outcomes:
        assert isinstance(record, ShardRecord)
        if kind == "shrink":
            assert record.primary == "n1" and record.in_sync() == ("n1", "n2")
        else:
            assert (record.epoch, record.primary, record.isr) == (2, "n2", (("n2", "i2"), ("n3", "i3")))


def test_a_change_from_a_stale_version_is_deposed_and_names_the_current_one(etcd: Etcd) -> None:
    async def run(client: EtcdClient) -> None:
        n1, n2 = await _member(client, "n1"), await _member(client, "n2")
        record = await _shard(client, ShardTable(client, PREFIX, n1), ["n1", "n2"], 1)
        elected = await ShardTable(client, PREFIX, n2).elect(record, "n2", [("n2", "b")])
        assert (elected.epoch, elected.primary) == (2, "n2")
        with pytest.raises(Deposed, match="epoch 2, primary 'n2'") as caught:
            await ShardTable(client, PREFIX, n1).shrink_isr(record, "n2")
        assert caught.value.current == elected

    with_etcd_client(etcd, run)


def test_a_writer_whose_membership_lapsed_changes_nothing(etcd: Etcd) -> None:
    async def run(client: EtcdClient) -> None:
        n1 = await _member(client, "n1")
        record = await _shard(client, ShardTable(client, PREFIX, n1), ["n1", "n2"], 1)
        await _member(client, "n1")  # registered again: the old create revision is gone
        await client.txn(Txn().delete(PREFIX + b"members/n1"))
        await _member(client, "n1")
        with pytest.raises(Deposed, match="lost its cluster membership"):
            await ShardTable(client, PREFIX, n1).shrink_isr(record, "n2")
        assert await ShardTable(client, PREFIX).fetch(record.uid) == record

    with_etcd_client(etcd, run)


def test_a_shrink_below_the_minimum_is_refused_and_changes_nothing(etcd: Etcd) -> None:
    async def run(client: EtcdClient) -> None:
        n1 = await _member(client, "n1")
        table = ShardTable(client, PREFIX, n1)
        record = await _shard(client, table, ["n1", "n2", "n3"], 2)
        record = await table.shrink_isr(record, "n3")
        assert record.in_sync() == ("n1", "n2")
        with pytest.raises(BelowMinIsr, match="leave 1 in-sync copy, below its minimum of 2"):
            await table.shrink_isr(record, "n2")
        assert await table.fetch(record.uid) == record
        # A copy back in sync, then its incarnation claimed: one entry per node.
        record = await table.expand_isr(record, ("n3", "c3"))
        record = await table.expand_isr(record, ("n2", "c2"))
        assert record.isr == (("n1", ""), ("n3", "c3"), ("n2", "c2"))
        assert await table.fetch(record.uid) == record

    with_etcd_client(etcd, run)


def test_shard_uids_are_handed_out_once_from_far_above_a_data_directorys_own(etcd: Etcd) -> None:
    async def run(client: EtcdClient) -> list[int]:
        table = ShardTable(client, PREFIX)
        return list(await asyncio.gather(*(table.next_uid() for _ in range(8))))

    uids = with_etcd_client(etcd, run)
    assert sorted(uids) == list(range(SHARD_UID_BASE, SHARD_UID_BASE + 8))


def test_a_retired_nodes_copy_leaves_the_record_never_the_primarys(etcd: Etcd) -> None:
    async def run(client: EtcdClient) -> None:
        n1 = await _member(client, "n1")
        table = ShardTable(client, PREFIX, n1)
        record = await _shard(client, table, ["n1", "n2"], 2)
        with pytest.raises(ValueError, match="is its primary"):
            await table.drop_copy(record, "n1")
        dropped = await table.drop_copy(record, "n2")
        assert (dropped.replicas, dropped.isr, dropped.min_isr) == (("n1",), (("n1", ""),), 1)
        assert await table.fetch(record.uid) == dropped

    with_etcd_client(etcd, run)


def test_a_move_is_recorded_with_its_new_copy_let_go_and_cleared_with_either_copy(etcd: Etcd) -> None:
    async def run(client: EtcdClient) -> None:
        n1 = await _member(client, "n1")
        table = ShardTable(client, PREFIX, n1)
        record = await _shard(client, table, ["n1", "n2"], 1)
        move = Move("n1", "n3", lead=True, by="n1", by_revision=n1.create_revision, until_us=123)
        with pytest.raises(ValueError, match="does not fit"):
            await table.add_copy(record, "n4", move)  # a move names the copy it adds
        added = await table.add_copy(record, "n3", move)
        assert added.move == move and added.replicas == ("n1", "n2", "n3") and "n3" not in added.in_sync()
        fetched = await table.fetch(record.uid)
        assert fetched == added  # stored with the record, read back the same
        with pytest.raises(ValueError, match="is under way"):  # one move at a time
            await table.add_copy(added, "n4", dataclasses.replace(move, source="n2", target="n4"))
        let_go = await table.let_go(added)
        assert let_go.move is not None and let_go.move.by == "" and let_go.move.target == "n3"
        # Another copy leaving keeps the move; the source or the target leaving ends it.
        kept = await table.drop_copy(let_go, "n2")
        assert kept.move == let_go.move and kept.replicas == ("n1", "n3")
        undone = await table.drop_copy(kept, "n3")
        assert undone.move is None and undone.replicas == ("n1",)
        assert b"move" not in undone.encode()  # a record without a move reads as one of an older version

    with_etcd_client(etcd, run)
