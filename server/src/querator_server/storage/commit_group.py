"""Commit groups: queues that share one LMDB environment and one durable commit.

A queue with an environment of its own pays a durable commit (two fsyncs) for every
cycle, however small; ten quiet queues pay ten. Queues in a group instead write each
cycle in a *nested* transaction of the group's held one, on the event loop, and one
commit on the group's storage lane makes every cycle that joined it durable. A cycle
that fails aborts only its own nested transaction; the others stay in.

The held transaction is begun and committed on the lane (LMDB ties it to the thread
that began it), while nested transactions are begun and committed on the loop, so
the two must never overlap: the loop hands the lane a job only when no nested
transaction is open, and begins none until the job is done. Everything the lane does
for the group goes through ``_hand``, which first commits what joined.

A commit is handed to the lane after two turns of the loop: the first turn runs the
callbacks that were ready when the first cycle joined, among them the actors woken
by the last commit, and the second lets their cycles run, so they join this commit
instead of each paying one of their own. A group with one queue commits at once, and
so does a cycle that joins while nothing else is ready to run on the loop when the
last commit carried only its own queue's cycles: a lone caller of one queue of a
group, whose every call the two turns would delay. While other queues share the
commits, the turns stay as they were, nothing ready or not, so busy queues batch
exactly as before (bench/RESULTS.md, "The plain generated-stub caller").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import lmdb

from .lane import StorageLane
from .queue_store import (
    MAX_GROWTHS,
    MapFull,
    StorageError,
    StorageFull,
    inject_write_fault,
    write_failure,
)

T = TypeVar("T")

# A commit carrying this many requests gives the GIL to the lane at once (time.sleep(0))
# rather than when the loop next blocks: the lane's thread needs it to start the
# commit, and with both cores busy it otherwise waits 300-400 µs for it. A commit of
# one request is usually one of a quiet queue, which would pay the hand-over alone.
HAND_OVER_AT = 2


def _nothing_ready(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether no callback waits to run on ``loop`` (known of asyncio's own loops only)."""
    ready = getattr(loop, "_ready", None)
    return ready is not None and not ready


@dataclass(slots=True)
class _Outcome:
    """What one job of the lane did."""

    error: BaseException | None = None  # of the commit
    result: Any = None  # of the extra function
    failure: BaseException | None = None  # of the extra function
    held: Any = None  # the next held transaction
    hold_error: BaseException | None = None
    took: float = 0.0  # seconds the commit took


