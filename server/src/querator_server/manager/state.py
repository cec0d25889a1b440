"""What the manager holds (the catalog, the queues' settings, their actors and copies,
the storage lanes and commit groups) and the small rules every part of it shares: the
storage home of a queue, its lane, a queue that failed, a server that is closing.

The manager's roles are mixins of ``ManagerState`` (queues_manager.py puts them
together); each reads and changes this state under ``_lock``.
"""

from __future__ import annotations

import asyncio
import builtins
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..actor import LogicalQueue
from ..auth import KeyRing
from ..errors import Unavailable
from ..logging import get_logger
from ..model import QueueConfig
from ..storage import Catalog, QueueStore
from ..storage.commit_group import CommitGroup
from ..storage.group_placement import CommitGroups, queue_prefix
from ..storage.lane import StorageLane
from ..storage.queue_store import DEFAULT_MAP_SIZE
from ..storage.replica_copy import ReplicaCopy

log = get_logger("manager")

_PATH = re.compile(r"""['"]?/[^\s'"]+['"]?""")


def storage_failed(exc: BaseException) -> Unavailable:
    """A storage failure during an admin change: nothing changed, the caller may retry.

    The caller learns why (a full disk, an I/O error) but not the server's file paths.
    """
    log.error("admin_storage_failed", error=str(exc))
    reason = _PATH.sub("<file>", str(exc))[:300]
    return Unavailable(f"storage failed ({reason}); the change was not made, retry later")


@dataclass(frozen=True, slots=True)
class SetAside:
    """A queue set aside: its settings when it was, how many items it held (-1: unknown)."""

    aside_id: str
    config: QueueConfig
    reason: str
    items: int
    at_us: int

    def record(self) -> dict[str, Any]:
        return {"id": self.aside_id, "reason": self.reason, "items": self.items, "at_us": self.at_us}

    @classmethod
    def from_record(cls, config: QueueConfig, record: dict[str, Any]) -> SetAside:
        return cls(str(record["id"]), config, str(record["reason"]), int(record["items"]), int(record["at_us"]))


