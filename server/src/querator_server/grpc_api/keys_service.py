"""querator.v1.KeysService: create, list and revoke API keys."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc

from querator.v1 import keys_pb2 as pb

from ..auth import Action, ApiKey, Role
from ..errors import InvalidArgument
from ..manager import QueuesManager
from ..queue_admin import QueueAdmin
from . import convert as c
from .authz import Guard
from .handlers import generic_handler

if TYPE_CHECKING:
    from ..cluster import Coordinator

SERVICE = "querator.v1.KeysService"


def api_key(key: ApiKey) -> pb.ApiKey:
    return pb.ApiKey(
        key_id=key.key_id,
        role=int(key.role),  # type: ignore[arg-type]
        queues=list(key.queues),
        description=key.description,
        created_at=c.to_timestamp(key.created_at_us),
    )


class KeysService:
    def __init__(self, manager: QueuesManager, guard: Guard | None = None, cluster: Coordinator | None = None) -> None:
        self.manager = manager
        self.guard = guard
        # Where keys are created and revoked: the cluster catalog in cluster mode.
        self.admin: QueueAdmin = manager if cluster is None else cluster

    async def create_key(self, request: pb.CreateKeyRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.CreateKeyResponse:
        try:
            role = Role(request.role)
        except ValueError:
            raise InvalidArgument("role", "must be ROLE_PRODUCER, ROLE_CONSUMER or ROLE_ADMIN") from None
        key, token = await self.admin.create_key(role, list(request.queues), request.description)
        return pb.CreateKeyResponse(key=api_key(key), token=token)

    async def list_keys(self, request: pb.ListKeysRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.ListKeysResponse:
        return pb.ListKeysResponse(keys=[api_key(k) for k in self.manager.keyring.keys()])

    async def revoke_key(self, request: pb.RevokeKeyRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.RevokeKeyResponse:
        if not request.key_id:
            raise InvalidArgument("key_id", "is required")
        await self.admin.revoke_key(request.key_id)
        return pb.RevokeKeyResponse()

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return generic_handler(
            SERVICE,
            {
                "CreateKey": (self.create_key, pb.CreateKeyRequest, pb.CreateKeyResponse, Action.KEYS),
                "ListKeys": (self.list_keys, pb.ListKeysRequest, pb.ListKeysResponse, Action.KEYS),
                "RevokeKey": (self.revoke_key, pb.RevokeKeyRequest, pb.RevokeKeyResponse, Action.KEYS),
            },
            guard=self.guard,
        )
