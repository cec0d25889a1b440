"""A replicated queue's copy on this node: where it stands, what it promised, and the
physical redo of change sets (change_set.py).

Kept in the queue's ``replica`` database, beside its data and written in the same
transactions, so a crash never separates a copy's contents from its position:

- ``position``: (epoch, lsn) of the last change the copy holds;
- ``fenced``: the highest epoch it accepted or promised; a change set or a promotion
  under a lower epoch is refused (``Fenced``);
- ``h`` + epoch: the lsn the epoch's first change had (the epoch history, so a copy
  that comes back can be told whether it lies on the primary's history);
- ``incarnation``: a random id made with the copy and never copied, so a copy that
  lost its disk (and was made again, empty) is not taken for the one it replaced;
- ``rebuilt``: the epoch of the primary whose snapshot the copy last installed whole
  (absent while installing, and in a copy never rebuilt): what lets a failover elect a
  copy rebuilt just before its primary died, before etcd recorded its new incarnation.

The ``replica`` database is the node's own: never recorded, never in a digest.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import struct
import uuid
from collections.abc import Iterable
from typing import Any

import lmdb

from .capture import Recording
from .change_set import ChangeSet, Diverged, Fenced, Position
from .keyed import KeyedIndex
from .queue_store import QueueStore

REPLICA_DB = b"replica"
_POSITION = b"position"
_FENCED = b"fenced"
_INCARNATION = b"incarnation"
_HISTORY = b"h"
_INSTALLING = b"installing"
_REBUILT = b"rebuilt"
_PAIR = struct.Struct(">QQ")
_U64 = struct.Struct(">Q")
_SIZE = struct.Struct(">I")
_HASH_RUN = 4096  # entries hashed in one update (bounds the memory of one)


class Hasher:
    """A stable hash of (role, key, value) entries given in role then key order."""

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=16)
        self._role = ""
        self.count = 0

    def add(self, role: str, key: bytes, value: bytes) -> None:
        self.add_run(role, ((key, value),))

    def add_run(self, role: str, entries: Iterable[tuple[bytes, bytes]]) -> None:
        """``add`` for a run of one role's entries, hashed in one update (per-entry
        updates cost a call and a concatenation each: most of a snapshot's reading)."""
        parts: list[bytes] = [b""]
        extend, pack = parts.extend, _SIZE.pack
        for key, value in entries:
            extend((pack(len(key)), key, pack(len(value)), value))
        if len(parts) == 1:
            return
        if role != self._role:  # a role is named once, before its first entry
            parts[0] = b"\x00" + role.encode() + b"\x00"
            self._role = role
        self.count += (len(parts) - 1) // 4
        self._h.update(b"".join(parts))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _write_ops(txn: lmdb.Transaction[bytes], ops: list[tuple[str, bytes, bytes | None]], dbs: dict[str, Any]) -> None:
    """Write ``ops`` in order: a run of puts to one database in one ``putmulti`` (in C,
    as the primary's bulk produce wrote them), deletes one by one."""
    delete = txn.delete
    run: list[tuple[bytes, bytes]] = []
    run_role = ""
    for role, key, value in ops:
        if run and (value is None or role != run_role):
            txn.cursor(db=dbs[run_role]).putmulti(run)
            run = []
        if value is None:
            delete(key, db=dbs[role])
        else:
            run_role = role
            run.append((key, value))
    if run:
        txn.cursor(db=dbs[run_role]).putmulti(run)


def _append(txn: lmdb.Transaction[bytes], db: Any, run: list[tuple[bytes, bytes]]) -> None:
    """Append ``run`` (sorted keys, each above the database's last) to ``db``; by plain
    puts from the first key that does not follow."""
    consumed, added = txn.cursor(db=db).putmulti(run, append=True)
    if added < len(run):
        put = txn.put
        for key, value in run[added:]:
            put(key, value, db=db)


def _epoch_at(history: list[tuple[int, int]], lsn: int) -> int:
    starts = [start for _, start in history]
    at = bisect.bisect_right(starts, lsn) - 1
    return history[at][0] if at >= 0 else 0


