"""Leased items: the data of one lease plus complete / retry / dead / extend."""

from __future__ import annotations

import json as _json
import threading
from collections.abc import Mapping
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from ._convert import Seconds
from ._models import CompleteResult, DeadReason, ItemRef, RetryResult
from .errors import DeadLetter

if TYPE_CHECKING:
    from opentelemetry.context import Context


# What a leased item needs of the client that leased it. Typed as protocols so that
# this module need not import the clients, which import it.
class _Settles(Protocol):
    def complete(self, items: Any) -> CompleteResult: ...
    def retry(
        self,
        items: Any,
        *,
        at: datetime | None = None,
        in_: Seconds | None = None,
        dead: bool = False,
        error: str | BaseException = "",
    ) -> RetryResult: ...
    def extend(self, items: Any, *, lease_timeout: Seconds | None = None) -> list[datetime]: ...


class _AsyncSettles(Protocol):
    async def complete(self, items: Any) -> CompleteResult: ...
    async def retry(
        self,
        items: Any,
        *,
        at: datetime | None = None,
        in_: Seconds | None = None,
        dead: bool = False,
        error: str | BaseException = "",
    ) -> RetryResult: ...
    async def extend(self, items: Any, *, lease_timeout: Seconds | None = None) -> list[datetime]: ...

#: What happened to a leased item through this object (None: nothing yet).
COMPLETED = "completed"
RETRIED = "retried"
DEAD = "dead"


class _LeasedBase:
    """The fields of a leased item; shared by the sync and async twins.

    ``client`` is the client that leased it (the twins type it). The twins have no
    ``__init__`` of their own: one keyword call per item, not two (a Lease makes one
    object per item, and passing 16 keywords on once more doubled the cost).
    """

    __slots__ = (
        "_client",
        "queue_name",
        "partition",
        "id",
        "payload",
        "encoding",
        "kind",
        "reference",
        "attempts",
        "lease_deadline",
        "created_at",
        "metadata",
        "message_id",
        "source_id",
        "dead_reason",
        "dead_at",
        "dead_attempts",
        "last_error",
        "last_error_at",
        "group_key",
        "priority",
        "_state",
        "_lock",
    )

    def __init__(
        self,
        client: Any,
        *,
        queue_name: str,
        partition: int,
        id: str,
        payload: bytes,
        encoding: str = "",
        kind: str = "",
        reference: str = "",
        attempts: int = 0,
        lease_deadline: datetime,
        created_at: datetime,
        metadata: Mapping[str, str] | None = None,
        message_id: str = "",
        source_id: str = "",
        dead_reason: DeadReason | None = None,
        dead_at: datetime | None = None,
        dead_attempts: int = 0,
        last_error: str = "",
        last_error_at: datetime | None = None,
        group_key: str = "",
        priority: int = 0,
    ) -> None:
        self.queue_name = queue_name
        self.partition = partition
        self.id = id
        self.payload = payload
        self.encoding = encoding
        self.kind = kind
        self.reference = reference
        #: How many times the item has been leased, this lease included (1 the first time).
        self.attempts = attempts
        #: When this lease ends unless extended; updated by extend().
        self.lease_deadline = lease_deadline
        self.created_at = created_at
        #: The string pairs given at produce (e.g. trace context); empty when none.
        self.metadata: Mapping[str, str] = {} if metadata is None else metadata
        #: The item's stable id: the id it was produced with, the same through every
        #: re-queue, retry, dead-lettering and redrive (``id`` is this lease's; use
        #: ``message_id`` to follow the item in logs).
        self.message_id = message_id or id
        #: In a dead-letter queue: the item's id in the queue it came from.
        self.source_id = source_id
        #: Dead letters only: why it died (None for other items), when, and how many
        #: times it had been leased there (``attempts`` counts the leases here).
        self.dead_reason = dead_reason
        self.dead_at = dead_at
        self.dead_attempts = dead_attempts
        #: What went wrong the last time the item failed (an earlier attempt's Retry
        #: ``error``, or "lease expired after N attempts"), and when; for a dead letter,
        #: the error that killed it. "" and None when it never failed with a text.
        self.last_error = last_error
        self.last_error_at = last_error_at
        #: The item's ordered group (``Item.group_key``); "" for none. No other item of
        #: the group is leased until this one is completed, dead-lettered or deleted.
        self.group_key = group_key
        #: 0 to 9, as given at produce (``Item.priority``): leases hand out higher first.
        self.priority = priority
        self._state: str | None = None
        self._lock = threading.Lock()
        self._client = client

    @property
    def text(self) -> str:
        """The payload decoded as UTF-8."""
        return self.payload.decode()

    def json(self) -> Any:
        """The payload parsed as JSON."""
        return _json.loads(self.payload)

    def trace_context(self) -> Context:
        """The producer's OpenTelemetry context, from ``metadata`` (empty when it has none).

        Parent or link a span to it: ``tracer.start_as_current_span("work",
        context=item.trace_context())``. Needs the ``otel`` extra (ImportError without).
        """
        from .tracing import extract

        return extract(self.metadata)

    @property
    def ref(self) -> ItemRef:
        return ItemRef(self.queue_name, self.partition, self.id)

    @property
    def state(self) -> str | None:
        """``"completed"``, ``"retried"``, ``"dead"`` once settled through the SDK, else None."""
        return self._state

    @property
    def settled(self) -> bool:
        return self._state is not None

    def _set_state(self, state: str) -> None:
        with self._lock:
            self._state = state

    def _set_deadline(self, deadline: datetime) -> None:
        self.lease_deadline = deadline

    def __repr__(self) -> str:
        payload = self.payload if len(self.payload) <= 40 else self.payload[:37] + b"..."
        return (
            f"{type(self).__name__}(queue_name={self.queue_name!r}, partition={self.partition}, "
            f"id={self.id!r}, attempts={self.attempts}, payload={payload!r})"
        )


