"""Stopping: every actor drained, passive copies and commit groups closed, the catalog
closed, the storage threads ended and the data directory unlocked."""

from __future__ import annotations

import asyncio

from .state import ManagerState


class Shutdown(ManagerState):
    async def stop(self) -> None:
        """Drain every actor, then close storage."""
        self._closing = True
        async with self._lock:
            passive = [copy for name, copy in self._copies.items() if name not in self._actors]
            await asyncio.gather(*(actor.stop() for actor in self._actors.values()))
            self._actors.clear()
            for copy in passive:
                await copy.close()
            self._copies.clear()
            await self._groups.close()
            if self._catalog is not None:
                self._catalog.close()
                self._catalog = None
        self._executor.shutdown(wait=True)
        for lane in self._lanes:
            lane.shutdown(wait=True)
        self._unlock()
