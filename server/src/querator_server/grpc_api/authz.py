"""Authentication and authorization of each call, before anything else happens.

The guard reads the bearer token from the call's metadata, finds the key, and checks
the method's action and every queue the request names (including a dead_queue being
set) against the key's role and patterns. It runs before validation and before any
queue lookup, so without the right key a caller learns nothing about which queues
exist.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import grpc

from ..auth import Action, KeyRing, Principal

# The principal of the call being handled (None when authentication is off).
current_principal: ContextVar[Principal | None] = ContextVar("current_principal", default=None)


def visible_queues() -> Callable[[str], bool] | None:
    """Whether the calling key may see a queue (None: it sees every queue), for answers
    and error texts that would otherwise name queues outside the key's patterns."""
    principal = current_principal.get()
    return None if principal is None or "*" in principal.queues else principal.matches


def queues_named(request: object) -> list[str]:
    """Every queue a request names: queue_name (and a redrive's target_queue), or
    queue.queue_name and queue.dead_queue."""
    names: list[str] = []
    name = getattr(request, "queue_name", None)
    if isinstance(name, str):
        names.append(name)
    target = getattr(request, "target_queue", None)
    if isinstance(target, str):
        names.append(target)
    info = getattr(request, "queue", None)
    if info is not None and not isinstance(info, bool):
        names.append(getattr(info, "queue_name", ""))
        names.append(getattr(info, "dead_queue", ""))
    return names


class Guard:
    """Checks calls against the key ring the manager holds."""

    def __init__(self, keyring: Callable[[], KeyRing]) -> None:
        self._keyring = keyring

    def authenticate(self, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
        """The caller's principal; raises Unauthenticated without a valid key."""
        return self._keyring().authenticate(context.invocation_metadata() or ())

    def check(self, action: Action, request: object, context: grpc.aio.ServicerContext[Any, Any]) -> Principal:
        principal = self.authenticate(context)
        principal.check(action, queues_named(request))
        current_principal.set(principal)
        return principal
