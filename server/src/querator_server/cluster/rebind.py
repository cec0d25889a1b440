"""An empty data directory started under a node id that holds data in the cluster.

The data that id held is gone from this machine (a wiped or replaced disk). Whether the
node may start empty depends on whether anything would be lost:

- a partition of a one-copy queue homed on it: its items lived in that data directory
  only, and an empty partition would serve in their place. Refused;
- a replicated queue whose in-sync set holds no copy but this node's (the others were
  dropped from it): its last acknowledged changes lived there only. Refused;
- otherwise every copy it held has another in-sync copy elsewhere: the start is
  accepted. The node id is bound to the new data directory (a compare-and-swap on
  ``bindings/<node>`` that also checks nothing it judged by changed meanwhile and no
  live process holds the id), its copies come up empty under new incarnations (so no
  in-sync set names them and no election picks them), the queues it was primary of are
  handed to an in-sync copy by an election before it serves anything (replica_roles.py:
  a primary whose copy is not the in-sync one elects another), and the primaries
  rebuild its copies (by snapshot, or by the tail of recent changes when those reach
  back to the queue's start) and add them back to the in-sync sets.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from ..logging import get_logger
from .catalog import Keys
from .etcd import Etcd, Txn
from .placement import QueueEntry
from .shard_record import ShardRecord

log = get_logger("cluster")

# Attempts at the compare-and-swap, each after reading the catalog again (it loses only
# when a queue or shard record changed between the read and the write).
_ATTEMPTS = 10
_POLL_S = 0.25


@dataclass
class Holdings:
    """What node id ``node`` holds in the catalog at ``revision``."""

    revision: int
    one_copy: dict[str, int] = field(default_factory=dict)  # queue -> partitions homed here, one copy each
    only_in_sync: list[str] = field(default_factory=list)  # replicated queues in sync here alone
    copies: list[str] = field(default_factory=list)  # replicated queues with a copy here
    primary_of: list[str] = field(default_factory=list)  # ... of which this node is the primary

    def losses(self) -> str:
        """What starting empty would lose, in words ("" when nothing)."""
        parts = [
            f"{count} partition(s) of queue {queue!r} (one copy, kept on this node only)"
            for queue, count in sorted(self.one_copy.items())
        ]
        parts += [f"queue {queue!r} (its only in-sync copy is this node's)" for queue in sorted(self.only_in_sync)]
        return "; ".join(parts)


async def holdings(etcd: Etcd, keys: Keys, node: str) -> Holdings:
    """Read the queues and shard records and sort what ``node`` holds."""
    queue_revision, queue_kvs = await etcd.range_prefix(keys.queue(""))
    shard_revision, shard_kvs = await etcd.range_prefix(keys.shard(""))
    found = Holdings(min(queue_revision, shard_revision))
    one_copy: defaultdict[str, int] = defaultdict(int)
    queues = len(keys.queue(""))
    for kv in queue_kvs:
        try:
            name = kv.key[queues:].decode()
            entry = QueueEntry.decode(name, kv.value, kv.mod_revision, kv.create_revision)
        except (ValueError, KeyError, TypeError):
            continue  # the catalog cache logs unreadable keys
        if entry.shard:
            continue  # a replicated queue's homes are its record's primary (below)
        count = sum(1 for h in entry.homes if h.node == node)
        if count:
            one_copy[entry.config.name] += count
    found.one_copy = dict(one_copy)
    for kv in shard_kvs:
        try:
            uid = int(kv.key.decode().rsplit("/", 1)[1])
            record = ShardRecord.decode(uid, kv.value, kv.mod_revision, kv.create_revision)
        except (ValueError, KeyError, TypeError, IndexError):
            continue
        if node not in record.replicas and node not in record.in_sync():
            continue
        found.copies.append(record.queue)
        if record.primary == node:
            found.primary_of.append(record.queue)
        others = [n for n in record.in_sync() if n != node]
        if node in record.in_sync() and not others:
            found.only_in_sync.append(record.queue)
    return found


class Refused(Exception):
    """Starting empty would lose data (``holdings.losses()``), or a live process holds the id."""

    def __init__(self, message: str, held: Holdings | None = None) -> None:
        super().__init__(message)
        self.held = held


async def rebind(etcd: Etcd, keys: Keys, node: str, timeout: float) -> tuple[str, Holdings]:
    """Bind ``node`` to a new data directory uuid, unless starting empty would lose data
    (Refused, naming it) or no live process lets go of the id within ``timeout``
    (Refused). The new uuid and what the node holds."""
    binding = keys.binding(node)
    member = keys.member(node)
    deadline = time.monotonic() + timeout
    for _ in range(_ATTEMPTS):
        held = await holdings(etcd, keys, node)
        if held.losses():
            raise Refused(held.losses(), held)
        # The id's previous process must be gone: its lease runs out within its TTL
        # after a crash. Judged again by the transaction below.
        _, kv = await etcd.get(member)
        while kv is not None:
            if time.monotonic() > deadline:
                raise Refused(f"node id {node!r} is registered by another live process; each node needs an id of its own")
            await asyncio.sleep(_POLL_S)
            _, kv = await etcd.get(member)
        _, bound = await etcd.get(binding)
        new = uuid.uuid4().hex
        txn = Txn().created_at(member, 0).unchanged_since(keys.queue(""), held.revision)
        txn = txn.unchanged_since(keys.shard(""), held.revision)
        txn = txn.created_at(binding, 0) if bound is None else txn.modified_at(binding, bound.mod_revision)
        ok, _ = await etcd.txn(txn.put(binding, new.encode()))
        if ok:
            log.warning(
                "cluster_node_rebound",
                node=node,
                data_dir_uuid=new,
                previous=None if bound is None else bound.value.decode(),
                copies=sorted(held.copies),
                primary_of=sorted(held.primary_of),
                detail="an empty data directory under a node id whose every copy has another in-sync copy: "
                "bound to it; its copies are rebuilt from the others, and the queues it was primary of "
                "are handed to an in-sync copy before it serves them",
            )
            return new, held
    raise Refused(f"node id {node!r}: the catalog kept changing while its data directory was rebound; start it again")
