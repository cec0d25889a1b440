"""Bytes of stream answers made but not yet sent, bounded per stream and server-wide.

A stream's answers go out in order, each once the client has read enough of the ones
before it (HTTP/2 flow control). A client that stops reading leaves them in memory:
three LeaseStreams that never read took a server from 113 MB to 838 MB, and every
answer held items leased to nobody. So each stream counts the bytes of its answers
from the moment a Lease takes their items until they are sent (gRPC has written them out), and a Lease on
a stream takes items only while its stream and the server have room (the actor asks
``room()`` as it leases: ``LeaseRoom``). One answer always has room on its stream:
the next one to be sent, which waits behind no other (it may still wait for room
server-wide).
"""

from __future__ import annotations

import asyncio
import contextvars
import math
from typing import Any

from ..model import MAX_REPLY_BYTES, SERVER_UNSENT_BYTES, STREAM_UNSENT_BYTES


class SendRoom:
    """The server-wide count, and a wake-up for the Leases waiting for room."""

    def __init__(self, limit: int = SERVER_UNSENT_BYTES) -> None:
        self.limit = limit
        self.unsent = 0
        self._freed: asyncio.Event | None = None

    def room(self) -> int:
        return self.limit - self.unsent

    def take(self, size: int) -> None:
        self.unsent += size

    def give(self, size: int) -> None:
        self.unsent -= size
        if size > 0:
            self.wake()

    def wake(self) -> None:
        """Wake every Lease waiting for room (to look again)."""
        freed = self._freed
        if freed is not None:
            self._freed = None
            freed.set()

    def freed(self) -> asyncio.Event:
        """Set at the next ``give`` of any stream (then replaced)."""
        if self._freed is None:
            self._freed = asyncio.Event()
        return self._freed


class StreamRoom:
    """One stream's unsent bytes, within the server's ``SendRoom``."""

    def __init__(self, server: SendRoom, limit: int = STREAM_UNSENT_BYTES) -> None:
        self.server = server
        self.limit = limit
        self.unsent = 0
        # The task making the answer that is sent next (it waits behind no other).
        self.head: asyncio.Task[Any] | None = None
        # Over: nothing more is leased for it, whatever is still asked.
        self.ended = False

    def end(self) -> None:
        self.ended = True
        self.server.wake()

    def room_for(self, task: asyncio.Task[Any] | None) -> int:
        if self.ended:
            return 0
        server = self.server.room()
        if task is not None and task is self.head:
            return server
        return min(self.limit - self.unsent, server)

    def take(self, size: int) -> None:
        self.unsent += size
        self.server.take(size)

    def give(self, size: int) -> None:
        self.unsent -= size
        self.server.give(size)

    async def wait_for_room(self, task: asyncio.Task[Any] | None, until: float) -> bool:
        """Wait until there is room for ``task``'s answer, or the loop time ``until``."""
        loop = asyncio.get_running_loop()
        while self.room_for(task) <= 0:
            if self.ended:
                return False
            left = until - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self.server.freed().wait(), None if left == math.inf else left)
            except TimeoutError:
                return False
        return True


class LeaseRoom:
    """The room one Lease of a stream has (the actor's ``ReplyRoom``)."""

    __slots__ = ("stream", "task")

    def __init__(self, stream: StreamRoom, task: asyncio.Task[Any] | None) -> None:
        self.stream = stream
        self.task = task

    def room(self) -> int:
        # Less than a quarter of a full answer counts as none: wait for more rather than
        # answer a few items (the one sent next may always take one).
        room = self.stream.room_for(self.task)
        if self.task is not self.stream.head and room < min(MAX_REPLY_BYTES, self.stream.limit) // 4:
            return 0
        return room

    def take(self, size: int) -> None:
        self.stream.take(size)


# The stream whose message is being handled (each message's task sees its stream).
current_stream: contextvars.ContextVar[StreamRoom | None] = contextvars.ContextVar("current_stream", default=None)
