"""A queue's LMDB environment: opened (its own, or a commit group's shared one under
the queue's prefix), its partitions' databases, durable writes, the held write
transaction, the map grown when full, closing and destroying it; and each
partition's next sequence number.

The actor's cycles use a *held* write transaction (``hold`` / ``run_held`` /
``commit_held``): its storage thread begins it, the actor fills it on the event loop,
and the same thread commits it and at once begins the next. py-lmdb releases the GIL
around every put, get and delete; on a worker thread each of those calls would wait
for the event loop to hand the GIL back, a few microseconds each, hundreds per cycle.
On the loop thread nobody else wants the GIL, so they cost nothing, while the fsync
still happens off the loop. LMDB ties a write transaction's lock to the thread that
began it, so beginning and ending one must stay on that one thread. A grouped queue's
cycles run in nested transactions that its commit group holds and commits
(storage/commit_group.py); ``hold``, ``run_held`` and ``commit_held`` serve queues of
their own.

The directory is named by the queue's numeric uid, never by its name: nothing a
client sends reaches a file path.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import lmdb

from .environment import (
    FILE_MODE,
    MapFull,
    StorageError,
    StorageFull,
    aborted_on_failure,
    check_data_file,
    database_names,
    inject_write_fault,
    make_private_dir,
)
from .record import KEY_NEXT_SEQ, decode_u64, encode_u64

T = TypeVar("T")

DEFAULT_MAP_SIZE = 1 << 30
MAX_GROWTHS = 12
_MAX_DBS_HEADROOM = 8


class QueueEnv:
    """The LMDB environment holding one queue's partitions, and its transactions."""

    def __init__(
        self,
        path: str,
        partitions: int,
        *,
        max_partitions: int = 1024,
        map_size: int = DEFAULT_MAP_SIZE,
        sync: bool = True,
        shared: lmdb.Environment | None = None,
        prefix: bytes = b"",
    ) -> None:
        self.path = path
        # A queue in a commit group keeps its databases, named with ``prefix``, in the
        # group's environment (``shared``, at ``path``), which it neither holds nor closes.
        self.shared = shared is not None
        self.prefix = prefix
        self._dbs: list[Any] = []
        self._held: lmdb.Transaction[bytes] | None = None
        self.on_commit: Callable[[float], None] | None = None
        if shared is not None:
            self.env = shared
            self.ensure_partitions(partitions)
            return
        make_private_dir(path)
        try:
            self.env = lmdb.open(
                path,
                mode=FILE_MODE,
                map_size=map_size,
                max_dbs=max_partitions + _MAX_DBS_HEADROOM,
                sync=sync,
                metasync=sync,
                subdir=True,
                lock=True,
            )
            self.env.reader_check()
            check_data_file(self.env, path)
        except lmdb.Error as exc:
            raise StorageError(f"cannot open queue storage {os.path.join(path, 'data.mdb')!r}: {exc}") from exc
        self.ensure_partitions(partitions)

    # -- environment -------------------------------------------------------------

    def ensure_partitions(self, partitions: int) -> None:
        """Open (creating when needed) the databases of partitions 0..partitions-1."""
        while len(self._dbs) < partitions:
            name = self.prefix + f"p{len(self._dbs)}".encode()
            self._dbs.append(self.write(partial(self._open_db, name)))

    def _open_db(self, name: bytes, txn: lmdb.Transaction[bytes]) -> Any:
        return self.env.open_db(name, txn=txn, create=True)

    def db(self, p: int) -> Any:
        return self._dbs[p]

    def database_name(self, p: int) -> str:
        """The LMDB database of partition ``p`` in its environment (``p1``, ``q7.p1``)."""
        return (self.prefix + f"p{p}".encode()).decode()

    @property
    def partitions(self) -> int:
        return len(self._dbs)

    def read(self, fn: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """Run ``fn`` in a read-only transaction: no commit, no fsync."""
        try:
            with self.env.begin() as txn:
                return fn(txn)
        except lmdb.Error as exc:
            raise StorageError(f"storage read failed: {exc}") from exc

    def write(self, fn: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """Run ``fn`` in one durable write transaction and commit it.

        When the map is full the transaction is thrown away, the map doubled and ``fn``
        run again from the start, so ``fn`` must not change anything outside the
        transaction before it returns (in a shared environment ``MapFull`` is raised
        instead, for the commit group to grow the map and run the job again). Runs on the thread that holds the held
        transaction, if any, and gives it up first (LMDB has one writer at a time).
        """
        self.abort_held()
        for _ in range(MAX_GROWTHS):
            txn = self.env.begin(write=True)
            try:
                with aborted_on_failure(txn, self.path):
                    result = fn(txn)
                    self._commit(txn)
                return result
            except MapFull:
                if self.shared:
                    raise  # the group grows the map on the loop (storage/commit_group.py)
                self._grow()
        raise StorageFull("storage is full: the LMDB map could not grow enough")

    def _commit(self, txn: lmdb.Transaction[bytes]) -> None:
        """Commit ``txn`` durably (after any injected fault), timing it for the metrics."""
        inject_write_fault(self.path)
        started = time.perf_counter()
        txn.commit()
        if self.on_commit is not None:
            self.on_commit(time.perf_counter() - started)

    # -- the held write transaction ----------------------------------------------
    # hold, commit_held, abort_held and grow run on the storage thread that owns this
    # store; run_held on whichever thread the owner lets run it, one at a time.

    @property
    def held(self) -> bool:
        return self._held is not None

    def hold(self) -> None:
        """Begin the write transaction the next cycle will fill (if none is open)."""
        if self._held is None:
            try:
                self._held = self.env.begin(write=True)
            except lmdb.Error as exc:
                raise StorageError(f"storage write failed: {exc}") from exc

    def run_held(self, fn: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """Run ``fn`` in the held transaction without committing it.

        Raises ``MapFull`` when the map is full; any other exception leaves the
        transaction to be aborted by ``abort_held``.
        """
        if self._held is None:
            raise StorageError("no write transaction is held")
        try:
            return fn(self._held)
        except lmdb.MapFullError as exc:
            raise MapFull() from exc
        except lmdb.Error as exc:
            raise StorageError(f"storage write failed: {exc}") from exc

    def commit_held(self) -> None:
        """Commit the held transaction durably, then begin the next one.

        On ``MapFull`` or ``StorageError`` nothing was committed and nothing is held.
        """
        txn, self._held = self._held, None
        if txn is None:
            raise StorageError("no write transaction is held")
        with aborted_on_failure(txn, self.path):
            self._commit(txn)
        try:
            self.hold()
        except StorageError:
            pass  # the commit stands; the next cycle's hold() reports the failure

    def abort_held(self) -> None:
        """Throw the held transaction away (a failed cycle, a write, or closing)."""
        txn, self._held = self._held, None
        if txn is not None:
            txn.abort()

    def grow(self) -> None:
        """Double the map after ``MapFull``; the next cycle holds a new transaction."""
        self.abort_held()
        self._grow()

    def _grow(self) -> None:
        size = self.env.info()["map_size"]
        try:
            self.env.set_mapsize(size * 2)
        except lmdb.Error as exc:
            raise StorageFull(f"storage is full and cannot grow past {size} bytes: {exc}") from exc

    def map_usage(self) -> tuple[int, int]:
        info = self.env.info()
        used = (info["last_pgno"] + 1) * self.env.stat()["psize"]
        return used, int(info["map_size"])

    def close(self) -> None:
        self.abort_held()
        if not self.shared:
            self.env.close()

    def destroy(self) -> None:
        """Delete the queue's storage: its directory, or its databases in a shared
        environment (where the space goes back to that environment, not the disk)."""
        self.abort_held()
        if self.shared:
            self.write(self._drop_all)
            return
        self.env.close()
        shutil.rmtree(self.path, ignore_errors=True)

    def _drop_all(self, txn: lmdb.Transaction[bytes]) -> None:
        for name in database_names(self.env, txn, self.prefix):
            txn.drop(self.env.open_db(name, txn=txn, create=False), delete=True)

    # -- sequence numbers --------------------------------------------------------

    def read_next_seq(self, txn: lmdb.Transaction[bytes], p: int) -> int:
        raw = txn.get(KEY_NEXT_SEQ, db=self._dbs[p])
        return decode_u64(raw) if raw is not None else 1

    def write_next_seq(self, txn: lmdb.Transaction[bytes], p: int, next_seq: int) -> None:
        txn.put(KEY_NEXT_SEQ, encode_u64(next_seq), db=self._dbs[p])
