"""A grouped queue's cycle is kept in its actor's books by the group's commit callback,
not by a second wake-up of the actor (real actors, real LMDB, durable commits)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from querator_server.actor import LeaseRequest, LogicalQueue, ProduceRequest
from querator_server.errors import Unavailable
from querator_server.faults import FAULT_FILE_ENV
from querator_server.manager import QueuesManager
from querator_server.model import QueueConfig


def _run(tmp_path: Path, names: list[str], body: Callable[[QueuesManager, list[LogicalQueue]], Awaitable[None]]) -> None:
    async def main() -> None:
        manager = QueuesManager(str(tmp_path / "data"))
        await manager.start()
        try:
            for name in names:
                await manager.create(QueueConfig(name=name, partitions=1))
            actors = [manager.actor(name) for name in names]
            assert all(a.group is not None and a.group is actors[0].group for a in actors)
            await body(manager, actors)
        finally:
            await manager.stop()

    asyncio.run(main())


def _counts(actor: LogicalQueue) -> tuple[int, int]:
    stats = actor.stats()
    return sum(p.total for p in stats.partitions), sum(p.total_leased for p in stats.partitions)


def _lease(batch: int, client: str, complete: list[str] | None = None) -> LeaseRequest:
    return LeaseRequest(batch_size=batch, client_id=client, wait_until_us=0, complete_ids=complete or [], complete_partition=0)


def test_a_grouped_queue_keeps_its_books_a_turn_after_its_answers_without_its_task(tmp_path: Path) -> None:
    # The commit's answers go out first; the books of every queue of the commit are
    # kept in the next turn by the group's one callback, not by a wake-up of each task.
    async def body(manager: QueuesManager, actors: list[LogicalQueue]) -> None:
        await asyncio.gather(*(a.submit(ProduceRequest(items=[], payloads=[b"x"] * 10)) for a in actors))
        await asyncio.sleep(0)
        assert [_counts(a) for a in actors] == [(10, 0)] * 3
        for round_ in range(4):
            futures = [a.submit(_lease(2, f"c{i}")) for i, a in enumerate(actors)]
            results = [await future for future in futures]
            await asyncio.sleep(0)
            assert [_counts(a) for a in actors] == [(10 - 2 * round_, 2)] * 3, round_
            assert all(a._joined is None for a in actors)
            futures = [a.submit(_lease(0, f"c{i}", list(r.ids))) for i, (a, r) in enumerate(zip(actors, results, strict=True))]
            for future in futures:
                assert not (await future).ids
            await asyncio.sleep(0)
            assert [_counts(a) for a in actors] == [(8 - 2 * round_, 0)] * 3, round_

    _run(tmp_path, ["a", "b", "c"], body)


def test_a_request_that_comes_while_the_cycle_waits_on_its_commit_is_applied_after_it(tmp_path: Path) -> None:
    async def body(manager: QueuesManager, actors: list[LogicalQueue]) -> None:
        a, b = actors
        group = a.group
        assert group is not None
        commits = group.commits
        first = a.submit(ProduceRequest(items=[], payloads=[b"first"]))
        other = b.submit(ProduceRequest(items=[], payloads=[b"other"]))
        # Let a's cycle run and join the commit (the commit waits two turns for others).
        for _ in range(50):
            await asyncio.sleep(0)
            if a._joined is not None:
                break
        assert a._joined is not None, "a's cycle did not wait on the group's commit"
        second = a.submit(ProduceRequest(items=[], payloads=[b"second"]))
        await asyncio.gather(first, other, second)
        assert group.commits > commits
        lease = await a.submit(_lease(10, "c"))
        assert lease.payloads == [b"first", b"second"]
        await asyncio.sleep(0)
        assert a._joined is None and a.waiting_requests() == 0

    _run(tmp_path, ["a", "b"], body)


def test_a_failed_commit_fails_what_joined_it_and_each_queue_serves_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))

    async def body(manager: QueuesManager, actors: list[LogicalQueue]) -> None:
        await asyncio.gather(*(a.submit(ProduceRequest(items=[], payloads=[b"kept"] * 3)) for a in actors))
        fault.write_text("io-error")
        failed = await asyncio.gather(
            *(a.submit(ProduceRequest(items=[], payloads=[b"lost"])) for a in actors),
            *(a.submit(_lease(3, f"c{i}")) for i, a in enumerate(actors)),
            return_exceptions=True,
        )
        assert all(isinstance(r, Unavailable) and "Input/output error" in str(r) for r in failed), failed
        fault.unlink()
        assert [_counts(a) for a in actors] == [(3, 0)] * 2  # nothing of the failed commit
        leases = await asyncio.gather(*(a.submit(_lease(10, f"c{i}")) for i, a in enumerate(actors)))
        assert [r.payloads for r in leases] == [[b"kept"] * 3] * 2
        assert not any(a.failed for a in actors)

    _run(tmp_path, ["a", "b"], body)


def test_a_full_disk_at_the_commit_refuses_the_adds_and_keeps_the_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The commit of a cycle with a Produce and a Lease fails for a full disk: the
    # Produce fails, the Lease is tried again alone (the fault is gone by then).
    fault = tmp_path / "fault"
    monkeypatch.setenv(FAULT_FILE_ENV, str(fault))

    async def body(manager: QueuesManager, actors: list[LogicalQueue]) -> None:
        a, _b = actors
        await a.submit(ProduceRequest(items=[], payloads=[b"kept"] * 2))
        group = a.group
        assert group is not None
        fault.write_text("no-space")
        produce = a.submit(ProduceRequest(items=[], payloads=[b"refused"]))
        lease = a.submit(_lease(5, "c"))
        for _ in range(50):
            await asyncio.sleep(0)
            if a._joined is not None:
                break
        assert a._joined is not None
        original = group._commit

        def commit_once_failing(parent: Any) -> Any:
            outcome = original(parent)
            fault.unlink(missing_ok=True)  # the retry's commit works
            return outcome

        monkeypatch.setattr(group, "_commit", commit_once_failing)
        with pytest.raises(Unavailable, match="No space left"):
            await produce
        leased = await lease
        assert leased.payloads == [b"kept"] * 2
        # The retry alone was awaited by the actor, which keeps its books a turn after.
        for _ in range(50):
            if _counts(a) == (2, 2):
                break
            await asyncio.sleep(0)
        assert _counts(a) == (2, 2)

    _run(tmp_path, ["a", "b"], body)


class _Crashing:
    """A metrics hook whose cycle report raises (a bug in the bookkeeping)."""

    def cycle_done(self, *_args: object) -> None:
        raise RuntimeError("bookkeeping bug")


def test_a_bookkeeping_that_raises_in_the_commit_callback_ends_only_its_own_actor(tmp_path: Path) -> None:
    async def body(manager: QueuesManager, actors: list[LogicalQueue]) -> None:
        a, b = actors
        a.observer = _Crashing()
        answers = await asyncio.gather(
            a.submit(ProduceRequest(items=[], payloads=[b"a"])),
            b.submit(ProduceRequest(items=[], payloads=[b"b"])),
            return_exceptions=True,
        )
        assert not any(isinstance(r, BaseException) for r in answers), answers
        assert a._task is not None
        with pytest.raises(RuntimeError, match="bookkeeping bug"):
            await asyncio.wait_for(asyncio.shield(a._task), 10)
        # The other queue of the same commit kept its answers and serves on.
        assert _counts(b) == (1, 0)
        leased = await b.submit(_lease(5, "c"))
        assert leased.payloads == [b"b"]
        # The manager's stop awaits each actor's task: a's ended as checked above.
        a._task = asyncio.create_task(asyncio.sleep(0))

    _run(tmp_path, ["a", "b"], body)


def test_a_stop_while_a_cycle_waits_on_its_commit_answers_it_and_keeps_it(tmp_path: Path) -> None:
    async def main() -> None:
        manager = QueuesManager(str(tmp_path / "data"))
        await manager.start()
        for name in ("a", "b"):
            await manager.create(QueueConfig(name=name, partitions=1))
        a = manager.actor("a")
        produced = a.submit(ProduceRequest(items=[], payloads=[b"kept"]))
        for _ in range(50):
            await asyncio.sleep(0)
            if a._joined is not None:
                break
        assert a._joined is not None
        await manager.stop()
        assert produced.done() and produced.exception() is None
        manager = QueuesManager(str(tmp_path / "data"))
        await manager.start()
        try:
            leased = await manager.actor("a").submit(_lease(5, "c"))
            assert leased.payloads == [b"kept"]
        finally:
            await manager.stop()

    asyncio.run(main())
