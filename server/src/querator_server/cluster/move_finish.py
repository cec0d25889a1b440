"""Moves nobody runs any more, finished or undone by the queue's primary (part of the
coordinator).

A move records itself in the shard record with the CAS that adds its new copy
(copy_moves.py): which copy goes where, whether the new one is to serve, and which node
runs it (its member key's create revision) until when. When that node dies (its
membership lapses), gives it up (its call's deadline, its client gone, an error: it
clears ``by``), or runs past ``until_us`` (it cannot reach etcd to say so), the queue
keeps a copy more than its ``replicas``: the primary, which fills the new copy, then
takes the move's remaining steps, each one CAS, one per pass:

- the new copy in sync: the primary is handed over to it when it is to serve (or when
  the moving copy became primary meanwhile), and the moving copy is dropped, once the
  copies left in sync keep the minimum: the move's intent, finished;
- the new copy not in sync and its node not live: that copy is dropped (it was never
  waited for, so nothing acknowledged depends on it): the move undone;
- the new copy not in sync, its node live: nothing yet (the primary is filling it; it
  enters the in-sync set by a CAS, which makes the next pass).

Run by the primary only, after each catalog change (a member leaving is one) and when
a move's ``until_us`` passes; a CAS that raced another change fails harmlessly and the
next pass reads the record again. A pass that failed (etcd out of reach) is tried again
a second later.
"""

from __future__ import annotations

from ..clock import now_us
from ..errors import QueratorError
from ..logging import get_logger
from .copy_moves import CopyMoves, needs_hand_over
from .shard_record import Move, ShardRecord

log = get_logger("cluster")

# A pass whose step failed (etcd out of reach, a CAS lost) is made again this long after.
_RETRY_S = 1.0


class MoveFinish(CopyMoves):
    """Part of Coordinator (coordinator.py holds the state and the wiring)."""

    def _in_progress(self, move: Move) -> bool:
        """Whether the node that recorded ``move`` still runs it."""
        member = self.catalog.members.get(move.by) if move.by else None
        return member is not None and member.create_revision == move.by_revision and now_us() < move.until_us

    async def finish_move(self, record: ShardRecord) -> float | None:
        """One step of ``record``'s move (this node is its serving primary) when nobody
        runs it any more; the seconds after which to look at it again when no catalog
        change will say so (None: the next change will)."""
        move = record.move
        if move is None:
            return None
        if self._in_progress(move):
            return (move.until_us - now_us()) / 1_000_000 + 0.05
        try:
            await self._finish_step(record, move)
        except QueratorError as exc:
            log.info("cluster_move_finish_skipped", queue=record.queue, shard=record.uid, reason=exc.message[:200])
            return _RETRY_S
        return None

    async def _finish_step(self, record: ShardRecord, move: Move) -> None:
        fields = {"queue": record.queue, "shard": record.uid, "source": move.source, "target": move.target}
        if not record.claimed_in_sync(move.target):
            if move.target in self.catalog.members:
                return  # being filled: its entry into the in-sync set makes the next pass
            await self._drop_copy(record, move.target)
            log.warning("cluster_move_undone", **fields, detail="its new copy's node is not live and was not in sync")
            return
        if needs_hand_over(record, move):
            elected = await self._hand_over(record, move.target, leaving=move.source)
            log.warning("cluster_move_handed_over", **fields, epoch=elected.epoch)
            return  # the new primary drops the moving copy on its own pass
        if sum(1 for n, incarnation in record.isr if incarnation and n != move.source) < record.min_isr:
            return  # the copies left in sync would be too few: wait for one to catch up
        await self._drop_copy(record, move.source)
        log.warning("cluster_move_finished", **fields)
