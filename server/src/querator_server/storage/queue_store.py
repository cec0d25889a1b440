"""A queue's storage: one named database per partition, in an LMDB environment of the
queue's own, or under the queue's prefix in a commit group's shared one (groups.py).

A queue's actor is the only writer of its own environment, so LMDB's single-writer
lock is never contended and such a queue commits (and fsyncs) independently of the
others. A grouped queue's cycles run in nested transactions that its commit group
holds and commits (storage/commit_group.py); ``hold``, ``run_held`` and ``commit_held``
below serve queues of their own.

The actor's cycles use a *held* write transaction (``hold`` / ``run_held`` /
``commit_held``): its storage thread begins it, the actor fills it on the event loop,
and the same thread commits it and at once begins the next. py-lmdb releases the GIL
around every put, get and delete; on a worker thread each of those calls would wait
for the event loop to hand the GIL back, a few microseconds each, hundreds per cycle.
On the loop thread nobody else wants the GIL, so they cost nothing, while the fsync
still happens off the loop. LMDB ties a write transaction's lock to the thread that
began it, so beginning and ending one must stay on that one thread.

The directory is named by the queue's numeric uid, never by its name: nothing a
client sends reaches a file path.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import lmdb

from . import lease_records, ordered_groups
from .environment import (
    DIR_MODE,
    FILE_MODE,
    MapFull,
    StorageError,
    StorageFull,
    aborted_on_failure,
    check_data_file,
    database_names,
    disk_full,
    free_bytes,
    inject_write_fault,
    low_on_space,
    make_private_dir,
    write_failure,
)
from .expiry_runs import drop_empty_runs
from .lease_records import LeaseRecord
from .record import (
    _FLAG_EXPIRY_RUN,
    _FLAG_HISTORY,
    _FLAG_LEASED,
    _HEADER,
    _LENGTHS,
    _NO_STRINGS,
    _STATE_FIXED,
    KEY_NEXT_SEQ,
    TAG_EXPIRY,
    TAG_GROUP_HEAD,
    TAG_ITEM,
    TAG_OUTBOX,
    TAG_PRIORITY,
    TAG_REDRIVE,
    TAG_SCHEDULED,
    TAG_WAITING,
    Item,
    ItemState,
    PlainLeaser,
    decode_u64,
    encode_u64,
    expiry_key,
    group_of,
    grouped,
    item_key,
    outbox_key,
    parse_expiry_key,
    parse_priority_key,
    parse_scheduled_key,
    plain_header,
    priority_key,
    priority_of,
    read_state,
    redrive_key,
    scheduled_key,
    seq_of_item_key,
    source_key,
)

T = TypeVar("T")

# The environment's failures and checks (environment.py) stay importable from here.
__all__ = [
    "DEFAULT_MAP_SIZE",
    "DIR_MODE",
    "FILE_MODE",
    "MAX_GROWTHS",
    "LeasedRun",
    "MapFull",
    "PartitionScan",
    "QueueStore",
    "StorageError",
    "StorageFull",
    "aborted_on_failure",
    "check_data_file",
    "database_names",
    "disk_full",
    "free_bytes",
    "inject_write_fault",
    "low_on_space",
    "make_private_dir",
    "write_failure",
]


def _by_seq(entry: tuple[int, ItemState]) -> int:
    return entry[0]


@dataclass(slots=True)
class LeasedRun:
    """What ``lease_run`` leased, oldest first, as parallel lists."""

    seqs: list[int] = field(default_factory=list)
    # For a lease by record (``write=False``): each item's expire deadline.
    expires: list[int] = field(default_factory=list)
    # Each item's record as it was before the lease (put back if the lease is fenced).
    records: list[bytes] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    created_at: list[int] = field(default_factory=list)
    # The last ready seq looked at, 0 for none.
    last_seq: int = 0
    # The ready item the run stopped at, which the leaser declined: (seq, record).
    other: tuple[int, bytes] | None = None
    # What the leased records add up to (with the overhead per item), and whether the
    # run stopped at an item that would have taken it past ``max_bytes``.
    size: int = 0
    full: bool = False


# The largest seq or time a key can hold (8 bytes, unsigned).
_LAST_KEY = (1 << 64) - 1

DEFAULT_MAP_SIZE = 1 << 30
MAX_GROWTHS = 12
_MAX_DBS_HEADROOM = 8


@dataclass(slots=True)
class PartitionScan:
    """What a full read of a partition finds: the basis of the actor's counters."""

    ready: int = 0
    leased: int = 0
    scheduled: int = 0
    created_sum: int = 0
    leased_at_sum: int = 0
    next_seq: int = 1
    first_ready_seq: int = 0
    leases: list[tuple[int, int]] = field(default_factory=list)  # (deadline, seq)
    first_due: int = 0
    first_expiry: int = 0
    # Ordered groups: items waiting behind their group's head (their created_at are in
    # created_sum), and groups whose head is leased.
    waiting: int = 0
    groups_in_flight: int = 0
    # Entries of the priority index (ready items of priority 1 to 9).
    ranked: int = 0
    # The open lease records (lease_records.py).
    lease_records: list[LeaseRecord] = field(default_factory=list)