class CommitGroup:
    """One shared environment, its held transaction, and the cycles waiting on its commit."""

    def __init__(self, env: lmdb.Environment, path: str, lane: StorageLane) -> None:
        self.env = env
        self.path = path
        self.lane = lane
        # Queues whose actors use the group (kept by the manager): one commits at once.
        self.members = 0
        self._parent: lmdb.Transaction[bytes] | None = None
        self._joined: list[tuple[asyncio.Future[None], Callable[[float], None] | None, Callable[[], None] | None]] = []
        # The members (their keys) whose cycles joined the pending commit, and the last one.
        self._joining: set[object] = set()
        self._last_commit: set[object] = set()
        # A job of the lane's is running; who waits for its end (one future each, so
        # that a waiter cancelled cancels nobody else's wait).
        self._busy = False
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._flush_scheduled = False
        self._requests = 0  # in the cycles that joined
        self._closed = False
        self.commits = 0

    # -- cycles ------------------------------------------------------------------------

    async def run(
        self,
        body: Callable[[lmdb.Transaction[bytes]], T],
        on_commit: Callable[[float], None] | None = None,
        requests: int = 1,
        on_durable: Callable[[T], None] | None = None,
        member: object = None,
    ) -> tuple[T, asyncio.Future[None]]:
        """Run ``body`` (a cycle of ``requests`` requests) in a nested transaction and
        join the next commit.

        Returns the body's result and a future that ends when the commit holding it is
        durable (or fails); ``on_durable`` (given the body's result) and ``on_commit``
        (given the commit's duration) are called as the commit is known durable, a turn
        of the loop before whoever awaits the future runs. ``member`` names the queue
        (any key; None: unknown), for the rule on when to commit at once.
        Raises ``MapFull`` (call ``grow``) or ``StorageError`` with nothing written;
        any exception of the body aborts only its own writes.
        """
        # The common case (a held transaction, no job running) checks three fields:
        # a cycle of a quiet queue of a busy group pays this path once per request.
        while self._busy or self._parent is None or self._closed:
            await self._idle()
            if self._closed:
                raise StorageError("the storage group is closed")
            if self._parent is not None:
                break
            outcome = await asyncio.shield(self._hand(None))
            if outcome.hold_error is not None:
                raise StorageError(f"storage write failed: {outcome.hold_error}")
        child = self.env.begin(write=True, parent=self._parent)
        # As aborted_on_failure, without a generator per cycle.
        try:
            result = body(child)
            child.commit()
        except lmdb.MapFullError as exc:
            child.abort()
            raise MapFull() from exc
        except lmdb.Error as exc:
            child.abort()
            raise StorageError(write_failure(exc, self.path)) from exc
        except BaseException:
            child.abort()
            raise
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._joined.append((done, on_commit, None if on_durable is None else partial(on_durable, result)))
        self._requests += requests
        if self.members <= 1:
            self._flush()
            return result, done
        # Alone: the last commit and the one pending hold no other member's cycles.
        joining, last = self._joining, self._last_commit
        alone = (
            member is not None
            and not (last and (len(last) > 1 or member not in last))
            and not (joining and (len(joining) > 1 or member not in joining))
        )
        if member is not None:
            joining.add(member)
        if alone and _nothing_ready(loop):
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(loop.call_soon, self._flush)
        return result, done

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._joined and not self._busy:
            requests = self._requests
            self._hand(None)
            if requests >= HAND_OVER_AT:
                time.sleep(0)

    async def job(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the lane with no transaction of the group open, so that it
        may begin and commit write transactions of its own (opening or dropping
        databases). Whatever joined before is committed first.

        ``fn`` raising ``MapFull`` is run again after the map has grown, so it must
        change nothing outside its transaction before it commits.
        """
        for _ in range(MAX_GROWTHS):
            await self._idle()
            outcome = await asyncio.shield(self._hand(fn))
            if isinstance(outcome.failure, MapFull):
                await self.grow()
                continue
            if outcome.failure is not None:
                raise outcome.failure
            return outcome.result  # type: ignore[no-any-return]
        raise StorageFull("storage is full: the LMDB map could not grow enough")

    async def grow(self) -> None:
        """Double the map after ``MapFull``; what joined before is committed first.

        The map is resized on the loop, with no transaction of the group held: LMDB
        remaps the file, which a read on another thread must not be in the middle of,
        and every read of a group's environment happens on the loop or in a job.
        """
        while True:
            await self._idle()
            if self._parent is None:
                break  # and nothing runs on the lane for the group until the next await
            await asyncio.shield(self._hand(None, hold=False))
        size = self.env.info()["map_size"]
        try:
            self.env.set_mapsize(size * 2)
        except lmdb.Error as exc:
            raise StorageFull(f"storage is full and cannot grow past {size} bytes: {exc}") from exc

    async def close(self) -> None:
        """Commit what joined, give up the held transaction and close the environment."""
        await self._idle()
        self._closed = True
        await asyncio.shield(self._hand(self.env.close, hold=False))

    # -- the lane's side -------------------------------------------------------------

    async def _idle(self) -> None:
        # A future of its own per waiter: a caller cancelled while it waits cancels only
        # its own wait (asyncio.shield would make two futures and a turn more per wait).
        while self._busy:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(waiter)
            await waiter

    def _hand(self, extra: Callable[[], Any] | None, *, hold: bool = True) -> asyncio.Future[_Outcome]:
        """Give the lane one job: commit what joined, run ``extra``, hold the next
        transaction. No nested transaction may begin until it is done.

        The returned future is the group's own: callers await it shielded, since the
        job runs to its end whatever they do, and the group must learn how it ended.
        """
        loop = asyncio.get_running_loop()
        joined, self._joined = self._joined, []
        self._last_commit, self._joining = self._joining, set()
        self._requests = 0
        parent, self._parent = self._parent, None
        ended: asyncio.Future[_Outcome] = loop.create_future()
        self._busy = True

        def finished(result: _Outcome | None, error: BaseException | None) -> None:
            if error is not None or result is None:
                # _job catches everything; this is the lane refusing the job.
                outcome = _Outcome(error=StorageError(f"storage write failed: {error}"))
            else:
                outcome = result
            self._parent = outcome.held
            self._busy = False
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            for done, on_commit, on_durable in joined:
                if done.done():
                    continue
                if outcome.error is None:
                    if on_durable is not None:
                        on_durable()
                    done.set_result(None)
                    if on_commit is not None:
                        on_commit(outcome.took)
                else:
                    done.set_exception(outcome.error)
            ended.set_result(outcome)
            if self._joined:
                self._flush()

        try:
            self.lane.run_then(partial(self._job, parent, bool(joined), extra, hold), finished)
        except RuntimeError as exc:  # the lane is shut down (the server is stopping)
            finished(None, exc)
        return ended

    def _job(self, parent: Any, commit: bool, extra: Callable[[], Any] | None, hold: bool) -> _Outcome:
        done = _Outcome()
        if parent is not None:
            if commit:
                done.error, done.took = self._commit(parent)
            else:
                parent.abort()
        elif commit:
            done.error = StorageError("storage write failed: no transaction was held")
        if extra is not None:
            try:
                done.result = extra()
            except BaseException as exc:  # handed to the caller of job()
                done.failure = exc
        if hold:
            try:
                done.held = self.env.begin(write=True)
            except lmdb.Error as exc:  # the next cycle asks again
                done.hold_error = exc
        return done

    def _commit(self, parent: lmdb.Transaction[bytes]) -> tuple[BaseException | None, float]:
        """Commit the held transaction durably: (the failure or None, seconds taken)."""
        started = time.perf_counter()
        try:
            inject_write_fault(self.path)
            parent.commit()
        except lmdb.MapFullError:
            parent.abort()
            return StorageFull("storage is full: the commit did not fit in the LMDB map"), 0.0
        except lmdb.Error as exc:
            parent.abort()
            return StorageError(write_failure(exc, self.path)), 0.0
        except Exception as exc:  # an injected fault, or a bug: never leave the lock held
            parent.abort()
            return exc if isinstance(exc, StorageError) else StorageError(f"storage write failed: {exc!r}"), 0.0
        self.commits += 1
        return None, time.perf_counter() - started
