"""The error boundary every call goes through, unary or stream.

Stock grpcio answers INTERNAL when request bytes do not parse; our deserializer
returns a marker instead (``Malformed``, ``TooLarge``) and the call answers
INVALID_ARGUMENT or RESOURCE_EXHAUSTED. Any exception becomes the domain error whose
status the caller gets (``domain_error``), and each one is logged once with its
queue name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from ..errors import Internal, QueratorError, Unavailable
from ..logging import get_logger
from ..storage import StorageError
from .status import status_code, to_status

log = get_logger("rpc")


class Malformed:
    """Request bytes that do not parse as the method's request."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class TooLarge:
    """Request bytes over the accepted size (never parsed)."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


def deserializer(message_type: type[Message], max_bytes: int) -> Callable[[bytes], object]:
    parse = message_type.FromString

    def deserialize(data: bytes) -> object:
        if len(data) > max_bytes:
            return TooLarge(len(data))
        try:
            return parse(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return Malformed(str(exc) or "undecodable bytes")

    return deserialize


def domain_error(exc: Exception, method: str, queue: str) -> QueratorError:
    """What a call that raised ``exc`` answers. The error has no traceback: kept, it
    would hold the call's frames, and so the refused request with its payload, alive in
    a reference cycle until the garbage collector's next full pass."""
    if isinstance(exc, QueratorError):
        error = exc
    elif isinstance(exc, StorageError):
        # A storage failure that no layer below turned into a domain error: the write
        # did not happen, so the caller may retry (never UNKNOWN).
        error = Unavailable(f"storage failed, retry later: {exc}")
    else:  # a bug: this call fails alone, INTERNAL rather than UNKNOWN
        log.error("rpc_failed", method=method, queue=queue[:200], error=repr(exc), exc_info=exc)
        error = Internal(f"internal error while handling the call ({type(exc).__name__})")
    error.__traceback__ = None
    return error


def log_error(method: str, queue: str, error: QueratorError) -> None:
    status = to_status(error)
    log_event = log.warning if isinstance(error, Unavailable) else log.info
    log_event("rpc_error", method=method, queue=queue[:200], code=status_code(error).name, message=status.details)


async def abort(context: grpc.aio.ServicerContext[Any, Any], method: str, queue: str, error: QueratorError) -> None:
    """End the call with ``error``'s status (logged). Call it outside an ``except``
    block, for the reason ``domain_error`` gives."""
    log_error(method, queue, error)
    status = to_status(error)
    await context.abort(status.code, status.details, status.trailing_metadata)
