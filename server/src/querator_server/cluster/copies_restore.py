"""Copies made again when a node becomes available (part of the coordinator).

A retire with no live node to take a dead node's copy leaves a replicated queue with
fewer copies than its ``replicas`` (admin_frontend.py, ``_drop_copies``). Once a live
node holding no copy of it is there (one that joined, or came back), the queue's
primary adds one there, as a retire would have (copy_moves.py: one CAS appending it to
the record's copies; the primary fills it and counts it in sync once caught up).

Run by the primary only (one node per shard), after each catalog change (a node
joining is one), one pass at a time, one copy per shard and pass: the CAS on the
record's revision makes a pass that raced another change (a retire, a move, an
UpdateQueue) fail harmlessly, and the next pass reads the record again. A queue with
as many copies as its ``replicas`` or more (a move under way) is left alone. Once
enough of its copies are in sync, its in-sync minimum (capped by the retire at the
copies left) is raised back to its ``min_in_sync``. A queue whose record holds a move
nobody runs any more has it finished or undone first (move_finish.py); a pass is also
made when such a move's time runs out, or a second after one of its steps failed.
"""

from __future__ import annotations

import asyncio

from ..errors import QueratorError
from ..logging import get_logger
from .move_finish import MoveFinish
from .replica_roles import ShardRoles
from .shard_record import ShardRecord

log = get_logger("cluster")


class CopiesRestore(MoveFinish):
    """Part of Coordinator (coordinator.py holds the state and the wiring)."""

    roles: ShardRoles
    retired: bool
    _restoring: asyncio.Task[None] | None
    _restore_again: bool
    _restore_timer: asyncio.TimerHandle | None

    def restore_copies_soon(self) -> None:
        """Run a pass in the background (a catalog change must not wait for CASes); a
        change seen while one runs makes it run once more."""
        if self._restoring is not None and not self._restoring.done():
            self._restore_again = True
            return
        self._restoring = asyncio.get_running_loop().create_task(self._restore_passes(), name="querator-copies-restore")

    async def _restore_passes(self) -> None:
        self._restore_again = True
        while self._restore_again:
            self._restore_again = False
            try:
                await self.restore_copies()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("cluster_copy_restore_failed")

    def _restore_in(self, seconds: float) -> None:
        """A pass in ``seconds`` (unless one is due sooner already)."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(seconds, 0.0)
        timer = self._restore_timer
        if timer is not None and not timer.cancelled() and loop.time() <= timer.when() <= when:
            return
        if timer is not None:
            timer.cancel()
        self._restore_timer = loop.call_at(when, self.restore_copies_soon)

    async def restore_copies(self) -> int:
        """One pass: a copy added for each short queue this node is primary of, where a
        live node holds none; the copies added."""
        if self.retired or self.membership.fenced or self.node not in self.catalog.members:
            return 0
        added = 0
        for entry in list(self.catalog.queues.values()):
            record = self.catalog.shards.get(entry.shard) if entry.shard else None
            if record is None or record.primary != self.node:
                continue
            shard = self.roles.host.shards.get(record.uid)
            if shard is None or shard.primary is None or shard.primary.epoch != record.epoch:
                continue  # not serving it (yet): the copy it adds must be filled by it
            if record.move is not None:  # a move under way: its copies are its own
                later = await self.finish_move(record)
                if later is not None:
                    self._restore_in(later)
                continue
            await self._restore_minimum(record, entry.config.min_in_sync)
            if len(record.replicas) >= entry.config.replicas:
                continue
            spare = self._spare_nodes(record)
            if not spare:
                continue
            try:
                await self._add_copy(record, spare[0])
            except QueratorError as exc:  # the record moved on, or this node is fenced: next pass
                log.info("cluster_copy_restore_skipped", queue=record.queue, node=spare[0], reason=exc.message[:200])
                continue
            added += 1
            log.warning(
                "cluster_copy_restored",
                queue=record.queue,
                shard=record.uid,
                node=spare[0],
                copies=len(record.replicas) + 1,
                replicas=entry.config.replicas,
            )
        return added

    async def _restore_minimum(self, record: ShardRecord, wanted: int) -> None:
        """The queue's min_in_sync again once enough copies are in sync (a retire capped
        it at the copies it left): until then writes were acknowledged on fewer copies
        than the queue asks for."""
        if not record.min_isr < wanted <= sum(1 for _, incarnation in record.isr if incarnation):
            return
        try:
            raised = await self.catalog.shards.raise_min_isr(record, wanted)
        except QueratorError as exc:  # the record moved on (an ISR change): next pass
            log.info("cluster_min_in_sync_restore_skipped", queue=record.queue, reason=exc.message[:200])
            return
        log.warning("cluster_min_in_sync_restored", queue=record.queue, shard=record.uid, min_in_sync=raised.min_isr)