class LeasedItem(_LeasedBase):
    """A leased item bound to the :class:`~querator.Client` that leased it.

    As a context manager it completes the item when the block succeeds, sends it to the
    dead-letter queue when the block raises :class:`~querator.DeadLetter`, and retries
    it at once on any other exception (which then propagates). An item settled inside
    the block is left alone.
    """

    __slots__ = ()
    _client: _Settles

    def complete(self) -> CompleteResult:
        """Remove the item for good. Raises LeaseLost when the lease is no longer ours.
        The result's ``already_completed`` holds the id when a send the client repeated
        had completed it already."""
        return self._client.complete(self)

    def retry(
        self, *, at: datetime | None = None, in_: Seconds | None = None, error: str | BaseException = ""
    ) -> RetryResult:
        """Give the item back: now, at ``at`` or after ``in_``; ``error`` (text or an
        exception) becomes its ``last_error``. Returns what the client's retry does."""
        return self._client.retry(self, at=at, in_=in_, error=error)

    def dead(self, error: str | BaseException = "") -> RetryResult:
        """Send the item to the queue's dead-letter queue (deleted when it has none),
        with ``error`` (text or an exception) as the dead letter's ``last_error``."""
        return self._client.retry(self, dead=True, error=error)

    def extend(self, lease_timeout: Seconds | None = None) -> datetime:
        """Push the lease deadline to now + ``lease_timeout`` (default: the queue's)."""
        return self._client.extend(self, lease_timeout=lease_timeout)[0]

    def __enter__(self) -> LeasedItem:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if self.settled:
            return False
        if exc is None:
            self.complete()
        elif isinstance(exc, DeadLetter):
            self.dead(error=exc)
            return True
        else:
            self.retry(error=exc)
        return False


class AsyncLeasedItem(_LeasedBase):
    """A leased item bound to the :class:`~querator.AsyncClient` that leased it.

    ``async with item:`` completes it on success, dead-letters it on
    :class:`~querator.DeadLetter` and retries it at once on any other exception.
    """

    __slots__ = ()
    _client: _AsyncSettles

    async def complete(self) -> CompleteResult:
        """Remove the item for good. Raises LeaseLost when the lease is no longer ours.
        The result's ``already_completed`` holds the id when a send the client repeated
        had completed it already."""
        return await self._client.complete(self)

    async def retry(
        self, *, at: datetime | None = None, in_: Seconds | None = None, error: str | BaseException = ""
    ) -> RetryResult:
        """Give the item back: now, at ``at`` or after ``in_``; ``error`` (text or an
        exception) becomes its ``last_error``. Returns what the client's retry does."""
        return await self._client.retry(self, at=at, in_=in_, error=error)

    async def dead(self, error: str | BaseException = "") -> RetryResult:
        """Send the item to the queue's dead-letter queue (deleted when it has none),
        with ``error`` (text or an exception) as the dead letter's ``last_error``."""
        return await self._client.retry(self, dead=True, error=error)

    async def extend(self, lease_timeout: Seconds | None = None) -> datetime:
        """Push the lease deadline to now + ``lease_timeout`` (default: the queue's)."""
        return (await self._client.extend(self, lease_timeout=lease_timeout))[0]

    async def __aenter__(self) -> AsyncLeasedItem:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if self.settled:
            return False
        if exc is None:
            await self.complete()
        elif isinstance(exc, DeadLetter):
            await self.dead(error=exc)
            return True
        else:
            await self.retry(error=exc)
        return False


AnyLeasedItem = LeasedItem | AsyncLeasedItem
"""A leased item of either client (what WorkerHooks receive)."""
