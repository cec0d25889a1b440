"""querator.v1.QueuesService: create, get, list, update, delete, clear, stats, pause, resume."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from querator.v1 import queues_pb2 as pb

from .. import actor as a
from ..auth import Action
from ..clock import now_us
from ..errors import InvalidArgument
from ..manager import QueuesManager
from ..model import (
    DEFAULT_DEDUP_WINDOW_US,
    DEFAULT_EXPIRE_TIMEOUT_US,
    DEFAULT_LEASE_KEY_TTL_US,
    DEFAULT_LEASE_TIMEOUT_US,
    MAX_ATTEMPTS_LIMIT,
    MAX_LEASE_TIMEOUT_US,
    MAX_LONG_DURATION_US,
    MAX_PARTITIONS,
    MAX_REFERENCE_BYTES,
    MAX_REPLICAS,
    REPLY_ITEMS_BYTES,
    QueueConfig,
)
from ..queue_admin import QueueAdmin, check_settings
from . import convert as c
from .authz import Guard, visible_queues
from .before_routing import checked_before_routing
from .handlers import generic_handler

if TYPE_CHECKING:
    from ..cluster import Coordinator

SERVICE = "querator.v1.QueuesService"

_UPDATABLE = {
    "dead_queue",
    "reference",
    "lease_timeout",
    "expire_timeout",
    "max_attempts",
    "requested_partitions",
    "dedup_window",
    "lease_key_ttl",
    "replicas",
    "min_in_sync",
}
_IMMUTABLE = {"queue_name", "created_at", "updated_at", "state", "failure"}
# Changed by PauseQueue and ResumeQueue only.
_PAUSE_FIELDS = {"paused", "produce_paused"}


def queue_info(config: QueueConfig, visible: Callable[[str], bool] | None = None, failure: str = "") -> pb.QueueInfo:
    """The queue's settings (and whether it is served: ``failure`` says why not); its
    dead_queue left empty when ``visible`` says the caller may not see that queue (its
    key's patterns do not match it)."""
    dead = config.dead_queue
    return pb.QueueInfo(
        state=pb.QUEUE_STATE_FAILED if failure else pb.QUEUE_STATE_SERVING,
        failure=failure,
        queue_name=config.name,
        dead_queue=dead if visible is None or not dead or visible(dead) else "",
        reference=config.reference,
        lease_timeout=c.to_duration(config.lease_timeout_us),
        expire_timeout=c.to_duration(config.expire_timeout_us),
        max_attempts=config.max_attempts,
        requested_partitions=config.partitions,
        created_at=c.to_timestamp(config.created_at_us),
        updated_at=c.to_timestamp(config.updated_at_us),
        dedup_window=c.to_duration(config.dedup_window_us),
        lease_key_ttl=c.to_duration(config.lease_key_ttl_us),
        # 0 for one copy: answers about such a queue are as before the field.
        replicas=config.replicas if config.replicas > 1 else 0,
        min_in_sync=config.min_in_sync if config.replicas > 1 else 0,
        paused=config.paused,
        produce_paused=config.produce_paused,
    )


def _settings(info: pb.QueueInfo, fields: set[str]) -> dict[str, object]:
    """The validated values of ``fields`` from ``info`` as QueueConfig keyword arguments."""
    out: dict[str, object] = {}
    if "dead_queue" in fields:
        out["dead_queue"] = c.queue_name(info.dead_queue, "queue.dead_queue") if info.dead_queue else ""
    if "reference" in fields:
        out["reference"] = c.text(info.reference, "queue.reference", MAX_REFERENCE_BYTES)
    if "lease_timeout" in fields:
        value = c.optional_duration_us(info, "lease_timeout", "queue.lease_timeout", maximum_us=MAX_LEASE_TIMEOUT_US)
        out["lease_timeout_us"] = value or DEFAULT_LEASE_TIMEOUT_US
    if "expire_timeout" in fields:
        value = c.optional_duration_us(info, "expire_timeout", "queue.expire_timeout", maximum_us=MAX_LONG_DURATION_US)
        out["expire_timeout_us"] = value or DEFAULT_EXPIRE_TIMEOUT_US
    if "max_attempts" in fields:
        if not 0 <= info.max_attempts <= MAX_ATTEMPTS_LIMIT:
            raise InvalidArgument(
                "queue.max_attempts", f"must be between 0 and {MAX_ATTEMPTS_LIMIT}, got {info.max_attempts}"
            )
        out["max_attempts"] = info.max_attempts
    if "requested_partitions" in fields:
        parts = info.requested_partitions
        if parts < 0 or parts > MAX_PARTITIONS:
            raise InvalidArgument(
                "queue.requested_partitions", f"must be between 1 and {MAX_PARTITIONS}, got {parts}"
            )
        out["partitions"] = parts or 1
    if "replicas" in fields:
        if not 0 <= info.replicas <= MAX_REPLICAS:
            raise InvalidArgument("queue.replicas", f"must be between 1 and {MAX_REPLICAS} (0: the server's default), got {info.replicas}")
        out["replicas"] = info.replicas
    if "min_in_sync" in fields:
        if info.min_in_sync < 0:
            raise InvalidArgument("queue.min_in_sync", f"must be at least 1 (0: the default), got {info.min_in_sync}")
        out["min_in_sync"] = info.min_in_sync
    if "dedup_window" in fields:
        value = c.optional_duration_us(info, "dedup_window", "queue.dedup_window", maximum_us=MAX_LONG_DURATION_US)
        out["dedup_window_us"] = value or DEFAULT_DEDUP_WINDOW_US
    if "lease_key_ttl" in fields:
        value = c.optional_duration_us(info, "lease_key_ttl", "queue.lease_key_ttl", maximum_us=MAX_LONG_DURATION_US)
        out["lease_key_ttl_us"] = value or DEFAULT_LEASE_KEY_TTL_US
    return out


def _single_copy(replicas: int, min_in_sync: int) -> None:
    """A single server keeps one copy of a queue: replicas 0 or 1, no min_in_sync."""
    if replicas > 1:
        raise InvalidArgument("queue.replicas", f"keeps copies on other nodes: a single server takes 0 or 1, got {replicas}")
    if min_in_sync:
        raise InvalidArgument("queue.min_in_sync", "applies to a replicated queue of a cluster: leave it 0")


class QueuesService:
    def __init__(self, manager: QueuesManager, guard: Guard | None = None, cluster: Coordinator | None = None) -> None:
        self.manager = manager
        self.guard = guard
        # Where queues are created, read and changed: the cluster catalog in cluster mode.
        self.cluster = cluster
        self.admin: QueueAdmin = manager if cluster is None else cluster

    async def create_queue(
        self, request: pb.CreateQueueRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CreateQueueResponse:
        if not request.HasField("queue"):
            raise InvalidArgument("queue", "is required")
        info = request.queue
        name = c.queue_name(info.queue_name, "queue.queue_name")
        config = QueueConfig(name=name, replicas=0).replace(**_settings(info, _UPDATABLE))
        lease_given = info.HasField("lease_timeout") and (info.lease_timeout.seconds or info.lease_timeout.nanos)
        if not lease_given and config.lease_timeout_us > config.expire_timeout_us:
            # A short-lived queue without a lease timeout of its own: the default lease
            # (1 min) shrinks to the item lifetime rather than refusing the queue.
            config = config.replace(lease_timeout_us=config.expire_timeout_us)
        if self.cluster is None:
            _single_copy(config.replicas, config.min_in_sync)
            config = config.replace(replicas=1)
        check_settings(config)
        visible = visible_queues()
        created = await self.admin.create(config, visible)
        return pb.CreateQueueResponse(queue=queue_info(created, visible))

    async def get_queue(self, request: pb.GetQueueRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.GetQueueResponse:
        name = c.queue_name(request.queue_name)
        config = self.admin.get(name)
        return pb.GetQueueResponse(queue=queue_info(config, visible_queues(), self.manager.failure(name)))

    async def list_queues(
        self, request: pb.ListQueuesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListQueuesResponse:
        limit = c.page_size(request.page_size)
        after = ""
        if request.page_token:
            try:
                after = c.decode_token(self.manager.token_secret, request.page_token, b"Q").decode()
            except UnicodeDecodeError:
                raise InvalidArgument("page_token", "is not a page token this server issued") from None
        visible = visible_queues()
        configs, more = self.admin.list(after, limit, visible)
        # Cut before the queue that would take the reply past what a client receives.
        failure = self.manager.failure
        infos: list[pb.QueueInfo] = []
        size = 0
        for config in configs:
            info = queue_info(config, visible, failure(config.name))
            size += info.ByteSize() + 8  # with its tag and length in the reply
            if size > REPLY_ITEMS_BYTES and infos:
                more = True
                break
            infos.append(info)
        token = c.encode_token(self.manager.token_secret, b"Q", infos[-1].queue_name.encode()) if more and infos else ""
        return pb.ListQueuesResponse(queues=infos, next_page_token=token)

    async def update_queue(
        self, request: pb.UpdateQueueRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.UpdateQueueResponse:
        if not request.HasField("queue"):
            raise InvalidArgument("queue", "is required")
        name = c.queue_name(request.queue.queue_name, "queue.queue_name")
        paths = [p.removeprefix("queue.") for p in request.update_mask.paths]
        if not paths:
            raise InvalidArgument("update_mask", "must name at least one field to change")
        for index, path in enumerate(paths):
            if path in _IMMUTABLE:
                raise InvalidArgument(f"update_mask.paths[{index}]", f"{path} cannot be changed")
            if path in _PAUSE_FIELDS:
                raise InvalidArgument(f"update_mask.paths[{index}]", f"{path} is changed by PauseQueue and ResumeQueue")
            if path not in _UPDATABLE:
                raise InvalidArgument(
                    f"update_mask.paths[{index}]",
                    f"unknown field {path[:100]!r}; one of {', '.join(sorted(_UPDATABLE))}",
                )
        changes = _settings(request.queue, set(paths))
        for field in ("replicas", "min_in_sync"):
            if changes.get(field) == 0:  # the default: as it is
                del changes[field]
        if self.cluster is None:
            info = request.queue
            _single_copy(info.replicas if "replicas" in paths else 1, info.min_in_sync if "min_in_sync" in paths else 0)
            changes.pop("replicas", None)
        visible = visible_queues()
        updated = await self.admin.update(name, changes, visible)
        return pb.UpdateQueueResponse(queue=queue_info(updated, visible))

    async def delete_queue(
        self, request: pb.DeleteQueueRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteQueueResponse:
        await self.admin.delete(c.queue_name(request.queue_name), request.force, visible_queues())
        return pb.DeleteQueueResponse()

    async def clear_queue(
        self, request: pb.ClearQueueRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClearQueueResponse:
        name = c.queue_name(request.queue_name)
        if not request.queue and not request.scheduled:
            raise InvalidArgument("queue", "set queue, scheduled or both to say which items to clear")
        await self.manager.actor(name).submit(
            a.ClearRequest(ready=request.queue, scheduled=request.scheduled, destructive=request.destructive)
        )
        return pb.ClearQueueResponse()

    async def get_queue_stats(
        self, request: pb.GetQueueStatsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetQueueStatsResponse:
        name = c.queue_name(request.queue_name)
        stats = self.manager.actor(name).stats()
        now = now_us()
        return pb.GetQueueStatsResponse(
            queue_name=name,
            partitions=[
                pb.PartitionStats(
                    partition=s.partition,
                    total=s.total,
                    total_leased=s.total_leased,
                    scheduled=s.scheduled,
                    average_age=c.to_duration(s.average_age_us),
                    average_leased_age=c.to_duration(s.average_leased_age_us),
                    faulty=bool(s.failure),
                    failure=s.failure,
                    faulty_since=c.to_timestamp(s.faulty_since_us) if s.faulty_since_us else None,
                    produced=s.produced,
                    completed=s.completed,
                    groups_in_flight=s.groups_in_flight,
                    oldest_waiting_in_group=(
                        c.to_duration(max(0, now - s.oldest_waiting_at_us)) if s.oldest_waiting_at_us else None
                    ),
                )
                for s in stats.partitions
            ],
            lease_waiting=stats.lease_waiting,
            produce_waiting=stats.produce_waiting,
            in_flight=stats.in_flight,
        )

    async def pause_queue(
        self, request: pb.PauseQueueRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PauseQueueResponse:
        name = c.queue_name(request.queue_name)
        visible = visible_queues()
        paused = await self.admin.update(name, {"paused": True, "produce_paused": request.produce}, visible)
        return pb.PauseQueueResponse(queue=queue_info(paused, visible))

    async def resume_queue(
        self, request: pb.ResumeQueueRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ResumeQueueResponse:
        name = c.queue_name(request.queue_name)
        visible = visible_queues()
        config = self.admin.get(name)
        if config.paused or config.produce_paused:
            config = await self.admin.update(name, {"paused": False, "produce_paused": False}, visible)
        return pb.ResumeQueueResponse(queue=queue_info(config, visible))

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        methods: dict[str, Any] = {
                "CreateQueue": (self.create_queue, pb.CreateQueueRequest, pb.CreateQueueResponse, Action.ADMIN),
                "GetQueue": (self.get_queue, pb.GetQueueRequest, pb.GetQueueResponse, Action.READ),
                "ListQueues": (self.list_queues, pb.ListQueuesRequest, pb.ListQueuesResponse, Action.LIST),
                "UpdateQueue": (self.update_queue, pb.UpdateQueueRequest, pb.UpdateQueueResponse, Action.ADMIN),
                "DeleteQueue": (self.delete_queue, pb.DeleteQueueRequest, pb.DeleteQueueResponse, Action.ADMIN),
                "ClearQueue": (self.clear_queue, pb.ClearQueueRequest, pb.ClearQueueResponse, Action.ADMIN),
                "GetQueueStats": (self.get_queue_stats, pb.GetQueueStatsRequest, pb.GetQueueStatsResponse, Action.READ),
                "PauseQueue": (self.pause_queue, pb.PauseQueueRequest, pb.PauseQueueResponse, Action.ADMIN),
                "ResumeQueue": (self.resume_queue, pb.ResumeQueueRequest, pb.ResumeQueueResponse, Action.ADMIN),
        }
        if self.cluster is not None:
            methods = checked_before_routing(self.cluster.router.route(SERVICE, methods))
        return generic_handler(SERVICE, methods, guard=self.guard)
