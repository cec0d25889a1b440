"""The local storage follows the catalog (the reconcile backend of the coordinator).

``reconcile`` runs after every catalog change and at start: it creates, grows,
updates and removes this node's local copies of the cluster's queues and keeps the
key ring equal to the catalog's keys, so a crash between an etcd write and the local
change is repaired by the next run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from ..errors import NotFound, QueratorError
from ..logging import get_logger
from ..manager import QueuesManager
from ..model import QueueConfig
from ..queue_admin import key_from_record
from .catalog import CatalogCache
from .membership import Membership
from .placement import GENERATION_MARK, SHARED_FIELDS, QueueEntry
from .replica_roles import ShardRoles

log = get_logger("cluster")

# The pause before a run of the reconcile of its own, while a queue's local storage
# could not be made: doubling from the first to the most.
_AGAIN_FIRST_S = 1.0
_AGAIN_MOST_S = 30.0


class ReconcileBackend:
    """Part of Coordinator (coordinator.py holds the state and the wiring)."""

    manager: QueuesManager
    node: str
    catalog: CatalogCache
    membership: Membership
    roles: ShardRoles
    retired: bool
    _reconcile_lock: asyncio.Lock
    _foreign: set[str]
    _blocked: set[str]
    # Queues whose local storage the last run could not make or change: name -> why.
    # Tried again by a run of its own (reconcile_again), not only at the next change of
    # the catalog, which may never come; meanwhile their calls here answer UNAVAILABLE
    # naming why (coordinator.lookup), not NOT_FOUND for a queue GetQueue shows.
    unmade: dict[str, str]
    _again: asyncio.Task[None] | None
    _again_delay_s: float

    async def reconcile(self) -> None:
        async with self._reconcile_lock:
            catalog = self.catalog
            if self.node in catalog.retired and not self.retired:
                self.retired = True
                log.error("cluster_node_retired", node=self.node, detail="this node no longer serves its partitions")
            member = catalog.members.get(self.node)
            registered = self.membership.create_revision
            # Judged only on a cache at least as new as the registration: an older event
            # (the deletion of the previous key, say) says nothing about the current one.
            if registered and catalog.revision >= registered and (
                member is None or member.create_revision != registered
            ):
                self.membership.lost()
            shards = {entry.shard for entry in catalog.queues.values() if entry.shard}
            for uid in self.roles.held() - shards:
                await self.roles.forget(uid)
            # Before the queues: a copy left over from a deleted generation of a queue
            # must go before the current generation's copy is made under that name.
            await self._drop_stale_copies()
            for entry in _dead_queues_first(catalog.queues.values()):
                await self._apply(entry)
            for config in [actor.config for actor in self.manager.queues()]:
                if config.name in catalog.queues or config.shard_copy:  # copies: _drop_stale_copies
                    continue
                if config.name not in catalog.deleted:  # never in this cluster: kept, not served
                    if config.name not in self._foreign:
                        self._foreign.add(config.name)
                        log.warning("cluster_unknown_local_queue", queue=config.name, detail="not in the catalog; kept")
                else:
                    try:
                        await self.manager.delete(config.name, force=True)
                        log.info("cluster_queue_removed", queue=config.name)
                    except QueratorError as exc:
                        log.warning("cluster_queue_remove_failed", queue=config.name, error=exc.message)
            self._sync_keys()
            for name in [n for n in self.unmade if n not in catalog.queues]:
                del self.unmade[name]
            self._reconcile_again()

    def _reconcile_again(self) -> None:
        """While a queue's local storage could not be made, another run after a pause
        (1 s, doubling to 30 s while it keeps failing)."""
        if not self.unmade:
            self._again_delay_s = _AGAIN_FIRST_S
            return
        if self._again is not None and not self._again.done():
            return
        delay, self._again_delay_s = self._again_delay_s, min(self._again_delay_s * 2, _AGAIN_MOST_S)

        async def again() -> None:
            await asyncio.sleep(delay)
            self._again = None
            await self.reconcile()

        self._again = asyncio.get_running_loop().create_task(again(), name="querator-reconcile-again")

    async def stop_reconciling(self) -> None:
        if self._again is not None:
            self._again.cancel()
            await asyncio.gather(self._again, return_exceptions=True)

    def _sync_keys(self) -> None:
        """The manager's key ring holds the catalog's keys (changed in place: the ring
        keeps its bootstrap-token settings and what it has already logged)."""
        ring = self.manager.keyring
        wanted = {key_id: key_from_record(record) for key_id, record in self.catalog.api_keys.items()}
        for key in ring.keys():
            if wanted.get(key.key_id) != key:
                ring.remove(key.key_id)
        held = {key.key_id for key in ring.keys()}
        for key_id, key in wanted.items():
            if key_id not in held:
                ring.add(key)

    async def _apply(self, entry: QueueEntry) -> None:
        if entry.shard:
            await self._follow_shard(entry)
            return
        count = entry.local_count(self.node)
        name = entry.config.name
        try:
            local = self.manager.get(name)
        except NotFound:
            local = None
        if local is not None and not local.reference.startswith(GENERATION_MARK):
            # The data directory held this queue before it joined the cluster: never
            # dropped, never served in place of the cluster's queue.
            if name not in self._blocked:
                self._blocked.add(name)
                log.error("cluster_queue_name_taken_here", queue=name, detail="a local queue of this name predates the cluster")
            return
        try:
            if local is not None and local.reference != entry.local_reference:
                # Another generation of the queue (deleted and created again while this
                # node was away): its items must not show up in the new queue.
                await self._set_aside_or_drop(name, "the catalog's queue of this name is another generation")
                local = None
            if count == 0:
                self.unmade.pop(name, None)
                return
            config = entry.config.replace(partitions=count, reference=entry.local_reference)
            if local is None:
                await self.manager.create(config)
                log.info("cluster_queue_created_here", queue=name, partitions=count)
            else:
                await self._settle(config, local)
            self.unmade.pop(name, None)
        except QueratorError as exc:
            if self.unmade.get(name) != exc.message:  # once per failure, not once per run
                log.error("cluster_reconcile_failed", queue=name, error=exc.message)
            self.unmade[name] = exc.message

    async def _settle(self, config: QueueConfig, local: QueueConfig) -> None:
        """Give the local queue ``local`` the catalog's settings and partition count
        (``config``, as this node keeps it)."""
        changes: dict[str, object] = {
            f: getattr(config, f)
            for f in SHARED_FIELDS
            if f not in ("created_at_us", "updated_at_us") and getattr(config, f) != getattr(local, f)
        }
        if local.partitions < config.partitions:
            changes["partitions"] = config.partitions
        if changes:
            await self.manager.update(config.name, changes)

    async def _follow_shard(self, entry: QueueEntry) -> None:
        """A replicated queue: this node's copy follows the shard's record (promoted,
        kept passive, or taking part in a failover: replica_roles.py)."""
        record = self.catalog.shards.get(entry.shard)
        if record is None or self.node not in record.replicas:
            await self.roles.forget(entry.shard)
            return
        config = entry.config.replace(partitions=len(entry.homes), reference=entry.local_reference, uid=entry.shard)
        try:
            await self.roles.follow(record, config)
            # The serving copy takes the catalog's settings (UpdateQueue, a pause) and its
            # added partitions; its change sets grow the other copies. A record naming this
            # node it does not serve (a later epoch promised, its copy not the in-sync one)
            # waits: the election that follows changes the record, and this runs again.
            if record.primary == self.node and self.roles.serving(entry.shard):
                await self._settle(config, self.manager.actor(config.name).config)
        except QueratorError as exc:
            log.error("cluster_reconcile_failed", queue=entry.config.name, shard=entry.shard, error=exc.message)

    async def _drop_stale_copies(self) -> None:
        """Remove the local copies of replicated queues the catalog no longer gives this
        node: the queue was deleted (while this node was up or down: a copy comes back
        with the node's data directory), created again as another shard, or this node's
        copy left the shard (a move, a drain, a retire). A copy is kept while its shard
        record is not known here (nothing says it is not needed)."""
        for config in self.manager.copy_configs():
            entry = self.catalog.queues.get(config.name)
            if entry is not None and entry.shard == config.uid:
                record = self.catalog.shards.get(entry.shard)
                if record is None or self.node in record.replicas:
                    continue
            try:
                await self.roles.forget(config.uid)
                if await self.manager.drop_copy(config.name, config.uid):
                    log.info("cluster_copy_removed", queue=config.name, shard=config.uid)
            except QueratorError as exc:
                log.warning("cluster_copy_remove_failed", queue=config.name, shard=config.uid, error=exc.message)

    async def _set_aside_or_drop(self, name: str, reason: str) -> None:
        """A local queue the catalog's entry of that name does not match: never dropped
        while it holds items (set aside instead, for an operator to look at), dropped when
        empty."""
        actor = next((a for a in self.manager.queues() if a.config.name == name), None)
        totals = actor.totals() if actor is not None else None
        if totals is not None and not (totals.ready or totals.leased or totals.scheduled):
            await self.manager.delete(name, force=True)
            log.info("cluster_stale_queue_removed", queue=name, detail=f"empty; {reason}")
            return
        await self.manager.set_aside(name, reason)


def _dead_queues_first(entries: Iterable[QueueEntry]) -> list[QueueEntry]:
    return sorted(entries, key=lambda e: (bool(e.config.dead_queue), e.config.name))
