"""The SDK's values: plain dataclasses in and out, no protobuf in sight."""

from __future__ import annotations

import json as _json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar

if TYPE_CHECKING:
    from ._convert import Seconds

T = TypeVar("T")

Payload = bytes | bytearray | memoryview | str


class DeadReason(StrEnum):
    """Why an item was moved to a dead-letter queue (``dead_reason`` of a dead letter)."""

    #: Its lease ran out, or a lease found it, with the queue's max_attempts reached.
    MAX_ATTEMPTS = "max_attempts"
    #: Its expire_timeout passed.
    EXPIRED = "expired"
    #: A consumer gave it up: ``item.dead()`` / Retry with ``dead``.
    RETRY_DEAD = "retry_dead"


@dataclass(frozen=True, slots=True)
class Item:
    """An item to produce. A ``str`` payload is stored as UTF-8.

    ``enqueue_at`` (timezone-aware) at least 100 ms in the future schedules the item:
    it becomes leasable at that time. ``idempotency_key`` (at most 512 bytes) makes the
    produce idempotent: a second item with the same key in the same queue within the
    queue's ``dedup_window`` stores nothing and gets the first item's id.

    ``metadata``: string pairs handed to whoever leases the item (``LeasedItem.metadata``),
    e.g. trace context; at most 64 pairs and 16 KB in all, keys 1 to 256 characters.

    ``group_key`` (at most 512 bytes; not with ``enqueue_at``) puts the item in an ordered
    group: the items of a group are leased one at a time, in the order they were produced
    (the next only once the one before is completed, dead-lettered or deleted). Grouped
    items of one request must belong to one partition: a ``Producer`` batches each group
    apart and keeps a group's batches in order.

    ``priority``: 0 (the default) to 9. A lease takes the ready items of a partition
    highest priority first, FIFO within a priority. No aging: lower priorities wait
    while higher ones are ready. Outside 0 to 9 the server answers INVALID_ARGUMENT
    (``items[i].priority``).
    """

    payload: Payload
    encoding: str = ""
    kind: str = ""
    reference: str = ""
    enqueue_at: datetime | None = None
    idempotency_key: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict, hash=False)
    group_key: str = ""
    priority: int = 0

    def __post_init__(self) -> None:
        if self.metadata:
            object.__setattr__(self, "metadata", dict(self.metadata))

    @classmethod
    def from_json(cls, value: Any, **options: Any) -> Item:
        """An item whose payload is ``value`` as JSON, with ``encoding="application/json"``."""
        options.setdefault("encoding", "application/json")
        return cls(_json.dumps(value, separators=(",", ":")).encode(), **options)


@dataclass(frozen=True, slots=True)
class ProduceResult:
    """The ids of produced items, in the order given, and the partition each went to.

    ``duplicates`` counts the items whose ``idempotency_key`` had been seen before: they
    stored nothing, and their id is the first item's.
    """

    ids: list[str] = field(default_factory=list)
    partitions: list[int] = field(default_factory=list)
    duplicates: int = 0

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self.ids)


@dataclass(frozen=True, slots=True)
class ItemRef:
    """Names a leased item: what Complete, Retry and Extend need.

    Lease results (:class:`LeasedItem`) carry the same three fields and can be passed
    wherever an ``ItemRef`` is accepted.
    """

    queue_name: str
    partition: int
    id: str


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A queue's settings. ``partitions`` is the contract's ``requested_partitions``.

    ``dedup_window``: how long a produced item's ``idempotency_key`` is remembered;
    ``lease_key_ttl``: how long a Lease's ``lease_key`` is remembered (unless all of its
    items are completed first). ``failure``: why the server does not serve the queue
    (its storage could not be loaded, or kept failing; every call on it then raises
    ``Unavailable``); empty while it serves. ``paused``: the queue hands out no items
    (leases wait) until resumed; ``produce_paused``: produce is refused too
    (:meth:`~querator.Client.pause_queue`).
    """

    name: str
    dead_queue: str = ""
    reference: str = ""
    lease_timeout: timedelta = timedelta(minutes=1)
    expire_timeout: timedelta = timedelta(hours=24)
    max_attempts: int = 0
    partitions: int = 1
    created_at: datetime | None = None
    updated_at: datetime | None = None
    dedup_window: timedelta = timedelta(hours=24)
    lease_key_ttl: timedelta = timedelta(hours=1)
    failure: str = ""
    paused: bool = False
    produce_paused: bool = False


class QueueSettings(TypedDict, total=False):
    """The settings of a queue that ``create_queue`` and ``update_queue`` take; None or
    absent: the server's default (create) or unchanged (update)."""

    dead_queue: str | None
    reference: str | None
    lease_timeout: Seconds | None
    expire_timeout: Seconds | None
    max_attempts: int | None
    partitions: int | None
    dedup_window: Seconds | None
    lease_key_ttl: Seconds | None


