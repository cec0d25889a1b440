"""Options of one kind's handler: its time limits, concurrency and retry rules.

They override the worker's own (``WorkerOptions``) for the items of that kind, as
Celery's task options and arq's ``func(...)`` do for one task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from .._convert import Seconds, seconds
from .failures import Decision, FailureRules, RetryRule

Executor = Literal["thread", "process"]


@dataclass(frozen=True, kw_only=True)
class KindOptions:
    """What one kind's handler may set for itself; None (or empty) takes the worker's.

    ``executor="process"`` runs a task's function in a child process (sync functions of
    :meth:`Tasks.task <querator.Tasks.task>` only: the arguments cross, a leased item
    cannot), where ``time_limit`` is hard: past it the child is killed (SIGKILL) and the
    item retried, or dead-lettered on its last attempt, with
    :class:`~querator.TimeLimitExceeded`. ``handler_timeout`` is soft: a sync handler on
    a thread is abandoned but runs on to its end.
    """

    #: Give up the handler after this long (soft: see above).
    handler_timeout: Seconds | None = None
    #: Handlers of this kind running at once (within the worker's ``concurrency``).
    concurrency: int | None = None
    #: Rules for this kind's errors, looked up before the worker's.
    retry_on: Sequence[type[BaseException] | RetryRule] | type[BaseException] | RetryRule = ()
    dead_on: Sequence[type[BaseException]] | type[BaseException] = ()
    #: Delay before a failed item of this kind comes back, by its attempt number.
    retry_backoff: Callable[[int], timedelta] | None = None
    #: Dead-letter an item of this kind after this many leases (the queue's
    #: ``max_attempts`` always holds too).
    max_attempts: int | None = None
    #: Where a sync handler runs: "thread" (default) or "process" (tasks only).
    executor: Executor = "thread"
    #: The hard limit of ``executor="process"``: the child is killed past it.
    time_limit: Seconds | None = None

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.executor not in ("thread", "process"):
            raise ValueError(f"executor is 'thread' or 'process', not {self.executor!r}")
        if self.time_limit is not None and self.executor != "process":
            raise ValueError("time_limit needs executor='process' (a thread cannot be killed: see handler_timeout)")
        for name in ("handler_timeout", "time_limit"):
            value = getattr(self, name)
            if value is not None and seconds(value) <= 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        FailureRules(self.retry_on, self.dead_on, _never)  # rejects bad rules now


def _never(attempt: int) -> timedelta:  # pragma: no cover - only checks the rules' shape
    return timedelta(0)


class KindRules:
    """A kind's rules in front of the worker's: the kind's named classes first, then the
    worker's, then the kind's backoff (or the worker's) for errors nobody named."""

    def __init__(self, options: KindOptions, worker: FailureRules) -> None:
        backoff = options.retry_backoff or worker.default.backoff
        self._own = FailureRules(options.retry_on, options.dead_on, backoff)
        self._worker = worker
        self.default = Decision(False, backoff, options.max_attempts)
        self.max_attempts = options.max_attempts

    def decide(self, error: BaseException) -> Decision:
        found = self._own.named(error) or self._worker.named(error)
        if found is None:
            return self.default
        if found.max_attempts is None and self.max_attempts is not None:
            return Decision(found.dead, found.backoff, self.max_attempts)
        return found


@dataclass(frozen=True)
class Kind:
    """A handler and its :class:`KindOptions`, as a value (``WorkerSettings.handlers``)::

    handlers = {"email": querator.Kind(send_email, handler_timeout=30, concurrency=4)}
    """

    handler: Callable[..., Any]
    options: KindOptions

    def __init__(self, handler: Callable[..., Any], **options: Any) -> None:
        object.__setattr__(self, "handler", handler)
        object.__setattr__(self, "options", KindOptions(**options))
