"""Changes to a shard record: each one etcd transaction that compares revisions.

Every change compares the record's mod revision (the writer acts on the version it
read; a writer that read an older one loses) and the writer's own ``members/<node>``
create revision (a node whose membership lapsed, paused past its TTL say, never
changes a record under its old registration). So an ISR shrink by the primary and an
election by a replica that both read one version cannot both apply: one wins, the
other gets ``Deposed``.

An etcd call that fails or times out raises ``Unavailable``: whether it applied is not
known, and the caller reads the record again (``ShardTable.fetch``) before acting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from ..errors import Unavailable
from .etcd import Etcd, EtcdError, Txn
from .shard_record import SHARD_UID_BASE, Move, ShardRecord

# Attempts at the uid counter before giving up (each loses only to another create).
_UID_ATTEMPTS = 20


class Writer(Protocol):
    """The node writing: its id and the create revision of its member key (its
    fencing token; 0 while it holds no membership)."""

    node: str
    create_revision: int


class Deposed(Unavailable):
    """The change was refused: the record changed since it was read (another writer
    won), or the writer no longer holds the membership it read it under.
    ``current``: the record as it is now (None: deleted, or etcd did not answer)."""

    def __init__(self, message: str, current: ShardRecord | None = None) -> None:
        super().__init__(message)
        self.current = current


class BelowMinIsr(Unavailable):
    """The ISR would drop below the shard's minimum: refused, nothing changed."""


async def read(etcd: Etcd, key: bytes, uid: int) -> ShardRecord | None:
    _, kv = await etcd.get(key)
    return None if kv is None else ShardRecord.decode(uid, kv.value, kv.mod_revision, kv.create_revision)


async def swap(
    etcd: Etcd,
    key: bytes,
    member_key: bytes,
    writer: Writer,
    old: ShardRecord,
    new: ShardRecord,
    absent: bytes | None = None,
) -> ShardRecord:
    """Write ``new`` in place of ``old`` if neither the record nor the writer's
    membership changed since (and, given ``absent``, that key does not exist); the
    written record (its new mod revision)."""
    if not writer.create_revision:
        raise Deposed(f"node {writer.node!r} holds no cluster membership now; shard {old.uid} unchanged", None)
    new = dataclasses.replace(new, generation=old.generation)
    txn = Txn().modified_at(key, old.mod_revision).created_at(member_key, writer.create_revision)
    if absent is not None:
        txn = txn.created_at(absent, 0)
    txn = txn.put(key, new.encode())
    try:
        ok, revision = await etcd.txn(txn)
    except EtcdError as exc:
        raise Unavailable(f"shard {old.uid}: etcd did not answer, the change may or may not apply; read it again: {exc}") from None
    if ok:
        return dataclasses.replace(new, mod_revision=revision)
    try:
        current = await read(etcd, key, old.uid)
    except EtcdError:
        current = None
    if current is not None and current.mod_revision != old.mod_revision:
        raise Deposed(
            f"shard {old.uid} changed meanwhile: epoch {current.epoch}, primary {current.primary!r}", current
        )
    if current is None:
        raise Deposed(f"shard {old.uid} is gone (its queue was deleted) or etcd did not answer", None)
    if absent is not None:
        try:
            _, there = await etcd.get(absent)
        except EtcdError:
            there = None
        if there is not None:
            raise Deposed(f"shard {old.uid} unchanged: {absent.decode(errors='replace')} exists again", current)
    raise Deposed(f"node {writer.node!r} lost its cluster membership; shard {old.uid} unchanged", current)


def shrunk(record: ShardRecord, drop: str) -> ShardRecord:
    """``record`` without ``drop`` in its ISR; BelowMinIsr when that leaves too few."""
    if drop == record.primary:
        raise ValueError(f"shard {record.uid}: the primary {drop!r} cannot leave its own ISR (elect another)")
    isr = tuple(entry for entry in record.isr if entry[0] != drop)
    if len(isr) == len(record.isr):
        raise ValueError(f"shard {record.uid}: {drop!r} is not in its ISR {list(record.in_sync())}")
    if len(isr) < record.min_isr:
        raise BelowMinIsr(
            f"shard {record.uid} (queue {record.queue!r}): dropping {drop!r} would leave {len(isr)} in-sync "
            f"cop{'y' if len(isr) == 1 else 'ies'}, below its minimum of {record.min_isr}"
        )
    return dataclasses.replace(record, isr=isr)


