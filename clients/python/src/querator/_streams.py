"""Produce and Lease over ``ProduceStream`` / ``LeaseStream``: one call, many requests.

An :class:`~querator.AsyncClient` (``ClientConfig.streams``, on by default) sends the
Produce and Lease requests of each queue over one stream per queue and kind: the
server spends about half the CPU per request of a unary call. The server answers each
request once, in the order sent; a request that fails is answered with its error and
the stream goes on. One stream per queue, so a Lease waiting on an empty queue holds
back only the answers of that queue.

A stream opens on first use and again after it breaks; the requests in flight when it
breaks fail with its error (UNAVAILABLE when the server went away, which a caller may
retry as after a unary call). A server without the streams (UNIMPLEMENTED) gets unary
calls from then on.

A caller that stops waiting (its timeout, or cancelled) cannot take its request back
alone. A Produce is left to run, as a unary call past its deadline may still be stored.
A Lease would lease items nobody receives until their lease ran out, so its stream is
cancelled, which the server treats as a cancelled call for every request in flight on
it: leases not yet committed take nothing. The others in flight on it fail UNAVAILABLE
and are retried on a new stream as after any UNAVAILABLE (a Lease that completes items
is not: as with a unary call, the caller cannot know whether the completion happened).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from .errors import (
    Cancelled,
    DeadlineExceeded,
    FieldViolation,
    InvalidRequest,
    QueratorError,
    ServerError,
    Unavailable,
    from_rpc_error,
    from_status,
)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class StreamsUnsupported(Exception):
    """The server has no ProduceStream / LeaseStream: use unary calls."""


def from_stream_error(error: Any, *, item_call: bool = False) -> QueratorError:
    """The exception for a ``StreamError`` answer (the status the unary call would have had)."""
    code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        violations = [FieldViolation(field, "") for field in error.fields]
        return InvalidRequest(error.message, code=code, field_violations=violations)
    return from_status(code, error.message, item_call=item_call)


def _forget(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved, so an answer nobody waits for is not reported


class RequestStream:
    """One open stream: writes one request at a time, resolves answers in order."""

    def __init__(self, open_call: Callable[[], Any], *, cancel_abandoned: bool) -> None:
        self._open_call = open_call
        self._cancel_abandoned = cancel_abandoned
        self._call: Any = None
        self._waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._write = asyncio.Lock()
        self._readers: set[asyncio.Task[None]] = set()
        self._closed = False

    async def ask(self, message: Any, timeout: float) -> Any:
        """Send ``message``; its answer (a ``...StreamResponse``), or the stream's error."""
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        async with self._write:
            if self._call is None:
                opened = await asyncio.wait_for(self._open(), timeout)
                # Each call has its own waiters: a cancelled call's reader fails only its own.
                self._call, self._waiting = opened, collections.deque()
                reader = asyncio.create_task(self._read(self._call, self._waiting))
                self._readers.add(reader)
                reader.add_done_callback(self._readers.discard)
            self._waiting.append(answer)
            call = self._call
            try:
                await call.write(message)
            except Exception:  # the stream is done; its reader fails every waiter
                pass
        try:
            return await asyncio.wait_for(asyncio.shield(answer), timeout)
        except TimeoutError:
            self._abandon(call, answer)
            raise DeadlineExceeded(f"no answer within {timeout:g}s", code=grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except asyncio.CancelledError:
            self._abandon(call, answer)
            raise

    async def _open(self) -> Any:
        """A new call, once the server has accepted it: it sends its headers at once. A
        write before that could fail and hide the server's status (grpc/grpc#36066: a
        refused method then reads INTERNAL instead of UNIMPLEMENTED)."""
        call = self._open_call()
        try:
            try:
                await call.initial_metadata()
            except grpc.aio.AioRpcError:
                pass  # the call ended: its status says why
            if call.done():
                code = await call.code()
                if code is grpc.StatusCode.UNIMPLEMENTED:
                    raise StreamsUnsupported()
                raise from_status(code, await call.details() or "", await call.trailing_metadata())
        except BaseException:
            call.cancel()
            raise
        return call

    def _abandon(self, call: Any, answer: asyncio.Future[Any]) -> None:
        answer.add_done_callback(_forget)
        if self._cancel_abandoned and not answer.done():
            if self._call is call:
                self._call = None
            call.cancel()

    async def _read(self, call: Any, waiting: collections.deque[asyncio.Future[Any]]) -> None:
        error: BaseException
        try:
            while (answer := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
                waiter = waiting.popleft()
                if not waiter.done():
                    waiter.set_result(answer)
            error = Unavailable("the server ended the stream", code=grpc.StatusCode.UNAVAILABLE)
        except grpc.aio.AioRpcError as exc:
            error = StreamsUnsupported() if exc.code() is grpc.StatusCode.UNIMPLEMENTED else from_rpc_error(exc)
        except asyncio.CancelledError:
            if self._closed:
                error = Cancelled("the client was closed", code=grpc.StatusCode.CANCELLED)
            else:  # cancelled under this request: another one on it was abandoned
                error = Unavailable(
                    "the stream was closed to take back an abandoned request; safe to retry",
                    code=grpc.StatusCode.UNAVAILABLE,
                )
        except Exception as exc:  # a bug must not leave callers waiting forever
            error = ServerError(f"the stream failed: {exc!r}", code=grpc.StatusCode.UNKNOWN)
        if self._call is call:
            self._call = None
        while waiting:
            waiter = waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    @property
    def idle(self) -> bool:
        """No request is waiting for its answer."""
        return not any(not waiter.done() for waiter in self._waiting)

    def reopen(self) -> None:
        """Open a new stream for the next request (e.g. to send fresh credentials)."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    async def close(self) -> None:
        self._closed = True
        self.reopen()
        await asyncio.gather(*self._readers, return_exceptions=True)


# Streams a client keeps open; past it the least recently used idle ones are closed
# (a client that touches thousands of queues must not hold a stream on each).
MAX_STREAMS = 32


class Streams:
    """The open streams of one client, by (method, queue), least recently used first."""

    def __init__(self) -> None:
        self._streams: dict[tuple[str, str], RequestStream] = {}
        self.unsupported = False

    def get(self, method: str, queue: str, open_call: Callable[[], Any]) -> RequestStream:
        key = (method, queue)
        stream = self._streams.pop(key, None)
        if stream is None:
            stream = RequestStream(open_call, cancel_abandoned=method == "Lease")
        self._streams[key] = stream
        if len(self._streams) > MAX_STREAMS:
            for old_key, old in list(self._streams.items())[: len(self._streams) - MAX_STREAMS]:
                if old.idle:
                    del self._streams[old_key]
                    old.reopen()  # cancels the call; its reader ends on its own
        return stream

    def all(self) -> Iterable[RequestStream]:
        return list(self._streams.values())

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(stream.close() for stream in streams), return_exceptions=True)
