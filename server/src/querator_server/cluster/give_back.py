"""Giving back, at their home, the items of LeaseStream answers a node will never send.

A LeaseStream ended with answers still unsent (its client stopped reading, or went
away) gives their items back to ready at once (actor GiveBackRequest), rather than
leaving them leased until their lease runs out. In a cluster an answer's items may
live on another node: the stream's node sends the give-back there, as a call between
peers (``querator.internal.Peer``, not part of the API: only a node with the cluster's
proof may make it). Best effort: a give-back that fails leaves the items to their
lease timeout, as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import empty_pb2

from querator.v1 import queue_pb2 as pb

from ..errors import InvalidArgument, PermissionDenied, Unavailable
from .forwarding import Peers
from .placement import Home, QueueEntry

SERVICE = "querator.internal.Peer"
# The answer was being sent when its stream ended (its ids may have reached the client:
# the items get new ids), or was never handed to the transport (they keep theirs).
SENT = "GiveBackSent"
UNSENT = "GiveBackUnsent"
_TIMEOUT_S = 10.0

# The give-back on this node: (queue, local partition, ids, lease deadline, reached) -> items given.
Local = Callable[[str, int, list[str], int, bool], Awaitable[int]]


class GiveBacks:
    def __init__(self, node: str, lookup: Callable[[str], Awaitable[QueueEntry]], peers: Peers) -> None:
        self.node = node
        self._lookup = lookup
        self._peers = peers

    async def give_back(self, queue: str, partition: int, ids: list[str], deadline: int, reached: bool, local: Local) -> None:
        """Give back ``ids``, leased until ``deadline`` (µs) from ``partition`` (in
        cluster numbers) of ``queue``, at their home: here, or by a call to the node
        homing them."""
        home = _home(await self._lookup(queue), partition)
        if home.node == self.node:
            await local(queue, home.index, ids, deadline, reached)
            return
        request = pb.LeaseResponse(queue_name=queue, partition=partition)
        request.columns.ids.extend(ids)
        request.columns.lease_deadlines_us.append(deadline)
        method = f"/{SERVICE}/{SENT if reached else UNSENT}"
        await self._peers.forward(home.node, method, request, empty_pb2.Empty, None, _TIMEOUT_S)

    def is_peer(self, context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        """Whether the call comes from another node of the cluster (its proof holds)."""
        return self._peers.is_forwarded(context)

    async def served(
        self, request: pb.LeaseResponse, reached: bool, context: grpc.aio.ServicerContext[Any, Any], local: Local
    ) -> empty_pb2.Empty:
        """Another node's give-back, at the items' home."""
        if not self._peers.is_forwarded(context):
            raise PermissionDenied(f"{SERVICE} is for the cluster's nodes only")
        if not request.columns.lease_deadlines_us:
            raise InvalidArgument("columns.lease_deadlines_us", "must hold the lease's deadline")
        home = _home(await self._lookup(request.queue_name), request.partition)
        if home.node != self.node:
            raise Unavailable(f"partition {request.partition} is not homed on node {self.node!r}")
        ids, deadline = list(request.columns.ids), request.columns.lease_deadlines_us[0]
        await local(request.queue_name, home.index, ids, deadline, reached)
        return empty_pb2.Empty()


def _home(entry: QueueEntry, partition: int) -> Home:
    if not 0 <= partition < len(entry.homes):
        raise InvalidArgument("partition", f"must be between 0 and {len(entry.homes) - 1}, got {partition}")
    return entry.homes[partition]
