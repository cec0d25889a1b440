"""Work that must run to its end once begun, whoever awaited it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def settled(work: Coroutine[Any, Any, T]) -> T:
    """``work`` run to its end even when the caller is cancelled; the caller still gets
    CancelledError, but only once the work is done (so a lock it holds is kept until
    then, and nothing else runs on what the work changes in between).

    For a write and what is noted of it in memory: gRPC cancels a call's handler when
    the caller goes away (a primary killed, an asker timed out), while a write already
    handed to a storage lane or a commit group becomes durable anyway. Stopping between
    the two left memory behind the storage."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    finally:
        if not task.done():
            await asyncio.wait([task])
            if not task.cancelled():
                task.exception()  # the caller is gone: its error goes with it
