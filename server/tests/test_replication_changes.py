"""Change sets of replicated queues (storage/change_set.py, capture.py,
replica_state.py): every write of a real actor's cycles, applied to other real
stores, leaves them identical; a copy refuses gaps, other histories and fenced epochs.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
from typing import Any

import lmdb
import pytest
from replication_helpers import SHARD_UID, Home, Mirror, Tally, client, make_home, shard_config

from querator_server.actor import LeaseRequest, LogicalQueue, ProduceRequest
from querator_server.actor.replication import Replication
from querator_server.errors import Unavailable
from querator_server.model import NewItem
from querator_server.storage import QueueStore, StorageError
from querator_server.storage.capture import Recording, begin_child
from querator_server.storage.change_set import ChangeSet, Diverged, Fenced, Position
from querator_server.storage.keyed import KeyedIndex
from querator_server.storage.replica_state import ReplicaState

# Every kind of call the random clients make: each must have been answered at least once.
CALLS_CHECKED = {
    "ProduceRequest",
    "LeaseRequest",
    "CompleteRequest",
    "RetryRequest",
    "ExtendRequest",
    "ImportItemsRequest",
    "DeleteItemsRequest",
}


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _settled(actor: LogicalQueue, mirror: Mirror) -> None:
    """Until the actor has nothing left to do soon and every change is replicated."""
    for _ in range(400):
        await asyncio.sleep(0.02)
        if actor.replica is None or mirror.changes == actor.replica.position().lsn:
            if not actor.waiting_requests():
                return
    raise AssertionError("the queue did not settle")


@pytest.mark.parametrize("grouped", [False, True], ids=["own", "grouped"])
def test_every_cycle_of_a_random_workload_leaves_the_copies_identical(tmp_path: Any, grouped: bool) -> None:
    """Produce (keys, scheduled, bare), lease (lease keys), complete, retry, extend, and
    the lifecycle (leases running out, expiry, scheduled items falling due, dead
    letters, keys forgotten): after each change set a copy that applied them all has
    the primary's digest. The copies keep their storage the other way (a directory of
    their own against a group, and back), and one starts with fewer partitions."""
    root = str(tmp_path)

    async def main() -> tuple[Mirror, Tally, int]:
        home = make_home(root, "primary", grouped)
        copy_homes = [make_home(root, "copy-a", not grouped), make_home(root, "copy-b", grouped)]
        config = shard_config()
        copies: list[tuple[Home, ReplicaState]] = []
        for i, copy_home in enumerate(copy_homes):
            store = await copy_home.open(os.path.join(root, f"copy{i}"), SHARD_UID, 1 + i)
            copies.append((copy_home, await copy_home.job(lambda store=store: ReplicaState(store, None, SHARD_UID))))
        dlq_home = make_home(root, "dlq", False)
        dlq = LogicalQueue(shard_config("dlq", 9, 1, ""), await dlq_home.open(os.path.join(root, "dlq"), 9, 1), dlq_home.lane)
        await dlq.start()
        mirror = Mirror(copies)
        store = await home.open(os.path.join(root, "p"), SHARD_UID, config.partitions)
        actor = LogicalQueue(config, store, home.lane, group=home.group, resolve=lambda _name: dlq, replication=mirror, epoch=1)
        mirror.primary = lambda: actor.replica
        await actor.start()
        # 6 s of clients, then on (new seeds, 30 s at most in all) until every kind of call
        # checked below was answered: bounded by time alone, a loaded machine once made
        # no Extend in the 6 s.
        tally = Tally()
        started = time.monotonic()
        until = started + 6.0
        for round_ in range(100):
            await asyncio.gather(*(client(actor, random.Random(seed + 1000 * round_), 400, until, tally) for seed in range(4)))
            if CALLS_CHECKED <= tally.kinds or time.monotonic() >= started + 30.0:
                break
            until = min(time.monotonic() + 1.0, started + 30.0)
        await asyncio.sleep(1.8)  # leases run out, items expire and dead-letter, keys are forgotten
        await _settled(actor, mirror)
        # Stop serving (storage kept open) so that no lifecycle cycle commits meanwhile.
        await actor.step_down("the test compares the copies")
        assert actor.replica is not None
        final = actor.replica.digest()
        for _home, state in copies:
            assert state.digest() == final
        assert final[0] == Position(1, mirror.changes)
        dead = dlq.totals()
        tally.dead_lettered = dead.ready + dead.leased
        await home.job(store.close)
        await dlq.stop()
        for h in [home, *copy_homes, dlq_home]:
            await h.close()
            h.lane.shutdown()
        return mirror, tally, final[0].lsn

    mirror, tally, lsn = _run(main())
    assert lsn == mirror.changes > 50
    # Nearly every change was compared at once (the rest: the primary had gone on).
    assert mirror.compared >= mirror.changes * 0.8, (mirror.compared, mirror.changes)
    assert {"p0", "p1", "dedup", "dedup_by_time", "lease_keys", "lease_keys_by_time"} <= mirror.roles
    # Items stored, rewritten and deleted; scheduled ones stored and falling due; dead
    # letters into the outbox and out once handed over; source ids of imported items;
    # expiry entries; next seqs; lease records written and deleted (storage/lease_records.py).
    kinds = {(tag, deleted) for tag in (b"i", b"s", b"d", b"u", b"l") for deleted in (False, True)} | {(b"x", False), (b"x", True), (b"n", False)}
    assert kinds <= mirror.tags, kinds - mirror.tags
    assert CALLS_CHECKED <= tally.kinds, CALLS_CHECKED - tally.kinds
    assert tally.dead_lettered > 0


def _store(path: str, partitions: int = 1) -> tuple[QueueStore, ReplicaState]:
    store = QueueStore(path, partitions)
    return store, ReplicaState(store, None, SHARD_UID)


def _change(epoch: int, lsn: int, value: bytes = b"v") -> ChangeSet:
    return ChangeSet(SHARD_UID, epoch, lsn, [("p0", b"k%d" % lsn, value), ("dedup", b"d", value)])


def test_a_copy_applies_in_order_once_and_refuses_gaps_other_histories_and_fenced_epochs(tmp_path: Any) -> None:
    path = str(tmp_path / "c")
    store, copy = _store(path)
    with pytest.raises(Diverged, match="gap"):
        copy.apply_now(_change(1, 2))
    assert copy.apply_now(_change(1, 1)) == Position(1, 1)
    before = copy.digest()
    assert copy.apply_now(_change(1, 1, b"other")) == Position(1, 1)  # held already: nothing written
    assert copy.digest() == before
    with pytest.raises(Diverged, match="epoch 1, not 2"):
        copy.apply_now(_change(2, 1))
    assert copy.apply_now(_change(2, 2)) == Position(2, 2)
    assert copy.fence_now(4) == Position(2, 2)
    with pytest.raises(Fenced):
        copy.apply_now(_change(3, 3))
    with pytest.raises(StorageError, match="uid"):
        copy.apply_now(ChangeSet(SHARD_UID + 1, 4, 3, []))
    assert copy.digest()[0] == Position(2, 2)
    incarnation = copy.incarnation
    store.close()

    # All of it was durable, in the copy's own storage.
    store, again = _store(path)
    assert (again.position(), again.fenced_epoch(), again.incarnation) == (Position(2, 2), 4, incarnation)
    assert again.history() == [(1, 1), (2, 2)]
    assert [again.epoch_at(n) for n in (0, 1, 2, 3)] == [0, 1, 2, 2]
    assert again.apply_now(_change(4, 3)) == Position(4, 3)
    assert again.history() == [(1, 1), (2, 2), (4, 3)]
    store.close()

    # A copy made anew (a wiped disk) is another incarnation.
    shutil.rmtree(path)
    store, fresh = _store(path)
    assert fresh.incarnation != incarnation and fresh.position() == Position(0, 0)
    store.close()


def test_change_sets_encode_compactly_and_refuse_damaged_bytes() -> None:
    change = ChangeSet(
        SHARD_UID, 3, 77, [("p12", b"\x00key", b""), ("dedup", b"k", None), ("p12", b"x" * 511, bytes(range(256)) * 9)]
    )
    data = change.encode()
    assert ChangeSet.decode(data) == change
    assert len(data) < 2 * (511 + 256 * 9)
    for bad in (data[:-1], data + b"\x00", b"\x02" + data[1:], b""):
        with pytest.raises(ValueError, match="not a change set"):
            ChangeSet.decode(bad)


def test_a_recording_keeps_what_nested_transactions_commit_and_refuses_unknown_databases(tmp_path: Any) -> None:
    store = QueueStore(str(tmp_path / "r"), 1)
    state = ReplicaState(store, KeyedIndex(store), SHARD_UID)
    other = store.write(lambda txn: store.env.open_db(b"elsewhere", txn=txn, create=True))

    def body(txn: lmdb.Transaction[bytes]) -> list[tuple[str, bytes, bytes | None]]:
        recording = state.record(txn)
        recording.put(b"a", b"1", db=store.db(0))
        kept = begin_child(store.env, recording)  # type: ignore[arg-type]
        kept.put(b"b", b"2", db=store.db(0))
        kept.commit()
        dropped = begin_child(store.env, recording)  # type: ignore[arg-type]
        dropped.put(b"c", b"3", db=store.db(0))
        dropped.abort()
        cursor = recording.cursor(db=store.db(0))
        assert cursor.set_key(b"a")
        cursor.delete()
        cursor.putmulti([(b"d", b"4"), (b"e", b"5")])
        assert not recording.delete(b"missing", db=store.db(0))  # nothing deleted, nothing recorded
        with pytest.raises(StorageError, match="does not replicate"):
            recording.put(b"x", b"y", db=other)
        for write in (
            lambda: recording.drop(store.db(0)),
            lambda: recording.replace(b"a", b"z", db=store.db(0)),
            lambda: recording.pop(b"d", db=store.db(0)),
            lambda: cursor.replace(b"d", b"z"),
            lambda: cursor.pop(b"d"),
        ):
            with pytest.raises(StorageError, match="not replicated|not recorded"):
                write()
        assert isinstance(recording, Recording)
        return recording.ops

    ops = store.write(body)
    assert ops == [("p0", b"a", b"1"), ("p0", b"b", b"2"), ("p0", b"a", None), ("p0", b"d", b"4"), ("p0", b"e", b"5")]
    store.close()


def test_a_replication_that_fails_makes_calls_fail_unavailable_never_ok(tmp_path: Any) -> None:
    """From the change that cannot be replicated on, nothing is answered OK, and the
    queue stops serving as primary."""
    root = str(tmp_path)

    async def main() -> tuple[int, list[str], list[tuple[str, str]]]:
        home = make_home(root, "primary", False)
        copy_home = make_home(root, "copy", False)
        copy_store = await copy_home.open(os.path.join(root, "c"), SHARD_UID, 2)
        copy = await copy_home.job(lambda: ReplicaState(copy_store, None, SHARD_UID))
        mirror = Mirror([(copy_home, copy)], fail_from=4)
        deposed: list[tuple[str, str]] = []
        store = await home.open(os.path.join(root, "p"), SHARD_UID, 2)
        actor = LogicalQueue(shard_config(dead_queue=""), store, home.lane, replication=mirror, epoch=1, on_deposed=lambda n, why: deposed.append((n, why)))
        await actor.start()
        ok = 0
        failures: list[str] = []

        async def produce(i: int) -> None:
            nonlocal ok
            try:
                await actor.submit(ProduceRequest(items=[NewItem(payload=b"%d" % i)]))
                ok += 1
            except Unavailable as exc:
                failures.append(str(exc))

        for i in range(3):
            await produce(i)
        await asyncio.gather(*(produce(i) for i in range(3, 12)))
        try:
            await actor.submit(LeaseRequest(batch_size=10, client_id="", wait_until_us=0))
        except Unavailable as exc:
            failures.append(str(exc))
        else:
            raise AssertionError("a lease was served after replication was lost")
        await actor.stop()
        home.lane.shutdown()
        copy_home.lane.shutdown()
        assert copy.position().lsn == 3
        return ok, failures, deposed

    ok, failures, deposed = _run(main())
    assert ok == 3
    assert len(failures) == 10 and all("retry" in text for text in failures)
    assert deposed and deposed[0][0] == "q" and "not replicated" in deposed[0][1]


def test_answers_waiting_for_replicas_all_fail_unavailable_when_abandoned_even_before_they_ran() -> None:
    from querator_server.actor.replication import ReplicationGate
    from querator_server.actor.transaction import answer

    class Silent(Replication):
        async def replicated(self, change: ChangeSet) -> None:
            await asyncio.Event().wait()  # never acknowledged

    async def main() -> None:
        lost: list[str] = []
        gate = ReplicationGate("q", Silent(), lost.append)
        requests = []
        for lsn in (1, 2, 3):
            request = ProduceRequest(items=[])
            request.future = asyncio.get_running_loop().create_future()
            requests.append(request)
            gate.release(ChangeSet(SHARD_UID, 1, lsn, [("p0", b"k", b"v")]), [(request, "ok")])
        gate.abandon("stepping down")  # the tasks have not run a step yet
        await gate.drain()
        for request in requests:
            assert isinstance(request.future.exception(), Unavailable)
        answer(requests[0], "late")  # an answer given already stays
        assert gate.pending == 0 and not lost

    asyncio.run(main())
