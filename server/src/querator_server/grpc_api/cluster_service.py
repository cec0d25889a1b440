"""querator.v1.ClusterService: the cluster's members and where partitions live."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from querator.v1 import cluster_pb2 as pb

from ..auth import Action
from ..errors import FailedPrecondition
from ..manager import QueuesManager
from . import convert as c
from .authz import Guard, current_principal
from .handlers import generic_handler

if TYPE_CHECKING:
    from ..cluster import Coordinator

SERVICE = "querator.v1.ClusterService"


class ClusterService:
    def __init__(
        self,
        manager: QueuesManager,
        address: Callable[[], str],
        guard: Guard | None = None,
        cluster: Coordinator | None = None,
    ) -> None:
        self.manager = manager
        self.address = address  # a single server's own address, once it listens
        self.guard = guard
        self.cluster = cluster

    def _names(self, request: pb.ClusterInfoRequest, every: list[str]) -> list[str]:
        principal = current_principal.get()
        wanted = [c.queue_name(n, f"queue_names[{i}]") for i, n in enumerate(request.queue_names)]
        names = sorted(set(wanted) & set(every)) if wanted else sorted(every)
        return [n for n in names if principal is None or principal.matches(n)]

    async def cluster_info(self, request: pb.ClusterInfoRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.ClusterInfoResponse:
        cluster = self.cluster
        if cluster is None:
            configs = {q.config.name: q.config.partitions for q in self.manager.queues()}
            return pb.ClusterInfoResponse(
                clustered=False,
                node_id="",
                members=[pb.ClusterMember(node_id="", address=self.address(), live=True)],
                queues=[
                    pb.QueuePlacement(queue_name=n, homes=[""] * configs[n], key_partitions=configs[n]) for n in self._names(request, list(configs))
                ],
                admin_writable=True,
            )
        catalog = cluster.catalog
        nodes = {h.node for e in catalog.queues.values() for h in e.homes} | set(catalog.members)
        nodes -= catalog.retired
        standing = await cluster.check_members() if request.check_members else {}
        members = [
            pb.ClusterMember(
                node_id=n,
                address=catalog.members[n].address if n in catalog.members else "",
                live=n in catalog.members,
                fenced=cluster.membership.fenced if n == cluster.node else n in standing and standing[n].fenced,
                check_error=standing[n].error if n in standing else "",
            )
            for n in sorted(nodes)
        ]
        return pb.ClusterInfoResponse(
            clustered=True,
            node_id=cluster.node,
            revision=catalog.revision,
            members=members,
            queues=[
                pb.QueuePlacement(
                    queue_name=n,
                    homes=[h.node for h in catalog.queues[n].homes],
                    key_partitions=catalog.queues[n].key_partitions,
                )
                for n in self._names(request, list(catalog.queues))
            ],
            admin_writable=not cluster.membership.fenced,
        )

    async def retire(
        self, request: pb.RetireNodeDiscardingDataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RetireNodeDiscardingDataResponse:
        if self.cluster is None:
            raise FailedPrecondition("this server is not part of a cluster")
        moved = await self.cluster.retire(request.node_id)
        return pb.RetireNodeDiscardingDataResponse(partitions_recreated=moved)

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return generic_handler(
            SERVICE,
            {
                "ClusterInfo": (self.cluster_info, pb.ClusterInfoRequest, pb.ClusterInfoResponse, Action.LIST),
                "RetireNodeDiscardingData": (
                    self.retire,
                    pb.RetireNodeDiscardingDataRequest,
                    pb.RetireNodeDiscardingDataResponse,
                    Action.KEYS,
                ),
            },
            guard=self.guard,
        )
