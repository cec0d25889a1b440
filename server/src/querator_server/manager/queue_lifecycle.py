"""A queue's life by admin call: created, updated (a grouped queue that outgrows its
commit group moved to a directory of its own), deleted. Each change takes the manager's
lock and is written to the catalog before it takes effect; its rules are queue_admin.py's."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import shutil
from collections.abc import Callable
from functools import partial

from ..actor import LogicalQueue
from ..clock import now_us
from ..errors import AlreadyExists, FailedPrecondition
from ..model import QueueConfig
from ..queue_admin import check_dead_queue, check_deletable, check_update
from ..storage import StorageError
from ..storage.group_layout import copy_out
from ..storage.group_placement import GROUP_MAX_PARTITIONS
from .actors import Actors
from .state import log, storage_failed


class QueueLifecycle(Actors):
    async def create(self, config: QueueConfig, visible: Callable[[str], bool] | None = None) -> QueueConfig:
        """Create a queue; ``visible``: the queues the caller may see (error texts name no other)."""
        async with self._lock:
            self._check_open()
            if config.name in self._configs:
                raise AlreadyExists(f"queue {config.name!r} already exists")
            check_dead_queue(config, self._configs, visible)
            loop = asyncio.get_running_loop()
            catalog = self._require_catalog()
            try:
                uid = await loop.run_in_executor(self._executor, catalog.next_uid)
                now = now_us()
                group = self._groups.place(config, self._stored_configs())
                config = config.replace(uid=uid, created_at_us=now, updated_at_us=now, group=group)
                actor = await self._start_actor(config, created=True)
            except (StorageError, OSError) as exc:
                self._lane_of.pop(config.uid, None)
                raise storage_failed(exc) from exc
            try:
                await loop.run_in_executor(self._executor, catalog.put, config)
            except Exception as exc:
                await actor.stop()
                if actor.group is not None:
                    actor.group.members -= 1
                    # Its databases hold slots of the group's max_dbs: drop them now
                    # (or, if that fails too, at the next start).
                    with contextlib.suppress(StorageError):
                        await actor.group.job(actor.store.destroy)
                self._lane_of.pop(config.uid, None)
                if self.observer is not None:
                    self.observer.detach(config.name)
                if isinstance(exc, StorageError | OSError):
                    raise storage_failed(exc) from exc
                raise
            self._configs[config.name] = config
            bisect.insort(self._names, config.name)
            self._actors[config.name] = actor
            log.info("queue_created", queue=config.name, partitions=config.partitions)
            return config

    async def update(
        self, name: str, changes: dict[str, object], visible: Callable[[str], bool] | None = None
    ) -> QueueConfig:
        async with self._lock:
            self._check_open()
            current = self.get(name)
            if name in self._failed:
                raise self._failed_error(name)
            updated = current.replace(**changes, updated_at_us=now_us())
            check_update(current, updated)
            if "dead_queue" in changes:
                check_dead_queue(updated, self._configs, visible)
            loop = asyncio.get_running_loop()
            actor = self._actors.get(name)
            copy = self._copies.get(name)
            if copy is not None and copy.group is not None and updated.partitions + 1 > GROUP_MAX_PARTITIONS:
                # Its copies would have to leave their groups in step; not done yet.
                raise FailedPrecondition(
                    f"replicated queue {name!r} keeps its storage in a commit group here, which holds at most "
                    f"{GROUP_MAX_PARTITIONS - 1} of its partitions"
                )
            if actor is not None and actor.group is not None and updated.partitions > GROUP_MAX_PARTITIONS:
                await self._move_out(actor, updated.replace(group=-1))
                return self._configs[name]
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().put, updated)
            except (StorageError, OSError) as exc:
                raise storage_failed(exc) from exc
            self._configs[name] = updated
            if actor is not None:  # a passive copy opens partitions as change sets name them
                await actor.reconfigure(updated)
            return updated

    async def _move_out(self, actor: LogicalQueue, updated: QueueConfig) -> None:
        """Give a grouped queue that outgrew its group a directory of its own."""
        loop = asyncio.get_running_loop()
        group = actor.group
        assert group is not None
        path = self._queue_path(updated.uid)
        copy = partial(copy_out, path=path, partitions=updated.partitions, map_size=self._map_size, sync=self._sync)

        async def persist() -> None:
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().put, updated)
            except (StorageError, OSError) as exc:
                raise storage_failed(exc) from exc
            self._configs[updated.name] = updated
            group.members -= 1

        await actor.move_out(updated, copy, persist)
        log.info("queue_moved_out_of_group", queue=updated.name, partitions=updated.partitions)

    async def delete(self, name: str, force: bool, visible: Callable[[str], bool] | None = None) -> None:
        async with self._lock:
            self._check_open()
            self.get(name)
            check_deletable(name, self._configs.values(), visible)
            if name in self._copies:
                raise FailedPrecondition(f"queue {name!r} is a copy of a replicated queue here; the cluster drops it")
            if name in self._failed:
                await self._delete_failed(name, force)
                return
            actor = self._actors[name]
            await actor.delete(force)
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().delete, name)
            except (StorageError, OSError) as exc:
                # The actor stopped but the catalog still has the queue: bring the
                # queue back as it was on its still-open storage (reading needs no
                # write), so nothing is half-deleted.
                self._actors[name] = await self._start_actor(self._configs[name], actor)
                raise storage_failed(exc) from exc
            del self._configs[name]
            self._names.remove(name)
            del self._actors[name]
            self._partitions_faulty(name, 0)
            if self.observer is not None:
                self.observer.detach(name)
            # A crash before this point leaves an orphan directory that start-up removes.
            if actor.group is not None:
                actor.group.members -= 1
                try:
                    await actor.group.job(actor.store.destroy)
                except StorageError as exc:  # the catalog forgot it: start-up drops them
                    log.warning("queue_storage_left", queue=name, error=str(exc))
            else:
                await loop.run_in_executor(self._lane(actor.config.uid), actor.store.destroy)
            del self._lane_of[actor.config.uid]
            log.info("queue_deleted", queue=name)

    async def _delete_failed(self, name: str, force: bool) -> None:
        """Delete a failed queue: what it holds is unknown, so only with ``force``. A
        directory of its own goes; databases in a commit group go at the next start that
        loads the group (start-up drops what the catalog does not know)."""
        if not force:
            raise FailedPrecondition(f"queue {name!r} has failed and what it holds is unknown; set force to delete it")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._require_catalog().delete, name)
        except (StorageError, OSError) as exc:
            raise storage_failed(exc) from exc
        config = self._configs.pop(name)
        self._names.remove(name)
        del self._failed[name]
        actor = self._actors.pop(name, None)
        if actor is not None:
            await actor.stop()
            if actor.group is not None:
                actor.group.members -= 1
        if config.group < 0:
            path = self._queue_path(config.uid)
            await loop.run_in_executor(self._executor, partial(shutil.rmtree, path, ignore_errors=True))
        self._lane_of.pop(config.uid, None)
        if self.observer is not None:
            self.observer.detach(name)
        log.info("queue_deleted", queue=name, failed=True)
