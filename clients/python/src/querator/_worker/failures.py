"""What a worker does with a handler's exception: the retry rules, and the failure log."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from ..errors import DeadLetter

log = logging.getLogger("querator.worker")


@dataclass(frozen=True)
class RetryRule:
    """How a handler error of the given types is retried (``WorkerOptions.retry_on``).

    ``backoff`` maps the attempt number to the delay before the item comes back
    (default: the worker's ``retry_backoff``); after ``max_attempts`` leases the item
    is dead-lettered instead (default: the queue's ``max_attempts``, which always holds).
    """

    exceptions: type[BaseException] | tuple[type[BaseException], ...]
    backoff: Callable[[int], timedelta] | None = None
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        types = self.exceptions if isinstance(self.exceptions, tuple) else (self.exceptions,)
        if not types or not all(isinstance(t, type) and issubclass(t, BaseException) for t in types):
            raise TypeError("RetryRule.exceptions must be exception classes")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("RetryRule.max_attempts must be at least 1")


@dataclass(frozen=True)
class Decision:
    """What to do with a failed item: dead-letter it now, or retry it after ``backoff``."""

    dead: bool
    backoff: Callable[[int], timedelta]
    max_attempts: int | None = None


_DEAD = object()


class FailureRules:
    """``retry_on`` / ``dead_on`` looked up by the error's class hierarchy: the most
    specific class named wins (``retry_on=(TimeoutError,)`` with ``dead_on=(OSError,)``
    retries timeouts and dead-letters other OS errors); unnamed errors are retried with
    ``retry_backoff``, as without rules."""

    def __init__(
        self,
        retry_on: Sequence[type[BaseException] | RetryRule] | type[BaseException] | RetryRule,
        dead_on: Sequence[type[BaseException]] | type[BaseException],
        default_backoff: Callable[[int], timedelta],
    ) -> None:
        # One class or rule alone is taken as a sequence of one.
        if isinstance(retry_on, (type, RetryRule)):
            retry_on = (retry_on,)
        if isinstance(dead_on, type):
            dead_on = (dead_on,)
        self.default = Decision(False, default_backoff)
        self._by_class: dict[type[BaseException], object] = {}
        for entry in retry_on:
            rule = entry if isinstance(entry, RetryRule) else RetryRule(entry)
            decision = Decision(False, rule.backoff or default_backoff, rule.max_attempts)
            for cls in rule.exceptions if isinstance(rule.exceptions, tuple) else (rule.exceptions,):
                self._by_class[cls] = decision
        for cls in dead_on:
            if not (isinstance(cls, type) and issubclass(cls, BaseException)):
                raise TypeError(f"dead_on takes exception classes, not {cls!r}")
            if cls in self._by_class:
                raise ValueError(f"{cls.__name__} is in both retry_on and dead_on")
            self._by_class[cls] = _DEAD
        self._dead = Decision(True, default_backoff)

    def decide(self, error: BaseException) -> Decision:
        return self.named(error) or self.default

    def named(self, error: BaseException) -> Decision | None:
        """The decision of the most specific class named for ``error``; None if none is."""
        if self._by_class:
            for cls in type(error).__mro__:
                found = self._by_class.get(cls)
                if found is _DEAD:
                    return self._dead
                if isinstance(found, Decision):
                    return found
        return None


# A traceback per exception type for the first few failures of each minute, then a
# count: one broken dependency otherwise floods the log with thousands of identical
# tracebacks (2,024 lines in one drain), hiding the one that differs.
LOG_BURST = 3
LOG_WINDOW = 60.0


class FailureLog:
    """Rate-limits failure logs per exception type (``LOG_BURST`` per ``LOG_WINDOW`` s)."""

    def __init__(self, burst: int = LOG_BURST, window: float = LOG_WINDOW) -> None:
        self.burst = burst
        self.window = window
        # type name -> [window start, logged in window, not logged since the last line]
        self._seen: dict[str, list[float]] = {}

    def admit(self, error: BaseException | None) -> tuple[bool, int]:
        """Whether to log this failure, and how many of its type were not logged before it."""
        key = type(error).__qualname__
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is None or now - entry[0] >= self.window:
            skipped = int(entry[2]) if entry is not None else 0
            self._seen[key] = [now, 1, 0]
            return True, skipped
        if entry[1] < self.burst:
            entry[1] += 1
            skipped, entry[2] = int(entry[2]), 0
            return True, skipped
        entry[2] += 1
        return False, 0

    def warning(self, message: str, *args: object, error: BaseException | None) -> None:
        logged, skipped = self.admit(error)
        if not logged:
            return
        if skipped:
            message += " (%d more %s not logged)"
            args = (*args, skipped, type(error).__qualname__)
        # DeadLetter is the handler's decision, not a crash; an error the worker made
        # itself (an unknown kind) was never raised: no traceback for either.
        trace = error if error is not None and not isinstance(error, DeadLetter) else None
        log.warning(message, *args, exc_info=trace)
