"""The rules of admin changes, the same for a single server and for a cluster.

What a queue's settings may be, which queue may be whose dead-letter queue, and how an
API key is kept. The single server's QueuesManager applies them to its local catalog,
the cluster's admin frontend to the catalog in etcd; ``QueueAdmin`` is what the gRPC
services call, whichever of the two answers.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from .auth import ApiKey, Role
from .errors import FailedPrecondition, InvalidArgument
from .model import QueueConfig

# The queues a caller may see (error texts name no other); None: every queue.
Visible = Callable[[str], bool] | None


class QueueAdmin(Protocol):
    """Queues and API keys: created, read, changed and deleted."""

    async def create(self, config: QueueConfig, visible: Visible = None) -> QueueConfig: ...

    def get(self, name: str) -> QueueConfig: ...

    def list(self, after: str, limit: int, visible: Visible = None) -> tuple[builtins.list[QueueConfig], bool]: ...

    async def update(self, name: str, changes: dict[str, object], visible: Visible = None) -> QueueConfig: ...

    async def delete(self, name: str, force: bool, visible: Visible = None) -> None: ...

    async def create_key(self, role: Role, queues: builtins.list[str], description: str) -> tuple[ApiKey, str]: ...

    async def revoke_key(self, key_id: str) -> None: ...


def check_settings(config: QueueConfig) -> None:
    if config.lease_timeout_us > config.expire_timeout_us:
        raise InvalidArgument("queue.lease_timeout", "must not be longer than expire_timeout")


def check_update(current: QueueConfig, updated: QueueConfig) -> None:
    """An UpdateQueue's result against the queue as it is (its dead queue apart)."""
    check_settings(updated)
    if updated.partitions < current.partitions:
        raise FailedPrecondition(f"requested_partitions cannot be lowered from {current.partitions} to {updated.partitions}")
    if updated.replicas < current.replicas:
        raise InvalidArgument("queue.replicas", f"cannot be lowered (from {current.replicas} to {updated.replicas})")
    if updated.replicas > current.replicas and current.replicas < 2:
        raise InvalidArgument(
            "queue.replicas",
            f"a queue of one copy cannot gain copies (from {current.replicas} to {updated.replicas}): its partitions "
            "are spread over nodes, not copied; create a queue with the copies it needs",
        )
    if updated.min_in_sync != current.min_in_sync:
        if updated.replicas < 2:
            raise InvalidArgument("queue.min_in_sync", "applies to a replicated queue (replicas above 1)")
        if not 1 <= updated.min_in_sync <= updated.replicas:
            raise InvalidArgument(
                "queue.min_in_sync", f"must be between 1 and replicas ({updated.replicas}), got {updated.min_in_sync}"
            )


def dead_queue_users(name: str, configs: Iterable[QueueConfig]) -> list[str]:
    """The queues (other than ``name``) whose dead_queue is ``name``, sorted."""
    return sorted(c.name for c in configs if c.dead_queue == name and c.name != name)


def users_text(users: list[str], visible: Visible) -> str:
    """``users`` for an error text, naming only those the caller may see (``visible``):
    the others are counted, never named."""
    shown = users if visible is None else [u for u in users if visible(u)]
    hidden = len(users) - len(shown)
    named = ", ".join(map(repr, shown[:5])) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
    if not hidden:
        return named
    others = f"{hidden} queue{'s' if hidden > 1 else ''} your key may not see"
    return f"{named} and {others}" if named else others


def check_dead_queue(config: QueueConfig, configs: Mapping[str, QueueConfig], visible: Visible = None) -> None:
    """``config``'s dead_queue against the other queues (``configs``, by name): it must
    exist, not be the queue itself, not have a dead queue of its own; and a queue that
    is some queue's dead_queue may not have one."""
    dead = config.dead_queue
    if not dead:
        return
    if dead == config.name:
        raise InvalidArgument("queue.dead_queue", "a queue cannot be its own dead_queue")
    target = configs.get(dead)
    if target is None:
        raise InvalidArgument("queue.dead_queue", f"queue {dead!r} does not exist; create it first")
    if target.dead_queue:
        raise InvalidArgument("queue.dead_queue", f"queue {dead!r} has a dead_queue of its own; a dead-letter queue may not")
    if users := users_text(dead_queue_users(config.name, configs.values()), visible):
        raise FailedPrecondition(f"queue {config.name!r} is the dead_queue of {users} and so cannot have a dead_queue of its own")


def check_deletable(name: str, configs: Iterable[QueueConfig], visible: Visible = None) -> None:
    """A queue that is another's dead_queue is not deleted (its users would dead-letter
    into nothing)."""
    if users := users_text(dead_queue_users(name, configs), visible):
        raise FailedPrecondition(f"queue {name!r} is the dead_queue of {users}")


def key_record(key: ApiKey) -> dict[str, object]:
    """How an API key is stored (the secret only as its hash)."""
    return {
        "key_id": key.key_id,
        "role": int(key.role),
        "queues": list(key.queues),
        "description": key.description,
        "created_at_us": key.created_at_us,
        "secret_sha256": key.secret_hash,
    }


def key_from_record(record: Mapping[str, object]) -> ApiKey:
    return ApiKey(
        key_id=str(record["key_id"]),
        role=Role(int(record["role"])),  # type: ignore[call-overload]
        queues=tuple(str(q) for q in record["queues"]),  # type: ignore[attr-defined]
        description=str(record["description"]),
        created_at_us=int(record["created_at_us"]),  # type: ignore[call-overload]
        secret_hash=str(record["secret_sha256"]),
    )
