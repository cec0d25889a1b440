"""Storage lanes: the threads that begin and commit the queues' write transactions.

LMDB ties a write transaction to the thread that began it, and its commit (an fsync)
must not stall the event loop, so every queue begins and commits on one lane, a
thread of its own shared with a few other queues.

A lane is an ``Executor`` (``run_in_executor`` works for the rare jobs), but a cycle's
commit goes through ``run`` or ``run_then``: ``ThreadPoolExecutor`` wraps each job in two
futures and wakes the loop once per job, which at a few thousand commits a second costs
the loop more than the commits' own Python. Here a finished job is posted to the loop's
*mailbox*, and the loop is woken once for every job that finished while it was busy,
whichever lane ran it. ``run_then`` hands the result to a callback the mailbox calls
itself: a future's done-callbacks would run one turn of the loop later, and a commit's
callback is what answers the callers (a plain Produce spends 10-15 µs per turn).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from queue import SimpleQueue
from typing import Any, TypeVar

T = TypeVar("T")

# What a finished job's result goes to on the loop: a future, or a callback given
# (result, error).
_Done = Callable[[Any, BaseException | None], None]
_Target = concurrent.futures.Future[Any] | tuple["_Mailbox", "asyncio.Future[Any] | _Done"]


class _Mailbox:
    """Results that lane threads hand to one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._done: deque[tuple[asyncio.Future[Any] | _Done, Any, BaseException | None]] = deque()
        self._scheduled = False

    def post(self, future: asyncio.Future[Any] | _Done, result: Any, error: BaseException | None) -> None:
        """From a lane thread: deliver this result (wake the loop unless it will look anyway)."""
        self._done.append((future, result, error))
        if not self._scheduled:
            # Cleared by _deliver *before* it empties the queue, so a result appended
            # after the check always finds either a pending delivery or a fresh wake.
            self._scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def _deliver(self) -> None:
        self._scheduled = False
        done = self._done
        while done:
            future, result, error = done.popleft()
            if not isinstance(future, asyncio.Future):
                try:
                    future(result, error)
                except BaseException as exc:  # as the loop does for a failing callback
                    self._loop.call_exception_handler({"message": "storage lane callback failed", "exception": exc})
                continue
            if future.cancelled():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)


_mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}
_mailboxes_lock = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    box = _mailboxes.get(loop)
    if box is None:
        with _mailboxes_lock:
            for old in [known for known in _mailboxes if known.is_closed()]:
                del _mailboxes[old]
            box = _mailboxes.setdefault(loop, _Mailbox(loop))
    return box


class StorageLane(concurrent.futures.Executor):
    """One thread running storage jobs in the order they were handed in."""

    def __init__(self, name: str) -> None:
        self._jobs: SimpleQueue[tuple[Callable[[], Any], _Target] | None] = SimpleQueue()
        self._shutdown = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run ``fn`` on the lane; await the result on the calling event loop."""
        if self._shutdown:
            raise RuntimeError("the storage lane is shut down")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((fn, (_mailbox(loop), future)))
        return future

    def run_then(self, fn: Callable[[], T], done: Callable[[T | None, BaseException | None], None]) -> None:
        """Run ``fn`` on the lane; the calling loop then calls ``done(result, error)``
        as it takes the result, not a turn later as a future's callback would be."""
        if self._shutdown:
            raise RuntimeError("the storage lane is shut down")
        self._jobs.put((fn, (_mailbox(asyncio.get_running_loop()), done)))

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        if self._shutdown:
            raise RuntimeError("the storage lane is shut down")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((partial(fn, *args, **kwargs), future))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if not self._shutdown:
            self._shutdown = True
            self._jobs.put(None)
        if wait:
            self._thread.join()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, target = job
            if isinstance(target, concurrent.futures.Future):
                if not target.set_running_or_notify_cancel():
                    continue
                try:
                    target.set_result(fn())
                except BaseException as exc:  # handed to whoever waits, as an executor does
                    target.set_exception(exc)
                continue
            mailbox, future = target
            try:
                result = fn()
            except BaseException as exc:
                mailbox.post(future, None, exc)
            else:
                mailbox.post(future, result, None)
