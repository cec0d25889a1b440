"""The primary's side of one shard's replication: its ``Replication`` (the actor's gate
awaits ``replicated`` before it answers a cycle's calls) and one ordered link per
replica.

The ack rule: a change is replicated once every copy the primary counts has acked it
durable, and never while an entry of the in-sync set is unclaimed (a new queue's copies
are claimed, in a tick or two, before its first answer). It counts the in-sync set of the shard's record in etcd, plus a replica it is
adding (counted from the moment it proposes it, so no change acknowledged after that
misses it), and drops a member only once etcd took the shrink: a replica silent or
behind for ``lag_s`` is shrunk out through a compare-and-swap, and until that CAS
succeeded it is waited for. A CAS lost means another primary was elected: every
waiting and later change fails UNAVAILABLE (the actor then stops serving as primary).
Below ``min_isr`` copies in sync ``writable`` raises, and the actor refuses writes
UNAVAILABLE before storing them; a change stored before the count fell waits (its
caller's deadline ends it: an outcome the caller cannot know) until a replica is back
in step.

Each link sends the ring's changes in lsn order, one batch in flight; on any error it
asks the replica for its position again and picks the path (tail, snapshot: see
change_ring.py), so a lost answer never reorders or skips a change.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable

from google.protobuf.wrappers_pb2 import BytesValue

from ..errors import QueratorError, Unavailable
from ..logging import get_logger
from .change_ring import ChangeRing, Path
from .forwarding import Peers
from .replica_contract import UNCLAIMED, ChangeSetLike, CopyLike, isr_incarnation, isr_nodes
from .replica_wire import SHIP, SNAPSHOT, STATUS, CopyState, Ship, SnapshotHead, StatusAsk
from .shard_record import ShardRecord
from .shard_table import ShardTable

log = get_logger("cluster")

SERVICE = "querator.internal.Peer"
REPLICA_LAG_S = 2.0
_BATCH_BYTES = 4 << 20
_CALL_S = 5.0
_SNAPSHOT_S = 600.0
_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 1.0


class ReplicaLink:
    """The ordered stream of one shard's changes to one replica node."""

    def __init__(self, shard: ShardReplication, node: str) -> None:
        self.shard = shard
        self.node = node
        self.acked = -1  # the lsn it has durable, on this primary's history (-1: unknown)
        self.incarnation = ""  # its copy's, as it last said
        self.behind_since: float | None = None  # when the oldest change it lacks was offered
        self.synced = False  # its position is known to be on this primary's history
        self.path = ""  # the last catch-up path taken (tail, snapshot), for status
        self.snapshots = 0
        self.rebuild = False  # the next sync sends a snapshot whatever its position says
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"querator-ship-{self.shard.uid}-{self.node}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def offered(self, lsn: int, now: float) -> None:
        if self.behind_since is None and self.acked < lsn:
            self.behind_since = now
        self._wake.set()

    async def _call(self, method: str, data: bytes, timeout: float) -> CopyState:
        reply = await self.shard.peers.forward(
            self.node, f"/{SERVICE}/{method}", BytesValue(value=data), BytesValue, None, timeout
        )
        return CopyState.decode(reply.value)

    async def _run(self) -> None:
        delay = _RETRY_FIRST_S
        while True:
            try:
                await self._sync()
                delay = _RETRY_FIRST_S
                await self._tail()
            except asyncio.CancelledError:
                raise
            except QueratorError as exc:
                self.synced = False
                log.debug("replica_link_failed", uid=self.shard.uid, node=self.node, error=str(exc)[:300])
            except Exception:
                self.synced = False
                log.exception("replica_link_failed", uid=self.shard.uid, node=self.node)
            if self.shard.failure is not None:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    async def _sync(self) -> None:
        """Learn the replica's position and bring it onto this primary's history."""
        shard = self.shard
        state = await self._call(STATUS, StatusAsk(shard.uid).encode(), _CALL_S)
        self._check(state)
        self.incarnation = state.incarnation
        here = shard.here()
        path = shard.ring.path(state.position, here)
        log.info(
            "replica_sync",
            uid=shard.uid,
            node=self.node,
            path="snapshot" if self.rebuild else path.value,
            position=list(state.position),
            primary_position=list(here),
        )
        if path is Path.SNAPSHOT or self.rebuild:
            state = await self._snapshot()
            self._check(state)
            if state.refused:
                raise Unavailable(f"node {self.node!r} refused the snapshot ({state.refused}: {state.detail})")
            self.rebuild = False
            self.incarnation = state.incarnation
            self.path = "snapshot"
        else:
            self.path = "tail"
        self._acked(state.lsn)
        self.synced = True

    def _check(self, state: CopyState) -> None:
        if state.fenced_epoch > self.shard.epoch:
            self.shard.newer_epoch(
                state.fenced_epoch, f"node {self.node!r} promised epoch {state.fenced_epoch} (> {self.shard.epoch})"
            )
            raise Unavailable(f"shard {self.shard.uid}: deposed")
        if state.primary:
            raise Unavailable(f"node {self.node!r} still runs shard {self.shard.uid} as primary")

    async def _snapshot(self) -> CopyState:
        shard = self.shard
        self.snapshots += 1
        log.info("replica_snapshot_sent", uid=shard.uid, node=self.node, epoch=shard.epoch)
        head = BytesValue(value=SnapshotHead(shard.uid, shard.epoch, shard.node).encode())

        started = time.monotonic()
        read = {"s": 0.0, "chunks": 0, "bytes": 0}

        async def messages() -> AsyncIterator[BytesValue]:
            yield head
            chunks = aiter(shard.copy.snapshot_chunks())
            while True:
                at = time.monotonic()
                chunk = await anext(chunks, None)
                read["s"] += time.monotonic() - at
                if chunk is None:
                    return
                read["chunks"] += 1
                read["bytes"] += len(chunk)
                yield BytesValue(value=chunk)

        channel = shard.peers.channel(self.node)
        call = channel.stream_unary(
            f"/{SERVICE}/{SNAPSHOT}",
            request_serializer=BytesValue.SerializeToString,
            response_deserializer=BytesValue.FromString,
        )
        metadata = shard.peers.proof_metadata()
        reply: BytesValue = await call(messages(), timeout=_SNAPSHOT_S, metadata=metadata)
        log.info(
            "replica_snapshot_done",
            uid=shard.uid,
            node=self.node,
            seconds=round(time.monotonic() - started, 3),
            read_s=round(read["s"], 3),
            chunks=read["chunks"],
            bytes=read["bytes"],
        )
        return CopyState.decode(reply.value)

    def _acked(self, lsn: int) -> None:
        self.acked = lsn
        self.behind_since = self.shard.offered_after(lsn)
        self.shard.notify()

    async def _tail(self) -> None:
        shard = self.shard
        while True:
            entries = shard.ring.after(self.acked, _BATCH_BYTES)
            if not entries:
                if len(shard.ring) and self.acked < shard.ring.first_lsn - 1:  # fell out of it meanwhile
                    raise Unavailable(f"node {self.node!r} fell behind the ring")
                self._wake.clear()
                await self._wake.wait()
                continue
            if entries[0].lsn != self.acked + 1:
                raise Unavailable(f"node {self.node!r} fell behind the ring")
            ship = Ship(shard.uid, shard.epoch, shard.node, self.incarnation, tuple(e.data for e in entries))
            state = await self._call(SHIP, ship.encode(), _CALL_S)
            self._check(state)
            if state.refused:
                # Not on this primary's history after all, or a change of an older epoch
                # its fence refuses (a suffix from before an election): rebuild it.
                self.rebuild = state.refused in ("diverged", "fenced")
                raise Unavailable(f"node {self.node!r} refused the change sets ({state.refused}: {state.detail})")
            self._acked(state.lsn)


