"""The threads that run a worker's sync handlers."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable

# How often an idle handler thread checks that its worker and the program still run.
_IDLE_CHECK = 1.0


class HandlerThreads:
    """The threads that run sync handlers, one call each at a time.

    A call is handed over through a queue, and the loop is woken once for all the calls
    that finished meanwhile: with many short handlers, ``run_in_executor``'s future per
    call, chained to an asyncio future, and its wake-up per call cost more than the
    calls. Like an executor's threads they are not daemons, so Python waits for a
    handler still running when it exits.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        self._loop = loop
        self._jobs: queue.SimpleQueue[tuple[asyncio.Future[None], Callable[[], object]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished: list[tuple[asyncio.Future[None], BaseException | None]] = []
        self._woken = False
        self._closed = False
        self._count = count
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a call
        self._running = 0  # calls running now, given up or not
        # Calls given up (handler_timeout) that still run: each holds a thread, so as
        # many threads more may be started to keep ``count`` calls going.
        self._abandoned: set[asyncio.Future[None]] = set()

    def run(self, call: Callable[[], object]) -> asyncio.Future[None]:
        """``call()`` on one of the threads; the future ends as it does (cancelling the
        future does not stop a call that started)."""
        future: asyncio.Future[None] = self._loop.create_future()
        self._jobs.put((future, call))
        # Threads are started as calls need them, up to ``count``, as an executor's are.
        if not self._idle and len(self._threads) < self._count + len(self._abandoned):
            with self._lock:
                thread = threading.Thread(target=self._work, name=f"querator-handler-{len(self._threads)}", daemon=False)
                self._threads.append(thread)
            thread.start()
        return future

    @property
    def running(self) -> int:
        """Handler calls running now, those given up included."""
        return self._running

    def abandon(self, future: asyncio.Future[None]) -> None:
        """Give up the call behind ``future`` (cancelled): its thread no longer counts."""
        with self._lock:
            self._abandoned.add(future)
        future.cancel()

    def close(self) -> None:
        """Drop the calls not started (their futures cancelled); each thread ends once
        its call, if any, returns."""
        self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        with self._lock:
            count = len(self._threads)
        for _ in range(count):
            self._jobs.put(None)

    def _work(self) -> None:
        main = threading.main_thread()
        while True:
            with self._lock:
                self._idle += 1
            try:
                job = self._jobs.get(timeout=_IDLE_CHECK)
            except queue.Empty:
                # A worker whose loop died without close(): end with the program.
                if self._closed or not main.is_alive():
                    return
                continue
            finally:
                with self._lock:
                    self._idle -= 1
            if job is None:  # close()
                return
            future, call = job
            error: BaseException | None = None
            with self._lock:
                self._running += 1
            try:
                call()
            except BaseException as exc:  # the handler's to report, whatever it is
                error = exc if not isinstance(exc, StopIteration) else RuntimeError(f"the handler raised {exc!r}")
            with self._lock:
                self._running -= 1
                retire = False
                if future in self._abandoned:
                    # Late: another thread was started in this one's place.
                    self._abandoned.discard(future)
                    retire = len(self._threads) > self._count + len(self._abandoned)
                    if retire:
                        self._threads.remove(threading.current_thread())
                else:
                    self._finished.append((future, error))
                wake = not retire and not self._woken and bool(self._finished)
                self._woken = self._woken or wake
            del job, future, call, error  # hold no item while idle
            if wake:
                try:
                    self._loop.call_soon_threadsafe(self._deliver)
                except RuntimeError:
                    pass  # the loop is closed: nobody waits for these any more
            if retire:
                return

    def _deliver(self) -> None:
        with self._lock:
            finished, self._finished = self._finished, []
            self._woken = False
            if self._abandoned:
                # Given up just as it returned: its thread is free again.
                for future, _ in finished:
                    self._abandoned.discard(future)
        for future, error in finished:
            if future.done():
                continue  # cancelled: the handler was abandoned
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
