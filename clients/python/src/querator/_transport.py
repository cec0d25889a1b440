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
import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import grpc
import grpc.aio

from . import _convert as c
from ._cluster import ABANDONED, LEASE_SLICE, LEFT, ClusterMap, Route, never_sent, node_gone, not_primary, origin, tagged
from ._config import ClientConfig
from ._convert import Seconds, seconds
from ._operations import CLUSTER, KEYS, QUEUE, QUEUES, STORAGE, Call, Operation
from ._retry import RetryPolicy
from ._streams import Streams, StreamsUnsupported, from_stream_error
from .errors import InvalidRequest, QueratorError, QueueNotFound, Unauthenticated, Unavailable, from_rpc_error
from .v1 import (
    cluster_pb2,
    cluster_pb2_grpc,
    keys_pb2_grpc,
    queue_pb2,
    queue_pb2_grpc,
    queues_pb2,
    queues_pb2_grpc,
    storage_pb2_grpc,
)

T = TypeVar("T")


def _stubs(channel: Any) -> dict[str, Any]:
    return {
        QUEUE: queue_pb2_grpc.QueueServiceStub(channel),
        QUEUES: queues_pb2_grpc.QueuesServiceStub(channel),
        STORAGE: storage_pb2_grpc.StorageServiceStub(channel),
        KEYS: keys_pb2_grpc.KeysServiceStub(channel),
        CLUSTER: cluster_pb2_grpc.ClusterServiceStub(channel),
    }


#: Deadline of the calls routing makes for itself (ClusterInfo, GetQueueStats).
_ROUTING_TIMEOUT = 5.0


# The steps of a routed call (see _Transport._steps), carried out by a transport.
@dataclass(frozen=True, slots=True)
class Rpc:
    address: str
    call: Call


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Refresh:
    asked: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class Forget:
    """The node at ``address`` went away: what stays open to it is not reused."""

    address: str


Step: TypeAlias = "Rpc | Sleep | Refresh | Forget"


def _not_ready(config: ClientConfig, timeout: Seconds) -> Unavailable:
    return Unavailable(f"could not connect to {config.address} within {timeout}s", code=grpc.StatusCode.UNAVAILABLE)


