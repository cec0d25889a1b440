"""The messages of the replication calls between nodes (``querator.internal.Peer``).

Not part of the API, so not in the public protos: each call carries one
``google.protobuf.BytesValue`` whose bytes are a JSON header (a 4-byte length first)
followed by length-prefixed blobs (encoded change sets, or nothing). Change sets are
storage's own encoding (``ChangeSet.encode``), shipped as they are: physical redo, never
re-encoded on the way.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import InvalidArgument

SHIP = "ShipChanges"
STATUS = "ReplicaStatus"
SNAPSHOT = "InstallSnapshot"

_LEN = struct.Struct("!I")


def pack(header: dict[str, Any], blobs: list[bytes] | tuple[bytes, ...] = ()) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [_LEN.pack(len(head)), head]
    for blob in blobs:
        parts += [_LEN.pack(len(blob)), blob]
    return b"".join(parts)


def unpack(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    try:
        (size,) = _LEN.unpack_from(data, 0)
        header = json.loads(data[4 : 4 + size])
        offset = 4 + size
        blobs = []
        while offset < len(data):
            (size,) = _LEN.unpack_from(data, offset)
            offset += 4
            if offset + size > len(data):
                raise ValueError("a blob runs past the end")
            blobs.append(data[offset : offset + size])
            offset += size
    except (struct.error, ValueError) as exc:
        raise InvalidArgument("value", f"not a replication message: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidArgument("value", "not a replication message: the header is not an object")
    return header, blobs


def _int(header: dict[str, Any], name: str) -> int:
    value = header.get(name)
    if not isinstance(value, int) or value < 0:
        raise InvalidArgument(name, f"must be a non-negative integer, got {value!r}")
    return value


def _str(header: dict[str, Any], name: str) -> str:
    value = header.get(name, "")
    if not isinstance(value, str):
        raise InvalidArgument(name, f"must be a string, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Ship:
    """Change sets of shard ``uid`` in lsn order, from the primary of ``epoch``, to the
    copy whose incarnation is ``incarnation`` (another copy there answers mismatch)."""

    uid: int
    epoch: int
    primary: str
    incarnation: str
    changes: tuple[bytes, ...] = ()

    def encode(self) -> bytes:
        header = {"uid": self.uid, "epoch": self.epoch, "primary": self.primary, "incarnation": self.incarnation}
        return pack(header, self.changes)

    @classmethod
    def decode(cls, data: bytes) -> Ship:
        header, blobs = unpack(data)
        return cls(_int(header, "uid"), _int(header, "epoch"), _str(header, "primary"), _str(header, "incarnation"), tuple(blobs))


@dataclass(frozen=True, slots=True)
class StatusAsk:
    """A copy's position; with ``fence`` > 0 it first promises to refuse every epoch
    below ``fence`` (durably)."""

    uid: int
    fence: int = 0

    def encode(self) -> bytes:
        return pack({"uid": self.uid, "fence": self.fence})

    @classmethod
    def decode(cls, data: bytes) -> StatusAsk:
        header, _ = unpack(data)
        return cls(_int(header, "uid"), _int(header, "fence"))


@dataclass(frozen=True, slots=True)
class CopyState:
    """A copy's answer: its last applied change's (epoch, lsn), its incarnation, the
    highest epoch it promised, whether the node runs it as primary, and the epoch whose
    primary last rebuilt it from a snapshot."""

    epoch: int
    lsn: int
    incarnation: str
    fenced_epoch: int
    primary: bool = False
    # Why a Ship was not applied ("" when it was): "mismatch" (another incarnation),
    # "fenced" (an epoch below fenced_epoch), "diverged" (not the next lsn of its history).
    refused: str = ""
    detail: str = field(default="", compare=False)
    # The epoch of the primary whose snapshot the copy last installed whole (0: none).
    rebuilt: int = 0

    @property
    def position(self) -> tuple[int, int]:
        return (self.epoch, self.lsn)

    def encode(self) -> bytes:
        return pack(asdict(self))

    @classmethod
    def decode(cls, data: bytes) -> CopyState:
        header, _ = unpack(data)
        return cls(
            _int(header, "epoch"),
            _int(header, "lsn"),
            _str(header, "incarnation"),
            _int(header, "fenced_epoch"),
            bool(header.get("primary", False)),
            _str(header, "refused"),
            _str(header, "detail"),
            _int(header, "rebuilt") if "rebuilt" in header else 0,  # absent from a node before it
        )


@dataclass(frozen=True, slots=True)
class SnapshotHead:
    """The first message of an InstallSnapshot stream; the chunks follow."""

    uid: int
    epoch: int
    primary: str

    def encode(self) -> bytes:
        return pack({"uid": self.uid, "epoch": self.epoch, "primary": self.primary})

    @classmethod
    def decode(cls, data: bytes) -> SnapshotHead:
        header, _ = unpack(data)
        return cls(_int(header, "uid"), _int(header, "epoch"), _str(header, "primary"))
