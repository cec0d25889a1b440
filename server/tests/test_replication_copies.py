"""Replicated queues on two nodes' managers in one process (manager.open_copy,
promote, demote; storage/replica_copy.py): a primary answers only what its copy holds,
and the copy, promoted, serves every acknowledged item once under the same ids."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from replication_helpers import MS, SHARD_UID

from querator_server.actor import CompleteRequest, LeaseRequest, LeaseResult, ProduceRequest
from querator_server.actor.replication import Replication
from querator_server.errors import QueratorError, Unavailable
from querator_server.manager import QueuesManager
from querator_server.model import NewItem, QueueConfig
from querator_server.storage import QueueStore
from querator_server.storage.change_set import ChangeSet, Fenced, Position
from querator_server.storage.replica_copy import ReplicaCopy
from querator_server.storage.replica_state import ReplicaState


def _config(partitions: int = 2) -> QueueConfig:
    return QueueConfig(name="q", uid=SHARD_UID, partitions=partitions, lease_timeout_us=30_000 * MS)


@dataclass
class ToCopy(Replication):
    """A ``Replication`` that ships every change set, as bytes, to another node's copy."""

    target: ReplicaCopy
    fail_from: int = 0
    shipped: int = 0
    _order: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def replicated(self, change: ChangeSet) -> None:
        if self.fail_from and change.lsn >= self.fail_from:
            raise Unavailable("the replica does not answer (test)")
        data = change.encode()
        async with self._order:
            await self.target.apply(ChangeSet.decode(data))
            self.shipped += 1


async def _managers(root: Any, grouped: bool) -> tuple[QueuesManager, QueuesManager]:
    managers = []
    for node in ("n1", "n2"):
        manager = QueuesManager(str(root / node), workers=2, commit_groups=grouped)
        await manager.start()
        managers.append(manager)
    return managers[0], managers[1]


@dataclass
class Ledger:
    produced: dict[str, bytes] = field(default_factory=dict)  # id -> payload, acknowledged
    completed: set[str] = field(default_factory=set)  # acknowledged
    held: dict[str, bytes] = field(default_factory=dict)  # leased, not completed


async def _load(manager: QueuesManager, ledger: Ledger, until: float, seed: int) -> None:
    rng = random.Random(seed)
    n = 0
    while time.monotonic() < until:
        actor = manager.actor("q")
        payloads = [b"%d-%d" % (seed, n + i) for i in range(rng.randint(1, 10))]
        n += len(payloads)
        result = await actor.submit(ProduceRequest(items=[NewItem(payload=p) for p in payloads]))
        ledger.produced.update(zip(result.ids, payloads, strict=True))
        lease: LeaseResult = await actor.submit(LeaseRequest(batch_size=rng.randint(1, 8), client_id="", wait_until_us=0))
        if not lease.ids:
            continue
        keep = rng.random() < 0.1  # held by a worker across the failover
        if keep:
            ledger.held.update(zip(lease.ids, lease.payloads, strict=True))
            continue
        await actor.submit(CompleteRequest(partition=lease.partition, ids=lease.ids))
        ledger.completed.update(lease.ids)


async def _drain(manager: QueuesManager, seconds: float) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    until = time.monotonic() + seconds
    actor = manager.actor("q")
    while time.monotonic() < until:
        lease: LeaseResult = await actor.submit(LeaseRequest(batch_size=100, client_id="", wait_until_us=0))
        if not lease.ids:
            if actor.totals().leased == 0 and actor.totals().ready == 0:
                return out
            await asyncio.sleep(0.05)
            continue
        for item_id, payload in zip(lease.ids, lease.payloads, strict=True):
            assert item_id not in out, f"{item_id} delivered twice"
            out[item_id] = payload
        await actor.submit(CompleteRequest(partition=lease.partition, ids=lease.ids))
    raise AssertionError("the queue did not drain")


