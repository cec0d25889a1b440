"""The one retry policy: which failures are tried again, how often, after how long.

Every call loop of the SDK (both clients, their streams, the Producers) and of the
Spark connector asks a :class:`RetryPolicy` instead of deciding on its own; a loop
only sleeps (blocking or awaited) for the delay it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._config import Backoff, ClientConfig
from .errors import QueratorError, Unavailable


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retry a failure of a kind in ``on`` up to ``retries`` times, after ``backoff(n)``.

    Only calls that are safe to repeat are retried at all (the caller says which:
    ``Call.retry``); UNAVAILABLE is the default kind because the request then never
    reached the server or its effect is idempotent.
    """

    retries: int
    backoff: Backoff
    on: tuple[type[QueratorError], ...] = (Unavailable,)

    @classmethod
    def of(cls, config: ClientConfig) -> RetryPolicy:
        return cls(config.retries, config.backoff)

    def delay(self, attempt: int, error: BaseException) -> float | None:
        """Seconds to wait before retry number ``attempt`` (1 for the first) after
        ``error``; None: give up and raise it."""
        if attempt > self.retries or not isinstance(error, self.on):
            return None
        return self.backoff(attempt).total_seconds()
