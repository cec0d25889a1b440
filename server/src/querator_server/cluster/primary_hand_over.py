"""Items handed to a replicated queue's primary when that is another node: the rule
that picks where they go, the peer call that takes them there, and its message.

Dead letters for a replicated dead-letter queue (dead_letter_route.py) and redriven
items for a replicated queue (redrive_route.py) go the same way: a replicated queue is
served by its shard's primary alone, so a node that is not the primary sends them
there, one hop, and a primary that is not live makes them wait (UNAVAILABLE: the
sender tries again, routed anew). The receiver stores each once by source_id
(storage/accepted_sources.py), so a try again stores nothing twice.
"""

from __future__ import annotations

from typing import Any, Protocol

from google.protobuf.wrappers_pb2 import BytesValue

from ..errors import InvalidArgument, Unavailable
from ..storage import Item
from .catalog import CatalogCache
from .forwarding import Peers
from .give_back import SERVICE
from .replica_wire import pack
from .shard_record import ShardRecord

# A hand-over waits for one transaction on the primary; longer means it is stuck.
CALL_S = 10.0


class _Items(Protocol):
    items: list[Item]


def encode(header: dict[str, Any], items: list[Item]) -> bytes:
    return pack(header, [item.encode() for item in items])


def decode_items(blobs: list[bytes], what: str) -> list[Item]:
    """The items of a hand-over (its header is for the caller to check); a bad one is
    INVALID_ARGUMENT naming ``value`` and ``what`` it was."""
    try:
        return [Item.decode(blob) for blob in blobs]
    except ValueError as exc:
        raise InvalidArgument("value", f"{what}: {exc}") from None


def remote_primary(catalog: CatalogCache, node: str, record: ShardRecord, waiting: str) -> str | None:
    """The node serving ``record``'s queue when it is not ``node`` (None when it is);
    UNAVAILABLE when that primary is not live, so that ``waiting`` wait."""
    if record.primary == node:
        return None
    if record.primary not in catalog.members:
        raise Unavailable(f"queue {record.queue!r}: its primary {record.primary!r} is not live; {waiting} wait")
    return record.primary


class PeerQueue:
    """A replicated queue served by another node (its primary), reached over the Peer
    call ``method`` whose message carries ``header`` and a request's items."""

    def __init__(self, peers: Peers, node: str, method: str, header: dict[str, Any]) -> None:
        self._peers = peers
        self._node = node
        self._method = f"/{SERVICE}/{method}"
        self._header = header

    async def submit(self, request: _Items) -> None:
        data = encode(self._header, request.items)
        await self._peers.forward(self._node, self._method, BytesValue(value=data), BytesValue, None, CALL_S)
