"""Every error the SDK raises, one class per case a caller handles differently.

A failed call raises a subclass of :class:`QueratorError`, chosen from the gRPC
status code and, where the same code means different things, from the call::

    QueratorError                   base: .code (grpc.StatusCode), .status (its name), .message
     ├── InvalidRequest             INVALID_ARGUMENT; .field_violations from google.rpc.BadRequest
     ├── NotFound                   NOT_FOUND
     │    ├── QueueNotFound         no such queue (or it was deleted)
     │    └── ItemNotFound    (*)   an id that does not exist: completed, re-queued under a
     │                              new id after its lease expired, or never produced
     ├── QueueExists                ALREADY_EXISTS
     ├── FailedPrecondition         FAILED_PRECONDITION: the state forbids it (a DLQ in use,
     │    │                         a queue that still holds items, a busy client_id, ...)
     │    └── NotLeased       (*)   an id that exists but is not leased, or whose lease ran out
     ├── Overloaded                 RESOURCE_EXHAUSTED: the queue is overloaded (too many requests
     │                              waiting) or its storage is full; back off and retry
     ├── MessageTooLarge            RESOURCE_EXHAUSTED for a message over a size limit: a request
     │                              over the server's 5 MB, or a message over a gRPC send or
     │                              receive limit ("... message larger than max"); retrying
     │                              the same call fails the same way
     ├── Unavailable                UNAVAILABLE: server shutting down, storage failing, or no
     │                              connection; safe to retry
     ├── Unauthenticated            UNAUTHENTICATED: no API key, or one the server does not know
     │                              (revoked, mistyped); send ``bearer_token=``
     ├── PermissionDenied           PERMISSION_DENIED: the key's role or queue patterns do not
     │                              allow this call on this queue
     ├── DeadlineExceeded           DEADLINE_EXCEEDED: the call's deadline passed first
     ├── Cancelled                  CANCELLED
     └── ServerError                any other status (UNKNOWN, INTERNAL, UNIMPLEMENTED, ...)

    LeaseLost                       (*) base of ItemNotFound and NotLeased: on Complete, Retry
                                    and Extend, catch it to mean "this lease is no longer mine"

    DeadLetter                      not a server error: raise it from a Worker handler (or in a
                                    ``with item:`` block) to send the item to the dead-letter
                                    queue instead of retrying it

A multi-request :meth:`~querator.Client.produce` that fails part way sets ``.produced`` on
the error: a :class:`~querator.ProduceResult` whose ``ids`` are ``""`` for the items that
were not stored (None when nothing was stored). A :meth:`~querator.Client.redrive_items`
that fails after its earlier calls moved items sets ``.redriven``: a
:class:`~querator.RedriveResult` of those (None when none moved).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from ._models import ProduceResult, RedriveResult

__all__ = [
    "Cancelled",
    "DeadLetter",
    "DeadlineExceeded",
    "FailedPrecondition",
    "FieldViolation",
    "HandlerTimeout",
    "TimeLimitExceeded",
    "InvalidRequest",
    "ItemNotFound",
    "LeaseLost",
    "MessageTooLarge",
    "NotFound",
    "NotLeased",
    "Overloaded",
    "PermissionDenied",
    "QueratorError",
    "QueueExists",
    "QueueNotFound",
    "ServerError",
    "Unauthenticated",
    "Unavailable",
    "from_rpc_error",
]

@dataclass(frozen=True, slots=True)
class FieldViolation:
    """One bad field of a request, as the server's ``google.rpc.BadRequest`` names it."""

    field: str
    description: str


