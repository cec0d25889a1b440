"""Where each call goes in a cluster (sans-IO; the transports ask and do the I/O).

The map is read from ClusterInfo (members, each queue's partition homes, the catalog
revision); GetQueueStats counts say what waits on each node. The rules (docs/sdk.md,
"Clusters"):

- Produce goes to a live node homing partitions of the queue, weighted by how many it
  homes and against the items already waiting there per partition; the node spreads
  the batch over its own partitions.
- Lease goes to a node whose partitions have ready items, weighted by them; with none
  known it stays on one homing node until a Lease comes back empty, then moves on. A
  long Lease is sent in short slices so no consumer waits on an empty node while
  another holds ready items.
- A call with a key goes to the key's home: a Produce by its first item's idempotency
  key, a Lease by its lease key, a Complete or Extend by lease keys alone by its first
  key (that node sends the other keys to their homes). A key's home is
  ``homes[crc32(key) % key_partitions]`` (the partition count at creation: adding
  partitions never moves a key).
- Complete, Retry, Extend and the storage calls about one partition go to
  ``homes[partition]``: no hop. A Lease completing items goes to their home.
- The cases of testdata/routing/cases.json pin these rules, for the server and both
  clients alike (test_sdk_routing_table.py).
- A node that fails for want of the node is skipped for a backoff (0.5 s doubling to
  10 s), logged once when it goes down and once when it answers again.
"""

from __future__ import annotations

import logging
import random
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from ._operations import QUEUE, QUEUES, STORAGE, Call

log = logging.getLogger("querator.cluster")

DOWN_FIRST = 0.5
DOWN_CAP = 10.0
#: A queue's counts are asked at most this often while it is used.
STATS_EVERY = 1.0
#: A queue the cluster did not know is asked about again after this long.
ABSENT_RECHECK = 1.0
#: A ClusterInfo that failed (no node reachable) is asked again after this long.
INFO_RETRY = 1.0
#: The longest one slice of a Lease waits on one node when other nodes home the queue.
LEASE_SLICE = 1.0

# The calls about one partition: to its home.
_HOME = {"Complete", "Retry", "Extend", "ListItems", "ListScheduledItems", "ImportItems", "DeleteItems"}

# What a connection-level failure of gRPC says (the node went away or never answered),
# as opposed to UNAVAILABLE a server sent about a queue or partition.
_GONE = (
    "failed to connect",
    "connection refused",
    "connections to all backends failing",
    "socket closed",
    "connection reset",
    "broken pipe",
    "goaway",
    "stream removed",
    "keepalive",
    "shutting down",
    "connection attempt timed out",
    "dns resolution failed",
)
_NEVER_SENT = ("failed to connect", "connection refused", "connections to all backends failing")


# What a failure on a stream was, where no text of gRPC says it: set on the error by
# the streams (an attribute: exceptions take no weak references). A status a node
# answered on a stream has none: its text is read as a unary call's would be.
_ORIGIN = "_querator_origin"
#: A stream this process closed to take back an abandoned request: the node is there.
ABANDONED = "abandoned"
#: A stream closed because its node left the cluster: the node is gone.
LEFT = "left"
#: A stream that ended as it opened, before the request was written: it never left
#: this process, and the node is going away.
UNSENT = "unsent"
#: A stream whose connection broke under a write (gRPC then ends the call INTERNAL,
#: "Internal error from Core", its own status, not the node's): the node is gone, and
#: the requests written on it before have an unknown outcome.
BROKEN = "broken"

E = TypeVar("E", bound=BaseException)


def tagged(error: E, origin: str) -> E:
    setattr(error, _ORIGIN, origin)
    return error


def origin(error: BaseException) -> str:
    """ABANDONED, LEFT, UNSENT, BROKEN, or "" (a status: its text says)."""
    return str(getattr(error, _ORIGIN, ""))


def node_gone(error: BaseException) -> bool:
    """Whether an UNAVAILABLE says the node itself is gone, not something it answered."""
    kind = origin(error)
    if kind:
        return kind != ABANDONED
    text = _details(error)
    return any(marker in text for marker in _GONE)


