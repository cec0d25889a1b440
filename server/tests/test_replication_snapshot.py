"""Snapshots of replicated queues (storage/snapshot.py): read from one transaction
while the primary keeps writing, installed into another node's copy, which then
applies the change sets after the snapshot's position and ends identical."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from replication_helpers import MS, SHARD_UID

from querator_server.actor import CompleteRequest, LeaseRequest, LeaseResult, ProduceRequest
from querator_server.actor.replication import Replication
from querator_server.manager import QueuesManager
from querator_server.model import NewItem, QueueConfig
from querator_server.storage.change_set import ChangeSet, Diverged, Fenced, Position
from querator_server.storage.replica_copy import ReplicaCopy
from querator_server.storage.snapshot import DATA

CONFIG = QueueConfig(name="q", uid=SHARD_UID, partitions=3, lease_timeout_us=300 * MS, dedup_window_us=400 * MS)


@dataclass
class Shipped(Replication):
    """Ships to one copy and keeps every change set (the ring a primary would keep)."""

    target: ReplicaCopy
    log: list[ChangeSet] = field(default_factory=list)
    _order: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def replicated(self, change: ChangeSet) -> None:
        async with self._order:
            self.log.append(ChangeSet.decode(change.encode()))
            await self.target.apply(self.log[-1])


async def _load(manager: QueuesManager, until: float, seed: int, at_least: int = 0) -> None:
    """Produce, lease and complete until ``until`` (monotonic), and on until ``at_least``
    items were produced."""
    n = 0
    while time.monotonic() < until or n < at_least:
        actor = manager.actor("q")
        items = [NewItem(payload=bytes(200) + b"%d-%d" % (seed, n + i), idempotency_key=f"k{seed}.{n + i}") for i in range(20)]
        n += 20
        await actor.submit(ProduceRequest(items=items))
        lease: LeaseResult = await actor.submit(LeaseRequest(batch_size=10, client_id="", wait_until_us=0, lease_key=f"L{seed}.{n}"))
        if lease.ids and n % 60:
            await actor.submit(CompleteRequest(partition=lease.partition, ids=lease.ids))


async def _slowly(chunks: AsyncIterator[bytes], seen: list[bytes]) -> AsyncIterator[bytes]:
    """Pass the chunks on with a pause after each, so the primary writes meanwhile."""
    async for chunk in chunks:
        seen.append(chunk)
        yield chunk
        await asyncio.sleep(0.03)


async def _nodes(root: Any) -> list[QueuesManager]:
    managers = []
    for node, grouped in (("n1", False), ("n2", True), ("n3", True)):
        manager = QueuesManager(str(root / node), workers=2, commit_groups=grouped)
        await manager.start()
        managers.append(manager)
    return managers


def test_a_snapshot_taken_under_writes_then_the_later_change_sets_make_an_identical_copy(tmp_path: Any) -> None:
    async def main() -> None:
        m1, m2, m3 = await _nodes(tmp_path)
        c1, c2, c3 = [await m.open_copy(CONFIG) for m in (m1, m2, m3)]
        shipped = Shipped(c2)
        await m1.promote("q", 1, shipped)
        # Something to copy: at least 1,200 items, about 160 kB kept, 10 chunks of 16 kB (a
        # loaded machine once wrote too few in the second for the 5 chunks checked below).
        await _load(m1, time.monotonic() + 1.0, 99, at_least=1200)
        before = c3.incarnation

        until = time.monotonic() + 3.0
        load = asyncio.gather(*(_load(m1, until, seed) for seed in range(3)))
        await asyncio.sleep(0.2)
        chunks: list[bytes] = []
        start = c1.position()
        at = await c3.install_snapshot(_slowly(c1.snapshot_chunks(chunk_bytes=16 << 10), chunks))
        during = c1.position()
        await load
        # The snapshot is one state, as of its start: the primary wrote on meanwhile.
        assert start.lsn <= at.lsn < during.lsn
        assert sum(1 for c in chunks if c[:1] == DATA) >= 5
        assert c3.incarnation != before and c3.fenced_epoch() == 1

        for change in shipped.log:  # those up to the snapshot's position are held already
            await c3.apply(change)
        assert c1.position() == c2.position() == c3.position() == Position(1, len(shipped.log))
        assert c1.digest() == c2.digest() == c3.digest()

        # The snapshot's history came along: an lsn it holds under another epoch is refused.
        with pytest.raises(Diverged):
            await c3.apply(ChangeSet(SHARD_UID, 2, at.lsn, [("p0", b"k", b"v")]))
        for m in (m1, m2, m3):
            await m.stop()

    asyncio.run(main())


def test_a_snapshot_replaces_what_a_copy_held_and_a_cut_stream_leaves_it_refusing_change_sets(tmp_path: Any) -> None:
    async def main() -> None:
        m1, m2, m3 = await _nodes(tmp_path)
        c1, c2, c3 = [await m.open_copy(CONFIG) for m in (m1, m2, m3)]
        # n3's copy diverged: it holds changes of an epoch the others never saw.
        await m3.promote("q", 1, None)
        await _load(m3, time.monotonic() + 0.3, 7)
        await m3.demote("q")
        assert c3.position().lsn > 0
        await m1.promote("q", 2, Shipped(c2))
        await _load(m1, time.monotonic() + 0.5, 8)
        with pytest.raises(Fenced):
            await c1.install_snapshot(c2.snapshot_chunks())  # never over the primary

        async def cut(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
            n = 0
            async for chunk in chunks:
                if n == 2:
                    return
                n += 1
                yield chunk

        with pytest.raises(Diverged, match="before its end"):
            await c3.install_snapshot(cut(c1.snapshot_chunks(chunk_bytes=4 << 10)))
        with pytest.raises(Diverged, match="half-way"):
            await c3.apply(ChangeSet(SHARD_UID, 2, 1, [("p0", b"k", b"v")]))
        await m1.demote("q")
        at = await c3.install_snapshot(c2.snapshot_chunks())
        assert at == c2.position() == c1.position()
        digest = c1.digest()
        assert c3.digest() == c2.digest() == digest
        for m in (m1, m2, m3):
            await m.stop()

        m3 = QueuesManager(str(tmp_path / "n3"), workers=2)
        await m3.start()
        assert m3.copy("q").position() == at and m3.copy("q").digest() == digest
        await m3.stop()

    asyncio.run(main())


def test_a_snapshot_cut_by_a_growth_of_the_map_fails_cleanly_and_is_taken_again(tmp_path: Any) -> None:
    """LMDB ends every open transaction when the map grows: the snapshot's next chunk
    fails with a StorageError (no crash, no partial copy taken for a whole one), the
    copy that was installing it refuses change sets, and a snapshot taken again fills it."""
    from querator_server.storage import QueueStore, StorageError
    from querator_server.storage.replica_state import ReplicaState
    from querator_server.storage.snapshot import SnapshotReader

    source_store = QueueStore(str(tmp_path / "source"), 1, map_size=1 << 20)
    source = ReplicaState(source_store, None, SHARD_UID)
    ops: list[tuple[str, bytes, bytes | None]] = [("p0", b"k%06d" % i, bytes(300)) for i in range(1500)]
    source.apply_now(ChangeSet(SHARD_UID, 1, 1, ops))
    reader = SnapshotReader(source, chunk_bytes=32 << 10)
    assert reader.next_chunk() is not None
    size = source_store.map_usage()[1]
    big: list[tuple[str, bytes, bytes | None]] = [("p0", b"w%06d" % i, bytes(400)) for i in range(4000)]
    source.apply_now(ChangeSet(SHARD_UID, 1, 2, big))  # grows the map
    assert source_store.map_usage()[1] > size
    with pytest.raises(StorageError, match="map grew"):
        reader.next_chunk()
    reader.close()

    async def main() -> None:
        m = QueuesManager(str(tmp_path / "n"), workers=2)
        await m.start()
        copy = await m.open_copy(CONFIG)

        async def cut_by_growth() -> AsyncIterator[bytes]:
            reader = SnapshotReader(source, chunk_bytes=32 << 10)
            try:
                yield reader.header.encode()
                yield reader.next_chunk() or b""
                source.apply_now(ChangeSet(SHARD_UID, 1, 3, [("p0", b"y%06d" % i, bytes(400)) for i in range(8000)]))
                while (chunk := reader.next_chunk()) is not None:
                    yield chunk
                yield reader.end()
            finally:
                reader.close()

        with pytest.raises(StorageError, match="map grew"):
            await copy.install_snapshot(cut_by_growth())
        with pytest.raises(Diverged, match="half-way"):
            await copy.apply(ChangeSet(SHARD_UID, 1, 4, [("p0", b"k", b"v")]))

        async def whole() -> AsyncIterator[bytes]:
            reader = SnapshotReader(source)
            try:
                yield reader.header.encode()
                while (chunk := reader.next_chunk()) is not None:
                    yield chunk
                yield reader.end()
            finally:
                reader.close()

        assert await copy.install_snapshot(whole()) == Position(1, 3)
        assert copy.digest() == source.digest()[1]
        await m.stop()

    asyncio.run(main())
    source_store.close()


def test_the_digest_of_entries_is_the_one_earlier_versions_compute() -> None:
    """Hashed a run at a time now, entries give the digest the per-entry hasher gave
    (a snapshot sent by a node of an earlier version must verify on this one): the
    value below is what that hasher computed for these entries."""
    from querator_server.storage.replica_state import Hasher

    runs = [("dedup", 3), ("p0", 5), ("p1", 0), ("p2", 4)]
    one_by_one, by_runs = Hasher(), Hasher()
    for role, n in runs:
        entries = [(b"k%03d" % i, b"v" * i) for i in range(n)]
        for key, value in entries:
            one_by_one.add(role, key, value)
        by_runs.add_run(role, entries[:2])
        by_runs.add_run(role, entries[2:])
    assert one_by_one.count == by_runs.count == 12
    assert one_by_one.hexdigest() == by_runs.hexdigest() == "f9f8a1cd04b8d3b14fc4b5a5e1f5ea7e"


def test_a_snapshot_whose_entries_differ_from_its_end_digest_is_refused_and_an_install_says_where_its_time_went(
    tmp_path: Any,
) -> None:
    """The install checks the entries it received against the end chunk's count and
    digest (it no longer reads the installed copy back); a chunk altered on the way
    (here: one value changed, the chunk encoded again) leaves the copy refusing change
    sets. A whole install reports its chunks and entries."""
    from querator_server.storage.snapshot import data_ops

    async def main() -> None:
        m1, m2, m3 = await _nodes(tmp_path)
        c1, c2, _ = [await m.open_copy(CONFIG) for m in (m1, m2, m3)]
        await m1.promote("q", 1, None)
        await _load(m1, time.monotonic() + 0.5, 3)
        await m1.demote("q")  # its lifecycle writes on after the load (timeouts of 300 ms): a copy holds still

        async def altered(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
            done = False
            async for chunk in chunks:
                if chunk[:1] == DATA and not done:
                    change = ChangeSet.decode(chunk[1:])
                    ops = data_ops(chunk, SHARD_UID)
                    role, key, value = ops[-1]
                    ops[-1] = (role, key, (value or b"") + b"!")
                    chunk = DATA + ChangeSet(change.uid, change.epoch, change.lsn, ops).encode()
                    done = True
                yield chunk

        with pytest.raises(Diverged, match="it was sent as"):
            await c2.install_snapshot(altered(c1.snapshot_chunks(chunk_bytes=8 << 10)))
        with pytest.raises(Diverged, match="half-way"):
            await c2.apply(ChangeSet(SHARD_UID, 1, 1, [("p0", b"k", b"v")]))
        at = await c2.install_snapshot(c1.snapshot_chunks(chunk_bytes=8 << 10))
        assert at == c1.position() and c2.digest() == c1.digest()
        stats = c2.install_stats
        assert stats.chunks >= 3 and stats.entries > 0 and stats.seconds >= stats.written_s > 0
        for m in (m1, m2, m3):
            await m.stop()

    asyncio.run(main())
