"""Workers: lease items, run a handler on each, then complete, retry or dead-letter them.

Split by concern: ``options`` (what a user sets and reads: options, hooks, stats),
``failures`` (retry rules, rate-limited failure logs), ``dispatch`` (handlers by kind),
``kinds`` (one kind's options), ``tasks`` (tasks by name and their codecs), ``settings`` (a worker as one value), ``periodic`` (jobs
produced on a schedule, each tick once), ``engine``
(leasing, handling, shutdown), ``processes`` (children under a hard time limit), ``keepalive`` (Extend), ``threads`` (sync handlers'
threads), ``settler`` (batched Complete and Retry), ``calls`` (the client calls the
worker makes), ``metrics`` (Prometheus, optional) and ``workers`` (Worker, AsyncWorker). The
``querator worker`` command is the CLI's (``querator.cli.worker``).
"""

from .dispatch import Handler
from .failures import RetryRule
from .kinds import Kind, KindOptions
from .options import WorkerHooks, WorkerOptions, WorkerStats
from .periodic import Periodic
from .settings import WorkerSettings
from .tasks import Codec, Task, Tasks, UnknownTask, current_item
from .workers import AsyncWorker, Worker

__all__ = [
    "AsyncWorker",
    "Codec",
    "Handler",
    "Kind",
    "KindOptions",
    "Periodic",
    "RetryRule",
    "Task",
    "Tasks",
    "UnknownTask",
    "Worker",
    "WorkerHooks",
    "WorkerOptions",
    "WorkerSettings",
    "WorkerStats",
    "current_item",
]