def never_sent(error: BaseException) -> bool:
    """Whether the request never reached the node (safe to send elsewhere, whatever it is)."""
    kind = origin(error)
    if kind:
        return kind == UNSENT
    text = _details(error)
    return any(marker in text for marker in _NEVER_SENT)


#: How a node's answer (UNAVAILABLE) starts when it cannot serve or forward a call
#: about a replicated queue: another node is its primary, or is about to be (the
#: primary it knows is down). Nothing was done: read the map again and send it there.
NOT_PRIMARY = "not primary: "


def not_primary(error: BaseException) -> bool:
    """Whether an UNAVAILABLE says the node is not the queue's primary (nothing done)."""
    return NOT_PRIMARY in _details(error)


def _details(error: BaseException) -> str:
    cause = error.__cause__ if error.__cause__ is not None else error
    parts = [str(getattr(error, "message", "") or error)]
    if isinstance(cause, grpc.RpcError):
        parts.append(str(cause.details() or ""))
        debug = getattr(cause, "debug_error_string", None)
        if callable(debug):
            parts.append(str(debug()))
    return " ".join(parts).lower()


def key_partition(key: str, partitions: int) -> int:
    """A key's partition among ``partitions`` (a queue's key_partitions), as the server
    computes it: crc32 of the key's UTF-8 bytes."""
    return zlib.crc32(key.encode()) % partitions


@dataclass
class _Down:
    until: float
    delay: float


@dataclass
class _Load:
    partitions: int = 0
    ready: int = 0


@dataclass
class _QueueLoad:
    counted_at: float = -1e18
    counted: bool = False
    nodes: dict[str, _Load] = field(default_factory=dict)
    turn: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    """Where a call goes: ``node`` (its ``address``), or the default channel when empty."""

    node: str = ""
    address: str = ""
    queue: str = ""
    kind: str = ""  # "home", "produce", "lease" or "" (any node)


