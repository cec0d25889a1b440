"""querator.internal.Peer: calls a cluster's nodes make to each other, and nobody else
(each checks the calling node's proof: cluster/forwarding.py). Not part of the API;
served only with --cluster.

Dead letters handed to a replicated dead-letter queue's primary (cluster/dead_letter_route.py),
and redriven items to a replicated queue's primary (cluster/redrive_route.py).

The give-backs of LeaseStream answers never sent (cluster/give_back.py), and the
replication calls (cluster/replica_host.py): change sets shipped to a copy, a copy's
position (and fencing), a snapshot streamed to a copy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import empty_pb2
from google.protobuf.wrappers_pb2 import BytesValue

from querator.v1 import queue_pb2 as pb

from ..auth import Action
from ..cluster.dead_letter_route import DEAD_LETTERS, DeadLetterRoute
from ..cluster.give_back import SENT, SERVICE, UNSENT, GiveBacks, Local
from ..cluster.redrive_route import REDRIVE_IN, RedriveRoute
from ..cluster.replica_host import CopyHost
from ..cluster.replica_wire import SHIP, SNAPSHOT, STATUS, Ship, SnapshotHead, StatusAsk
from ..errors import InvalidArgument, PermissionDenied
from .boundary import abort, domain_error
from .handlers import generic_handler


class PeerService:
    def __init__(
        self,
        give_backs: GiveBacks,
        give_back_here: Local,
        copies: CopyHost | None = None,
        dead_letters: DeadLetterRoute | None = None,
        redrives: RedriveRoute | None = None,
    ) -> None:
        self._give_backs = give_backs
        self._here = give_back_here
        self._copies = copies
        self._dead_letters = dead_letters
        self._redrives = redrives

    async def _unsent(self, request: pb.LeaseResponse, context: grpc.aio.ServicerContext[Any, Any]) -> empty_pb2.Empty:
        return await self._give_backs.served(request, False, context, self._here)

    async def _sent(self, request: pb.LeaseResponse, context: grpc.aio.ServicerContext[Any, Any]) -> empty_pb2.Empty:
        return await self._give_backs.served(request, True, context, self._here)

    def _host(self, context: grpc.aio.ServicerContext[Any, Any]) -> CopyHost:
        if not self._give_backs.is_peer(context):
            raise PermissionDenied(f"{SERVICE} is for the cluster's nodes only")
        if self._copies is None:
            raise PermissionDenied("this node holds no replicated shards")
        return self._copies

    async def _ship(self, request: BytesValue, context: grpc.aio.ServicerContext[Any, Any]) -> BytesValue:
        host = self._host(context)
        return BytesValue(value=(await host.ship(Ship.decode(request.value))).encode())

    async def _dead(self, request: BytesValue, context: grpc.aio.ServicerContext[Any, Any]) -> BytesValue:
        return await self._hand_over(self._dead_letters, "dead letters", request, context)

    async def _redriven(self, request: BytesValue, context: grpc.aio.ServicerContext[Any, Any]) -> BytesValue:
        return await self._hand_over(self._redrives, "redriven items", request, context)

    async def _hand_over(
        self,
        route: DeadLetterRoute | RedriveRoute | None,
        what: str,
        request: BytesValue,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> BytesValue:
        """Items another node hands to a queue this node is primary of (cluster/primary_hand_over.py)."""
        if not self._give_backs.is_peer(context):
            raise PermissionDenied(f"{SERVICE} is for the cluster's nodes only")
        if route is None:
            raise PermissionDenied(f"this node takes no {what} from others")
        await route.take(request.value)
        return BytesValue()

    async def _status(self, request: BytesValue, context: grpc.aio.ServicerContext[Any, Any]) -> BytesValue:
        host = self._host(context)
        return BytesValue(value=(await host.status(StatusAsk.decode(request.value))).encode())

    async def _snapshot(
        self, requests: AsyncIterator[BytesValue], context: grpc.aio.ServicerContext[Any, Any]
    ) -> BytesValue:
        method = f"/{SERVICE}/{SNAPSHOT}"
        try:
            host = self._host(context)
            first = await anext(aiter(requests), None)
            if first is None:
                raise InvalidArgument("value", "an InstallSnapshot stream starts with its head")
            head = SnapshotHead.decode(first.value)

            async def chunks() -> AsyncIterator[bytes]:
                async for message in requests:
                    yield message.value

            state = await host.install(head, chunks())
        except Exception as exc:
            error = domain_error(exc, method, "")
        else:
            return BytesValue(value=state.encode())
        await abort(context, method, "", error)
        raise AssertionError("unreachable: abort raises")

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        # No API key is asked for: the calling node's proof is (GiveBacks.served, _host).
        methods: dict[str, Any] = {
            UNSENT: (self._unsent, pb.LeaseResponse, empty_pb2.Empty, Action.CONSUME),
            SENT: (self._sent, pb.LeaseResponse, empty_pb2.Empty, Action.CONSUME),
            SHIP: (self._ship, BytesValue, BytesValue, Action.CONSUME),
            STATUS: (self._status, BytesValue, BytesValue, Action.CONSUME),
            DEAD_LETTERS: (self._dead, BytesValue, BytesValue, Action.CONSUME),
            REDRIVE_IN: (self._redriven, BytesValue, BytesValue, Action.CONSUME),
        }
        generic = generic_handler(SERVICE, methods)
        snapshot = grpc.stream_unary_rpc_method_handler(
            self._snapshot,
            request_deserializer=BytesValue.FromString,
            response_serializer=BytesValue.SerializeToString,
        )
        return _Joined(generic, {f"/{SERVICE}/{SNAPSHOT}": snapshot})


class _Joined(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    """The unary methods' handler and the snapshot stream's, as one service."""

    def __init__(self, generic: grpc.GenericRpcHandler[Any, Any], extra: dict[str, grpc.RpcMethodHandler[Any, Any]]) -> None:
        self._generic = generic
        self._extra = extra

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        extra = self._extra.get(handler_call_details.method)
        if extra is not None:
            return extra
        return self._generic.service(handler_call_details)
