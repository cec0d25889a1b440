"""Worker and AsyncWorker: the public faces of the engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .._convert import Seconds, seconds
from .calls import WorkerCalls
from .dispatch import Dispatch, H, Handler
from .engine import Engine
from .kinds import KindOptions
from .options import WorkerOptions, WorkerStats
from .periodic import Periodic, run_with

if TYPE_CHECKING:
    from .._async_client import AsyncClient
    from .._client import Client
    from .tasks import Tasks


def _options(options: WorkerOptions | None, overrides: dict[str, Any]) -> WorkerOptions:
    base = options or WorkerOptions()
    return replace(base, **overrides) if overrides else base


class _Handlers:
    """``worker.handler(kind)`` and ``worker.include(tasks)``: shared by both workers."""

    _dispatch: Dispatch
    queue_name: str
    _periodic: tuple[Periodic, ...] = ()

    def handler(self, kind: str, **options: Any) -> Callable[[H], H]:
        """Register the handler of items of ``kind`` (a decorator), before the worker runs::

            @worker.handler("email", handler_timeout=30, concurrency=4)
            def send_email(item: querator.LeasedItem) -> None: ...

        A handler given to the constructor then takes the kinds not registered; without
        one, an item of another kind is dead-lettered ("no handler for kind ...").
        ``options``: :class:`~querator.KindOptions` fields, this kind's own time limit,
        concurrency and retry rules.
        """
        kind_options = KindOptions(**options) if options else None

        def register(handler: H) -> H:
            self._dispatch.add(kind, handler, kind_options)
            return handler

        return register

    def include(self, tasks: Tasks) -> None:
        """Handle the tasks of a registry (:class:`~querator.Tasks`), each by its kind."""
        if tasks.queue != self.queue_name:
            raise ValueError(f"the tasks are for queue {tasks.queue!r}, the worker works on {self.queue_name!r}")
        for task in tasks:
            self._dispatch.add(task.kind, task.route())

    def schedule(self, *jobs: Periodic) -> None:
        """Produce these periodic jobs while the worker runs (:class:`~querator.Periodic`):
        every worker that schedules them produces each tick, the server keeps one."""
        if self._dispatch.frozen:
            raise RuntimeError("periodic jobs are scheduled before the worker runs")
        names = [job.name for job in (*self._periodic, *jobs)]
        if len(set(names)) != len(names):
            raise ValueError(f"periodic job names must differ: {names}")
        self._periodic = (*self._periodic, *jobs)


class AsyncWorker(_Handlers):
    """Runs a handler on items of ``queue_name`` leased through an :class:`~querator.AsyncClient`.

    An ``async def`` handler gets :class:`~querator.AsyncLeasedItem` objects and runs as
    tasks; a plain function gets :class:`~querator.LeasedItem` objects and runs on
    ``concurrency`` threads. Several handlers, by the item's ``kind``: :meth:`handler`.
    After the handler:

    - it returned: the item is completed (unless the handler settled it itself);
    - it raised :class:`~querator.DeadLetter` or an error of ``dead_on``: the item goes
      to the dead-letter queue;
    - it raised anything else (or ran past ``handler_timeout``): the item is retried at
      ``now + backoff(attempts)`` (``retry_on`` rules, else ``retry_backoff``),
      dead-lettered instead once it used the queue's ``max_attempts``.

    With the client's ``tracing=True`` each handler runs inside a CONSUMER span that
    continues the producer's trace (:func:`querator.tracing.process_span`).

    Options are :class:`WorkerOptions` fields, as keywords. ``await worker.run()`` runs
    until :meth:`stop` (or SIGTERM/SIGINT): leasing stops, buffered items are released,
    running handlers get ``shutdown_timeout`` to finish, and the items of those that do
    not are released too (Retry now; an item on its last attempt is dead-lettered).
    """

    def __init__(
        self,
        client: AsyncClient,
        queue_name: str,
        handler: Handler | None = None,
        options: WorkerOptions | None = None,
        **overrides: Any,
    ) -> None:
        self.client = client
        self.queue_name = queue_name
        self.options = _options(options, overrides)
        self._dispatch = Dispatch(handler)
        self._engine = Engine(WorkerCalls(client), queue_name, self._dispatch, self.options, None)
        self._task: asyncio.Task[None] | None = None

    @property
    def stats(self) -> WorkerStats:
        return self._engine.stats

    async def run(self, *, until_empty: bool = False) -> None:
        """Run until stopped; with ``until_empty`` (burst mode), also return once the
        queue has nothing ready, leased or scheduled and this worker holds nothing."""
        await run_with(self._engine.run(until_empty), self.client, self.queue_name, self._periodic)

    def stop(self) -> None:
        """Ask the worker to stop gracefully (safe from any thread); ``run()`` then returns."""
        self._engine.request_stop()

    async def __aenter__(self) -> AsyncWorker:
        self._task = asyncio.create_task(run_with(self._engine.run(), self.client, self.queue_name, self._periodic))
        while not self._engine.started.is_set() and not self._task.done():
            await asyncio.sleep(0.005)
        if self._task.done():
            self._task.result()  # raises the start-up error (e.g. QueueNotFound)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if self._task is not None:
            await self._task


class Worker(_Handlers):
    """The blocking twin of :class:`AsyncWorker`, for a :class:`~querator.Client`.

    ``worker.run()`` blocks until :meth:`stop` or SIGTERM/SIGINT (``run(until_empty=True)``:
    or until the queue is empty); ``worker.start()`` (or ``with worker:``) runs it on a
    background thread instead. A sync handler runs on ``concurrency`` threads and gets
    :class:`~querator.LeasedItem` objects bound to ``client``; an ``async def`` handler
    runs on the worker's own event loop.
    """

    def __init__(
        self,
        client: Client,
        queue_name: str,
        handler: Handler | None = None,
        options: WorkerOptions | None = None,
        **overrides: Any,
    ) -> None:
        self.client = client
        self.queue_name = queue_name
        self.options = _options(options, overrides)
        self._dispatch = Dispatch(handler)
        self._engine: Engine | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stop_requested = False

    @property
    def stats(self) -> WorkerStats:
        return self._engine.stats if self._engine is not None else WorkerStats()

    def run(self, *, until_empty: bool = False) -> None:
        """Run until stopped (blocking); with ``until_empty`` (burst mode), also return
        once the queue has nothing ready, leased or scheduled and this worker holds nothing."""
        asyncio.run(self._main(until_empty))

    async def _main(self, until_empty: bool) -> None:
        from .._async_client import AsyncClient

        aclient = AsyncClient(config=self.client.config)
        self._engine = Engine(WorkerCalls(aclient), self.queue_name, self._dispatch, self.options, lambda: self.client)
        try:
            if self._stop_requested:
                return
            await run_with(self._engine.run(until_empty), aclient, self.queue_name, self._periodic)
        finally:
            await aclient.close()

    def start(self, timeout: Seconds = 30) -> Worker:
        """Run on a background thread; returns once the worker is leasing."""
        if self._thread is not None:
            raise RuntimeError("the worker is already started")
        self.options = _options(self.options, {"handle_signals": False})

        def target() -> None:
            try:
                self.run()
            except BaseException as exc:  # reported by stop()
                self._error = exc

        self._thread = threading.Thread(target=target, name="querator-worker", daemon=True)
        self._thread.start()
        limit = time.monotonic() + seconds(timeout)
        while time.monotonic() < limit and self._thread.is_alive():
            engine = self._engine
            if engine is not None and engine.started.wait(0.01):
                return self
        if self._error is not None:
            raise self._error
        raise TimeoutError("the worker did not start in time")

    def stop(self, *, wait: bool = True, timeout: Seconds | None = None) -> None:
        """Stop gracefully; with ``wait``, block until done (and raise what run() raised)."""
        self._stop_requested = True
        if self._engine is not None:
            self._engine.request_stop()
        if wait and self._thread is not None:
            self._thread.join(None if timeout is None else seconds(timeout))
            if self._error is not None:
                raise self._error

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
