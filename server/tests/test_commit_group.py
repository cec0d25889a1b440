"""Commit groups on real LMDB and real lanes: who shares a commit, and what a failure undoes."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import lmdb
import pytest

from querator_server.faults import FAULT_FILE_ENV
from querator_server.storage import MapFull, StorageError
from querator_server.storage.commit_group import CommitGroup
from querator_server.storage.group_layout import open_group_env
from querator_server.storage.lane import StorageLane


@pytest.fixture
def lane() -> Iterator[StorageLane]:
    lane = StorageLane("test-group-lane")
    yield lane
    lane.shutdown()


def _group(path: str, lane: StorageLane, members: int, map_size: int = 1 << 24) -> CommitGroup:
    env = open_group_env(path, map_size=map_size, sync=True)
    group = CommitGroup(env, path, lane)
    group.members = members
    return group


async def _open_dbs(group: CommitGroup, names: list[bytes]) -> list[Any]:
    def open_all() -> list[Any]:
        with group.env.begin(write=True) as txn:
            return [group.env.open_db(name, txn=txn) for name in names]

    return await group.job(open_all)


def _read_back(path: str, names: list[bytes]) -> dict[bytes, dict[bytes, bytes]]:
    """What a fresh process would find: every database's contents, from disk."""
    env = lmdb.open(path, max_dbs=32, readonly=True, lock=False)
    try:
        out: dict[bytes, dict[bytes, bytes]] = {}
        with env.begin() as txn:
            for name in names:
                try:
                    db = env.open_db(name, txn=txn, create=False)
                except lmdb.NotFoundError:
                    continue
                out[name] = dict(txn.cursor(db=db))
        return out
    finally:
        env.close()


def _put(db: Any, key: bytes, value: bytes) -> Callable[[lmdb.Transaction[bytes]], bytes]:
    def body(txn: lmdb.Transaction[bytes]) -> bytes:
        txn.put(key, value, db=db)
        return key

    return body


def _run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_cycles_of_several_queues_share_one_durable_commit(tmp_path: Any, lane: StorageLane) -> None:
    path = str(tmp_path / "g")
    names = [b"q1.p0", b"q2.p0", b"q3.p0"]

    async def main() -> int:
        group = _group(path, lane, members=3)
        dbs = await _open_dbs(group, names)
        before = group.commits

        async def queue(i: int) -> None:
            result, committed = await group.run(_put(dbs[i], b"k", b"v%d" % i))
            assert result == b"k"
            await committed

        await asyncio.gather(*(queue(i) for i in range(3)))
        commits = group.commits - before
        await group.close()
        return commits

    assert _run(main()) == 1
    assert _read_back(path, names) == {n: {b"k": b"v%d" % i} for i, n in enumerate(names)}


def test_a_lone_queue_joining_while_nothing_else_is_ready_is_committed_without_waiting_for_the_loop(
    tmp_path: Any, lane: StorageLane
) -> None:
    # A plain caller of one queue in a group with other (quiet) members: no other member
    # can join before the loop next turns, so the commit must not wait for those turns.
    path = str(tmp_path / "g")
    names = [b"q1.p0", b"q2.p0"]

    async def main() -> None:
        group = _group(path, lane, members=3)
        dbs = await _open_dbs(group, names)
        for value in (b"first", b"alone"):
            for _ in range(3):
                await asyncio.sleep(0)  # whatever the last job or commit left ready has run
            before = group.commits
            _, committed = await group.run(_put(dbs[0], b"k", value), member="q1")
            # The loop does not turn while this polls: the lane must have the commit already.
            deadline = time.monotonic() + 30
            while group.commits == before:
                assert time.monotonic() < deadline, "the commit waited for the loop to turn"
                time.sleep(0.005)
            await committed
        await group.close()

    _run(main())
    assert _read_back(path, names) == {names[0]: {b"k": b"alone"}, names[1]: {}}


def test_after_a_commit_of_several_queues_a_lone_cycle_still_waits_for_the_others(
    tmp_path: Any, lane: StorageLane
) -> None:
    # Busy queues of one group keep sharing commits: after a commit that carried two
    # queues, a cycle joining with nothing else ready still waits its two turns, and
    # the other queue's cycle of the next turn joins the same commit.
    path = str(tmp_path / "g")
    names = [b"q0.p0", b"q1.p0"]

    async def main() -> int:
        group = _group(path, lane, members=2)
        dbs = await _open_dbs(group, names)

        async def queue(i: int, value: bytes) -> None:
            _, committed = await group.run(_put(dbs[i], b"k", value), member=f"q{i}")
            await committed

        await asyncio.gather(queue(0, b"a"), queue(1, b"a"))  # the last commit: both queues
        for _ in range(3):
            await asyncio.sleep(0)
        before = group.commits
        _, first = await group.run(_put(dbs[0], b"k", b"b"), member="q0")  # nothing else ready
        second = asyncio.ensure_future(queue(1, b"b"))  # q1's cycle, a turn later
        await first
        await second
        commits = group.commits - before
        await group.close()
        return commits

    assert _run(main()) == 1
    assert _read_back(path, names) == {n: {b"k": b"b"} for n in names}


