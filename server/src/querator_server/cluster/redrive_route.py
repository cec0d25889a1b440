"""Where a redriven item goes in a cluster, and what ``RedriveIn`` carries.

A redrive moves each item back to its source queue, named by the uid in its
source_id. A replicated queue's uid is its shard's, the same on every node, and the
queue is served by its primary alone, which may be another node than the one running
the redrive (a replicated dead-letter queue's primary): the items go there over
``RedriveIn``, one hop, as dead letters go to a replicated dead-letter queue
(primary_hand_over.py, dead_letter_route.py). The receiver stores each once by
source_id (storage/accepted_sources.py), so the sender's tries again (a failure, a
failover of either queue) store nothing twice. An explicit target_queue that is
replicated is reached the same way. A queue of one copy keeps its node's own uids, so
its items go back only to a partition on the same node: out of a one-copy dead-letter
queue, whose part on a node holds that node's dead letters alone, or out of a
replicated one whose primary is their node, which names them (dead_letter_source.py;
QueuesManager.queues_by_uid and own_sources).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..actor.requests import RedriveInRequest
from ..errors import InvalidArgument, Unavailable
from ..storage import Item
from .catalog import CatalogCache
from .forwarding import Peers
from .primary_hand_over import PeerQueue, decode_items, remote_primary
from .replica_wire import unpack

REDRIVE_IN = "RedriveIn"


def decode(data: bytes) -> tuple[int, list[Item]]:
    header, blobs = unpack(data)
    uid = header.get("uid")
    if not isinstance(uid, int) or isinstance(uid, bool) or uid <= 0:
        raise InvalidArgument("uid", "a redrive hand-over names its queue's uid")
    return uid, decode_items(blobs, f"a redriven item for queue uid {uid}")


class RedriveRoute:
    """The manager's way to a redrive's target queues (QueuesManager.redrive_route and
    QueuesManager.redrive_targets)."""

    def __init__(self, node: str, catalog: CatalogCache, peers: Peers, local: Callable[[int], Any]) -> None:
        self._node = node
        self._catalog = catalog
        self._peers = peers
        self._local = local

    def __call__(self, uid: int) -> Any:
        """The queue of ``uid``: its actor here, its primary's node, or None (gone: the
        items go back where they came from)."""
        record = self._catalog.shards.get(uid)
        if record is None:
            return self._local(uid)
        primary = remote_primary(self._catalog, self._node, record, "redriven items")
        if primary is not None:
            return PeerQueue(self._peers, primary, REDRIVE_IN, {"uid": uid})
        actor = self._local(uid)
        if actor is None:  # elected here, not serving yet: not gone (that would put the items back)
            raise Unavailable(f"queue {record.queue!r} is not served here yet; redriven items wait")
        return actor

    def targets(self, visible: Callable[[str], bool] | None) -> dict[int, str]:
        """Every replicated queue (that is ``visible``), by its shard's uid."""
        return {r.uid: r.queue for r in self._catalog.shards.records() if visible is None or visible(r.queue)}

    async def take(self, data: bytes) -> None:
        """Items another node redrives into a queue this node is primary of
        (``RedriveIn``), stored once each by source_id; UNAVAILABLE when it is not the
        primary here (the sender tries again, routed anew)."""
        uid, items = decode(data)
        actor = self._local(uid)
        if actor is None:
            raise Unavailable(f"the queue of uid {uid} is not served here; send the redriven items to its primary")
        await actor.submit(RedriveInRequest(items))
