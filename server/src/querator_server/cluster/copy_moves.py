"""New copies of replicated queues (part of the coordinator's admin frontend).

A copy is added by one compare-and-swap that appends its node to the shard record's
copies, never to its in-sync set: the node opens an empty copy when its catalog watch
sees the record (reconcile_backend.py), the primary's shipper opens a link to it and
catches it up (a snapshot, or the ring's tail while the shard is young), and once it
holds every change acknowledged so far the primary adds it to the in-sync set
(shipper.py, ``_expand``). Until then nothing waits for it and nothing can elect it.

Moves, drains, retires and raised replica counts are made of that step, a hand-over
(an election with the in-sync set unchanged) and the removal of a copy, each its own
CAS: an operation cut short leaves a record that is valid at every step, and running
it again goes on from where it stopped.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from ..errors import FailedPrecondition, NotFound, Unavailable
from ..logging import get_logger
from .catalog import APPLY_TIMEOUT_S as _APPLY_TIMEOUT_S
from .catalog import CatalogCache
from .membership import Membership
from .shard_cas import Deposed
from .shard_record import ShardRecord

log = get_logger("cluster")

# How long an admin call waits for a new copy to be caught up, when its caller gives no
# deadline of its own.
CATCH_UP_S = 60.0
_POLL_S = 0.05


class CopyMoves:
    """Part of Coordinator (coordinator.py holds the state and the wiring)."""

    node: str
    catalog: CatalogCache
    membership: Membership

    def _spare_nodes(self, record: ShardRecord, planned: Counter[str] | None = None) -> list[str]:
        """Live nodes without a copy of ``record``'s queue, those keeping the fewest
        copies (then primaries) first; ``planned``: copies about to be added, counted."""
        copies: Counter[str] = Counter()
        primaries: Counter[str] = Counter()
        for other in self.catalog.shards.records():
            copies.update(other.replicas)
            primaries[other.primary] += 1
        if planned:
            copies.update(planned)
        spare = [n for n in self.catalog.members if n not in record.replicas]
        return sorted(spare, key=lambda n: (copies[n], primaries[n], n))

    async def _add_copy(self, record: ShardRecord, node: str) -> ShardRecord:
        """Append a copy on ``node`` to the record (out of the in-sync set)."""
        self.membership.check()
        try:
            added = await self.catalog.shards.add_copy(record, node)
        except Deposed as exc:
            raise FailedPrecondition(f"queue {record.queue!r} changed meanwhile ({exc.message}); retry") from None
        await self.catalog.wait_applied(added.mod_revision, _APPLY_TIMEOUT_S)
        log.info("cluster_copy_added", queue=record.queue, shard=record.uid, node=node, copies=list(added.replicas))
        return added

    async def _drop_copy(self, record: ShardRecord, node: str) -> ShardRecord:
        """Remove ``node``'s copy (not the primary's) from the record; the node deletes its
        storage when its catalog watch sees the change."""
        self.membership.check()
        try:
            dropped = await self.catalog.shards.drop_copy(record, node)
        except Deposed as exc:
            raise FailedPrecondition(f"queue {record.queue!r} changed meanwhile ({exc.message}); retry") from None
        log.info("cluster_copy_dropped", queue=record.queue, shard=record.uid, node=node, copies=list(dropped.replicas))
        return dropped

    async def _caught_up(self, uid: int, node: str, within: float) -> ShardRecord:
        """The record once ``node``'s copy is in its in-sync set (the primary caught it
        up); Unavailable after ``within`` seconds (the copy stays and keeps catching up:
        the same call made again goes on waiting for it)."""
        deadline = time.monotonic() + within
        started = time.monotonic()
        while True:
            record = self.catalog.shards.get(uid)
            if record is None:
                raise NotFound(f"the queue of shard {uid} was deleted meanwhile")
            if node not in record.replicas:
                raise FailedPrecondition(f"queue {record.queue!r}: the copy on {node!r} was removed meanwhile")
            if any(n == node and incarnation for n, incarnation in record.isr):
                log.info(
                    "cluster_copy_in_sync", queue=record.queue, shard=uid, node=node, took_s=round(time.monotonic() - started, 3)
                )
                return record
            if time.monotonic() >= deadline:
                raise Unavailable(
                    f"queue {record.queue!r}: the new copy on {node!r} is still catching up after {within:.0f} s "
                    "(it stays and goes on catching up); make the same call again to finish"
                )
            await asyncio.sleep(_POLL_S)
