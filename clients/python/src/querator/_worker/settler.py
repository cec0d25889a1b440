"""Completes and retries a worker's items in batches."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import TYPE_CHECKING

from .._config import MAX_BATCH
from ..errors import LeaseLost, QueratorError, Unavailable

if TYPE_CHECKING:
    from .state import EngineState, Held

# (held, "complete" or "retry", retry at, dead, future, error text)
_Entry = tuple["Held", str, datetime | None, bool, "asyncio.Future[bool]", str]


class Settler:
    """Completes and retries in batches: what queued up while a call ran goes in the next one."""

    def __init__(self, engine: EngineState) -> None:
        self.engine = engine
        self.queue: list[_Entry] = []
        self.wake = asyncio.Event()

    async def submit(self, held: Held, kind: str, retry_at: datetime | None, dead: bool, error: str = "") -> bool:
        """Queue one settlement and wait for it; True when it took effect."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.queue.append((held, kind, retry_at, dead, future, error))
        self.wake.set()
        return await future

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.queue = self.queue, []
            groups: dict[tuple[str, int], list[_Entry]] = {}
            for entry in batch:
                groups.setdefault((entry[1], entry[0].item.partition), []).append(entry)
            for (kind, _), entries in groups.items():
                for start in range(0, len(entries), MAX_BATCH):
                    await self._apply(kind, entries[start : start + MAX_BATCH], split=True)

    async def _apply(self, kind: str, entries: list[_Entry], *, split: bool) -> None:
        engine = self.engine
        calls = engine.calls
        attempt = 0
        while True:
            try:
                if kind == "complete":
                    await calls.complete([e[0].item for e in entries])
                else:
                    await calls.retry([(e[0].item, e[2], e[3], e[5]) for e in entries])
            except LeaseLost as error:
                if split and len(entries) > 1:
                    for entry in entries:  # all-or-nothing: find the lost ones
                        await self._apply(kind, [entry], split=False)
                    return
                assert isinstance(error, QueratorError)
                for entry in entries:
                    engine.lost(entry[0], error)
                    resolve(entry[4], False)
                return
            except Unavailable as error:
                attempt += 1
                if attempt <= calls.retries:
                    await asyncio.sleep(calls.backoff(attempt))
                    continue
                self._failed(entries, error)
                return
            except QueratorError as error:
                self._failed(entries, error)
                return
            for entry in entries:
                resolve(entry[4], True)
            return

    def _failed(self, entries: list[_Entry], error: QueratorError) -> None:
        self.engine.stats.errors += 1
        self.engine.hook("on_error", error)
        for entry in entries:
            resolve(entry[4], False)


def resolve(future: asyncio.Future[bool], value: bool) -> None:
    if not future.done():
        future.set_result(value)
