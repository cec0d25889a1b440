"""A worker's options, hooks and counters: everything a user configures or reads."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from .._config import MAX_BATCH, Backoff
from .._convert import Seconds, seconds
from .._items import AnyLeasedItem
from ..errors import QueratorError
from .failures import FailureLog, FailureRules, RetryRule

log = logging.getLogger("querator.worker")


class WorkerHooks:
    """Callbacks for metrics and logging; subclass and override what you need.

    They run on the worker's event loop and must be quick; an exception in a hook is
    logged and ignored. The defaults log through ``logging.getLogger("querator.worker")``;
    handler failures with their traceback, at most a few per exception type and minute
    (the rest are counted in ``WorkerStats.failures`` and summed up in the next line).
    ``item`` is the object the handler received (LeasedItem or AsyncLeasedItem).
    """

    def _failure_log(self) -> FailureLog:
        # Made on first use: subclasses need not call super().__init__().
        found = self.__dict__.get("_querator_failure_log")
        if found is None:
            found = self.__dict__["_querator_failure_log"] = FailureLog()
        return found

    def on_lease(self, items: Sequence[AnyLeasedItem]) -> None:
        """A Lease call returned ``items`` (not called for empty replies)."""

    def on_start(self, item: AnyLeasedItem) -> None:
        """The handler is about to run for ``item``."""

    def on_complete(self, item: AnyLeasedItem, elapsed: timedelta) -> None:
        """``item`` was handled in ``elapsed`` and completed."""

    def on_retry(self, item: AnyLeasedItem, error: BaseException, retry_at: datetime) -> None:
        """The handler raised ``error``; ``item`` comes back at ``retry_at``."""
        self._failure_log().warning(
            "handler failed for item %s (attempt %d), retry at %s: %r",
            item.id, item.attempts, retry_at.isoformat(timespec="milliseconds"), error,
            error=error,
        )  # fmt: skip

    def on_dead(self, item: AnyLeasedItem, error: BaseException | None) -> None:
        """``item`` went to the dead-letter queue (DeadLetter raised, a rule of ``dead_on``,
        out of attempts, or no handler for its kind)."""
        self._failure_log().warning(
            "item %s dead-lettered after %d attempts: %r", item.id, item.attempts, error, error=error
        )

    def on_extend(self, items: Sequence[AnyLeasedItem]) -> None:
        """The leases of ``items`` were extended (keep-alive)."""

    def on_lease_lost(self, item: AnyLeasedItem, error: QueratorError) -> None:
        """The lease of ``item`` was lost; another consumer may handle it again."""
        log.warning("lease of item %s lost: %s", item.id, error)

    def on_lease_capped(self, item: AnyLeasedItem) -> None:
        """``item``'s handler is still running at ``max_lease_duration``: its lease is no
        longer extended, and the item comes back to the queue when it runs out."""
        log.warning("item %s held for max_lease_duration: its lease is no longer extended", item.id)

    def on_release(self, items: Sequence[AnyLeasedItem]) -> None:
        """At shutdown, ``items`` were given back unhandled (Retry now)."""

    def on_error(self, error: BaseException) -> None:
        """A call the worker made failed (it carries on, with backoff)."""
        log.error("worker call failed: %s", error)


@dataclass
class WorkerStats:
    """Counters of what a worker did so far."""

    leased: int = 0
    completed: int = 0
    retried: int = 0
    dead: int = 0
    extended: int = 0
    lost: int = 0
    released: int = 0
    #: Calls of the worker's that failed (Lease, Complete, Retry, Extend).
    errors: int = 0
    #: Handlers that raised (or ran past ``handler_timeout``, or had no handler for the
    #: item's kind); ``failures`` counts them by exception type name.
    failed: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    #: Handlers that ran past ``handler_timeout`` (also counted in ``failed``).
    timed_out: int = 0
    #: Items whose lease stopped being extended at ``max_lease_duration``.
    lease_capped: int = 0


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """A worker's settings: keyword-only; durations as :class:`~datetime.timedelta`
    (a number of seconds is taken too)."""

    #: Handlers running at once (threads for a sync handler, tasks for an async one).
    concurrency: int = 10
    #: Items asked for per Lease call (default: ``concurrency``, at most 1,000).
    batch_size: int | None = None
    #: Leased items waiting for a free handler slot beyond those running (default:
    #: ``batch_size``). Flow control: no Lease is sent while the worker holds
    #: ``concurrency + max_buffered`` items; a Lease stays in flight while earlier items
    #: are being handled and completed.
    max_buffered: int | None = None
    #: How long a Lease waits on the server when nothing is ready.
    lease_wait: Seconds = timedelta(seconds=30)
    #: Extend leases of held items when half their time is gone.
    keep_alive: bool = True
    #: Lease length asked for by Extend (default: the queue's lease_timeout).
    lease_extension: Seconds | None = None
    #: Keep-alive never holds an item longer than this from its lease (None: no cap);
    #: past it, its lease runs out and the item comes back to the queue.
    max_lease_duration: Seconds | None = None
    #: A handler still running after this long is given up (None: no limit): an async
    #: one is cancelled, a sync one abandoned (its thread cannot be stopped; the worker
    #: starts another in its place), and the item is retried as if the handler raised
    #: :class:`~querator.HandlerTimeout`.
    handler_timeout: Seconds | None = None
    #: Burst mode (``run(until_empty=True)``): how long to wait for faulty partitions
    #: (their node down, their storage failing) once every other partition is empty.
    #: Their items may still be there, so the run does not end while any is faulty;
    #: past this, ``run()`` raises :class:`~querator.Unavailable` naming them instead
    #: of returning. None: wait until they are back (or ``stop()``).
    faulty_timeout: Seconds | None = None
    #: Delay before a failed item comes back, by its attempt number (1 = first lease).
    retry_backoff: Callable[[int], timedelta] = Backoff(timedelta(seconds=1), timedelta(minutes=5))
    #: Exception classes (or :class:`RetryRule` with a backoff of their own) that are
    #: retried; with ``dead_on``, the most specific class named wins.
    retry_on: Sequence[type[BaseException] | RetryRule] | type[BaseException] | RetryRule = ()
    #: Exception classes that send the item to the dead-letter queue at once.
    dead_on: Sequence[type[BaseException]] | type[BaseException] = ()
    #: At stop: how long running handlers may finish before their items are released.
    shutdown_timeout: Seconds = timedelta(seconds=30)
    #: At stop: how long a Lease in flight may still answer before it is cancelled.
    lease_grace: Seconds = timedelta(seconds=1)
    #: Stop gracefully on SIGTERM and SIGINT (run() in the main thread only).
    handle_signals: bool = True
    #: Callbacks for metrics and logging.
    hooks: WorkerHooks | None = None
    #: Record Prometheus metrics (prometheus_client's default registry; the ``metrics``
    #: extra). Implied by ``metrics_port``.
    metrics: bool = False
    #: Serve the metrics on this port (0 picks a free one).
    metrics_port: int | None = None
    #: The address the metrics port binds: this machine only unless told otherwise
    #: ("0.0.0.0" for every interface, when a scraper on another host reads it).
    metrics_host: str = "127.0.0.1"
    #: The Lease client_id (default: host, pid and a random suffix). A second Lease in
    #: flight uses ``<client_id>/1``, a third ``/2``: the server takes one per id.
    client_id: str | None = None
    #: Complete handled items with the next Lease call (``complete_ids``) instead of
    #: separate Complete calls. Needs a server that knows ``LeaseRequest.complete_ids``.
    complete_with_lease: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.batch_size is not None and not 1 <= self.batch_size <= MAX_BATCH:
            raise ValueError(f"batch_size must be between 1 and {MAX_BATCH}")
        if self.max_buffered is not None and self.max_buffered < 0:
            raise ValueError("max_buffered must not be negative")
        for name in ("handler_timeout", "max_lease_duration", "faulty_timeout"):
            value = getattr(self, name)
            try:
                positive = value is None or seconds(value) > 0
            except ValueError:
                positive = False
            if not positive:
                raise ValueError(f"{name} must be positive, got {value!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be between 0 and 65535")
        self.failure_rules()  # rejects bad rules now, not at the first failure

    def failure_rules(self) -> FailureRules:
        return FailureRules(self.retry_on, self.dead_on, self.retry_backoff)
