"""Admin writes to the catalog (the admin frontend of the coordinator).

Every admin change is one etcd transaction that compares revisions: the queue key's
(no lost update between two admins on two nodes) and this node's member key's (no
write from a node whose membership lapsed: fenced). An admin call returns once this
node has applied its own change (reconcile_backend.py).
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from ..auth import ApiKey, Role, new_key
from ..clock import now_us
from ..errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, QueratorError, Unavailable
from ..logging import get_logger
from ..model import QueueConfig
from ..queue_admin import check_dead_queue, check_deletable, check_update, key_record
from . import failover, shard_cas
from .catalog import APPLY_TIMEOUT_S as _APPLY_TIMEOUT_S
from .catalog import CatalogCache, Keys
from .copy_moves import CATCH_UP_S, CopyMoves
from .etcd import Etcd, EtcdError, Txn
from .failover import Promoted
from .membership import Membership
from .placement import Home, QueueEntry, place, place_shard
from .shard_record import ShardRecord, default_min_in_sync

if TYPE_CHECKING:
    from .replica_roles import ShardRoles
    from .router import Router

log = get_logger("cluster")

# etcd 3.4 refuses a transaction of more than 128 operations (--max-txn-ops).
_TXN_OPS = 100
# UpdateQueue tries again while only a key it compared besides the queue's entry changed
# (a shard record's in-sync set moves on its own), for at most this long, each try a round
# trip to etcd after a random pause of up to 5 ms doubling to 100 ms. A bound on tries
# alone was not enough: with the record rewritten every ~4 ms (the race test), 1 of 30
# calls in a CI run lost 5 tries in a row, each read landing just before another write.
_CAS_RETRY_S = 5.0
_CAS_PAUSE_S = (0.005, 0.1)


class _UpdateConflict(FailedPrecondition):
    """An update's transaction lost its comparisons (AdminFrontend.update tells an
    admin's edit of the entry from a change of the other keys it compared)."""


