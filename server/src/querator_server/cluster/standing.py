"""Whether the other nodes are fenced, for an operator's view of the cluster.

Only a node itself knows whether it still holds its membership (a fenced node cannot
write that to etcd), and it says so in its health: ``querator.v1.ClusterService`` is
NOT_SERVING while it is fenced. So the answering node asks each live member's health,
all at once, each with a short deadline: a paused member costs that deadline, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..errors import QueratorError
from .forwarding import Peers

CLUSTER_SERVICE = "querator.v1.ClusterService"
CHECK_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Standing:
    fenced: bool
    error: str = ""  # why the node could not be asked; empty when it answered


async def check_members(peers: Peers, nodes: Iterable[str], timeout: float = CHECK_TIMEOUT_S) -> dict[str, Standing]:
    async def one(node: str) -> Standing:
        request = health_pb2.HealthCheckRequest(service=CLUSTER_SERVICE)
        try:
            reply = await health_pb2_grpc.HealthStub(peers.channel(node)).Check(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return Standing(False, f"{exc.code().name}: {exc.details()}")
        except QueratorError as exc:  # it left the membership meanwhile
            return Standing(False, exc.message)
        return Standing(reply.status != health_pb2.HealthCheckResponse.SERVING)

    asked = list(nodes)
    return dict(zip(asked, await asyncio.gather(*(one(n) for n in asked)), strict=True))
