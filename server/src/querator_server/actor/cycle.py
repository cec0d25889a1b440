"""One cycle of a logical queue: every waiting request applied in one transaction.

``Cycle`` runs on a worker thread inside ``QueueStore.write``. It reads the actor's
partition views but only changes copies of them; the actor adopts the copies once the
transaction has committed. If LMDB's map is full the whole cycle runs again from the
start on a bigger map, so nothing here touches state outside the transaction.
"""

from __future__ import annotations

from collections.abc import Sequence

import lmdb

from ..errors import FailedPrecondition, InvalidArgument, NotFound, QueratorError, quote
from ..model import SCHEDULE_MIN_US, QueueConfig
from ..storage import Item, QueueStore
from ..storage.keyed import KeyedIndex, LeaseKeyRecord
from ..storage.record import (
    TAG_ITEM,
    ItemState,
    parse_scheduled_key,
    read_state,
    scheduled_key,
    seq_of_item_key,
    with_lease,
)
from .ids import ItemRef, item_id, parse_id, scheduled_id
from .requests import (
    ClearRequest,
    CompleteRequest,
    ExtendResult,
    DeadLetterRequest,
    DeleteItemsRequest,
    ExtendRequest,
    ImportItemsRequest,
    LeasedItem,
    LeaseRequest,
    LeaseResult,
    ListItemsRequest,
    OutboxDoneRequest,
    PageResult,
    ProduceRequest,
    ProduceResult,
    Request,
    RetryRequest,
    StoredItem,
)
from .view import PartitionView

# A lease answered this close to its caller's deadline would arrive too late to use.
FENCE_MARGIN_US = 2_000
# Lifecycle work per kind per cycle; more than this waits for the next cycle, which
# follows at once, so client requests never queue behind a huge backlog.
LIFECYCLE_BATCH = 1000
LIMIT_PLUS_ONE = LIFECYCLE_BATCH + 1