class ManagerState:
    """The catalog, the queues and what serves them, shared by the manager's roles."""

    def __init__(
        self,
        data_dir: str,
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        sync: bool = True,
        max_inbox: int = 10_000,
        workers: int = 8,
        bootstrap_token: str = "",
        bootstrap_until_key: bool = False,
        commit_groups: bool = True,
        fail_queue_after_s: float = 60.0,
    ) -> None:
        self._bootstrap_token = bootstrap_token
        self._bootstrap_until_key = bootstrap_until_key
        self._fail_queue_after_s = fail_queue_after_s
        self.data_dir = os.path.abspath(data_dir)
        self._map_size = map_size
        self._sync = sync
        self._max_inbox = max_inbox
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="querator-storage")
        # A queue's held write transaction must begin and end on one thread
        # (queue_store.py), so each queue commits on one single-thread lane: the lane
        # with the fewest queues when the queue starts, kept until it is deleted.
        self._lanes = [
            StorageLane(f"querator-lane-{i}") for i in range(max(1, workers))
        ]
        self._lane_of: dict[int, int] = {}  # queue uid -> lane index
        self._groups = CommitGroups(self.data_dir, self._lanes, map_size=map_size, sync=sync, enabled=commit_groups)
        # The flock on the data directory while the server runs (data_dir.py).
        self._lock_fd: int | None = None
        # Calls refused because the server is closing (the shutdown waits for a lull).
        self.refused_while_closing = 0
        self._catalog: Catalog | None = None
        self._configs: dict[str, QueueConfig] = {}
        # Queues set aside (set_aside): not served, storage kept; by set-aside id.
        self._aside: dict[str, SetAside] = {}
        self._names: list[str] = []
        self._actors: dict[str, LogicalQueue] = {}
        # Copies of replicated queues' shards, served here (with an actor) or passive.
        self._copies: dict[str, ReplicaCopy] = {}
        self._stepping_down: set[asyncio.Task[None]] = set()
        # Queues that failed to load or whose storage kept failing: name -> why.
        self._failed: dict[str, str] = {}
        # Queues with faulty partitions: name -> how many (actor/cycle_base.py).
        self._faulty: dict[str, int] = {}
        # Told the number of faulty partitions on the server when it changes (health).
        self.on_faulty_partitions: Callable[[int], None] | None = None
        self._lock = asyncio.Lock()
        self._closing = False
        # Metrics (metrics.Metrics) hooks each actor as it is made; None when off.
        self.observer: Any = None
        # Where dead letters for a queue go when that is not simply its queue here (a
        # cluster's replicated dead-letter queue is served by its primary's node): set
        # by the cluster; None: this node's queue of that name.
        self.dead_queue_route: Callable[[str], Any] | None = None
        # The same for a redrive's targets, by uid (a replicated queue's primary may be
        # another node), and the queues a redrive may reach that are not here.
        self.redrive_route: Callable[[int], Any] | None = None
        self.redrive_targets: Callable[[Callable[[str], bool] | None], dict[int, str]] | None = None
        # What the source ids of this node's one-copy queues start with in a replicated
        # dead-letter queue (cluster/dead_letter_source.py); "" on a single server.
        self.own_source_prefix = ""
        self.keyring = KeyRing()
        # Signs page tokens; kept in the catalog (read at start).
        self.token_secret = b""

    # -- where a queue's storage lives -----------------------------------------------

    def _queue_path(self, uid: int) -> str:
        return os.path.join(self.data_dir, "queues", str(uid))

    def _stored_configs(self) -> builtins.list[QueueConfig]:
        """Every queue whose storage the data directory keeps: served or set aside."""
        return [*self._configs.values(), *(a.config for a in self._aside.values())]

    async def _grouped_store(self, group: CommitGroup, config: QueueConfig) -> QueueStore:
        """``config``'s databases in its commit group's environment, opened (made when
        new) on the group's lane."""
        return await group.job(
            lambda: QueueStore(group.path, config.partitions, shared=group.env, prefix=queue_prefix(config.uid))
        )

    def _lane(self, uid: int) -> StorageLane:
        if uid not in self._lane_of:
            users = [0] * len(self._lanes)
            for index in self._lane_of.values():
                users[index] += 1
            self._lane_of[uid] = users.index(min(users))
        return self._lanes[self._lane_of[uid]]

    # -- queues that failed, partitions that are faulty ------------------------------

    def _queue_failed(self, name: str, reason: str) -> None:
        """Serve ``name`` no more: its calls answer UNAVAILABLE with the reason (without
        the server's paths), GetQueue shows it failed, and nothing touches its storage
        until the server starts again (docs/operations.md, "A queue that failed")."""
        self._failed[name] = reason
        log.error("queue_failed", queue=name, reason=reason)

    def failure(self, name: str) -> str:
        """Why queue ``name`` failed, as callers may see it; "" while it serves."""
        reason = self._failed.get(name)
        return "" if reason is None else _PATH.sub("<file>", reason)[:500]

    def _failed_error(self, name: str) -> Unavailable:
        return Unavailable(
            f"queue {name!r} has failed and is not served: {self.failure(name)}; "
            "repair or restore its storage and restart the server, or delete the queue"
        )

    def failed_queues(self) -> int:
        return len(self._failed)

    def queue_count(self) -> int:
        """Queues the server has, serving or not: one that failed to load has no actor,
        so counting actors would hide it from the queue count."""
        return len(self._configs)

    def faulty_partitions(self) -> int:
        """Partitions of all queues left out because their storage failed."""
        return sum(self._faulty.values())

    def _partitions_faulty(self, name: str, count: int) -> None:
        before = self.faulty_partitions()
        if count:
            self._faulty[name] = count
        else:
            self._faulty.pop(name, None)
        after = self.faulty_partitions()
        if after != before and self.on_faulty_partitions is not None:
            self.on_faulty_partitions(after)

    # -- a server that is closing ------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise self._shutting_down()

    def _shutting_down(self) -> Unavailable:
        self.refused_while_closing += 1
        return Unavailable("the server is shutting down")

    def _require_catalog(self) -> Catalog:
        if self._catalog is None:
            raise Unavailable("the server is shutting down")
        return self._catalog

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None
