"""Domain errors raised by the manager, the actors and validation.

They carry no gRPC types; ``grpc_api.status`` maps each class to a status code::

    QueratorError
     ├── InvalidArgument      bad input, with one (field, description) pair per problem
     ├── NotFound             no such queue, or an id that does not exist
     ├── AlreadyExists        the queue name is taken
     ├── FailedPrecondition   the state forbids it (not leased, DLQ in use, ...)
     ├── ResourceExhausted    overloaded or request too big
     ├── Unavailable          shutting down or storage failing; safe to retry
     ├── Internal             a bug met while applying one request (it was not applied)
     ├── DeadlineExceeded     the caller's deadline passed first
     ├── Unauthenticated      authentication is on and no valid key came with the call
     ├── PermissionDenied     the key's role or queue patterns do not allow the call
     └── Relayed              another node's answer to a forwarded call, passed on as it was
"""

from __future__ import annotations

_MAX_QUOTE = 128


def quote(value: object, limit: int = _MAX_QUOTE) -> str:
    """Return ``repr(value)`` cut to ``limit`` characters.

    Error messages travel in gRPC trailers, which the client caps at 16 KB: a quoted
    10 KB id would otherwise turn the answer into a different status.
    """
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


class QueratorError(Exception):
    """Base class of every error the server reports to a caller."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(QueratorError):
    """The request is malformed; ``violations`` lists (field, description) pairs."""

    def __init__(self, violations: list[tuple[str, str]] | str, description: str = "") -> None:
        if isinstance(violations, str):
            violations = [(violations, description)]
        self.violations = violations
        super().__init__("; ".join(f"{field}: {desc}" for field, desc in violations))


class NotFound(QueratorError):
    """The queue or item does not exist."""


class AlreadyExists(QueratorError):
    """The queue already exists."""


class FailedPrecondition(QueratorError):
    """The current state forbids the operation."""


def holds_items(queue: str) -> FailedPrecondition:
    """A DeleteQueue without ``force`` of a queue that holds items: the same words from
    a single node's actor and a cluster node's router (the CLI turns "set force" into
    "add --force")."""
    return FailedPrecondition(f"queue {queue!r} still holds items; set force to delete it")


class ResourceExhausted(QueratorError):
    """The server is overloaded or the request is too big."""


class Unavailable(QueratorError):
    """The server is shutting down or storage is failing; the caller may retry."""


class NoHealthyPartition(Unavailable):
    """Every partition of the queue here is faulty (its storage failed): a Produce may
    still succeed on another node's partitions of the queue."""


class Internal(QueratorError):
    """A bug met while applying one request: it was not applied, and nothing else failed."""


class DeadlineExceeded(QueratorError):
    """The caller's deadline passed before the work was done."""


class Unauthenticated(QueratorError):
    """Authentication is on and the call carried no valid key."""


class PermissionDenied(QueratorError):
    """The caller's key does not allow this call on this queue."""


class Relayed(QueratorError):
    """The answer of the node a call was forwarded to (cluster mode), kept as it came.

    ``code`` is the gRPC status code's number, so this module needs no gRPC types.
    """

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
