"""Commit groups on real LMDB and real lanes: who shares a commit, and what a failure undoes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import lmdb
import pytest
from querator_server.actor.commit_group import CommitGroup
from querator_server.actor.lane import StorageLane
from querator_server.faults import FAULT_FILE_ENV
from querator_server.storage import MapFull, StorageError
from querator_server.storage.groups import open_group_env


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
    env = lmdb.open(path, max_dbs=16, readonly=True, lock=False)
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
