"""Hand-overs: entries a queue committed to an outbox of its own, handed to another
queue and dropped once that queue has stored them.

Two outboxes use it: dead letters (to the dead-letter queue) and redriven items (to
their target queues). Each receiver deduplicates what it stored (dead letters by
source_id, redriven items by their hand-over id), so sending again after a crash, or
after a failure between its commit and ours, stores nothing twice. A failing hand-over
is tried again every ``RETRY_S``: logged at its first failure, then at most once a
``LOG_EVERY_S`` with the count of failed tries, and once when it goes through again.
Entries of a faulty partition wait until it works again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Container
from typing import Generic, TypeVar

from ..errors import QueratorError
from ..logging import RepeatedFailure, get_logger

log = get_logger("queue")

V = TypeVar("V")
Key = tuple[int, int]  # (partition, seq) of the entry in this queue's outbox
# ``send(chunk, done)`` hands ``chunk`` over and calls ``done(keys)`` for the entries it
# has handed over for good (the receiver stored them and this queue recorded that).
Send = Callable[[list[tuple[Key, V]], Callable[[list[Key]], None]], Awaitable[None]]

# How long to wait before handing over again after a failure.
RETRY_S = 1.0
# A hand-over that keeps failing is logged at most this often (with a count).
LOG_EVERY_S = 60.0
# Entries per try: a receiver's cycle takes them in one request.
CHUNK = 1000


class HandOver(Generic[V]):
    """One outbox of a queue and the task that empties it.

    ``kind`` names the log events (``<kind>_failed``, ``<kind>_recovered``) and the task;
    ``receiver`` gives the receiving queue's name, logged as ``receiver_field`` and
    counted apart (None: the receivers are not named, one count for all)."""

    def __init__(
        self,
        queue: str,
        kind: str,
        send: Send[V],
        *,
        closed: Callable[[], bool],
        faulty: Callable[[], Container[int]],
        receiver: Callable[[], str] | None = None,
        receiver_field: str = "",
    ) -> None:
        self.entries: dict[Key, V] = {}
        self._queue = queue
        self._kind = kind
        self._send = send
        self._closed = closed
        self._faulty = faulty
        self._receiver = receiver
        self._receiver_field = receiver_field
        self._failures: dict[str, RepeatedFailure] = {}
        self._task: asyncio.Task[None] | None = None
        # Callers waiting for entries to be handed over: (their keys, their future).
        self._waiters: list[tuple[list[Key], asyncio.Future[None]]] = []

    def kick(self) -> None:
        """Start handing over, unless it runs already or there is nothing to hand."""
        if self.entries and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name=f"{self._kind}:{self._queue}")

    async def wait(self) -> None:
        """Until the running hand-over (if any) ends: everything handed, or stopped."""
        if self._task is not None:
            await asyncio.shield(self._task)

    def wait_for(self, keys: list[Key], waiter: asyncio.Future[None]) -> None:
        """Resolve ``waiter`` once every entry of ``keys`` is handed over."""
        self._waiters.append((keys, waiter))

    async def cancel(self, why: Exception) -> None:
        """Stop handing over (what is left stays in the outbox); waiters fail with ``why``."""
        for _keys, waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(why)
        self._waiters = []
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def _done(self, keys: list[Key]) -> None:
        for key in keys:
            self.entries.pop(key, None)
        if self._waiters:
            self._waiters = [(ks, w) for ks, w in self._waiters if not _settled(ks, w, self.entries)]

    async def _run(self) -> None:
        while self.entries and not self._closed():
            faulty = self._faulty()
            pending = [entry for entry in self.entries.items() if entry[0][0] not in faulty]
            if not pending:
                return  # theirs wait until the partition works again (a recovery kicks)
            receiver = self._receiver() if self._receiver is not None else ""
            named = {self._receiver_field: receiver} if self._receiver_field else {}
            try:
                await self._send(pending[:CHUNK], self._done)
            except QueratorError as exc:
                reported = self._failures.setdefault(receiver, RepeatedFailure(LOG_EVERY_S)).failed()
                if reported:
                    log.warning(
                        f"{self._kind}_failed",
                        queue=self._queue,
                        **named,
                        error=exc.message,
                        failures=reported,
                        retry_every_s=RETRY_S,
                    )
                await asyncio.sleep(RETRY_S)
                continue
            recovered = self._failures.pop(receiver, None)
            if recovered is not None:
                log.info(f"{self._kind}_recovered", queue=self._queue, **named, failures=recovered.failures)


def _settled(keys: list[Key], waiter: asyncio.Future[None], entries: Container[Key]) -> bool:
    """Whether ``waiter`` is done with: resolved now that none of its keys is left."""
    if waiter.done():
        return True
    if any(key in entries for key in keys):
        return False
    waiter.set_result(None)
    return True
