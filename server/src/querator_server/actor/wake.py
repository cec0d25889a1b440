"""The actor's wake-up: ``asyncio.Event`` for one waiter, with less per sleep.

An actor of a queue that gets one request per cycle sleeps and wakes once per request
(W4 drain: ten queues, one Lease in flight each). ``asyncio.Event`` keeps a deque of
waiters and takes each out again after the wait; one waiter needs one future.
"""

from __future__ import annotations

import asyncio


class Wake:
    """set / clear / wait as ``asyncio.Event``'s, for a single waiting task."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> bool:
        if not self._set:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return True
