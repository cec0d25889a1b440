"""gRPC health checking: grpcio-health-checking's servicer, whose Watch calls end at shutdown.

A ``Health.Watch`` call never ends by itself, and gRPC client-side health checking keeps
one open per channel. The server's shutdown waits for the calls in progress, so every
open Watch would hold a SIGTERM for the whole grace period. ``end_watches`` lets each
Watch tell its caller the status shutdown set (``NOT_SERVING``), then ends it with OK.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from grpc_health.v1 import health, health_pb2

# How long a Watch may take to send the shutdown's status before it is ended anyway.
_LAST_STATUS_S = 1.0


class _Recorder:
    """The call's context as a Watch sees it, noting the last status it sent."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self.status: int | None = None
        self.sent = asyncio.Event()

    async def write(self, message: health_pb2.HealthCheckResponse) -> None:
        await self._context.write(message)
        self.status = message.status
        self.sent.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class HealthService(health.aio.HealthServicer):  # type: ignore[misc,name-defined]  # not in its stubs
    """The standard health servicer; Watch calls end once ``end_watches`` is called."""

    def __init__(self) -> None:
        super().__init__()
        self._watches: dict[asyncio.Task[None], _Recorder] = {}
        self._ending = False

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:  # noqa: N802 -- gRPC's name
        recorder = _Recorder(context)
        watch = asyncio.ensure_future(super().Watch(request, recorder))
        self._watches[watch] = recorder
        try:
            if self._ending:  # opened during shutdown: tell the status, then end
                await self._end(watch, recorder)
            await watch
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not (self._ending and watch.cancelled()) or (current is not None and current.cancelling()):
                raise  # the caller went away, or gRPC is cancelling this call
            # Ended by end_watches: the call ends with OK.
        finally:
            watch.cancel()
            self._watches.pop(watch, None)

    async def end_watches(self) -> None:
        """End every Watch call once it has sent a status other than ``SERVING``
        (waiting at most a second for that); call after ``enter_graceful_shutdown``.
        A Watch opened from then on sends its status and ends at once."""
        self._ending = True
        watches = list(self._watches.items())
        await asyncio.gather(*(self._end(watch, recorder) for watch, recorder in watches))
        await asyncio.gather(*(watch for watch, _ in watches), return_exceptions=True)

    @staticmethod
    async def _end(watch: asyncio.Future[None], recorder: _Recorder) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + _LAST_STATUS_S
        # Shutdown set every known service NOT_SERVING; others answer SERVICE_UNKNOWN.
        while recorder.status in (None, health_pb2.HealthCheckResponse.SERVING) and not watch.done():
            left = give_up - loop.time()
            if left <= 0:
                break
            recorder.sent.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(recorder.sent.wait(), left)
        watch.cancel()