class _Transport:
    """What both transports share: the settings, the retry decision and the routing.

    A call is carried out as the steps of :meth:`_steps` (sans-IO): the transports only
    make the RPCs, sleeps and map refreshes those steps name.
    """

    def __init__(
        self, config: ClientConfig, *, retry_policy: RetryPolicy | None = None, options: Sequence[tuple[str, Any]] | None = None
    ) -> None:
        self.config = config
        self.retry_policy = retry_policy or RetryPolicy.of(config)
        self._options = list(config.options() if options is None else options)
        self.cluster = ClusterMap(config.cluster_refresh.total_seconds())

    def _call_options(self) -> dict[str, Any]:
        return {"metadata": tuple(self.config.call_metadata()), "wait_for_ready": self.config.wait_for_ready or None}

    def _next_delay(self, call: Call, attempt: int, error: QueratorError) -> float:
        """The wait before retry ``attempt`` of ``call``; raises ``error`` when there is none."""
        delay = self.retry_policy.delay(attempt, error) if call.retry else None
        if delay is None:
            raise error
        return delay

    # -- routing (sans-IO) ------------------------------------------------------------------

    def _prepare(self, call: Call) -> Generator[Step, Any, None]:
        """The map refreshes (and counts) ``call`` needs before it can be routed. Against a
        single server: one ClusterInfo on the first call, then nothing."""
        now = time.monotonic()
        if self.cluster.needs_info(now):
            yield Refresh(None)
        if not self.cluster.clustered or call.service not in (QUEUE, STORAGE):
            return
        queue: str = getattr(call.request, "queue_name", "")
        if self.cluster.needs_lookup(queue, now):
            yield Refresh((queue,))
        if call.service == QUEUE and call.method in ("Produce", "Lease") and self.cluster.stats_due(queue, now) and self.cluster.spread(queue, now) > 1:
            self.cluster.stats_asked(queue, now)
            request = queues_pb2.GetQueueStatsRequest(queue_name=queue)
            try:
                stats = yield Rpc("", Call(QUEUES, "GetQueueStats", request, _ROUTING_TIMEOUT, False))
            except QueratorError:
                return  # the counts stay as they were; asked again after a second
            self.cluster.apply_stats(queue, ((p.partition, p.total - p.total_leased) for p in stats.partitions))

    def _steps(self, call: Call, error: QueratorError | None = None, route: Route | None = None) -> Generator[Step, Any, Any]:
        """The steps of ``call``: refresh the map as needed, send it where the map says,
        retry as the policy allows. ``error``/``route``: its first attempt, made elsewhere
        (:meth:`SyncTransport.start`), failed so. A node gone costs one immediate retry
        on another node when the call may be repeated (or never left this process)."""
        attempt = 0
        failed_over = False
        lease_end = self._lease_end(call)
        while True:
            if error is not None:
                assert route is not None
                gone = self._node_failed(route, error)
                if gone:
                    yield Forget(route.address or self.config.address)
                # Refused by a node that is not the primary: nothing was done, so once
                # at once to the primary the map (read again) names, whatever the call.
                moved = not gone and isinstance(error, Unavailable) and not_primary(error)
                if (gone or moved) and not failed_over and (call.retry or never_sent(error) or moved):
                    failed_over = True
                else:
                    attempt += 1
                    yield Sleep(self._next_delay(call, attempt, error))
                error = None
            yield from self._prepare(call)
            route = self.cluster.route(call, time.monotonic())
            sent = self._slice(call, route, lease_end)
            try:
                reply = yield Rpc(route.address, sent)
            except QueratorError as failure:
                error = failure
                continue
            self._answered(route, call, reply)
            if sent is not call and not len(reply.columns.ids) and lease_end - time.monotonic() > 0.05:
                call = _only_lease(call)  # an empty slice: the next one asks another node
                continue
            return reply

    @staticmethod
    def _lease_end(call: Call) -> float:
        if call.method != "Lease" or call.service != QUEUE:
            return 0.0
        request: Any = call.request
        return time.monotonic() + c.seconds(c.from_duration(request.request_timeout))

    def _slice(self, call: Call, route: Route, lease_end: float) -> Call:
        """A Lease that may wait long, on one of several nodes homing the queue, waits
        at most LEASE_SLICE there: an empty answer moves the next slice to another node,
        so the consumer does not idle while another node has ready items."""
        if route.kind != "lease" or self.cluster.spread(route.queue, time.monotonic()) < 2:
            return call
        remaining = lease_end - time.monotonic()
        if remaining <= LEASE_SLICE:
            return call
        original: Any = call.request
        request = queue_pb2.LeaseRequest()
        request.CopyFrom(original)
        request.request_timeout.CopyFrom(c.to_duration(LEASE_SLICE))
        margin = call.timeout - remaining
        return Call(call.service, call.method, request, LEASE_SLICE + max(margin, 1.0), call.retry, call.item_call, call.key_call)

    def _node_failed(self, route: Route, error: QueratorError) -> bool:
        """After ``error`` from ``route``: whether its node is gone (then it is skipped and
        the map is read again before the next call)."""
        if not self.cluster.clustered or origin(error) == ABANDONED:
            return False  # ABANDONED: a stream this process closed, not the node's doing
        if isinstance(error, QueueNotFound) or (isinstance(error, InvalidRequest) and "partition" in error.message):
            self.cluster.refreshed_at = -1e18  # the map may be stale: read it before the next call
            return False
        if isinstance(error, Unavailable) and not_primary(error):
            self.cluster.refreshed_at = -1e18  # the primary moved (or is moving): read the map again
            return False
        if isinstance(error, Unavailable) and not node_gone(error) and route.kind in ("produce", "lease"):
            self.cluster.mark_queue_down(route.queue, route.node, time.monotonic())
            return False
        if not isinstance(error, Unavailable) or not node_gone(error):
            return False
        node = route.node or self.cluster.node_at(route.address or self.config.address)
        if node:
            self.cluster.mark_down(node, time.monotonic(), error.message)
        self.cluster.refreshed_at = -1e18
        return True

    def _answered(self, route: Route, call: Call, reply: Any) -> None:
        if not route.node:
            return
        self.cluster.mark_up(route.node)
        if route.kind == "lease":
            self.cluster.leased(route.queue, route.node, len(reply.columns.ids))
        elif route.kind == "produce":
            self.cluster.produced(route.queue, route.node, len(reply.ids))

    def _info_addresses(self) -> list[str]:
        """Where ClusterInfo is asked: known live members first, then the bootstraps."""
        out = self.cluster.live_addresses(time.monotonic())
        return out + [a for a in self.config.addresses if a not in out]

    def _info_answered(self, asked: tuple[str, ...] | None, answer: Any, error: QueratorError | None) -> list[str]:
        """Take a ClusterInfo answer (or its failure); returns channels to close."""
        if error is not None:
            if _answered_no(error):
                # A server without ClusterService (UNIMPLEMENTED), or one that will not
                # tell this caller (its key): calls go to the address given, as to a
                # single server, and are not slowed by asking again.
                if self.cluster.clustered is None:
                    self.cluster.single()
            elif self.cluster.clustered is None:
                self.cluster.info_failed_at = time.monotonic()
            return []
        return self.cluster.apply(answer, asked, time.monotonic())

    def _stale(self, refresh: Refresh) -> bool:
        """Whether the refresh a caller waited for is still needed (single flight: a
        caller that waited behind another's refresh uses its answer)."""
        now = time.monotonic()
        if refresh.asked is None:
            return self.cluster.needs_info(now)
        return self.cluster.needs_lookup(refresh.asked[0], now)

    @staticmethod
    def _info_call(refresh: Refresh) -> Call:
        request = cluster_pb2.ClusterInfoRequest(queue_names=list(refresh.asked or ()))
        return Call(CLUSTER, "ClusterInfo", request, _ROUTING_TIMEOUT, False)