class AdminFrontend(CopyMoves):
    """Part of Coordinator (coordinator.py holds the state and the wiring)."""

    node: str
    roles: ShardRoles
    router: Router
    etcd: Etcd
    keys: Keys
    catalog: CatalogCache
    membership: Membership

    # --replicas and --min-in-sync: for a CreateQueue that names none (0).
    default_replicas: int
    default_min_in_sync: int

    def _live(self) -> builtins.list[str]:
        return sorted(self.catalog.members)

    def _load(self) -> Counter[str]:
        """Partitions homed per node, over every queue: placement's tie-breaker."""
        return Counter(h.node for e in self.catalog.queues.values() for h in self.catalog.routed(e).homes)

    def _shard_load(self) -> tuple[Counter[str], Counter[str]]:
        """Per node: what it serves as primary (replicated queues, and partitions of one
        copy, which it serves alone), and the copies of replicated queues it keeps."""
        primaries: Counter[str] = Counter(h.node for e in self.catalog.queues.values() if not e.shard for h in e.homes)
        copies: Counter[str] = Counter()
        for record in self.catalog.shards.records():
            primaries[record.primary] += 1
            copies.update(record.replicas)
        return primaries, copies

    def _replication(self, config: QueueConfig) -> tuple[int, int]:
        """The queue's copies and minimum in-sync count: asked for, else the defaults."""
        replicas = config.replicas or self.default_replicas
        if replicas == 1:
            if config.min_in_sync > 1:
                raise InvalidArgument("queue.min_in_sync", f"must be at most replicas (1), got {config.min_in_sync}")
            return 1, 0
        if config.min_in_sync > replicas:
            raise InvalidArgument("queue.min_in_sync", f"must be at most replicas ({replicas}), got {config.min_in_sync}")
        return replicas, config.min_in_sync or min(self.default_min_in_sync, replicas) or default_min_in_sync(replicas)

    def _check_replicated_dead_queue(self, config: QueueConfig) -> None:
        """A replicated queue's dead letters are sent by whichever copy is primary: they
        go to a replicated dead-letter queue's primary (dead_letter_route.py). A one-copy
        dead-letter queue's part on the old primary's node would neither follow a
        failover nor see what the new primary sends again."""
        dead = self.catalog.queues.get(config.dead_queue) if config.dead_queue else None
        if config.replicas > 1 and dead is not None and not dead.shard and config.dead_queue != config.name:
            raise FailedPrecondition(
                f"queue.dead_queue: queue {config.dead_queue!r} keeps one copy; the dead_queue of a replicated queue "
                "(replicas > 1) must be replicated too"
            )

    def _fenced_txn(self) -> Txn:
        self.membership.check()
        return Txn().created_at(self.keys.member(self.node), self.membership.create_revision)

    async def _commit(self, txn: Txn, conflict: Callable[[], QueratorError]) -> int:
        try:
            ok, revision = await self.etcd.txn(txn)
        except EtcdError as exc:
            raise Unavailable(f"the cluster catalog (etcd) did not answer; nothing was changed: {exc}") from None
        if not ok:
            try:
                _, member = await self.etcd.get(self.keys.member(self.node))
            except EtcdError as exc:
                raise Unavailable(f"the cluster catalog (etcd) did not answer: {exc}") from None
            if member is None or member.create_revision != self.membership.create_revision:
                self.membership.lost()
                raise Unavailable(f"node {self.node!r} lost its cluster membership; nothing was changed, retry")
            raise conflict()
        await self.catalog.wait_applied(revision, _APPLY_TIMEOUT_S)
        return revision

    def _configs(self) -> dict[str, QueueConfig]:
        """Every queue's settings, by name: what the admin rules (queue_admin.py) read."""
        return {name: entry.config for name, entry in self.catalog.queues.items()}

    def _with_dead_queue(self, txn: Txn, config: QueueConfig, homes: Iterable[Home]) -> None:
        """Give the dead-letter queue a partition on every node that homes one of the
        queue's: dead letters go from a partition to the dead-letter queue's part on the
        same node. Added to ``txn``, which also compares the dead-letter queue's revision."""
        if not config.dead_queue:
            return
        target = self.catalog.queues[config.dead_queue]
        key = self.keys.queue(config.dead_queue)
        txn.modified_at(key, target.mod_revision)
        if target.shard:  # served by its primary alone, wherever the users' dead letters come from
            return
        have = {h.node for h in target.homes}
        added = list(target.homes)
        for node in sorted({h.node for h in homes} - have):
            added += place(1, [node], added)
        if len(added) > len(target.homes):
            grown = target.config.replace(partitions=len(added), updated_at_us=now_us())
            txn.put(key, dataclasses.replace(target, config=grown, homes=tuple(added)).encode())

    async def create(self, config: QueueConfig, visible: Callable[[str], bool] | None = None) -> QueueConfig:
        """As QueuesManager.create, in the catalog; ``visible``: what error texts may name."""
        check_dead_queue(config, self._configs(), visible)
        replicas, min_in_sync = self._replication(config)
        config = config.replace(replicas=replicas, min_in_sync=min_in_sync)
        self._check_replicated_dead_queue(config)
        txn = self._fenced_txn()
        live = self._live()
        if not live:
            raise Unavailable("no live node to place the queue's partitions on")
        if len(live) < replicas:
            raise FailedPrecondition(
                f"queue {config.name!r} needs {replicas} live nodes for its replicas, "
                f"the cluster has {len(live)} live ({', '.join(live)})"
            )
        now = now_us()
        config = config.replace(created_at_us=now, updated_at_us=now, uid=0, group=-1)
        key = self.keys.queue(config.name)
        if replicas > 1:
            copies = place_shard(replicas, live, *self._shard_load())
            uid = await self.catalog.shards.next_uid()
            entry = QueueEntry(
                config, tuple(Home(copies[0], p) for p in range(config.partitions)), config.partitions, shard=uid
            )
            shard = self.catalog.shards.key(uid)
            record = ShardRecord.new(uid, config.name, copies, min_in_sync)
            txn.created_at(shard, 0).put(shard, record.encode())
        else:
            entry = QueueEntry(config, tuple(place(config.partitions, live, load=self._load())), config.partitions)
        txn.created_at(key, 0).put(key, entry.encode()).delete(self.keys.deleted(config.name))
        self._with_dead_queue(txn, entry.config, entry.homes)
        await self._commit(
            txn,
            lambda: AlreadyExists(f"queue {config.name!r} already exists")
            if config.name in self.catalog.queues or not config.dead_queue
            else FailedPrecondition(f"queue {config.dead_queue!r} was changed meanwhile; retry"),
        )
        if entry.shard:
            log.info("cluster_queue_created", queue=config.name, shard=entry.shard, copies=copies)
        else:
            log.info("cluster_queue_created", queue=config.name, homes=[h.node for h in entry.homes])
        return self.get(config.name)

    def get(self, name: str) -> QueueConfig:
        entry = self.catalog.queues.get(name)
        if entry is None:
            raise NotFound(f"queue {name!r} does not exist")
        return entry.config

    def list(
        self, after: str, limit: int, visible: Callable[[str], bool] | None = None
    ) -> tuple[builtins.list[QueueConfig], bool]:
        names = sorted(n for n in self.catalog.queues if n > after and (visible is None or visible(n)))
        return [self.catalog.queues[n].config for n in names[:limit]], len(names) > limit

    async def update(
        self, name: str, changes: dict[str, object], visible: Callable[[str], bool] | None = None
    ) -> QueueConfig:
        """Change the queue's settings. A replicated queue's shard record, changed in the
        same transaction, also changes without an admin: its primary's in-sync set
        changes, a copy restored (copies_restore.py), a copy claimed. Such a change
        between the read and the write is no admin's conflicting edit: the call is made
        again on the record as it is now (for at most ``_CAS_RETRY_S``, after a random
        pause so that a try does not keep landing in step with the other writer), rather
        than failing the user's call."""
        deadline = time.monotonic() + _CAS_RETRY_S
        for attempt in itertools.count(1):
            entry = self.catalog.queues.get(name)
            try:
                return await self._update_once(name, changes, visible)
            except _UpdateConflict:
                if entry is None or time.monotonic() > deadline or not await self._entry_unchanged(entry):
                    raise
                log.info("cluster_update_retried", queue=name, attempt=attempt, detail="its shard record changed meanwhile")
                first, most = _CAS_PAUSE_S
                await asyncio.sleep(random.uniform(0, min(most, first * 2 ** (attempt - 1))))
        raise AssertionError("unreachable")  # the loop returns or raises

    async def _entry_unchanged(self, entry: QueueEntry) -> bool:
        """Whether the queue's entry in etcd is still ``entry`` (then what changed was
        another key the update compared: its shard record, its dead-letter queue's
        entry); if so, once this node's catalog has caught up with etcd."""
        try:
            revision, kv = await self.etcd.get(self.keys.queue(entry.config.name))
        except EtcdError as exc:
            raise Unavailable(f"the cluster catalog (etcd) did not answer: {exc}") from None
        if kv is None or kv.mod_revision != entry.mod_revision:
            return False
        await self.catalog.wait_applied(revision, _APPLY_TIMEOUT_S)
        return True

    async def _update_once(
        self, name: str, changes: dict[str, object], visible: Callable[[str], bool] | None
    ) -> QueueConfig:
        txn = self._fenced_txn()
        entry = self.catalog.queues.get(name)
        if entry is None:
            raise NotFound(f"queue {name!r} does not exist")
        current = entry.config
        updated = current.replace(**changes, updated_at_us=now_us())
        check_update(current, updated)
        if "dead_queue" in changes:
            check_dead_queue(updated, self._configs(), visible)
            self._check_replicated_dead_queue(updated)
        homes = entry.homes
        if updated.partitions > current.partitions:
            if entry.shard:  # every copy holds every partition, at its own number
                homes = entry.homes + tuple(Home(entry.homes[0].node, p) for p in range(current.partitions, updated.partitions))
            else:
                homes = homes + tuple(place(updated.partitions - current.partitions, self._live(), homes, self._load()))
        new = dataclasses.replace(entry, config=updated, homes=homes)
        key = self.keys.queue(name)
        txn.modified_at(key, entry.mod_revision).put(key, new.encode())
        if entry.shard and (updated.min_in_sync != current.min_in_sync or updated.replicas != current.replicas):
            # The record is what the primary's gate reads: changed in the same Txn, from
            # the version read (a concurrent ISR change makes this one retry).
            record = self.catalog.shards.get(entry.shard)
            if record is None:
                raise Unavailable(f"queue {name!r}: its shard record is not known here yet; retry")
            shard = self.catalog.shards.key(entry.shard)
            changed = dataclasses.replace(record, min_isr=updated.min_in_sync)
            for node in self._copies_to_add(record, updated.replicas) if updated.replicas > current.replicas else ():
                # Out of the in-sync set: the primary fills each and counts it once caught up.
                changed = shard_cas.with_copy(changed, node)
            txn.modified_at(shard, record.mod_revision).put(shard, changed.encode())
        self._with_dead_queue(txn, updated, homes)
        await self._commit(
            txn, lambda: _UpdateConflict(f"queue {name!r} was changed by another admin meanwhile; read it again and retry")
        )
        return self.get(name)

    def _copies_to_add(self, record: ShardRecord, replicas: int) -> builtins.list[str]:
        """The live nodes that take the copies raising a queue to ``replicas`` needs;
        FAILED_PRECONDITION naming the counts when the live nodes without a copy are too few."""
        wanted = replicas - len(record.replicas)
        if wanted <= 0:
            return []
        spare = self._spare_nodes(record)
        if len(spare) < wanted:
            live = self._live()
            raise FailedPrecondition(
                f"queue {record.queue!r} needs {replicas} live nodes for its replicas, the cluster has {len(live)} live "
                f"({', '.join(live)}), {len(spare)} of them without a copy"
            )
        return spare[:wanted]

    async def delete(self, name: str, force: bool, visible: Callable[[str], bool] | None = None) -> None:
        """Delete the queue everywhere (Router.delete checked first that it is empty,
        unless forced: the homes' storage goes when they apply the change)."""
        txn = self._fenced_txn()
        entry = self.catalog.queues.get(name)
        if entry is None:
            raise NotFound(f"queue {name!r} does not exist")
        check_deletable(name, self._configs().values(), visible)
        key = self.keys.queue(name)
        txn.modified_at(key, entry.mod_revision).delete(key).put(self.keys.deleted(name), b"{}")
        if entry.shard:
            txn.delete(self.catalog.shards.key(entry.shard))
        await self._commit(
            txn, lambda: FailedPrecondition(f"queue {name!r} was changed by another admin meanwhile; retry")
        )
        log.info("cluster_queue_deleted", queue=name)

    async def create_key(self, role: Role, queues: builtins.list[str], description: str) -> tuple[ApiKey, str]:
        key, token = new_key(role, queues, description, now_us())
        record = key_record(key)
        name = self.keys.api_key(key.key_id)
        txn = self._fenced_txn().created_at(name, 0).put(name, json.dumps(record).encode())
        await self._commit(txn, lambda: AlreadyExists(f"key {key.key_id} exists"))
        return key, token

    async def revoke_key(self, key_id: str) -> None:
        if key_id not in self.catalog.api_keys:
            raise NotFound(f"key {key_id!r} does not exist")
        name = self.keys.api_key(key_id)
        txn = self._fenced_txn().delete(name)
        await self._commit(txn, lambda: NotFound(f"key {key_id!r} does not exist"))

    async def retire(self, node: str, promote_behind: bool = False) -> tuple[int, int, builtins.list[Promoted]]:
        """Recreate ``node``'s partitions, empty, on the live nodes (its items are lost),
        and its copies of replicated queues from their other copies: (partitions
        recreated, copies made again, copies promoted). ``promote_behind``: a queue
        whose only in-sync copy ``node`` held gets its most advanced surviving copy as
        primary (failover.promote_behind: what ``node`` acknowledged after it is lost);
        without it such a queue makes the retire refuse."""
        if not node:
            raise InvalidArgument("node_id", "is required")
        if node == self.node or node in self.catalog.members:
            raise FailedPrecondition(f"node {node!r} is live; only a dead node can be retired")
        # Replicated queues are not recreated here: their copies elsewhere hold them.
        owned = [e for e in self.catalog.queues.values() if not e.shard and any(h.node == node for h in e.homes)]
        copies = sorted((r for r in self.catalog.shards.records() if node in r.replicas), key=lambda r: r.queue)
        if not owned and not copies and node in self.catalog.retired:
            return 0, 0, []
        if not owned and not copies:
            # Retiring bans the id for ever: an id the catalog does not know (a typo) must
            # not be banned, and a node that homes nothing has nothing to give up.
            raise NotFound(
                f"node_id: node {node!r} homes no partition and is not a member of the cluster "
                "(ClusterInfo lists the nodes); nothing to retire"
            )
        live = self._live()
        if not live:
            raise Unavailable("no live node to recreate the partitions on")
        # A queue whose primary the node was and of which no live node keeps a copy has
        # no survivor to fill a new copy from: only the data-loss retire re-makes it.
        lost = [r for r in copies if r.primary == node and not self._live_copies(r, node)]
        if lost and not promote_behind:
            raise FailedPrecondition(
                f"queue {lost[0].queue!r}: no live node keeps a copy of it (copies on "
                f"{', '.join(lost[0].replicas)}, none live); nothing was retired (bring one of those nodes back; "
                "or retire with promote_copies_behind (cluster retire --discard-data), which re-makes the queue "
                "empty on the live nodes: its items are lost, also those on the other dead nodes)"
            )
        promoted: builtins.list[Promoted] = []
        remade = await self._drop_copies(node, [r for r in copies if r not in lost], promote_behind, promoted)
        recreated = 0
        for record in lost:
            recreated += await self._remake_empty(record, node)
        if not owned:
            await self._commit(
                self._fenced_txn().created_at(self.keys.member(node), 0).put(self.keys.retired(node), b"{}"),
                lambda: FailedPrecondition(f"node {node!r} came back meanwhile; it was not retired"),
            )
            log.warning(
                "cluster_node_retired_by_admin",
                node=node,
                partitions_recreated=recreated,
                copies_dropped=len(copies),
                copies_remade=remade,
            )
            return recreated, remade, promoted
        queues = self.catalog.queues
        work: dict[str, builtins.list[Home]] = {}
        moved = 0
        for entry in owned:
            kept = [h for h in entry.homes if h.node != node]
            homes: builtins.list[Home] = []
            for h in entry.homes:
                if h.node == node:
                    (new,) = place(1, live, kept + homes)
                    homes.append(new)
                    moved += 1
                else:
                    homes.append(h)
            work[entry.config.name] = homes
        # Dead-letter queues follow their users onto the nodes their partitions moved to.
        for entry in list(queues.values()):
            target = entry.config.dead_queue
            if not target or target not in queues or queues[target].shard:
                continue
            users_nodes = {h.node for h in work.get(entry.config.name, entry.homes)}
            dead_homes = list(work.get(target, queues[target].homes))
            for missing in sorted(users_nodes - {h.node for h in dead_homes}):
                dead_homes += place(1, [missing], dead_homes)
            if target in work or len(dead_homes) > len(queues[target].homes):
                work[target] = dead_homes
        # The first transaction marks the node retired (it can never come back) while it
        # is still not registered; later ones, if the queues do not fit in one, move the rest.
        txn = self._fenced_txn().created_at(self.keys.member(node), 0).put(self.keys.retired(node), b"{}")
        ops = 1
        for name, homes in work.items():
            entry = queues[name]
            key = self.keys.queue(name)
            config = entry.config.replace(partitions=len(homes))
            txn.modified_at(key, entry.mod_revision).put(key, dataclasses.replace(entry, config=config, homes=tuple(homes)).encode())
            ops += 1
            if ops >= _TXN_OPS:
                await self._commit(txn, lambda: FailedPrecondition("the catalog changed meanwhile; retry"))
                txn, ops = self._fenced_txn().created_at(self.keys.member(node), 0), 0
        if ops:
            await self._commit(txn, lambda: FailedPrecondition("the catalog changed meanwhile (or the node came back); retry"))
        log.warning("cluster_node_retired_by_admin", node=node, partitions_recreated=moved + recreated, copies_remade=remade)
        return moved + recreated, remade, promoted

    def _live_copies(self, record: ShardRecord, node: str) -> builtins.list[str]:
        return [n for n in record.replicas if n != node and n in self.catalog.members]

    async def _remake_empty(self, record: ShardRecord, node: str) -> int:
        """Re-make a replicated queue none of whose copies is live, empty, on the live
        nodes (its items are lost): a new shard, as CreateQueue makes one, under a new
        uid, so that no item id a worker still holds names an item of the new shard, and
        so that a dead node keeping a copy of the old one drops it when it comes back
        (reconcile: its shard is no longer the queue's). Its copies are the queue's
        ``replicas`` or the live nodes, when fewer (copies_restore.py adds the others
        later); the queue entry, the old record and the new one change in one
        transaction, made only while ``node`` is still not registered. Returns the
        queue's partitions."""
        entry = self.catalog.queues.get(record.queue)
        if entry is None or entry.shard != record.uid:
            return 0  # deleted or re-made meanwhile: nothing of it left to lose
        live = self._live()
        count = min(entry.config.replicas, len(live))
        copies = place_shard(count, live, *self._shard_load())
        uid = await self.catalog.shards.next_uid()
        fresh = dataclasses.replace(
            ShardRecord.new(uid, record.queue, copies, min(entry.config.min_in_sync, count)),
            generation=entry.generation,
            epoch=record.epoch + 1,
        )
        homes = tuple(Home(copies[0], p) for p in range(len(entry.homes)))
        key, old, new = self.keys.queue(record.queue), self.catalog.shards.key(record.uid), self.catalog.shards.key(uid)
        txn = (
            self._fenced_txn()
            .created_at(self.keys.member(node), 0)
            .modified_at(key, entry.mod_revision)
            .put(key, dataclasses.replace(entry, homes=homes, shard=uid).encode())
            .modified_at(old, record.mod_revision)
            .delete(old)
            .created_at(new, 0)
            .put(new, fresh.encode())
        )
        await self._commit(
            txn, lambda: FailedPrecondition(f"queue {record.queue!r} changed meanwhile (or {node!r} came back); retry")
        )
        log.error(
            "shard_remade_empty",
            queue=record.queue,
            old_shard=record.uid,
            shard=uid,
            copies=copies,
            lost_copies=list(record.replicas),
            detail=f"no live node kept a copy when {node!r} was retired: the queue's items are lost",
        )
        return len(entry.homes)

    async def _drop_copies(
        self, node: str, copies: builtins.list[ShardRecord], promote_behind: bool, promoted: builtins.list[Promoted]
    ) -> int:
        """Take a node being retired out of each replicated queue it keeps a copy of: a
        queue it is still primary of goes to another live in-sync copy first; one whose
        only in-sync copy it holds is refused (nothing else has what it acknowledged)
        before anything changes, unless ``promote_behind`` (its most advanced surviving
        copy is elected, listed in ``promoted``). Each copy is made again on a live node
        without one (added before the dead one is dropped, so the queue's min_in_sync
        stays), filled from the survivors by its primary; with no such node, or with the
        primary down too, the queue keeps one copy fewer (its min_in_sync capped at what
        is left). Returns the copies made again."""

        def in_sync_elsewhere(record: ShardRecord) -> builtins.list[str]:
            return [n for n, i in record.isr if n != node and i and n in self.catalog.members]

        alone = [r for r in copies if r.primary == node and not in_sync_elsewhere(r)]
        if alone and not promote_behind:
            raise FailedPrecondition(
                f"queue {alone[0].queue!r}: node {node!r} holds its only in-sync copy; nothing was retired "
                "(bring the node back, or delete the queue; or retire it with promote_copies_behind "
                "(cluster retire --discard-data), which makes the most advanced other copy the primary and "
                "loses what the node acknowledged after that copy's position)"
            )
        planned: Counter[str] = Counter()
        for record in copies:
            if record.primary == node:
                others = in_sync_elsewhere(record)
                if others:
                    record = await self._hand_over(record, others[0], leaving=node)
                else:
                    record, copy = await failover.promote_behind(
                        record, node, self.node, self.roles.host.shards, self.catalog.shards, self.router.peers, self.router.live
                    )
                    promoted.append(copy)
                    await self.catalog.wait_applied(record.mod_revision, _APPLY_TIMEOUT_S)
            # A copy is filled by its primary: with the primary down as well, one added now
            # would stay empty, and be what a later retire of the primary promotes. The
            # primary adds it once back (copies_restore.py). None either when the copies
            # left keep the queue's count: a move under way (cut short by its deadline or
            # its node's death) had added the node's successor already, or this retire,
            # interrupted and run again, did.
            entry = self.catalog.queues.get(record.queue)
            short = entry is None or len(record.replicas) - 1 < entry.config.replicas
            spare = self._spare_nodes(record, planned) if short and record.primary in self.catalog.members else []
            if spare:
                record = await self._add_copy(record, spare[0])
                planned[spare[0]] += 1
            await self._drop_copy(record, node)
        return sum(planned.values())

    # -- replicated queues: hand-overs ------------------------------------------------

    def _in_sync_here(self, record: ShardRecord, node: str) -> bool:
        """Whether ``node`` is live and holds a copy claimed in the record's in-sync set."""
        return node in self.catalog.members and any(n == node and i for n, i in record.isr)

    async def move(self, name: str, node: str, source: str = "", within: float = CATCH_UP_S) -> ShardRecord:
        """Make ``node`` serve queue ``name``, or with ``source``, move ``source``'s copy to
        ``node``. A node holding an in-sync copy: the primary is handed over (an election
        with the in-sync set unchanged: every member has every acknowledged change, so
        nothing acknowledged is lost and the old primary stays a copy). A node holding
        none: a copy is added there and caught up (waited for up to ``within`` s), the
        primary handed over to it if the moved copy (``source``, else the primary's) was
        the primary, and the moved copy dropped."""
        if not node:
            raise InvalidArgument("node_id", "is required")
        entry = self.catalog.queues.get(name)
        if entry is None:
            raise NotFound(f"queue {name!r} does not exist")
        record = self.catalog.shards.get(entry.shard) if entry.shard else None
        if record is None:
            raise FailedPrecondition(
                f"queue {name!r} keeps one copy of each partition (replicas 1): its partitions cannot move"
            )
        if record.move is not None and record.move.target == node:
            # A move there under way (this call made again, or the queue's primary
            # finishing one cut short): once it is over, this call is done, or starts
            # it again if it was undone (its new copy's node died before it caught up).
            await self._moved(record.uid, record.move, within)
            return await self.move(name, node, source, within)
        if source:
            if source == node:
                raise InvalidArgument("from_node_id", f"names the target node {node!r} itself")
            if source not in record.replicas:
                if node in record.replicas:  # this move made already (the call again): done
                    return record
                raise FailedPrecondition(
                    f"from_node_id: node {source!r} holds no copy of queue {name!r} (copies: {', '.join(record.replicas)})"
                )
            # ``node`` holding a copy while the queue has one more than it keeps and no
            # move recorded: a move cut short by an older version, which recorded none;
            # this call finishes it.
            if node in record.replicas and (record.move is not None or len(record.replicas) <= entry.config.replicas):
                raise FailedPrecondition(
                    f"node {node!r} holds a copy of queue {name!r} already (copies: {', '.join(record.replicas)}); "
                    "a copy moves to a node without one"
                )
            return await self._move_copy(record, source, node, within)
        # A node without a copy, or one a move of an older version cut short added (the
        # queue has a copy more than it keeps, no move recorded): the primary's copy moves there.
        legacy_cut_short = record.move is None and len(record.replicas) > entry.config.replicas  # no move recorded
        if node not in record.replicas or (legacy_cut_short and record.primary != node):
            return await self._move_copy(record, record.primary, node, within)
        if record.primary == node:
            return record
        if not self._in_sync_here(record, node):
            state = "not live" if node not in self.catalog.members else "not in sync"
            raise FailedPrecondition(
                f"the copy of queue {name!r} on node {node!r} is {state} "
                f"(in sync: {', '.join(n for n, i in record.isr if i) or 'none'}); retry once it is"
            )
        return await self._hand_over(record, node)

    async def drain(
        self, node: str, leaving: bool = False, copies: bool = False, within: float = CATCH_UP_S
    ) -> tuple[builtins.list[str], builtins.list[str]]:
        """Hand every replicated queue whose primary is ``node`` over to another live
        in-sync copy (the one serving the fewest primaries): (moved, kept with why).
        ``leaving``: ``node`` is stopping, so it also leaves the in-sync sets it can.
        ``copies``: move its copies too, each to a live node without one (added, caught
        up, then ``node``'s dropped; a primary with no other in-sync copy is handed to
        its new copy); a copy stays when every live node has one already."""
        if not node:
            raise InvalidArgument("node_id", "is required")
        if node not in self.catalog.members and not any(node in r.replicas for r in self.catalog.shards.records()):
            raise NotFound(f"node_id: node {node!r} is not a member of the cluster and holds no copy")
        moved: builtins.list[str] = []
        kept: builtins.list[str] = []
        for record in sorted(self.catalog.shards.records(), key=lambda r: r.queue):
            if record.primary != node:
                continue
            primaries, _ = self._shard_load()
            others = sorted(
                (n for n in record.replicas if n != node and self._in_sync_here(record, n)),
                key=lambda n: (primaries[n], n),
            )
            if not others:
                if not (copies and self._spare_nodes(record)):  # else its copy's move hands it over
                    kept.append(f"{record.queue}: no other live in-sync copy")
                continue
            try:
                await self._hand_over(record, others[0], node if leaving else "")
            except FailedPrecondition as exc:
                kept.append(f"{record.queue}: {exc.message}")
                continue
            moved.append(record.queue)
        if copies:
            await self._drain_copies(node, within, moved, kept)
        return sorted(set(moved)), sorted(kept)

    async def _drain_copies(self, node: str, within: float, moved: builtins.list[str], kept: builtins.list[str]) -> None:
        """Move ``node``'s copies to live nodes without one, all at once (each waits for
        its own catch-up)."""
        planned: Counter[str] = Counter()
        jobs: builtins.list[tuple[str, Awaitable[ShardRecord]]] = []
        for record in sorted(self.catalog.shards.records(), key=lambda r: r.queue):
            if node not in record.replicas:
                continue
            spare = self._spare_nodes(record, planned)
            if not spare:
                kept.append(f"{record.queue}: its copy stays, every live node has one")
                continue
            planned[spare[0]] += 1
            jobs.append((record.queue, self._move_copy(record, node, spare[0], within)))
        results = await asyncio.gather(*(job for _, job in jobs), return_exceptions=True)
        for (queue, _), result in zip(jobs, results, strict=True):
            if isinstance(result, QueratorError):
                kept.append(f"{queue}: {result.message}")
            elif isinstance(result, BaseException):
                raise result
            else:
                moved.append(queue)