def _partition_role(role: str) -> int | None:
    """The partition a role names (``p3`` -> 3), None for the other databases."""
    if role[:1] == "p" and role[1:].isdigit():
        return int(role[1:])
    return None


class ReplicaState:
    """The replication state of one queue's store (``uid`` is the shard's).

    Build it with no write transaction of the store held (on its lane, or in its
    commit group's job): it opens the ``replica`` database and, for a new copy,
    writes its incarnation.
    """

    def __init__(self, store: QueueStore, keyed: KeyedIndex | None, uid: int) -> None:
        self.store = store
        self.keyed = keyed if keyed is not None else KeyedIndex(store)
        self.uid = uid
        env = store.env
        name = store.prefix + REPLICA_DB

        def open_meta(txn: lmdb.Transaction[bytes]) -> tuple[Any, bytes]:
            db = env.open_db(name, txn=txn, create=True)
            incarnation = txn.get(_INCARNATION, db=db)
            if incarnation is None:
                incarnation = uuid.uuid4().hex.encode()
                txn.put(_INCARNATION, incarnation, db=db)
            return db, incarnation

        self._meta, incarnation = store.write(open_meta)
        self.incarnation = incarnation.decode()
        self._keyed_dbs = self.keyed.databases()
        self._roles: dict[Any, str] = {}
        self._handles: dict[str, Any] = {}
        self._load()

    def _load(self) -> None:
        with self.store.env.begin() as txn:
            raw = txn.get(_POSITION, db=self._meta)
            self._position = Position(*_PAIR.unpack(raw)) if raw else Position(0, 0)
            raw = txn.get(_FENCED, db=self._meta)
            self._fenced = _U64.unpack(raw)[0] if raw else 0
            raw = txn.get(_INCARNATION, db=self._meta)
            self.incarnation = raw.decode() if raw else self.incarnation
            self._history = self.stored_history(txn)
            self._installing = txn.get(_INSTALLING, db=self._meta) is not None
            raw = txn.get(_REBUILT, db=self._meta)
            self._rebuilt = _U64.unpack(raw)[0] if raw else 0

    # -- what the copy holds -------------------------------------------------------------

    def position(self) -> Position:
        """The last change durably held (as of the last commit this state was told of)."""
        return self._position

    def fenced_epoch(self) -> int:
        return self._fenced

    def history(self) -> list[tuple[int, int]]:
        """(epoch, lsn of its first change), oldest first."""
        return list(self._history)

    def rebuilt_epoch(self) -> int:
        """The epoch of the primary whose snapshot this copy last installed whole (0:
        none, or one is being installed)."""
        return self._rebuilt

    def epoch_at(self, lsn: int) -> int:
        """The epoch under which this copy holds change ``lsn`` (0: before any)."""
        return _epoch_at(self._history, lsn)

    # -- databases by role ---------------------------------------------------------------

    def roles(self) -> dict[Any, str]:
        """Every replicated database of the queue, handle -> role."""
        if len(self._roles) != self.store.partitions + len(self._keyed_dbs):
            roles = {self.store.db(p): f"p{p}" for p in range(self.store.partitions)}
            roles.update((db, role) for role, db in self._keyed_dbs.items())
            self._roles = roles
            self._handles = {role: db for db, role in roles.items()}
        return self._roles

    def handle(self, role: str) -> Any:
        self.roles()
        db = self._handles.get(role)
        if db is None:
            raise Diverged(f"a change set names database {role!r}, which this copy of queue uid {self.uid} lacks")
        return db

    def prepare(self, change: ChangeSet) -> None:
        """Open the partitions ``change`` writes that this copy does not have yet (a
        write transaction of its own: call it where ``store.write`` may run)."""
        self.prepare_roles(role for role, _, _ in change.ops)

    def prepare_roles(self, roles: Iterable[str]) -> None:
        need = max((p for role in roles if (p := _partition_role(role)) is not None), default=-1) + 1
        if need > self.store.partitions:
            self.store.ensure_partitions(need)

    # -- the primary's side ----------------------------------------------------------------

    def record(self, txn: lmdb.Transaction[bytes]) -> Recording:
        """A recording of ``txn`` for one cycle."""
        return Recording(txn, self.roles())

    def seal(self, txn: lmdb.Transaction[bytes], recording: Recording, epoch: int) -> ChangeSet | None:
        """The change set of a cycle that recorded ``recording`` under ``epoch``, its
        position written in ``txn``; None when the cycle wrote nothing. ``committed``
        once the transaction is durable."""
        if not recording.ops:
            return None
        if epoch < self._fenced:
            raise Fenced(f"queue uid {self.uid}: epoch {epoch} is fenced (this copy promised epoch {self._fenced})")
        change = ChangeSet(self.uid, epoch, self._position.lsn + 1, recording.ops)
        self._write_position(txn, change)
        return change

    def committed(self, change: ChangeSet) -> None:
        """``change`` is durable here."""
        if change.epoch > self._position.epoch:
            self._history.append((change.epoch, change.lsn))
        self._fenced = max(self._fenced, change.epoch)
        self._position = change.position

    def _write_position(
        self, txn: lmdb.Transaction[bytes], change: ChangeSet, held: Position | None = None, fenced: int | None = None
    ) -> None:
        """``change``'s position, over ``held`` and ``fenced`` (by default the durable ones)."""
        meta = self._meta
        held = self._position if held is None else held
        fenced = self._fenced if fenced is None else fenced
        txn.put(_POSITION, _PAIR.pack(change.epoch, change.lsn), db=meta)
        if change.epoch > held.epoch:
            txn.put(_HISTORY + _U64.pack(change.epoch), _U64.pack(change.lsn), db=meta)
        if change.epoch > fenced:
            txn.put(_FENCED, _U64.pack(change.epoch), db=meta)

    # -- a copy's side -----------------------------------------------------------------------

    def check(self, change: ChangeSet, sender: int = 0) -> bool:
        """Whether ``change`` is the next one to apply; False when this copy already
        holds it. Raises ``Fenced``, or ``Diverged`` for a gap or another history.

        ``sender``: the epoch of the primary that sends it. A change of an older epoch
        sent by a primary of the promised epoch or later is on that primary's history
        (the suffix it holds from before its election); only a sender below the promise
        is refused. Refusing such a change made the new primary rebuild an in-sync copy
        (a new incarnation) and, were it to die before it recorded that, left no copy
        that could take over."""
        return self._check(change, sender, self._position, self._fenced, self._history)

    def _check(
        self, change: ChangeSet, sender: int, held: Position, fenced: int, history: list[tuple[int, int]]
    ) -> bool:
        """``check`` against a copy that holds up to ``held`` under ``history``, fenced at ``fenced``."""
        if change.uid != self.uid:
            raise Diverged(f"a change set of queue uid {change.uid} was offered to the copy of queue uid {self.uid}")
        if self._installing:
            raise Diverged(f"queue uid {self.uid}: the copy is half-way through installing a snapshot: install one again")
        if max(change.epoch, sender) < fenced:
            raise Fenced(
                f"queue uid {self.uid}: change {change.lsn} of epoch {change.epoch} (sent under epoch "
                f"{max(change.epoch, sender)}) is fenced (epoch {fenced} was promised)"
            )
        if change.lsn <= held.lsn:
            if _epoch_at(history, change.lsn) != change.epoch:
                raise Diverged(
                    f"queue uid {self.uid}: change {change.lsn} is held under epoch {_epoch_at(history, change.lsn)}, "
                    f"not {change.epoch}: the copy diverged"
                )
            return False
        if change.lsn != held.lsn + 1:
            raise Diverged(
                f"queue uid {self.uid}: change {change.lsn} does not follow {held.lsn} (a gap): the copy must be rebuilt"
            )
        return True

    def apply(self, txn: lmdb.Transaction[bytes], change: ChangeSet, sender: int = 0) -> bool:
        """Write ``change`` and its position in ``txn`` (``prepare`` first); False when
        this copy held it already (nothing written). ``committed`` once durable."""
        return bool(self.apply_all(txn, [change], sender)[0])  # one change: refused, it is raised

    def apply_all(
        self, txn: lmdb.Transaction[bytes], changes: list[ChangeSet], sender: int = 0
    ) -> tuple[list[ChangeSet], Fenced | Diverged | None]:
        """``apply`` each of ``changes`` in order in ``txn`` (``prepare`` them first),
        each checked against the copy as the ones before leave it, up to the first
        refused: the changes written (those held already are skipped) and the refusal
        (None: none); the refusal is raised when nothing was written before it (the
        transaction is then thrown away, as for one change refused alone).
        ``committed`` each written one, in order, once durable.

        One transaction for the changes of one call: a copy catching up under load
        applied one per transaction (one fsync each, ~50 a second), about the rate its
        primary made new ones, and never caught up."""
        held, fenced, history = self._position, self._fenced, list(self._history)
        written: list[ChangeSet] = []
        for change in changes:
            try:
                if not self._check(change, sender, held, fenced, history):
                    continue
                dbs = {role: self.handle(role) for role in {op[0] for op in change.ops}}
            except (Fenced, Diverged) as exc:
                if not written:
                    raise
                return written, exc
            _write_ops(txn, change.ops, dbs)
            self._write_position(txn, change, held, fenced)
            if change.epoch > held.epoch:
                history.append((change.epoch, change.lsn))
            fenced = max(fenced, change.epoch)
            held = change.position
            written.append(change)
        return written, None

    def fence_in(self, txn: lmdb.Transaction[bytes], epoch: int) -> None:
        """Promise, in ``txn``, to accept nothing under an epoch below ``epoch``;
        ``fenced`` once durable."""
        if epoch > self._fenced:
            txn.put(_FENCED, _U64.pack(epoch), db=self._meta)

    def fenced(self, epoch: int) -> None:
        self._fenced = max(self._fenced, epoch)

    def apply_now(self, change: ChangeSet, sender: int = 0) -> Position:
        """``apply`` in a durable write transaction of its own (a store with an
        environment of its own, no transaction held; blocking)."""
        self.apply_all_now([change], sender)  # one change: refused, it is raised
        return self._position

    def apply_all_now(self, changes: list[ChangeSet], sender: int = 0) -> tuple[list[ChangeSet], Fenced | Diverged | None]:
        """``apply_all`` in one durable write transaction of its own (as ``apply_now``)."""
        self.prepare_roles(role for change in changes for role, _, _ in change.ops)
        written, refused = self.store.write(lambda txn: self.apply_all(txn, changes, sender))
        for change in written:
            self.committed(change)
        return written, refused

    def fence_now(self, epoch: int) -> Position:
        """``fence_in`` in a durable write transaction of its own (as ``apply_now``)."""
        if epoch > self._fenced:
            self.store.write(lambda txn: self.fence_in(txn, epoch))
            self.fenced(epoch)
        return self._position

    # -- comparing copies --------------------------------------------------------------------

    def digest(self) -> tuple[Position, str]:
        """The position and a stable hash of every replicated database's contents, read
        in one transaction. Databases are taken by role, empty ones skipped, so two
        copies holding the same keys and values hash alike wherever they keep them."""
        hasher = Hasher()
        with self.store.env.begin() as txn:
            position = self.stored_position(txn)
            for role, db in sorted(self.roles_by_name().items()):
                entries = iter(txn.cursor(db=db))
                while run := list(itertools.islice(entries, _HASH_RUN)):
                    hasher.add_run(role, run)
        return position, hasher.hexdigest()

    def stored(self) -> tuple[Position, int, str]:
        """Position, promise and incarnation as the storage holds them (what a restart
        would load), read in one transaction."""
        with self.store.env.begin() as txn:
            raw = txn.get(_FENCED, db=self._meta)
            incarnation = txn.get(_INCARNATION, db=self._meta)
            return (
                self.stored_position(txn),
                _U64.unpack(raw)[0] if raw else 0,
                bytes(incarnation).decode() if incarnation else "",
            )

    def stored_position(self, txn: lmdb.Transaction[bytes]) -> Position:
        raw = txn.get(_POSITION, db=self._meta)
        return Position(*_PAIR.unpack(raw)) if raw else Position(0, 0)

    def stored_history(self, txn: lmdb.Transaction[bytes]) -> list[tuple[int, int]]:
        history: list[tuple[int, int]] = []
        cursor = txn.cursor(db=self._meta)
        if cursor.set_range(_HISTORY):
            for key, value in cursor:
                if key[:1] != _HISTORY:
                    break
                history.append((_U64.unpack(key[1:])[0], _U64.unpack(value)[0]))
        return history

    # -- installing a snapshot (snapshot.py) -------------------------------------------------
    # Over several transactions, each durable: the first empties the copy and marks it
    # as being installed (a new incarnation, position 0), so a crash half-way leaves a
    # copy that refuses every change set until a snapshot is installed again.

    def begin_install(self, txn: lmdb.Transaction[bytes]) -> str:
        """Empty every replicated database and mark the copy as being installed; the
        new incarnation (``installing`` once durable)."""
        for db in self.roles_by_name().values():
            txn.drop(db, delete=False)
        meta = self._meta
        for key in [bytes(k) for k in txn.cursor(db=meta).iternext(keys=True, values=False) if k[:1] == _HISTORY]:
            txn.delete(key, db=meta)
        incarnation = uuid.uuid4().hex
        txn.put(_INCARNATION, incarnation.encode(), db=meta)
        txn.put(_POSITION, _PAIR.pack(0, 0), db=meta)
        txn.put(_INSTALLING, b"1", db=meta)
        txn.delete(_REBUILT, db=meta)
        return incarnation

    def installing(self, incarnation: str) -> None:
        self.incarnation = incarnation
        self._position = Position(0, 0)
        self._history = []
        self._installing = True
        self._rebuilt = 0

    def put_entries(self, txn: lmdb.Transaction[bytes], ops: list[tuple[str, bytes, bytes | None]]) -> None:
        """Store a snapshot's entries (``prepare`` first).

        A snapshot gives each database's entries in key order, after those of the
        chunks before (begin_install emptied them), so each run of one database is
        appended (``MDB_APPEND``, in C): no search of the tree and no Python call per
        entry (200,000 entries: 0.57 s against 0.99 s put one by one). A run out of
        order (a stream not from snapshot.py) is stored by plain puts."""
        dbs = {role: self.handle(role) for role in {op[0] for op in ops}}
        run: list[tuple[bytes, bytes]] = []
        run_role = ""
        for role, key, value in ops:
            if value is None:
                continue
            if run and role != run_role:
                _append(txn, dbs[run_role], run)
                run = []
            run_role = role
            run.append((key, value))
        if run:
            _append(txn, dbs[run_role], run)

    def finish_install(
        self, txn: lmdb.Transaction[bytes], position: Position, history: list[tuple[int, int]], sender: int = 0
    ) -> None:
        """The copy holds the snapshot: its position, history and a fence at its epoch;
        ``sender``: the epoch of the primary that sent it (kept as ``rebuilt``)."""
        meta = self._meta
        if sender:
            txn.put(_REBUILT, _U64.pack(sender), db=meta)
        txn.put(_POSITION, _PAIR.pack(*position), db=meta)
        for epoch, start in history:
            txn.put(_HISTORY + _U64.pack(epoch), _U64.pack(start), db=meta)
        if position.epoch > self._fenced:
            txn.put(_FENCED, _U64.pack(position.epoch), db=meta)
        txn.delete(_INSTALLING, db=meta)

    def installed(self, position: Position, history: list[tuple[int, int]], sender: int = 0) -> None:
        self._position = position
        self._history = list(history)
        self._fenced = max(self._fenced, position.epoch)
        self._installing = False
        self._rebuilt = sender

    def roles_by_name(self) -> dict[str, Any]:
        self.roles()
        return dict(self._handles)