#: The names of :class:`QueueSettings`, in the order the command line and docs show them.
QUEUE_SETTINGS: tuple[str, ...] = tuple(QueueSettings.__annotations__)


@dataclass(frozen=True, slots=True)
class PartitionStats:
    """One partition's counts. ``total`` is ready plus leased; scheduled items are apart.

    ``failure``: why the partition is faulty, since ``faulty_since``; empty and None while
    it serves. Faulty: its storage failed (calls it cannot apply raise ``Unavailable``
    until the server finds it working again), or, in a cluster, its node is down (its
    counts are then 0: unknown, not empty). Its items are kept and come back with it.
    """

    partition: int
    total: int
    total_leased: int
    scheduled: int
    average_age: timedelta
    average_leased_age: timedelta
    failure: str = ""
    faulty_since: datetime | None = None
    #: Items produced into and completed in the partition since the server loaded the
    #: queue: counters (0 at the server's start) whose growth over time is the rate.
    produced: int = 0
    completed: int = 0
    #: Ordered groups whose first item is leased now, and how long the item that has
    #: waited longest behind the first of its group has been in the queue (None: none
    #: waits). Items waiting so are counted in ``total`` (and so in ``ready``).
    groups_in_flight: int = 0
    oldest_waiting_in_group: timedelta | None = None

    @property
    def ready(self) -> int:
        return self.total - self.total_leased

    @property
    def faulty(self) -> bool:
        return bool(self.failure)


@dataclass(frozen=True, slots=True)
class QueueStats:
    """A queue's counts now, per partition and summed."""

    queue_name: str
    partitions: list[PartitionStats]
    lease_waiting: int = 0
    produce_waiting: int = 0
    in_flight: int = 0

    @property
    def total(self) -> int:
        """Ready plus leased items in every partition (scheduled ones not counted)."""
        return sum(p.total for p in self.partitions)

    @property
    def total_leased(self) -> int:
        return sum(p.total_leased for p in self.partitions)

    @property
    def ready(self) -> int:
        return sum(p.ready for p in self.partitions)

    @property
    def scheduled(self) -> int:
        return sum(p.scheduled for p in self.partitions)


@dataclass(frozen=True, slots=True)
class StoredItem:
    """An item as StorageService stores it. Build one to import items (``id`` is ignored)."""

    payload: bytes = b""
    id: str = ""
    partition: int = 0
    is_leased: bool = False
    lease_deadline: datetime | None = None
    expire_deadline: datetime | None = None
    enqueue_at: datetime | None = None
    created_at: datetime | None = None
    attempts: int = 0
    reference: str = ""
    encoding: str = ""
    kind: str = ""
    source_id: str = ""
    #: String pairs given at produce (e.g. trace context), kept by import.
    metadata: Mapping[str, str] = field(default_factory=dict, hash=False)
    #: The item's stable id: the id it was produced with, kept when it is re-queued,
    #: scheduled again, dead-lettered or redriven (``id`` changes each time).
    message_id: str = ""
    #: Dead letters only: why the item died, when, and after how many attempts in the
    #: queue it died in (``attempts`` counts the leases in the queue that holds it now).
    dead_reason: DeadReason | None = None
    dead_at: datetime | None = None
    dead_attempts: int = 0
    #: What went wrong the last time the item failed (a Retry's ``error``, or "lease
    #: expired after N attempts"), at most 2,048 bytes, and when; for a dead letter,
    #: the error that killed it. Empty / None when it never failed with a text.
    last_error: str = ""
    last_error_at: datetime | None = None
    #: The item's ordered group (``Item.group_key``); "" for none. Not imported.
    group_key: str = ""
    #: 0 to 9, as given at produce (``Item.priority``); import keeps it.
    priority: int = 0

    def __post_init__(self) -> None:
        if self.metadata:
            object.__setattr__(self, "metadata", dict(self.metadata))


@dataclass(frozen=True, slots=True)
class RedriveResult:
    """What :meth:`~querator.Client.redrive_items` did: how many items it moved, their
    message ids, and how many matching items stayed (their source queue is gone)."""

    moved: int = 0
    message_ids: tuple[str, ...] = ()
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class CompleteResult:
    """What :meth:`~querator.Client.complete` returns.

    ``already_completed``: the ids (as sent) that an earlier send of the same request
    had completed already. Empty on a first send; not empty when the client sent the
    request again after a lost answer (UNAVAILABLE, ``retry_complete``): those items
    are done, not lost. ``key_items_completed``: how many items ``lease_keys``
    completed (0 when every key was done or forgotten already).
    """

    already_completed: tuple[str, ...] = ()
    key_items_completed: int = 0


class RetryResult(list[str]):
    """What :meth:`~querator.Client.retry` returns: the ids dead-lettered (a list, empty
    when every item went back).

    ``already_retried`` adds the ids (as sent) that an earlier send of the same request
    had retried already (the client sent it again after a lost answer): they were not
    retried twice. Those the first send dead-lettered are in the list too.
    """

    already_retried: tuple[str, ...] = ()


