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

A move (and a drain, made of moves) also writes down what it is doing: the CAS adding
the new copy records the move (shard_record.Move: which copy goes where, and which node
runs it until when), and the CAS dropping either copy clears it. A move whose node dies,
whose call is given up (its client gone, its deadline, etcd failing) or that runs past
its time is no longer in progress, and the queue's primary finishes it or undoes it
(move_finish.py), so the queue comes back to its count of copies with nobody running
the command again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING

from ..clock import now_us
from ..errors import FailedPrecondition, NotFound, QueratorError, Unavailable
from ..faults import REPLICA_MOVE_ADDED, REPLICA_MOVE_CATCHING_UP, REPLICA_MOVE_HANDED_OVER, REPLICA_MOVE_IN_SYNC, crash_point
from ..logging import get_logger
from . import failover
from .catalog import APPLY_TIMEOUT_S as _APPLY_TIMEOUT_S
from .catalog import CatalogCache
from .etcd import EtcdError
from .membership import Membership
from .replica_wire import StatusAsk
from .shard_cas import Deposed
from .shard_record import Move, ShardRecord

if TYPE_CHECKING:
    from .replica_roles import ShardRoles
    from .router import Router

log = get_logger("cluster")

# How long an admin call waits for a new copy to be caught up, when its caller gives no
# deadline of its own.
CATCH_UP_S = 60.0
_POLL_S = 0.05
# A move is in progress until its call's deadline and this much more (a hand-over and a
# drop after the catch-up); past that the queue's primary takes it over.
MOVE_GRACE_S = 15.0
# A node giving a move up tells the record so again this often while etcd does not
# answer, up to the move's ``until_us`` (then the primary takes it over anyway).
_LET_GO_RETRY_S = 0.5
_LET_GO_ATTEMPTS = 60


def needs_hand_over(record: ShardRecord, move: Move) -> bool:
    """Whether the move's target is to be elected before its source's copy is dropped:
    it was to serve (the moved copy was the primary's), or the source is primary now
    (a failover elected it meanwhile: a primary's copy is never dropped)."""
    return record.primary != move.target and (move.lead or record.primary == move.source)


