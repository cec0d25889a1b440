"""What one cycle of the actor applies: the requests it took from its inbox, sorted by
kind, and the order it applies them in one transaction (``cycle_body``).

Produces first, then leases (completing what they name first), then client acks
(before the lifecycle: a Complete or Retry that arrives after the lease deadline but
before the re-queue still succeeds), then the other requests, the lifecycle, and the
probes of faulty partitions; items that became ready meanwhile go to leases that found
nothing, without waiting a cycle.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import lmdb

from ..clock import now_us
from ..model import QueueConfig
from ..storage import QueueStore
from .cycle import Cycle
from .requests import (
    ClearRequest,
    CompleteRequest,
    DeadLetterRequest,
    DeleteItemsRequest,
    ExtendRequest,
    GiveBackRequest,
    ImportItemsRequest,
    LeaseRequest,
    ListItemsRequest,
    OutboxDoneRequest,
    ProduceRequest,
    RedriveDoneRequest,
    RedriveInRequest,
    RedriveRequest,
    Request,
    RetryRequest,
)
from .transaction import Body


@dataclass(eq=False, slots=True)
class Reconfigure(Request):
    """New settings for the actor (applied between cycles)."""

    config: QueueConfig
    # Moving out of the commit group: copies the queue's storage into an environment
    # of its own (on the group's lane), then ``persist`` records the move.
    move_out: Callable[[QueueStore], QueueStore] | None = None
    persist: Callable[[], Awaitable[None]] | None = None


@dataclass(eq=False, slots=True)
class DeleteQueue(Request):
    """Stop the actor for good (after the cycle it comes with)."""

    force: bool


# The requests that store new items (the first to fail on a full disk or map).
_ADDING = (ImportItemsRequest, DeadLetterRequest, RedriveInRequest)

# Each step takes (cycle, txn, request=...).
_ACK: dict[type, Callable[..., None]] = {
    CompleteRequest: Cycle.complete,
    RetryRequest: Cycle.retry,
    ExtendRequest: Cycle.extend,
}

_OTHER: dict[type, Callable[..., None]] = {
    ListItemsRequest: Cycle.list_items,
    ImportItemsRequest: Cycle.import_items,
    DeleteItemsRequest: Cycle.delete_items,
    ClearRequest: Cycle.clear,
    DeadLetterRequest: Cycle.receive_dead_letters,
    OutboxDoneRequest: Cycle.outbox_done,
    GiveBackRequest: Cycle.give_back,
    RedriveRequest: Cycle.redrive,
    RedriveInRequest: Cycle.receive_redriven,
    RedriveDoneRequest: Cycle.redrive_done,
}


@dataclass(slots=True)
class Batch:
    produces: list[ProduceRequest] = field(default_factory=list)
    leases: list[LeaseRequest] = field(default_factory=list)
    acks: list[Request] = field(default_factory=list)
    others: list[Request] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.produces) + len(self.leases) + len(self.acks) + len(self.others)

    def adds_items(self) -> bool:
        return bool(self.produces) or any(isinstance(r, _ADDING) for r in self.others)

    def split_adding(self) -> tuple[list[Request], Batch]:
        """The requests that add items, and a batch of the others."""
        adding: list[Request] = list(self.produces)
        others: list[Request] = []
        for request in self.others:
            (adding if isinstance(request, _ADDING) else others).append(request)
        return adding, Batch(leases=self.leases, acks=self.acks, others=others)

    def only_listings(self, lifecycle: bool) -> bool:
        """Whether the cycle only lists items (a read transaction does)."""
        return (
            not lifecycle
            and not (self.produces or self.leases or self.acks)
            and all(isinstance(r, ListItemsRequest) for r in self.others)
        )


@dataclass(frozen=True, slots=True)
class CycleWork:
    """What a cycle does beyond its requests."""

    lifecycle: bool
    expired: list[tuple[int, int, int]]  # lease deadlines due: (deadline, partition, seq)
    forget_keys: bool  # idempotency or lease keys are due to be forgotten
    probes: list[int]  # faulty partitions to read again
    touch: bool  # write something, so the commit proves a failing storage works again
    forget_done: bool = False  # records of completed items are due to be forgotten


def cycle_body(batch: Batch, new_cycle: Callable[[], Cycle], work: CycleWork) -> Body:
    """The transaction body of one cycle: ``batch`` and ``work`` applied to a new Cycle."""

    def body(txn: lmdb.Transaction[bytes]) -> Cycle:
        cycle = new_cycle()
        for produce in batch.produces:
            cycle.apply(txn, produce, partial(cycle.produce, request=produce))
        leases = batch.leases
        if any(lease.complete_ids for lease in leases):
            leases = cycle.complete_before_lease(txn, leases)
        if leases:
            cycle.lease(txn, leases)
        for request in batch.acks:
            cycle.apply(txn, request, partial(_ACK[type(request)], cycle, request=request))
        for request in batch.others:
            cycle.apply(txn, request, partial(_OTHER[type(request)], cycle, request=request))
        if work.lifecycle:
            cycle.apply(
                txn,
                None,
                partial(
                    cycle.lifecycle, expired_leases=work.expired, forget_keys=work.forget_keys, forget_done=work.forget_done
                ),
            )
        for p in work.probes:
            cycle.probe(txn, p)
        if cycle.unserved and cycle.ready_total():
            waiting, cycle.unserved = cycle.unserved, []
            cycle.lease(txn, waiting)
        cycle.fence_leases(txn, now_us())
        if work.touch and not cycle.views:
            cycle.touch(txn)
        cycle.finish(txn)
        return cycle

    return body