class Cycle:
    """The transaction body of one actor cycle and everything it decided."""

    def __init__(
        self,
        store: QueueStore,
        config: QueueConfig,
        views: Sequence[PartitionView],
        now: int,
        keyed: KeyedIndex | None = None,
    ) -> None:
        self.store = store
        self.keyed = keyed
        self.config = config
        self.uid = config.uid
        self.now = now
        self._base = views
        self.views: dict[int, PartitionView] = {}
        self.results: list[tuple[Request, object]] = []
        # Leases granted this cycle: (request, partition, [(seq, raw before lease)]).
        self._granted: list[tuple[LeaseRequest, int, list[tuple[int, bytes]]]] = []
        # Lease deadlines to track once committed: (deadline, partition, seq).
        self.lease_deadlines: list[tuple[int, int, int]] = []
        # Leases that found nothing and may keep waiting.
        self.unserved: list[LeaseRequest] = []
        # Items moved to the dead-letter outbox: (partition, seq, item with source_id).
        self.outbox_added: list[tuple[int, int, Item]] = []
        # Items deleted because the queue has no dead-letter queue: (id, reason).
        self.dropped: list[tuple[str, str]] = []
        # Whether lifecycle work was left for the next cycle.
        self.more_lifecycle = False
        # Leases whose complete_ids were applied in this cycle.
        self.completed_by_lease: list[LeaseRequest] = []
        # When the oldest remembered idempotency key / lease key was taken, as
        # found by this cycle's forgetting (None: not looked at), and whether the
        # cycle remembered new ones: the actor's timers for forgetting follow these.
        self.dedup_next: int | None = None
        self.lease_keys_next: int | None = None
        self.dedup_added = False
        self.lease_keys_added = False
        # Leases that ran out in this cycle's lifecycle (for metrics).
        self.lease_expirations = 0

    # -- views ---------------------------------------------------------------------

    def view(self, p: int) -> PartitionView:
        v = self.views.get(p)
        if v is None:
            v = self.views[p] = self._base[p].copy()
        return v

    def _peek(self, p: int) -> PartitionView:
        return self.views.get(p) or self._base[p]

    def ready_total(self) -> int:
        return sum(self._peek(p).ready for p in range(len(self._base)))

    def _ok(self, request: Request, result: object) -> None:
        self.results.append((request, result))

    # -- produce -------------------------------------------------------------------

    def produce(self, txn: lmdb.Transaction, request: ProduceRequest) -> None:
        counts = [self._peek(p).ready for p in range(len(self._base))]
        p = counts.index(min(counts))
        v = self.view(p)
        store, now = self.store, self.now
        expire = now + self.config.expire_timeout_us
        ids: list[str] = []
        duplicates = 0
        since = now - self.config.dedup_window_us
        for new in request.items:
            key = new.idempotency_key
            if key and self.keyed is not None:
                first = self.keyed.seen(txn, key, since)
                if first is not None:
                    ids.append(first)
                    duplicates += 1
                    continue
            seq = v.take_seq()
            item = Item(
                payload=new.payload,
                encoding=new.encoding,
                kind=new.kind,
                reference=new.reference,
                created_at=now,
                expire_deadline=expire,
            )
            if new.enqueue_at_us >= now + SCHEDULE_MIN_US:
                item.enqueue_at = new.enqueue_at_us
                store.put_scheduled(txn, p, new.enqueue_at_us, seq, item)
                v.scheduled += 1
                v.note_due(new.enqueue_at_us)
                ids.append(scheduled_id(self.uid, p, seq, new.enqueue_at_us))
            else:
                store.append(txn, p, seq, item)
                v.ready += 1
                v.created_sum += now
                ids.append(item_id(self.uid, p, seq))
            if key and self.keyed is not None:
                self.keyed.remember(txn, key, now, ids[-1])
                self.dedup_added = True
        if len(request.items) > duplicates:
            v.note_expiry(expire)
        self._ok(request, ProduceResult(p, ids, duplicates))

    # -- lease ---------------------------------------------------------------------

    def lease(self, txn: lmdb.Transaction, requests: list[LeaseRequest]) -> None:
        """Share the ready items among ``requests`` (oldest first), round-robin."""
        if self.keyed is not None and any(r.lease_key for r in requests):
            fresh: list[LeaseRequest] = []
            for request in requests:
                record = self.keyed.lease_key(txn, request.lease_key) if request.lease_key else None
                if record is None:
                    fresh.append(request)
                else:
                    self._replay(txn, request, record)
            requests = fresh
        total = self.ready_total()
        wanted = [r.batch_size for r in requests]
        if total >= sum(wanted):
            quotas = wanted
        else:
            quotas = _water_fill(wanted, total)
        for request, quota in zip(requests, quotas):
            granted = self._lease_one(txn, request, quota) if quota else None
            if granted is None:
                self.unserved.append(request)

    def _lease_one(self, txn: lmdb.Transaction, request: LeaseRequest, quota: int) -> LeaseResult | None:
        p = max(range(len(self._base)), key=lambda i: self._peek(i).ready)
        v = self.view(p)
        if not v.ready:
            return None
        now = self.now
        deadline = now + self.config.lease_timeout_us
        taken: list[tuple[int, bytes]] = []
        items: list[LeasedItem] = []
        last_seq = v.ready_hint - 1
        for seq, raw in self.store.ready_items(txn, p, v.ready_hint):
            if len(items) >= quota:
                break
            last_seq = seq
            state = read_state(raw)
            reason = self._death_reason(state)
            if reason:  # expired or out of attempts: never leased again
                item = Item.decode(raw)
                self.store.delete(txn, p, seq, item)
                v.ready -= 1
                v.created_sum -= item.created_at
                self._dead_letter(txn, p, seq, item, item_id(self.uid, p, seq), reason)
                continue
            if state.lease_key or request.lease_key:
                # Tagged items change their tag (and their old key loses them).
                item = Item.decode(raw)
                if state.lease_key and state.lease_key != request.lease_key:
                    self._untag(txn, state.lease_key, seq)
                item.is_leased, item.attempts, item.lease_deadline = True, state.attempts + 1, deadline
                item.leased_at, item.lease_key = now, request.lease_key
                leased = item.encode()
            else:
                leased = with_lease(raw, state, attempts=state.attempts + 1, deadline=deadline, leased_at=now)
            self.store.put_raw(txn, p, seq, leased)
            taken.append((seq, raw))
            items.append(LeasedItem(item_id(self.uid, p, seq), Item.decode(leased)))
            self.lease_deadlines.append((deadline, p, seq))
        if not items:
            return None
        v.ready -= len(items)
        v.leased += len(items)
        v.leased_at_sum += now * len(items)
        v.ready_hint = last_seq + 1
        result = LeaseResult(p, items)
        if request.lease_key and self.keyed is not None:
            record = LeaseKeyRecord(now, p, tuple(seq for seq, _ in taken))
            self.keyed.put_lease_key(txn, request.lease_key, record, new=True)
            self.lease_keys_added = True
        else:
            # A keyed lease is not taken back when its caller vanishes: the caller
            # replays the key and gets the same items.
            self._granted.append((request, p, taken))
        self._ok(request, result)
        return result

    def _replay(self, txn: lmdb.Transaction, request: LeaseRequest, record: LeaseKeyRecord) -> None:
        """Answer a repeated lease key with the items still leased under it.

        Items whose lease expired and that are ready again are leased again; items
        that left the key (completed, leased by others, dead-lettered) are dropped.
        """
        key, p, now = request.lease_key, record.partition, self.now
        if p >= len(self._base):
            self._ok(request, LeaseResult(0, []))
            return
        v = self.view(p)
        deadline = now + self.config.lease_timeout_us
        items: list[LeasedItem] = []
        kept: list[int] = []
        for seq in record.seqs:
            raw = self.store.get_raw(txn, p, seq)
            state = read_state(raw) if raw is not None else None
            if raw is None or state is None or state.lease_key != key:
                continue
            if not state.is_leased:
                if self._death_reason(state):
                    continue  # the lease scan or the lifecycle dead-letters it
                item = Item.decode(raw)
                item.is_leased, item.attempts, item.lease_deadline, item.leased_at = True, state.attempts + 1, deadline, now
                raw = item.encode()
                self.store.put_raw(txn, p, seq, raw)
                v.ready -= 1
                v.leased += 1
                v.leased_at_sum += now
                self.lease_deadlines.append((deadline, p, seq))
            items.append(LeasedItem(item_id(self.uid, p, seq), Item.decode(raw)))
            kept.append(seq)
        if tuple(kept) != record.seqs:
            assert self.keyed is not None
            self.keyed.put_lease_key(txn, key, record._replace(seqs=tuple(kept)), new=False)
        self._ok(request, LeaseResult(p, items))

    def _untag(self, txn: lmdb.Transaction, key: str, seq: int) -> None:
        """Take item ``seq`` out of lease key ``key`` (forgetting the key once empty)."""
        if self.keyed is None:
            return
        record = self.keyed.lease_key(txn, key)
        if record is not None and seq in record.seqs:
            seqs = tuple(s for s in record.seqs if s != seq)
            self.keyed.put_lease_key(txn, key, record._replace(seqs=seqs), new=False)

    def _follow(self, txn: lmdb.Transaction, key: str, old_seq: int, new_seq: int) -> None:
        """Item ``old_seq`` of lease key ``key`` re-entered its partition as ``new_seq``."""
        if self.keyed is None:
            return
        record = self.keyed.lease_key(txn, key)
        if record is not None and old_seq in record.seqs:
            seqs = tuple(new_seq if s == old_seq else s for s in record.seqs)
            self.keyed.put_lease_key(txn, key, record._replace(seqs=seqs), new=False)

    def fence_leases(self, txn: lmdb.Transaction, now: int) -> None:
        """Take back leases whose caller hung up or ran out of time before the commit."""
        for request, p, taken in self._granted:
            gone = request.future.done() or (request.deadline_us and now >= request.deadline_us - FENCE_MARGIN_US)
            if not gone:
                continue
            v = self.view(p)
            for seq, raw in taken:
                self.store.put_raw(txn, p, seq, raw)
                v.ready_hint = min(v.ready_hint, seq)
            v.ready += len(taken)
            v.leased -= len(taken)
            v.leased_at_sum -= self.now * len(taken)
            taken_seqs = {seq for seq, _ in taken}
            self.lease_deadlines = [d for d in self.lease_deadlines if d[1] != p or d[2] not in taken_seqs]
            # The caller is gone or too late; answer (if anyone listens) with nothing.
            self.results = [(r, LeaseResult(p, []) if r is request else res) for r, res in self.results]

    # -- complete / retry / extend ----------------------------------------------------

    def _leased_items(
        self,
        txn: lmdb.Transaction,
        partition: int,
        ids: Sequence[str],
        *,
        check_deadline: bool = False,
        field: str = "ids",
    ) -> list[tuple[int, bytes, ItemState]]:
        """Look up every id as a leased item of ``partition``: (seq, raw, state) for
        all of them, or an error naming each id that is not."""
        found: list[tuple[int, bytes, ItemState]] = []
        missing: list[str] = []
        unleased: list[str] = []
        lost: list[str] = []
        for index, text in enumerate(ids):
            ref = parse_id(text)
            raw = self._lookup(txn, partition, ref)
            if ref is None or raw is None:
                missing.append(f"{field}[{index}] {quote(text)}")
                continue
            state = read_state(raw)
            if ref.due or not state.is_leased:
                unleased.append(f"{field}[{index}] {quote(text)}")
            elif check_deadline and min(state.lease_deadline, state.expire_deadline) <= self.now:
                lost.append(f"{field}[{index}] {quote(text)}")
            else:
                found.append((ref.seq, raw, state))
        if missing:
            raise NotFound(_listing("no such item (completed, moved or never produced)", missing))
        if unleased:
            raise FailedPrecondition(_listing("item is not leased", unleased))
        if lost:
            raise FailedPrecondition(_listing("lease (or item) has expired", lost))
        return found

    def _lookup(self, txn: lmdb.Transaction, partition: int, ref: ItemRef | None) -> bytes | None:
        if ref is None or ref.uid != self.uid or ref.partition != partition:
            return None
        if ref.due:  # a scheduled item exists but is never leased
            raw: bytes | None = txn.get(scheduled_key(ref.due, ref.seq), db=self.store.db(partition))
            return raw
        return self.store.get_raw(txn, partition, ref.seq)

    def complete(self, txn: lmdb.Transaction, request: CompleteRequest) -> None:
        if request.ids:
            self._complete(txn, request.partition, request.ids)
        self._complete_keys(txn, request.lease_keys)
        self._ok(request, None)

    def _complete(self, txn: lmdb.Transaction, p: int, ids: Sequence[str], field: str = "ids") -> None:
        found = self._leased_items(txn, p, ids, field=field)
        for seq, _raw, state in found:
            self._remove_leased(txn, p, seq, state)
            if state.lease_key:
                self._untag(txn, state.lease_key, seq)

    def _remove_leased(self, txn: lmdb.Transaction, p: int, seq: int, state: ItemState) -> None:
        self.store.delete(txn, p, seq, state)
        v = self.view(p)
        v.leased -= 1
        v.created_sum -= state.created_at
        v.leased_at_sum -= state.leased_at

    def _complete_keys(self, txn: lmdb.Transaction, keys: Sequence[str]) -> None:
        """Complete every item still leased under each key; forget the keys. Idempotent."""
        if self.keyed is None:
            return
        for key in keys:
            record = self.keyed.lease_key(txn, key)
            if record is None:
                continue
            p = record.partition
            for seq in record.seqs if p < len(self._base) else ():
                raw = self.store.get_raw(txn, p, seq)
                if raw is None:
                    continue
                state = read_state(raw)
                if state.is_leased and state.lease_key == key:
                    self._remove_leased(txn, p, seq, state)
            self.keyed.drop_lease_key(txn, key)

    def complete_before_lease(self, txn: lmdb.Transaction, requests: list[LeaseRequest]) -> list[LeaseRequest]:
        """Apply the completions that leases carry; return the leases still to serve.

        A lease whose completion fails is answered with that error and leases nothing.
        """
        kept: list[LeaseRequest] = []
        for request in requests:
            if request.complete_ids:
                try:
                    self._complete(txn, request.complete_partition, request.complete_ids, "complete_ids")
                except QueratorError as exc:
                    self.fail(request, exc)
                    continue
                self.completed_by_lease.append(request)
            kept.append(request)
        return kept

    def retry(self, txn: lmdb.Transaction, request: RetryRequest) -> None:
        p = request.partition
        found = self._leased_items(txn, p, [o.item_id for o in request.orders])
        for (seq, raw, _state), order in zip(found, request.orders):
            item = Item.decode(raw)
            old_id = item_id(self.uid, p, seq)
            self._end_lease(txn, p, seq, item)
            reason = "retried as dead" if order.dead else self._death_reason(item)
            if reason:
                self._dead_letter(txn, p, seq, item, old_id, reason)
            elif order.retry_at_us >= self.now + SCHEDULE_MIN_US:
                self._schedule(txn, p, item, order.retry_at_us, seq)
            else:
                self._requeue(txn, p, item, seq)
        self._ok(request, None)

    # -- lifecycle -----------------------------------------------------------------------

    def _death_reason(self, item: Item | ItemState) -> str:
        if item.expire_deadline <= self.now:
            return "expired"
        limit = self.config.max_attempts
        if limit and item.attempts >= limit:
            return "max_attempts reached"
        return ""

    def _end_lease(self, txn: lmdb.Transaction, p: int, seq: int, item: Item) -> None:
        """Take a leased item out of its place; the caller puts it somewhere else."""
        self.store.delete(txn, p, seq, item)
        v = self.view(p)
        v.leased -= 1
        v.created_sum -= item.created_at
        v.leased_at_sum -= item.leased_at
        item.is_leased = False
        item.lease_deadline = 0
        item.leased_at = 0

    def _requeue(self, txn: lmdb.Transaction, p: int, item: Item, old_seq: int = 0) -> None:
        """Put an item at the tail of its partition under a new id."""
        v = self.view(p)
        item.enqueue_at = 0
        new_seq = v.take_seq()
        if item.lease_key and old_seq:
            self._follow(txn, item.lease_key, old_seq, new_seq)
        self.store.append(txn, p, new_seq, item)
        v.ready += 1
        v.created_sum += item.created_at
        v.note_expiry(item.expire_deadline)

    def _schedule(self, txn: lmdb.Transaction, p: int, item: Item, due: int, old_seq: int) -> None:
        if item.lease_key:
            self._untag(txn, item.lease_key, old_seq)
            item.lease_key = ""
        v = self.view(p)
        item.enqueue_at = due
        self.store.put_scheduled(txn, p, due, v.take_seq(), item)
        v.scheduled += 1
        v.note_due(due)
        v.note_expiry(item.expire_deadline)

    def _dead_letter(self, txn: lmdb.Transaction, p: int, seq: int, item: Item, old_id: str, reason: str) -> None:
        """Send an item (already out of its place) to the dead-letter queue, or drop it.

        The item goes to the partition's outbox in this same transaction; the actor
        hands the outbox to the dead-letter queue after the commit and removes each
        entry once that queue has stored it (deduplicated by source_id).
        """
        if item.lease_key:
            self._untag(txn, item.lease_key, seq)
            item.lease_key = ""
        if not self.config.dead_queue:
            self.dropped.append((old_id, reason))
            return
        item.source_id = old_id
        self.store.put_outbox(txn, p, seq, item)
        self.outbox_added.append((p, seq, item))

    def lifecycle(
        self,
        txn: lmdb.Transaction,
        expired_leases: Sequence[tuple[int, int, int]],
        *,
        forget_keys: bool = False,
    ) -> None:
        """Expired leases, due scheduled items and expired items, as of ``self.now``;
        with ``forget_keys``, idempotency and lease keys past their window."""
        now = self.now
        if forget_keys and self.keyed is not None:
            n, self.dedup_next = self.keyed.forget_dedup_before(txn, now - self.config.dedup_window_us, LIFECYCLE_BATCH)
            m, self.lease_keys_next = self.keyed.forget_lease_keys_before(
                txn, now - self.config.lease_key_ttl_us, LIFECYCLE_BATCH
            )
            if n == LIFECYCLE_BATCH or m == LIFECYCLE_BATCH:
                self.more_lifecycle = True
        for deadline, p, seq in expired_leases:
            item = self.store.get(txn, p, seq)
            if item is None or not item.is_leased or item.lease_deadline != deadline:
                continue  # completed, retried or extended since
            self.lease_expirations += 1
            old_id = item_id(self.uid, p, seq)
            self._end_lease(txn, p, seq, item)
            reason = self._death_reason(item)
            if reason:
                self._dead_letter(txn, p, seq, item, old_id, f"lease expired, {reason}")
            else:
                self._requeue(txn, p, item, seq)
        for p in range(len(self._base)):
            first_due = self._peek(p).first_due
            if first_due and first_due <= now:
                self._promote(txn, p)
            first_expiry = self._peek(p).first_expiry
            if first_expiry and first_expiry <= now:
                self._expire(txn, p)

    def _promote(self, txn: lmdb.Transaction, p: int) -> None:
        v = self.view(p)
        rows = self.store.page_scheduled(txn, p, (0, -1), LIMIT_PLUS_ONE)
        due_rows = [row for row in rows[:LIFECYCLE_BATCH] if row[0] <= self.now]
        for due, seq, item in due_rows:
            self.store.delete_scheduled(txn, p, due, seq, item)
            v.scheduled -= 1
            if item.expire_deadline <= self.now:
                self._dead_letter(txn, p, seq, item, scheduled_id(self.uid, p, seq, due), "expired while scheduled")
            else:
                self._requeue(txn, p, item)
        if len(due_rows) == LIFECYCLE_BATCH:
            self.more_lifecycle = True
        v.first_due = self.store.first_due(txn, p)

    def _expire(self, txn: lmdb.Transaction, p: int) -> None:
        v = self.view(p)
        entries, next_deadline = self.store.expired(txn, p, self.now, LIFECYCLE_BATCH)
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
            self._dead_letter(txn, p, seq, item, old_id, "expired")
        if next_deadline == self.now:
            self.more_lifecycle = True
        v.first_expiry = next_deadline

    def receive_dead_letters(self, txn: lmdb.Transaction, request: DeadLetterRequest) -> None:
        """Store items another queue dead-lettered here, once each by source_id."""
        counts = [self._peek(p).ready for p in range(len(self._base))]
        p = counts.index(min(counts))
        v = self.view(p)
        expire = self.now + self.config.expire_timeout_us
        for item in request.items:
            if item.source_id and self.store.has_source(txn, item.source_id):
                continue  # sent before a crash; already here
            item.attempts = 0
            item.is_leased = False
            item.lease_deadline = 0
            item.leased_at = 0
            item.enqueue_at = 0
            item.expire_deadline = expire
            self._requeue(txn, p, item)
        self._ok(request, None)

    def outbox_done(self, txn: lmdb.Transaction, request: OutboxDoneRequest) -> None:
        for p, seq in request.entries:
            self.store.delete_outbox(txn, p, seq)
        self._ok(request, None)

    def extend(self, txn: lmdb.Transaction, request: ExtendRequest) -> None:
        p = request.partition
        found = self._leased_items(txn, p, request.ids, check_deadline=True) if request.ids else []
        timeout = request.lease_timeout_us or self.config.lease_timeout_us
        deadlines = [self._extend_one(txn, p, seq, raw, state, timeout) for seq, raw, state in found]
        by_keys = 0
        for key in request.lease_keys if self.keyed is not None else ():
            record = self.keyed.lease_key(txn, key)  # type: ignore[union-attr]
            if record is None or record.partition >= len(self._base):
                continue
            for seq in record.seqs:
                raw = self.store.get_raw(txn, record.partition, seq)
                if raw is None:
                    continue
                state = read_state(raw)
                live = state.is_leased and min(state.lease_deadline, state.expire_deadline) > self.now
                if live and state.lease_key == key:
                    self._extend_one(txn, record.partition, seq, raw, state, timeout)
                    by_keys += 1
        self._ok(request, ExtendResult(deadlines, by_keys))

    def _extend_one(self, txn: lmdb.Transaction, p: int, seq: int, raw: bytes, state: ItemState, timeout: int) -> int:
        deadline = min(self.now + timeout, state.expire_deadline)
        self.store.put_raw(
            txn, p, seq, with_lease(raw, state, attempts=state.attempts, deadline=deadline, leased_at=state.leased_at)
        )
        self.lease_deadlines.append((deadline, p, seq))
        return deadline

    # -- storage requests ------------------------------------------------------------

    def list_items(self, txn: lmdb.Transaction, request: ListItemsRequest) -> None:
        p = request.partition
        out: list[StoredItem] = []
        next_after: tuple[int, int] | None = None
        if request.scheduled:
            rows = self.store.page_scheduled(txn, p, request.after, request.limit + 1)
            for due, seq, item in rows[: request.limit]:
                out.append(StoredItem(scheduled_id(self.uid, p, seq, due), item))
            if len(rows) > request.limit:
                due, seq, _ = rows[request.limit - 1]
                next_after = (due, seq)
        else:
            page = self.store.page_items(txn, p, request.after[0], request.limit + 1)
            for seq, item in page[: request.limit]:
                out.append(StoredItem(item_id(self.uid, p, seq), item))
            if len(page) > request.limit:
                next_after = (page[request.limit - 1][0], 0)
        self._ok(request, PageResult(out, next_after))

    def import_items(self, txn: lmdb.Transaction, request: ImportItemsRequest) -> None:
        p = request.partition
        v = self.view(p)
        now = self.now
        ids: list[str] = []
        for given in request.items:
            seq = v.take_seq()
            item = Item(
                payload=given.payload,
                encoding=given.encoding,
                kind=given.kind,
                reference=given.reference,
                source_id=given.source_id,
                created_at=given.created_at_us or now,
                expire_deadline=given.expire_deadline_us or now + self.config.expire_timeout_us,
                enqueue_at=given.enqueue_at_us,
                attempts=given.attempts,
            )
            v.note_expiry(item.expire_deadline)
            if given.enqueue_at_us >= now + SCHEDULE_MIN_US:
                self.store.put_scheduled(txn, p, given.enqueue_at_us, seq, item)
                v.scheduled += 1
                v.note_due(given.enqueue_at_us)
                ids.append(scheduled_id(self.uid, p, seq, given.enqueue_at_us))
                continue
            if given.is_leased:
                item.is_leased = True
                item.lease_deadline = given.lease_deadline_us or now + self.config.lease_timeout_us
                item.leased_at = now
                v.leased += 1
                v.leased_at_sum += now
                self.lease_deadlines.append((item.lease_deadline, p, seq))
            else:
                v.ready += 1
            v.created_sum += item.created_at
            self.store.append(txn, p, seq, item)
            ids.append(item_id(self.uid, p, seq))
        self._ok(request, ids)

    def delete_items(self, txn: lmdb.Transaction, request: DeleteItemsRequest) -> None:
        p = request.partition
        v = self.view(p)
        for text in dict.fromkeys(request.ids):
            ref = parse_id(text)
            if ref is None or ref.uid != self.uid or ref.partition != p:
                continue
            if ref.due:
                item = self.store.get_scheduled(txn, p, ref.due, ref.seq)
                if item is not None:
                    self.store.delete_scheduled(txn, p, ref.due, ref.seq, item)
                    v.scheduled -= 1
                continue
            item = self.store.get(txn, p, ref.seq)
            if item is None:
                continue
            self.store.delete(txn, p, ref.seq, item)
            v.created_sum -= item.created_at
            if item.is_leased:
                v.leased -= 1
                v.leased_at_sum -= item.leased_at
            else:
                v.ready -= 1
        self._ok(request, None)

    def clear(self, txn: lmdb.Transaction, request: ClearRequest) -> None:
        for p in range(len(self._base)):
            self.store.clear(
                txn,
                p,
                ready=request.ready,
                leased=request.ready and request.destructive,
                scheduled=request.scheduled,
            )
            scan = self.store.scan(txn, p)
            v = self.view(p)
            fresh = PartitionView.from_scan(scan)
            fresh.next_seq = v.next_seq
            fresh.seq_dirty = v.seq_dirty
            self.views[p] = fresh
        self._ok(request, None)

    # -- end of cycle ------------------------------------------------------------------

    def finish(self, txn: lmdb.Transaction) -> None:
        for p, v in self.views.items():
            if v.seq_dirty:
                self.store.write_next_seq(txn, p, v.next_seq)
                v.seq_dirty = False

    def fail(self, request: Request, error: QueratorError) -> None:
        self.results.append((request, error))


def _water_fill(wanted: list[int], total: int) -> list[int]:
    """Split ``total`` items round-robin among requests wanting ``wanted`` each."""
    quotas = [0] * len(wanted)
    remaining = total
    open_ = [i for i, w in enumerate(wanted) if w > 0]
    while remaining > 0 and open_:
        share = max(1, remaining // len(open_))
        still: list[int] = []
        for i in open_:
            if remaining <= 0:
                break
            give = min(share, wanted[i] - quotas[i], remaining)
            quotas[i] += give
            remaining -= give
            if quotas[i] < wanted[i]:
                still.append(i)
        open_ = still
    return quotas


def _listing(reason: str, entries: list[str], limit: int = 10) -> str:
    shown = ", ".join(entries[:limit])
    more = f" and {len(entries) - limit} more" if len(entries) > limit else ""
    return f"{reason}: {shown}{more}"


__all__ = ["Cycle", "InvalidArgument"]