def _answered_no(error: QueratorError) -> bool:
    """Whether a ClusterInfo failure is the node's answer (asking the next node would
    get the same), not a node that could not be reached in time."""
    return error.code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _only_lease(call: Call) -> Call:
    """A Lease without the completions it carried (done by the slice that answered)."""
    original: Any = call.request
    if not original.complete_ids:
        return call
    request = queue_pb2.LeaseRequest()
    request.CopyFrom(original)
    del request.complete_ids[:]
    request.complete_partition = 0
    return Call(call.service, call.method, request, call.timeout, True)


class SyncTransport(_Transport):
    """Blocking calls over a ``grpc`` channel per node; safe to share between threads."""

    def __init__(
        self, config: ClientConfig, *, retry_policy: RetryPolicy | None = None, options: Sequence[tuple[str, Any]] | None = None
    ) -> None:
        super().__init__(config, retry_policy=retry_policy, options=options)
        self.channel = self._open(config.address)
        self._nodes: dict[str, tuple[grpc.Channel, dict[str, Any]]] = {}
        self._stubs = _stubs(self.channel)
        self._closed = False
        self._refreshing = threading.Lock()

    def _open(self, address: str) -> grpc.Channel:
        creds = self.config.credentials()
        if creds is None:
            return grpc.insecure_channel(address, options=self._options)
        return grpc.secure_channel(address, creds, options=self._options)

    def _stubs_at(self, address: str) -> dict[str, Any]:
        if not address or address == self.config.address:
            return self._stubs
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes.setdefault(address, (channel := self._open(address), _stubs(channel)))
        return node[1]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.channel.close()
            for channel, _ in self._nodes.values():
                channel.close()

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
                try:
                    reply = self.invoke(call)
                except QueratorError as exc:  # the operation may note what it did, then re-raise
                    call = op.throw(exc)
                else:
                    call = op.send(reply)
        except StopIteration as done:
            result: T = done.value
            return result

    def invoke(self, call: Call) -> Any:
        """The reply to ``call``, routed, retried as the policy allows."""
        return self._drive(self._steps(call))

    def start(self, call: Call) -> grpc.Future[Any]:
        """Send ``call`` without waiting (many in flight on one thread); :meth:`finish` waits."""
        self._drive(self._prepare(call))
        route = self.cluster.route(call, time.monotonic())
        rpc = getattr(self._stubs_at(route.address)[call.service], call.method)
        future: grpc.Future[Any] = rpc.future(call.request, timeout=call.timeout, **self._call_options())
        future._querator_route = route  # type: ignore[attr-defined]  # read back by error()
        return future

    def finish(self, call: Call, future: grpc.Future[Any]) -> Any:
        """The reply of a :meth:`start`; a failure is retried as the policy allows."""
        try:
            reply = future.result()
        except grpc.RpcError as exc:
            error = self.error(call, exc)
            return self._drive(self._steps(call, error, getattr(future, "_querator_route", Route())))
        self._answered(getattr(future, "_querator_route", Route()), call, reply)
        return reply

    def error(self, call: Call, exc: grpc.RpcError) -> QueratorError:
        """The SDK's error for a failed :meth:`start`; a node gone is marked so."""
        error = from_rpc_error(exc, item_call=call.item_call, key_call=call.key_call)
        error.__cause__ = exc
        route = getattr(exc, "_querator_route", None)
        if route is not None:
            self._node_failed(route, error)
        return error

    def resume(self, call: Call, error: QueratorError | None) -> Any:
        """The reply to ``call``, whose last attempt (to the default node) failed with
        ``error`` (None: none made yet)."""
        return self._drive(self._steps(call, error, Route()))

    def _drive(self, steps: Generator[Step, Any, T]) -> T:
        reply: Any = None
        failure: QueratorError | None = None
        while True:
            try:
                step = steps.send(reply) if failure is None else steps.throw(failure)
            except StopIteration as done:
                result: T = done.value
                return result
            reply, failure = None, None
            if isinstance(step, Sleep):
                time.sleep(step.seconds)
            elif isinstance(step, Refresh):
                self._refresh(step)
            elif isinstance(step, Forget):
                pass  # a grpc channel reconnects by itself; nothing else stays open to a node
            else:
                try:
                    reply = self._call(step)
                except QueratorError as error:
                    failure = error

    def _call(self, step: Rpc) -> Any:
        if self._closed:
            raise RuntimeError("the client is closed")
        call = step.call
        rpc = getattr(self._stubs_at(step.address)[call.service], call.method)
        try:
            return rpc(call.request, timeout=call.timeout, **self._call_options())
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, item_call=call.item_call, key_call=call.key_call)
            raise error from exc

    def _refresh(self, refresh: Refresh) -> None:
        with self._refreshing:
            if not self._stale(refresh):
                return
            call = self._info_call(refresh)
            addresses = self._info_addresses()
            for address in addresses:
                try:
                    answer = self._call(Rpc(address, call))
                except QueratorError as error:
                    if _answered_no(error) or address == addresses[-1]:
                        self._close_gone(self._info_answered(refresh.asked, None, error))
                        return
                    continue
                self._close_gone(self._info_answered(refresh.asked, answer, None))
                return

    def _close_gone(self, addresses: list[str]) -> None:
        for address in addresses:
            node = self._nodes.pop(address, None)
            if node is not None:
                node[0].close()


