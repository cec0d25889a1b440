"""A copy's operation whose caller goes away half-way (the primary that shipped the change
set was killed, a failover's call timed out: gRPC cancels the handler) on real LMDB in
one process: what was handed to storage becomes durable whatever the caller does, and
the copy's own idea of its position, promise and incarnation must follow its storage,
or a copy promoted later numbers its first change after a position it has passed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from replication_helpers import MS, SHARD_UID

from querator_server.actor import ProduceRequest
from querator_server.actor.replication import Replication
from querator_server.cluster.replica_host import CopyHost, Shard
from querator_server.cluster.replica_wire import Ship
from querator_server.cluster.shard_record import ShardRecord
from querator_server.cluster.shipper import ShardReplication
from querator_server.manager import QueuesManager
from querator_server.model import NewItem, QueueConfig
from querator_server.storage.change_set import ChangeSet, Diverged, Fenced, Position
from querator_server.storage.replica_copy import ReplicaCopy


def _config() -> QueueConfig:
    return QueueConfig(name="q", uid=SHARD_UID, partitions=1, lease_timeout_us=30_000 * MS)


@dataclass
class Kept(Replication):
    """A ``Replication`` that keeps every change set (encoded) and acknowledges it."""

    changes: list[bytes] = field(default_factory=list)

    async def replicated(self, change: ChangeSet) -> None:
        self.changes.append(change.encode())


@dataclass
class ToCopy(Replication):
    target: ReplicaCopy

    async def replicated(self, change: ChangeSet) -> None:
        await self.target.apply(ChangeSet.decode(change.encode()), change.epoch)


def _stored(copy: ReplicaCopy) -> tuple[Position, int, str]:
    """What the copy's storage says of it: position, promise, incarnation."""
    return copy.state.stored()


async def _settle(copy: ReplicaCopy) -> None:
    """Until what the cancelled call handed over is durable and the copy is idle."""
    if copy.group is not None:
        await copy.group.job(lambda: None)
    await copy.fence(0)  # waits its turn behind whatever still runs on the copy


async def _managers(root: Any, count: int) -> list[QueuesManager]:
    managers = []
    for i in range(count):
        manager = QueuesManager(str(root / f"n{i + 1}"), workers=2, commit_groups=True)
        await manager.start()
        managers.append(manager)
    return managers


def test_an_apply_cancelled_while_its_change_is_committed_leaves_the_copy_where_its_storage_is(tmp_path: Any) -> None:
    """The rapid double failover's digest mismatch: the new primary (killed at once) was
    shipping the third copy its catch-up; the call's cancellation ended that copy's apply
    after its change joined the commit and before the copy noted its new position. That
    copy, elected, reported the lsn before, and numbered its first change with the lsn
    its storage already held under the old epoch: the copies caught up by tail from it
    ended at its position without the old change. Every cancellation point is tried."""

    async def main() -> None:
        m1, m2, m3 = await _managers(tmp_path, 3)
        c1, c2, c3 = [await m.open_copy(_config()) for m in (m1, m2, m3)]
        kept = Kept()
        await m1.promote("q", 1, kept)
        for i in range(80):
            await m1.actor("q").submit(ProduceRequest(items=[NewItem(payload=b"%d" % i)]))
        await m1.demote("q")
        old = [ChangeSet.decode(blob) for blob in kept.changes]
        assert [c.lsn for c in old] == list(range(1, 81))

        # c2 applies them one by one, each call cancelled after a growing number of
        # turns of the loop, until one change is durable although its call was cancelled.
        interrupted = 0
        for turns, change in enumerate(old):
            call = asyncio.ensure_future(c2.apply(change, 1))
            for _ in range(turns):
                await asyncio.sleep(0)
            cancelled = call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            await _settle(c2)
            stored = _stored(c2)[0]
            assert c2.position() == stored, (
                f"change {change.lsn}: cancelled after {turns} turns, the copy says {c2.position()}, its storage {stored}"
            )
            if cancelled and stored.lsn == change.lsn:
                interrupted = change.lsn
                break
            if stored.lsn < change.lsn:
                await c2.apply(change, 1)  # the primary resends what was not applied
        assert interrupted, "no cancellation fell after the commit"

        # c3 stands where the old primary's last acknowledged change is; c2 is elected
        # (it is ahead) and catches c3 up from its own history, then serves.
        for change in old[: interrupted - 1]:
            await c3.apply(change, 1)
        await c3.fence(2)
        for change in old[c3.position().lsn : c2.position().lsn]:
            await c3.apply(change, 2)
        await m2.promote("q", 2, ToCopy(c3))
        await m2.actor("q").submit(ProduceRequest(items=[NewItem(payload=b"after")]))
        assert c2.position() == c3.position() == Position(2, interrupted + 1), (c2.position(), c3.position())
        assert c2.digest() == c3.digest()
        for manager in (m1, m2, m3):
            await manager.stop()

    asyncio.run(main())


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "own"])
def test_a_fence_cancelled_while_it_is_committed_is_kept_by_the_copy(tmp_path: Any, grouped: bool) -> None:
    """A failover's ask that timed out at the asker still fenced the copy durably: the
    copy must refuse the old epoch from then on, not only after a restart."""

    async def main() -> None:
        manager = QueuesManager(str(tmp_path / "n1"), workers=2, commit_groups=grouped)
        await manager.start()
        copy = await manager.open_copy(_config())
        for epoch in range(1, 60):
            call = asyncio.ensure_future(copy.fence(epoch))
            for _ in range(epoch - 1):
                await asyncio.sleep(0)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            await _settle(copy)
            stored = _stored(copy)[1]
            assert copy.fenced_epoch() == stored, f"fence {epoch}: the copy promised {copy.fenced_epoch()}, its storage {stored}"
        await manager.stop()

    asyncio.run(main())


