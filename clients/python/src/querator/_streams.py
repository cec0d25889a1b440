"""Produce and Lease over ``ProduceStream`` / ``LeaseStream``: one call, many requests.

An :class:`~querator.AsyncClient` (``ClientConfig.streams``, on by default) sends the
Produce and Lease requests of each queue over one stream per queue and kind, and in a
cluster per node too (to the node routing chose for each request): the server spends
about half the CPU per request of a unary call. The server answers each request once,
in the order sent; a request that fails is answered with its error and the stream
goes on. One stream per queue, so a Lease waiting on an empty queue holds back only
the answers of that queue.

A stream opens on first use and again after it breaks; the requests in flight when it
breaks fail with its error (UNAVAILABLE when the server went away, which a caller may
retry as after a unary call, and which the routing reads as it reads a unary call's).
A request that could not be written (the stream could not open, or its write failed:
the connection broke under it) never left this process. A write that fails makes gRPC
end the call INTERNAL "Internal error from Core", a status of its own: the requests
written before it fail UNAVAILABLE as when the node went away, while an INTERNAL the
server answers (for one request, or for the stream) stays a ServerError. A server without the streams (UNIMPLEMENTED) gets unary calls from then on.

A caller that stops waiting (its timeout, or cancelled) cannot take its request back
alone. A Produce is left to run, as a unary call past its deadline may still be stored.
A Lease would lease items nobody receives until their lease ran out, so its stream is
cancelled, which the server treats as a cancelled call for every request in flight on
it: leases not yet committed take nothing. The others in flight on it fail UNAVAILABLE
and are retried on a new stream as after any UNAVAILABLE (a Lease that completes items
too, as a unary one is, unless ``retry_complete`` is off: the server answers the ids it
completed the first time as done).
"""

from __future__ import annotations

import asyncio
import collections
import copy
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from ._cluster import ABANDONED, BROKEN, UNSENT, tagged
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
        violations = [FieldViolation(name, "") for name in error.fields]
        return InvalidRequest(error.message, code=code, field_violations=violations)
    return from_status(code, error.message, item_call=item_call)