# Produce and Lease go over the queue's stream (see _streams.py) when streams are on.
_STREAMED = {"Produce": queue_pb2.ProduceStreamRequest, "Lease": queue_pb2.LeaseStreamRequest}


class AsyncTransport(_Transport):
    """Awaited calls over a ``grpc.aio`` channel per node, opened on first use in the running loop."""

    def __init__(self, config: ClientConfig, *, retry_policy: RetryPolicy | None = None) -> None:
        super().__init__(config, retry_policy=retry_policy)
        self.channel: grpc.aio.Channel | None = None
        self._closed = False
        self._stubs: dict[str, Any] = {}
        self._nodes: dict[str, tuple[grpc.aio.Channel, dict[str, Any]]] = {}
        self.streams = Streams()
        self._refreshing: asyncio.Lock | None = None

    def _open(self, address: str) -> grpc.aio.Channel:
        creds = self.config.credentials()
        if creds is None:
            return grpc.aio.insecure_channel(address, options=self._options)
        return grpc.aio.secure_channel(address, creds, options=self._options)

    def stub(self, service: str, address: str = "") -> Any:
        return self._node(address)[1][service]

    def _node(self, address: str) -> tuple[grpc.aio.Channel, dict[str, Any]]:
        """The channel to ``address`` ("": the default one) and its stubs."""
        if self._closed:
            raise RuntimeError("the client is closed")
        if self.channel is None:
            self.channel = self._open(self.config.address)
            self._stubs = _stubs(self.channel)
        if not address or address == self.config.address:
            return self.channel, self._stubs
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes.setdefault(address, (channel := self._open(address), _stubs(channel)))
        return node

    async def close(self) -> None:
        self._closed = True
        await self.streams.close()
        channel, self.channel = self.channel, None
        if channel is not None:
            await channel.close(None)
        nodes, self._nodes = self._nodes, {}
        for node_channel, _ in nodes.values():
            await node_channel.close(None)

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
                try:
                    reply = await self.invoke(call)
                except QueratorError as exc:  # the operation may note what it did, then re-raise
                    call = op.throw(exc)
                else:
                    call = op.send(reply)
        except StopIteration as done:
            result: T = done.value
            return result

    async def invoke(self, call: Call) -> Any:
        """The reply to ``call``, routed, retried as the policy allows."""
        steps = self._steps(call)
        reply: Any = None
        failure: QueratorError | None = None
        while True:
            try:
                step = steps.send(reply) if failure is None else steps.throw(failure)
            except StopIteration as done:
                return done.value
            reply, failure = None, None
            if isinstance(step, Sleep):
                await asyncio.sleep(step.seconds)
            elif isinstance(step, Refresh):
                await self._refresh(step)
            elif isinstance(step, Forget):
                self.streams.retire(step.address)
            else:
                try:
                    reply = await self._once(step.call, step.address)
                except QueratorError as error:
                    failure = error

    async def _once(self, call: Call, address: str = "") -> Any:
        channel, stubs = self._node(address)
        stub = stubs[call.service]
        wrap = _STREAMED.get(call.method) if call.service == QUEUE else None
        if wrap is None or not self.config.streams or self.streams.unsupported:
            try:
                return await getattr(stub, call.method)(call.request, timeout=call.timeout, **self._call_options())
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc, item_call=call.item_call, key_call=call.key_call) from exc
        # One stream per (node, kind, queue): in a cluster each request goes to the node
        # routing chose, as a unary call would.
        open_call = getattr(stub, f"{call.method}Stream")
        request: Any = call.request
        stream = self.streams.get(
            address or self.config.address,
            call.method,
            request.queue_name,
            lambda: open_call(**self._call_options()),
            lambda: channel.get_state() is grpc.ChannelConnectivity.READY,
        )
        try:
            answer = await stream.ask(wrap(request=request), call.timeout)
        except StreamsUnsupported:
            self.streams.unsupported = True
            return await self._once(call, address)
        if answer.WhichOneof("result") == "response":
            return answer.response
        error = from_stream_error(answer.error, item_call=call.item_call)
        if isinstance(error, Unauthenticated):
            stream.reopen()  # the next request opens it with fresh credentials
        raise error

    async def _refresh(self, refresh: Refresh) -> None:
        if self._refreshing is None:
            self._refreshing = asyncio.Lock()
        async with self._refreshing:
            if not self._stale(refresh):
                return
            call = self._info_call(refresh)
            addresses = self._info_addresses()
            for address in addresses:
                try:
                    answer = await self._once(call, address)
                except QueratorError as error:
                    if _answered_no(error) or address == addresses[-1]:
                        await self._close_gone(self._info_answered(refresh.asked, None, error))
                        return
                    continue
                await self._close_gone(self._info_answered(refresh.asked, answer, None))
                return

    async def _close_gone(self, addresses: list[str]) -> None:
        for address in addresses:
            left = Unavailable(f"the node at {address} left the cluster", code=grpc.StatusCode.UNAVAILABLE)
            await self.streams.close(address, tagged(left, LEFT))
            node = self._nodes.pop(address, None)
            if node is not None:
                await node[0].close(None)
