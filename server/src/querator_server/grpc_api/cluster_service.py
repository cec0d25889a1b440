"""querator.v1.ClusterService: the cluster's members and where partitions live."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from querator.v1 import cluster_pb2 as pb

from ..auth import Action
from ..errors import FailedPrecondition, InvalidArgument, QueratorError, Unavailable
from ..manager import QueuesManager
from . import convert as c
from .authz import Guard, current_principal
from .handlers import generic_handler

if TYPE_CHECKING:
    from ..cluster import Coordinator
    from ..cluster.catalog import CatalogCache
    from ..cluster.placement import QueueEntry

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
        nodes |= {n for record in catalog.shards.records() for n in record.replicas}
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
        queues = [_placement(catalog, catalog.queues[n]) for n in self._names(request, list(catalog.queues))]
        if request.check_members:
            await self._failover_blocked(cluster, queues)
        return pb.ClusterInfoResponse(
            clustered=True,
            node_id=cluster.node,
            revision=catalog.revision,
            members=members,
            queues=queues,
            admin_writable=not cluster.membership.fenced,
        )

    @staticmethod
    async def _failover_blocked(cluster: Coordinator, queues: list[pb.QueuePlacement]) -> None:
        """Fill failover_blocked of each replicated queue whose primary is not live."""
        down = [q for q in queues if q.primary and q.primary not in cluster.catalog.members]
        records = [cluster.catalog.shards.get(cluster.catalog.queues[q.queue_name].shard) for q in down]
        reasons = await asyncio.gather(*(cluster.failover_blocked(r) for r in records if r is not None))
        for placement, why in zip([q for q, r in zip(down, records, strict=True) if r is not None], reasons, strict=True):
            placement.failover_blocked = why

    async def retire(
        self, request: pb.RetireNodeDiscardingDataRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RetireNodeDiscardingDataResponse:
        if self.cluster is None:
            raise FailedPrecondition("this server is not part of a cluster")
        moved, remade, promoted = await self.cluster.retire(request.node_id, request.promote_copies_behind)
        return pb.RetireNodeDiscardingDataResponse(
            partitions_recreated=moved,
            copies_recreated=remade,
            copies_promoted=[
                pb.PromotedCopy(queue_name=p.queue, node_id=p.node, epoch=p.epoch, lsn=p.lsn, new_epoch=p.new_epoch)
                for p in promoted
            ],
        )

    # -- replicated queues: hand-overs -------------------------------------------------

    async def move_queue(
        self, request: pb.MoveQueueRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.MoveQueueResponse:
        if self.cluster is None:
            raise FailedPrecondition("this server is not part of a cluster: a queue has one copy")
        name = c.queue_name(request.queue_name)
        await self.cluster.move(name, request.node_id, request.from_node_id, _catch_up_within(context))
        catalog = self.cluster.catalog
        return pb.MoveQueueResponse(placement=_placement(catalog, catalog.queues[name]))

    async def drain_node(
        self, request: pb.DrainNodeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DrainNodeResponse:
        if self.cluster is None:
            raise FailedPrecondition("this server is not part of a cluster")
        moved, kept = await self.cluster.drain(request.node_id, copies=True, within=_catch_up_within(context))
        return pb.DrainNodeResponse(moved=moved, kept=kept)

    # -- queues set aside (manager.set_aside) -------------------------------------------

    def _set_aside_here(self) -> list[pb.SetAsideQueue]:
        node = self.cluster.node if self.cluster is not None else ""
        return [
            pb.SetAsideQueue(
                node_id=node,
                set_aside_id=a.aside_id,
                queue_name=a.config.name,
                items=a.items,
                reason=a.reason,
                set_aside_at=c.to_timestamp(a.at_us),
                partitions=a.config.partitions,
            )
            for a in self.manager.set_aside_queues()
        ]

    def _target(self, node: str, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """The node a set-aside call is for: "" for this one."""
        cluster = self.cluster
        if cluster is None or not node or node == cluster.node or cluster.router.is_forwarded(context):
            if node and (cluster is None or node != cluster.node):
                raise FailedPrecondition(f"this server is not node {node!r}")
            return ""
        if node not in cluster.catalog.members:
            raise Unavailable(f"node {node!r} is not live; its set-aside queues can be seen only while it is")
        return node

    async def list_set_aside(
        self, request: pb.ListSetAsideQueuesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListSetAsideQueuesResponse:
        cluster = self.cluster
        target = self._target(request.node_id, context)
        if target and cluster is not None:
            return await cluster.router.peers.forward(
                target, f"/{SERVICE}/ListSetAsideQueues", request, pb.ListSetAsideQueuesResponse, context
            )
        if cluster is None or request.node_id or cluster.router.is_forwarded(context):
            return pb.ListSetAsideQueuesResponse(queues=self._set_aside_here())
        queues = self._set_aside_here()
        unanswered: list[str] = []
        others = sorted(n for n in cluster.catalog.members if n != cluster.node)

        async def ask(node: str) -> pb.ListSetAsideQueuesResponse:
            one = pb.ListSetAsideQueuesRequest(node_id=node)
            return await cluster.router.peers.forward(
                node, f"/{SERVICE}/ListSetAsideQueues", one, pb.ListSetAsideQueuesResponse, context, timeout=10.0
            )

        for node, answer in zip(others, await asyncio.gather(*(ask(n) for n in others), return_exceptions=True), strict=True):
            if isinstance(answer, pb.ListSetAsideQueuesResponse):
                queues.extend(answer.queues)
            elif isinstance(answer, QueratorError):
                unanswered.append(node)
            else:
                raise answer
        queues.sort(key=lambda q: (q.node_id, q.queue_name, q.set_aside_id))
        return pb.ListSetAsideQueuesResponse(queues=queues, unanswered_nodes=unanswered)

    async def remove_set_aside(
        self, request: pb.RemoveSetAsideQueueRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RemoveSetAsideQueueResponse:
        if not request.set_aside_id:
            raise InvalidArgument("set_aside_id", "is required (ListSetAsideQueues gives it)")
        target = self._target(request.node_id, context)
        if target and self.cluster is not None:
            return await self.cluster.router.peers.forward(
                target, f"/{SERVICE}/RemoveSetAsideQueue", request, pb.RemoveSetAsideQueueResponse, context
            )
        before = {q.set_aside_id: q for q in self._set_aside_here()}
        await self.manager.remove_set_aside(request.set_aside_id)
        return pb.RemoveSetAsideQueueResponse(removed=before[request.set_aside_id])

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
                "MoveQueue": (self.move_queue, pb.MoveQueueRequest, pb.MoveQueueResponse, Action.KEYS),
                "DrainNode": (self.drain_node, pb.DrainNodeRequest, pb.DrainNodeResponse, Action.KEYS),
                "ListSetAsideQueues": (
                    self.list_set_aside, pb.ListSetAsideQueuesRequest, pb.ListSetAsideQueuesResponse, Action.KEYS
                ),
                "RemoveSetAsideQueue": (
                    self.remove_set_aside, pb.RemoveSetAsideQueueRequest, pb.RemoveSetAsideQueueResponse, Action.KEYS
                ),
            },
            guard=self.guard,
        )


def _placement(catalog: CatalogCache, entry: QueueEntry) -> pb.QueuePlacement:
    """Where a queue's partitions are served; a replicated queue's from its shard
    record: each partition at the primary, and the copies, in-sync set and epoch."""
    routed = catalog.routed(entry)
    placement = pb.QueuePlacement(
        queue_name=entry.config.name, homes=[h.node for h in routed.homes], key_partitions=entry.key_partitions
    )
    record = catalog.shards.get(entry.shard) if entry.shard else None
    if record is not None:
        placement.replicas.extend(record.replicas)
        placement.in_sync.extend(record.in_sync())
        placement.epoch = record.epoch
        placement.primary = record.primary
        placement.min_in_sync = record.min_isr
        if record.move is not None:
            placement.moving_from = record.move.source
            placement.moving_to = record.move.target
    return placement


def _catch_up_within(context: grpc.aio.ServicerContext[Any, Any]) -> float:
    """How long a move may wait for a new copy's catch-up: the caller's deadline less a
    margin for the answer, at most CATCH_UP_S."""
    # Imported here: the cluster package needs the cluster extra, a single server does not.
    from ..cluster.copy_moves import CATCH_UP_S

    remaining = context.time_remaining()
    if remaining is None:
        return CATCH_UP_S
    return max(0.0, min(CATCH_UP_S, remaining - 1.0))