class QueratorError(Exception):
    """Base class of every error a Querator call raises."""

    #: The gRPC status code, or None for errors raised before any call was made.
    code: grpc.StatusCode | None = None

    def __init__(self, message: str, *, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        #: For a produce that stored some batches before failing: what was stored.
        self.produced: ProduceResult | None = None
        #: For a redrive whose earlier calls moved items before one failed: what they moved.
        self.redriven: RedriveResult | None = None

    @property
    def status(self) -> str:
        """The status code's name, e.g. ``"NOT_FOUND"`` (``"UNKNOWN"`` when there is none)."""
        return self.code.name if self.code is not None else "UNKNOWN"

    def __str__(self) -> str:
        return f"{self.status}: {self.message}" if self.code is not None else self.message


class InvalidRequest(QueratorError):
    """The request is malformed (INVALID_ARGUMENT); ``field_violations`` names each bad field."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        field_violations: list[FieldViolation] | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.field_violations: list[FieldViolation] = list(field_violations or [])


class NotFound(QueratorError):
    """NOT_FOUND: the queue or the item does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class LeaseLost(QueratorError):
    """The lease named by an id is no longer the caller's (base of ItemNotFound and NotLeased).

    The item was completed, retried, re-queued after its lease expired (it has a new id
    now) or was never leased. Whatever the caller did with it may be done again by
    another consumer: handlers must be idempotent (at-least-once delivery).
    """


class QueueNotFound(NotFound):
    """The queue does not exist (or was deleted)."""


class ItemNotFound(NotFound, LeaseLost):
    """An id passed to Complete, Retry or Extend does not exist (any more)."""


class QueueExists(QueratorError):
    """ALREADY_EXISTS: a queue of that name exists."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(QueratorError):
    """FAILED_PRECONDITION: the current state forbids the operation."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NotLeased(FailedPrecondition, LeaseLost):
    """An id passed to Complete, Retry or Extend is not leased, or its lease has run out."""


class Overloaded(QueratorError):
    """RESOURCE_EXHAUSTED: the queue is overloaded (too many requests waiting) or its
    storage is full. A message over a size limit is :class:`MessageTooLarge` instead."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class MessageTooLarge(QueratorError):
    """RESOURCE_EXHAUSTED because a message was over a size limit, not because the server
    is busy: a request over the server's 5,000,000 bytes, or a message over this
    channel's or the server's gRPC send or receive limit. Sending the same call again
    fails the same way: send fewer or smaller items, or raise the channel's
    ``grpc.max_receive_message_length`` (``channel_options``)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(QueratorError):
    """UNAVAILABLE: the server is shutting down, its storage is failing or it cannot be reached.

    The request was not applied when the server said so; after a lost connection it may
    or may not have been. Reads, Lease and Extend are retried automatically.
    """

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(QueratorError):
    """UNAUTHENTICATED: the server requires an API key and the call had none it accepts.

    No ``authorization: Bearer`` metadata, or a token that is unknown or revoked.
    """

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(QueratorError):
    """PERMISSION_DENIED: the key may not make this call on this queue.

    Its role does not allow the call (a producer key leasing, say) or none of its queue
    patterns matches the queue. A missing queue outside the patterns answers the same.
    """

    code = grpc.StatusCode.PERMISSION_DENIED


class DeadlineExceeded(QueratorError):
    """DEADLINE_EXCEEDED: the call's deadline passed before the server answered."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(QueratorError):
    """CANCELLED: the call was cancelled."""

    code = grpc.StatusCode.CANCELLED


class ServerError(QueratorError):
    """Any other status (UNKNOWN, INTERNAL, UNIMPLEMENTED, ...): a bug or a mismatched server."""


class DeadLetter(Exception):  # noqa: N818 - it is an instruction, not an error condition
    """Raise from a handler to send the item to the dead-letter queue, without retrying it."""


class HandlerTimeout(TimeoutError):
    """A worker's handler ran past ``handler_timeout``: the worker gave it up and
    retries the item (a ``TimeoutError``, so ``retry_on``/``dead_on`` rules naming
    TimeoutError apply to it)."""


class TimeLimitExceeded(HandlerTimeout):
    """A handler run with ``executor="process"`` ran past its ``time_limit``: its process
    was killed (SIGKILL), so nothing it had not done yet happens, and the item is retried
    (or dead-lettered on its last attempt) as for any other error."""


_BY_CODE: dict[grpc.StatusCode, type[QueratorError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: QueueExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


class _Ended:
    """A finished call's status, in the shape ``grpc_status.rpc_status.from_call`` reads."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: object) -> None:
        self._code, self._message, self._trailing = code, message, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> object:
        return self._trailing


def _field_violations(code: grpc.StatusCode, message: str, trailing: object) -> list[FieldViolation]:
    """The google.rpc.BadRequest field violations of the call's rich status, if any."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    try:
        status = rpc_status.from_call(_Ended(code, message, trailing or ()))  # type: ignore[arg-type]
    except Exception:  # a garbled or mismatched trailer must not hide the real error
        return []
    out: list[FieldViolation] = []
    for detail in status.details if status is not None else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            out.extend(FieldViolation(v.field, v.description) for v in bad.field_violations)
    return out


def _is_size_message(message: str) -> bool:
    """Whether a RESOURCE_EXHAUSTED message is about a message's size: gRPC's own ("Sent
    message larger than max (N vs. M)", "Received message larger than max ...") or the
    server's ("the request is N bytes; at most M bytes are accepted")."""
    return "larger than max" in message or " bytes are accepted" in message


def _is_queue_message(message: str) -> bool:
    return message.startswith("queue ") and ("does not exist" in message or "was deleted" in message)


def from_status(
    code: grpc.StatusCode, message: str, trailing: object = (), *, item_call: bool = False, key_call: bool = False
) -> QueratorError:
    """The exception for a status ``code``; ``item_call`` for calls that name leased ids,
    ``key_call`` for KeysService calls (NOT_FOUND is then a missing key)."""
    cls = _BY_CODE.get(code, ServerError)
    if cls is NotFound and not key_call:
        cls = ItemNotFound if item_call and not _is_queue_message(message) else QueueNotFound
    elif cls is FailedPrecondition and item_call and "client_id" not in message:
        cls = NotLeased
    elif cls is Overloaded and _is_size_message(message):
        cls = MessageTooLarge
    if cls is InvalidRequest:
        return InvalidRequest(message, code=code, field_violations=_field_violations(code, message, trailing))
    return cls(message, code=code)


def from_rpc_error(error: grpc.RpcError, *, item_call: bool = False, key_call: bool = False) -> QueratorError:
    """Map a ``grpc.RpcError`` (sync or ``grpc.aio.AioRpcError``) to a :class:`QueratorError`."""
    if isinstance(error, (grpc.aio.AioRpcError, grpc.Call)):
        return from_status(
            error.code(), error.details() or "", error.trailing_metadata(), item_call=item_call, key_call=key_call
        )
    return ServerError(str(error) or type(error).__name__)
