"""A cycle's transaction: run on the loop, committed on a storage lane, and the
cycle's requests answered as soon as the commit is durable.

A queue with an environment of its own runs the cycle in the store's held write
transaction and commits it on the queue's lane (see queue_store.py for why the work
stays on the loop); a queue in a commit group runs it in a nested transaction of the
group's and waits for the group's next commit (storage/commit_group.py). A full map is
grown and the cycle run again, up to ``MAX_GROWTHS`` times.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import lmdb

from ..storage import MAX_GROWTHS, MapFull, QueueStore, StorageFull
from ..storage.commit_group import HAND_OVER_AT, CommitGroup
from ..storage.lane import StorageLane
from .cycle import Cycle
from .requests import Request

Body = Callable[["lmdb.Transaction[bytes]"], Cycle]


async def run_own(store: QueueStore, lane: StorageLane, body: Body, requests: int, *, answer_early: bool = True) -> Cycle:
    """``body`` in the store's held transaction, committed on ``lane``; the cycle's
    requests are answered as the commit returns, unless not ``answer_early``."""
    for _ in range(MAX_GROWTHS):
        if not store.held:
            await lane.run(store.hold)
        try:
            cycle = store.run_held(body)
            committed = _committed(lane, store.commit_held, cycle if answer_early else None)
            if requests >= HAND_OVER_AT:
                time.sleep(0)  # give the lane the GIL now: it waits for it to commit
            await committed
            return cycle
        except MapFull:
            await lane.run(store.grow)
        except Exception:
            await lane.run(store.abort_held)
            raise
    raise StorageFull("storage is full: the LMDB map could not grow enough")


async def run_grouped(
    group: CommitGroup, store: QueueStore, body: Body, requests: int, member: Any, *, answer_early: bool = True
) -> Cycle:
    """``body`` in a nested transaction of the group's, durable with its next commit
    (which answers the cycle's requests, unless not ``answer_early``)."""
    durable = answer_results if answer_early else None
    for _ in range(MAX_GROWTHS):
        try:
            cycle, committed = await group.run(body, store.on_commit, requests, on_durable=durable, member=member)
        except MapFull:
            await group.grow()
            continue
        await committed
        return cycle
    raise StorageFull("storage is full: the LMDB map could not grow enough")


def answer_results(cycle: Cycle) -> None:
    """Answer a cycle's requests as its commit is known durable: one turn of the loop
    before the actor itself resumes (which answers whatever is left)."""
    for request, result in cycle.results:
        answer(request, result)


def _committed(lane: StorageLane, commit: Callable[[], None], cycle: Cycle | None) -> asyncio.Future[None]:
    """Commit on ``lane``; the requests of ``cycle`` (if given) are answered as the commit returns."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def done(_result: None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
            return
        if cycle is not None:
            answer_results(cycle)
        future.set_result(None)

    lane.run_then(commit, done)
    return future


def answer(request: Request, result: object) -> None:
    """Resolve ``request``'s future with ``result`` (an exception fails it), once."""
    future = request.future
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