class CopyMoves:
    """Part of Coordinator (coordinator.py holds the state and the wiring)."""

    node: str
    catalog: CatalogCache
    membership: Membership
    roles: ShardRoles
    router: Router
    _letting_go: set[asyncio.Task[None]]

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

    async def _add_copy(self, record: ShardRecord, node: str, move: Move | None = None) -> ShardRecord:
        """Append a copy on ``node`` to the record (out of the in-sync set); ``move``:
        the move it is the target of, recorded in the same CAS."""
        self.membership.check()
        try:
            added = await self.catalog.shards.add_copy(record, node, move)
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
        waited = False
        while True:
            record = self.catalog.shards.get(uid)
            if record is None:
                raise NotFound(f"the queue of shard {uid} was deleted meanwhile")
            if node not in record.replicas:
                raise FailedPrecondition(f"queue {record.queue!r}: the copy on {node!r} was removed meanwhile")
            if record.claimed_in_sync(node):
                log.info(
                    "cluster_copy_in_sync", queue=record.queue, shard=uid, node=node, took_s=round(time.monotonic() - started, 3)
                )
                return record
            if time.monotonic() >= deadline:
                raise Unavailable(
                    f"queue {record.queue!r}: the new copy on {node!r} is still catching up after {within:.0f} s "
                    "(it stays and goes on catching up; the queue's primary finishes the move once it is in sync)"
                )
            if not waited:
                crash_point(REPLICA_MOVE_CATCHING_UP)
                waited = True
            await asyncio.sleep(_POLL_S)

    async def _moved(self, uid: int, move: Move, within: float) -> ShardRecord:
        """The record once ``move`` is no longer recorded in it (finished or undone, by
        the node running it or by the queue's primary); Unavailable after ``within`` s."""
        deadline = time.monotonic() + within
        while True:
            record = self.catalog.shards.get(uid)
            if record is None:
                raise NotFound(f"the queue of shard {uid} was deleted meanwhile")
            if record.move is None or (record.move.source, record.move.target) != (move.source, move.target):
                return record
            if time.monotonic() >= deadline:
                raise Unavailable(
                    f"queue {record.queue!r}: the move of {move.source!r}'s copy to {move.target!r} is still under way "
                    f"after {within:.0f} s (the queue's primary finishes it once the new copy is in sync)"
                )
            await asyncio.sleep(_POLL_S)

    async def _move_copy(self, record: ShardRecord, source: str, node: str, within: float) -> ShardRecord:
        """Move ``source``'s copy to ``node`` (live, without one, or with the copy an
        earlier move added): add it, the move recorded with it, wait until the primary
        has it in sync, hand the primary over to it if ``source`` was the primary, drop
        ``source``'s copy (which clears the move). Given up part-way (an error, the call
        cancelled), the move is left to the queue's primary (``_let_go_soon``)."""
        if node not in self.catalog.members:
            raise FailedPrecondition(f"node {node!r} is not live; a copy is made only on a live node")
        if record.move is not None and node not in record.replicas:
            raise FailedPrecondition(
                f"queue {record.queue!r}: a move of {record.move.source!r}'s copy to {record.move.target!r} is under way; "
                "retry once it is over (the queue's primary finishes it if its node gives it up)"
            )
        move = Move(
            source,
            node,
            lead=record.primary == source,
            by=self.node,
            by_revision=self.membership.create_revision,
            until_us=now_us() + int((within + MOVE_GRACE_S) * 1_000_000),
        )
        try:
            if node not in record.replicas:
                record = await self._add_copy(record, node, move)
                crash_point(REPLICA_MOVE_ADDED)
            record = await self._caught_up(record.uid, node, within)
            crash_point(REPLICA_MOVE_IN_SYNC)
            if needs_hand_over(record, move):
                record = await self._hand_over(record, node, leaving=source)
                crash_point(REPLICA_MOVE_HANDED_OVER)
            dropped = await self._drop_copy(record, source)
        except BaseException:
            self._let_go_soon(record.uid)
            raise
        await self.catalog.wait_applied(dropped.mod_revision, _APPLY_TIMEOUT_S)
        return dropped

    def _let_go_soon(self, uid: int) -> None:
        """Leave the shard's move, if this node runs it, to the queue's primary now (in
        the background: the call giving it up may be cancelled). Should this fail (etcd
        out of reach), the primary takes it over at the move's ``until_us``."""
        task = asyncio.get_running_loop().create_task(self._let_go(uid), name="querator-move-let-go")
        self._letting_go.add(task)
        task.add_done_callback(self._letting_go.discard)

    async def _let_go(self, uid: int) -> None:
        try:  # etcd's: the add may have applied without this node having seen it yet
            record = await self.catalog.shards.fetch(uid)
        except EtcdError:
            record = self.catalog.shards.get(uid)
        for attempt in range(_LET_GO_ATTEMPTS):
            move = record.move if record is not None else None
            if record is None or move is None or now_us() >= move.until_us:
                return  # over, or the primary's to finish by now
            if (move.by, move.by_revision) != (self.node, self.membership.create_revision):
                return  # let go already, or another node's
            if attempt:
                await asyncio.sleep(_LET_GO_RETRY_S)
            try:
                record = await self.catalog.shards.let_go(record)
            except Deposed as exc:  # the record read was stale: etcd's is tried
                record = exc.current
                continue
            except QueratorError as exc:  # etcd out of reach (the change may have applied: read again)
                log.info("cluster_move_let_go_failed", queue=record.queue, shard=uid, reason=exc.message[:200])
                try:
                    record = await self.catalog.shards.fetch(uid)
                except EtcdError:
                    pass
                continue
            log.info("cluster_move_let_go", queue=record.queue, shard=uid, source=move.source, target=move.target)
            return

    async def _hand_over(self, record: ShardRecord, node: str, leaving: str = "") -> ShardRecord:
        """Elect ``node``; ``leaving``: a node about to stop, left out of the in-sync set
        when enough copies stay (the new primary then waits for it on no write).

        The old primary first promises the next epoch away (``_fence_primary``): until
        then it may answer OK a change whose copies' acknowledgements are still on their
        way to it, and its catalog watch may tell it of the election only after the new
        primary answered (one that no longer waits for its copy, ``leaving``, answers
        without it): two epochs would answer at once. A primary that is not live is
        taken over only while its membership is gone, as a failover does."""
        self.membership.check()
        gone = await self._fence_primary(record, node)
        isr = record.isr
        rest = tuple(entry for entry in isr if entry[0] != leaving)
        if leaving and len(rest) >= record.min_isr:
            isr = rest
        try:
            elected = await self.catalog.shards.elect(record, node, isr, primary_gone=gone)
        except Deposed as exc:
            raise FailedPrecondition(f"queue {record.queue!r} changed meanwhile ({exc.message}); retry") from None
        await self.catalog.wait_applied(elected.mod_revision, _APPLY_TIMEOUT_S)
        log.info("cluster_primary_moved", queue=record.queue, shard=record.uid, old=record.primary, new=node, epoch=elected.epoch)
        return elected

    async def _fence_primary(self, record: ShardRecord, node: str) -> bool:
        """Make the primary of ``record`` (unless it is ``node``) stop answering under its
        epoch: its copy fenced at the next epoch, its serving deposed, before it replies.
        Returns True when it is not live (the election then requires its member key
        absent); Unavailable when it is live and does not answer (nothing changed)."""
        old = record.primary
        if old == node:
            return False
        fence = record.epoch + 1
        if old == self.node:
            await self.roles.host.status(StatusAsk(record.uid, fence))
            return False
        if old not in self.catalog.members:
            return True
        try:
            await failover.ask(self.router.peers, old, record.uid, fence)
        except QueratorError as exc:
            raise Unavailable(
                f"queue {record.queue!r}: its primary {old!r} did not stop serving for the hand-over ({exc.message}); "
                "nothing was moved, retry (a primary that is down is replaced by a failover)"
            ) from None
        return False
