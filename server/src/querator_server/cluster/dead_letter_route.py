"""Where a queue's dead letters go in a cluster, and what ``DeadLetters`` carries.

A dead-letter queue of one copy has a partition on every node homing one of its users'
partitions (admin_frontend.py gives it one), so dead letters go to its part on the
same node, as on a single server. A replicated dead-letter queue is served by its
shard's primary alone, so dead letters go there, over ``DeadLetters`` when that is
another node (primary_hand_over.py). Its storage (and with it the deduplication by
source_id) is the same on every copy, so a dead letter sent again after a failover of
either queue (the source's new primary hands over what its outbox still holds) is
stored once, also when it was completed there meanwhile (storage/accepted_sources.py
remembers what was taken).

A replicated queue's dead_queue must be replicated too: its dead letters are sent by
whichever copy is primary, and a part of a one-copy queue on the old primary's node
would neither move with it nor see what the new one sends.

A dead letter of a one-copy queue names its source by this node's own storage uid,
which another node's counter hands out too: sent to a replicated dead-letter queue
(whose primary may be, or after a failover become, another node) its source_id is the
node's id, "/", and the item's id (dead_letter_source.py), so a redrive there tells
this node's queue from another one of the same uid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..actor.requests import DeadLetterRequest
from ..errors import InvalidArgument
from ..storage import Item
from .catalog import CatalogCache
from .dead_letter_source import qualify
from .forwarding import Peers
from .primary_hand_over import PeerQueue, decode_items, remote_primary
from .replica_wire import unpack

DEAD_LETTERS = "DeadLetters"


def decode(data: bytes) -> tuple[str, list[Item]]:
    header, blobs = unpack(data)
    queue = header.get("queue")
    if not isinstance(queue, str) or not queue:
        raise InvalidArgument("queue", "a dead-letter hand-over names its queue")
    return queue, decode_items(blobs, f"a dead letter of queue {queue!r}")


class DeadLetterRoute:
    """The manager's way to the dead-letter queue ``name`` (QueuesManager.dead_queue_route)."""

    def __init__(self, node: str, catalog: CatalogCache, peers: Peers, local: Callable[[str], Any]) -> None:
        self._node = node
        self._catalog = catalog
        self._peers = peers
        self._local = local

    def __call__(self, name: str) -> Any:
        entry = self._catalog.queues.get(name)
        record = self._catalog.shards.get(entry.shard) if entry is not None and entry.shard else None
        if record is None:
            return self._local(name)
        primary = remote_primary(self._catalog, self._node, record, "dead letters")
        if primary is None:
            return _Qualified(self._local(name), self._node)
        return _Qualified(PeerQueue(self._peers, primary, DEAD_LETTERS, {"queue": name}), self._node)

    async def take(self, data: bytes) -> None:
        """Dead letters another node sent (``DeadLetters``): stored by this node's
        primary of their queue, once each by source_id (NotFound or UNAVAILABLE when it
        is not the primary here: the sender tries again, routed anew)."""
        queue, items = decode(data)
        await self._local(queue).submit(DeadLetterRequest(items))


class _Qualified:
    """A replicated dead-letter queue, given dead letters whose one-copy sources are
    named with this node's id (the items are the sender's copies)."""

    def __init__(self, target: Any, node: str) -> None:
        self._target = target
        self._node = node

    async def submit(self, request: DeadLetterRequest) -> None:
        for item in request.items:
            item.source_id = qualify(self._node, item.source_id)
        await self._target.submit(request)
