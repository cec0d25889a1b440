"""Queues set aside: not served and out of the namespace, their storage kept as it is
(a queue whose data must not be served, nor lost: cluster/coordinator.py), until an
operator removes them."""

from __future__ import annotations

import asyncio
import shutil
from functools import partial

from ..clock import now_us
from ..errors import NotFound
from ..storage import StorageError
from .actors import Actors
from .state import SetAside, log, storage_failed


class SetAsideQueues(Actors):
    async def set_aside(self, name: str, reason: str) -> SetAside:
        """Stop serving queue ``name`` and move it out of the served namespace, its storage
        kept as it is. A queue of the same name may be created afterwards;
        ``remove_set_aside`` deletes it."""
        async with self._lock:
            self._check_open()
            config = self.get(name)
            actor = self._actors.get(name)
            items = -1  # unknown: a failed queue's storage was not read
            if actor is not None and name not in self._failed:
                totals = actor.totals()
                items = totals.ready + totals.leased + totals.scheduled
            entry = SetAside(
                aside_id=f"{name}@{config.uid}", config=config, reason=reason, items=items, at_us=now_us()
            )
            loop = asyncio.get_running_loop()
            if actor is not None and name in self._failed:
                await actor.stop()
            elif actor is not None:
                await actor.delete(force=True)  # stops it for good; nothing is dropped
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().set_aside, config, entry.record())
            except (StorageError, OSError) as exc:
                if actor is not None:
                    self._actors[name] = await self._start_actor(config, actor)
                raise storage_failed(exc) from exc
            del self._configs[name]
            self._names.remove(name)
            self._failed.pop(name, None)
            self._partitions_faulty(name, 0)
            if self.observer is not None:
                self.observer.detach(name)
            if actor is not None:
                if actor.group is not None:
                    actor.group.members -= 1  # its databases stay in the group
                else:
                    await loop.run_in_executor(self._lane(config.uid), actor.store.close)
            self._lane_of.pop(config.uid, None)
            self._aside[entry.aside_id] = entry
            log.error(
                "queue_set_aside",
                queue=name,
                aside_id=entry.aside_id,
                items=items,
                reason=reason,
                detail="not served, kept on disk; list with 'querator cluster set-aside list'",
            )
            return entry

    def set_aside_queues(self) -> list[SetAside]:
        return sorted(self._aside.values(), key=lambda a: (a.config.name, a.at_us))

    async def remove_set_aside(self, aside_id: str) -> SetAside:
        """Delete a set-aside queue's storage for good."""
        async with self._lock:
            self._check_open()
            entry = self._aside.get(aside_id)
            if entry is None:
                raise NotFound(f"no queue set aside with id {aside_id!r}")
            config = entry.config
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().delete_aside, aside_id)
            except (StorageError, OSError) as exc:
                raise storage_failed(exc) from exc
            del self._aside[aside_id]
            # A crash before the storage goes leaves what start-up removes: a directory or
            # group databases no catalog entry owns.
            if config.group >= 0:
                group = await loop.run_in_executor(self._executor, self._groups.get, config.group)
                try:
                    store = await self._grouped_store(group, config)
                    await group.job(store.destroy)
                except StorageError as exc:
                    log.warning("queue_storage_left", queue=config.name, error=str(exc))
            else:
                path = self._queue_path(config.uid)
                await loop.run_in_executor(self._executor, partial(shutil.rmtree, path, ignore_errors=True))
            log.warning("set_aside_queue_removed", queue=config.name, aside_id=aside_id, items=entry.items)
            return entry
