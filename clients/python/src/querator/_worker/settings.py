"""A worker described in code: what ``querator worker app.tasks:settings`` runs.

The equivalent of arq's ``WorkerSettings`` and of Celery's app configuration with task
options: one object holds the queue, the handlers (by kind, each with its own options),
the task registries, the worker's options (retry rules, backoff, time limits,
concurrency, dead-letter rules, hooks) and the periodic jobs. The command line's flags
override what it sets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .dispatch import Handler
from .kinds import Kind
from .options import WorkerOptions
from .periodic import Periodic
from .tasks import Tasks
from .workers import AsyncWorker, Worker

if TYPE_CHECKING:
    from .._async_client import AsyncClient
    from .._client import Client


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """Everything a worker runs with, as one value::

        settings = querator.WorkerSettings(
            queue="notifications",
            tasks=tasks,                                    # @tasks.task("email") ...
            handlers={"sms": querator.Kind(send_sms, handler_timeout=10, concurrency=2)},
            options=querator.WorkerOptions(concurrency=20, dead_on=[ValueError]),
        )

    ``queue`` may be left out when ``tasks`` are given: it is theirs. ``handler`` takes
    the kinds nobody else handles (without it, they are dead-lettered).
    """

    #: The queue to work on (default: the tasks' queue).
    queue: str = ""
    #: The handler of every kind not in ``handlers`` or ``tasks``.
    handler: Handler | None = None
    #: Handlers by kind: a function, or a :class:`~querator.Kind` with its own options.
    handlers: Mapping[str, Handler | Kind] = field(default_factory=dict)
    #: Task registries whose tasks this worker runs (all of the same queue).
    tasks: Tasks | Sequence[Tasks] = ()
    #: The worker's options: concurrency, retry_on/dead_on/retry_backoff, handler_timeout,
    #: shutdown_timeout, hooks, metrics, ...
    options: WorkerOptions = field(default_factory=WorkerOptions)
    #: Periodic jobs (:class:`~querator.Periodic`), produced by every worker that runs
    #: these settings, each tick once.
    periodic: Sequence[Periodic] = ()

    def __post_init__(self) -> None:
        registries = self.registries()
        queue = self.queue or (registries[0].queue if registries else "")
        if not queue:
            raise ValueError("WorkerSettings needs a queue (or tasks, whose queue it takes)")
        for tasks in registries:
            if tasks.queue != queue:
                raise ValueError(f"tasks of queue {tasks.queue!r} in the settings of queue {queue!r}")
        object.__setattr__(self, "queue", queue)
        if self.handler is None and not self.handlers and not any(registries):
            raise ValueError("WorkerSettings has no handler: give handler, handlers or tasks")

    def registries(self) -> list[Tasks]:
        return [self.tasks] if isinstance(self.tasks, Tasks) else list(self.tasks)

    def with_options(self, **changes: Any) -> WorkerSettings:
        """These settings with some options replaced (what command-line flags do)."""
        return replace(self, options=replace(self.options, **changes)) if changes else self

    def worker(self, client: Client) -> Worker:
        """A :class:`~querator.Worker` of these settings on ``client``."""
        worker = Worker(client, self.queue, self.handler, self.options)
        self._register(worker)
        return worker

    def async_worker(self, client: AsyncClient) -> AsyncWorker:
        """An :class:`~querator.AsyncWorker` of these settings on ``client``."""
        worker = AsyncWorker(client, self.queue, self.handler, self.options)
        self._register(worker)
        return worker

    def _register(self, worker: Worker | AsyncWorker) -> None:
        for tasks in self.registries():
            worker.include(tasks)
        for kind, handler in self.handlers.items():
            if isinstance(handler, Kind):
                worker._dispatch.add(kind, handler.handler, handler.options)
            else:
                worker._dispatch.add(kind, handler)
        if self.periodic:
            worker.schedule(*self.periodic)
