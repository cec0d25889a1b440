"""The change sets of one Ship call applied to a copy in one durable write
(ReplicaCopy.apply_all, CopyHost.ship), on real LMDB, with a copy of its own and in a
commit group: the same copy as one by one (positions, digests, what a restart would
load), a prefix held already skipped, a refused change leaving the changes before it
applied and durable, and one commit for the call."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from replication_helpers import SHARD_UID, Home, make_home

from querator_server.cluster.replica_host import CopyHost, Shard
from querator_server.cluster.replica_wire import Ship
from querator_server.storage.change_set import ChangeSet, Diverged, Fenced, Position
from querator_server.storage.replica_copy import ReplicaCopy
from querator_server.storage.replica_state import ReplicaState

MODES = pytest.mark.parametrize("grouped", [False, True], ids=["own", "grouped"])


def _change(lsn: int, epoch: int = 1) -> ChangeSet:
    """Change ``lsn``: an item put in a partition, the item of the change before deleted."""
    ops: list[tuple[str, bytes, bytes | None]] = [(f"p{lsn % 2}", b"i%08d" % lsn, b"payload %d" % lsn)]
    if lsn > 1:
        ops.append((f"p{(lsn - 1) % 2}", b"i%08d" % (lsn - 1), None))
    ops.append(("p0", b"n%08d" % lsn, b"x" * (lsn % 7)))
    return ChangeSet(SHARD_UID, epoch, lsn, ops)


class Copy:
    """A copy of SHARD_UID on real LMDB, counting the commits that make it durable."""

    def __init__(self, home: Home, path: str) -> None:
        self.home = home
        self.path = path
        self.own_commits = 0
        self.copy: ReplicaCopy

    async def open(self) -> Copy:
        home = self.home
        if home.group is None:
            os.makedirs(self.path, exist_ok=True)
        store = await home.open(self.path, SHARD_UID, 2)
        if home.group is None:
            store.on_commit = self._committed
        state = await home.job(lambda: ReplicaState(store, None, SHARD_UID))
        self.copy = ReplicaCopy("q", state, home.lane, home.group)
        return self

    def _committed(self, _seconds: float) -> None:
        self.own_commits += 1

    def commits(self) -> int:
        return self.home.group.commits if self.home.group is not None else self.own_commits

    def seen(self) -> tuple[Position, str, tuple[Position, int, str], list[tuple[int, int]]]:
        """Position and digest, as held in memory and as stored, and the epoch history."""
        state = self.copy.state
        return state.position(), state.digest()[1], state.stored(), state.history()

    async def close(self) -> None:
        await self.copy.close()
        await self.home.close()


@asynccontextmanager
async def _copies(root: Any, grouped: bool, n: int = 2) -> AsyncIterator[list[Copy]]:
    copies = [await Copy(make_home(str(root), f"copy-{i}", grouped), str(root / f"copy-{i}")).open() for i in range(n)]
    try:
        yield copies
    finally:
        for copy in copies:
            await copy.close()


def _same(a: Copy, b: Copy) -> None:
    pa, da, sa, ha = a.seen()
    pb, db, sb, hb = b.seen()
    assert (pa, da, ha) == (pb, db, hb)
    # Durable: what a restart would load is what memory says (the incarnations differ).
    assert sa[:2] == (pa, a.copy.fenced_epoch()) and sb[:2] == (pb, b.copy.fenced_epoch())


@MODES
def test_a_batch_leaves_the_copy_as_one_by_one_and_skips_a_prefix_held(tmp_path: Any, grouped: bool) -> None:
    async def main() -> None:
        async with _copies(tmp_path, grouped) as (one, batch):
            changes = [_change(lsn) for lsn in range(1, 8)] + [_change(lsn, epoch=2) for lsn in range(8, 13)]
            for change in changes:
                await one.copy.apply(change)
            for change in changes[:4]:
                await batch.copy.apply(change)
            written, refused = await batch.copy.apply_all(changes, sender=2)
            assert refused is None
            assert [c.lsn for c in written] == list(range(5, 13))
            assert batch.copy.position() == Position(2, 12)
            assert batch.copy.history() == [(1, 1), (2, 8)] == one.copy.history()
            _same(one, batch)
            # All held already: a no-op, nothing written.
            assert await batch.copy.apply_all(changes[3:], sender=2) == ([], None)
            _same(one, batch)

    asyncio.run(main())


@MODES
def test_a_fenced_change_in_the_middle_leaves_the_changes_before_it_durable(tmp_path: Any, grouped: bool) -> None:
    async def main() -> None:
        async with _copies(tmp_path, grouped) as (one, batch):
            # Change 3 of epoch 1, after change 2 of epoch 2 (which promised epoch 2), sent
            # by an epoch-1 primary: fenced.
            changes = [_change(1, 2), _change(2, 2), _change(3, 1), _change(4, 2)]
            for change in changes[:2]:
                await one.copy.apply(change)
            with pytest.raises(Fenced):
                await one.copy.apply(changes[2])
            written, refused = await batch.copy.apply_all(changes)
            assert [c.lsn for c in written] == [1, 2]
            assert isinstance(refused, Fenced), refused
            assert batch.copy.position() == Position(2, 2) and batch.copy.fenced_epoch() == 2
            _same(one, batch)
            # Refused first: raised, nothing written (as one change alone).
            before = batch.commits()
            with pytest.raises(Fenced):
                await batch.copy.apply_all(changes[2:])
            assert batch.commits() == before
            _same(one, batch)

    asyncio.run(main())


@MODES
def test_a_diverged_change_stops_the_batch_after_the_changes_before_it(tmp_path: Any, grouped: bool) -> None:
    async def main() -> None:
        async with _copies(tmp_path, grouped) as (one, batch):
            for change in (_change(1), _change(2)):
                await one.copy.apply(change)
            # A gap: change 4 after 2.
            written, refused = await batch.copy.apply_all([_change(1), _change(2), _change(4), _change(3)])
            assert [c.lsn for c in written] == [1, 2]
            assert isinstance(refused, Diverged) and "gap" in str(refused)
            _same(one, batch)
            # Change 3 held... under another epoch than the one sent: diverged; the held
            # prefix before it is a no-op, so nothing is written and the refusal raised.
            await batch.copy.apply(_change(3))
            await one.copy.apply(_change(3))
            with pytest.raises(Diverged, match="held under epoch 1"):
                await batch.copy.apply_all([_change(2), _change(3, epoch=2), _change(4, epoch=2)], sender=2)
            assert batch.copy.position() == Position(1, 3)
            _same(one, batch)

    asyncio.run(main())


def _host() -> CopyHost:
    return CopyHost(ChangeSet.decode, Fenced, Diverged, lambda _uid, _epoch: None)


@MODES
def test_a_ship_call_is_one_commit_and_its_changes_go_to_the_ring(tmp_path: Any, grouped: bool) -> None:
    """Each change set of a call had a commit (an fsync) of its own: a copy catching up
    under load applied about as many a second as its primary made."""

    async def main() -> None:
        async with _copies(tmp_path, grouped, n=1) as (copy,):
            host = _host()
            shard = host.shards[SHARD_UID] = Shard(SHARD_UID, "q", copy.copy)
            blobs = tuple(_change(lsn).encode() for lsn in range(1, 21))
            before = copy.commits()
            state = await host.ship(Ship(SHARD_UID, 1, "n1", copy.copy.incarnation, blobs))
            assert (state.refused, state.position) == ("", (1, 20))
            assert copy.commits() - before == 1
            assert shard.applied == 20 and len(shard.ring) == 20 and shard.ring.last is not None
            assert shard.ring.last.lsn == 20

    asyncio.run(main())


@MODES
def test_a_ship_call_refused_in_the_middle_answers_the_prefix_and_rings_it(tmp_path: Any, grouped: bool) -> None:
    async def main() -> None:
        async with _copies(tmp_path, grouped, n=1) as (copy,):
            host = _host()
            shard = host.shards[SHARD_UID] = Shard(SHARD_UID, "q", copy.copy)
            blobs = (_change(1, 2).encode(), _change(2, 2).encode(), _change(3, 1).encode())
            state = await host.ship(Ship(SHARD_UID, 1, "n1", copy.copy.incarnation, blobs))
            assert (state.refused, state.position, state.fenced_epoch) == ("fenced", (2, 2), 2)
            assert shard.applied == 2 and shard.ring.last is not None and shard.ring.last.lsn == 2
            # A change of another shard after one of this shard's: the first is applied.
            other = ChangeSet(SHARD_UID + 1, 2, 4, [("p0", b"k", b"v")]).encode()
            state = await host.ship(Ship(SHARD_UID, 2, "n1", copy.copy.incarnation, (_change(3, 2).encode(), other)))
            assert (state.refused, state.position) == ("diverged", (2, 3))
            assert shard.applied == 3 and shard.ring.last is not None and shard.ring.last.lsn == 3
            assert copy.copy.state.stored()[0] == Position(2, 3)

    asyncio.run(main())