class QueueStore:
    """The LMDB environment holding one queue's partitions."""

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

    def ready_heads(self, starts: Iterable[tuple[int, int, Container[int]]]) -> dict[int, int | None]:
        """For each (partition, seq, seqs held by lease records): created_at (us) of its
        first ready item at or after that seq (0: none), or None when more than
        ``HEAD_SCAN_LIMIT`` leased items come first. One read transaction; for the
        metrics' oldest-ready age."""
        out: dict[int, int | None] = {}
        with self.env.begin() as txn:
            for p, from_seq, held in starts:
                out[p] = _ready_head(txn.cursor(db=self.db(p)), from_seq, held)
        return out

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

    # -- ready and leased items --------------------------------------------------

    def append(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item) -> None:
        """Store a ready or leased item at ``seq`` (the tail of the partition), with an
        expiry entry of its own."""
        db = self._dbs[p]
        key = item_key(seq)
        item.expiry_run = False
        txn.put(key, item.encode(), db=db)
        txn.put(expiry_key(item.expire_deadline, key), b"", db=db)
        if item.source_id:
            txn.put(source_key(item.source_id), key, db=db)
        if item.priority and not item.is_leased:
            txn.put(priority_key(item.priority, seq), b"", db=db)

    def append_new(self, txn: lmdb.Transaction[bytes], p: int, first_seq: int, items: list[Item], expire_deadline: int) -> None:
        """Store freshly produced items at first_seq, first_seq + 1, ... (no source ids),
        all expiring at ``expire_deadline``, indexed by one expiry run."""
        if not items:
            return
        db = self._dbs[p]
        put = txn.put
        self._put_run(txn, db, expire_deadline, first_seq, first_seq + len(items) - 1)
        for seq, item in enumerate(items, first_seq):
            item.expiry_run = True
            put(item_key(seq), item.encode(), db=db)
            if item.priority:
                put(priority_key(item.priority, seq), b"", db=db)

    def append_payloads(
        self, txn: lmdb.Transaction[bytes], p: int, first_seq: int, payloads: list[bytes], created_at: int, expire_deadline: int
    ) -> None:
        """``append_new`` for items that carry only a payload: one shared header, and
        every record written by one ``putmulti``."""
        if not payloads:
            return
        db = self._dbs[p]
        head = plain_header(created_at, expire_deadline, expiry_run=True)
        self._put_run(txn, db, expire_deadline, first_seq, first_seq + len(payloads) - 1)
        txn.cursor(db=db).putmulti([(item_key(seq), head + payload) for seq, payload in enumerate(payloads, first_seq)])

    @staticmethod
    def _put_run(txn: lmdb.Transaction[bytes], db: Any, expire_deadline: int, first: int, last: int) -> None:
        # Written before the records: the other way round, a fill of 1,000,000 items
        # left 223 MB of the file mapped in the process against 140 MB.
        txn.put(expiry_key(expire_deadline, item_key(first)), encode_u64(last), db=db)

    def get(self, txn: lmdb.Transaction[bytes], p: int, seq: int) -> Item | None:
        raw = txn.get(item_key(seq), db=self._dbs[p])
        return None if raw is None else Item.decode(raw)

    def put(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item) -> None:
        """Overwrite an item in place (same key, same expiry)."""
        txn.put(item_key(seq), item.encode(), db=self._dbs[p])

    def put_raw(self, txn: lmdb.Transaction[bytes], p: int, seq: int, raw: bytes) -> None:
        txn.put(item_key(seq), raw, db=self._dbs[p])

    def put_ready(self, txn: lmdb.Transaction[bytes], p: int, seq: int, raw: bytes) -> bool:
        """Store ``raw``, a record that is ready again (a lease undone), at ``seq`` and
        index its priority. True when it has one (one more entry in the index)."""
        db = self._dbs[p]
        txn.put(item_key(seq), raw, db=db)
        priority = priority_of(raw)
        if priority:
            txn.put(priority_key(priority, seq), b"", db=db)
        return bool(priority)

    def unrank(self, txn: lmdb.Transaction[bytes], p: int, seq: int, raw: bytes) -> None:
        """Take the item at ``seq`` (``raw``: its ready record) out of the priority index,
        as it is leased by another path than ``lease_ranked``."""
        priority = priority_of(raw)
        if priority:
            txn.delete(priority_key(priority, seq), db=self._dbs[p])

    def delete(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item | ItemState) -> None:
        self._forget(txn, p, item_key(seq), item)

    def delete_leased(self, txn: lmdb.Transaction[bytes], p: int, found: Iterable[tuple[int, ItemState]]) -> None:
        """``delete`` for many items of partition ``p`` (a completed batch) in one loop.

        Two cursors walk the items and their expiry keys in key order: a batch is
        mostly a run of neighbours (leased together, produced together), and a
        cursor's delete leaves it on the next key, so most deletes need no search.
        """
        db = self._dbs[p]
        items, expiries = txn.cursor(db=db), txn.cursor(db=db)
        runs: list[tuple[int, int]] = []
        for seq, state in sorted(found, key=_by_seq):
            key = item_key(seq)
            if items.key() == key or items.set_key(key):
                items.delete()
            if state.expiry_run:
                runs.append((state.expire_deadline, seq))
            else:
                expiry = expiry_key(state.expire_deadline, key)
                if expiries.key() == expiry or expiries.set_key(expiry):
                    expiries.delete()
            if state.source_id:
                self._forget_source(txn, db, key, state.source_id)
        if runs:
            self._drop_empty_runs(txn, db, runs)

    def complete_run(self, txn: lmdb.Transaction[bytes], p: int, first: int, last: int) -> tuple[int, int] | None:
        """Delete items ``first``..``last`` of partition ``p`` if every one of them is
        stored, leased, and tagged by no lease key and no source id: the batch a plain
        lease handed out, completed. Returns the sums of their created_at and leased_at.

        None, having changed nothing, when any of them is not so; the caller then takes
        the item-by-item path, which names each id that fails. One cursor pass checks
        the run and one deletes it, with no search per item.
        """
        db = self._dbs[p]
        cursor = txn.cursor(db=db)
        if not cursor.set_key(item_key(first)):
            return None
        count = last - first + 1
        unpack = _STATE_FIXED.unpack_from
        created = leased_at = 0
        runs: list[tuple[int, int]] = []
        singles: list[bytes] = []
        seq = first
        for raw in cursor.iternext(keys=False, values=True):
            if raw[_LENGTHS] != _NO_STRINGS or not raw[0] & _FLAG_LEASED:
                return None  # (a key past the items, e.g. ``n``, has a shorter value)
            if raw[0] & _FLAG_HISTORY and grouped(raw):
                return None  # its completion releases its group: the item-by-item path
            flags, _attempts, created_at, expire, _deadline, _enqueue_at, at = unpack(raw)
            created += created_at
            leased_at += at
            if flags & _FLAG_EXPIRY_RUN:
                runs.append((expire, seq))
            else:
                singles.append(expiry_key(expire, item_key(seq)))
            if seq == last:
                break
            seq += 1
        # count keys in order from first, the last of them last: exactly the run.
        if seq != last or cursor.key() != item_key(last):
            return None
        cursor.set_key(item_key(first))
        delete = cursor.delete
        for _ in range(count):
            delete()
        for key in singles:
            txn.delete(key, db=db)
        self._drop_empty_runs(txn, db, runs)
        return created, leased_at

    def leased_under(
        self, txn: lmdb.Transaction[bytes], p: int, seqs: Iterable[int], lease_key: str
    ) -> list[tuple[int, ItemState]]:
        """The items among ``seqs`` of partition ``p`` still leased under ``lease_key``."""
        cursor = txn.cursor(db=self._dbs[p])
        found: list[tuple[int, ItemState]] = []
        for seq in sorted(seqs):
            key = item_key(seq)
            if cursor.key() != key and not cursor.set_key(key):
                continue
            state = read_state(cursor.value())
            if state.is_leased and state.lease_key == lease_key:
                found.append((seq, state))
            cursor.next()
        return found

    def reader(self, txn: lmdb.Transaction[bytes], p: int) -> Callable[[int], bytes | None]:
        """``get_raw`` for many lookups in partition ``p``: one cursor, which finds a
        neighbour of its last key without a search from the root."""
        cursor = txn.cursor(db=self._dbs[p])
        set_key, value = cursor.set_key, cursor.value

        def read(seq: int) -> bytes | None:
            raw: bytes | None = value() if set_key(item_key(seq)) else None
            return raw

        return read

    def get_raw(self, txn: lmdb.Transaction[bytes], p: int, seq: int) -> bytes | None:
        raw: bytes | None = txn.get(item_key(seq), db=self._dbs[p])
        return raw

    def _forget(self, txn: lmdb.Transaction[bytes], p: int, key: bytes, item: Item | ItemState) -> None:
        db = self._dbs[p]
        txn.delete(key, db=db)
        if item.expiry_run:
            self._drop_empty_runs(txn, db, [(item.expire_deadline, seq_of_item_key(key))])
        else:
            txn.delete(expiry_key(item.expire_deadline, key), db=db)
        if item.source_id:
            self._forget_source(txn, db, key, item.source_id)
        if isinstance(item, Item) and item.priority and not item.is_leased and key[:1] == TAG_ITEM:
            txn.delete(priority_key(item.priority, seq_of_item_key(key)), db=db)

    _drop_empty_runs = staticmethod(drop_empty_runs)

    @staticmethod
    def _forget_source(txn: lmdb.Transaction[bytes], db: Any, key: bytes, source_id: str) -> None:
        if txn.get(source_key(source_id), db=db) == key:
            txn.delete(source_key(source_id), db=db)

    def has_source(self, txn: lmdb.Transaction[bytes], source_id: str, skip: Container[int] = ()) -> bool:
        """Whether any partition (but those in ``skip``) holds an item that came from
        ``source_id``."""
        key = source_key(source_id)
        if skip:
            return any(txn.get(key, db=db) is not None for p, db in enumerate(self._dbs) if p not in skip)
        return any(txn.get(key, db=db) is not None for db in self._dbs)

    def lease_run(
        self,
        txn: lmdb.Transaction[bytes],
        p: int,
        from_seq: int,
        quota: int,
        lease: Callable[[bytes], tuple[Any, bytes, int, int] | None],
        max_bytes: int,
        item_overhead: int,
        *,
        take_first: bool,
        skip: Container[int] = (),
        write: bool = True,
    ) -> LeasedRun:
        """Lease up to ``quota`` ready items of partition ``p`` from ``from_seq`` on, in
        FIFO order, as ``lease`` rewrites them, until one it declines (``other``) or
        one that would take the records leased past ``max_bytes`` (each record counted
        with ``item_overhead`` more; with ``take_first`` the first item is taken
        whatever its size).

        Each record is rewritten through the cursor that found it, which needs no
        search of the tree, and leased items on the way are skipped by their flag, or,
        when held by a lease record (lease_records.py), by being in ``skip``. With
        ``write`` False the records stay as they are (the caller writes a lease record)
        and ``expires`` gets what ``lease`` answers first: each item's expire deadline.
        """
        run = LeasedRun()
        cursor = txn.cursor(db=self._dbs[p])
        if not cursor.set_range(item_key(from_seq)):
            return run
        seqs, records, payloads, attempts, created_at = run.seqs, run.records, run.payloads, run.attempts, run.created_at
        put, seq_of, expires = cursor.put, seq_of_item_key, run.expires
        seq = 0
        # ``quota`` records of at most ``small`` bytes stay within ``max_bytes``: the sum
        # is kept item by item only from the first longer one on (most runs never see one).
        small = max_bytes // max(quota, 1) - item_overhead
        counting = False
        size = 0
        for key, raw in cursor:
            if key[:1] != TAG_ITEM:
                break
            if raw[0] & _FLAG_LEASED or (skip and seq_of(key) in skip):
                continue
            if counting or len(raw) > small:
                if not counting:
                    counting = True
                    size = sum(map(len, records)) + len(records) * item_overhead
                cost = len(raw) + item_overhead
                if size + cost > max_bytes and (seqs or not take_first):
                    run.full = True
                    break
                size += cost  # an item declined below ends the run: its size is not used
            seq = seq_of(key)
            leased = lease(raw)
            if leased is None:
                run.other = (seq, raw)
                break
            if write:
                put(key, leased[0])
            else:
                expires.append(leased[0])
            seqs.append(seq)
            records.append(raw)
            payloads.append(leased[1])
            attempts.append(leased[2])
            created_at.append(leased[3])
            if len(seqs) >= quota:
                break
        run.last_seq = seq
        run.size = sum(map(len, records)) + len(records) * item_overhead
        return run

    # -- ordered groups (ordered_groups.py) -------------------------------------------

    def group_partitions(self, txn: lmdb.Transaction[bytes]) -> int:
        """The partition count that places group keys (0: none kept yet)."""
        return ordered_groups.recorded_partitions(txn, self._dbs[0])

    def record_group_partitions(self, txn: lmdb.Transaction[bytes], count: int) -> None:
        ordered_groups.record_partitions(txn, self._dbs[0], count)

    def has_group_head(self, txn: lmdb.Transaction[bytes], p: int, key: str) -> bool:
        return ordered_groups.has_head(txn, self._dbs[p], key)

    def set_group_head(self, txn: lmdb.Transaction[bytes], p: int, key: str) -> None:
        ordered_groups.set_head(txn, self._dbs[p], key)

    def put_waiting(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item) -> None:
        ordered_groups.put_waiting(txn, self._dbs[p], seq, item)

    def release_group(self, txn: lmdb.Transaction[bytes], p: int, key: str) -> tuple[int, bytes] | None:
        """``ordered_groups.release``; a next item of priority 1 to 9, ready now, also
        enters the priority index."""
        promoted = ordered_groups.release(txn, self._dbs[p], key)
        if promoted is not None and priority_of(promoted[1]):
            seq, raw = promoted
            txn.put(priority_key(priority_of(raw), seq), b"", db=self._dbs[p])
        return promoted

    def oldest_waiting(self, partitions: Iterable[int], limit: int) -> dict[int, int]:
        """created_at of the longest-waiting grouped item of each partition (0: none);
        one read transaction, for stats."""
        with self.env.begin() as txn:
            return {p: ordered_groups.oldest_waiting(txn, self._dbs[p], limit) for p in partitions}
    def lease_ranked(
        self,
        txn: lmdb.Transaction[bytes],
        p: int,
        quota: int,
        lease: PlainLeaser,
        max_bytes: int,
        item_overhead: int,
        *,
        take_first: bool,
    ) -> LeasedRun:
        """``lease_run`` over the priority index of partition ``p``: ready items of
        priority 1 to 9, highest first, FIFO within a priority. Each item leased leaves
        the index; ``other`` (declined) stays in it, for the caller to lease or drop.
        ``last_seq`` is 0 when the index ran out (nothing of priority above 0 is
        ready), else the seq the run stopped at.

        An entry whose item is gone, leased or of another priority is dropped.
        """
        run = LeasedRun(last_seq=-1)
        db = self._dbs[p]
        index, items = txn.cursor(db=db), txn.cursor(db=db)
        seqs, records, payloads, attempts, created_at = run.seqs, run.records, run.payloads, run.attempts, run.created_at
        size = 0
        found = index.set_range(TAG_PRIORITY)
        while found:
            key = index.key()
            if key[:1] != TAG_PRIORITY:
                break
            priority, seq = parse_priority_key(key)
            raw = items.value() if items.set_key(item_key(seq)) else None
            if raw is None or raw[0] & _FLAG_LEASED or priority_of(raw) != priority:
                found = index.delete()
                continue
            cost = len(raw) + item_overhead
            if size + cost > max_bytes and (seqs or not take_first):
                run.full = True
                run.last_seq = seq
                break
            leased = lease(raw)
            if leased is None:
                run.other = (seq, raw)
                run.last_seq = seq
                break
            size += cost
            items.put(item_key(seq), leased[0])
            seqs.append(seq)
            records.append(raw)
            payloads.append(leased[1])
            attempts.append(leased[2])
            created_at.append(leased[3])
            found = index.delete()
            if len(seqs) >= quota:
                run.last_seq = seq
                break
        if run.last_seq < 0:
            run.last_seq = 0  # the index ran out
        run.size = size
        return run

    def page_items(self, txn: lmdb.Transaction[bytes], p: int, after_seq: int, limit: int) -> list[tuple[int, Item]]:
        cursor = txn.cursor(db=self._dbs[p])
        out: list[tuple[int, Item]] = []
        if not 0 <= after_seq < _LAST_KEY or not cursor.set_range(item_key(after_seq + 1)):
            return out
        for key, raw in cursor:
            if key[:1] != TAG_ITEM or len(out) >= limit:
                break
            out.append((seq_of_item_key(key), Item.decode(raw)))
        return out

    # -- scheduled items ---------------------------------------------------------

    def put_scheduled(self, txn: lmdb.Transaction[bytes], p: int, due: int, seq: int, item: Item) -> None:
        db = self._dbs[p]
        key = scheduled_key(due, seq)
        item.expiry_run = False
        txn.put(key, item.encode(), db=db)
        txn.put(expiry_key(item.expire_deadline, key), b"", db=db)
        if item.source_id:
            txn.put(source_key(item.source_id), key, db=db)

    def get_scheduled(self, txn: lmdb.Transaction[bytes], p: int, due: int, seq: int) -> Item | None:
        raw = txn.get(scheduled_key(due, seq), db=self._dbs[p])
        return None if raw is None else Item.decode(raw)

    def delete_scheduled(self, txn: lmdb.Transaction[bytes], p: int, due: int, seq: int, item: Item) -> None:
        self._forget(txn, p, scheduled_key(due, seq), item)

    # -- the dead-letter outbox --------------------------------------------------

    def put_outbox(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item) -> None:
        item.expiry_run = False
        txn.put(outbox_key(seq), item.encode(), db=self._dbs[p])

    def delete_outbox(self, txn: lmdb.Transaction[bytes], p: int, seq: int) -> None:
        txn.delete(outbox_key(seq), db=self._dbs[p])

    def outbox(self, txn: lmdb.Transaction[bytes], p: int) -> list[tuple[int, Item]]:
        cursor = txn.cursor(db=self._dbs[p])
        out: list[tuple[int, Item]] = []
        if not cursor.set_range(TAG_OUTBOX):
            return out
        for key, raw in cursor:
            if key[:1] != TAG_OUTBOX:
                break
            out.append((seq_of_item_key(TAG_ITEM + key[1:]), Item.decode(raw)))
        return out

    # -- the redrive outbox ------------------------------------------------------

    def put_redrive(self, txn: lmdb.Transaction[bytes], p: int, seq: int, target_uid: int, item: Item) -> None:
        item.expiry_run = False
        txn.put(redrive_key(seq), encode_u64(target_uid) + item.encode(), db=self._dbs[p])

    def delete_redrive(self, txn: lmdb.Transaction[bytes], p: int, seq: int) -> None:
        txn.delete(redrive_key(seq), db=self._dbs[p])

    def get_redrive(self, txn: lmdb.Transaction[bytes], p: int, seq: int) -> tuple[int, Item] | None:
        raw = txn.get(redrive_key(seq), db=self._dbs[p])
        return None if raw is None else (decode_u64(raw[:8]), Item.decode(raw[8:]))

    def redrive_outbox(self, txn: lmdb.Transaction[bytes], p: int) -> list[tuple[int, int, Item]]:
        """(seq, target queue uid, item) of every item on its way out of partition ``p``."""
        cursor = txn.cursor(db=self._dbs[p])
        out: list[tuple[int, int, Item]] = []
        if not cursor.set_range(TAG_REDRIVE):
            return out
        for key, raw in cursor:
            if key[:1] != TAG_REDRIVE:
                break
            out.append((seq_of_item_key(TAG_ITEM + key[1:]), decode_u64(raw[:8]), Item.decode(raw[8:])))
        return out

    def page_scheduled(
        self, txn: lmdb.Transaction[bytes], p: int, after: tuple[int, int], limit: int
    ) -> list[tuple[int, int, Item]]:
        cursor = txn.cursor(db=self._dbs[p])
        out: list[tuple[int, int, Item]] = []
        due, seq = after
        if not (0 <= due <= _LAST_KEY and -1 <= seq < _LAST_KEY) or not cursor.set_range(scheduled_key(due, seq + 1)):
            return out
        for key, raw in cursor:
            if key[:1] != TAG_SCHEDULED or len(out) >= limit:
                break
            d, s = parse_scheduled_key(key)
            out.append((d, s, Item.decode(raw)))
        return out

    def first_due(self, txn: lmdb.Transaction[bytes], p: int) -> int:
        cursor = txn.cursor(db=self._dbs[p])
        if cursor.set_range(TAG_SCHEDULED) and cursor.key()[:1] == TAG_SCHEDULED:
            return parse_scheduled_key(cursor.key())[0]
        return 0

    # -- expiry index ------------------------------------------------------------

    def expired(
        self, txn: lmdb.Transaction[bytes], p: int, now: int, limit: int, held: Container[int] = ()
    ) -> tuple[list[tuple[bytes, Item]], int]:
        """Up to ``limit`` expired items that are not leased, and the next deadline to check.

        Leased items are skipped: they are dead-lettered when their lease ends (those
        of lease records, ``held``, as well as those flagged leased). The
        next deadline is 0 when nothing else is indexed, or ``now`` when more expired
        items remain than ``limit``.
        """
        db = self._dbs[p]
        cursor, items = txn.cursor(db=db), txn.cursor(db=db)
        out: list[tuple[bytes, Item]] = []
        empty_runs: list[bytes] = []
        try:
            if not cursor.set_range(TAG_EXPIRY):
                return out, 0
            for key, value in cursor:
                if key[:1] != TAG_EXPIRY:
                    break
                deadline, target = parse_expiry_key(key)
                if deadline > now:
                    return out, deadline
                if len(out) >= limit:
                    return out, now
                if value:
                    if self._expired_in_run(items, target, decode_u64(value), now, out, limit, held):
                        empty_runs.append(key)
                    elif len(out) >= limit:
                        return out, now  # the rest of this run, next time
                    continue
                raw = txn.get(target, db=db)
                if raw is None or (target[:1] == TAG_ITEM and (raw[0] & 1 or seq_of_item_key(target) in held)):
                    continue
                out.append((target, Item.decode(raw)))
            return out, 0
        finally:
            for key in empty_runs:
                txn.delete(key, db=db)

    @staticmethod
    def _expired_in_run(
        items: Any, first_key: bytes, last: int, now: int, out: list[tuple[bytes, Item]], limit: int, held: Container[int]
    ) -> bool:
        """Add the run's expired ready items to ``out`` (up to ``limit`` in all); True
        when the run holds no item at all any more (its entry can go)."""
        last_key = item_key(last)
        if not (items.set_range(first_key) and items.key() <= last_key):
            return True
        for key, raw in items:
            if key > last_key or len(out) >= limit:
                break
            if raw[0] & 1 or (held and seq_of_item_key(key) in held):
                continue  # leased: dead-lettered when its lease ends
            item = Item.decode(raw)
            if item.expire_deadline <= now:
                out.append((key, item))
        return False

    def first_expiry(self, txn: lmdb.Transaction[bytes], p: int) -> int:
        cursor = txn.cursor(db=self._dbs[p])
        if cursor.set_range(TAG_EXPIRY) and cursor.key()[:1] == TAG_EXPIRY:
            return parse_expiry_key(cursor.key())[0]
        return 0

    # -- whole-partition operations ------------------------------------------------

    def clear(self, txn: lmdb.Transaction[bytes], p: int, *, ready: bool, leased: bool, scheduled: bool) -> list[int]:
        """Delete the chosen kinds of items; return the seqs of deleted leased items.
        Lease records are written out first, so their items are leased ones here."""
        db = self._dbs[p]
        for record in lease_records.read_all(txn, db):
            lease_records.write_out(txn, db, record)
        removed_leases: list[int] = []
        cursor = txn.cursor(db=db)
        doomed: list[bytes] = []
        runs: list[tuple[int, int]] = []
        if ready or leased:
            if cursor.set_range(TAG_ITEM):
                for key, raw in cursor:
                    if key[:1] != TAG_ITEM:
                        break
                    is_leased = bool(raw[0] & 1)
                    if (is_leased and leased) or (not is_leased and ready):
                        doomed.append(key)
                        doomed.extend(self._index_keys(key, raw, db, txn, runs))
                        if is_leased:
                            removed_leases.append(seq_of_item_key(key))
        if scheduled and cursor.set_range(TAG_SCHEDULED):
            for key, raw in cursor:
                if key[:1] != TAG_SCHEDULED:
                    break
                doomed.append(key)
                doomed.extend(self._index_keys(key, raw, db, txn, runs))
        for key in doomed:
            txn.delete(key, db=db)
        self._drop_empty_runs(txn, db, runs)
        if (ready or scheduled) and cursor.set_range(TAG_WAITING) and cursor.key()[:1] in (TAG_WAITING, TAG_GROUP_HEAD):
            ordered_groups.clear(txn, db, self._group_heads(txn, p), waiting=ready)
        return removed_leases

    def _group_heads(self, txn: lmdb.Transaction[bytes], p: int) -> set[str]:
        """The groups whose head is stored in partition ``p`` (ready, leased or scheduled)."""
        cursor = txn.cursor(db=self._dbs[p])
        heads: set[str] = set()
        for tag in (TAG_ITEM, TAG_SCHEDULED):
            if cursor.set_range(tag):
                for key, raw in cursor:
                    if key[:1] != tag:
                        break
                    key_of_group = group_of(raw)
                    if key_of_group:
                        heads.add(key_of_group)
        return heads

    def _index_keys(
        self, key: bytes, raw: bytes, db: Any, txn: lmdb.Transaction[bytes], runs: list[tuple[int, int]]
    ) -> list[bytes]:
        """The index entries of the item at ``key`` to delete with it; its expiry run,
        if it has one, goes to ``runs`` to be checked once the items are gone."""
        item = Item.decode(raw)
        if item.expiry_run:
            runs.append((item.expire_deadline, seq_of_item_key(key)))
            keys = []
        else:
            keys = [expiry_key(item.expire_deadline, key)]
        if item.source_id and txn.get(source_key(item.source_id), db=db) == key:
            keys.append(source_key(item.source_id))
        if item.priority and not item.is_leased and key[:1] == TAG_ITEM:
            keys.append(priority_key(item.priority, seq_of_item_key(key)))
        return keys

    def scan(self, txn: lmdb.Transaction[bytes], p: int) -> PartitionScan:
        """Read a whole partition once to rebuild the actor's in-memory view of it."""
        result = PartitionScan(next_seq=self.read_next_seq(txn, p))
        result.lease_records = lease_records.read_all(txn, self._dbs[p])
        held = {seq: record for record in result.lease_records for seq in record.seqs()}
        cursor = txn.cursor(db=self._dbs[p])
        unpack = _HEADER.unpack_from
        max_seq = 0
        if cursor.set_range(TAG_ITEM):
            for key, raw in cursor:
                if key[:1] != TAG_ITEM:
                    break
                seq = seq_of_item_key(key)
                max_seq = seq
                flags, _att, created, _exp, lease_deadline, _enq, leased_at = unpack(raw)[:7]
                result.created_sum += created
                record = held.get(seq) if held else None
                if record is not None:  # as the lease would have rewritten it
                    result.leased += 1
                    result.leased_at_sum += record.leased_at
                    result.leases.append((record.deadline, seq))
                elif flags & 1:
                    result.leased += 1
                    if flags & _FLAG_HISTORY and grouped(raw):
                        result.groups_in_flight += 1
                    result.leased_at_sum += leased_at
                    result.leases.append((lease_deadline, seq))
                else:
                    result.ready += 1
                    if not result.first_ready_seq:
                        result.first_ready_seq = seq
        if cursor.set_range(TAG_SCHEDULED):
            for key in cursor.iternext(keys=True, values=False):
                if key[:1] != TAG_SCHEDULED:
                    break
                _due, seq = parse_scheduled_key(key)
                max_seq = max(max_seq, seq)
                result.scheduled += 1
        result.waiting, waiting_created = ordered_groups.count_waiting(txn, self._dbs[p])
        result.created_sum += waiting_created
        if result.waiting and cursor.set_range(TAG_WAITING):
            for key in cursor.iternext(keys=True, values=False):
                if key[:1] != TAG_WAITING:
                    break
                max_seq = max(max_seq, ordered_groups.seq_of_waiting_key(key))
        for seq, _item in self.outbox(txn, p):
            max_seq = max(max_seq, seq)
        for seq, _uid, _item in self.redrive_outbox(txn, p):
            max_seq = max(max_seq, seq)
        result.next_seq = max(result.next_seq, max_seq + 1)
        if not result.first_ready_seq:
            result.first_ready_seq = result.next_seq
        result.first_due = self.first_due(txn, p)
        result.first_expiry = self.first_expiry(txn, p)
        if cursor.set_range(TAG_PRIORITY):
            for key in cursor.iternext(keys=True, values=False):
                if key[:1] != TAG_PRIORITY:
                    break
                result.ranked += 1
        return result


# How far the head-of-partition lookup walks past leased items before giving up (the
# caller keeps what it knew; the lease scan moves the ready hint on soon after).
HEAD_SCAN_LIMIT = 1000


def _ready_head(cursor: Any, from_seq: int, held: Container[int]) -> int | None:
    if not cursor.set_range(item_key(from_seq)):
        return 0
    for n, (key, raw) in enumerate(cursor):
        if key[:1] != TAG_ITEM:
            return 0
        if not raw[0] & _FLAG_LEASED and not (held and seq_of_item_key(key) in held):
            return int(read_state(raw).created_at)
        if n >= HEAD_SCAN_LIMIT:
            return None
    return 0
