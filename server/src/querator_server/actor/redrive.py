"""Redrive: moving ready items out of a queue (usually a dead-letter queue) into others.

The two queues may live in different environments (commit groups or directories of
their own), so no transaction spans both. The move is the dead-letter hand-over run
the other way, in three commits:

1. The queue moving items out (the *origin*) takes each from its place into its
   partition's *redrive outbox* (``r`` + seq, value: the target's uid and the record
   as it was), in one transaction.
2. After that commit the origin's actor hands the outbox to each target's actor,
   which stores every item once, deduplicated by source_id (the item's id in the
   origin, never reused): an item it already holds is not stored again.
3. After the target's commit the origin drops the outbox entries.

A crash after 1 leaves the items in the outbox, and start-up hands them over again
before the server accepts calls; a crash after 2 does the same and the target's
deduplication stores nothing twice. If the target queue was deleted meanwhile, the
items go back to the origin's partitions as they were. At any moment an item is in
exactly one place that a reader sees (origin, target) or in the origin's outbox, which
only ever leads to one of them.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import lmdb

from ..storage import Item
from .ids import item_id, parse_id
from .lifecycle import LifecycleSteps
from .requests import RedriveDoneRequest, RedriveInRequest, RedriveRequest, RedriveResult

# A redrive looks at no more items than this in one call (and so in one cycle), so a
# filter that matches little in a large queue cannot hold the queue's cycle for long;
# the caller goes on with the call's next_page_token.
REDRIVE_SCAN_LIMIT = 10_000
_PAGE = 500


def handed_over(uid: int, partition: int, seq: int, item: Item) -> Item:
    """The copy of an origin item that its target stores: a fresh item again (no
    attempts, no dead-letter fields, no lease), with its origin id as source_id and
    its message id kept."""
    origin_id = item_id(uid, partition, seq)
    return replace(
        item,
        source_id=origin_id,
        message_id=item.message_id or origin_id,
        dead_reason=0,
        dead_at=0,
        dead_attempts=0,
        attempts=0,
        is_leased=False,
        lease_deadline=0,
        leased_at=0,
        lease_key="",
        enqueue_at=0,
        metadata=dict(item.metadata),
    )


class RedriveSteps(LifecycleSteps):
    """The redrive steps; they re-queue items as the lifecycle does."""

    def redrive(self, txn: lmdb.Transaction[bytes], request: RedriveRequest) -> None:
        """Move up to ``request.limit`` matching ready items into the redrive outbox."""
        moved: list[str] = []
        entries: list[tuple[int, int]] = []
        skipped = examined = 0
        next_after: tuple[int, int] | None = None
        first_p, first_after = request.after
        for p in range(first_p, len(self._base)):
            if self.faulty and p in self.faulty:
                continue  # its items stay; a redrive after it works again finds them
            self.enter(p)
            after = first_after if p == first_p else 0
            while next_after is None:
                page = self._as_leased(p, self.store.page_items(txn, p, after, _PAGE))
                for seq, item in page:
                    if len(moved) >= request.limit or examined >= REDRIVE_SCAN_LIMIT:
                        next_after = (p, after)
                        break
                    examined += 1
                    after = seq
                    if item.is_leased or (request.kind and item.kind != request.kind):
                        continue
                    if request.dead_reason and item.dead_reason != request.dead_reason:
                        continue
                    target = request.target_uid or self._source_uid(item, request)
                    if not target or target == self.uid:
                        skipped += 1
                        continue
                    self._take_for_redrive(txn, p, seq, item, target)
                    moved.append(item.message_id or item_id(self.uid, p, seq))
                    entries.append((p, seq))
                if len(page) < _PAGE:
                    break
            if next_after is not None:
                break
        delivered = asyncio.get_running_loop().create_future() if entries else None
        self._ok(request, RedriveResult(moved, entries, skipped, next_after, delivered))

    @staticmethod
    def _source_uid(item: Item, request: RedriveRequest) -> int:
        """The uid of the queue ``item`` goes back to, or 0: none it may go to."""
        text, targets = item.source_id, request.targets
        if request.own_prefix and text.startswith(request.own_prefix):
            text, targets = text[len(request.own_prefix) :], request.own
        ref = parse_id(text) if text else None
        return ref.uid if ref is not None and ref.uid in targets else 0

    def _take_for_redrive(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item, target: int) -> None:
        self.store.delete(txn, p, seq, item)
        v = self.view(p)
        v.ready -= 1
        v.created_sum -= item.created_at
        if item.lease_key:
            self._untag(txn, item.lease_key, seq)
            item.lease_key = ""
        if item.group_key:  # it leaves its group, which goes on without it
            self._release_group(txn, p, item.group_key)
            item.group_key = ""
        self.store.put_redrive(txn, p, seq, target, item)
        self.redrive_added.append((p, seq, target, item))

    def receive_redriven(self, txn: lmdb.Transaction[bytes], request: RedriveInRequest) -> None:
        """Store items redriven here, once each by source_id, as fresh ready items."""
        partitions = self.some_healthy() if self.faulty else range(len(self._base))
        p = min(partitions, key=lambda i: self._peek(i).ready)
        self._forget_taken(txn)
        self.enter(p)
        expire = self.now + self.config.expire_timeout_us
        for item in request.items:
            if self.taken_before(txn, item.source_id):
                continue  # handed over before a crash or a failover of the origin; taken
            item.expire_deadline = expire
            item.created_at = item.created_at or self.now
            item.group_key = ""
            self._requeue(txn, p, item)
            self.note_taken(txn, p, item.source_id)
        self._ok(request, None)

    def redrive_done(self, txn: lmdb.Transaction[bytes], request: RedriveDoneRequest) -> None:
        """Drop outbox entries their target stored, or (``restore``) put them back
        where items of this partition go: its tail, as ready items."""
        for p, seq in request.entries:
            self.enter(p)
            if request.restore:
                found = self.store.get_redrive(txn, p, seq)
                if found is not None:
                    self._requeue(txn, p, found[1], seq)
            self.store.delete_redrive(txn, p, seq)
        self._ok(request, None)