class ClusterMap:
    """The cluster as this client knows it. ``clustered``: None until the first answer."""

    def __init__(self, refresh: float) -> None:
        self.clustered: bool | None = None
        self.revision = -1
        self.refresh_every = refresh
        self.refreshed_at = -1e18
        self.info_failed_at = -1e18
        self._members: dict[str, tuple[str, bool]] = {}
        # queue -> (homes, the revision they are of, key_partitions)
        self._homes: dict[str, tuple[list[str], int, int]] = {}
        self._absent: dict[str, float] = {}
        self._down: dict[str, _Down] = {}
        self._queue_down: dict[tuple[str, str], _Down] = {}
        self._loads: dict[str, _QueueLoad] = {}

    # -- the map -----------------------------------------------------------------------

    def needs_info(self, now: float) -> bool:
        """Whether ClusterInfo should be asked before this call (first call, or the period)."""
        if self.clustered is False:
            return False
        if self.clustered is None:
            return now - self.info_failed_at >= INFO_RETRY
        return now - self.refreshed_at >= self.refresh_every

    def single(self) -> None:
        """The server has no ClusterService, or answered ``clustered=false``."""
        self.clustered = False

    def apply(self, answer: Any, asked: Sequence[str] | None, now: float) -> list[str]:
        """Take a ClusterInfoResponse; an older view than the one held is ignored.
        Returns the addresses no longer members (their channels can close)."""
        if not answer.clustered:
            self.single()
            return []
        self.clustered = True
        if asked is None:
            self.refreshed_at = now
        gone: list[str] = []
        if answer.revision >= self.revision:
            self.revision = answer.revision
            before = {address for address, _ in self._members.values()}
            self._members = {m.node_id: (m.address, m.live) for m in answer.members}
            after = {address for address, _ in self._members.values()}
            gone = sorted(before - after)
        seen = set()
        for placement in answer.queues:
            seen.add(placement.queue_name)
            self._absent.pop(placement.queue_name, None)
            held = self._homes.get(placement.queue_name)
            if held is None or held[1] <= answer.revision:
                span = placement.key_partitions or len(placement.homes)  # 0: a server before the field
                self._homes[placement.queue_name] = (list(placement.homes), answer.revision, span)
        for name in list(asked if asked is not None else self._homes):
            held = self._homes.get(name)
            if name in seen or (held is not None and held[1] > answer.revision):
                continue
            self._homes.pop(name, None)
            self._loads.pop(name, None)
            self._absent[name] = now
        return gone

    def needs_lookup(self, queue: str, now: float) -> bool:
        if not self.clustered or not queue or queue in self._homes:
            return False
        checked = self._absent.get(queue)
        return checked is None or now - checked >= ABSENT_RECHECK

    def homes(self, queue: str) -> list[str]:
        held = self._homes.get(queue)
        return held[0] if held else []

    def home_of(self, queue: str, partition: int) -> str:
        """The node homing ``partition`` of ``queue`` ('' when the map does not know it)."""
        homes = self.homes(queue)
        return homes[partition] if 0 <= partition < len(homes) else ""

    def home_of_key(self, queue: str, key: str) -> str:
        """The node homing ``key``'s partition ('' when the map does not know the queue)."""
        held = self._homes.get(queue)
        if not held or not held[0]:
            return ""
        return held[0][key_partition(key, held[2])]

    def address(self, node: str) -> str:
        """The address of a live member ('' when unknown or not live)."""
        address, live = self._members.get(node, ("", False))
        return address if live else ""

    def node_at(self, address: str) -> str:
        for node, (at, _) in self._members.items():
            if at == address:
                return node
        return ""

    def live_addresses(self, now: float) -> list[str]:
        """Live members, those not down first: where ClusterInfo and the like are asked."""
        up = [a for n, (a, live) in self._members.items() if live and a and not self.is_down(n, now)]
        down = [a for n, (a, live) in self._members.items() if live and a and self.is_down(n, now)]
        return up + down

    # -- nodes that fail -------------------------------------------------------------------

    def is_down(self, node: str, now: float) -> bool:
        down = self._down.get(node)
        return down is not None and now < down.until

    def mark_down(self, node: str, now: float, reason: str) -> None:
        down = self._down.get(node)
        if down is None:
            self._down[node] = _Down(now + DOWN_FIRST, DOWN_FIRST)
            log.warning("querator node %s is down (%s); its partitions are skipped until it answers", node, reason)
        elif now >= down.until:
            delay = min(down.delay * 2, DOWN_CAP)
            self._down[node] = _Down(now + delay, delay)

    def mark_queue_down(self, queue: str, node: str, now: float) -> None:
        """``node`` answered UNAVAILABLE about ``queue`` (its storage failing, its
        partitions faulty): leave it out of that queue's Produce and Lease for a backoff,
        while another node homes the queue; the node itself is not marked down."""
        down = self._queue_down.get((queue, node))
        delay = DOWN_FIRST if down is None else min(down.delay * 2, DOWN_CAP) if now >= down.until else down.delay
        self._queue_down[(queue, node)] = _Down(now + delay, delay)

    def mark_up(self, node: str) -> None:
        if self._down.pop(node, None) is not None:
            log.warning("querator node %s answers again", node)

    def _usable(self, node: str, now: float) -> bool:
        return bool(self.address(node)) and not self.is_down(node, now)

    # -- counts -------------------------------------------------------------------------

    def stats_due(self, queue: str, now: float) -> bool:
        load = self._loads.get(queue)
        return load is None or now - load.counted_at >= STATS_EVERY

    def stats_asked(self, queue: str, now: float) -> None:
        self._loads.setdefault(queue, _QueueLoad()).counted_at = now

    def counted(self, queue: str) -> bool:
        load = self._loads.get(queue)
        return load is not None and load.counted

    def apply_stats(self, queue: str, partitions: Iterable[tuple[int, int]]) -> None:
        """Ready items per (cluster-wide) partition, summed per home."""
        homes = self.homes(queue)
        load = self._loads.setdefault(queue, _QueueLoad())
        nodes: dict[str, _Load] = {}
        for node in homes:
            nodes.setdefault(node, _Load()).partitions += 1
        for partition, ready in partitions:
            if 0 <= partition < len(homes):
                nodes[homes[partition]].ready += max(0, ready)
        load.nodes = nodes
        load.counted = True

    def _homing(self, queue: str, now: float) -> dict[str, int]:
        out: dict[str, int] = {}
        for node in self.homes(queue):
            if self._usable(node, now):
                out[node] = out.get(node, 0) + 1
        for node in list(out) if self._queue_down else ():
            down = self._queue_down.get((queue, node))
            if down is not None and now < down.until and len(out) > 1:
                del out[node]
        return out

    # -- choosing nodes ----------------------------------------------------------------------

    def produce_node(self, queue: str, now: float, rnd: float | None = None) -> str:
        homing = self._homing(queue, now)
        if not homing:
            return ""
        load = self._loads.get(queue)
        weights = []
        for node, partitions in homing.items():
            waiting = load.nodes[node].ready if load is not None and node in load.nodes else 0
            # Fewer waiting per partition: more weight (squared, so the emptiest fills first).
            weights.append((node, partitions / (1.0 + waiting / partitions) ** 2))
        return _pick(weights, random.random() if rnd is None else rnd)

    def produced(self, queue: str, node: str, count: int) -> None:
        load = self._loads.get(queue)
        if load is not None and node in load.nodes:
            load.nodes[node].ready += count

    def lease_node(self, queue: str, now: float, rnd: float | None = None) -> str:
        homing = self._homing(queue, now)
        if not homing:
            return ""
        load = self._loads.get(queue)
        ready = [(n, float(load.nodes[n].ready)) for n in homing if load is not None and n in load.nodes]
        chosen = _pick(ready, random.random() if rnd is None else rnd)
        if chosen:
            return chosen
        nodes = sorted(homing)
        turn = load.turn if load is not None else 0
        return nodes[turn % len(nodes)]

    def leased(self, queue: str, node: str, count: int) -> None:
        """A Lease from ``node`` took ``count`` items (0: none there, move on)."""
        load = self._loads.setdefault(queue, _QueueLoad())
        if node in load.nodes:
            load.nodes[node].ready = max(0, load.nodes[node].ready - count) if count else 0
        if not count:
            load.turn += 1

    def spread(self, queue: str, now: float) -> int:
        """How many usable nodes home partitions of ``queue``."""
        return len(self._homing(queue, now))

    def route(self, call: Call, now: float) -> Route:
        """Where ``call`` goes (an empty Route: the default channel, any node)."""
        if not self.clustered or call.service not in (QUEUE, QUEUES, STORAGE):
            return Route()
        request: Any = call.request
        queue = getattr(request, "queue_name", "")
        method = call.method
        if call.service == QUEUE and method == "Produce":
            # A group lives at its key's home (the server refuses groups of two homes).
            key = next((item.group_key for item in request.items if item.group_key), "")
            key = key or next((item.idempotency_key for item in request.items if item.idempotency_key), "")
            if key:  # dedup is exact at the key's one home
                return self._to(queue, self.home_of_key(queue, key), "home")
            node = self.produce_node(queue, now)
            return Route(node, self.address(node), queue, "produce") if node else Route(queue=queue)
        if call.service == QUEUE and method == "Lease":
            if request.lease_key:
                return self._to(queue, self.home_of_key(queue, request.lease_key), "home")
            if request.complete_ids:
                # To the completed items' home; a "lease" route still, so a long one is
                # sliced and moves on (without the completions) when that node is empty.
                return self._to(queue, self.home_of(queue, request.complete_partition), "lease")
            node = self.lease_node(queue, now)
            return Route(node, self.address(node), queue, "lease") if node else Route(queue=queue)
        if method in _HOME and call.service != QUEUES:
            keys = list(getattr(request, "lease_keys", ()))
            if keys and not (getattr(request, "ids", None) or getattr(request, "items", None)):
                return self._to(queue, self.home_of_key(queue, keys[0]), "home")
            return self._to(queue, self.home_of(queue, request.partition), "home")
        return Route()

    def _to(self, queue: str, node: str, kind: str) -> Route:
        """To ``node`` (its address empty while it is down: the default channel then
        carries the call and a node answers why); '' (not known): any node."""
        return Route(node, self.address(node), queue, kind) if node else Route()


def _pick(entries: list[tuple[str, float]], point: float) -> str:
    total = sum(weight for _, weight in entries)
    if total <= 0:
        return ""
    point *= total
    for value, weight in entries:
        point -= weight
        if point < 0:
            return value
    return entries[-1][0]
