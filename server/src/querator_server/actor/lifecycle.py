"""Lifecycle steps of a cycle: re-queue, schedule and dead-letter items; expiry.

The actor runs them inside the same transaction as the client requests of the cycle,
working only on what is due: popped lease deadlines, the first keys of the scheduled
keyspace and of the expiry index.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import lmdb

from ..faults import FAULT_FILE_ENV, InjectedFault, lifecycle_fault
from ..model import NEVER_US
from ..storage import Item, accepted_sources, done_runs
from ..storage.record import DEAD_EXPIRED, TAG_ITEM, parse_scheduled_key, seq_of_item_key
from .cycle_base import DEATH_CODES, CycleBase
from .ids import item_id, scheduled_id
from .requests import DeadLetterRequest, OutboxDoneRequest

# Lifecycle work per kind per cycle; more than this waits for the next cycle, which
# follows at once, so client requests never queue behind a huge backlog.
LIFECYCLE_BATCH = 1000
LIMIT_PLUS_ONE = LIFECYCLE_BATCH + 1


# A Complete or Retry sent again after a lost answer can reach the queue well after the
# first: the SDK waits out a reconnect backoff of up to 10 s, a node restarts, a server
# process is paused. Seen in a soak: a node paused 3.2 s answered the resend NOT_FOUND,
# its queue's 2 s lease timeout having passed. A queue of short leases still remembers
# for this long (one small record per completed run: at 1,000 Completes a second, a
# minute of them is about 60,000 records of 25 bytes). Tests of the forgetting itself
# lower it with QUERATOR_TEST_DONE_RETENTION_FLOOR_S (docs/configuration.md).
DONE_RETENTION_FLOOR_ENV = "QUERATOR_TEST_DONE_RETENTION_FLOOR_S"


def _retention_floor_us() -> int:
    text = os.environ.get(DONE_RETENTION_FLOOR_ENV, "60")
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{DONE_RETENTION_FLOOR_ENV}={text!r}: not a number of seconds") from None
    return max(0, int(seconds * 1_000_000))


DONE_RETENTION_FLOOR_US = _retention_floor_us()


def done_retention_us(lease_timeout_us: int) -> int:
    """How long a partition remembers an item it completed or retried (a Complete or
    Retry sent again within it is answered as done): the queue's lease timeout, and at
    least DONE_RETENTION_FLOOR_US."""
    return max(lease_timeout_us, DONE_RETENTION_FLOOR_US)


DONE_SWEEP_GAP_US = 1_000_000


def lease_expired_error(attempts: int) -> str:
    """The last error of an item whose lease ran out (RetryItem.error's server-side twin)."""
    return f"lease expired after {attempts} attempt{'' if attempts == 1 else 's'}"


class LifecycleSteps(CycleBase):
    def _end_lease(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item) -> None:
        """Take a leased item out of its place; the caller puts it somewhere else."""
        self.store.delete(txn, p, seq, item)
        self.lease_ends.append((p, seq))
        v = self.view(p)
        v.leased -= 1
        v.created_sum -= item.created_at
        v.leased_at_sum -= item.leased_at
        if item.group_key:  # still its group's head, wherever it goes next
            v.groups_in_flight -= 1
        item.is_leased = False
        item.lease_deadline = 0
        item.leased_at = 0

    def _requeue(self, txn: lmdb.Transaction[bytes], p: int, item: Item, old_seq: int = 0, old_id: str = "") -> None:
        """Put an item at the tail of its partition under a new id; its message id
        stays the id it had before its first move (``old_id``, or the one of ``old_seq``)."""
        if not item.message_id:
            item.message_id = old_id or (item_id(self.uid, p, old_seq) if old_seq else "")
        v = self.view(p)
        item.enqueue_at = 0
        new_seq = v.take_seq()
        if item.lease_key and old_seq:
            self._follow(txn, item.lease_key, old_seq, new_seq)
        self.store.append(txn, p, new_seq, item)
        v.ready += 1
        if item.priority:
            v.ranked += 1
        v.created_sum += item.created_at
        v.note_expiry(item.expire_deadline)

    def _schedule(self, txn: lmdb.Transaction[bytes], p: int, item: Item, due: int, old_seq: int) -> None:
        if not item.message_id:
            item.message_id = item_id(self.uid, p, old_seq)
        if item.lease_key:
            self._untag(txn, item.lease_key, old_seq)
            item.lease_key = ""
        v = self.view(p)
        item.enqueue_at = due
        self.store.put_scheduled(txn, p, due, v.take_seq(), item)
        v.scheduled += 1
        v.note_due(due)
        v.note_expiry(item.expire_deadline)

    def _dead_letter(
        self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item, old_id: str, reason: str, code: int
    ) -> None:
        """Send an item (already out of its place) to the dead-letter queue, or drop it.

        The item goes to the partition's outbox in this same transaction; the actor
        hands the outbox to the dead-letter queue after the commit and removes each
        entry once that queue has stored it (deduplicated by source_id). It carries
        its history: its message id, why (``code``, a DEAD_*), when, after how many
        attempts.
        """
        if item.lease_key:
            self._untag(txn, item.lease_key, seq)
            item.lease_key = ""
        if item.group_key:  # (it was its group's head) the group's next item goes on
            self._release_group(txn, p, item.group_key)
        if not self.config.dead_queue:
            self.dropped.append((old_id, reason, item.last_error))
            return
        item.message_id = item.message_id or old_id
        item.dead_reason, item.dead_at, item.dead_attempts = code, self.now, item.attempts
        item.source_id = old_id
        self.store.put_outbox(txn, p, seq, item)
        self.outbox_added.append((p, seq, item))

    def lifecycle(
        self,
        txn: lmdb.Transaction[bytes],
        expired_leases: Sequence[tuple[int, int, int]],
        *,
        forget_keys: bool = False,
        forget_done: bool = False,
    ) -> None:
        """Expired leases, due scheduled items and expired items, as of ``self.now``;
        with ``forget_keys``, idempotency and lease keys past their window; with
        ``forget_done``, records of completed and retried items past theirs."""
        now = self.now
        if forget_keys and self.keyed is not None:
            n, self.dedup_next = self.keyed.forget_dedup_before(txn, now - self.config.dedup_window_us, LIFECYCLE_BATCH)
            m, self.lease_keys_next = self.keyed.forget_lease_keys_before(
                txn, now - self.config.lease_key_ttl_us, LIFECYCLE_BATCH
            )
            if n == LIFECYCLE_BATCH or m == LIFECYCLE_BATCH:
                self.more_lifecycle = True
        if forget_done:
            self._forget_done(txn)
        faulty = self.faulty
        for deadline, p, seq in expired_leases:
            if faulty and p in faulty:
                continue  # its leases are read again when it works again
            self.enter(p)
            self._write_out(txn, p, (seq,))
            item = self.store.get(txn, p, seq)
            if item is None or not item.is_leased or item.lease_deadline != deadline:
                continue  # completed, retried or extended since
            self.lease_expirations += 1
            old_id = item_id(self.uid, p, seq)
            self._end_lease(txn, p, seq, item)
            # No worker said what went wrong: say what the server saw, for the next
            # attempt's handler and, when it dies of it, the dead letter.
            item.last_error, item.last_error_at = lease_expired_error(item.attempts), now
            reason = self._death_reason(item)
            if reason:
                self._dead_letter(txn, p, seq, item, old_id, f"lease expired, {reason}", DEATH_CODES[reason])
            else:
                self._requeue(txn, p, item, seq)
        for p in range(len(self._base)):
            if faulty and p in faulty:
                continue
            first_due = self._peek(p).first_due
            if first_due and first_due <= now:
                self.enter(p)
                self._promote(txn, p)
            first_expiry = self._peek(p).first_expiry
            if first_expiry and first_expiry <= now:
                self.enter(p)
                self._expire(txn, p)
        if os.environ.get(FAULT_FILE_ENV) and lifecycle_fault(self.store.path):
            raise InjectedFault("injected into the lifecycle step")

    def _forget_done(self, txn: lmdb.Transaction[bytes]) -> None:
        """Forget completed and retried items past their retention (done_runs.py)."""
        before = self.now - done_retention_us(self.config.lease_timeout_us)
        firsts: list[int] = []
        for p in range(len(self._base)):
            if self.faulty and p in self.faulty:
                continue
            self.enter(p)
            n, first = done_runs.forget_before(txn, self.store.db(p), before, LIFECYCLE_BATCH)
            if n == LIFECYCLE_BATCH:
                self.more_lifecycle = True
            if first:
                firsts.append(first)
        self.done_next = min(firsts, default=0)

    def _promote(self, txn: lmdb.Transaction[bytes], p: int) -> None:
        v = self.view(p)
        rows = self.store.page_scheduled(txn, p, (0, -1), LIMIT_PLUS_ONE)
        due_rows = [row for row in rows[:LIFECYCLE_BATCH] if row[0] <= self.now]
        for due, seq, item in due_rows:
            self.store.delete_scheduled(txn, p, due, seq, item)
            v.scheduled -= 1
            old_id = scheduled_id(self.uid, p, seq, due)
            if item.expire_deadline <= self.now:
                self._dead_letter(txn, p, seq, item, old_id, "expired while scheduled", DEAD_EXPIRED)
            else:
                self._requeue(txn, p, item, old_id=old_id)
        if len(due_rows) == LIFECYCLE_BATCH:
            self.more_lifecycle = True
        v.first_due = self.store.first_due(txn, p)

    def _expire(self, txn: lmdb.Transaction[bytes], p: int) -> None:
        v = self.view(p)
        entries, next_deadline = self.store.expired(txn, p, self.now, LIFECYCLE_BATCH, v.leases.held)
        for key, item in entries:
            if key[:1] == TAG_ITEM:
                seq = seq_of_item_key(key)
                self.store.delete(txn, p, seq, item)
                v.ready -= 1
                v.created_sum -= item.created_at
                old_id = item_id(self.uid, p, seq)
            else:
                due, seq = parse_scheduled_key(key)
                self.store.delete_scheduled(txn, p, due, seq, item)
                v.scheduled -= 1
                old_id = scheduled_id(self.uid, p, seq, due)
            self._dead_letter(txn, p, seq, item, old_id, "expired", DEAD_EXPIRED)
        if next_deadline == self.now:
            self.more_lifecycle = True
        v.first_expiry = next_deadline

    def receive_dead_letters(self, txn: lmdb.Transaction[bytes], request: DeadLetterRequest) -> None:
        """Store items another queue dead-lettered here, once each by source_id.

        ``attempts`` starts again (this queue's max_attempts counts leases here); the
        attempts of the source queue stay in ``dead_attempts``. Dead letters never
        expire here: they were kept for someone to look at, and a deadline of this
        queue's expire_timeout (24 hours by default) would delete them unseen. They
        stay until completed, deleted, cleared or redriven.
        """
        partitions = self.some_healthy() if self.faulty else range(len(self._base))
        p = min(partitions, key=lambda i: self._peek(i).ready)
        self._forget_taken(txn)
        self.enter(p)
        for item in request.items:
            if item.source_id and self.taken_before(txn, item.source_id):
                continue  # sent before a crash or a failover of its queue; already taken
            item.attempts = 0
            item.group_key = ""  # a dead letter leaves its group: this queue has its own
            item.is_leased = False
            item.lease_deadline = 0
            item.leased_at = 0
            item.enqueue_at = 0
            item.expire_deadline = NEVER_US
            self._requeue(txn, p, item)
            if item.source_id:
                self.note_taken(txn, p, item.source_id)
        self._ok(request, None)

    def taken_before(self, txn: lmdb.Transaction[bytes], source_id: str) -> bool:
        """Whether the item from ``source_id`` was handed over here before: still held
        (``u``), or taken within accepted_sources.WINDOW_US (completed since, maybe).
        A faulty partition is not read: an item first sent before a crash and stored
        there would be stored twice (only if it is resent while the partition is out)."""
        if self.store.has_source(txn, source_id, self.faulty):
            return True
        dbs = (self.store.db(p) for p in range(len(self._base)) if not (self.faulty and p in self.faulty))
        return accepted_sources.seen(txn, dbs, source_id)

    def note_taken(self, txn: lmdb.Transaction[bytes], p: int, source_id: str) -> None:
        accepted_sources.note(txn, self.store.db(p), source_id, self.now)

    def _forget_taken(self, txn: lmdb.Transaction[bytes]) -> None:
        """Forget source ids taken before the window, a batch per partition: each
        hand-over forgets at least as many as it can add, so they stay bounded by what
        one window brings."""
        before = self.now - accepted_sources.WINDOW_US
        for p in range(len(self._base)):
            if not ((self.faulty and p in self.faulty) or (self.broken and p in self.broken)):
                self.enter(p)
                accepted_sources.forget_before(txn, self.store.db(p), before, LIFECYCLE_BATCH)

    def outbox_done(self, txn: lmdb.Transaction[bytes], request: OutboxDoneRequest) -> None:
        for p, seq in request.entries:
            self.enter(p)
            self.store.delete_outbox(txn, p, seq)
        self._ok(request, None)
