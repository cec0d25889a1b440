"""The cluster coordinator: the wiring of a node's cluster parts, beside the queues
manager: membership, the catalog cache, the router, and by role

- admin_frontend.py: the fenced admin writes to the catalog in etcd;
- reconcile_backend.py: the local storage following the catalog.

It looks queues up for the data calls (``lookup``) and starts and stops the parts.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..errors import FailedPrecondition, NotFound, QueratorError, Unavailable
from ..logging import get_logger
from ..manager import QueuesManager
from ..storage.change_set import ChangeSet, Diverged, Fenced
from . import failover, identity
from .admin_frontend import AdminFrontend
from .catalog import APPLY_TIMEOUT_S as _APPLY_TIMEOUT_S
from .catalog import CatalogCache, Keys
from .change_ring import RING_CHANGES
from .copies_restore import CopiesRestore
from .dead_letter_route import DeadLetterRoute
from .dead_letter_source import prefix as own_prefix
from .etcd import Access, Endpoint, Etcd, EtcdError, Txn
from .forwarding import PeerTls
from .membership import Membership
from .placement import QueueEntry
from .reconcile_backend import ReconcileBackend
from .redrive_route import RedriveRoute
from .replica_roles import ShardRoles
from .router import Router
from .shard_cas import Deposed
from .shard_record import ShardRecord
from .shipper import REPLICA_LAG_S
from .standing import Standing, check_members

log = get_logger("cluster")

# The longest a stopping node spends handing its primaries over.
_HAND_OVER_S = 3.0


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
    # TLS and authentication towards etcd; None: plaintext, no authentication.
    etcd_access: Access | None = None
    # Defaults of new queues whose CreateQueue names none (--replicas, --min-in-sync;
    # 0: replicas - 1, at least 1, capped at the queue's replicas).
    replicas: int = 1
    min_in_sync: int = 0
    # How long a replica may stay silent or behind before its primary drops it from the
    # in-sync set (--replica-lag).
    replica_lag_s: float = REPLICA_LAG_S
    # Change sets kept per copy for catch-up by tail (--replica-ring).
    replica_ring: int = RING_CHANGES


class Coordinator(AdminFrontend, ReconcileBackend, CopiesRestore):
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
        self.etcd = Etcd(endpoint.targets, settings.etcd_access)
        self.keys = Keys(endpoint.prefix)
        self.catalog = CatalogCache(self.etcd, self.keys, self.reconcile)
        self.default_replicas = settings.replicas
        self.default_min_in_sync = settings.min_in_sync
        self._on_standing = on_standing
        self.membership = Membership(
            self.etcd, self.keys.member(self.node), self.node, settings.advertise, settings.lease_ttl_s, self._standing
        )
        self.catalog.shards.writer = self.membership
        self.router = Router(self.node, self.catalog, self.lookup, settings.peer_tls, self.membership.verify)
        # The replicated queues' copies here: promoted, followed, elected (replica_roles.py).
        self.roles = ShardRoles(
            self.node,
            manager,
            self.catalog.shards,
            self.router.peers,
            self.router.live,
            (Deposed, Fenced, Diverged),
            ChangeSet.decode,
            settings.replica_lag_s,
            settings.replica_ring,
        )
        # Dead letters to a replicated dead-letter queue go to its primary's node.
        self.dead_letters = DeadLetterRoute(self.node, self.catalog, self.router.peers, manager.actor)
        manager.dead_queue_route = self.dead_letters
        # Redriven items to a replicated queue go to its primary's node.
        self.redrives = RedriveRoute(self.node, self.catalog, self.router.peers, manager.actor_by_uid)
        manager.redrive_route = self.redrives
        manager.redrive_targets = self.redrives.targets
        manager.own_source_prefix = own_prefix(self.node)
        self._reconcile_lock = asyncio.Lock()
        self.retired = False
        self._foreign: set[str] = set()  # local queues the catalog never had (warned once)
        self.identity: identity.Identity | None = None
        # Cluster queues this node cannot serve: its data directory has an older queue of
        # the same name (from before it joined).
        self._blocked: set[str] = set()
        self._restoring: asyncio.Task[None] | None = None  # copies_restore.py
        self.unmade: dict[str, str] = {}  # reconcile_backend.py
        self._again: asyncio.Task[None] | None = None
        self._again_delay_s = 1.0
        self._restore_again = False
        self._restore_timer: asyncio.TimerHandle | None = None  # a pass due at a time (move_finish.py)
        self._letting_go: set[asyncio.Task[None]] = set()  # moves left to the primary (copy_moves.py)

    # -- start and stop ------------------------------------------------------------

    async def start(self, timeout: float = 30.0) -> None:
        try:
            _, retired = await self.etcd.get(self.keys.retired(self.node))
            if retired is not None:
                raise OSError(
                    f"node {self.node!r} was retired from the cluster (its partitions were recreated "
                    "elsewhere); start it with a new node id and an empty data directory"
                )
            self.identity = await identity.check(self.manager, self.etcd, self.keys, self.node, self.settings.url, timeout)
            self.membership.data_dir = self.identity.data_dir
            await self.membership.register(timeout=timeout)
            await self._share_token_secret()
            await self.catalog.load()
        except EtcdError as exc:
            raise OSError(f"cannot reach the cluster catalog at {self.settings.url}: {exc}") from exc
        except QueratorError as exc:
            raise OSError(str(exc)) from exc
        self.catalog.start()
        self.membership.start()
        self.roles.start()
        log.info("cluster_joined", node=self.node, advertise=self.settings.advertise, revision=self.catalog.revision)

    async def _share_token_secret(self) -> None:
        """Every node signs page tokens with one secret (the first node's), so a listing
        started on one node goes on on any other."""
        key = self.keys.token_secret
        await self.etcd.txn(Txn().created_at(key, 0).put(key, os.urandom(32)))
        _, kv = await self.etcd.get(key)
        if kv is not None and kv.value:
            self.manager.token_secret = kv.value
        self.router.peers.set_secret(self.manager.token_secret)  # and proves forwarded calls

    async def reconcile(self) -> None:
        await super().reconcile()
        # A node that joined may take the copy a queue left short by a retire lacks.
        self.restore_copies_soon()

    async def stop(self) -> None:
        if self._restore_timer is not None:
            self._restore_timer.cancel()
        if self._restoring is not None:
            self._restoring.cancel()
            await asyncio.gather(self._restoring, return_exceptions=True)
        await self.stop_reconciling()
        await self._hand_over_primaries()
        await self.roles.stop()
        await self.catalog.stop()
        await self.membership.stop()
        await self.router.close()
        await self.etcd.close()

    def _serving(self, name: str) -> bool:
        """Whether this node serves queue ``name`` from a running local queue."""
        try:
            self.manager.actor(name)
        except QueratorError:
            return False
        return True

    async def _hand_over_primaries(self) -> None:
        """Before this node stops: every replicated queue it is primary of goes to another
        live in-sync copy now (one election each), rather than wait for its membership to
        lapse and a failover. Bounded: a node that cannot reach etcd stops anyway."""
        if self.retired or self.membership.fenced or not any(
            r.primary == self.node for r in self.catalog.shards.records()
        ):
            return
        self.roles.host.leaving = {r.uid for r in self.catalog.shards.records() if r.primary == self.node}
        try:
            moved, kept = await asyncio.wait_for(self.drain(self.node, leaving=True), _HAND_OVER_S)
        except (QueratorError, TimeoutError) as exc:
            log.warning("cluster_hand_over_failed", node=self.node, error=str(exc))
            return
        if moved or kept:
            log.info("cluster_primaries_handed_over", node=self.node, moved=moved, kept=kept)

    async def _standing(self, standing: bool) -> None:
        if standing:
            self.catalog.rewatch()  # a stream left silent by a paused etcd is not trusted
        if self._on_standing is not None:
            await self._on_standing(standing)

    async def lookup(self, name: str) -> QueueEntry:
        """The queue's entry; read from etcd when the cache does not have it yet (a queue
        just created on another node), so a call right after a create finds it."""
        if self.retired:
            raise FailedPrecondition(f"node {self.node!r} was retired from the cluster; it serves nothing")
        await self.membership.verify()
        if name in self._blocked:
            raise FailedPrecondition(
                f"node {self.node!r} holds a queue {name!r} from before it joined the cluster and cannot serve "
                "the cluster's queue of that name; move that data away or send the call to another node"
            )
        entry = self.catalog.queues.get(name)
        if entry is not None:
            revision = entry.mod_revision
            # A primary just elected here serves once it has taken its copy up (the
            # reconcile of the record); other record changes (the in-sync set) need no
            # wait, so a slow reconcile holds up no call that does not need it.
            record = self.catalog.shards.get(entry.shard) if entry.shard else None
            if record is not None and record.primary == self.node and not self._serving(name):
                revision = max(revision, record.mod_revision)
            if revision > self.catalog.applied:  # seen, but not yet applied to local storage
                await self.catalog.wait_applied(revision, _APPLY_TIMEOUT_S)
            why = self.unmade.get(name)
            if why is not None and entry.local_count(self.node) and not self._serving(name):
                raise Unavailable(
                    f"queue {name!r}: node {self.node!r} could not make its storage for the queue ({why}); "
                    "it tries again every few seconds: retry"
                )
            return self.catalog.routed(entry)
        if self.membership.fenced:  # etcd is likely out of reach: answer now, not after its timeout
            raise NotFound(f"queue {name!r} does not exist (as far as this node knows: it cannot reach the catalog)")
        try:
            _, kv = await self.etcd.get(self.keys.queue(name))
        except EtcdError:
            kv = None
        if kv is None:
            raise NotFound(f"queue {name!r} does not exist")
        await self.catalog.wait_applied(kv.mod_revision, _APPLY_TIMEOUT_S)
        entry = self.catalog.queues.get(name) or QueueEntry.decode(name, kv.value, kv.mod_revision, kv.create_revision)
        return self.catalog.routed(entry)

    # -- the operator's view --------------------------------------------------------

    def metrics_view(self) -> tuple[int, bool, int]:
        """Live members, whether this node is fenced, and the catalog's partitions homed
        on a node that is not live, for the metrics. Called on the scrape's thread: it
        copies the cached catalog's dicts in one step each and reads nothing else."""
        live = set(self.catalog.members)
        # A replicated queue's partitions are down with its current primary (the record's).
        routed = self.catalog.routed
        down = sum(1 for entry in list(self.catalog.queues.values()) for home in routed(entry).homes if home.node not in live)
        return len(live), self.membership.fenced, down

    async def failover_blocked(self, record: ShardRecord) -> str:
        """Why no live copy can take over from the record's primary ("" when none is
        needed or one may): failover.why_blocked, for ClusterInfo."""
        return await failover.why_blocked(record, self.node, self.roles.host.shards, self.router.peers, self.router.live)

    async def check_members(self) -> dict[str, Standing]:
        """Whether each other live member is fenced, as it says itself."""
        return await check_members(self.router.peers, [n for n in self._live() if n != self.node])
