"""What one cycle of a replicated queue changed, as physical writes, and the errors of
applying it elsewhere.

A change set is redo, never a replay of requests: the primary's cycle decided ids,
clock readings and placements, and a copy stores exactly the keys and values the
primary stored (``ops``: database role, key, value or None for a delete). ``db`` is
the database's role in the queue (``p0``, ``dedup``, ...), never an LMDB handle or a
name with the node's own prefix, so a copy may keep its databases in an environment
of its own or in a commit group whatever the primary does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from .queue_store import StorageError

# version, uid, epoch, lsn, roles, ops
_HEAD = struct.Struct(">BQQQHI")
# role index, key length, value length (0xFFFFFFFF: a delete)
_OP = struct.Struct(">HHI")
_DELETE = 0xFFFFFFFF
_VERSION = 1


class Fenced(StorageError):
    """A change set or a promotion under an epoch below the one this copy has accepted
    or promised: it comes from a deposed primary and must not be applied."""


class Diverged(StorageError):
    """A change set that does not follow this copy's history (a gap in the lsns, or an
    lsn this copy holds under another epoch): the copy must be rebuilt from a snapshot."""


class Position(NamedTuple):
    """Where a copy stands: the epoch of its last applied change and that change's lsn
    (0, 0: nothing applied yet)."""

    epoch: int
    lsn: int


@dataclass(slots=True)
class ChangeSet:
    """The writes of one cycle of queue ``uid`` under ``epoch``, numbered ``lsn``."""

    uid: int
    epoch: int
    lsn: int
    ops: list[tuple[str, bytes, bytes | None]] = field(default_factory=list)

    @property
    def position(self) -> Position:
        return Position(self.epoch, self.lsn)

    def encode(self) -> bytes:
        """Compact bytes: a header, the role names once, then each op as (role index,
        key length, value length) and the bytes themselves."""
        roles: dict[str, int] = {}
        body: list[bytes] = []
        extend, pack = body.extend, _OP.pack
        last_role, index = "", 0
        for role, key, value in self.ops:
            if role != last_role:
                found = roles.get(role)
                if found is None:
                    found = roles[role] = len(roles)
                last_role, index = role, found
            if value is None:
                extend((pack(index, len(key), _DELETE), key))
            else:
                extend((pack(index, len(key), len(value)), key, value))
        names = [bytes((len(name),)) + name.encode() for name in roles]
        head = _HEAD.pack(_VERSION, self.uid, self.epoch, self.lsn, len(roles), len(self.ops))
        return b"".join([head, *names, *body])

    @staticmethod
    def encode_runs(uid: int, epoch: int, lsn: int, runs: list[tuple[str, list[tuple[bytes, bytes]]]]) -> bytes:
        """``encode`` of a change set of puts only, given as runs of one role's
        (key, value) pairs: the same bytes, without a tuple per op (a snapshot's chunks)."""
        roles: dict[str, int] = {}
        body: list[bytes] = []
        extend, pack = body.extend, _OP.pack
        count = 0
        for role, run in runs:
            index = roles.setdefault(role, len(roles))
            for key, value in run:
                extend((pack(index, len(key), len(value)), key, value))
            count += len(run)
        names = [bytes((len(name),)) + name.encode() for name in roles]
        return b"".join([_HEAD.pack(_VERSION, uid, epoch, lsn, len(roles), count), *names, *body])

    @classmethod
    def decode(cls, data: bytes) -> ChangeSet:
        data = bytes(data)
        try:
            version, uid, epoch, lsn, role_count, op_count = _HEAD.unpack_from(data)
            if version != _VERSION:
                raise ValueError(f"unknown change set version {version}")
            at = _HEAD.size
            roles: list[str] = []
            for _ in range(role_count):
                size = data[at]
                roles.append(data[at + 1 : at + 1 + size].decode())
                at += 1 + size
            ops: list[tuple[str, bytes, bytes | None]] = []
            append, unpack, op_size = ops.append, _OP.unpack_from, _OP.size
            for _ in range(op_count):
                index, key_size, value_size = unpack(data, at)
                at += op_size
                end = at + key_size
                if value_size == _DELETE:
                    append((roles[index], data[at:end], None))
                    at = end
                else:
                    at = end + value_size
                    append((roles[index], data[end - key_size : end], data[end:at]))
            if at != len(data):
                raise ValueError(f"{len(data) - at} bytes past the last op (negative: cut short)")
        except (struct.error, IndexError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"not a change set: {exc}") from exc
        return cls(uid, epoch, lsn, ops)
