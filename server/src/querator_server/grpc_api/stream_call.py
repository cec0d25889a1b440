"""A stream call: many unary requests on one bidirectional stream.

Each message is applied as the unary method (the message's ``request`` field), several
at once (up to ``STREAM_WINDOW``), and answered in the order received; a failure
answers that message and the stream goes on. Answers not yet sent are counted
(send_room.py) and, at the stream's end, the items of every answer the client will not
get are given back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import grpc
from google.protobuf.message import Message

from ..auth import Action
from ..errors import QueratorError, ResourceExhausted, Unauthenticated
from ..faults import asks_for_fault, faulty_call, request_faults_on
from ..logging import get_logger
from ..model import MAX_REQUEST_BYTES, STALL_SECONDS, STREAM_UNSENT_BYTES
from .authz import Guard
from .boundary import Malformed, TooLarge, abort, domain_error, log_error
from .send_room import SendRoom, StreamRoom, current_stream
from .status import invalid_argument_status, stream_error, to_status

log = get_logger("rpc")

Behavior = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Message]]

# Requests of one stream read and not yet answered; past it the stream is not read, and
# HTTP/2 flow control holds the client back. Bounds what a stream holds in memory (each
# request up to the 5 MB limit); a client gains nothing from more in flight than this.
STREAM_WINDOW = 16


# A stream answer's ``response`` (field 1, length-delimited) is written around the unary
# answer's bytes: building the answer message instead copies the whole reply into it
# (a 100-item lease reply took 13 µs to wrap and serialize that way, 5 µs this way).
_RESPONSE_TAG = b"\x0a"
_UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED.value[0]


def _length(size: int) -> bytes:
    """``size`` as a protobuf varint."""
    out = bytearray()
    while size > 0x7F:
        out.append(size & 0x7F | 0x80)
        size >>= 7
    out.append(size)
    return bytes(out)


class StreamAnswer:
    """One answer of a stream: its bytes on the wire, and what they hold (the unary
    answer, or the error), for whoever watches the stream (metrics)."""

    __slots__ = ("data", "response", "error")

    def __init__(self, data: bytes, response: Message | None = None, error: Message | None = None) -> None:
        self.data = data
        self.response = response
        self.error = error

    @classmethod
    def of_response(cls, message: Message) -> StreamAnswer:
        inner = message.SerializeToString()
        return cls(b"".join((_RESPONSE_TAG, _length(len(inner)), inner)), response=message)

    @classmethod
    def of_error(cls, response_type: type[Message], error: Message) -> StreamAnswer:
        return cls(response_type(error=error).SerializeToString(), error=error)


class StreamMethod:
    """One stream method (ProduceStream, LeaseStream); ``handle`` serves each stream
    (a bound async generator function: grpc.aio tells streaming handlers by that).

    Each open stream's reader is in ``readers``: cancelling it ends the stream with OK
    once the messages already read are answered (the server does so when it stops).

    With a ``guard``, the call is authenticated once at its start and ended
    UNAUTHENTICATED without a valid key, or PERMISSION_DENIED when the key's role may
    never do the stream's action, so neither stream stays open. Each message is still
    checked (its action and queue; a key revoked meanwhile): a
    message refused for its queue is answered PERMISSION_DENIED and the stream goes on;
    one whose key no longer authenticates is answered UNAUTHENTICATED, nothing more is
    read, and the stream ends UNAUTHENTICATED once the messages before it are answered.

    With ``sending``, the bytes of answers not yet sent are counted (send_room.py), and
    a stream whose client reads nothing for ``stall_s`` is ended."""

    def __init__(
        self,
        service: str,
        method: str,
        behavior: Behavior,
        response_type: type[Message],
        action: Action,
        guard: Guard | None,
        readers: set[asyncio.Task[None]],
        sending: Sending | None = None,
    ) -> None:
        if response_type.DESCRIPTOR.fields_by_name["response"].number != 1:
            raise ValueError(f"{response_type.__name__}.response must be field 1")
        self.full = f"/{service}/{method}"
        self.method = method
        self.unary = method.removesuffix("Stream")
        self.behavior = behavior
        self.response_type = response_type
        self.action = action
        self.guard = guard
        self.readers = readers
        self.sending = sending
        self.faults = request_faults_on()  # read once, when the server starts

    async def handle(
        self, messages: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[StreamAnswer]:
        await self._open(context)
        # Set by a message whose key stopped authenticating (revoked while the stream is open).
        revoked: list[Unauthenticated] = []
        # At once, before any message: a client waits for this to know the server has the
        # method (a server without it answers UNIMPLEMENTED instead) before it writes.
        await context.send_initial_metadata(())
        # Answers in the order asked: each message's task, oldest first; None ends it.
        answers: asyncio.Queue[asyncio.Task[StreamAnswer] | None] = asyncio.Queue(maxsize=STREAM_WINDOW)
        sending = self.sending
        stream = None if sending is None else StreamRoom(sending.room, sending.stream_limit)
        current_stream.set(stream)  # seen by every message's task, created by the reader
        state = None if stream is None or sending is None else _Unsent(context, stream, sending)
        reader = asyncio.create_task(self._read(messages, context, revoked, answers, state))
        self.readers.add(reader)
        reader.add_done_callback(self.readers.discard)
        if state is not None:
            state.reader = reader
        try:
            while not (answers.empty() and reader.done()):
                task = await answers.get()
                if task is None:
                    break
                if state is None:
                    answer = await task
                    yield answer
                else:
                    state.stream.head = task
                    answer = await task
                    state.stream.head = None  # made: from here on it is the held answer
                    state.sending_now(task, answer)
                    yield answer
                    state.sent()
                    if state.ended:
                        return  # ended by the stall timeout; the client read the answer late
                if revoked and getattr(answer.error, "code", 0) == _UNAUTHENTICATED:
                    # Later messages were checked after this one, and so failed too.
                    await abort(context, self.full, "", revoked[0])
            if not reader.cancelled():
                await reader  # a stream that broke ends the call with the transport's error
        finally:
            self.readers.discard(reader)
            reader.cancel()
            if state is not None:
                state.end()
            while not answers.empty():
                left = answers.get_nowait()
                if left is not None:
                    left.cancel()

    async def _open(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if self.guard is not None:
            denied: QueratorError | None = None
            try:
                # A key whose role can never do this action (a producer key opening a
                # LeaseStream) is refused for the call, as the unary call is: answering
                # each message PERMISSION_DENIED would keep a misconfigured client
                # spinning on an open stream. Queue patterns are checked per message.
                self.guard.check(self.action, None, context)
            except QueratorError as exc:
                denied = exc
            if denied is not None:  # aborted outside the except block (boundary.domain_error says why)
                denied.__traceback__ = None
                await abort(context, self.full, "", denied)
        if self.faults:
            faulty_call.set(asks_for_fault(context.invocation_metadata()))

    async def _read(
        self,
        messages: AsyncIterator[Any],
        context: grpc.aio.ServicerContext[Any, Any],
        revoked: list[Unauthenticated],
        answers: asyncio.Queue[asyncio.Task[StreamAnswer] | None],
        state: _Unsent | None,
    ) -> None:
        stream = None if state is None else state.stream
        try:
            async for message in messages:
                task = asyncio.create_task(self._one(message, context, revoked, stream))
                if state is not None:
                    state.made(task)
                    if state.ended:
                        task.cancel()
                        break
                try:
                    await answers.put(task)
                except BaseException:  # stopped with the window full: nobody will answer it
                    # It ran while the window was full, and may be answered already:
                    # then the stream's end settles it (``_Unsent.made``).
                    task.cancel()
                    raise
                if revoked:  # messages read meanwhile fail their own check too
                    break
        finally:
            # The end mark; with the window full the writer sees the reader done.
            if not answers.full():
                answers.put_nowait(None)

    async def _one(
        self,
        message: Any,
        context: grpc.aio.ServicerContext[Any, Any],
        revoked: list[Unauthenticated],
        stream: StreamRoom | None,
    ) -> StreamAnswer:
        answer = await self._answer_of(message, context, revoked)
        if stream is not None and self.sending is not None:
            if stream.ended:  # made after its stream ended: it will never be sent
                self.sending.give_back_answer(answer, reached=False)
            else:
                stream.take(len(answer.data))  # unsent from now until the writer hands it over
        return answer

    async def _answer_of(
        self, message: Any, context: grpc.aio.ServicerContext[Any, Any], revoked: list[Unauthenticated]
    ) -> StreamAnswer:
        request = None if isinstance(message, Malformed | TooLarge) else message.request
        where = f"{self.full} ({self.unary})"
        try:
            if self.guard is not None:
                try:
                    self.guard.check(self.action, request, context)
                except Unauthenticated as exc:
                    revoked.append(exc)
                    raise
            if isinstance(message, Malformed):
                status = invalid_argument_status(f"the message is not a valid {self.method}Request: {message.reason}")
                log.info("rpc_error", method=self.full, code="INVALID_ARGUMENT", message=status.details)
                return StreamAnswer.of_error(self.response_type, stream_error(int(status.code.value[0]), status.details))
            if isinstance(message, TooLarge):
                raise ResourceExhausted(f"the message is {message.size} bytes; at most {MAX_REQUEST_BYTES} bytes are accepted")
            return StreamAnswer.of_response(await self.behavior(request, context))
        except Exception as exc:
            error = domain_error(exc, where, getattr(request, "queue_name", ""))
        log_error(where, getattr(request, "queue_name", ""), error)
        status = to_status(error)
        return StreamAnswer.of_error(self.response_type, stream_error(int(status.code.value[0]), status.details, error))


class Sending:
    """How a stream's answers are bounded while they wait to be sent (send_room.py), and
    what gives back the items of an answer that will never be (None: nothing to give)."""

    def __init__(
        self,
        room: SendRoom,
        give_back: Callable[[Message, bool], None] | None = None,
        *,
        stream_limit: int = STREAM_UNSENT_BYTES,
        stall_s: float = STALL_SECONDS,
    ) -> None:
        self.room = room
        self.give_back = give_back
        self.stream_limit = stream_limit
        self.stall_s = stall_s
        # Told of each stream ended by the stall timeout (a metric).
        self.on_stall: Callable[[], None] | None = None

    def give_back_answer(self, answer: StreamAnswer, *, reached: bool) -> None:
        if self.give_back is not None and answer.response is not None:
            self.give_back(answer.response, reached)


class _Unsent:
    """A stream's answers that are made and not yet sent: their bytes (counted in its
    ``StreamRoom``), the stall timer of the one gRPC holds, and its end, which gives back
    the items of every answer the client will not get."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any], stream: StreamRoom, sending: Sending) -> None:
        self.context = context
        self.reader: asyncio.Task[None] | None = None  # the stream's reader, once started
        self.stream = stream
        self.sending = sending
        self.ended = False
        self.stalled = False
        # The answer handed to gRPC, which holds it until the client has read enough.
        self.held: StreamAnswer | None = None
        # Each message's task, oldest first, from its creation until its answer is held:
        # in the window, awaited by the writer, or waiting for a place in the window.
        self._making: dict[asyncio.Task[StreamAnswer], None] = {}
        self._timer: asyncio.TimerHandle | None = None
        # The task gRPC runs the call in (it sends what the stream yields).
        self.call = asyncio.current_task()
        if self.call is not None:
            # gRPC stops iterating a stream whose call is cancelled while it sends, and
            # leaves it suspended (closed only once collected): the call's end is the
            # stream's end, whatever the stream itself still runs.
            self.call.add_done_callback(lambda _call: self.end())

    def made(self, task: asyncio.Task[StreamAnswer]) -> None:
        """A message's task: its answer counts from when it is made until it is sent,
        or is settled at the stream's end."""
        self._making[task] = None

    def sending_now(self, task: asyncio.Task[StreamAnswer], answer: StreamAnswer) -> None:
        self._making.pop(task, None)
        self.held = answer
        self._timer = asyncio.get_running_loop().call_later(self.sending.stall_s, self._stall)

    def sent(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.held is not None:
            self.stream.give(len(self.held.data))
            self.held = None

    def end(self) -> None:
        """The stream is over: answers it will not send are given back; the one gRPC
        held stops counting (gone with the call). Called again, it does nothing more."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.held is not None:
            if not self.stalled:  # ended while gRPC held it: it may never arrive
                self.sending.give_back_answer(self.held, reached=True)
            self.stream.give(len(self.held.data))
            self.held = None
        if not self.ended:
            self.ended = True
            self.stream.end()
            if self.reader is not None:
                self.reader.cancel()
        self._drop_answers()

    def _drop_answers(self) -> None:
        """Made answers are given back (their items were never seen); ones still being made
        are cancelled (a Lease then leases nothing, or its cycle takes the lease back).

        Every message's task counts, wherever it is: in the window, awaited by the writer
        (a call cancelled meanwhile), or made by the reader while it waited for a place in
        the window. The stream is ended first, so a task answered before counted its
        bytes (settled here) and one answered after gives its answer back itself (``one``)."""
        assert self.stream.ended
        self.stream.head = None
        making, self._making = self._making, {}
        for task in making:
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None:
                answer = task.result()
                self.stream.give(len(answer.data))
                self.sending.give_back_answer(answer, reached=False)

    def _stall(self) -> None:
        """The client has read nothing for ``stall_s``: end the stream and give back the
        items of every answer it was not sent, the one gRPC holds included (under new
        ids: it may still arrive). That one's bytes count until the call is over."""
        self._timer = None
        self.stalled = self.ended = True
        self.stream.end()
        if self.reader is not None:
            self.reader.cancel()
        self._drop_answers()
        if self.held is not None:
            self.sending.give_back_answer(self.held, reached=True)
        stall_s = self.sending.stall_s
        message = f"the client read no answer for {stall_s:g} s; the stream is ended and its unsent items given back"
        log.warning("stream_stalled", peer=self.context.peer(), unsent_bytes=self.stream.unsent)
        if self.sending.on_stall is not None:
            self.sending.on_stall()
        context, call = self.context, self.call

        async def abort() -> None:
            with contextlib.suppress(Exception):
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, message)
            # gRPC does not resume a stream it holds an answer of once the status is
            # out; ending the call's task closes it here, and ``end`` settles the rest.
            if call is not None:
                call.cancel()

        _background(abort())


_tasks: set[asyncio.Task[None]] = set()


def _background(coro: Coroutine[Any, Any, None]) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


