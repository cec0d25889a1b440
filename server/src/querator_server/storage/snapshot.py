"""A replicated queue's whole copy as a stream of chunks, for a copy too far behind
(or diverged, or new) to catch up from recent change sets.

Every chunk is read from one read transaction, so the stream is one consistent state
and carries its own position (written with the data, replica_state.py): the copy
that installs it then applies the change sets after that position. Chunks:

- ``H``: the queue's uid, the position and the epoch history;
- ``D``: up to ``CHUNK_BYTES`` of entries, as a change set of puts (change_set.py);
- ``E``: how many entries, and their digest, which the installed copy must match.

``CHUNK_BYTES`` is 1 MiB: a chunk is one message of the data path (gRPC's default
limit is 4 MiB) and bounds what either side holds in memory, while a chunk of a few
hundred records would pay a round trip per chunk.

While the read transaction is open, LMDB cannot reuse the pages the writer frees, so
the file grows by what the queue writes during the snapshot: the reader should be
drained at once, never parked. If the map has to grow meanwhile, LMDB (py-lmdb) ends
every open transaction of the environment, the snapshot's too: the next chunk then
fails with ``StorageError`` and the snapshot is taken again (the installing copy
refuses change sets until one completes). Chunks are read where the map grows (the
store's lane, or the loop for a commit group), never during a growth.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass

import lmdb

from .change_set import ChangeSet, Diverged, Position
from .queue_store import StorageError
from .replica_state import Hasher, ReplicaState

CHUNK_BYTES = 1 << 20
_HEAD = struct.Struct(">QQQI")
_PAIR = struct.Struct(">QQ")
_END = struct.Struct(">Q")
HEADER, DATA, END = b"H", b"D", b"E"


@dataclass(frozen=True, slots=True)
class SnapshotHeader:
    uid: int
    position: Position
    history: list[tuple[int, int]]

    def encode(self) -> bytes:
        pairs = b"".join(_PAIR.pack(epoch, start) for epoch, start in self.history)
        return HEADER + _HEAD.pack(self.uid, self.position.epoch, self.position.lsn, len(self.history)) + pairs

    @classmethod
    def decode(cls, chunk: bytes) -> SnapshotHeader:
        if chunk[:1] != HEADER:
            raise ValueError("a snapshot starts with its header")
        try:
            uid, epoch, lsn, count = _HEAD.unpack_from(chunk, 1)
            at = 1 + _HEAD.size
            history = [_PAIR.unpack_from(chunk, at + i * _PAIR.size) for i in range(count)]
            if at + count * _PAIR.size != len(chunk):
                raise ValueError("bytes past the history")
        except struct.error as exc:
            raise ValueError(f"not a snapshot header: {exc}") from exc
        return cls(uid, Position(epoch, lsn), [(int(e), int(s)) for e, s in history])


def decode_end(chunk: bytes) -> tuple[int, str]:
    """(entries, digest) of an end chunk."""
    if chunk[:1] != END or len(chunk) != 1 + _END.size + 32:
        raise ValueError("not a snapshot's end chunk")
    return _END.unpack_from(chunk, 1)[0], chunk[1 + _END.size :].decode()


class SnapshotReader:
    """One read transaction of a copy, read out chunk by chunk (one thread at a time)."""

    def __init__(self, state: ReplicaState, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._state = state
        self._chunk_bytes = chunk_bytes
        self._roles = sorted(state.roles_by_name().items())
        self._txn: lmdb.Transaction[bytes] | None = state.store.env.begin()
        self.header = SnapshotHeader(state.uid, state.stored_position(self._txn), state.stored_history(self._txn))
        self._hasher = Hasher()
        # Where the next chunk starts: the index of the role, and the last key sent there.
        self._at = 0
        self._after: bytes | None = None

    def next_chunk(self) -> bytes | None:
        """The next ``D`` chunk, or None when every entry has been sent."""
        if self._at >= len(self._roles):
            return None
        txn = self._txn
        if txn is None:
            raise StorageError(f"the snapshot of queue uid {self.header.uid} was closed before its end")
        try:
            return self._chunk(txn)
        except lmdb.Error as exc:
            self.close()
            raise StorageError(
                f"the snapshot of queue uid {self.header.uid} was cut ({exc}): the storage's map grew "
                "meanwhile, which ends every open transaction; take it again"
            ) from exc

    def _chunk(self, txn: lmdb.Transaction[bytes]) -> bytes | None:
        # Runs of one database's entries, read by the cursor's iterator (in C) and
        # hashed and encoded a run at a time: a snapshot reads every entry of a queue.
        runs: list[tuple[str, list[tuple[bytes, bytes]]]] = []
        size = 0
        limit = self._chunk_bytes
        while self._at < len(self._roles) and size < limit:
            role, db = self._roles[self._at]
            cursor = txn.cursor(db=db)
            found = cursor.set_range(self._after) if self._after is not None else cursor.first()
            if found and self._after is not None and cursor.key() == self._after:
                found = cursor.next()
            run: list[tuple[bytes, bytes]] = []
            if found:
                append = run.append
                for key, value in cursor.iternext():
                    append((key, value))
                    size += len(key) + len(value) + 8
                    if size >= limit:
                        break
                else:
                    found = False
            if run:
                runs.append((role, run))
                self._hasher.add_run(role, run)
                self._after = run[-1][0]
            if not found:
                self._at += 1
                self._after = None
        if not runs:
            return None
        position = self.header.position
        return DATA + ChangeSet.encode_runs(self.header.uid, position.epoch, position.lsn, runs)

    def end(self) -> bytes:
        return END + _END.pack(self._hasher.count) + self._hasher.hexdigest().encode()

    def close(self) -> None:
        txn, self._txn = self._txn, None
        if txn is not None:
            with contextlib.suppress(lmdb.Error):  # ended already by a growth of the map
                txn.abort()


def data_ops(chunk: bytes, uid: int) -> list[tuple[str, bytes, bytes | None]]:
    """The entries of a ``D`` chunk of the snapshot of queue ``uid``."""
    if chunk[:1] != DATA:
        raise ValueError("expected a snapshot data chunk")
    change = ChangeSet.decode(chunk[1:])
    if change.uid != uid:
        raise Diverged(f"a snapshot chunk of queue uid {change.uid} in the snapshot of {uid}")
    return change.ops