class ExtendResult(list[datetime]):
    """What :meth:`~querator.Client.extend` returns: the new deadline of each item, in order.

    A list; ``key_items_extended`` adds how many items were extended through ``lease_keys``.
    """

    key_items_extended: int = 0


#: The roles of an API key: what it may do on the queues its patterns match.
ROLES = ("producer", "consumer", "admin")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """An API key as the server describes it (never its token).

    ``role`` is ``"producer"`` (Produce, plus reading queue settings and stats),
    ``"consumer"`` (Lease, Complete, Retry, Extend, plus the same reads) or ``"admin"``
    (every call on its queues; with the pattern ``"*"`` also the key calls). ``queues``
    are shell-style name patterns (``"orders*"``).
    """

    key_id: str
    role: str
    queues: list[str] = field(default_factory=list)
    description: str = ""
    created_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class SetAsideQueue:
    """A queue a cluster node set aside: it held items but no longer matched the
    catalog's queue of its name, so it is not served; its items stay on ``node_id``'s
    disk until removed (docs/cluster.md, "Queues set aside"). ``items`` is -1 when
    unknown (its storage had failed)."""

    node_id: str
    set_aside_id: str
    queue_name: str
    items: int
    reason: str
    set_aside_at: datetime | None
    partitions: int


@dataclass(frozen=True, slots=True)
class SetAsideQueues:
    """Set-aside queues, and the live nodes that did not answer (not listed)."""

    queues: list[SetAsideQueue]
    unanswered_nodes: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class CreatedKey:
    """A new key and its token: send the token as ``bearer_token``. Shown only once."""

    key: ApiKey
    token: str = field(repr=False)

    @property
    def key_id(self) -> str:
        return self.key.key_id


@dataclass(frozen=True, slots=True)
class ClusterMember:
    """A node of a cluster as ClusterInfo describes it.

    ``fenced``: the node cannot renew its membership, so it refuses admin changes while it
    goes on serving data; known for the node that answered, and for the others only when
    asked with ``check_members`` (``check_error`` then says why a live node could not be
    asked).
    """

    node_id: str
    address: str
    live: bool
    fenced: bool = False
    check_error: str = ""


@dataclass(frozen=True, slots=True)
class ReplicaSet:
    """Where a replicated queue (replicas > 1) is kept: ``primary`` serves every
    partition under ``epoch`` (it grows by one with each election); ``replicas``, every
    copy's node, the primary included; ``in_sync``, the copies every acknowledged change
    is durable on; writes need at least ``min_in_sync`` of them. ``failover_blocked``:
    why no live copy can take over from a primary that is not live (asked with
    ``cluster_info(check_members=True)``; empty otherwise). ``moving_from`` and
    ``moving_to``: a move of a copy under way, the node whose copy leaves and the node
    of the copy taking its place (empty when none)."""

    primary: str
    epoch: int
    replicas: list[str] = field(default_factory=list)
    in_sync: list[str] = field(default_factory=list)
    min_in_sync: int = 0
    failover_blocked: str = ""
    moving_from: str = ""
    moving_to: str = ""


@dataclass(frozen=True, slots=True)
class PromotedCopy:
    """A copy out of the in-sync set that a retire made its queue's primary
    (``retire_node(..., promote_copies_behind=True)``): every change acknowledged after
    its position (``epoch``, ``lsn``) is lost; ``new_epoch`` is the queue's epoch since."""

    queue_name: str
    node_id: str
    epoch: int
    lsn: int
    new_epoch: int


@dataclass(frozen=True, slots=True)
class RetiredNode:
    """What retiring a node did: partitions recreated empty (those of queues of one
    copy, and every partition of a replicated queue re-made empty because no live node
    kept a copy), copies of replicated queues made again from the others, and copies
    promoted although behind."""

    partitions_recreated: int
    copies_recreated: int = 0
    copies_promoted: list[PromotedCopy] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ClusterView:
    """A node's view of its cluster at catalog ``revision`` (a single server: one member,
    ``clustered`` false). ``homes[queue][p]`` is the node id homing partition ``p``."""

    clustered: bool
    node_id: str
    revision: int
    members: list[ClusterMember] = field(default_factory=list)
    homes: dict[str, list[str]] = field(default_factory=dict)
    admin_writable: bool = True
    #: The replicated queues' copies, by queue (a queue of one copy is not listed).
    replicated: dict[str, ReplicaSet] = field(default_factory=dict)

    def partitions_of(self, node_id: str) -> int:
        """How many partitions, over the queues in the view, ``node_id`` homes."""
        return sum(homes.count(node_id) for homes in self.homes.values())


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a listing; ``next_page_token`` is empty on the last page."""

    items: list[T]
    next_page_token: str = ""
