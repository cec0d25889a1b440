"""A replicated queue's copy on this node, as the cluster's data path drives it.

Passive while another node is the queue's primary: change sets are applied to it, it
is fenced, read whole for a snapshot, compared by digest. While this node is the
primary (``serving_epoch``), the actor writes it and nothing else may: a change set or
a fence under a later epoch first makes the node step down (``step_down``, given by
the manager), since a later epoch means another node was elected.

Operations run one at a time, each durable before it returns: in a write transaction
of the copy's own on its lane, or in its commit group's next commit. Each runs to its
end even if its caller is cancelled (``settled``), so what the copy says of itself
(position, promise, incarnation) is always what its storage holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import lmdb

from ..settled import settled
from .change_set import ChangeSet, Diverged, Fenced, Position
from .commit_group import CommitGroup
from .lane import StorageLane
from .queue_store import MAX_GROWTHS, MapFull, StorageFull
from .replica_state import Hasher, ReplicaState
from .snapshot import CHUNK_BYTES, END, SnapshotHeader, SnapshotReader, data_ops, decode_end

T = TypeVar("T")


@dataclass(slots=True)
class InstallStats:
    """Where the last snapshot install's time went (seconds), for its log event."""

    chunks: int = 0
    entries: int = 0
    waited_s: float = 0.0  # for the next chunk from the primary
    written_s: float = 0.0  # decoding and storing chunks
    seconds: float = 0.0


def _take_chunk(state: ReplicaState, chunk: bytes, received: Hasher) -> list[tuple[str, bytes, bytes | None]]:
    """A snapshot chunk's entries, their databases opened and the entries hashed (a
    job, off the loop)."""
    ops = data_ops(chunk, state.uid)
    state.prepare_roles({role for role, _, _ in ops})
    run_role, run = "", list[tuple[bytes, bytes]]()
    for role, key, value in ops:
        if value is None:
            raise Diverged(f"a snapshot chunk of queue uid {state.uid} deletes an entry")
        if role != run_role and run:
            received.add_run(run_role, run)
            run = []
        run_role = role
        run.append((key, value))
    if run:
        received.add_run(run_role, run)
    return ops


