"""Which cluster and which node id a data directory belongs to.

A data directory holds partitions of one cluster's queues, under one node id. Served
under another cluster (a fresh etcd, a mistyped prefix) its old items would show up in
new queues of the same name, or be dropped as stale; served by a second process under
the same id, the two would split that node's partitions. So at its first join a data
directory records, in its own catalog (so backups carry it), the cluster's uuid, the
etcd cluster id, the prefix, the node id and a uuid of its own; and etcd records, with
no lease, which data directory each node id is bound to (``bindings/<node>``). Every
later start compares them and refuses on any mismatch, naming both sides.

The cluster's uuid is a key the first node writes under the prefix, rather than etcd's
own cluster id alone: an etcd restored from a snapshot gets a new cluster id but keeps
the catalog, and must not strand every node; a fresh etcd or another prefix has no such
key, or another one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ..logging import get_logger
from ..manager import QueuesManager
from . import rebind
from .catalog import Keys
from .etcd import Etcd, Txn
from .placement import QueueEntry

log = get_logger("cluster")


class IdentityError(OSError):
    """The data directory is not this node's of this cluster: the server does not start."""


@dataclass(frozen=True, slots=True)
class Identity:
    cluster: str  # the cluster's uuid (Keys.cluster_uuid)
    etcd_cluster_id: int
    prefix: str
    node: str
    data_dir: str  # the data directory's own uuid

    def record(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "etcd_cluster_id": self.etcd_cluster_id,
            "prefix": self.prefix,
            "node": self.node,
            "data_dir": self.data_dir,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Identity:
        try:
            return cls(
                str(record["cluster"]),
                int(record["etcd_cluster_id"]),
                str(record["prefix"]),
                str(record["node"]),
                str(record["data_dir"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise IdentityError(f"the data directory's cluster identity record is unreadable: {exc}") from None


async def _cluster_uuid(etcd: Etcd, keys: Keys, create: bool) -> str | None:
    """The cluster's uuid; made now when ``create`` and there is none yet."""
    if create:
        await etcd.txn(Txn().created_at(keys.cluster_uuid, 0).put(keys.cluster_uuid, uuid.uuid4().hex.encode()))
    _, kv = await etcd.get(keys.cluster_uuid)
    return None if kv is None else kv.value.decode()


async def _bound_to(etcd: Etcd, keys: Keys, node: str) -> str | None:
    _, kv = await etcd.get(keys.binding(node))
    return None if kv is None else kv.value.decode()


async def _partitions_homed(etcd: Etcd, keys: Keys, node: str) -> int:
    _, kvs = await etcd.range_prefix(keys.queue(""))
    homed = 0
    for kv in kvs:
        try:
            entry = QueueEntry.decode(kv.key.decode(), kv.value, kv.mod_revision, kv.create_revision)
        except (ValueError, KeyError, TypeError):
            continue  # the catalog cache logs unreadable keys
        homed += sum(1 for h in entry.homes if h.node == node)
    return homed


async def _bind(etcd: Etcd, keys: Keys, node: str, data_dir: str) -> str:
    """Bind ``node`` to ``data_dir`` unless it is bound already: the data dir it is bound to."""
    key = keys.binding(node)
    ok, _ = await etcd.txn(Txn().created_at(key, 0).put(key, data_dir.encode()))
    if ok:
        log.info("cluster_node_bound", node=node, data_dir_uuid=data_dir)
        return data_dir
    bound = await _bound_to(etcd, keys, node)
    return data_dir if bound is None else bound


async def _rebind(
    manager: QueuesManager, etcd: Etcd, keys: Keys, node: str, prefix: str, etcd_id: int, bound: str | None, timeout: float
) -> Identity:
    path = manager.data_dir
    try:
        data_dir, _ = await rebind.rebind(etcd, keys, node, timeout)
    except rebind.Refused as exc:
        if exc.held is None:
            raise IdentityError(str(exc)) from None
        if bound is None:  # a node id from before bindings
            homed = sum(exc.held.one_copy.values())
            raise IdentityError(
                f"node id {node!r} homes {homed} partition(s) in the cluster, but data directory {path} holds none; "
                f"refusing to start: it would lose {exc}. Start {node!r} on its own data directory (or a restored "
                f"backup of it), or, if that data is lost for good, retire {node!r} (querator cluster retire) and "
                "join with a new node id"
            ) from None
        raise IdentityError(
            f"node id {node!r} is bound to data directory {bound} in the cluster, and this one ({path}) never joined "
            f"the cluster; refusing to start empty: it would lose {exc}. Start {node!r} on its own data directory "
            f"(or a restored backup of it), or, if that data is lost for good, retire {node!r} "
            "(querator cluster retire) and join with a new node id"
        ) from None
    cluster = await _cluster_uuid(etcd, keys, create=False)
    if cluster is None:
        raise IdentityError(f"etcd holds no cluster under {prefix!r} any more; refusing to start")
    # etcd first, then the data directory: a crash in between leaves an empty data
    # directory under a binding to a uuid nobody has, which the next start rebinds.
    identity = Identity(cluster, etcd_id, prefix, node, data_dir)
    await manager.put_cluster_identity(identity.record())
    return identity


def _other_data_dir(node: str, bound: str, here: str | None, path: str) -> IdentityError:
    this = f"this one ({path}) is {here}" if here else f"this one ({path}) never joined the cluster"
    return IdentityError(
        f"node id {node!r} is bound to data directory {bound} in the cluster, and {this}; refusing to start. "
        f"Start {node!r} on its own data directory (or a restored backup of it), or, if that data is lost "
        f"for good, retire {node!r} (querator cluster retire) and join with a new node id"
    )


async def check(manager: QueuesManager, etcd: Etcd, keys: Keys, node: str, url: str, timeout: float = 30.0) -> Identity:
    """Check (or, at a first join, record) that the data directory is ``node``'s of the
    cluster at ``url``; raise IdentityError, which names both sides, when it is not.
    An empty data directory under a node id that holds data is bound to it when every
    copy the id held has another in-sync copy (rebind.py; waiting up to ``timeout`` for
    the id's previous process to let go of it), and refused otherwise."""
    prefix = keys.prefix.decode()
    path = manager.data_dir
    etcd_id = await etcd.cluster_id(keys.cluster_uuid)
    stored = manager.cluster_identity()
    if stored is None:
        return await _first_join(manager, etcd, keys, node, prefix, etcd_id, timeout)
    local = Identity.from_record(stored)
    if local.prefix != prefix:
        raise IdentityError(
            f"data directory {path} belongs to the cluster at prefix {local.prefix!r} (as node {local.node!r}), "
            f"not {prefix!r}; refusing to start. Check the prefix in --cluster {url} (mistyped?), "
            "or give this node an empty data directory to join that cluster"
        )
    if local.node != node:
        raise IdentityError(
            f"data directory {path} joined the cluster as node {local.node!r}, not {node!r}; refusing to start. "
            f"Start it with --node-id {local.node}, or give node {node!r} an empty data directory"
        )
    cluster = await _cluster_uuid(etcd, keys, create=False)
    if cluster != local.cluster:
        found = f"cluster {cluster}" if cluster else "no cluster at all (a fresh etcd, or another one)"
        raise IdentityError(
            f"data directory {path} belongs to cluster {local.cluster} (etcd cluster id {local.etcd_cluster_id:x}), "
            f"but etcd at {url} holds {found} under {prefix!r} (etcd cluster id {etcd_id:x}); refusing to start. "
            "Point --cluster at that cluster's etcd (restored from its snapshot if it was lost), "
            "or give this node an empty data directory"
        )
    bound = await _bound_to(etcd, keys, node)
    if bound is None:  # a first join that stopped between its two writes
        bound = await _bind(etcd, keys, node, local.data_dir)
    if bound != local.data_dir:
        raise _other_data_dir(node, bound, local.data_dir, path)
    if local.etcd_cluster_id != etcd_id:
        # The same catalog in another etcd cluster: etcd restored from a snapshot.
        log.warning(
            "cluster_etcd_replaced",
            node=node,
            before=f"{local.etcd_cluster_id:x}",
            now=f"{etcd_id:x}",
            detail="the catalog is the same cluster's (etcd restored from a snapshot?); recorded the new id",
        )
        local = Identity(local.cluster, etcd_id, local.prefix, local.node, local.data_dir)
        await manager.put_cluster_identity(local.record())
    return local


async def _first_join(
    manager: QueuesManager, etcd: Etcd, keys: Keys, node: str, prefix: str, etcd_id: int, timeout: float
) -> Identity:
    bound = await _bound_to(etcd, keys, node)
    if not manager.queue_count() and (bound is not None or await _partitions_homed(etcd, keys, node)):
        # An empty data directory under a node id that joined before: its data is gone
        # from here. Accepted only when nothing is lost by it (rebind.py).
        return await _rebind(manager, etcd, keys, node, prefix, etcd_id, bound, timeout)
    if bound is not None:
        raise _other_data_dir(node, bound, None, manager.data_dir)
    cluster = await _cluster_uuid(etcd, keys, create=True)
    assert cluster is not None
    # The data directory first: a crash before etcd's binding leaves a record the next
    # start completes; the other way round, a binding no data directory matches.
    identity = Identity(cluster, etcd_id, prefix, node, uuid.uuid4().hex)
    await manager.put_cluster_identity(identity.record())
    bound = await _bind(etcd, keys, node, identity.data_dir)
    if bound != identity.data_dir:  # another process joined as ``node`` meanwhile
        raise _other_data_dir(node, bound, identity.data_dir, manager.data_dir)
    queues = manager.queue_count()
    if queues:
        log.info(
            "cluster_identity_adopted",
            node=node,
            cluster=cluster,
            data_dir_uuid=identity.data_dir,
            queues=queues,
            detail="a data directory from before identities: bound to this cluster and node id from now on",
        )
    else:
        log.info("cluster_identity_recorded", node=node, cluster=cluster, data_dir_uuid=identity.data_dir)
    return identity