class ShardReplication:
    """``Replication`` for one shard this node is primary of (epoch ``record.epoch``)."""

    def __init__(
        self,
        node: str,
        record: ShardRecord,
        table: ShardTable,
        deposed_error: type[Exception],
        peers: Peers,
        copy: CopyLike,
        ring: ChangeRing,
        lag_s: float = REPLICA_LAG_S,
        on_deposed: Callable[[int], None] | None = None,
        lease: Callable[[], tuple[int, float]] | None = None,
        on_newer_epoch: Callable[[int, int], None] | None = None,
    ) -> None:
        self.node = node
        self.uid = record.uid
        self.epoch = record.epoch
        self.record = record
        self.table = table
        self._deposed_error = deposed_error
        self.peers = peers
        self.copy = copy
        self.ring = ring
        self.lag_s = lag_s
        self._on_deposed = on_deposed
        self._on_newer_epoch = on_newer_epoch
        self.failure: Unavailable | None = None
        # The members waited on: the record's ISR (less this node) and any being added.
        self.counted: set[str] = {n for n in isr_nodes(record) if n != node}
        self.links = {n: ReplicaLink(self, n) for n in (*record.replicas, *isr_nodes(record)) if n != node}
        self._changed = asyncio.Condition()
        self._offered: deque[tuple[int, float]] = deque()  # (lsn, when) of changes not acked by every link
        self._isr_lock = asyncio.Lock()
        self._monitor: asyncio.Task[None] | None = None
        # The highest lsn answered (replicated() returned): every counted copy holds it.
        self.released = copy.position().lsn
        self._stopping: set[asyncio.Task[None]] = set()  # links of copies that left, stopping
        self._adding: set[str] = set()  # being added to etcd's ISR right now (counted already)
        self.below_min = ""  # why a lagging copy could not be dropped (the minimum), if so
        self.shrinks = 0
        self.expands = 0
        # This node's membership: (registration, monotonic time etcd surely keeps it
        # until). A change is answered only before then, under the registration this
        # primary confirmed: a failover needs this node's membership gone (failover.py),
        # so no other epoch can have begun acknowledging yet. Without it, an answer its
        # replica sent before an election, held on the way (a partition), would release
        # a cycle after the new primary began acknowledging. None: no such bound.
        self._lease = lease
        self._registration = lease()[0] if lease is not None else 0
        self._leased = True

    # -- life ---------------------------------------------------------------------------

    def start(self) -> None:
        for link in self.links.values():
            link.start()
        self._monitor = asyncio.create_task(self._watch_lag(), name=f"querator-isr-{self.uid}")

    async def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        await asyncio.gather(*(link.stop() for link in self.links.values()))
        if self.failure is None:
            self.failure = Unavailable(f"shard {self.uid}: this node no longer serves it as primary")
        self.notify()

    def here(self) -> tuple[int, int]:
        """This primary's position: its last change handed over, or its copy's when the
        ring has nothing as recent (before any, or a change applied here as a replica
        that the ring missed): never behind what the copy holds, or a copy level with
        it would be taken for one ahead, and rebuilt."""
        last = self.ring.last
        position = self.copy.position()
        if last is not None and last.lsn >= position.lsn:
            return (last.epoch, last.lsn)
        return (position.epoch, position.lsn)

    # -- the gate -------------------------------------------------------------------------

    def writable(self) -> None:
        """Raise unless a change made now could be acknowledged (before anything is written)."""
        if self.failure is not None:
            raise self.failure
        if self.below_min:
            raise Unavailable(f"queue {self.record.queue!r}: a copy in sync stopped answering and {self.below_min}")
        in_sync = 1 + len(self.counted)
        if in_sync < self.record.min_isr:
            raise Unavailable(
                f"queue {self.record.queue!r}: {in_sync} in-sync copies, fewer than its minimum of "
                f"{self.record.min_isr}; writes are refused until a replica is back in step, retry"
            )

    async def replicated(self, change: ChangeSetLike) -> None:
        if self.failure is not None:
            raise self.failure
        lsn = change.lsn
        self.ring.add(change.epoch, lsn, change.encode())
        now = time.monotonic()
        self._offered.append((lsn, now))
        for link in self.links.values():
            link.offered(lsn, now)
        async with self._changed:
            await self._changed.wait_for(lambda: self._done(lsn) or self.failure is not None)
            # Deposed first: its copies' acks may have come since, but a later epoch may
            # be answering already (a hand-over fences this primary before it elects).
            if self.failure is None and self._done(lsn):
                # Under the condition's lock, as _expand counts a copy: a change is either
                # released before the copy is counted (and the copy holds it), or waits for it.
                self.released = max(self.released, lsn)
                return
        assert self.failure is not None
        raise self.failure

    def _done(self, lsn: int) -> bool:
        if 1 + len(self.counted) < self.record.min_isr:
            return False
        if any(incarnation == UNCLAIMED for _, incarnation in self.record.isr):
            # An unclaimed entry names no copy: an ack from that node may come from a copy
            # made since (its data lost). Nothing is acknowledged until every entry names
            # the copy that acked, so an unclaimed copy holds everything acknowledged
            # (nothing) and may take over (replica_contract.why_not_electable).
            return False
        return all(self.links[n].acked >= lsn for n in self.counted if n in self.links) and self._within_lease()

    def _within_lease(self) -> bool:
        if self._lease is None:
            return True
        registration, until = self._lease()
        return registration == self._registration and time.monotonic() < until

    async def _check_lease(self) -> None:
        """While this node's membership may have lapsed, answers wait; once it holds one
        again, go on if the record (read from etcd, after the registration) still names
        this node at this epoch, else this primary was deposed."""
        leased = self._within_lease()
        if leased:
            if not self._leased:
                self._leased = True
                self.notify()
            return
        self._leased = False
        assert self._lease is not None
        registration, until = self._lease()
        if not registration or registration == self._registration or time.monotonic() >= until:
            return  # not registered again yet
        try:
            current = await self.table.fetch(self.uid)
        except Exception as exc:  # etcd away: the next turn asks again
            log.info("shard_lease_check_failed", uid=self.uid, error=str(exc)[:200])
            return
        if current is None or current.epoch != self.epoch or current.primary != self.node:
            where = "gone" if current is None else f"names {current.primary!r} at epoch {current.epoch}"
            self.deposed(f"its membership lapsed and the record {where}")
            return
        self._registration = registration
        log.info("shard_lease_renewed", uid=self.uid, epoch=self.epoch, registration=registration)
        self._leased = True
        self.notify()

    def notify(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(wake())

    def offered_after(self, lsn: int) -> float | None:
        """When the first change after ``lsn`` was offered (None: there is none)."""
        slowest = min((link.acked for link in self.links.values()), default=lsn)
        while self._offered and self._offered[0][0] <= slowest:
            self._offered.popleft()
        for offered, when in self._offered:
            if offered > lsn:
                return when
        return None

    def deposed(self, why: str) -> None:
        if self.failure is None:
            log.warning("shard_deposed", uid=self.uid, epoch=self.epoch, node=self.node, reason=why)
            self.failure = Unavailable(
                f"queue {self.record.queue!r}: this node is no longer its primary (epoch {self.epoch}: {why}); "
                "retry: the call goes to the new primary"
            )
            self.notify()
            if self._on_deposed is not None:
                self._on_deposed(self.uid)

    def newer_epoch(self, epoch: int, why: str) -> None:
        """A replica promised ``epoch`` (> this one's): an election began. Deposed; the
        node's own copy promises it too (``on_newer_epoch``), so that, should that
        election not complete (it needs this node's membership gone), this node runs
        one itself rather than serve again under an epoch its replicas refuse."""
        self.deposed(why)
        if self._on_newer_epoch is not None:
            self._on_newer_epoch(self.uid, epoch)

    def record_changed(self, record: ShardRecord) -> None:
        """The shard's record as the catalog watch saw it."""
        if record.epoch != self.epoch or record.primary != self.node:
            self.deposed(f"the record names {record.primary!r} at epoch {record.epoch}")
            return
        if record.mod_revision > self.record.mod_revision and not self._isr_lock.locked():
            self._adopt(record)

    # -- the in-sync set ----------------------------------------------------------------

    async def _watch_lag(self) -> None:
        while self.failure is None:
            await asyncio.sleep(min(0.25, self.lag_s / 4))
            try:
                await self._check_lease()
                await self._adjust()
            except Exception:
                log.exception("isr_adjust_failed", uid=self.uid)

    async def _adjust(self) -> None:
        now = time.monotonic()
        self.below_min = ""
        for node, link in list(self.links.items()):
            if node not in self.record.replicas and node not in self.counted:
                continue  # its copy left the shard (a move, a retire): nothing to add back
            in_isr = isr_incarnation(self.record, node)
            # In step enough to count: it holds every change acknowledged so far (those
            # still waiting will wait for it too once it is counted), so a copy is added
            # back under a steady load, not only in a lull.
            caught_up = link.synced and bool(link.incarnation) and link.acked >= self.released
            if node in self.counted:
                # A copy not yet claimed (UNCLAIMED: a new queue's empty copy) is waited
                # on from the start and claimed once its link knows its incarnation.
                stale = link.synced and bool(in_isr) and link.incarnation != in_isr
                late = link.behind_since is not None and now - link.behind_since >= self.lag_s
                if stale or late:
                    why = "a new copy (its data was lost or rebuilt)" if stale else f"behind for {self.lag_s:g} s"
                    await self._shrink(node, why)
                elif in_isr == UNCLAIMED and caught_up:
                    await self._expand(node, link.incarnation)
            elif caught_up:
                await self._expand(node, link.incarnation)

    async def _cas(self, change: Callable[[], Awaitable[ShardRecord]]) -> ShardRecord | None:
        """The record ``change`` wrote, or None: it did not apply (deposed: self.failure
        is set), or its outcome is unknown (the record is read again; the next turn
        tries again)."""
        try:
            return await change()
        except self._deposed_error as exc:
            current: ShardRecord | None = getattr(exc, "current", None)
            if current is not None and current.epoch == self.epoch and current.primary == self.node:
                # Changed by this primary's own earlier CAS of unknown outcome, or this
                # node's membership was renewed: not deposed; go on from what is there.
                self._adopt(current)
                return None
            if current is not None:
                self.deposed(f"the record names {current.primary!r} at epoch {current.epoch}")
            return None
        except Unavailable as exc:  # etcd did not answer (or below min_isr): nothing known to change
            self.below_min = str(exc) if "minimum" in str(exc) else self.below_min
            log.warning("isr_change_failed", uid=self.uid, error=str(exc)[:300])
            return None

    def _adopt(self, record: ShardRecord) -> None:
        """Take ``record`` (this primary's epoch) as the current one: its ISR is etcd's."""
        self.record = record
        members = {n for n in isr_nodes(record) if n != self.node}
        self.counted &= members | self._adding
        self.counted |= members
        if self._monitor is not None:  # a copy added within this epoch (a move): ship to it too
            for node in record.replicas:
                if node != self.node and node not in self.links:
                    link = self.links[node] = ReplicaLink(self, node)
                    link.start()
            # A copy that left the shard (moved, dropped): its link stops, or its stale
            # position would hold the offered-changes bookkeeping back for ever.
            for node in [n for n in self.links if n not in record.replicas and n not in self.counted]:
                stopping = asyncio.get_running_loop().create_task(self.links.pop(node).stop())
                self._stopping.add(stopping)
                stopping.add_done_callback(self._stopping.discard)
        self.notify()

    async def _shrink(self, node: str, why: str) -> None:
        async with self._isr_lock:
            if self.failure is not None or isr_incarnation(self.record, node) is None:
                self.counted.discard(node)  # counted while being added only: never in etcd's set
                self.notify()
                return
            record = await self._cas(lambda: self.table.shrink_isr(self.record, node))
            if record is None:
                return
            self.shrinks += 1
            self._adopt(record)
            log.warning("isr_shrunk", uid=self.uid, queue=record.queue, node=node, reason=why, isr=isr_nodes(record))
            self.notify()

    async def _expand(self, node: str, incarnation: str) -> None:
        async with self._isr_lock:
            if self.failure is not None:
                return
            async with self._changed:
                if self.links[node].acked < self.released:
                    return  # a change it lacks was acknowledged meanwhile: next turn
                self.counted.add(node)  # from now on every change waits for it too
            self._adding.add(node)
            try:
                record = await self._cas(lambda: self.table.expand_isr(self.record, (node, incarnation)))
            finally:
                self._adding.discard(node)
            if record is None:
                if isr_incarnation(self.record, node) is None:
                    self.counted.discard(node)  # never in etcd's set: nobody can elect it
                    self.notify()
                return
            self.expands += 1
            self._adopt(record)
            log.info("isr_expanded", uid=self.uid, queue=record.queue, node=node, isr=isr_nodes(record))
            self.notify()
