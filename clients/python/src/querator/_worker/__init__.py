"""Workers: lease items, run a handler on each, then complete, retry or dead-letter them.

Split by concern: ``options`` (what a user sets and reads: options, hooks, stats),
``failures`` (retry rules, rate-limited failure logs), ``dispatch`` (handlers by kind),
``engine`` (leasing, handling, shutdown), ``keepalive`` (Extend), ``threads`` (sync handlers'
threads), ``settler`` (batched Complete and Retry), ``calls`` (the client calls the
worker makes), ``metrics`` (Prometheus, optional) and ``workers`` (Worker, AsyncWorker). The
``querator worker`` command is the CLI's (``querator.cli.worker``).
"""

from .dispatch import Handler
from .failures import RetryRule
from .options import WorkerHooks, WorkerOptions, WorkerStats
from .workers import AsyncWorker, Worker

__all__ = ["AsyncWorker", "Handler", "RetryRule", "Worker", "WorkerHooks", "WorkerOptions", "WorkerStats"]