def test_a_failing_cycle_aborts_only_its_own_writes(tmp_path: Any, lane: StorageLane) -> None:
    path = str(tmp_path / "g")
    names = [b"q1.p0", b"q2.p0"]

    async def main() -> None:
        group = _group(path, lane, members=2)
        dbs = await _open_dbs(group, names)

        def broken(txn: lmdb.Transaction[bytes]) -> None:
            txn.put(b"half", b"written", db=dbs[1])
            raise RuntimeError("the cycle failed half-way")

        _, committed = await group.run(_put(dbs[0], b"k", b"kept"))
        with pytest.raises(RuntimeError):
            await group.run(broken)
        await committed
        await group.close()

    _run(main())
    assert _read_back(path, names) == {names[0]: {b"k": b"kept"}, names[1]: {}}


def test_a_failed_commit_fails_every_cycle_in_it_and_the_next_one_works(
    tmp_path: Any, lane: StorageLane, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "g")
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))
    names = [b"q1.p0", b"q2.p0"]

    async def main() -> None:
        group = _group(path, lane, members=2)
        dbs = await _open_dbs(group, names)
        fault.write_text("io-error")
        joined = [await group.run(_put(db, b"lost", b"x")) for db in dbs]
        for _, committed in joined:
            with pytest.raises(StorageError, match="Input/output error"):
                await committed
        fault.unlink()
        _, committed = await group.run(_put(dbs[0], b"kept", b"y"))
        await committed
        await group.close()

    _run(main())
    assert _read_back(path, names) == {names[0]: {b"kept": b"y"}, names[1]: {}}


def test_map_full_grows_the_map_and_keeps_what_others_wrote(tmp_path: Any, lane: StorageLane) -> None:
    path = str(tmp_path / "g")
    names = [b"q1.p0", b"q2.p0"]
    big = os.urandom(2000)

    async def main() -> int:
        group = _group(path, lane, members=2, map_size=1 << 20)
        dbs = await _open_dbs(group, names)
        _, small = await group.run(_put(dbs[0], b"small", b"s"))

        def fill(txn: lmdb.Transaction[bytes]) -> None:
            for i in range(600):
                txn.put(b"%06d" % i, big, db=dbs[1])

        with pytest.raises(MapFull):
            await group.run(fill)
        await group.grow()
        await small  # committed by the growth, before the map was resized
        for _ in range(4):  # as the actor does: grow until the cycle fits
            try:
                _, filled = await group.run(fill)
                break
            except MapFull:
                await group.grow()
        await filled
        size = int(group.env.info()["map_size"])
        await group.close()
        return size

    assert _run(main()) >= 2 << 20
    found = _read_back(path, names)
    assert found[names[0]] == {b"small": b"s"}
    assert len(found[names[1]]) == 600


def test_a_job_runs_with_no_transaction_held_after_what_joined(tmp_path: Any, lane: StorageLane) -> None:
    path = str(tmp_path / "g")
    names = [b"q1.p0", b"q2.p0"]

    async def main() -> bool:
        group = _group(path, lane, members=2)
        dbs = await _open_dbs(group, names[:1])
        _, committed = await group.run(_put(dbs[0], b"k", b"v"))

        def job() -> bool:
            # A write transaction of its own: only possible with none held by the group.
            with group.env.begin(write=True) as txn:
                group.env.open_db(names[1], txn=txn)
                return txn.get(b"k", db=dbs[0]) == b"v"

        saw_it = await group.job(job)
        assert committed.done() and committed.exception() is None
        await group.close()
        return bool(saw_it)

    assert _run(main()) is True
    assert _read_back(path, names) == {names[0]: {b"k": b"v"}, names[1]: {}}


