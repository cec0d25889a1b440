"""The one boundary between domain errors and gRPC status codes.

``INVALID_ARGUMENT`` carries a ``google.rpc.BadRequest`` with one field violation per
problem. Messages are cut short: they travel in trailers that clients cap at 16 KB.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from querator.v1 import queue_pb2

from ..errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QueratorError,
    Relayed,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

MAX_MESSAGE = 2048

_CODES: dict[type[QueratorError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Internal: grpc.StatusCode.INTERNAL,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_code(error: QueratorError) -> grpc.StatusCode:
    if isinstance(error, Relayed):
        return next((c for c in grpc.StatusCode if c.value[0] == error.code), grpc.StatusCode.UNKNOWN)
    for cls in type(error).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def _cut(text: str, limit: int = MAX_MESSAGE) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def to_status(error: QueratorError) -> grpc.Status:
    code = status_code(error)
    message = _cut(error.message)
    details = []
    if isinstance(error, InvalidArgument):
        bad = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=_cut(f, 256), description=_cut(d, 512))
                for f, d in error.violations[:20]
            ]
        )
        packed = any_pb2.Any()
        packed.Pack(bad)
        details.append(packed)
    proto = status_pb2.Status(code=code.value[0], message=message, details=details)
    return rpc_status.to_status(proto)


def invalid_argument_status(message: str) -> grpc.Status:
    return rpc_status.to_status(status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=_cut(message)))


def stream_error(code: int, message: str, error: QueratorError | None = None) -> queue_pb2.StreamError:
    """The answer to one failed request of a stream: the unary call's code and message."""
    fields = [_cut(f, 256) for f, _ in error.violations[:20]] if isinstance(error, InvalidArgument) else []
    return queue_pb2.StreamError(code=code, message=message, fields=fields)