def test_a_ship_cancelled_after_its_change_is_applied_leaves_the_change_in_the_ring_too(tmp_path: Any) -> None:
    """The ring of a copy is its catch-up source once it is promoted. The old primary,
    killed while it shipped, cancelled the call after the change was applied and before
    the ring had it: the copy, elected, took its ring's last change for its position,
    found the third copy (level with it) ahead, and rebuilt it from a snapshot: a new
    incarnation, which its own death a moment later left unable to take over."""

    async def main() -> None:
        m1, m2 = await _managers(tmp_path, 2)
        kept = Kept()
        await m1.open_copy(_config())
        await m1.promote("q", 1, kept)
        for i in range(60):
            await m1.actor("q").submit(ProduceRequest(items=[NewItem(payload=b"%d" % i)]))
        copy = await m2.open_copy(_config())
        host = CopyHost(ChangeSet.decode, Fenced, Diverged, lambda uid, epoch: None)
        shard = host.shards[SHARD_UID] = Shard(SHARD_UID, "q", copy)
        for turns, blob in enumerate(kept.changes):
            change = ChangeSet.decode(blob)
            call = asyncio.ensure_future(host.ship(Ship(SHARD_UID, 1, "n1", copy.incarnation, (blob,))))
            for _ in range(turns):
                await asyncio.sleep(0)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            await _settle(copy)
            await asyncio.sleep(0)
            if copy.position().lsn < change.lsn:
                await host.ship(Ship(SHARD_UID, 1, "n1", copy.incarnation, (blob,)))  # resent
            last = shard.ring.last
            assert last is not None and (last.epoch, last.lsn) == tuple(copy.position()), (
                f"change {change.lsn} (cancelled after {turns} turns): the ring ends at "
                f"{None if last is None else (last.epoch, last.lsn)}, the copy holds {tuple(copy.position())}"
            )

        # Promoted, this copy stands where its copy does even if its ring were behind.
        shard.ring.clear()
        shard.ring.add(1, 1, kept.changes[0])
        record = ShardRecord.new(SHARD_UID, "q", ["n1", "n2"], 1)
        replication = ShardReplication("n2", record, None, Exception, None, copy, shard.ring)  # type: ignore[arg-type]
        assert replication.here() == tuple(copy.position()) == (1, 60)
        await m1.stop()
        await m2.stop()

    asyncio.run(main())