@pytest.mark.parametrize("grouped", [False, True], ids=["own", "grouped"])
def test_the_promoted_copy_serves_every_acknowledged_item_once_under_the_same_ids(tmp_path: Any, grouped: bool) -> None:
    async def main() -> None:
        m1, m2 = await _managers(tmp_path, grouped)
        c1, c2 = await m1.open_copy(_config()), await m2.open_copy(_config())
        assert c1.incarnation != c2.incarnation
        with pytest.raises(Unavailable, match="passive copy"):
            m1.actor("q")
        to_c2 = ToCopy(c2)
        await m1.promote("q", 1, to_c2)
        ledger = Ledger()
        until = time.monotonic() + 3.0
        await asyncio.gather(*(_load(m1, ledger, until, seed) for seed in range(4)))
        await m1.demote("q")
        with pytest.raises(Unavailable):
            m1.actor("q")
        # Both copies stand at the same change with the same contents.
        assert c1.position() == c2.position() == Position(1, to_c2.shipped)
        assert c1.digest() == c2.digest()
        assert to_c2.shipped > 20

        await m2.promote("q", 2, ToCopy(c1))
        actor = m2.actor("q")
        # Leases taken on the old primary are still valid here, under the same ids.
        by_partition: dict[int, list[str]] = {}
        for item_id in ledger.held:
            by_partition.setdefault(int(item_id.split(".")[1], 16), []).append(item_id)
        for p, ids in by_partition.items():
            await actor.submit(CompleteRequest(partition=p, ids=ids))
        ledger.completed.update(ledger.held)
        left = await _drain(m2, 10.0)
        expected = {i: payload for i, payload in ledger.produced.items() if i not in ledger.completed}
        assert left == expected
        assert c1.digest() == c2.digest() and c1.position() == c2.position()
        assert c2.position().epoch == 2 and c2.history()[-1][0] == 2
        await m1.stop()
        await m2.stop()

    asyncio.run(main())


def test_a_replication_that_fails_answers_unavailable_and_the_queue_becomes_a_passive_copy(tmp_path: Any) -> None:
    async def main() -> None:
        m1, m2 = await _managers(tmp_path, False)
        c1, c2 = await m1.open_copy(_config()), await m2.open_copy(_config())
        await m1.promote("q", 1, ToCopy(c2, fail_from=6))
        ok = unavailable = 0
        for i in range(12):
            try:
                await m1.actor("q").submit(ProduceRequest(items=[NewItem(payload=b"%d" % i)]))
                ok += 1
            except QueratorError as exc:
                assert isinstance(exc, Unavailable), exc
                unavailable += 1
        assert ok == 5 and unavailable == 7
        for _ in range(100):  # the queue steps down by itself
            if c1.serving_epoch == 0:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(Unavailable, match="passive copy"):
            m1.actor("q")
        # The old primary holds a change its copy lacks: 6 against 5.
        assert c1.position() == Position(1, 6) and c2.position() == Position(1, 5)
        await m1.stop()
        await m2.stop()

    asyncio.run(main())


def test_a_later_epoch_reaching_a_serving_primary_makes_it_step_down_and_fences_it(tmp_path: Any) -> None:
    async def main() -> None:
        m1, m2 = await _managers(tmp_path, True)
        c1, c2 = await m1.open_copy(_config(1)), await m2.open_copy(_config(1))
        await m1.promote("q", 3, ToCopy(c2))
        await m1.actor("q").submit(ProduceRequest(items=[NewItem(payload=b"x")]))
        with pytest.raises(Fenced):
            await c1.fence(2)  # an epoch below the one it serves: refused, still serving
        assert c1.serving_epoch == 3
        assert await c1.fence(5) == Position(3, 1)
        assert c1.serving_epoch == 0 and c1.fenced_epoch() == 5
        with pytest.raises(Fenced):
            await m1.promote("q", 4, ToCopy(c2))
        with pytest.raises(Fenced):
            await c1.apply(ChangeSet(SHARD_UID, 4, 2, [("p0", b"k", b"v")]))
        await m1.stop()
        await m2.stop()

        # After a restart: still passive, the same copy, the same promises.
        m1 = QueuesManager(str(tmp_path / "n1"), workers=2)
        await m1.start()
        again = m1.copy("q")
        assert (again.position(), again.fenced_epoch(), again.incarnation) == (Position(3, 1), 5, c1.incarnation)
        with pytest.raises(Unavailable, match="passive copy"):
            m1.actor("q")
        await m1.promote("q", 6, None)
        lease = await m1.actor("q").submit(LeaseRequest(batch_size=5, client_id="", wait_until_us=0))
        assert lease.payloads == [b"x"] and lease.ids[0].startswith(f"{SHARD_UID:x}.")
        await m1.stop()

    asyncio.run(main())


