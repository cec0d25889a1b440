"""What this node does with each replicated shard it holds a copy of, following the
shard's record in etcd: serve it as primary (promote the copy, with a ShardReplication
as its gate), keep it as a passive copy that applies what the primary ships, or take
part in a failover when the primary is gone.

The rules, applied on every catalog change and every half second:

- the record names this node primary, this copy is in the in-sync set and has not
  promised a later epoch away: promote it under the record's epoch (a start, a new
  queue, or the outcome of an election);
- it names this node but this copy is not the in-sync one (its data was lost or
  rebuilt): never serve it; fence and elect one of the others on their behalf;
- it names this node but this copy promised a later epoch (a replica told it so: it
  was paused or cut off while the others started a failover): run the election itself;
- it names another node that is not live, and this copy may take over (in sync, or
  rebuilt by that primary before etcd heard of it: ``why_not_electable``): run the
  election; a copy that may not says why in the log (``shard_failover_blocked``);
- this node serves a shard the record no longer gives it, or under another epoch:
  demote it (a passive copy again, caught up by the new primary).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..logging import get_logger
from ..model import QueueConfig
from . import failover
from .change_ring import RING_CHANGES, ChangeRing
from .forwarding import Peers
from .replica_contract import UNCLAIMED, CopyLike, Decode, isr_incarnation, why_not_electable
from .replica_host import CopyHost, Shard
from .shard_record import ShardRecord
from .shard_table import ShardTable
from .shipper import REPLICA_LAG_S, ShardReplication

log = get_logger("cluster")

_TICK_S = 0.5
# A failover attempt that did not end in a record naming a primary is tried again this
# long after (the winner may have died before it promoted).
_RETRY_RACE_S = 1.0


class Copies(Protocol):
    """What the node-local manager offers for replicated shards (storage's half)."""

    async def open_copy(self, config: QueueConfig) -> Any: ...
    async def promote(self, name: str, epoch: int, replication: Any) -> None: ...
    async def demote(self, name: str) -> None: ...
    def failure(self, name: str) -> str: ...
    async def delete(self, name: str, force: bool) -> None: ...


class ShardRoles:
    def __init__(
        self,
        node: str,
        manager: Copies,
        table: ShardTable,
        peers: Peers,
        live: Callable[[str], bool],
        errors: tuple[type[Exception], type[Exception], type[Exception]],
        decode: Decode,
        lag_s: float = REPLICA_LAG_S,
        ring_changes: int = RING_CHANGES,
    ) -> None:
        self.node = node
        self._manager = manager
        self.table = table
        self.peers = peers
        self._live = live
        self._deposed_error, fenced, diverged = errors
        self.lag_s = lag_s
        self._ring_changes = ring_changes
        self.host = CopyHost(decode, fenced, diverged, self._newer_epoch)
        self._records: dict[int, tuple[ShardRecord, QueueConfig]] = {}
        self._locks: dict[int, asyncio.Lock] = {}
        self._raced_at: dict[int, float] = {}
        self._racing: set[int] = set()
        self._blocked: dict[int, int] = {}  # uid -> the record revision a blocked failover was logged for
        # uid -> a later epoch a copy or caller spoke of, promised here from that moment
        # (its durable fence follows in _step_down): a shard deposed that way is not
        # promoted again under its old epoch meanwhile.
        self._promised: dict[int, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self.failovers = 0

    # -- life ---------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._tick(), name="querator-shard-roles")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._pending) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for shard in self.host.shards.values():
            if shard.primary is not None:
                await shard.primary.stop()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            for uid in list(self._records):
                try:
                    await self.refollow(uid)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("shard_roles_failed", uid=uid)

    # -- following the records ----------------------------------------------------------

    async def follow(self, record: ShardRecord, config: QueueConfig) -> None:
        """The shard's record as the catalog has it now; ``config`` its local queue's
        settings (with the shard's uid), to open the copy with."""
        self._records[record.uid] = (record, config)
        await self.refollow(record.uid)

    def held(self) -> set[int]:
        """The shards this node follows."""
        return set(self._records)

    def serving(self, uid: int) -> bool:
        """Whether this node serves shard ``uid`` as its primary now."""
        shard = self.host.shards.get(uid)
        return shard is not None and shard.primary is not None

    async def forget(self, uid: int) -> None:
        """This node holds no copy of ``uid`` any more (the queue was deleted or moved)."""
        async with self._lock(uid):
            self._records.pop(uid, None)
            self._promised.pop(uid, None)
            shard = self.host.shards.pop(uid, None)
            if shard is not None and shard.primary is not None:
                await self._demote(shard)

    async def refollow(self, uid: int) -> None:
        async with self._lock(uid):
            held = self._records.get(uid)
            if held is None:
                return
            record, config = held
            latest = self.table.get(uid)
            if latest is not None and latest.mod_revision > record.mod_revision:
                record = latest
                self._records[uid] = (record, config)
            shard = self.host.shards.get(uid)
            if shard is None:
                copy: CopyLike = await self._open(config)
                shard = self.host.shards[uid] = Shard(uid, record.queue, copy, ChangeRing(self._ring_changes))
            await self._step(shard, record)

    async def _open(self, config: QueueConfig) -> CopyLike:
        """This node's copy of the shard; a copy whose storage cannot be loaded (missing,
        truncated, damaged: refused at start) is dropped and made again, empty, with a
        new incarnation: out of the in-sync set until the primary rebuilt it."""
        reason = self._manager.failure(config.name)
        if reason:
            log.error("shard_copy_rebuilt", queue=config.name, uid=config.uid, reason=reason)
            await self._manager.delete(config.name, True)
        copy: CopyLike = await self._manager.open_copy(config)
        return copy

    def _lock(self, uid: int) -> asyncio.Lock:
        return self._locks.setdefault(uid, asyncio.Lock())

    async def _step(self, shard: Shard, record: ShardRecord) -> None:
        me = self.node
        running = shard.primary
        if running is not None:
            serving = shard.copy.serving_epoch == running.epoch
            if record.primary == me and record.epoch == running.epoch and running.failure is None and serving:
                running.record_changed(record)
                return
            running.deposed(f"the record names {record.primary!r} at epoch {record.epoch}")
            await self._demote(shard)
        mine = isr_incarnation(record, me)
        if record.primary == me and mine == UNCLAIMED and shard.copy.position().lsn == 0:
            # A new queue: every copy is empty, this one claims its entry before it serves.
            claimed = await self._claim(record, shard)
            if claimed is None:
                return
            record, mine = claimed, shard.copy.incarnation
        in_sync = mine == shard.copy.incarnation
        if record.primary == me:
            if not in_sync:
                await self._race(shard, record, include_self=False)
            elif max(shard.copy.fenced_epoch(), self._promised.get(shard.uid, 0)) <= record.epoch:
                await self._promote(shard, record)
            else:
                await self._race(shard, record, include_self=True)
        elif not self._live(record.primary) and mine is not None:
            why = why_not_electable(record, me, shard.copy.incarnation, shard.copy.rebuilt_epoch())
            if not why:
                await self._race(shard, record, include_self=True)
            elif self._blocked.get(record.uid) != record.mod_revision:
                self._blocked[record.uid] = record.mod_revision
                log.error(
                    "shard_failover_blocked",
                    uid=record.uid,
                    queue=record.queue,
                    primary=record.primary,
                    epoch=record.epoch,
                    reason=why,
                    detail="this copy cannot take over; another in-sync copy or the primary must",
                )

    async def _claim(self, record: ShardRecord, shard: Shard) -> ShardRecord | None:
        try:
            claimed = await self.table.expand_isr(record, (self.node, shard.copy.incarnation))
        except Exception as exc:  # lost to another change, or etcd away: the next turn reads it again
            log.info("shard_claim_failed", uid=record.uid, error=str(exc)[:200])
            return None
        held = self._records.get(record.uid)
        if held is not None:
            self._records[record.uid] = (claimed, held[1])
        return claimed

    async def _race(self, shard: Shard, record: ShardRecord, include_self: bool) -> None:
        """Start an election (in the background: a catalog change must not wait for it)."""
        now = time.monotonic()
        if now - self._raced_at.get(record.uid, 0.0) < _RETRY_RACE_S or record.uid in self._racing:
            return
        self._raced_at[record.uid] = now
        self._racing.add(record.uid)

        async def race() -> None:
            try:
                async with self._lock(record.uid):
                    held = self._records.get(record.uid)
                    if held is None or held[0].mod_revision != record.mod_revision:
                        return  # the record moved on meanwhile: the next turn judges it again
                    await self._race_now(shard, record, include_self)
            finally:
                self._racing.discard(record.uid)

        self._spawn(race())

    async def _race_now(self, shard: Shard, record: ShardRecord, include_self: bool) -> None:
        elected = await failover.run(
            self.node, record, shard, self.table, self._deposed_error, self.peers, self._live, include_self
        )
        if elected is None:
            return
        self.failovers += 1
        held = self._records.get(record.uid)
        if held is not None:
            self._records[record.uid] = (elected, held[1])
        if elected.primary == self.node:
            await self._promote(shard, elected)

    async def _promote(self, shard: Shard, record: ShardRecord) -> None:
        replication = ShardReplication(
            self.node,
            record,
            self.table,
            self._deposed_error,
            self.peers,
            shard.copy,
            shard.ring,
            self.lag_s,
            on_deposed=self._deposed,
            lease=getattr(self.table.writer, "held_until", None),
            on_newer_epoch=self._newer_epoch,
        )
        shard.primary = replication
        try:
            await self._manager.promote(record.queue, record.epoch, replication)
        except Exception as exc:
            shard.primary = None
            log.error("shard_promote_failed", uid=record.uid, queue=record.queue, epoch=record.epoch, error=str(exc)[:300])
            return
        replication.start()
        log.info("shard_primary", uid=record.uid, queue=record.queue, epoch=record.epoch, node=self.node)

    async def _demote(self, shard: Shard) -> None:
        replication, shard.primary = shard.primary, None
        try:
            # First, while the links still ship: the answers in flight may still be acked.
            await self._manager.demote(shard.queue)
        except Exception as exc:  # demoted already (the gate's failure does it too)
            log.debug("shard_demote", uid=shard.uid, queue=shard.queue, error=str(exc)[:200])
        if replication is not None:
            await replication.stop()
        log.info("shard_demoted", uid=shard.uid, queue=shard.queue, node=self.node)

    def _deposed(self, uid: int) -> None:
        self._soon(uid)

    def _newer_epoch(self, uid: int, epoch: int) -> None:
        """A copy or a caller speaks of ``epoch``, above the one this node serves ``uid``
        under: this node was deposed while it could not tell (paused, cut off), or
        fenced by a hand-over about to elect another copy."""
        # Its own election (``_step``: promised a later epoch) is only the way out
        # should the asker's election not come: not before _RETRY_RACE_S, so as not to
        # race the asker's (a hand-over's CAS follows its fence at once).
        self._raced_at[uid] = time.monotonic()
        # Before the deposed primary's own refollow (spawned as it is deposed) can run:
        # it would find the record still naming this node, this copy not fenced yet, and
        # promote it again under the old epoch, its next change stored here alone (the
        # replicas refuse it) and the copy rebuilt by snapshot once another is elected.
        self._promised[uid] = max(self._promised.get(uid, 0), epoch)
        shard = self.host.shards.get(uid)
        if shard is not None and shard.primary is not None:
            shard.primary.deposed(f"another node speaks of epoch {epoch}")
        self._spawn(self._step_down(uid, epoch))

    async def _step_down(self, uid: int, epoch: int) -> None:
        """Demote, and promise ``epoch`` on this copy, so it is not promoted again under
        the old one while the catalog still names this node (its watch may lag)."""
        async with self._lock(uid):
            shard = self.host.shards.get(uid)
            if shard is None:
                return
            if shard.primary is not None:
                await self._demote(shard)
            async with shard.lock:
                if shard.copy.fenced_epoch() < epoch:
                    await shard.copy.fence(epoch)
            if self._promised.get(uid, 0) <= epoch:
                self._promised.pop(uid, None)  # the copy's fence says it now
        await self.refollow(uid)

    def _soon(self, uid: int) -> None:
        self._spawn(self.refollow(uid))

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
