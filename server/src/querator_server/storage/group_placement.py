"""Where queues keep their storage: in a commit group, or in a directory of their own.

A new queue with at most ``GROUP_MAX_PARTITIONS`` partitions joins the first commit
group with room (``groups/<n>``, ``GROUP_QUEUES`` queues each), so that busy queues
share durable commits (storage/commit_group.py); a bigger queue gets ``queues/<uid>``.
A grouped queue that grows past ``GROUP_MAX_PARTITIONS`` moves to a directory of its
own. The catalog records each queue's group, which is the truth at start-up: storage
it does not account for (a crash during a create, a delete or a move) is removed.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from collections.abc import Iterable

import lmdb

from ..model import QueueConfig
from . import StorageError
from .commit_group import CommitGroup
from .group_layout import GROUP_MAX_PARTITIONS, GROUP_QUEUES, drop_queues, open_group_env, queue_prefix, queue_uids
from .lane import StorageLane


class CommitGroups:
    """The open commit groups of one data directory."""

    def __init__(self, data_dir: str, lanes: list[StorageLane], *, map_size: int, sync: bool, enabled: bool) -> None:
        self.root = os.path.join(data_dir, "groups")
        self._lanes = lanes
        self._map_size = map_size
        self._sync = sync
        self.enabled = enabled
        self._open: dict[int, CommitGroup] = {}
        # Groups that failed to load: no new queue joins them (nothing may create or
        # change their storage while the operator has not repaired it).
        self._broken: set[int] = set()
        # get() runs on executor threads; LMDB must never open one environment twice.
        self._opening = threading.Lock()

    def path(self, index: int) -> str:
        return os.path.join(self.root, str(index))

    def place(self, config: QueueConfig, configs: Iterable[QueueConfig]) -> int:
        """The group a new queue joins: the first with room, or -1 (a directory of its own)."""
        if not self.enabled or config.partitions > GROUP_MAX_PARTITIONS:
            return -1
        members = Counter(c.group for c in configs if c.group >= 0)
        index = 0
        while members[index] >= GROUP_QUEUES or index in self._broken:
            index += 1
        return index

    def get(self, index: int) -> CommitGroup:
        """The group ``index``, opening (or creating) its environment. Blocking."""
        with self._opening:
            group = self._open.get(index)
            if group is None:
                path = self.path(index)
                env = open_group_env(path, map_size=self._map_size, sync=self._sync)
                group = self._open[index] = CommitGroup(env, path, self._lanes[index % len(self._lanes)])
            return group

    def load(self, configs: list[QueueConfig]) -> dict[int, str]:
        """At start-up, before any actor: open every group the catalog names, and drop
        what no queue of the catalog owns. Blocking.

        Returns why, by uid, the queues that cannot be served: all of a group that is
        missing or fails to open, a queue whose databases the group no longer holds.
        Nothing of those is changed or removed."""
        owners: dict[int, set[int]] = {}
        for config in configs:
            if config.group >= 0:
                owners.setdefault(config.group, set()).add(config.uid)
        failed: dict[int, str] = {}
        for index in sorted(owners):
            data = os.path.join(self.path(index), "data.mdb")
            if not os.path.isfile(data) or os.path.getsize(data) == 0:
                failed.update(dict.fromkeys(owners[index], f"{data}: the storage of its commit group is missing or empty"))
                self._broken.add(index)
                continue
            try:
                group = self.get(index)
                present = queue_uids(group.env)
            except (StorageError, lmdb.Error) as exc:
                failed.update(dict.fromkeys(owners[index], f"{data}: cannot load its commit group: {exc}"))
                self._broken.add(index)
                continue
            for uid in owners[index] - present:
                failed[uid] = f"{data}: its commit group holds no storage for it"
            drop_queues(group.env, present - owners[index])
        if os.path.isdir(self.root):
            for entry in os.listdir(self.root):
                if entry.isdigit() and int(entry) not in owners:
                    _remove_tree(os.path.join(self.root, entry))
        return failed

    async def close(self) -> None:
        await asyncio.gather(*(group.close() for group in self._open.values()))
        self._open.clear()


def _remove_tree(path: str) -> None:
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


__all__ = ["CommitGroups", "GROUP_MAX_PARTITIONS", "queue_prefix"]