@dataclass
class Holding(Replication):
    """A ``Replication`` that ships to another node's copy until ``hold``, then keeps
    the change sets back (a replica that missed the old primary's last changes)."""

    target: ReplicaCopy
    hold: bool = False
    held: list[bytes] = field(default_factory=list)

    async def replicated(self, change: ChangeSet) -> None:
        if self.hold:
            self.held.append(change.encode())
        else:
            await self.target.apply(ChangeSet.decode(change.encode()))


@pytest.mark.parametrize("grouped", [True, False])
def test_a_copy_fenced_by_an_election_takes_the_old_epochs_suffix_from_the_new_primary_only(
    tmp_path: Any, grouped: bool
) -> None:
    """The failover fences every in-sync copy at epoch 2; the copy elected holds epoch-1
    changes another lacks and ships them under epoch 2: they are on its history and
    applied, with the copy's incarnation kept (it stays the in-sync one). The deposed
    primary sending them under epoch 1 is refused."""

    async def main() -> None:
        from querator_server.cluster.replica_host import CopyHost, Shard
        from querator_server.cluster.replica_wire import Ship
        from querator_server.storage.change_set import Diverged

        m1, m2 = await _managers(tmp_path, grouped)
        c1, c2 = await m1.open_copy(_config(1)), await m2.open_copy(_config(1))
        link = Holding(c2)
        await m1.promote("q", 1, link)
        await m1.actor("q").submit(ProduceRequest(items=[NewItem(payload=b"a")]))
        link.hold = True
        await m1.actor("q").submit(ProduceRequest(items=[NewItem(payload=b"b")]))
        assert link.held and c2.position().lsn < c1.position().lsn
        behind, incarnation = c2.position(), c2.incarnation
        await c2.fence(2)  # the election's promise

        host = CopyHost(ChangeSet.decode, Fenced, Diverged, lambda uid, epoch: None)
        host.shards[SHARD_UID] = Shard(SHARD_UID, "q", c2)
        old = await host.ship(Ship(SHARD_UID, 1, "n1", incarnation, tuple(link.held)))
        assert old.refused == "fenced" and c2.position() == behind, old
        new = await host.ship(Ship(SHARD_UID, 2, "n1", incarnation, tuple(link.held)))
        assert new.refused == "", new
        assert c2.position() == c1.position() and c2.incarnation == incarnation
        assert c2.fenced_epoch() == 2
        await m1.stop()
        await m2.stop()

    asyncio.run(main())


def _logged_changes(path: str) -> list[ChangeSet]:
    """The change sets the child wrote, the last one left out if the kill cut it."""
    with open(path, "rb") as f:
        data = f.read()
    out: list[ChangeSet] = []
    at = 0
    while at + 4 <= len(data):
        size = int.from_bytes(data[at : at + 4], "big")
        if at + 4 + size > len(data):
            break
        out.append(ChangeSet.decode(data[at + 4 : at + 4 + size]))
        at += 4 + size
    return out


def _rebuilt(path: str, changes: list[ChangeSet]) -> str:
    """The digest of a fresh store that applied ``changes``."""
    store = QueueStore(path, 1)
    state = ReplicaState(store, None, SHARD_UID)
    for change in changes:
        state.apply_now(change)
    digest = state.digest()
    store.close()
    return digest[1]


