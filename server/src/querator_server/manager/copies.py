"""This node's copies of replicated queues' shards, which the cluster's data path
drives: opened passive, promoted to serve under an epoch, demoted, made anew, dropped."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import shutil
from functools import partial

from ..actor.replication import Replication
from ..clock import now_us
from ..errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable
from ..model import QueueConfig
from ..storage import QueueStore, StorageError
from ..storage.replica_copy import ReplicaCopy
from ..storage.replica_state import ReplicaState
from .actors import Actors
from .state import log, storage_failed


class Copies(Actors):
    def copy(self, name: str) -> ReplicaCopy:
        """This node's copy of replicated queue ``name``."""
        copy = self._copies.get(name)
        if copy is None:
            if name in self._failed:
                raise Unavailable(f"queue {name!r}: this node's copy failed to load ({self.failure(name)}); reset it")
            raise NotFound(f"queue {name!r} has no copy on this node")
        return copy

    def copy_configs(self) -> list[QueueConfig]:
        """The copies of replicated queues this node keeps (served, passive or failed)."""
        return [config for config in self._configs.values() if config.shard_copy]

    async def open_copy(self, config: QueueConfig) -> ReplicaCopy:
        """A passive copy of a replicated queue's shard, ``config.uid`` being the shard's
        (the same on every node, so item ids stay valid on any copy): made empty, or
        the one this node has. No actor, no lifecycle until ``promote``."""
        async with self._lock:
            self._check_open()
            name = config.name
            current = self._configs.get(name)
            if name in self._copies and current is not None:
                if current.uid != config.uid:
                    raise FailedPrecondition(f"queue {name!r} has a copy of shard {current.uid} here, not of {config.uid}")
                return self._copies[name]
            if current is not None:
                raise AlreadyExists(f"queue {name!r} exists on this node and is not a copy of shard {config.uid}")
            if config.uid <= 0 or any(c.uid == config.uid for c in self._stored_configs()):
                raise FailedPrecondition(f"storage uid {config.uid} is taken on this node; a shard needs a uid of its own")
            now = now_us()
            # Its replica database takes a slot of a group's max_dbs, as a partition does.
            group = self._groups.place(config.replace(partitions=config.partitions + 1), self._stored_configs())
            config = config.replace(shard_copy=True, group=group, created_at_us=config.created_at_us or now, updated_at_us=now)
            loop = asyncio.get_running_loop()
            try:
                copy = await self._open_copy_storage(config)
            except (StorageError, OSError) as exc:
                self._lane_of.pop(config.uid, None)
                raise storage_failed(exc) from exc
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().put, config)
            except (StorageError, OSError) as exc:
                await self._destroy_copy(copy)
                self._lane_of.pop(config.uid, None)
                raise storage_failed(exc) from exc
            self._configs[name] = config
            bisect.insort(self._names, name)
            self._copies[name] = copy
            log.info("shard_copy_opened", queue=name, uid=config.uid, incarnation=copy.incarnation)
            return copy

    async def _open_copy_storage(self, config: QueueConfig) -> ReplicaCopy:
        loop = asyncio.get_running_loop()
        lane = self._lane(config.uid)
        if config.group >= 0:
            group = await loop.run_in_executor(self._executor, self._groups.get, config.group)
            store = await self._grouped_store(group, config)
            state = await group.job(lambda: ReplicaState(store, None, config.uid))
            group.members += 1
            return ReplicaCopy(config.name, state, lane, group)
        path = self._queue_path(config.uid)
        store = await loop.run_in_executor(
            self._executor, lambda: QueueStore(path, config.partitions, map_size=self._map_size, sync=self._sync)
        )
        try:
            state = await lane.run(lambda: ReplicaState(store, None, config.uid))
        except BaseException:
            await lane.run(store.close)
            raise
        return ReplicaCopy(config.name, state, lane, None)

    async def _destroy_copy(self, copy: ReplicaCopy) -> None:
        with contextlib.suppress(StorageError):
            if copy.group is not None:
                copy.group.members -= 1
                await copy.group.job(copy.state.store.destroy)
            else:
                await copy.lane.run(copy.state.store.destroy)

    async def reset_copy(self, name: str) -> ReplicaCopy:
        """Throw this node's copy of ``name`` away and make it anew, empty, as another
        incarnation: for a copy that failed to load (a damaged file) or diverged. A
        snapshot then fills it (``install_snapshot``)."""
        async with self._lock:
            self._check_open()
            config = self.get(name)
            if not config.shard_copy:
                raise FailedPrecondition(f"queue {name!r} is not a copy of a replicated queue here")
            if name in self._actors:
                raise FailedPrecondition(f"queue {name!r} is served here; demote it first")
            copy = self._copies.pop(name, None)
            loop = asyncio.get_running_loop()
            if copy is not None:
                await self._destroy_copy(copy)
            elif config.group >= 0:
                group = await loop.run_in_executor(self._executor, self._groups.get, config.group)
                try:
                    store = await self._grouped_store(group, config)
                    await group.job(store.destroy)
                except StorageError as exc:
                    raise storage_failed(exc) from exc
            else:
                await loop.run_in_executor(
                    self._executor, partial(shutil.rmtree, self._queue_path(config.uid), ignore_errors=True)
                )
            self._failed.pop(name, None)
            try:
                copy = await self._open_copy_storage(config)
            except (StorageError, OSError) as exc:
                self._queue_failed(name, f"cannot make its copy anew: {exc}")
                raise storage_failed(exc) from exc
            self._copies[name] = copy
            log.warning("shard_copy_reset", queue=name, uid=config.uid, incarnation=copy.incarnation)
            return copy

    async def drop_copy(self, name: str, uid: int) -> bool:
        """Remove this node's copy of shard ``uid`` (queue ``name``) for good, storage
        and all: the queue was deleted, or the copy left the shard (moved, retired). A
        copy served here is demoted first. False when there is no such copy here."""
        async with self._lock:
            self._check_open()
            config = self._configs.get(name)
            if config is None or not config.shard_copy or config.uid != uid:
                return False
            await self._demote(name, "its copy leaves this node")
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().delete, name)
            except (StorageError, OSError) as exc:
                raise storage_failed(exc) from exc
            # A crash from here on leaves storage the catalog no longer knows, which
            # start-up removes (a directory of its own, or databases of a group).
            del self._configs[name]
            self._names.remove(name)
            self._failed.pop(name, None)
            copy = self._copies.pop(name, None)
            if copy is not None:
                await self._destroy_copy(copy)
            elif config.group < 0:
                await loop.run_in_executor(
                    self._executor, partial(shutil.rmtree, self._queue_path(config.uid), ignore_errors=True)
                )
            self._lane_of.pop(config.uid, None)
            if self.observer is not None:
                self.observer.detach(name)
            log.info("shard_copy_dropped", queue=name, uid=uid)
            return True

    async def promote(self, name: str, epoch: int, replication: Replication | None) -> None:
        """Serve ``name`` from this node's copy as its primary under ``epoch``: the copy
        is fenced at ``epoch`` first (durably), then loaded as a restart loads a queue.
        Its cycles answer once ``replication`` has their change sets (None: at once,
        a primary with no other copy to wait for)."""
        async with self._lock:
            self._check_open()
            copy = self.copy(name)
            if name in self._actors:
                if copy.serving_epoch == epoch:
                    return
                raise FailedPrecondition(f"queue {name!r} is served here under epoch {copy.serving_epoch}, not {epoch}")
            config = self._configs[name]
            actor = await copy.serve(
                epoch, partial(self._start_actor, config, copy=copy, replication=replication, epoch=epoch)
            )
            copy.step_down = partial(self._step_down_for, name)
            self._actors[name] = actor
            actor.kick_outboxes()
            log.info("shard_promoted", queue=name, epoch=epoch, position=tuple(copy.position()))

    async def demote(self, name: str) -> None:
        """Stop serving ``name`` here; its copy stays, passive. Calls waiting fail UNAVAILABLE."""
        async with self._lock:
            await self._demote(name, "demoted")
