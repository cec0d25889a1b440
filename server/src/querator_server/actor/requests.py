"""Requests that gRPC handlers hand to a logical queue, and what they get back.

Each request carries an asyncio future that the actor resolves after the cycle that
applied it has committed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from ..model import REPLY_ITEMS_BYTES, ImportedItem, NewItem, RetryOrder
from ..storage import Item


@dataclass(slots=True)
class StoredItem:
    item_id: str
    item: Item


@dataclass(eq=False, slots=True)
class Request:
    future: asyncio.Future[object] = field(init=False, repr=False)
    # Wall-clock deadline in µs after which applying the request is pointless; 0: none.
    deadline_us: int = field(default=0, kw_only=True)
    # Fail this request's apply step on purpose (reliability tests, faults.py).
    fault: bool = field(default=False, kw_only=True, repr=False)


@dataclass(eq=False, slots=True)
class ProduceRequest(Request):
    items: list[NewItem]
    # The compact form: items that are only a payload (``items`` is then empty).
    payloads: list[bytes] = field(default_factory=list)


class ReplyRoom(Protocol):
    """Bytes of answers that may still be made before earlier ones are sent."""

    def room(self) -> int: ...

    def take(self, size: int) -> None: ...


@dataclass(eq=False, slots=True)
class LeaseRequest(Request):
    batch_size: int
    client_id: str
    # Until when to wait for items when none are ready (wall µs).
    wait_until_us: int
    # Items of an earlier lease to complete first (all-or-nothing), and their
    # partition; emptied by the actor once the completion has committed.
    complete_ids: list[str] = field(default_factory=list)
    complete_partition: int = 0
    # An idempotent lease: a repeated key returns the items taken under it.
    lease_key: str = ""
    # What the leased items may add up to (records and their reply overhead, see
    # model.py), and the room left to send them, shared with other leases (a stream's).
    max_bytes: int = REPLY_ITEMS_BYTES
    room: ReplyRoom | None = None
    # What the lease's cycles took from ``room`` (a cycle run twice takes twice): the
    # caller settles it against the answer it actually built.
    charged: int = 0


@dataclass(eq=False, slots=True)
class GiveBackRequest(Request):
    """Items leased for an answer that was never delivered (its stream was ended):
    back to ready with the attempt their lease took given back. Only items still under
    that lease (same deadline, no lease key) change. Items whose ids the caller may have
    seen (``reached``: the answer was being sent) get new ids at the tail, so the old
    ones fence; the others keep their id and place."""

    partition: int
    ids: list[str]
    lease_deadline_us: int
    reached: bool = False


@dataclass(eq=False, slots=True)
class CompleteRequest(Request):
    partition: int
    ids: list[str]
    lease_keys: list[str] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class RetryRequest(Request):
    partition: int
    orders: list[RetryOrder]


@dataclass(eq=False, slots=True)
class ExtendRequest(Request):
    partition: int
    ids: list[str]
    lease_timeout_us: int
    lease_keys: list[str] = field(default_factory=list)


@dataclass(eq=False, slots=True)
class ListItemsRequest(Request):
    partition: int
    limit: int
    after: tuple[int, int]  # (seq, 0) for items, (due, seq) for scheduled ones
    scheduled: bool


@dataclass(eq=False, slots=True)
class ImportItemsRequest(Request):
    partition: int
    items: list[ImportedItem]


@dataclass(eq=False, slots=True)
class DeleteItemsRequest(Request):
    partition: int
    ids: list[str]


@dataclass(eq=False, slots=True)
class ClearRequest(Request):
    ready: bool
    scheduled: bool
    destructive: bool


@dataclass(eq=False, slots=True)
class DeadLetterRequest(Request):
    """Items another queue dead-lettered into this one (each with its source_id)."""

    items: list[Item]


@dataclass(eq=False, slots=True)
class OutboxDoneRequest(Request):
    """Outbox entries the dead-letter queue has durably stored: (partition, seq)."""

    entries: list[tuple[int, int]]


@dataclass(eq=False, slots=True)
class RedriveRequest(Request):
    """Move up to ``limit`` ready items out of this queue (RedriveItems).

    ``targets`` maps the uid of each queue an item may go to onto that queue: the
    uid of an item's source queue (from its source_id) for a redrive to the sources,
    or, with ``target_uid``, that one queue for every item. ``own`` maps the uids of
    the queues an item may go to only when its source_id starts with ``own_prefix``
    (a cluster node's one-copy queues, named so in a replicated dead-letter queue).
    """

    targets: dict[int, str]
    limit: int
    after: tuple[int, int]  # (partition, seq): go on after this item
    kind: str = ""
    dead_reason: int = 0
    target_uid: int = 0
    own_prefix: str = ""
    own: dict[int, str] = field(default_factory=dict)


@dataclass(slots=True)
class RedriveResult:
    message_ids: list[str]
    # (partition, seq) of each moved item's redrive outbox entry.
    entries: list[tuple[int, int]]
    skipped: int
    next_after: tuple[int, int] | None
    # Set once every moved item is stored by its target (or back here) and gone from
    # the redrive outbox; None when nothing moved.
    delivered: asyncio.Future[None] | None = None


@dataclass(eq=False, slots=True)
class RedriveInRequest(Request):
    """Items another queue redrives into this one (each with its source_id there)."""

    items: list[Item]


@dataclass(eq=False, slots=True)
class RedriveDoneRequest(Request):
    """Redrive outbox entries the target queue has durably stored, or, with
    ``restore``, that go back into this queue (their target is gone)."""

    entries: list[tuple[int, int]]
    restore: bool = False


@dataclass(slots=True)
class LeaseResult:
    """What a lease took, oldest first, as parallel lists: entry i of each is item i's.

    Columns, not an object per item: the lease path fills them from the record's header
    and the columnar reply takes them as they are.
    """

    partition: int
    ids: list[str] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    lease_deadlines: list[int] = field(default_factory=list)
    created_at: list[int] = field(default_factory=list)
    # The items that carry more than a payload (encoding, kind, reference, metadata, a
    # source id or a history), by index.
    details: dict[int, Item] = field(default_factory=dict)
    # Empty when every item has priority 0, else each item's priority.
    priorities: list[int] = field(default_factory=list)
    # Nothing leased because the lease's ReplyRoom was used up.
    no_room: bool = False

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, item_id: str, item: Item) -> None:
        if (
            item.encoding
            or item.kind
            or item.reference
            or item.metadata
            or item.source_id
            or item.message_id
            or item.last_error
            or item.group_key
        ):
            self.details[len(self.ids)] = item
        if item.priority or self.priorities:
            if not self.priorities:
                self.priorities = [0] * len(self.ids)
            self.priorities.append(item.priority)
        self.ids.append(item_id)
        self.payloads.append(item.payload)
        self.attempts.append(item.attempts)
        self.lease_deadlines.append(item.lease_deadline)
        self.created_at.append(item.created_at)


@dataclass(slots=True)
class ProduceResult:
    partition: int
    ids: list[str]
    duplicates: int = 0


@dataclass(slots=True)
class CompleteResult:
    # The ids (as sent) completed by an earlier request: this one was sent again.
    already_completed: list[str]
    key_items_completed: int = 0


@dataclass(slots=True)
class RetryResult:
    dead_ids: list[str]
    # The ids (as sent) retried by an earlier request under the same lease.
    already_retried: list[str] = field(default_factory=list)


@dataclass(slots=True)
class ExtendResult:
    deadlines: list[int]
    key_items_extended: int = 0


@dataclass(slots=True)
class PageResult:
    items: list[StoredItem]
    next_after: tuple[int, int] | None
    # Where a page cut after item i goes on: the cursor of each item.
    cursors: list[tuple[int, int]] = field(default_factory=list)
