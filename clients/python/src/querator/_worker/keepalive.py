"""Keep-alive: extends the leases of the items a worker holds, up to ``max_lease_duration``."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from .._config import MAX_BATCH
from ..errors import LeaseLost, QueratorError

if TYPE_CHECKING:
    from .state import EngineState, Held

# Keep-alive does not bother to extend a lease by less than this (max_lease_duration).
_MIN_EXTENSION = 1.0


class KeepAlive:
    """Extends each held item's lease when about half of it is gone, in batches per
    partition; never beyond ``max_lease_duration`` from the lease."""

    def __init__(self, engine: EngineState) -> None:
        self.engine = engine

    async def run(self) -> None:
        e = self.engine
        while True:
            now = time.monotonic()
            due = [h for h in e.held.values() if self._keep(h) and h.extend_at <= now]
            if due:
                await self._extend(due)
            now = time.monotonic()
            upcoming = [h.extend_at for h in e.held.values() if self._keep(h)]
            delay = min(upcoming, default=now + 1.0) - now
            e.new_leases.clear()
            try:
                await asyncio.wait_for(e.new_leases.wait(), min(max(delay, 0.02), 1.0))
            except TimeoutError:
                pass

    @staticmethod
    def _keep(held: Held) -> bool:
        return not (held.lost or held.abandoned or held.settling or held.capped or held.item.settled)

    def _capped(self, due: list[Held]) -> tuple[list[Held], list[tuple[Held, float]]]:
        """``due`` split by ``max_lease_duration``: those extended by the usual length,
        and those that may only be extended by less (the room left to the cap)."""
        e = self.engine
        assert e.max_lease is not None
        full = e.extension or e.lease_timeout
        now = time.monotonic()
        whole: list[Held] = []
        short: list[tuple[Held, float]] = []
        for held in due:
            left = held.leased_at + e.max_lease - now
            if left >= full:
                whole.append(held)
            elif left >= _MIN_EXTENSION:
                short.append((held, left))
            else:
                held.capped = True
                e.stats.lease_capped += 1
                e.hook("on_lease_capped", held.item)
        return whole, short

    async def _extend(self, due: list[Held]) -> None:
        e = self.engine
        if e.max_lease is not None:
            due, short = self._capped(due)
            for held, left in short:
                await self._extend_one(held, left)
        groups: dict[int, list[Held]] = {}
        for held in due:
            groups.setdefault(held.item.partition, []).append(held)
        for members in groups.values():
            for start in range(0, len(members), MAX_BATCH):
                chunk = members[start : start + MAX_BATCH]
                sent = time.monotonic()
                try:
                    await e.calls.extend([h.item for h in chunk], e.extension)
                except LeaseLost:
                    for held in chunk:
                        await self._extend_one(held, e.extension)
                    continue
                except QueratorError as error:
                    e.stats.errors += 1
                    e.hook("on_error", error)
                    for held in chunk:  # try again soon, while the lease lasts
                        held.extend_at = sent + min(1.0, held.length / 10)
                    continue
                self._extended(chunk, sent, e.extension or e.lease_timeout)

    async def _extend_one(self, held: Held, length: float | None) -> None:
        e = self.engine
        sent = time.monotonic()
        try:
            await e.calls.extend(held.item, length)
        except LeaseLost as error:
            assert isinstance(error, QueratorError)
            if self._keep(held):  # else it was completed meanwhile: not lost
                e.lost(held, error)
        except QueratorError as error:
            e.stats.errors += 1
            e.hook("on_error", error)
            held.extend_at = sent + min(1.0, held.length / 10)
        else:
            self._extended([held], sent, length or e.extension or e.lease_timeout)

    def _extended(self, chunk: list[Held], sent: float, length: float) -> None:
        e = self.engine
        for held in chunk:
            held.length = length
            held.extend_at = sent + length / 2
        e.stats.extended += len(chunk)
        e.hook("on_extend", [h.item for h in chunk])