def expanded(record: ShardRecord, add: tuple[str, str]) -> ShardRecord:
    """``record`` with copy ``add`` = (node, incarnation) in its ISR, in place of any
    entry of that node (a copy that said its incarnation, or one rebuilt)."""
    node, _ = add
    if node not in record.replicas:
        raise ValueError(f"shard {record.uid}: {node!r} holds no copy (copies: {list(record.replicas)})")
    isr = tuple(entry for entry in record.isr if entry[0] != node) + (add,)
    return dataclasses.replace(record, isr=isr)


def elected(record: ShardRecord, primary: str, isr: Sequence[tuple[str, str]]) -> ShardRecord:
    """``record`` under the next epoch with ``primary`` and ``isr`` (it may be below
    ``min_isr``: writes are then refused, reads still served)."""
    nodes = [node for node, _ in isr]
    if primary not in nodes:
        raise ValueError(f"shard {record.uid}: the new primary {primary!r} must be in the new ISR {nodes}")
    strangers = [n for n in nodes if n not in record.replicas]
    if strangers or len(set(nodes)) != len(nodes):
        raise ValueError(f"shard {record.uid}: ISR {nodes} must name distinct copies of {list(record.replicas)}")
    # An ISR below the minimum is allowed here: the survivors still serve reads and
    # refuse writes (the actor's gate) rather than leave the shard with no primary.
    return dataclasses.replace(record, epoch=record.epoch + 1, primary=primary, isr=tuple((n, i) for n, i in isr))


def without_copy(record: ShardRecord, node: str) -> ShardRecord:
    """``record`` without ``node``'s copy (a retired node): out of the copies and the
    ISR, the minimum capped at the copies left. Never the primary's (elect first)."""
    if node == record.primary:
        raise ValueError(f"shard {record.uid}: {node!r} is its primary (elect another first)")
    replicas = tuple(n for n in record.replicas if n != node)
    isr = tuple(entry for entry in record.isr if entry[0] != node)
    # A move whose source or target leaves is over: finished (its source dropped) or
    # undone (its target dropped).
    move = None if record.move is not None and node in (record.move.source, record.move.target) else record.move
    return dataclasses.replace(record, replicas=replicas, isr=isr, min_isr=min(record.min_isr, len(replicas)), move=move)


def with_copy(record: ShardRecord, node: str, move: Move | None = None) -> ShardRecord:
    """``record`` with a new, empty copy on ``node``: in the copies, not in the ISR.
    The primary ships to it (a snapshot first) and counts it once it holds every
    change acknowledged so far (expand_isr); until then nothing waits for it.
    ``move``: the move this copy is the target of, recorded with it."""
    if node in record.replicas:
        raise ValueError(f"shard {record.uid}: {node!r} holds a copy already (copies: {list(record.replicas)})")
    # A copy of the node left over in the ISR (it cannot be: without_copy removes it)
    # would be counted with an incarnation that is not the new copy's.
    isr = tuple(entry for entry in record.isr if entry[0] != node)
    if move is None:
        return dataclasses.replace(record, replicas=(*record.replicas, node), isr=isr)
    if record.move is not None:  # one move at a time: the record keeps one for the primary to finish
        raise ValueError(f"shard {record.uid}: a move of {record.move.source!r}'s copy to {record.move.target!r} is under way")
    if move.target != node or move.source not in record.replicas:
        raise ValueError(f"shard {record.uid}: a move to {node!r} from {move.source!r} does not fit {list(record.replicas)}")
    return dataclasses.replace(record, replicas=(*record.replicas, node), isr=isr, move=move)


async def next_uid(etcd: Etcd, key: bytes) -> int:
    """A shard uid never handed out before (a CAS on the counter ``key``)."""
    for _ in range(_UID_ATTEMPTS):
        try:
            _, kv = await etcd.get(key)
            if kv is None:
                uid, txn = SHARD_UID_BASE, Txn().created_at(key, 0)
            else:
                uid, txn = int(kv.value), Txn().modified_at(key, kv.mod_revision)
            ok, _ = await etcd.txn(txn.put(key, str(uid + 1).encode()))
        except EtcdError as exc:
            raise Unavailable(f"the cluster catalog (etcd) did not answer; nothing was changed: {exc}") from None
        if ok:
            return uid
    raise Unavailable("could not reserve a shard uid (many queues created at once); retry")
