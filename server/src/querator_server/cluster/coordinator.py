"""The cluster coordinator: beside the queues manager, it keeps the node's local
queues in step with the catalog in etcd and makes the admin changes there.

Every admin change is one etcd transaction that compares revisions: the queue key's
(no lost update between two admins on two nodes) and this node's member key's (no
write from a node whose membership lapsed). The local storage follows the catalog
through ``reconcile``, run after every catalog change and at start, so a crash
between the etcd write and the local change is repaired by the next run.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from ..auth import ApiKey, Role, new_key
from ..clock import now_us
from ..errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, QueratorError, Unavailable
from ..logging import get_logger
from ..manager import QueuesManager
from ..model import QueueConfig
from .catalog import CatalogCache, Keys
from .etcd import Endpoint, Etcd, EtcdError, Txn
from .forwarding import PeerTls
from .membership import Membership
from .placement import GENERATION_MARK, SHARED_FIELDS, Home, QueueEntry, place
from .router import Router

log = get_logger("cluster")

# How long an admin call waits for this node to apply its own change.
_APPLY_TIMEOUT_S = 10.0
# etcd 3.4 refuses a transaction of more than 128 operations (--max-txn-ops).
_TXN_OPS = 100


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    url: str  # etcd://host:port/prefix
    node_id: str
    advertise: str  # host:port other nodes and clients reach this node at
    lease_ttl_s: int = 5
    # TLS for forwarded calls: the CA bundle that signed the other nodes' certificates
    # (None: the system's roots) and this node's own chain and key, presented as a
    # client certificate; None: plaintext.
    peer_tls: PeerTls | None = None


class Coordinator:
    def __init__(
        self,
        manager: QueuesManager,
        settings: ClusterSettings,
        on_standing: Callable[[bool], Awaitable[None]] | None = None,
    ) -> None:
        self.manager = manager
        self.settings = settings
        self.node = settings.node_id
        endpoint = Endpoint.parse(settings.url)
        self.etcd = Etcd(endpoint.targets)
        self.keys = Keys(endpoint.prefix)
        self.catalog = CatalogCache(self.etcd, self.keys, self.reconcile)
        self._on_standing = on_standing
        self.membership = Membership(
            self.etcd, self.keys.member(self.node), self.node, settings.advertise, settings.lease_ttl_s, self._standing
        )
        self.router = Router(self.node, self.catalog, self.lookup, settings.peer_tls)
        self._reconcile_lock = asyncio.Lock()
        self.retired = False
        self._foreign: set[str] = set()  # local queues the catalog never had (warned once)
        # Cluster queues this node cannot serve: its data directory has an older queue of
        # the same name (from before it joined).
        self._blocked: set[str] = set()

    # -- start and stop ------------------------------------------------------------

    async def start(self, timeout: float = 30.0) -> None:
        try:
            _, retired = await self.etcd.get(self.keys.retired(self.node))
            if retired is not None:
                raise OSError(
                    f"node {self.node!r} was retired from the cluster (its partitions were recreated "
                    "elsewhere); start it with a new node id and an empty data directory"
                )
            await self.membership.register(timeout=timeout)
            await self._share_token_secret()
            await self.catalog.load()
        except EtcdError as exc:
            raise OSError(f"cannot reach the cluster catalog at {self.settings.url}: {exc}") from exc
        except QueratorError as exc:
            raise OSError(str(exc)) from exc
        self.catalog.start()
        self.membership.start()
        log.info("cluster_joined", node=self.node, advertise=self.settings.advertise, revision=self.catalog.revision)

    async def _share_token_secret(self) -> None:
        """Every node signs page tokens with one secret (the first node's), so a listing
        started on one node goes on on any other."""
        key = self.keys.token_secret
        await self.etcd.txn(Txn().created_at(key, 0).put(key, os.urandom(32)))
        _, kv = await self.etcd.get(key)
        if kv is not None and kv.value:
            self.manager.token_secret = kv.value

    async def stop(self) -> None:
        await self.catalog.stop()
        await self.membership.stop()
        await self.router.close()
        await self.etcd.close()

    async def _standing(self, standing: bool) -> None:
        if standing:
            self.catalog.rewatch()  # a stream left silent by a paused etcd is not trusted
        if self._on_standing is not None:
            await self._on_standing(standing)

    # -- the local storage follows the catalog --------------------------------------

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
            for entry in _dead_queues_first(catalog.queues.values()):
                await self._apply(entry)
            for config in [actor.config for actor in self.manager.queues()]:
                if config.name in catalog.queues:
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

    def _sync_keys(self) -> None:
        """The manager's key ring holds the catalog's keys (changed in place: the ring
        keeps its bootstrap-token settings and what it has already logged)."""
        ring = self.manager.keyring
        wanted = {key_id: _key(record) for key_id, record in self.catalog.api_keys.items()}
        for key in ring.keys():
            if wanted.get(key.key_id) != key:
                ring.remove(key.key_id)
        held = {key.key_id for key in ring.keys()}
        for key_id, key in wanted.items():
            if key_id not in held:
                ring.add(key)

    async def _apply(self, entry: QueueEntry) -> None:
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
                # A queue of this name that was deleted while this node was away: its
                # items must not show up in the new queue.
                await self.manager.delete(name, force=True)
                log.info("cluster_stale_queue_removed", queue=name)
                local = None
            if count == 0:
                return
            config = entry.config.replace(partitions=count, reference=entry.local_reference)
            if local is None:
                await self.manager.create(config)
                log.info("cluster_queue_created_here", queue=name, partitions=count)
                return
            changes: dict[str, object] = {
                f: getattr(config, f) for f in SHARED_FIELDS if f not in ("created_at_us", "updated_at_us")
                and getattr(config, f) != getattr(local, f)
            }
            if local.partitions < count:
                changes["partitions"] = count
            if changes:
                await self.manager.update(name, changes)
        except QueratorError as exc:
            log.error("cluster_reconcile_failed", queue=name, error=exc.message)

    async def lookup(self, name: str) -> QueueEntry:
        """The queue's entry; read from etcd when the cache does not have it yet (a queue
        just created on another node), so a call right after a create finds it."""
        if self.retired:
            raise FailedPrecondition(f"node {self.node!r} was retired from the cluster; it serves nothing")
        if name in self._blocked:
            raise FailedPrecondition(
                f"node {self.node!r} holds a queue {name!r} from before it joined the cluster and cannot serve "
                "the cluster's queue of that name; move that data away or send the call to another node"
            )
        entry = self.catalog.queues.get(name)
        if entry is not None:
            if entry.mod_revision > self.catalog.applied:  # seen, but not yet applied to local storage
                await self.catalog.wait_applied(entry.mod_revision, _APPLY_TIMEOUT_S)
            return entry
        if self.membership.fenced:  # etcd is likely out of reach: answer now, not after its timeout
            raise NotFound(f"queue {name!r} does not exist (as far as this node knows: it cannot reach the catalog)")
        try:
            _, kv = await self.etcd.get(self.keys.queue(name))
        except EtcdError:
            kv = None
        if kv is None:
            raise NotFound(f"queue {name!r} does not exist")
        await self.catalog.wait_applied(kv.mod_revision, _APPLY_TIMEOUT_S)
        return self.catalog.queues.get(name) or QueueEntry.decode(name, kv.value, kv.mod_revision, kv.create_revision)

    # -- admin ---------------------------------------------------------------------

    def _live(self) -> builtins.list[str]:
        return sorted(self.catalog.members)

    def _load(self) -> Counter[str]:
        """Partitions homed per node, over every queue: placement's tie-breaker."""
        return Counter(h.node for e in self.catalog.queues.values() for h in e.homes)

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

    def _users_text(self, name: str, visible: Callable[[str], bool] | None) -> str:
        """The queues using ``name`` as their dead_queue, as an error text names them to a
        caller who may see only ``visible`` ones (as manager._users_text)."""
        users = sorted(e.config.name for e in self.catalog.queues.values() if e.config.dead_queue == name)
        users = [u for u in users if u != name]
        shown = users if visible is None else [u for u in users if visible(u)]
        hidden = len(users) - len(shown)
        named = ", ".join(map(repr, shown[:5])) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
        if not hidden:
            return named
        others = f"{hidden} queue{'s' if hidden > 1 else ''} your key may not see"
        return f"{named} and {others}" if named else others

    def _check_dead_queue(self, config: QueueConfig, visible: Callable[[str], bool] | None = None) -> None:
        """The single server's rules (manager._check_dead_queue), against the catalog."""
        queues = self.catalog.queues
        users = self._users_text(config.name, visible)
        dead = config.dead_queue
        if not dead:
            return
        if dead == config.name:
            raise InvalidArgument("queue.dead_queue", "a queue cannot be its own dead_queue")
        target = queues.get(dead)
        if target is None:
            raise InvalidArgument("queue.dead_queue", f"queue {dead!r} does not exist; create it first")
        if target.config.dead_queue:
            raise InvalidArgument(
                "queue.dead_queue", f"queue {dead!r} has a dead_queue of its own; a dead-letter queue may not"
            )
        if users:
            raise FailedPrecondition(
                f"queue {config.name!r} is the dead_queue of {users} and so cannot have a dead_queue of its own"
            )

    def _with_dead_queue(self, txn: Txn, config: QueueConfig, homes: Iterable[Home]) -> None:
        """Give the dead-letter queue a partition on every node that homes one of the
        queue's: dead letters go from a partition to the dead-letter queue's part on the
        same node. Added to ``txn``, which also compares the dead-letter queue's revision."""
        if not config.dead_queue:
            return
        target = self.catalog.queues[config.dead_queue]
        have = {h.node for h in target.homes}
        added = list(target.homes)
        for node in sorted({h.node for h in homes} - have):
            added += place(1, [node], added)
        key = self.keys.queue(config.dead_queue)
        txn.modified_at(key, target.mod_revision)
        if len(added) > len(target.homes):
            grown = target.config.replace(partitions=len(added), updated_at_us=now_us())
            txn.put(key, QueueEntry(grown, tuple(added)).encode())

    async def create(self, config: QueueConfig, visible: Callable[[str], bool] | None = None) -> QueueConfig:
        """As QueuesManager.create, in the catalog; ``visible``: what error texts may name."""
        self._check_dead_queue(config, visible)
        txn = self._fenced_txn()
        live = self._live()
        if not live:
            raise Unavailable("no live node to place the queue's partitions on")
        now = now_us()
        entry = QueueEntry(
            config.replace(created_at_us=now, updated_at_us=now, uid=0, group=-1),
            tuple(place(config.partitions, live, load=self._load())),
        )
        key = self.keys.queue(config.name)
        txn.created_at(key, 0).put(key, entry.encode()).delete(self.keys.deleted(config.name))
        self._with_dead_queue(txn, entry.config, entry.homes)
        await self._commit(
            txn,
            lambda: AlreadyExists(f"queue {config.name!r} already exists")
            if config.name in self.catalog.queues or not config.dead_queue
            else FailedPrecondition(f"queue {config.dead_queue!r} was changed meanwhile; retry"),
        )
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
        txn = self._fenced_txn()
        entry = self.catalog.queues.get(name)
        if entry is None:
            raise NotFound(f"queue {name!r} does not exist")
        current = entry.config
        updated = current.replace(**changes, updated_at_us=now_us())
        if updated.lease_timeout_us > updated.expire_timeout_us:
            raise InvalidArgument("queue.lease_timeout", "must not be longer than expire_timeout")
        if updated.partitions < current.partitions:
            raise FailedPrecondition(
                f"requested_partitions cannot be lowered from {current.partitions} to {updated.partitions}"
            )
        if "dead_queue" in changes:
            self._check_dead_queue(updated, visible)
        homes = entry.homes
        if updated.partitions > current.partitions:
            homes = homes + tuple(place(updated.partitions - current.partitions, self._live(), homes, self._load()))
        new = QueueEntry(updated, homes)
        key = self.keys.queue(name)
        txn.modified_at(key, entry.mod_revision).put(key, new.encode())
        self._with_dead_queue(txn, updated, homes)
        await self._commit(
            txn,
            lambda: FailedPrecondition(
                f"queue {name!r} was changed by another admin meanwhile; read it again and retry"
            ),
        )
        return self.get(name)

    async def delete(self, name: str, force: bool, visible: Callable[[str], bool] | None = None) -> None:
        """Delete the queue everywhere (Router.delete checked first that it is empty,
        unless forced: the homes' storage goes when they apply the change)."""
        txn = self._fenced_txn()
        entry = self.catalog.queues.get(name)
        if entry is None:
            raise NotFound(f"queue {name!r} does not exist")
        if users := self._users_text(name, visible):
            raise FailedPrecondition(f"queue {name!r} is the dead_queue of {users}")
        key = self.keys.queue(name)
        txn.modified_at(key, entry.mod_revision).delete(key).put(self.keys.deleted(name), b"{}")
        await self._commit(
            txn, lambda: FailedPrecondition(f"queue {name!r} was changed by another admin meanwhile; retry")
        )
        log.info("cluster_queue_deleted", queue=name)

    async def create_key(self, role: Role, queues: builtins.list[str], description: str) -> tuple[ApiKey, str]:
        key, token = new_key(role, queues, description, now_us())
        record = {
            "key_id": key.key_id,
            "role": int(key.role),
            "queues": list(key.queues),
            "description": key.description,
            "created_at_us": key.created_at_us,
            "secret_sha256": key.secret_hash,
        }
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

    async def retire(self, node: str) -> int:
        """Recreate ``node``'s partitions, empty, on the live nodes; its items are lost."""
        if not node:
            raise InvalidArgument("node_id", "is required")
        if node == self.node or node in self.catalog.members:
            raise FailedPrecondition(f"node {node!r} is live; only a dead node can be retired")
        owned = [e for e in self.catalog.queues.values() if any(h.node == node for h in e.homes)]
        if not owned and node in self.catalog.retired:
            return 0
        live = self._live()
        if not live:
            raise Unavailable("no live node to recreate the partitions on")
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
            if not target or target not in queues:
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
            txn.modified_at(key, entry.mod_revision).put(key, QueueEntry(config, tuple(homes)).encode())
            ops += 1
            if ops >= _TXN_OPS:
                await self._commit(txn, lambda: FailedPrecondition("the catalog changed meanwhile; retry"))
                txn, ops = self._fenced_txn().created_at(self.keys.member(node), 0), 0
        if ops:
            await self._commit(txn, lambda: FailedPrecondition("the catalog changed meanwhile (or the node came back); retry"))
        log.warning("cluster_node_retired_by_admin", node=node, partitions_recreated=moved)
        return moved


def _dead_queues_first(entries: Iterable[QueueEntry]) -> list[QueueEntry]:
    return sorted(entries, key=lambda e: (bool(e.config.dead_queue), e.config.name))


def _key(record: dict[str, object]) -> ApiKey:
    return ApiKey(
        key_id=str(record["key_id"]),
        role=Role(int(record["role"])),  # type: ignore[call-overload]
        queues=tuple(str(q) for q in record["queues"]),  # type: ignore[attr-defined]
        description=str(record["description"]),
        created_at_us=int(record["created_at_us"]),  # type: ignore[call-overload]
        secret_hash=str(record["secret_sha256"]),
    )
