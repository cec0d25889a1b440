"""This node's copies of replicated shards, and the replication calls other nodes make
to them: change sets applied in order (each durable before it is acked), positions
asked for and epochs fenced, snapshots installed.

A copy applies only change sets of an epoch it has not promised away (storage refuses
lower ones: ``Fenced``) and only the next lsn of its history (``Diverged`` otherwise);
a resent change it already holds under the same epoch is a no-op (the primary resends
after a lost answer). Every change applied here also goes into the shard's ring, so this copy, once
promoted, can bring the others up to its position by tail.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from ..errors import InvalidArgument, Unavailable
from ..logging import get_logger
from ..settled import settled
from .change_ring import ChangeRing
from .replica_contract import ChangeSetLike, CopyLike, Decode
from .replica_wire import CopyState, Ship, SnapshotHead, StatusAsk

if TYPE_CHECKING:
    from .shipper import ShardReplication

log = get_logger("cluster")


def _stats(copy: CopyLike) -> dict[str, object]:
    """Where the copy's last install spent its time, rounded, for the log."""
    stats = getattr(copy, "install_stats", None)
    if stats is None:
        return {}
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(stats).items()}


@dataclass(slots=True)
class Shard:
    """This node's copy of one shard and what runs on it."""

    uid: int
    queue: str
    copy: CopyLike
    ring: ChangeRing = field(default_factory=ChangeRing)
    # Serialises what changes the copy (apply, fence, install): in lsn order, one at a time.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    primary: ShardReplication | None = None  # set while this node serves it as primary
    applied: int = 0  # change sets applied here as a replica
    installs: int = 0  # snapshots installed here

    def state(self, refused: str = "", detail: str = "") -> CopyState:
        position = self.copy.position()
        return CopyState(
            position.epoch,
            position.lsn,
            self.copy.incarnation,
            self.copy.fenced_epoch(),
            self.primary is not None,
            refused,
            detail,
            self.copy.rebuilt_epoch(),
        )


class CopyHost:
    """Serves the replication calls for the shards this node holds a copy of."""

    def __init__(
        self,
        decode: Decode,
        fenced_error: type[Exception],
        diverged_error: type[Exception],
        on_newer_epoch: Callable[[int, int], None],
    ) -> None:
        self.shards: dict[int, Shard] = {}
        self._decode = decode
        self._fenced = fenced_error
        self._diverged = diverged_error
        # Told when a call names an epoch above the one this node serves a shard as
        # primary under (uid, epoch): it was deposed meanwhile.
        self._on_newer_epoch = on_newer_epoch
        # Shards this node hands over as it stops (SIGTERM): its copies of them take no
        # more changes and answer no catch-up, so the new primary, which left it out of
        # the in-sync set, does not catch it up and add it back just before it exits
        # (then to wait for it; seen: the in-sync set [n2, n1] after n1 stopped).
        self.leaving: set[int] = set()

    def _shard(self, uid: int) -> Shard:
        shard = self.shards.get(uid)
        if shard is None:
            raise Unavailable(f"this node holds no copy of shard {uid} (yet)")
        return shard

    def _replica(self, uid: int) -> Shard:
        """The shard, for a call that would catch its copy up (not while leaving)."""
        shard = self._shard(uid)
        if uid in self.leaving and shard.primary is None:
            raise Unavailable(f"this node is stopping: its copy of shard {uid} takes no more changes")
        return shard

    async def ship(self, ship: Ship) -> CopyState:
        shard = self._replica(ship.uid)
        if shard.primary is not None:
            if ship.epoch > shard.primary.epoch:
                self._on_newer_epoch(ship.uid, ship.epoch)
            return shard.state("primary", f"this node serves shard {ship.uid} as primary")
        if ship.incarnation and ship.incarnation != shard.copy.incarnation:
            return shard.state("mismatch", f"the copy here is incarnation {shard.copy.incarnation}")
        async with shard.lock:
            # The call's changes up to the first that does not decode or names another
            # shard are applied (one durable write), then that one is answered, as one
            # by one.
            changes: list[tuple[ChangeSetLike, bytes]] = []
            bad: InvalidArgument | str | None = None  # str: why it diverged
            for blob in ship.changes:
                try:
                    change = self._decode(blob)
                except ValueError as exc:
                    bad = InvalidArgument("value", f"a change set of shard {ship.uid}: {exc}")
                    break
                if change.uid != ship.uid:
                    bad = f"a change set of shard {change.uid} in a call for {ship.uid}"
                    break
                changes.append((change, blob))
            try:
                await settled(self._apply(shard, changes, ship.epoch))
            except Exception as exc:
                if isinstance(exc, self._fenced):
                    return shard.state("fenced", str(exc))
                if isinstance(exc, self._diverged):
                    return shard.state("diverged", str(exc))
                raise
            if isinstance(bad, InvalidArgument):
                raise bad
            if bad is not None:
                return shard.state("diverged", bad)
        return shard.state()

    @staticmethod
    async def _apply(shard: Shard, changes: list[tuple[ChangeSetLike, bytes]], sender: int) -> None:
        """Apply changes (in one durable write) and put those applied in the ring, both
        or neither: a call cancelled in between (its primary died) left the ring behind
        the copy, and the copy, once promoted, took itself for further behind than it
        was (a snapshot for a copy level with it: a new incarnation, out of the in-sync
        set). A refusal after the first change comes back once those before it are in
        the ring."""
        if not changes:
            return
        blobs = {change.lsn: blob for change, blob in changes}
        # A change it holds already (resent after a lost answer) is a no-op, unless held
        # under another epoch: then Diverged (storage checks both).
        written, refused = await shard.copy.apply_all([change for change, _ in changes], sender)
        for change in written:
            shard.ring.add(change.epoch, change.lsn, blobs[change.lsn])
            shard.applied += 1
        if refused is not None:
            raise refused

    async def status(self, ask: StatusAsk) -> CopyState:
        shard = self._replica(ask.uid)
        if ask.fence:
            # Deposed first, so it answers nothing more (its in-flight calls fail) rather
            # than the fence's step-down waiting for them: the asker may be about to elect.
            if shard.primary is not None and ask.fence > shard.primary.epoch:
                self._on_newer_epoch(ask.uid, ask.fence)
            async with shard.lock:
                if ask.fence > shard.copy.fenced_epoch():
                    await shard.copy.fence(ask.fence)
                    log.info("shard_fenced", uid=ask.uid, epoch=ask.fence)
        return shard.state()

    async def install(self, head: SnapshotHead, chunks: AsyncIterator[bytes]) -> CopyState:
        shard = self._replica(head.uid)
        if shard.primary is not None:
            if head.epoch > shard.primary.epoch:
                self._on_newer_epoch(head.uid, head.epoch)
            return shard.state("primary", f"this node serves shard {head.uid} as primary")
        async with shard.lock:
            if head.epoch < shard.copy.fenced_epoch():
                return shard.state("fenced", f"a snapshot of epoch {head.epoch} below {shard.copy.fenced_epoch()}")
            # Emptied first: a call cancelled half-way must not leave the old history's
            # changes in the ring of a copy that now holds another.
            shard.ring.clear()
            position = await shard.copy.install_snapshot(chunks, head.epoch)
            shard.installs += 1
            log.info(
                "replica_snapshot_installed",
                uid=head.uid,
                epoch=position.epoch,
                lsn=position.lsn,
                primary=head.primary,
                incarnation=shard.copy.incarnation,
                **_stats(shard.copy),
            )
        return shard.state()