def test_a_failing_job_is_raised_to_its_caller_and_the_group_goes_on(tmp_path: Any, lane: StorageLane) -> None:
    path = str(tmp_path / "g")

    async def main() -> None:
        group = _group(path, lane, members=1)
        (db,) = await _open_dbs(group, [b"q1.p0"])

        def fails() -> None:
            raise StorageError("the job failed")

        with pytest.raises(StorageError, match="the job failed"):
            await group.job(fails)
        _, committed = await group.run(_put(db, b"k", b"v"))
        await committed
        await group.close()

    _run(main())
    assert _read_back(path, [b"q1.p0"]) == {b"q1.p0": {b"k": b"v"}}


def test_close_commits_what_joined_and_refuses_later_cycles(tmp_path: Any, lane: StorageLane) -> None:
    path = str(tmp_path / "g")

    async def main() -> None:
        group = _group(path, lane, members=2)
        (db,) = await _open_dbs(group, [b"q1.p0"])
        _, committed = await group.run(_put(db, b"k", b"v"))
        await group.close()
        await committed
        with pytest.raises(StorageError, match="closed"):
            await group.run(_put(db, b"x", b"y"))

    _run(main())
    assert _read_back(path, [b"q1.p0"]) == {b"q1.p0": {b"k": b"v"}}


def test_a_cancelled_caller_leaves_the_group_working(tmp_path: Any, lane: StorageLane) -> None:
    path = str(tmp_path / "g")

    async def main() -> None:
        group = _group(path, lane, members=3)
        (db,) = await _open_dbs(group, [b"q1.p0"])
        release = threading.Event()
        _, first = await group.run(_put(db, b"a", b"1"))
        # A job that holds the lane until released commits what joined, then keeps
        # the group busy while two cycles wait for it and a third caller is cancelled.
        busy = asyncio.ensure_future(group.job(lambda: release.wait(10)))
        await asyncio.sleep(0)
        cancelled = asyncio.ensure_future(group.run(_put(db, b"x", b"never")))
        waiting = asyncio.ensure_future(group.run(_put(db, b"b", b"2")))
        cancelled_job = asyncio.ensure_future(group.job(lambda: "never run"))
        await asyncio.sleep(0.05)
        cancelled.cancel()
        cancelled_job.cancel()
        await asyncio.sleep(0)
        release.set()
        assert await busy is True
        await first
        _, second = await waiting
        await second
        for task in (cancelled, cancelled_job):
            with pytest.raises(asyncio.CancelledError):
                await task
        _, third = await group.run(_put(db, b"c", b"3"))
        await third
        await group.close()

    _run(main())
    assert _read_back(path, [b"q1.p0"]) == {b"q1.p0": {b"a": b"1", b"b": b"2", b"c": b"3"}}


def test_a_job_that_fills_the_map_runs_again_after_it_grew(tmp_path: Any, lane: StorageLane) -> None:
    path = str(tmp_path / "g")
    big = os.urandom(2000)

    async def main() -> int:
        group = _group(path, lane, members=2, map_size=1 << 20)
        (db,) = await _open_dbs(group, [b"q1.p0"])
        runs = 0

        def fill() -> None:
            nonlocal runs
            runs += 1
            try:
                with group.env.begin(write=True) as txn:
                    for i in range(600):
                        txn.put(b"%06d" % i, big, db=db)
            except lmdb.MapFullError as exc:
                raise MapFull() from exc

        await group.job(fill)
        await group.close()
        return runs

    assert _run(main()) >= 2
    assert len(_read_back(path, [b"q1.p0"])[b"q1.p0"]) == 600


def test_many_queues_with_failing_cycles_store_exactly_what_committed(tmp_path: Any, lane: StorageLane) -> None:
    """Twenty queues, fifty cycles each, every seventh cycle failing half-way."""
    path = str(tmp_path / "g")
    names = [b"q%d.p0" % i for i in range(20)]

    async def main() -> dict[bytes, dict[bytes, bytes]]:
        group = _group(path, lane, members=len(names))
        dbs = await _open_dbs(group, names)
        expected: dict[bytes, dict[bytes, bytes]] = {name: {} for name in names}

        async def queue(i: int) -> None:
            for n in range(50):
                key, value = b"k%03d" % n, b"%d-%d" % (i, n)

                def body(txn: lmdb.Transaction[bytes], key: bytes = key, value: bytes = value, n: int = n) -> None:
                    txn.put(key, value, db=dbs[i])
                    if (i + n) % 7 == 0:
                        raise RuntimeError("half-way")

                try:
                    _, committed = await group.run(body)
                except RuntimeError:
                    continue
                await committed
                expected[names[i]][key] = value

        await asyncio.gather(*(queue(i) for i in range(len(names))))
        assert group.commits < 20 * 50 * 6 // 7  # commits were shared
        await group.close()
        return expected

    expected = _run(main())
    assert _read_back(path, names) == expected
