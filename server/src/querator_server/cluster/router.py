"""Data calls in a cluster, carried out as the routing policy (policy.py) says: served
here when this node homes the partition, else forwarded one hop (forwarding.py) to
the node that does, or split over several homes (lease keys) or all of them.

Partition numbers on the wire are the queue's cluster-wide numbers; each node keeps
its partitions of a queue as a local queue with its own indexes (placement.py), so a
call served here is translated on the way in and out.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from querator.v1 import queue_pb2 as pb
from querator.v1 import queues_pb2 as qpb
from querator.v1 import storage_pb2 as spb

from ..errors import NoHealthyPartition, NotFound, QueratorError, Unavailable, holds_items
from ..model import DEFAULT_WAIT_US, MAX_WAIT_US, check_lease_keys
from .catalog import CatalogCache
from .forwarding import NODE_GONE_HELP, Peers, PeerTls, Unreachable
from .give_back import GiveBacks
from .placement import QueueEntry
from .policy import Part, Where, where
from .redrive_walk import RedriveWalk, check_target, walk

# A Lease that finds nothing anywhere waits on one node for at most this long before it
# looks at the others again, so items produced elsewhere reach a waiting consumer.
_LEASE_SLICE_S = 1.0
# As queue_service's answer margin: a waiting Lease answers this long before the deadline.
_ANSWER_MARGIN_S = 0.5

M = TypeVar("M", bound=Message)


Local = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]


class Router:
    def __init__(
        self,
        node: str,
        catalog: CatalogCache,
        lookup: Callable[[str], Awaitable[QueueEntry]],
        tls: PeerTls | None = None,
        vouch: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.node = node
        self._catalog = catalog
        self._lookup = lookup
        self.peers = Peers(node, lambda: catalog.members, tls)
        self.give_backs = GiveBacks(node, lookup, self.peers)
        self._forward = self.peers.forward
        # Called after a call was served here, before it is answered: raises (or ends the
        # process) when this node's id may now be another process's (membership.verify).
        self._vouch = vouch
        self._turn = itertools.count()
        # The Complete behavior of this node (set by route()): a Lease whose lease goes
        # elsewhere completes its complete_ids homed here with it first.
        self._complete_here: Local | None = None

    @property
    def forwarded(self) -> int:
        return self.peers.forwarded

    async def close(self) -> None:
        await self.peers.close()

    # -- where things are (policy.py decides; this carries it out) ---------------------

    def live(self, node: str) -> bool:
        return node in self._catalog.members

    def where(self, entry: QueueEntry, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Where:
        return where(entry, self.node, self._catalog.members, method, request, self.is_forwarded(context))

    def _global(self, entry: QueueEntry, local: int) -> int:
        for partition, home in enumerate(entry.homes):
            if home.node == self.node and home.index == local:
                return partition
        raise Unavailable(f"queue {entry.config.name!r}: local partition {local} has no home here")

    def _in_turn(self, nodes: tuple[str, ...]) -> list[str]:
        """``nodes`` other than this one, starting at the next in turn, so that callers
        of one node do not all ask the same other node first."""
        others = [n for n in nodes if n != self.node]
        if others:
            turn = next(self._turn) % len(others)
            others = others[turn:] + others[:turn]
        return others

    def is_forwarded(self, context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        return self.peers.is_forwarded(context)

    # -- Produce ---------------------------------------------------------------------

    async def produce(
        self, request: pb.ProduceRequest, context: grpc.aio.ServicerContext[Any, Any], local: Local
    ) -> pb.ProduceResponse:
        entry = await self._lookup(request.queue_name)
        route = self.where(entry, "Produce", request, context)
        if route.parts:  # forwarded here, or keyed: dedup lives at the key's one home
            targets = [route.parts[0].node]
        else:  # a home that fails is skipped for the next one (ADR 19: try another partition)
            targets = ([self.node] if route.spread[0] == self.node else []) + self._in_turn(route.spread)
        if targets[0] == self.node:
            try:
                response: pb.ProduceResponse = await local(request, context)
            except NoHealthyPartition:
                # Every partition of the queue here is faulty: the other homes' serve
                # (ADR 19). Not for a keyed or forwarded produce: those belong here.
                targets = targets[1:]
                if not targets:
                    raise
            else:
                response.partition = self._global(entry, response.partition)
                return response
        for node in targets[:-1]:
            try:
                return await self._forward(node, "/querator.v1.QueueService/Produce", request, pb.ProduceResponse, context)
            except Unreachable:  # never sent: another home cannot store it twice
                continue
        return await self._forward(targets[-1], "/querator.v1.QueueService/Produce", request, pb.ProduceResponse, context)

    # -- Lease -----------------------------------------------------------------------

    async def lease(
        self, request: pb.LeaseRequest, context: grpc.aio.ServicerContext[Any, Any], local: Local
    ) -> pb.LeaseResponse:
        entry = await self._lookup(request.queue_name)
        route = self.where(entry, "Lease", request, context)
        if request.complete_ids:
            if route.complete_at:  # complete at the items' home first, then lease without them
                done = pb.CompleteRequest(
                    queue_name=request.queue_name, partition=request.complete_partition, ids=request.complete_ids
                )
                if route.complete_at == self.node:
                    done.partition = entry.home_of(done.partition).index
                    assert self._complete_here is not None
                    await self._complete_here(done, context)
                else:
                    await self._forward(
                        route.complete_at, "/querator.v1.QueueService/Complete", done, pb.CompleteResponse, context
                    )
                del request.complete_ids[:]
                request.complete_partition = 0
            else:  # completed by the lease here
                request.complete_partition = entry.home_of(request.complete_partition).index
        if route.parts:
            node = route.parts[0].node
            if node == self.node:
                return await self._lease_here(entry, request, context, local)
            return await self._forward(node, "/querator.v1.QueueService/Lease", request, pb.LeaseResponse, context)
        return await self._lease_anywhere(entry, route.spread, request, context, local)

    async def _lease_here(
        self, entry: QueueEntry, request: pb.LeaseRequest, context: grpc.aio.ServicerContext[Any, Any], local: Local
    ) -> pb.LeaseResponse:
        response: pb.LeaseResponse = await local(request, context)
        if response.items or response.HasField("columns") and response.columns.ids:
            response.partition = self._global(entry, response.partition)
        else:
            response.partition = 0
        return response

    async def _lease_anywhere(
        self,
        entry: QueueEntry,
        spread: tuple[str, ...],
        request: pb.LeaseRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        local: Local,
    ) -> pb.LeaseResponse:
        """Items from this node's partitions when it has some ready; else from another
        home's; else wait, a slice at a time, looking at every home between slices.
        A queue deleted while the Lease waits answers it at once, empty, as a single
        node does (not NOT_FOUND from the slice after the delete)."""
        try:
            return await self._look_and_wait(entry, spread, request, context, local)
        except NotFound:
            current = self._catalog.queues.get(entry.config.name)
            if current is not None and current.generation == entry.generation:
                raise  # the queue is still there: the NOT_FOUND was about something else
            return pb.LeaseResponse(queue_name=entry.config.name)

    async def _look_and_wait(
        self,
        entry: QueueEntry,
        spread: tuple[str, ...],
        request: pb.LeaseRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        local: Local,
    ) -> pb.LeaseResponse:
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        if request.HasField("request_timeout"):
            wait_s = request.request_timeout.seconds + request.request_timeout.nanos / 1e9
        else:
            wait_s = min(remaining, MAX_WAIT_US / 1e6) if remaining is not None else DEFAULT_WAIT_US / 1e6
        if remaining is not None:  # answer (empty) before the caller's deadline, as a single node does
            wait_s = min(wait_s, remaining - min(_ANSWER_MARGIN_S, remaining / 5))
        give_up = loop.time() + max(0.0, wait_s)
        here = spread[0] == self.node
        # This node's storage failing (a full disk): the other homes still serve, and the
        # call answers that failure rather than "empty" if none of them has items.
        failing: Unavailable | None = None
        # The request is this call's own (deserialized for it), so each look changes it
        # in place: no copy of it, complete_ids and all, per look on the hot path.
        while True:
            request.request_timeout.FromSeconds(0)
            if here:
                try:
                    response = await self._lease_here(entry, request, context, local)
                    failing = None
                except Unavailable as exc:
                    if request.complete_ids:
                        raise  # its completions were not applied: the caller must know
                    failing = exc
                else:
                    if _has_items(response):
                        return response
                if request.complete_ids:
                    del request.complete_ids[:]  # completed by the first look
            others = self._in_turn(spread)
            for node in others:
                try:
                    response = await self._forward(node, "/querator.v1.QueueService/Lease", request, pb.LeaseResponse, context)
                except Unavailable:
                    continue  # a home that died meanwhile: its partitions are skipped
                if _has_items(response):
                    return response
            left = give_up - loop.time()
            if left <= 0.05 or (failing is not None and not others):
                return _nothing_leased(entry, failing)
            request.request_timeout.FromNanoseconds(int(min(left, _LEASE_SLICE_S) * 1e9))
            if here and failing is None:
                response = await self._lease_here(entry, request, context, local)
            elif others:
                try:
                    response = await self._forward(
                        others[0], "/querator.v1.QueueService/Lease", request, pb.LeaseResponse, context
                    )
                except Unavailable:
                    await asyncio.sleep(min(left, _LEASE_SLICE_S))
                    continue
            else:
                raise Unavailable(f"queue {entry.config.name!r}: no live node homes any of its partitions")
            if _has_items(response):
                return response
            if give_up - loop.time() <= 0.05:
                # The wait took the time left: answered now, not after another look at
                # every home, which on a loaded machine (load 15-17, two calls' worth of
                # round trips) ran past a 1 s call's deadline.
                return _nothing_leased(entry, failing)

    # -- Complete, Retry, Extend: at the item's home --------------------------------

    async def to_home(
        self,
        method: str,
        request: Any,
        response_type: type[M],
        context: grpc.aio.ServicerContext[Any, Any],
        local: Local,
    ) -> M:
        """A call about one partition (Complete, Retry, Extend, the storage calls), at
        that partition's home. Lease keys go to each key's home (policy.py): the homes
        of keys alone first, side by side, then the ids' home with the ids and its own
        keys, only once the others are done (queue.proto, CompleteRequest.lease_keys)."""
        entry = await self._lookup(request.queue_name)
        if getattr(request, "lease_keys", None):
            check_lease_keys(request.lease_keys)  # whole, before any home applies a part
        route = self.where(entry, method.rsplit("/", 1)[1], request, context)
        last = route.parts[-1]
        others = route.parts[:-1] if last.ids else route.parts
        answers = await asyncio.gather(
            *(self._part(entry, method, request, response_type, context, local, part) for part in others),
            return_exceptions=True,
        )
        failed = [(part, a) for part, a in zip(others, answers, strict=True) if isinstance(a, BaseException)]
        if failed:
            done = [p for p in others if all(p is not f for f, _ in failed)]
            raise _partial(failed, done, last if last.ids else None)
        response = response_type()
        if last.ids:
            response = await self._part(entry, method, request, response_type, context, local, last)
        for counted in ("key_items_extended", "key_items_completed"):
            if hasattr(response, counted):
                setattr(response, counted, getattr(response, counted) + sum(getattr(a, counted) for a in answers))
        return response

    async def _part(
        self,
        entry: QueueEntry,
        method: str,
        request: Any,
        response_type: type[M],
        context: grpc.aio.ServicerContext[Any, Any],
        local: Local,
        part: Part,
    ) -> M:
        if hasattr(request, "lease_keys") and list(request.lease_keys) != list(part.keys):
            sent = type(request)()
            sent.CopyFrom(request)
            del sent.lease_keys[:]
            sent.lease_keys.extend(part.keys)
            if not part.ids:
                del sent.ids[:]
                sent.partition = 0
            request = sent
        if part.node != self.node:
            return await self._forward(part.node, method, request, response_type, context)
        if part.ids:
            request.partition = entry.home_of(request.partition).index
        return await local(request, context)  # type: ignore[no-any-return]

    async def everywhere(
        self, method: str, request: Any, response_type: type[M], context: grpc.aio.ServicerContext[Any, Any], local: Local
    ) -> M:
        """A call for the whole queue (ClearQueue): on every node that homes part of it."""
        entry = await self._lookup(request.queue_name)
        route = self.where(entry, method.rsplit("/", 1)[1], request, context)
        if route.parts:  # forwarded: this node's part
            return await local(request, context)  # type: ignore[no-any-return]
        down = []
        response = response_type()
        for node in route.every:
            if node == self.node:
                response = await local(request, context)
            elif self.live(node):
                response = await self._forward(node, method, request, response_type, context)
            else:
                down.append(node)
        if down:
            raise Unavailable(f"done on the live nodes; not on {', '.join(down)} (down): call again once they are back")
        return response

    async def delete(
        self, request: qpb.DeleteQueueRequest, context: grpc.aio.ServicerContext[Any, Any], local: Local, stats: Local
    ) -> qpb.DeleteQueueResponse:
        if not request.force:
            found, away = await self._stats_of_homes(qpb.GetQueueStatsRequest(queue_name=request.queue_name), context, stats)
            if away:
                raise Unavailable(
                    f"queue {request.queue_name!r}: part of it is on {', '.join(away)}, down or not answering; "
                    "cannot tell it is empty"
                )
            # What the homes' stats show of what a single node's actor counts as holding
            # items (LogicalQueue.holds_items): ready, leased, waiting in a group (total),
            # scheduled, or a faulty partition whose contents are unknown.
            if any(p.total or p.scheduled or p.faulty for p in found.partitions):
                raise holds_items(request.queue_name)
        return await local(request, context)  # type: ignore[no-any-return]

    async def redrive(
        self,
        request: spb.RedriveItemsRequest,
        limit: int,
        token: bytes | None,
        context: grpc.aio.ServicerContext[Any, Any],
        local: Local,
    ) -> tuple[spb.RedriveItemsResponse, bytes | None]:
        """RedriveItems on every node homing the queue (cluster/redrive_walk.py); ``token``:
        the payload of the caller's page token. Answers the response and the payload of
        its next page token (None: done). A forwarded call is the local part alone."""
        entry = await self._lookup(request.queue_name)
        forwarded = self.is_forwarded(context)
        if request.target_queue:
            target = await self._lookup(request.target_queue)
            check_target(entry, target, [self.node] if forwarded else entry.nodes())
        if forwarded:
            return await local(request, context), None
        start = None if token is None else RedriveWalk.decode(token, entry)

        async def step(node: str, part: spb.RedriveItemsRequest) -> spb.RedriveItemsResponse:
            if node == self.node:
                return await local(part, context)  # type: ignore[no-any-return]
            # A node that does not answer a health check (paused, say) is passed over as
            # one that is down; one that stops answering mid-call: answer what the others
            # moved before the caller's deadline, rather than nothing after it.
            remaining = context.time_remaining()
            timeout = None if remaining is None else remaining - min(_ANSWER_MARGIN_S, remaining / 5)
            return await self._forward(
                node, "/querator.v1.StorageService/RedriveItems", part, spb.RedriveItemsResponse, context, timeout, probe=True
            )

        response, rest = await walk(entry, request, limit, start, lambda n: n == self.node or self.live(n), step, Unreachable)
        return response, None if rest is None else rest.encode()

    def route(self, service: str, methods: dict[str, Any]) -> dict[str, Any]:
        """``methods`` (name -> (behavior, request type, response type, action), as for
        handlers.generic_handler) with the data behaviors routed through this node."""
        out = dict(methods)

        def wrap(name: str, route: Callable[..., Awaitable[Any]]) -> None:
            behavior, request_type, response_type, action = methods[name]

            async def here(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                answer = await behavior(request, context)
                if self._vouch is not None:  # nothing answered here once another process holds this node's id
                    await self._vouch()
                return answer

            async def routed(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                return await route(request, context, here)

            out[name] = (routed, request_type, response_type, action)

        def home(name: str) -> None:
            path = f"/{service}/{name}"
            response_type = methods[name][2]
            wrap(name, lambda r, c, local: self.to_home(path, r, response_type, c, local))

        if "Complete" in methods:
            self._complete_here = methods["Complete"][0]
        for name in methods:
            if name == "Produce":
                wrap(name, self.produce)
            elif name == "Lease":
                wrap(name, self.lease)
            elif name in ("Complete", "Retry", "Extend", "ListItems", "ListScheduledItems", "ImportItems", "DeleteItems"):
                home(name)
            elif name == "GetQueueStats":
                wrap(name, self.stats)
        if "ClearQueue" in methods:
            path, cleared = f"/{service}/ClearQueue", methods["ClearQueue"][2]
            wrap("ClearQueue", lambda r, c, local: self.everywhere(path, r, cleared, c, local))
        if "DeleteQueue" in methods:
            stats = methods["GetQueueStats"][0]
            wrap("DeleteQueue", lambda r, c, local: self.delete(r, c, local, stats))
        return out

    # -- stats -------------------------------------------------------------------------

    async def stats(
        self, request: qpb.GetQueueStatsRequest, context: grpc.aio.ServicerContext[Any, Any], local: Local
    ) -> qpb.GetQueueStatsResponse:
        """Every home's partitions, in cluster numbers; those of a home that is down or
        does not answer are listed as faulty, with counts of 0, so a queue whose items sit
        on a node that is away never reads as empty."""
        return (await self._stats_of_homes(request, context, local))[0]

    async def _stats_of_homes(
        self, request: qpb.GetQueueStatsRequest, context: grpc.aio.ServicerContext[Any, Any], local: Local
    ) -> tuple[qpb.GetQueueStatsResponse, list[str]]:
        """The merged stats, and the homes that could not say."""
        entry = await self._lookup(request.queue_name)
        route = self.where(entry, "GetQueueStats", request, context)
        if route.parts:  # forwarded: this node's part
            return await self._stats_here(entry, request, context, local), []
        out = qpb.GetQueueStatsResponse(queue_name=entry.config.name)
        away: list[str] = []
        for node in route.every:
            part: qpb.GetQueueStatsResponse | None = None
            if node == self.node:
                part = await self._stats_here(entry, request, context, local)
            elif self.live(node):
                try:
                    part = await self._forward(
                        node, "/querator.v1.QueuesService/GetQueueStats", request, qpb.GetQueueStatsResponse, context
                    )
                except Unavailable:
                    pass
            if part is None:
                away.append(node)
                failure = (
                    f"its home, node {node!r}, is down or did not answer: its counts are unknown until it is back "
                    f"({NODE_GONE_HELP})"
                )
                out.partitions.extend(
                    qpb.PartitionStats(partition=partition, faulty=True, failure=failure)
                    for partition in entry.local_partitions(node).values()
                )
                continue
            out.partitions.extend(part.partitions)
            out.lease_waiting += part.lease_waiting
            out.produce_waiting += part.produce_waiting
            out.in_flight += part.in_flight
        out.partitions.sort(key=lambda s: s.partition)
        return out, away

    async def _stats_here(
        self, entry: QueueEntry, request: qpb.GetQueueStatsRequest, context: grpc.aio.ServicerContext[Any, Any], local: Local
    ) -> qpb.GetQueueStatsResponse:
        response: qpb.GetQueueStatsResponse = await local(request, context)
        homed = entry.local_partitions(self.node)
        kept = [s for s in response.partitions if s.partition in homed]
        for s in kept:
            s.partition = homed[s.partition]
        del response.partitions[:]
        response.partitions.extend(kept)
        return response


def _partial(failed: list[tuple[Part, BaseException]], done: list[Part], ids: Part | None) -> BaseException:
    """The first failure of a call split over several homes, its text naming what was
    done and what was not, with the failure's own status."""
    part, error = failed[0]
    if not isinstance(error, QueratorError):
        return error
    not_done = [f"lease_keys {list(p.keys)} on node {p.node!r}" for p, _ in failed]
    if ids is not None:
        not_done.append(f"the ids (and lease_keys {list(ids.keys)}) on node {ids.node!r}")
    text = f"{error.message}; not done: {'; '.join(not_done)}"
    if done:
        text += f"; done: {'; '.join(f'lease_keys {list(p.keys)} on node {p.node!r}' for p in done)}"
    text += "; sending the same request again is safe (a key already done is no error)"
    out: QueratorError = copy.copy(error)
    out.message = text
    out.args = (text,)
    return out


def _nothing_leased(entry: QueueEntry, failing: Unavailable | None) -> pb.LeaseResponse:
    """A Lease's answer once its time is up with no items: this node's storage failure
    (a full disk) when it had one, rather than "empty"; else empty."""
    if failing is not None:
        raise failing
    return pb.LeaseResponse(queue_name=entry.config.name)


def _has_items(response: pb.LeaseResponse) -> bool:
    return bool(response.items) or (response.HasField("columns") and bool(response.columns.ids))
