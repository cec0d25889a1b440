"""Child processes that run handlers under a hard time limit (``executor="process"``).

A thread cannot be stopped, so a sync handler past ``handler_timeout`` runs on and does
its side effect anyway. A process can be killed: past ``time_limit`` its child gets
SIGKILL, and whatever the handler had not done yet is never done. Each child runs one
call at a time and is kept for the next; a killed or dead child is replaced by a new one
when a call needs it. The function and its arguments cross by pickle, so the function
must be importable by its module and name (a module-level function or task).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from .._failure import remember_frames
from ..errors import TimeLimitExceeded

_STARTED = "started"

# How long close() waits for idle children to end before it kills them.
_CLOSE_WAIT = 2.0


def _child_main(conn: Connection) -> None:
    # The worker decides when its children end (stop, time limit): a Ctrl-C or a
    # SIGTERM sent to the whole process group must not cut a call short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        except Exception as exc:  # the function did not unpickle (its module does not import)
            conn.send((False, RuntimeError(f"the handler's process cannot load the call: {exc!r}"), None))
            continue
        if job is None:
            return
        # The time limit counts from here: importing the function's module in a new
        # child (the SDK, the application) is not the handler's time.
        conn.send(_STARTED)
        function, args, kwargs = job
        try:
            function(*args, **kwargs)
        except BaseException as exc:  # the handler's to report, whatever it is
            # Its traceback does not pickle: its frames go as text, for the failure text.
            frames = traceback.format_tb(exc.__traceback__)
            try:
                conn.send((False, exc, frames))
            except Exception:  # an exception that does not pickle
                conn.send((False, RuntimeError(f"the handler raised {exc!r}"), frames))
        else:
            conn.send((True, None, None))
        del job, function, args, kwargs


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Child:
    __slots__ = ("conn", "process")

    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


def _context() -> Any:  # a start method's context (typeshed's BaseContext lacks Process)
    # forkserver: children forked from a clean server process, not from this one with
    # its gRPC threads (fork() of a threaded process may deadlock the child).
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


class HandlerProcesses:
    """The children of one worker: as many as it ran handlers at once at most (its
    ``concurrency`` bounds them), each idle one kept for the next call."""

    def __init__(self) -> None:
        self._idle: list[_Child] = []
        self._ctx = _context()

    def _start(self) -> _Child:
        parent, child_end = self._ctx.Pipe()
        process = self._ctx.Process(target=_child_main, args=(child_end,), name="querator-handler", daemon=True)
        process.start()
        child_end.close()
        return _Child(process, parent)

    async def run(
        self, call: tuple[Callable[..., object], tuple[Any, ...], dict[str, Any]], time_limit: float | None, soft: float | None
    ) -> None:
        """``function(*args, **kwargs)`` in a child; raises what it raised, or
        TimeLimitExceeded once it ran past ``time_limit`` (else ``soft``, the
        handler_timeout: a child is stopped the only way it can be) and was killed."""
        child = self._idle.pop() if self._idle else await asyncio.to_thread(self._start)
        keep = False
        try:
            child.conn.send(call)
            answer = await self._answer(child, None)
            if answer == _STARTED:
                limit = time_limit if time_limit is not None else soft
                try:
                    answer = await self._answer(child, limit)
                except TimeoutError:
                    raise TimeLimitExceeded(f"time limit: the handler ran past {limit:g}s and its process was killed") from None
            ok, error, frames = answer
            keep = True
            if not ok:
                if frames:
                    remember_frames(error, frames)
                raise error
        finally:
            if keep:
                self._idle.append(child)
            else:
                # Past its limit, cancelled (the worker stops) or dead: SIGKILL, and a
                # new child for the next call.
                await asyncio.to_thread(child.kill)

    @staticmethod
    async def _answer(child: _Child, limit: float | None) -> Any:
        """The child's next message, waited for on the loop (at most ``limit`` seconds)."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(child.conn.fileno(), _resolve, ready)
        try:
            async with asyncio.timeout(limit):
                await ready
        finally:
            loop.remove_reader(child.conn.fileno())
        try:
            return child.conn.recv()
        except EOFError:
            child.process.join(5)
            raise ChildProcessError(f"the handler's process died (exit code {child.process.exitcode})") from None

    def close(self) -> None:
        """End the idle children (the busy ones end with their calls)."""
        idle, self._idle = self._idle, []
        for child in idle:
            try:
                child.conn.send(None)
            except OSError:
                pass
        for child in idle:
            child.process.join(_CLOSE_WAIT)
            child.kill()
