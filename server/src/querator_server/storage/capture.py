"""Recording a cycle's writes, for replicated queues (change_set.py).

``Recording`` stands in for the cycle's write transaction and notes every put and
delete, through the transaction or a cursor of it, as ``(role, key, value | None)``.
Only replicated queues' cycles get one: a queue of one copy runs on the bare LMDB
transaction, with nothing in between. A write to a database the recording does not
know fails, so a new database of the queue cannot escape replication unnoticed.

Nested transactions (a cycle's isolated steps and probes) are begun with
``begin_child``: their writes join the parent's record when they commit and are
dropped with them when they abort.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import lmdb

from .queue_store import StorageError

Op = tuple[str, bytes, bytes | None]
# Cursor writes a recording does not note: refused rather than missed.
_UNRECORDED = frozenset({"replace", "pop"})


def _unknown(db: Any) -> StorageError:
    return StorageError(f"a replicated queue wrote to a database it does not replicate ({db!r})")


class Recording:
    """A write transaction whose writes are recorded (the subset of LMDB's
    ``Transaction`` that cycles use)."""

    __slots__ = ("txn", "ops", "roles", "_parent")

    def __init__(self, txn: lmdb.Transaction[bytes], roles: Mapping[Any, str], parent: Recording | None = None) -> None:
        self.txn = txn
        self.roles = roles
        self.ops: list[Op] = []
        self._parent = parent

    def get(self, key: bytes, default: bytes | None = None, db: Any = None) -> bytes | None:
        return self.txn.get(key, default, db=db)

    def put(self, key: bytes, value: bytes, dupdata: bool = True, overwrite: bool = True, append: bool = False, db: Any = None) -> bool:
        role = self.roles.get(db)
        if role is None:
            raise _unknown(db)
        done = self.txn.put(key, value, dupdata=dupdata, overwrite=overwrite, append=append, db=db)
        if done:
            self.ops.append((role, bytes(key), bytes(value)))
        return done

    def delete(self, key: bytes, value: bytes = b"", db: Any = None) -> bool:
        role = self.roles.get(db)
        if role is None:
            raise _unknown(db)
        done = self.txn.delete(key, value, db=db)
        if done:
            self.ops.append((role, bytes(key), None))
        return done

    def drop(self, db: Any, delete: bool = True) -> None:
        raise StorageError(f"a replicated queue's cycle may not drop a database ({self.roles.get(db, db)!r}): it is not replicated")

    def replace(self, key: bytes, value: bytes, db: Any = None) -> bytes | None:
        raise StorageError("Transaction.replace is not recorded for replication: use get and put")

    def pop(self, key: bytes, db: Any = None) -> bytes | None:
        raise StorageError("Transaction.pop is not recorded for replication: use get and delete")

    def cursor(self, db: Any = None) -> RecordingCursor:
        role = self.roles.get(db)
        if role is None:
            raise _unknown(db)
        return RecordingCursor(self.txn.cursor(db=db), role, self.ops)

    # -- as a nested transaction -------------------------------------------------------

    def commit(self) -> None:
        self.txn.commit()
        if self._parent is not None:
            self._parent.ops.extend(self.ops)

    def abort(self) -> None:
        self.txn.abort()
        self.ops = []


class RecordingCursor:
    """A cursor of a ``Recording``: reads go straight to LMDB's cursor."""

    __slots__ = ("_cursor", "_role", "_ops")

    def __init__(self, cursor: lmdb.Cursor[bytes], role: str, ops: list[Op]) -> None:
        self._cursor = cursor
        self._role = role
        self._ops = ops

    def __getattr__(self, name: str) -> Any:
        if name in _UNRECORDED:
            raise StorageError(f"Cursor.{name} is not recorded for replication: use put and delete")
        return getattr(self._cursor, name)

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return iter(self._cursor)

    def put(self, key: bytes, value: bytes, dupdata: bool = True, overwrite: bool = True, append: bool = False) -> bool:
        done = self._cursor.put(key, value, dupdata=dupdata, overwrite=overwrite, append=append)
        if done:
            self._ops.append((self._role, bytes(key), bytes(value)))
        return done

    def delete(self, dupdata: bool = False) -> bool:
        key = self._cursor.key()
        done = self._cursor.delete(dupdata=dupdata)
        if done:
            self._ops.append((self._role, bytes(key), None))
        return done

    def putmulti(
        self, items: Iterable[tuple[bytes, bytes]], dupdata: bool = True, overwrite: bool = True, append: bool = False
    ) -> tuple[int, int]:
        pairs = list(items)
        if not overwrite:  # which ones went in is not said: one at a time
            added = sum(1 for key, value in pairs if self.put(key, value, dupdata=dupdata, overwrite=False, append=append))
            return len(pairs), added
        result = self._cursor.putmulti(pairs, dupdata=dupdata, overwrite=True, append=append)
        role = self._role
        self._ops.extend((role, bytes(key), bytes(value)) for key, value in pairs)
        return result


def begin_child(env: lmdb.Environment, txn: lmdb.Transaction[bytes]) -> lmdb.Transaction[bytes]:
    """A nested write transaction of ``txn``, recorded into ``txn``'s record if it has one."""
    if isinstance(txn, Recording):
        return Recording(env.begin(write=True, parent=txn.txn), txn.roles, txn)
    return env.begin(write=True, parent=txn)
