"""Where a data call goes in a cluster: the routing policy, pure (no I/O).

``where`` answers it from the queue's catalog entry (``home_of``, ``home_of_key``),
this node, the live nodes and the call; router.py carries the answer out (serves
this node's part, forwards the others through forwarding.py). The routing table
(testdata/routing/cases.json) holds the cases that the server's, the Python SDK's and
the TypeScript client's tests all run, so the three cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument, Unavailable
from .placement import QueueEntry

# Calls about one partition: served at that partition's home.
HOME_CALLS = frozenset({"Complete", "Retry", "Extend", "ListItems", "ListScheduledItems", "ImportItems", "DeleteItems"})
# Calls about the whole queue: on every node homing part of it.
# (DeleteQueue checks emptiness through GetQueueStats; RedriveItems walks the homes,
# redrive_walk.py.)
EVERY_CALLS = frozenset({"ClearQueue", "GetQueueStats"})


@dataclass(frozen=True, slots=True)
class Part:
    """One node's part of a call: ``keys``, the lease keys it takes; ``ids``, whether the
    request's ids (and partition) go with it."""

    node: str
    keys: tuple[str, ...] = ()
    ids: bool = False


@dataclass(frozen=True, slots=True)
class Where:
    """Exactly one of ``parts``, ``spread``, ``every`` is set.

    - ``parts``: each to its node, in order (the one carrying ids last);
    - ``spread``: any one of these nodes: this node first when it homes partitions,
      then the others (tried in turn, a failed or empty one skipped);
    - ``every``: all of these nodes.

    ``complete_at``: a Lease's complete_ids are completed at this node's first (a
    Complete), and the lease goes on without them.
    """

    parts: tuple[Part, ...] = ()
    spread: tuple[str, ...] = ()
    every: tuple[str, ...] = ()
    complete_at: str = ""


def where(entry: QueueEntry, here: str, live: Collection[str], method: str, request: Any, forwarded: bool) -> Where:
    """Where ``request`` (a ``method`` call about ``entry``'s queue) goes from node
    ``here``; ``live``: the live nodes; ``forwarded``: it came from another node, which
    already chose this one. Raises InvalidArgument or Unavailable for a call that cannot go anywhere."""
    # GetQueueStats is answered whatever: a primary that is down shows as its partitions
    # listed faulty (as a home that is down does), which operators read during a failover.
    if entry.shard and (forwarded or method != "GetQueueStats"):
        _check_primary(entry, here, live, forwarded)
    if method == "Produce":
        return _produce(entry, here, live, request, forwarded)
    if method == "Lease":
        return _lease(entry, here, live, request, forwarded)
    if method in HOME_CALLS:
        return _at_home(entry, here, live, request, forwarded)
    if method in EVERY_CALLS:
        return Where(parts=(Part(here),)) if forwarded else Where(every=tuple(entry.nodes()))
    raise ValueError(f"{method} is not a routed call")


def not_primary(node: str, epoch: int) -> str:
    """What a node that cannot serve or forward a replicated queue's call answers
    (UNAVAILABLE): clients match its start, re-read the map and go on."""
    return f"not primary: {node} epoch {epoch}"


def _check_primary(entry: QueueEntry, here: str, live: Collection[str], forwarded: bool) -> None:
    """A replicated queue is served by its primary alone (every partition's home): a
    call reaching another node is forwarded there, unless it was forwarded already (one
    hop) or the primary is down (a failover is due): then the caller hears which
    primary and epoch this node knows."""
    primary = entry.homes[0].node if entry.homes else ""
    if primary != here and (forwarded or primary not in live):
        raise Unavailable(f"{not_primary(primary, entry.epoch)} (queue {entry.config.name!r})")


def _spread(entry: QueueEntry, here: str, live: Collection[str]) -> Where:
    others = tuple(n for n in entry.nodes() if n != here and n in live)
    first = (here,) if any(h.node == here for h in entry.homes) else ()
    if not first and not others:
        raise Unavailable(f"queue {entry.config.name!r}: no live node homes any of its partitions")
    return Where(spread=first + others)