class ReplicaCopy:
    """One queue's copy on this node (see the module docstring)."""

    def __init__(self, name: str, state: ReplicaState, lane: StorageLane, group: CommitGroup | None) -> None:
        self.name = name
        self.state = state
        self.lane = lane
        self.group = group
        self._lock = asyncio.Lock()
        # The epoch this node serves the queue under as its primary (0: passive).
        self.serving_epoch = 0
        # Stops the primary here before a later epoch's change or fence is taken.
        self.step_down: Callable[[int], Awaitable[None]] | None = None
        self.install_stats = InstallStats()

    @property
    def incarnation(self) -> str:
        return self.state.incarnation

    def position(self) -> Position:
        return self.state.position()

    def fenced_epoch(self) -> int:
        return self.state.fenced_epoch()

    def history(self) -> list[tuple[int, int]]:
        return self.state.history()

    def digest(self) -> str:
        return self.state.digest()[1]

    def rebuilt_epoch(self) -> int:
        return self.state.rebuilt_epoch()

    async def apply(self, change: ChangeSet, sender: int = 0) -> Position:
        """Apply ``change``, sent by the primary of epoch ``sender``, durably (a no-op
        for one held already); raises ``Fenced`` or ``Diverged`` (change_set.py)."""
        async with self._lock:
            return await settled(self._apply(change, sender))

    async def _apply(self, change: ChangeSet, sender: int) -> Position:
        await self._apply_all([change], sender)  # one change: refused, it is raised
        return self.state.position()

    async def apply_all(
        self, changes: list[ChangeSet], sender: int = 0
    ) -> tuple[list[ChangeSet], Fenced | Diverged | None]:
        """``apply`` each of ``changes`` in order, all in one durable write (one fsync),
        up to the first refused: the changes written (not those held already) and the
        refusal, raised instead when it is the first change's (ReplicaState.apply_all)."""
        async with self._lock:
            return await settled(self._apply_all(changes, sender))

    async def _apply_all(
        self, changes: list[ChangeSet], sender: int
    ) -> tuple[list[ChangeSet], Fenced | Diverged | None]:
        if not changes:
            return [], None
        # The first change alone, as one by one: it steps a primary here down (after
        # which the node serves nothing, and the rest pass) or is refused.
        first = changes[0]
        await self._passive(max(first.epoch, sender), f"change {first.lsn} of epoch {first.epoch}")
        state = self.state
        if self.group is None:
            return await self.lane.run(lambda: state.apply_all_now(changes, sender))
        await self.group.job(lambda: state.prepare_roles(role for c in changes for role, _, _ in c.ops))
        written, refused = await self._grouped(lambda txn: state.apply_all(txn, changes, sender))
        for change in written:
            state.committed(change)
        return written, refused

    async def fence(self, epoch: int) -> Position:
        """Refuse, durably, every change set and promotion under an epoch below ``epoch``;
        the position of the last change held."""
        async with self._lock:
            return await settled(self._passive_fence(epoch))

    async def _passive_fence(self, epoch: int) -> Position:
        await self._passive(epoch + 1, f"a fence at epoch {epoch}")
        return await self._fence(epoch)

    async def _fence(self, epoch: int) -> Position:
        if epoch <= self.state.fenced_epoch():
            return self.state.position()
        if self.group is None:
            state = self.state
            return await self.lane.run(lambda: state.fence_now(epoch))
        await self._grouped(lambda txn: self.state.fence_in(txn, epoch))
        self.state.fenced(epoch)
        return self.state.position()

    async def serve(self, epoch: int, start: Callable[[], Awaitable[T]]) -> T:
        """Fence at ``epoch`` (durably), then ``start`` the primary on this copy, with
        no change set or fence taken in between (which the start would not see)."""
        async with self._lock:
            if self.serving_epoch:
                raise Fenced(f"queue {self.name!r} is served here already, under epoch {self.serving_epoch}")
            if epoch < self.state.fenced_epoch():
                raise Fenced(
                    f"queue {self.name!r}: epoch {epoch} is below the epoch {self.state.fenced_epoch()} this copy promised"
                )
            await settled(self._fence(epoch))
            self.serving_epoch = epoch
            try:
                return await start()
            except BaseException:
                self.serving_epoch = 0
                raise

    # -- snapshots (snapshot.py) -------------------------------------------------------------

    def snapshot_chunks(self, chunk_bytes: int = CHUNK_BYTES) -> AsyncIterator[bytes]:
        """The whole copy as of one read transaction, in chunks of about ``chunk_bytes``
        of entries: drain it at once (a parked reader makes the file grow)."""
        return self._snapshot(chunk_bytes)

    async def _snapshot(self, chunk_bytes: int) -> AsyncIterator[bytes]:
        reader = await self._read(partial(SnapshotReader, self.state, chunk_bytes))
        try:
            yield reader.header.encode()
            while (chunk := await self._read(reader.next_chunk)) is not None:
                yield chunk
            yield reader.end()
        finally:
            reader.close()

    async def install_snapshot(self, chunks: AsyncIterator[bytes], sender: int = 0) -> Position:
        """Replace this copy's contents with a snapshot (``snapshot_chunks`` of another
        copy) sent by the primary of epoch ``sender``: a new incarnation, at the
        snapshot's position, fenced at its epoch, ``rebuilt_epoch`` ``sender`` once
        whole. A crash or a bad stream half-way leaves a copy that refuses change sets
        until a snapshot is installed again."""
        async with self._lock:
            if self.serving_epoch:
                raise Fenced(f"queue {self.name!r} is served here under epoch {self.serving_epoch}: no snapshot over it")
            state = self.state
            stream = aiter(chunks)
            header = SnapshotHeader.decode(await anext(stream))
            if header.uid != state.uid:
                raise Diverged(f"a snapshot of queue uid {header.uid} offered to the copy of queue uid {state.uid}")

            async def begin() -> None:
                state.installing(await self._write(state.begin_install))

            stats = self.install_stats = InstallStats()
            # The entries as received, hashed as the sender hashed them: the end chunk's
            # digest checks the stream. The store holds exactly them: begin emptied every
            # database in the transaction that marked the install, and each chunk's
            # entries are stored in order (put_entries). Reading the installed copy back
            # for its digest instead took a quarter of the install (1.1 s of 200,000 items).
            received = Hasher()
            started = time.monotonic()
            await settled(begin())
            end: tuple[int, str] | None = None
            while True:
                at = time.monotonic()
                chunk = await anext(stream, None)
                stats.waited_s += time.monotonic() - at
                if chunk is None:
                    break
                if chunk[:1] == END:
                    end = decode_end(chunk)
                    break
                at = time.monotonic()
                ops = await self._job(partial(_take_chunk, state, chunk, received))
                await self._write(partial(state.put_entries, ops=ops))
                stats.written_s += time.monotonic() - at
                stats.chunks += 1
                stats.entries += len(ops)
            if end is None:
                raise Diverged(f"the snapshot of queue {self.name!r} ended before its end chunk")
            stats.seconds = time.monotonic() - started
            if (received.count, received.hexdigest()) != end:
                raise Diverged(
                    f"the snapshot of queue {self.name!r} arrived as {received.count} entries of digest "
                    f"{received.hexdigest()}, not the {end[0]} of digest {end[1]} it was sent as"
                )

            async def finish() -> None:
                await self._write(partial(state.finish_install, position=header.position, history=header.history, sender=sender))
                state.installed(header.position, header.history, sender)

            await settled(finish())
            return header.position

    async def _read(self, fn: Callable[[], T]) -> T:
        """Read with no growth of the map in the middle: on the lane, which grows a
        store of its own; on the loop, which grows a commit group's map."""
        if self.group is None:
            return await self.lane.run(fn)
        return fn()

    async def _job(self, fn: Callable[[], T]) -> T:
        if self.group is None:
            return await self.lane.run(fn)
        return await self.group.job(fn)

    async def _write(self, fn: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """``fn`` in a durable write transaction of its own."""
        store = self.state.store
        return await self._job(partial(store.write, fn))

    async def _passive(self, epoch: int, what: str) -> None:
        """Step down first if this node serves the queue under an epoch below ``epoch``;
        refuse ``what`` if it serves it under that epoch or a later one."""
        if not self.serving_epoch:
            return
        if epoch <= self.serving_epoch or self.step_down is None:
            raise Fenced(f"queue {self.name!r} is served here under epoch {self.serving_epoch}: {what} refused")
        await self.step_down(epoch)
        if self.serving_epoch:
            raise Fenced(f"queue {self.name!r} could not stop serving here under epoch {self.serving_epoch}")

    async def _grouped(self, body: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """``body`` in the commit group's next commit, once durable."""
        group = self.group
        assert group is not None
        for _ in range(MAX_GROWTHS):
            try:
                result, durable = await group.run(body, member=self)
            except MapFull:
                await group.grow()
                continue
            await durable
            return result
        raise StorageFull("storage is full: the LMDB map could not grow enough")

    async def close(self) -> None:
        """Close a copy with an environment of its own (a group closes its own)."""
        async with self._lock:
            if self.group is None:
                await self.lane.run(self.state.store.close)
