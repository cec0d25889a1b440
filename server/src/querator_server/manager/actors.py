"""Starting a queue's actor (on storage opened here, on a stopped actor's, or as the
primary of a replicated queue's copy), what it is wired to, and an actor's stepping
down to a passive copy."""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial
from typing import Any

from ..actor import LogicalQueue
from ..actor.replication import Replication
from ..model import QueueConfig
from ..storage import QueueStore, StorageError
from ..storage.change_set import ChangeSet
from ..storage.replica_copy import ReplicaCopy
from .lookups import Lookups
from .state import log


class _Alone(Replication):
    """The replication of a primary with no other copy to wait for."""

    async def replicated(self, change: ChangeSet) -> None:
        return None


_ALONE = _Alone()


class Actors(Lookups):
    async def _start_actor(
        self,
        config: QueueConfig,
        stopped: LogicalQueue | None = None,
        *,
        created: bool = False,
        copy: ReplicaCopy | None = None,
        replication: Replication | None = None,
        epoch: int = 0,
    ) -> LogicalQueue:
        """Start an actor for ``config``; on ``stopped``'s open storage when given, or as
        the primary of ``copy`` under ``epoch``. ``created``: the queue is new, so
        storage made for it goes if the start fails."""
        loop = asyncio.get_running_loop()
        lane = self._lane(config.uid)
        group = None
        if copy is not None:
            store, group = copy.state.store, copy.group
            if store.partitions < config.partitions:  # settings changed while it was passive
                grow = partial(store.ensure_partitions, config.partitions)
                await (group.job(grow) if group is not None else lane.run(grow))
        elif stopped is not None:
            store, group = stopped.store, stopped.group
        elif config.group >= 0:
            group = await loop.run_in_executor(self._executor, self._groups.get, config.group)
            store = await self._grouped_store(group, config)
        else:
            store = await loop.run_in_executor(
                self._executor,
                lambda: QueueStore(
                    self._queue_path(config.uid), config.partitions, map_size=self._map_size, sync=self._sync
                ),
            )
        actor = LogicalQueue(
            config,
            store,
            lane,
            resolve=self._dead_queue,
            resolve_uid=self._redrive_target,
            max_inbox=self._max_inbox,
            group=group,
            fail_after_s=self._fail_queue_after_s,
            on_failed=self._queue_failed,
            on_partitions=self._partitions_faulty,
            replication=None if copy is None else replication or _ALONE,
            epoch=epoch,
            on_deposed=None if copy is None else self._deposed,
        )
        if self.observer is not None:
            self.observer.attach(actor)
        try:
            if copy is not None:
                await actor.start(copy.state.keyed, copy.state)
                return actor
            await actor.start(stopped.keyed_index if stopped is not None else None)
        except BaseException:
            if copy is not None:  # the copy stays as it was
                if self.observer is not None:
                    self.observer.detach(config.name)
            elif created and group is not None:  # its databases would hold slots of max_dbs
                with contextlib.suppress(StorageError):
                    await group.job(store.destroy)
            elif stopped is None and group is None:  # a damaged file stays as it is, closed
                with contextlib.suppress(Exception):
                    await loop.run_in_executor(self._executor, store.close)
            raise
        if group is not None and stopped is None:
            group.members += 1
        return actor

    def _dead_queue(self, name: str) -> Any:
        """What a queue hands its dead letters to (``submit(DeadLetterRequest)``)."""
        route = self.dead_queue_route
        return self.actor(name) if route is None else route(name)

    def _redrive_target(self, uid: int) -> Any:
        """What a redrive hands the items for queue ``uid`` to (``submit(RedriveInRequest)``),
        or None when that queue is gone."""
        route = self.redrive_route
        return self.actor_by_uid(uid) if route is None else route(uid)

    # -- a primary stepping down to a passive copy -------------------------------------

    async def _demote(self, name: str, reason: str) -> None:
        actor = self._actors.get(name)
        copy = self._copies.get(name)
        if actor is None or copy is None:
            return
        del self._actors[name]
        try:
            await actor.step_down(reason)
        finally:
            copy.serving_epoch = 0
            if self.observer is not None:
                self.observer.detach(name)
        log.warning("shard_demoted", queue=name, reason=reason, position=tuple(copy.position()))

    async def _step_down_for(self, name: str, epoch: int) -> None:
        """A later epoch (``epoch``) reached this node's copy: another node was elected."""
        async with self._lock:
            await self._demote(name, f"epoch {epoch} was elected elsewhere")

    def _deposed(self, name: str, reason: str) -> None:
        """A primary here lost its replicas' acknowledgement: it becomes a passive copy."""

        async def demote() -> None:
            async with self._lock:
                await self._demote(name, reason)

        task = asyncio.get_running_loop().create_task(demote())
        self._stepping_down.add(task)
        task.add_done_callback(self._stepping_down.discard)
