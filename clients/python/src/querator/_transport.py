"""The I/O of the clients: a channel, its stubs, and calls made under the retry policy.

:class:`SyncTransport` (blocking; :class:`~querator.Client`, the Producer, the Spark
connector) and :class:`AsyncTransport` (``grpc.aio``; :class:`~querator.AsyncClient`,
the AsyncProducer and the workers) carry out the :class:`~querator._operations.Call`
objects the operations yield. They are the clients' internal interface: a Producer or
Worker reaches the I/O of its client only through ``client._transport`` and the
methods here (``run``, ``invoke``, ``start``/``finish``, ``retry_policy``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from ._config import ClientConfig
from ._convert import Seconds, seconds
from ._operations import KEYS, QUEUE, QUEUES, STORAGE, Call, Operation
from ._retry import RetryPolicy
from ._streams import Streams, StreamsUnsupported, from_stream_error
from .errors import QueratorError, Unauthenticated, Unavailable, from_rpc_error
from .v1 import keys_pb2_grpc, queue_pb2, queue_pb2_grpc, queues_pb2_grpc, storage_pb2_grpc

T = TypeVar("T")


def _stubs(channel: Any) -> dict[str, Any]:
    return {
        QUEUE: queue_pb2_grpc.QueueServiceStub(channel),
        QUEUES: queues_pb2_grpc.QueuesServiceStub(channel),
        STORAGE: storage_pb2_grpc.StorageServiceStub(channel),
        KEYS: keys_pb2_grpc.KeysServiceStub(channel),
    }


def _not_ready(config: ClientConfig, timeout: Seconds) -> Unavailable:
    return Unavailable(f"could not connect to {config.address} within {timeout}s", code=grpc.StatusCode.UNAVAILABLE)


class _Transport:
    """What both transports share: the settings and the retry decision."""

    def __init__(
        self, config: ClientConfig, *, retry_policy: RetryPolicy | None = None, options: Sequence[tuple[str, Any]] | None = None
    ) -> None:
        self.config = config
        self.retry_policy = retry_policy or RetryPolicy.of(config)
        self._options = list(config.options() if options is None else options)

    def _call_options(self) -> dict[str, Any]:
        return {"metadata": tuple(self.config.call_metadata()), "wait_for_ready": self.config.wait_for_ready or None}

    def _next_delay(self, call: Call, attempt: int, error: QueratorError) -> float:
        """The wait before retry ``attempt`` of ``call``; raises ``error`` when there is none."""
        delay = self.retry_policy.delay(attempt, error) if call.retry else None
        if delay is None:
            raise error
        return delay


class SyncTransport(_Transport):
    """Blocking calls over one ``grpc`` channel; safe to share between threads."""

    def __init__(
        self, config: ClientConfig, *, retry_policy: RetryPolicy | None = None, options: Sequence[tuple[str, Any]] | None = None
    ) -> None:
        super().__init__(config, retry_policy=retry_policy, options=options)
        creds = config.credentials()
        if creds is None:
            self.channel = grpc.insecure_channel(config.address, options=self._options)
        else:
            self.channel = grpc.secure_channel(config.address, creds, options=self._options)
        self._stubs = _stubs(self.channel)
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.channel.close()

    def wait_ready(self, timeout: Seconds) -> None:
        if self._closed:
            raise RuntimeError("the client is closed")
        try:
            grpc.channel_ready_future(self.channel).result(timeout=seconds(timeout))
        except grpc.FutureTimeoutError:
            raise _not_ready(self.config, timeout) from None

    def run(self, op: Operation[T]) -> T:
        """Carry out an operation: each call it yields, in turn, then its result."""
        try:
            call = next(op)
            while True:
                call = op.send(self.invoke(call))
        except StopIteration as done:
            result: T = done.value
            return result

    def invoke(self, call: Call) -> Any:
        """The reply to ``call``, retried as the policy allows."""
        return self.resume(call, None)

    def start(self, call: Call) -> grpc.Future[Any]:
        """Send ``call`` without waiting (many in flight on one thread); :meth:`finish` waits."""
        rpc = getattr(self._stubs[call.service], call.method)
        future: grpc.Future[Any] = rpc.future(call.request, timeout=call.timeout, **self._call_options())
        return future

    def finish(self, call: Call, future: grpc.Future[Any]) -> Any:
        """The reply of a :meth:`start`; a failure is retried as the policy allows."""
        try:
            return future.result()
        except grpc.RpcError as exc:
            return self.resume(call, self.error(call, exc))

    @staticmethod
    def error(call: Call, exc: grpc.RpcError) -> QueratorError:
        return from_rpc_error(exc, item_call=call.item_call, key_call=call.key_call)

    def resume(self, call: Call, error: QueratorError | None) -> Any:
        """The reply to ``call``, whose last attempt failed with ``error`` (None: none made yet)."""
        attempt = 0
        while True:
            if error is not None:
                attempt += 1
                time.sleep(self._next_delay(call, attempt, error))
            rpc = getattr(self._stubs[call.service], call.method)
            try:
                return rpc(call.request, timeout=call.timeout, **self._call_options())
            except grpc.RpcError as exc:
                error = self.error(call, exc)
                error.__cause__ = exc


# Produce and Lease go over the queue's stream (see _streams.py) when streams are on.
_STREAMED = {"Produce": queue_pb2.ProduceStreamRequest, "Lease": queue_pb2.LeaseStreamRequest}


class AsyncTransport(_Transport):
    """Awaited calls over one ``grpc.aio`` channel, opened on first use in the running loop."""

    def __init__(self, config: ClientConfig, *, retry_policy: RetryPolicy | None = None) -> None:
        super().__init__(config, retry_policy=retry_policy)
        self.channel: grpc.aio.Channel | None = None
        self._closed = False
        self._stubs: dict[str, Any] = {}
        self.streams = Streams()

    def stub(self, service: str) -> Any:
        if self._closed:
            raise RuntimeError("the client is closed")
        if self.channel is None:
            creds = self.config.credentials()
            if creds is None:
                self.channel = grpc.aio.insecure_channel(self.config.address, options=self._options)
            else:
                self.channel = grpc.aio.secure_channel(self.config.address, creds, options=self._options)
            self._stubs = _stubs(self.channel)
        return self._stubs[service]

    async def close(self) -> None:
        self._closed = True
        await self.streams.close()
        channel, self.channel = self.channel, None
        if channel is not None:
            await channel.close(None)

    async def wait_ready(self, timeout: Seconds) -> None:
        self.stub(QUEUE)
        assert self.channel is not None
        try:
            await asyncio.wait_for(self.channel.channel_ready(), seconds(timeout))
        except TimeoutError:
            raise _not_ready(self.config, timeout) from None

    async def run(self, op: Operation[T]) -> T:
        """Carry out an operation: each call it yields, in turn, then its result."""
        try:
            call = next(op)
            while True:
                call = op.send(await self.invoke(call))
        except StopIteration as done:
            result: T = done.value
            return result

    async def invoke(self, call: Call) -> Any:
        """The reply to ``call``, retried as the policy allows."""
        attempt = 0
        while True:
            try:
                return await self._once(call)
            except QueratorError as error:
                attempt += 1
                delay = self._next_delay(call, attempt, error)
            await asyncio.sleep(delay)

    async def _once(self, call: Call) -> Any:
        stub = self.stub(call.service)
        wrap = _STREAMED.get(call.method) if call.service == QUEUE else None
        if wrap is None or not self.config.streams or self.streams.unsupported:
            try:
                return await getattr(stub, call.method)(call.request, timeout=call.timeout, **self._call_options())
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc, item_call=call.item_call, key_call=call.key_call) from exc
        open_call = getattr(stub, f"{call.method}Stream")
        request: Any = call.request
        stream = self.streams.get(call.method, request.queue_name, lambda: open_call(**self._call_options()))
        try:
            answer = await stream.ask(wrap(request=request), call.timeout)
        except StreamsUnsupported:
            self.streams.unsupported = True
            return await self._once(call)
        if answer.WhichOneof("result") == "response":
            return answer.response
        error = from_stream_error(answer.error, item_call=call.item_call)
        if isinstance(error, Unauthenticated):
            stream.reopen()  # the next request opens it with fresh credentials
        raise error