def test_kill9_leaves_every_copy_at_a_position_that_matches_its_contents(tmp_path: Any) -> None:
    """The position (and fence) is written in the transaction of the data it names, so
    a ``kill -9`` at any moment leaves each node's copy holding exactly the changes up
    to its position: rebuilt from the change sets up to that position, a fresh store
    has the same digest (the primary in a directory of its own, the copy in a group).
    A fence that returned is there after the kill."""
    here = os.path.dirname(__file__)
    compared_primary = 0
    for attempt in range(3):
        root = tmp_path / f"run{attempt}"
        root.mkdir()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen(
            [sys.executable, os.path.join(here, "replication_child.py"), str(root)], stdout=subprocess.PIPE, env=env
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == b"ready"
            time.sleep(0.8 + attempt * 0.6)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        changes = _logged_changes(str(root / "changes.log"))
        assert len(changes) > 10

        async def positions(root: Any) -> tuple[list[tuple[Position, str, int]], int]:
            out = []
            for node in ("n1", "n2"):
                manager = QueuesManager(str(root / node), workers=2)
                await manager.start()
                copy = manager.copy("q")
                out.append((copy.position(), copy.digest(), copy.fenced_epoch()))
                fenced = manager.copy("f").fenced_epoch() if node == "n2" else 0
                await manager.stop()
            return out, fenced

        ((p1, d1, f1), (p2, d2, f2)), fenced = asyncio.run(positions(root))
        promised = (root / "fences.log").read_text().split()
        assert promised and fenced >= int(promised[-1])  # every fence that returned held
        assert p2.lsn <= len(changes) and p2.lsn <= p1.lsn and f1 == f2 == 1
        assert d2 == _rebuilt(str(root / "rebuilt-n2"), changes[: p2.lsn])
        if p1.lsn <= len(changes):
            assert d1 == _rebuilt(str(root / "rebuilt-n1"), changes[: p1.lsn])
            compared_primary += 1
        # else: killed after the primary's commit, before it handed the change on
    assert compared_primary >= 1


@dataclass
class Kept(Replication):
    """A ``Replication`` that keeps the change sets and ships none."""

    log: list[ChangeSet] = field(default_factory=list)

    async def replicated(self, change: ChangeSet) -> None:
        self.log.append(ChangeSet.decode(change.encode()))


@pytest.mark.parametrize("apply_first", [True, False])
def test_a_change_set_racing_a_promotion_is_either_refused_or_served(tmp_path: Any, apply_first: bool) -> None:
    """Never applied under the starting primary's feet: an apply that returns is in
    what the new primary serves."""

    async def main() -> None:
        m1, m2 = await _managers(tmp_path, False)
        await m1.open_copy(_config(1))
        c2 = await m2.open_copy(_config(1))
        kept = Kept()
        await m1.promote("q", 1, kept)
        await m1.actor("q").submit(ProduceRequest(items=[NewItem(payload=b"raced")]))
        await m1.demote("q")
        (change,) = [c for c in kept.log if any(role == "p0" and key[:1] == b"i" for role, key, _ in c.ops)][:1]
        assert change.lsn == 1

        async def apply() -> bool:
            try:
                await c2.apply(change)
            except Fenced:
                return False
            return True

        if apply_first:
            applied, _ = await asyncio.gather(apply(), m2.promote("q", 1, None))
        else:
            _, applied = await asyncio.gather(m2.promote("q", 1, None), apply())
        lease = await m2.actor("q").submit(LeaseRequest(batch_size=5, client_id="", wait_until_us=0))
        assert lease.payloads == ([b"raced"] if applied else [])
        assert applied == apply_first
        await m1.stop()
        await m2.stop()

    asyncio.run(main())


def test_settings_of_a_copy_change_passive_or_serving_and_a_grouped_copy_keeps_to_its_group(tmp_path: Any) -> None:
    async def main() -> None:
        m1, m2 = await _managers(tmp_path, True)
        await m1.open_copy(_config(2))
        c2 = await m2.open_copy(_config(2))
        await m1.promote("q", 1, ToCopy(c2))
        for manager in (m1, m2):  # serving, then passive
            updated = await manager.update("q", {"partitions": 4, "max_attempts": 3})
            assert (updated.partitions, updated.max_attempts, updated.shard_copy) == (4, 3, True)
            with pytest.raises(QueratorError, match="at most 31"):
                await manager.update("q", {"partitions": 32})
        for _ in range(8):  # the new partitions are written, and opened on the copy
            await m1.actor("q").submit(ProduceRequest(items=[NewItem(payload=b"x")]))
        assert c2.state.store.partitions == 4 and c2.digest() == m1.copy("q").digest()
        await m1.stop()
        await m2.stop()

        # A copy whose settings grew while nothing was written to the new partitions.
        m3 = QueuesManager(str(tmp_path / "n3"), workers=2)
        await m3.start()
        await m3.open_copy(_config(1).replace(name="r", uid=SHARD_UID + 1))
        await m3.update("r", {"partitions": 3})
        await m3.promote("r", 1, None)
        assert m3.actor("r").partition_count == 3
        await m3.stop()

    asyncio.run(main())


def test_a_damaged_copy_is_refused_at_start_then_made_anew_and_filled_from_a_snapshot(tmp_path: Any) -> None:
    async def main() -> None:
        m1, m2 = await _managers(tmp_path, False)
        await m1.open_copy(_config())
        c2 = await m2.open_copy(_config())
        await m1.promote("q", 1, ToCopy(c2))
        ledger = Ledger()
        await _load(m1, ledger, time.monotonic() + 0.5, 1)
        old = c2.incarnation
        await m2.stop()
        data = tmp_path / "n2" / "queues" / str(SHARD_UID) / "data.mdb"
        with open(data, "r+b") as f:  # truncated, as a crash of the file system may leave it
            f.truncate(os.path.getsize(data) // 2)

        m2 = QueuesManager(str(tmp_path / "n2"), workers=2)
        await m2.start()
        with pytest.raises(Unavailable, match="failed to load"):
            m2.copy("q")
        fresh = await m2.reset_copy("q")
        assert fresh.incarnation != old and fresh.position() == Position(0, 0)
        with pytest.raises(QueratorError, match="demote it first"):
            await m1.reset_copy("q")
        await m1.demote("q")
        at = await fresh.install_snapshot(m1.copy("q").snapshot_chunks())
        assert at == m1.copy("q").position() and fresh.digest() == m1.copy("q").digest()
        await m1.stop()
        await m2.stop()

    asyncio.run(main())


@dataclass
class Gated(Replication):
    """Ships to a copy, holding every change set from ``hold_from`` on until ``open``."""

    target: ReplicaCopy
    hold_from: int = 0
    open: asyncio.Event = field(default_factory=asyncio.Event)
    _order: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def replicated(self, change: ChangeSet) -> None:
        data = change.encode()
        if self.hold_from and change.lsn >= self.hold_from:
            await self.open.wait()
        async with self._order:
            await self.target.apply(ChangeSet.decode(data))


def test_dead_letters_leave_only_once_the_copies_hold_the_move_and_a_new_primary_sends_what_is_left(tmp_path: Any) -> None:
    from querator_server.actor import RetryRequest
    from querator_server.model import RetryOrder

    async def main() -> None:
        m1, m2 = await _managers(tmp_path, False)
        config = _config(1).replace(dead_queue="dlq")
        await m1.open_copy(config)
        c2 = await m2.open_copy(config)
        await m1.create(QueueConfig(name="dlq"))
        gated = Gated(c2)
        await m1.promote("q", 1, gated)
        actor = m1.actor("q")
        await actor.submit(ProduceRequest(items=[NewItem(payload=b"first")]))
        lease: LeaseResult = await actor.submit(LeaseRequest(batch_size=1, client_id="", wait_until_us=0))
        gated.hold_from = c2.position().lsn + 1
        retry = actor.submit(RetryRequest(partition=0, orders=[RetryOrder(lease.ids[0], dead=True)]))
        await asyncio.sleep(0.5)
        # Moved to the outbox here, but not acknowledged by the copy: not answered, not sent.
        assert not retry.done() and m1.actor("dlq").totals().ready == 0
        gated.open.set()
        await retry
        for _ in range(100):
            if m1.actor("dlq").totals().ready == 1:
                break
            await asyncio.sleep(0.02)
        assert m1.actor("dlq").totals().ready == 1

        # Another queue's dead letter cannot reach its dead-letter queue on n1 (there is
        # none there): it waits in the outbox, which the copy holds too; the copy
        # promoted on n2 sends it.
        other = _config(1).replace(name="r", uid=SHARD_UID + 1, dead_queue="dlq2")
        await m1.open_copy(other)
        r2 = await m2.open_copy(other)
        await m1.promote("r", 1, ToCopy(r2))
        await m1.actor("r").submit(ProduceRequest(items=[NewItem(payload=b"second")]))
        taken: LeaseResult = await m1.actor("r").submit(LeaseRequest(batch_size=1, client_id="", wait_until_us=0))
        await m1.actor("r").submit(RetryRequest(partition=0, orders=[RetryOrder(taken.ids[0], dead=True)]))
        await m1.demote("r")
        await m2.create(QueueConfig(name="dlq2"))
        await m2.promote("r", 2, None)
        for _ in range(200):
            if m2.actor("dlq2").totals().ready == 1:
                break
            await asyncio.sleep(0.02)
        page = await m2.actor("dlq2").submit(LeaseRequest(batch_size=5, client_id="", wait_until_us=0))
        assert page.payloads == [b"second"]
        await m1.stop()
        await m2.stop()

    asyncio.run(main())


def test_a_primary_gets_at_most_a_bounded_number_of_cycles_ahead_of_its_replicas(tmp_path: Any) -> None:
    from querator_server.actor.replication import MAX_UNREPLICATED

    async def main() -> None:
        m1, m2 = await _managers(tmp_path, False)
        await m1.open_copy(_config(1))
        c2 = await m2.open_copy(_config(1))
        gated = Gated(c2, hold_from=1)
        await m1.promote("q", 1, gated)
        actor = m1.actor("q")
        calls = [actor.submit(ProduceRequest(items=[NewItem(payload=b"%d" % i)])) for i in range(MAX_UNREPLICATED * 3)]
        for _ in range(3 * MAX_UNREPLICATED):  # one call per cycle: give it time to run ahead
            await asyncio.sleep(0.01)
            calls.append(actor.submit(ProduceRequest(items=[NewItem(payload=b"late")])))
        await asyncio.sleep(0.3)
        ahead = m1.copy("q").position().lsn
        assert MAX_UNREPLICATED <= ahead <= MAX_UNREPLICATED + 1, ahead
        assert not any(call.done() for call in calls)
        gated.open.set()
        await asyncio.gather(*calls)
        assert c2.position() == m1.copy("q").position()
        await m1.stop()
        await m2.stop()

    asyncio.run(main())


def test_a_server_stopping_while_its_replicas_never_answer_stops_and_fails_those_calls(tmp_path: Any) -> None:
    class Silent(Replication):
        async def replicated(self, change: ChangeSet) -> None:
            await asyncio.Event().wait()

    async def main() -> None:
        m1, m2 = await _managers(tmp_path, False)
        await m1.open_copy(_config(1))
        await m1.promote("q", 1, Silent())
        call = m1.actor("q").submit(ProduceRequest(items=[NewItem(payload=b"x")]))
        await asyncio.sleep(0.2)
        await asyncio.wait_for(m1.stop(), 10)  # not held by the replica that never answers
        with pytest.raises(Unavailable):
            await call
        await m2.stop()

    asyncio.run(main())