def _forget(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved, so an answer nobody waits for is not reported


@dataclass(eq=False)
class _Opened:
    """One call of a stream: the waiters of its answers, in order, and why this process
    ended it (None: it ended on its own)."""

    call: Any
    waiting: collections.deque[asyncio.Future[Any]] = field(default_factory=collections.deque)
    ended: QueratorError | None = None
    # A write (or half-close) under way, and whether one failed. gRPC ends a call whose
    # write fails (its connection broke) with a status of its own, INTERNAL "Internal
    # error from Core", which the reader may see before the writer does: it waits for
    # the write to finish to know whose status it is.
    writing: asyncio.Future[None] | None = None
    broke: bool = False

    async def send(self, write: Awaitable[None]) -> None:
        """Await ``write`` (of this call); an ``AioRpcError`` from it: the call broke."""
        self.writing = asyncio.get_running_loop().create_future()
        try:
            await write
        except grpc.aio.AioRpcError:
            self.broke = True
            raise
        finally:
            self.writing.set_result(None)
            self.writing = None


def _broken(exc: grpc.aio.AioRpcError) -> QueratorError:
    message = "the connection to the node broke with requests in flight on its stream"
    error = tagged(Unavailable(message, code=grpc.StatusCode.UNAVAILABLE), BROKEN)
    error.__cause__ = exc
    return error


def _abandoned() -> QueratorError:
    message = "the stream was closed to take back an abandoned request; safe to retry"
    return tagged(Unavailable(message, code=grpc.StatusCode.UNAVAILABLE), ABANDONED)


class RequestStream:
    """One stream: writes one request at a time, resolves answers in order.

    ``connected``: whether the channel still has its connection. A request is never
    written on a call whose connection is gone (gRPC may not have told the call yet):
    a new call is opened instead, so a node that died between two requests makes the
    second fail as never sent (the connection refused), not as lost in flight.
    """

    def __init__(
        self, open_call: Callable[[], Any], *, cancel_abandoned: bool, connected: Callable[[], bool] | None = None
    ) -> None:
        self._open_call = open_call
        self._cancel_abandoned = cancel_abandoned
        self._connected = connected
        self._current: _Opened | None = None
        self._write = asyncio.Lock()
        self._readers: dict[_Opened, asyncio.Task[None]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._closed: QueratorError | None = None

    async def ask(self, message: Any, timeout: float) -> Any:
        """Send ``message``; its answer (a ``...StreamResponse``), or the stream's error."""
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        async with self._write:
            if self._closed is not None:
                raise copy.copy(self._closed)
            opened = self._current
            if opened is None or opened.call.done() or (self._connected is not None and not self._connected()):
                self.retire()
                try:
                    opened = self._current = await asyncio.wait_for(self._opened(), timeout)
                except TimeoutError:
                    raise DeadlineExceeded(
                        f"the stream did not open within {timeout:g}s", code=grpc.StatusCode.DEADLINE_EXCEEDED
                    ) from None
            opened.waiting.append(answer)
            try:
                await opened.send(opened.call.write(message))
            except asyncio.InvalidStateError:  # it ended as it opened: nothing was written
                opened.waiting.remove(answer)
                error = Unavailable("the stream ended before the request was written", code=grpc.StatusCode.UNAVAILABLE)
                raise tagged(error, UNSENT) from None
            except grpc.aio.AioRpcError as exc:
                # The write failed (its send never completed): the request did not reach
                # the node, whatever the reader may have told its waiter meanwhile.
                if answer in opened.waiting:
                    opened.waiting.remove(answer)
                answer.add_done_callback(_forget)
                error = Unavailable(
                    "the connection to the node broke before the request was written", code=grpc.StatusCode.UNAVAILABLE
                )
                raise tagged(error, UNSENT) from exc
            except Exception:  # the stream is done; its reader fails every waiter
                pass
        try:
            return await asyncio.wait_for(asyncio.shield(answer), timeout)
        except TimeoutError:
            self._abandon(opened, answer)
            raise DeadlineExceeded(f"no answer within {timeout:g}s", code=grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except asyncio.CancelledError:
            self._abandon(opened, answer)
            raise

    async def _opened(self) -> _Opened:
        opened = _Opened(await self._open())
        # Each call has its own waiters: a cancelled call's reader fails only its own.
        reader = asyncio.create_task(self._read(opened))
        self._readers[opened] = reader
        reader.add_done_callback(lambda _: self._readers.pop(opened, None))
        return opened

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

    def _abandon(self, opened: _Opened, answer: asyncio.Future[Any]) -> None:
        answer.add_done_callback(_forget)
        if self._cancel_abandoned and not answer.done():
            self._end(opened, _abandoned())

    def _end(self, opened: _Opened, reason: QueratorError) -> None:
        """Cancel ``opened``: its waiters fail with ``reason``."""
        if self._current is opened:
            self._current = None
        if opened.ended is None:
            opened.ended = reason
        opened.call.cancel()

    async def _read(self, opened: _Opened) -> None:
        call, waiting = opened.call, opened.waiting
        error: BaseException
        try:
            while (answer := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
                waiter = waiting.popleft()
                if not waiter.done():
                    waiter.set_result(answer)
            # The server ends its streams itself only when it stops (once it answered
            # what it read).
            error = Unavailable("the server ended the stream: shutting down", code=grpc.StatusCode.UNAVAILABLE)
        except grpc.aio.AioRpcError as exc:
            if opened.writing is not None:  # ends soon: the call is over
                await asyncio.wait([opened.writing])
            if opened.broke:
                error = _broken(exc)
            elif exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                error = StreamsUnsupported()
            else:
                error = from_rpc_error(exc)
                error.__cause__ = exc  # the connection's own words, read by the routing
        except asyncio.CancelledError:
            error = opened.ended or _abandoned()
        except Exception as exc:  # a bug must not leave callers waiting forever
            error = ServerError(f"the stream failed: {exc!r}", code=grpc.StatusCode.UNKNOWN)
        if self._current is opened:
            self._current = None
        while waiting:
            waiter = waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)

    @property
    def idle(self) -> bool:
        """No request is waiting for its answer."""
        return all(waiter.done() for opened in self._readers for waiter in opened.waiting)

    def reopen(self) -> None:
        """Open a new stream for the next request (e.g. to send fresh credentials)."""
        if self._current is not None:
            self._end(self._current, _abandoned())

    def retire(self) -> None:
        """Open a new call for the next request; the current one ends once it answered
        what it was sent (its requests are not cut short: the connection may be fine)."""
        opened, self._current = self._current, None
        if opened is not None and not opened.call.done():
            task = asyncio.create_task(self._half_close(opened))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _half_close(self, opened: _Opened) -> None:
        async with self._write:  # not while a request is being written on it
            try:
                await opened.send(opened.call.done_writing())
            except Exception:
                pass  # ended already: its reader has told its waiters

    async def close(self, reason: QueratorError | None = None) -> None:
        """End every call of the stream; the requests in flight fail with ``reason``
        (default: Cancelled, the client was closed)."""
        self._closed = reason or Cancelled("the client was closed", code=grpc.StatusCode.CANCELLED)
        for opened in list(self._readers):
            self._end(opened, self._closed)
        await asyncio.gather(*self._readers.values(), *self._closing, return_exceptions=True)


# Streams a client keeps open per node; past it the least recently used idle ones are
# closed (a client that touches thousands of queues must not hold a stream on each).
MAX_STREAMS = 32


class Streams:
    """The open streams of one client, by (node address, method, queue), least recently
    used first. A single server's are all at its one address."""

    def __init__(self) -> None:
        self._streams: dict[tuple[str, str, str], RequestStream] = {}
        self.unsupported = False

    def get(
        self, address: str, method: str, queue: str, open_call: Callable[[], Any], connected: Callable[[], bool] | None = None
    ) -> RequestStream:
        key = (address, method, queue)
        stream = self._streams.pop(key, None)
        if stream is None:
            stream = RequestStream(open_call, cancel_abandoned=method == "Lease", connected=connected)
            self._evict(address)
        self._streams[key] = stream
        return stream

    def _evict(self, address: str) -> None:
        held = [key for key in self._streams if key[0] == address]
        for key in held[: max(0, len(held) + 1 - MAX_STREAMS)]:
            if self._streams[key].idle:
                self._streams.pop(key).reopen()  # cancels the call; its reader ends on its own

    def retire(self, address: str) -> None:
        """The node at ``address`` went away: its streams are not written on again (a
        new call is opened for the next request, when the node is back)."""
        for key, stream in self._streams.items():
            if key[0] == address:
                stream.retire()

    def all(self) -> Iterable[RequestStream]:
        return list(self._streams.values())

    async def close(self, address: str | None = None, reason: QueratorError | None = None) -> None:
        """Close every stream (or those to ``address``); see :meth:`RequestStream.close`."""
        keys = [key for key in self._streams if address is None or key[0] == address]
        streams = [self._streams.pop(key) for key in keys]
        await asyncio.gather(*(stream.close(reason) for stream in streams), return_exceptions=True)
