"""RedriveItems on a cluster: the single-server redrive run on each node in turn.

A redrive hands items between the actors of one process (actor/redrive.py), and it
may: a dead letter only ever moves from a partition to the dead-letter queue's part
on the same node (coordinator.py, ``_with_dead_queue``), so the items of a node's
dead-letter partitions go back to source partitions on that node, named there by
their local uid. The receiving node runs the local redrive on every node homing the
queue, in node id order (its own part here, the others' by a forwarded call, which
their nodes run locally), until ``max_items`` moved.

Where a call stops, its page token says where to go on: the node being worked on
with that node's own page token, then the nodes after it in id order, then the nodes
passed over because they were down. That order does not depend on the receiving node,
so any node goes on with a token another issued.

Nothing moved is ever left unreported: a node that fails after others moved items
ends the call, answered with what moved and a token that starts at the failed node;
only a call that moved nothing answers with the error. A node known to be down (not a
member, its connection refused, or no answer to a health check: a paused node; the
call never reached it) is passed over and tried again at the end of the walk; if it
still is, the call answers what moved and the next one UNAVAILABLE naming it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from querator.v1 import storage_pb2 as pb

from ..errors import FailedPrecondition, InvalidArgument, QueratorError, Unavailable
from .placement import QueueEntry

# One node's redrive: (node, the request for it) -> its answer. Raises Unreachable when
# the call never reached the node.
Step = Callable[[str, pb.RedriveItemsRequest], Awaitable[pb.RedriveItemsResponse]]

_NOT_OURS = "is not a page token this server issued"


@dataclass(slots=True)
class RedriveWalk:
    """Where a cluster redrive goes on (what its page token holds)."""

    generation: int  # of the queue's catalog entry: a token is for this queue only
    # The node to go on with (with its own page token ``local``), then every node after
    # it in id order; "" to start with the first node, None once every node was visited.
    at: str | None = ""
    local: str = ""
    # Nodes passed over while down, with their page tokens: visited after the others.
    later: list[tuple[str, str]] = field(default_factory=list)

    def encode(self) -> bytes:
        return json.dumps([self.generation, self.at, self.local, self.later], separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, entry: QueueEntry) -> RedriveWalk:
        # Signed by the cluster (c.decode_token), so only ever what a call issued;
        # checked all the same, as a token of an older format could be.
        try:
            generation, at, local, later = json.loads(data)
            walk = cls(int(generation), None if at is None else str(at), str(local), [(str(n), str(t)) for n, t in later])
        except (ValueError, TypeError):
            raise InvalidArgument("page_token", _NOT_OURS) from None
        if walk.generation != entry.generation:
            raise InvalidArgument("page_token", "was issued for another queue")
        return walk


def check_target(entry: QueueEntry, target: QueueEntry, nodes: Iterable[str]) -> None:
    """Items move within their node only: refuse, before anything moves there, a target
    that lacks a partition on one of ``nodes`` (nodes homing the queue). A replicated
    target is served by its primary alone and reached from every node over
    ``RedriveIn`` (redrive_route.py), as a replicated source is."""
    if target.shard:
        return
    missing = sorted(set(nodes) - set(target.nodes()))
    if not missing:
        return
    name, to = entry.config.name, target.config.name
    raise FailedPrecondition(
        f"target_queue {to!r} has no partition on node(s) {', '.join(missing)}, which home partitions of {name!r}: "
        f"a redrive moves items within their node, so nothing was moved. Add partitions to {to!r} "
        "(UpdateQueue requested_partitions; new ones go to the nodes holding the fewest of it) until "
        f"every node homing {name!r} has one (ClusterInfo shows the homes), or redrive without target_queue"
    )


async def walk(
    entry: QueueEntry,
    request: pb.RedriveItemsRequest,
    limit: int,
    start: RedriveWalk | None,
    live: Callable[[str], bool],
    step: Step,
    unreachable: type[Exception],
) -> tuple[pb.RedriveItemsResponse, RedriveWalk | None]:
    """Redrive on every node of ``entry`` from ``start`` until ``limit`` items moved."""
    here = start or RedriveWalk(entry.generation)
    nodes = entry.nodes()
    # Each stop: (node, its page token, whether it is on the main pass).
    stops: list[tuple[str, str, bool]] = []
    if here.at is not None:
        if here.at in nodes:
            stops.append((here.at, here.local, True))
        stops += [(n, "", True) for n in nodes if n > here.at]
    stops += [(n, t, False) for n, t in here.later if n in nodes]
    out = pb.RedriveItemsResponse()
    down: list[tuple[str, str]] = []

    def stop_at(index: int, token: str) -> RedriveWalk:
        node, _, main = stops[index]
        rest = [(n, t) for n, t, m in stops[index + 1 :] if not m]
        if main:
            return RedriveWalk(entry.generation, node, token, rest + down)
        return RedriveWalk(entry.generation, None, "", [(node, token), *rest, *down])

    for index, (node, token, _) in enumerate(stops):
        if out.moved >= limit:
            return out, stop_at(index, token)
        if not live(node):
            down.append((node, token))
            continue
        part = pb.RedriveItemsRequest()
        part.CopyFrom(request)
        part.max_items = limit - out.moved
        part.page_token = token
        try:
            answer = await step(node, part)
        except unreachable:  # never reached the node: nothing moved there
            down.append((node, token))
            continue
        except QueratorError:
            if out.moved:  # report what moved; the next call starts at this node
                return out, stop_at(index, token)
            raise
        out.moved += answer.moved
        out.message_ids.extend(answer.message_ids)
        out.skipped += answer.skipped
        if answer.next_page_token:
            return out, stop_at(index, answer.next_page_token)
    if not down:
        return out, None
    if out.moved:
        return out, RedriveWalk(entry.generation, None, "", down)
    names = ", ".join(sorted({n for n, _ in down}))
    raise Unavailable(
        f"queue {entry.config.name!r}: node(s) {names} homing part of it are down or not answering, so their items were not "
        "redriven (the live nodes' were, and each moved item was reported); send the same request again once they are back"
    )
