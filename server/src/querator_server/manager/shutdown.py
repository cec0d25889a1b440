"""Stopping: every actor drained, passive copies and commit groups closed, the catalog
closed, the storage threads ended and the data directory unlocked.

One queue that cannot stop (its actor's task had died, its copy fails to close) is
logged and the rest still stops: raising out of here would leave the other queues'
storage, the catalog, the storage threads and the lock on the data directory open.
"""

from __future__ import annotations

import asyncio
import contextlib

from ..actor import LogicalQueue
from .state import ManagerState, log


class Shutdown(ManagerState):
    async def stop(self) -> None:
        """Drain every actor, then close storage."""
        self._closing = True
        try:
            async with self._lock:
                passive = [(name, copy) for name, copy in self._copies.items() if name not in self._actors]
                actors = list(self._actors.values())
                outcomes = await asyncio.gather(*(actor.stop() for actor in actors), return_exceptions=True)
                self._actors.clear()
                for actor, outcome in zip(actors, outcomes, strict=True):
                    if isinstance(outcome, BaseException):
                        await self._stop_failed(actor, outcome)
                for name, copy in passive:
                    try:
                        await copy.close()
                    except Exception as exc:
                        log.error("queue_stop_failed", queue=name, error=repr(exc), exc_info=exc)
                self._copies.clear()
                await self._groups.close()
                if self._catalog is not None:
                    self._catalog.close()
                    self._catalog = None
        finally:
            self._executor.shutdown(wait=True)
            for lane in self._lanes:
                lane.shutdown(wait=True)
            self._unlock()

    async def _stop_failed(self, actor: LogicalQueue, exc: BaseException) -> None:
        """``actor`` did not stop (its task ended with ``exc``, or its storage failed on
        the way): logged, and its own environment closed here, on its lane, as its stop
        would have (a grouped queue's closes with its group)."""
        log.error("queue_stop_failed", queue=actor.name, error=repr(exc), exc_info=exc)
        if actor.group is None:
            with contextlib.suppress(Exception):
                await self._lane(actor.config.uid).run(actor.store.close)