def _live_home(entry: QueueEntry, here: str, live: Collection[str], partition: int, why: str = "") -> str:
    """The node homing ``partition``; Unavailable naming it when it is down."""
    node = entry.home_of(partition).node
    if node != here and node not in live:
        raise Unavailable(
            f"{why}partition {partition} of queue {entry.config.name!r} lives on node {node!r}, "
            "which is down; its items are served again when it returns"
        )
    return node


def _key_home(entry: QueueEntry, here: str, live: Collection[str], key: str, what: str) -> str:
    return _live_home(entry, here, live, entry.key_partition(key), f"{what} {key!r}: ")


def _produce(entry: QueueEntry, here: str, live: Collection[str], request: Any, forwarded: bool) -> Where:
    if forwarded:
        return Where(parts=(Part(here),))
    # A group's items live in one partition: a request with group keys goes to its
    # first group's home (its node keeps each group in one partition of its own, by
    # the same rule: storage/ordered_groups.py); its other groups must live there too.
    group = next((item.group_key for item in request.items if item.group_key), "")
    if group:
        node = _key_home(entry, here, live, group, "group key")
        for index, item in enumerate(request.items):
            for what, key in (("group_key", item.group_key), ("idempotency_key", item.idempotency_key)):
                if key and entry.home_of_key(key).node != node:
                    raise InvalidArgument(
                        f"items[{index}].{what}",
                        f"{what.replace('_', ' ')} {key!r} lives on node {entry.home_of_key(key).node!r} and the "
                        f"request's first group {group!r} on node {node!r}: produce them in separate requests",
                    )
        return Where(parts=(Part(node),))
    # Dedup is exact at one home: a request with keys goes to its first key's.
    key = next((item.idempotency_key for item in request.items if item.idempotency_key), "")
    if key:
        return Where(parts=(Part(_key_home(entry, here, live, key, "idempotency key")),))
    return _spread(entry, here, live)


def _check_partition(entry: QueueEntry, partition: int, field: str) -> None:
    count = len(entry.homes)
    if not 0 <= partition < count:
        raise InvalidArgument(field, f"must be between 0 and {count - 1} (the queue has {count}), got {partition}")


def _home(entry: QueueEntry, here: str, live: Collection[str], partition: int, forwarded: bool) -> str:
    if forwarded and entry.home_of(partition).node != here:
        raise Unavailable(f"partition {partition} is not homed on node {here!r}")
    return _live_home(entry, here, live, partition)


def _lease(entry: QueueEntry, here: str, live: Collection[str], request: Any, forwarded: bool) -> Where:
    if forwarded:
        out = Where(parts=(Part(here),))
    elif request.lease_key:
        out = Where(parts=(Part(_key_home(entry, here, live, request.lease_key, "lease key")),))
    else:
        out = _spread(entry, here, live)
    if not request.complete_ids:
        return out
    _check_partition(entry, request.complete_partition, "complete_partition")
    node = _home(entry, here, live, request.complete_partition, forwarded)
    first = out.parts[0].node if out.parts else out.spread[0]
    # Completed in the lease call itself when the lease looks there first; a replicated
    # queue's lease and completion both go to its primary, in one forwarded call.
    if first == node and (first == here or entry.shard):
        return out
    return Where(out.parts, out.spread, complete_at=node)


def _at_home(entry: QueueEntry, here: str, live: Collection[str], request: Any, forwarded: bool) -> Where:
    keys = tuple(getattr(request, "lease_keys", ()))
    has_ids = bool(getattr(request, "ids", None) or getattr(request, "items", None)) or not keys
    if forwarded and not has_ids:  # the sender sent this node its keys
        return Where(parts=(Part(here, keys),))
    ids_node = ""
    if has_ids:
        _check_partition(entry, request.partition, "partition")
        ids_node = _home(entry, here, live, request.partition, forwarded)
        if forwarded:
            return Where(parts=(Part(here, keys, ids=True),))
    by_node: dict[str, list[str]] = {}
    for key in keys:
        by_node.setdefault(_key_home(entry, here, live, key, "lease key"), []).append(key)
    parts = [Part(node, tuple(k)) for node, k in by_node.items() if node != ids_node]
    if ids_node:
        parts.append(Part(ids_node, tuple(by_node.get(ids_node, ())), ids=True))
    return Where(parts=tuple(parts))
