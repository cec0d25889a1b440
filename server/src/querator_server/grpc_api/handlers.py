"""Registering services: each method's behavior behind the error boundary
(boundary.py), with our own deserializers; stream methods are stream_call.py's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message

from ..auth import Action
from ..errors import QueratorError, ResourceExhausted
from ..faults import asks_for_fault, faulty_call, request_faults_on
from ..model import MAX_REQUEST_BYTES
from .authz import Guard
from .boundary import Malformed, TooLarge, abort, deserializer, domain_error, log
from .status import invalid_argument_status
from .stream_call import Sending, StreamAnswer, StreamMethod

__all__ = ["Behavior", "generic_handler"]

Behavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Message]]


def _answer_bytes(answer: StreamAnswer) -> bytes:
    return answer.data  # serialized as it was made


def _wrap(service: str, method: str, behavior: Behavior, action: Action, guard: Guard | None) -> Behavior:
    full = f"/{service}/{method}"
    faults = request_faults_on()  # read once, when the server starts

    async def handler(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        if guard is not None:
            denied: QueratorError | None = None
            try:
                # Before anything else, even before looking at a malformed request.
                guard.check(action, None if isinstance(request, Malformed | TooLarge) else request, context)
            except QueratorError as exc:
                denied = exc
            if denied is not None:  # aborted outside the except block, as below
                denied.__traceback__ = None
                del request
                await abort(context, full, "", denied)
        if isinstance(request, Malformed):
            status = invalid_argument_status(f"the request is not a valid {method}Request: {request.reason}")
            log.info("rpc_error", method=full, code="INVALID_ARGUMENT", message=status.details)
            await context.abort(status.code, status.details, status.trailing_metadata)
        if isinstance(request, TooLarge):
            too_large = ResourceExhausted(
                f"the request is {request.size} bytes; at most {MAX_REQUEST_BYTES} bytes are accepted"
            )
            await abort(context, full, "", too_large)
        queue = getattr(request, "queue_name", "")
        if faults:
            faulty_call.set(asks_for_fault(context.invocation_metadata()))
        error: QueratorError
        try:
            return await behavior(request, context)
        except Exception as exc:
            error = domain_error(exc, full, queue)
        # Aborted outside the except block, the request dropped (boundary.domain_error says why).
        del request
        await abort(context, full, queue, error)
        raise AssertionError("unreachable: abort raises")

    return handler


def generic_handler(
    service: str,
    methods: dict[str, tuple[Behavior, type[Message], type[Message], Action]],
    *,
    streams: dict[str, tuple[Behavior, type[Message], type[Message], Action]] | None = None,
    open_streams: set[asyncio.Task[None]] | None = None,
    sending: dict[str, Sending] | None = None,
    guard: Guard | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
) -> grpc.GenericRpcHandler[Any, Any]:
    """A handler for ``service``: name -> (behavior, request type, response type, action).

    ``streams`` are bidirectional methods whose messages wrap a unary request: name
    -> (the unary behavior, stream request type, stream response type, action). With
    a ``guard`` every call (every message of a stream) is authenticated and authorized
    for its action first. ``open_streams`` collects the readers of open streams.
    """
    readers = open_streams if open_streams is not None else set()
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _wrap(service, name, behavior, action, guard),
            request_deserializer=deserializer(request_type, max_request_bytes),
            response_serializer=response_type.SerializeToString,
        )
        for name, (behavior, request_type, response_type, action) in methods.items()
    }
    for name, (behavior, request_type, response_type, action) in (streams or {}).items():
        handlers[name] = grpc.stream_stream_rpc_method_handler(
            StreamMethod(service, name, behavior, response_type, action, guard, readers, (sending or {}).get(name)).handle,
            request_deserializer=deserializer(request_type, max_request_bytes),
            response_serializer=_answer_bytes,
        )
    return grpc.method_handlers_generic_handler(service, handlers)
