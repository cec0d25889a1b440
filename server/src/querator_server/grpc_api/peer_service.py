"""querator.internal.Peer: calls a cluster's nodes make to each other, and nobody else
(each checks the calling node's proof: cluster/forwarding.py). Not part of the API;
served only with --cluster."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import empty_pb2

from querator.v1 import queue_pb2 as pb

from ..auth import Action
from ..cluster.give_back import SENT, SERVICE, UNSENT, GiveBacks, Local
from .handlers import generic_handler


class PeerService:
    def __init__(self, give_backs: GiveBacks, give_back_here: Local) -> None:
        self._give_backs = give_backs
        self._here = give_back_here

    async def _unsent(self, request: pb.LeaseResponse, context: grpc.aio.ServicerContext[Any, Any]) -> empty_pb2.Empty:
        return await self._give_backs.served(request, False, context, self._here)

    async def _sent(self, request: pb.LeaseResponse, context: grpc.aio.ServicerContext[Any, Any]) -> empty_pb2.Empty:
        return await self._give_backs.served(request, True, context, self._here)

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        # No API key is asked for: the calling node's proof is (GiveBacks.served).
        methods: dict[str, Any] = {
            UNSENT: (self._unsent, pb.LeaseResponse, empty_pb2.Empty, Action.CONSUME),
            SENT: (self._sent, pb.LeaseResponse, empty_pb2.Empty, Action.CONSUME),
        }
        return generic_handler(SERVICE, methods)
