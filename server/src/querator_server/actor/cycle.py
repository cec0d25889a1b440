"""One cycle of a logical queue: every waiting request applied in one transaction.

``Cycle`` runs on the event loop in the store's held transaction (see cycle_base.py for
the rules every step follows). This module holds the client requests: produce,
lease (shared round-robin, idempotent lease keys), complete, retry and extend; the
lifecycle, storage and redrive steps come from lifecycle.py, storage_steps.py and
redrive.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import lmdb

from ..errors import FailedPrecondition, InvalidArgument, NotFound, quote
from ..model import ITEM_REPLY_OVERHEAD, MAX_METADATA_PAIRS, METADATA_PAIR_OVERHEAD, SCHEDULE_MIN_US, NewItem
from ..storage import Item, done_runs, lease_records
from ..storage.keyed import LeaseKeyRecord
from ..storage.lease_records import LeaseRecord, RecordRun, lease_walk
from ..storage.lease_walks import LeasedRun
from ..storage.ordered_groups import group_partition
from ..storage.record import (
    DEAD_RETRIED,
    ItemState,
    PlainLeaser,
    grouped,
    plain_leaser,
    priority_of,
    read_state,
    scheduled_key,
    with_lease,
    with_lease_key,
    without_lease,
)
from .cycle_base import DEATH_CODES
from .ids import ItemRef, item_id, parse_id, scheduled_id
from .lifecycle import LifecycleSteps
from .redrive import RedriveSteps
from .requests import (
    CompleteRequest,
    CompleteResult,
    ExtendRequest,
    ExtendResult,
    GiveBackRequest,
    LeaseRequest,
    LeaseResult,
    ProduceRequest,
    ProduceResult,
    RetryRequest,
    RetryResult,
)
from .storage_steps import StorageSteps
from .view import PartitionView

# A lease answered this close to its caller's deadline would arrive too late to use.
FENCE_MARGIN_US = 2_000
# An item with strings or metadata, counted against a lease's byte budget: its record,
# plus the most its reply entry and metadata can add (see model.py).
_DETAILED_ITEM_OVERHEAD = ITEM_REPLY_OVERHEAD + METADATA_PAIR_OVERHEAD * MAX_METADATA_PAIRS
_HEX_DIGITS = "0123456789abcdef"
_NO_FLOOR = 1 << 64


class Cycle(RedriveSteps, LifecycleSteps, StorageSteps):
    """The transaction body of one actor cycle and everything it decided."""

    # -- produce -------------------------------------------------------------------

    def produce(self, txn: lmdb.Transaction[bytes], request: ProduceRequest) -> None:
        if self.config.produce_paused:
            raise FailedPrecondition(f"queue {quote(self.config.name)} is paused for produce; ResumeQueue ends the pause")
        store, now = self.store, self.now
        grouped = not request.payloads and any(new.group_key for new in request.items)
        p = self._group_partition(txn, request) if grouped else self._produce_partition(request, now + SCHEDULE_MIN_US)
        self.at = p  # self.enter(p), inlined: once per request
        if self.faulty or self.broken:
            self.refuse(p)
        if grouped:  # (only the first grouped produce writes it)
            store.record_group_partitions(txn, len(self._base))
        v = self.view(p)
        expire = now + self.config.expire_timeout_us
        if request.payloads:
            self._produce_payloads(txn, request, p, v, expire)
            return
        if _bare(request.items, now + SCHEDULE_MIN_US):
            self._produce_bare(txn, request, p, v, expire)
            return
        scheduled_before = v.scheduled
        waiting_before = v.waiting
        ids: list[str] = []
        duplicates = 0
        since = now - self.config.dedup_window_us
        # Ready items are stored in runs of consecutive seqs, sharing their key prefixes.
        run: list[Item] = []
        run_first = 0
        for new in request.items:
            key = new.idempotency_key
            last_at = 0
            if key and self.keyed is not None:
                first, last_at = self.keyed.check(txn, key, since)
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
                metadata=new.metadata,
                group_key=new.group_key,
                priority=new.priority,
            )
            if new.group_key and store.has_group_head(txn, p, new.group_key):
                store.put_waiting(txn, p, seq, item)  # behind its group's head
                v.waiting += 1
                v.created_sum += now
                ids.append(item_id(self.uid, p, seq))
            elif new.enqueue_at_us >= now + SCHEDULE_MIN_US:
                item.enqueue_at = new.enqueue_at_us
                store.put_scheduled(txn, p, new.enqueue_at_us, seq, item)
                v.scheduled += 1
                v.note_due(new.enqueue_at_us)
                ids.append(scheduled_id(self.uid, p, seq, new.enqueue_at_us))
            else:
                if new.group_key:  # the first of its group: its head
                    store.set_group_head(txn, p, new.group_key)
                if run and run_first + len(run) != seq:
                    store.append_new(txn, p, run_first, run, expire)
                    run = []
                if not run:
                    run_first = seq
                run.append(item)
                ids.append(item_id(self.uid, p, seq))
                if new.priority:
                    v.ranked += 1
            if key and self.keyed is not None:
                self.keyed.remember(txn, key, now, ids[-1], last_at=last_at)
                self.dedup_added = True
        if run:
            store.append_new(txn, p, run_first, run, expire)
        ready = len(request.items) - duplicates - (v.scheduled - scheduled_before) - (v.waiting - waiting_before)
        v.ready += ready
        v.created_sum += now * ready
        v.produced += len(request.items) - duplicates
        if len(request.items) > duplicates:
            v.note_expiry(expire)
        self._ok(request, ProduceResult(p, ids, duplicates))

    def _produce_partition(self, request: ProduceRequest, schedule_from: int) -> int:
        """The partition with the fewest ready items, or, for a request of scheduled
        items, the fewest scheduled ones (ADR 24): scheduled items are counted apart
        from ready ones, else they would all land in the partition that has no ready
        items and make it the fullest once they fall due. A request mixing both counts
        both."""
        parts: Sequence[int] = self.some_healthy() if self.faulty else range(len(self._base))
        scheduled = 0 if request.payloads else sum(1 for new in request.items if new.enqueue_at_us >= schedule_from)
        if not scheduled:
            counts = [self._peek(p).ready for p in parts]
        elif scheduled == len(request.items):
            counts = [self._peek(p).scheduled for p in parts]
        else:
            counts = [self._peek(p).ready + self._peek(p).scheduled for p in parts]
        return parts[counts.index(min(counts))]

    def _group_partition(self, txn: lmdb.Transaction[bytes], request: ProduceRequest) -> int:
        """The partition of the request's groups (storage/ordered_groups.py); every
        grouped item of a request must belong to the same one (ProduceResponse names one
        partition), else INVALID_ARGUMENT naming the first that does not."""
        count = self.store.group_partitions(txn) or len(self._base)
        p = -1
        for index, new in enumerate(request.items):
            if not new.group_key:
                continue
            q = group_partition(new.group_key, count)
            if p < 0:
                p, first = q, index
            elif q != p:
                raise InvalidArgument(
                    f"items[{index}].group_key",
                    f"group {quote(new.group_key)} belongs to partition {q}, and items[{first}]'s group to partition "
                    f"{p}: a request's grouped items go to one partition; produce them in separate requests",
                )
        return p

    def _produce_payloads(
        self, txn: lmdb.Transaction[bytes], request: ProduceRequest, p: int, v: PartitionView, expire: int
    ) -> None:
        """``produce`` of the compact form: payloads only, no keys, stored in bulk."""
        payloads, now = request.payloads, self.now
        first, count = v.next_seq, len(request.payloads)
        prefix = item_id(self.uid, p, 0)[:-1]
        v.take_seqs(count)
        self.store.append_payloads(txn, p, first, payloads, now, expire)
        v.ready += count
        v.produced += count
        v.created_sum += now * count
        v.note_expiry(expire)
        self._ok(request, ProduceResult(p, [prefix + format(seq, "x") for seq in range(first, first + count)]))

    def _produce_bare(
        self, txn: lmdb.Transaction[bytes], request: ProduceRequest, p: int, v: PartitionView, expire: int
    ) -> None:
        """``produce`` of bare payloads (the common case), stored in bulk. Idempotency
        keys are checked item by item as in ``produce``: a key seen within the window,
        or earlier in this request, answers the first item's id and stores nothing."""
        now, keyed = self.now, self.keyed
        since = now - self.config.dedup_window_us
        prefix = item_id(self.uid, p, 0)[:-1]
        first = v.next_seq
        ids: list[str] = []
        payloads: list[bytes] = []
        # key -> (index in ids of the item it stores, when the key was last remembered)
        fresh: dict[str, tuple[int, int]] = {}
        for new in request.items:
            key = new.idempotency_key
            if key and keyed is not None:
                if key in fresh:
                    ids.append(ids[fresh[key][0]])
                    continue
                seen, last_at = keyed.check(txn, key, since)
                if seen is not None:
                    ids.append(seen)
                    continue
                fresh[key] = (len(ids), last_at)
            ids.append(prefix + format(first + len(payloads), "x"))
            payloads.append(new.payload)
        count = len(payloads)
        if count:
            v.take_seqs(count)
            self.store.append_payloads(txn, p, first, payloads, now, expire)
            v.ready += count
            v.produced += count
            v.created_sum += now * count
            v.note_expiry(expire)
        if fresh and keyed is not None:
            keyed.remember_all(txn, now, [(key, ids[index], last_at) for key, (index, last_at) in fresh.items()])
            self.dedup_added = True
        self._ok(request, ProduceResult(p, ids, len(ids) - count))

    # -- lease ---------------------------------------------------------------------

    def lease(self, txn: lmdb.Transaction[bytes], requests: list[LeaseRequest]) -> None:
        """Share the ready items among ``requests`` (oldest first), round-robin."""
        if self.keyed is not None and any(r.lease_key for r in requests):
            fresh: list[LeaseRequest] = []
            for request in requests:
                if not request.lease_key:
                    fresh.append(request)
                    continue
                replayed: list[bool] = []
                self.apply(txn, request, partial(self._replay_key, request=request, replayed=replayed))
                if not replayed:
                    fresh.append(request)
            requests = fresh
        if any(r.room is not None for r in requests):
            requests = self._with_room(requests)
        wanted = [r.batch_size for r in requests]
        if self.config.paused:
            # Nothing handed out: unkeyed leases park (answered empty at their timeout,
            # served by the first cycle after the resume), keyed ones answer empty.
            quotas = [0] * len(requests)
        elif (total := self.ready_total()) >= sum(wanted):
            quotas = wanted
        else:
            quotas = _water_fill(wanted, total)
        for request, quota in zip(requests, quotas):
            self.apply(txn, request, partial(self._serve_lease, request=request, quota=quota))

    def _replay_key(self, txn: lmdb.Transaction[bytes], request: LeaseRequest, replayed: list[bool]) -> None:
        """Answer a lease key seen before (``replayed`` gets True); a new key is left alone."""
        assert self.keyed is not None
        record = self.keyed.lease_key(txn, request.lease_key)
        if record is not None:
            replayed.append(True)
            self._replay(txn, request, record)

    def _serve_lease(self, txn: lmdb.Transaction[bytes], request: LeaseRequest, quota: int) -> None:
        granted = self._lease_one(txn, request, quota) if quota else None
        if granted is not None:
            return
        if request.lease_key and self.keyed is not None:
            # A keyed lease does not wait: it records that it found nothing, so a
            # replay of the key answers nothing too, never items that came later.
            self.keyed.put_lease_key(txn, request.lease_key, LeaseKeyRecord(self.now, 0, ()), new=True)
            self.lease_keys_added = True
            self._ok(request, LeaseResult(0))
        else:
            self.unserved.append(request)

    def _with_room(self, requests: list[LeaseRequest]) -> list[LeaseRequest]:
        """The leases whose answers have room to be sent. The others are answered
        ``no_room`` at once, leasing nothing: their caller waits for room and asks again."""
        kept: list[LeaseRequest] = []
        for request in requests:
            if request.room is None or request.room.room() > 0:
                kept.append(request)
            else:
                self._ok(request, LeaseResult(0, no_room=True))
        return kept

    def _lease_one(self, txn: lmdb.Transaction[bytes], request: LeaseRequest, quota: int) -> LeaseResult | None:
        partitions = self.healthy() if self.faulty else range(len(self._base))
        if not partitions:  # every partition faulty: the lease waits, as for a full disk
            return None
        p = max(partitions, key=lambda i: self._peek(i).ready)
        if not self._peek(p).ready:
            return None
        self.at = p  # self.enter(p), inlined
        if self.faulty or self.broken:
            self.refuse(p)
        v = self.view(p)
        room = request.room
        budget = request.max_bytes
        if room is not None:
            budget = min(budget, room.room())
            if budget <= 0:  # earlier leases of this cycle took the stream's room
                no_room = LeaseResult(0, no_room=True)
                self._ok(request, no_room)
                return no_room
        used = 0
        now = self.now
        deadline = now + self.config.lease_timeout_us
        taken: list[tuple[int, bytes]] = []
        result = LeaseResult(p)
        ids, payloads, attempts, created_at = result.ids, result.payloads, result.attempts, result.created_at
        last_seq = v.ready_hint - 1
        floor = _NO_FLOOR  # the lowest seq a dead head's group moved into the FIFO
        leaser = plain_leaser(
            now=now, max_attempts=self.config.max_attempts, deadline=deadline, key_bytes=request.lease_key.encode()
        )
        # An unkeyed lease takes plain items by one lease record (storage/lease_records.py),
        # leaving their records as they are; the other items, and a keyed lease's, are
        # rewritten as leased.
        by_record = not request.lease_key
        held = v.leases.held
        recorded: list[int] = []
        expires: list[int] = []
        recorded_created = 0
        id_format = item_id(self.uid, p, 0)[:-1] + "%x"
        deadline_runs = self.lease_deadline_runs
        # Items of priority 1 to 9 first, from the priority index, while it holds any;
        # then (and for a queue that never used priorities, only) the FIFO walk.
        ranked = ranked_at_start = v.ranked > 0
        run: LeasedRun | RecordRun
        while len(ids) < quota:
            if ranked:
                run = self.store.lease_ranked(
                    txn, p, quota - len(ids), leaser, budget - used, ITEM_REPLY_OVERHEAD, take_first=not ids
                )
                v.ranked = max(0, v.ranked - len(run.seqs))
            else:
                run = self._fifo_run(
                    txn, p, last_seq + 1, quota - len(ids), budget - used, not ids, held, None if by_record else leaser
                )
                if isinstance(run, RecordRun) and run.seqs:
                    recorded.extend(run.seqs)
                    expires.extend(run.expires)
                    recorded_created += sum(run.created_at)
            used += run.size
            if run.seqs:
                ids.extend(map(id_format.__mod__, run.seqs))
                payloads.extend(run.payloads)
                attempts.extend(run.attempts)
                created_at.extend(run.created_at)
                taken.extend(zip(run.seqs, run.records))
                deadline_runs.append((deadline, p, run.seqs))
            if ranked:
                if run.other is None:
                    if run.full or len(ids) >= quota:
                        break
                    # The index ran out: nothing above priority 0 is ready.
                    ranked = False
                    v.ranked = 0
                    continue
            else:
                last_seq = max(last_seq, run.last_seq)
                if run.other is None:
                    break
            seq, raw = run.other
            cost = len(raw) + _DETAILED_ITEM_OVERHEAD
            if ids and used + cost > budget:
                if not ranked:
                    last_seq = seq - 1  # it stays ready, where the next lease starts
                break
            cost, low = self._lease_declined(txn, p, v, request, seq, raw, deadline, result, taken)
            used += cost
            floor = min(floor, low)
        if not ids:
            return None
        record = self._open_record(txn, p, v, recorded, expires, recorded_created, deadline) if recorded else None
        if ranked_at_start or result.priorities:
            _note_priorities(result, taken)
        if room is not None and not request.future.done():  # a gone caller settles nothing
            room.take(used)
            request.charged += used
        count = len(ids)
        result.lease_deadlines = [deadline] * count
        v.ready -= count
        v.leased += count
        v.leased_at_sum += now * count
        v.ready_hint = min(floor, last_seq + 1)
        if request.lease_key and self.keyed is not None:
            keyed = LeaseKeyRecord(now, p, tuple(seq for seq, _ in taken))
            self.keyed.put_lease_key(txn, request.lease_key, keyed, new=True)
            self.lease_keys_added = True
        else:
            # A keyed lease is not taken back when its caller vanishes: the caller
            # replays the key and gets the same items.
            self._granted.append((request, p, taken, record))
        self._ok(request, result)
        return result

    def _fifo_run(
        self,
        txn: lmdb.Transaction[bytes],
        p: int,
        from_seq: int,
        quota: int,
        max_bytes: int,
        take_first: bool,
        held: dict[int, int],
        leaser: PlainLeaser | None,
    ) -> LeasedRun | RecordRun:
        """The next run of the FIFO walk: for a lease record (``leaser`` None), its
        items left as they are; else rewritten as leased by ``leaser``."""
        if leaser is None:
            return lease_walk(
                txn,
                self.store.db(p),
                from_seq,
                quota,
                now=self.now,
                max_attempts=self.config.max_attempts,
                max_bytes=max_bytes,
                item_overhead=ITEM_REPLY_OVERHEAD,
                take_first=take_first,
                skip=held,
            )
        return self.store.lease_run(
            txn, p, from_seq, quota, leaser, max_bytes, ITEM_REPLY_OVERHEAD, take_first=take_first, skip=held
        )

    def _open_record(
        self,
        txn: lmdb.Transaction[bytes],
        p: int,
        v: PartitionView,
        seqs: list[int],
        expires: list[int],
        created: int,
        deadline: int,
    ) -> LeaseRecord:
        """Write the lease record of the plain items ``seqs`` a lease took."""
        record = lease_records.build(seqs, expires, created, deadline, self.now)
        lease_records.put(txn, self.store.db(p), record)
        v.leases.open(record)
        self.records_written += 1
        return record

    def _lease_declined(
        self,
        txn: lmdb.Transaction[bytes],
        p: int,
        v: PartitionView,
        request: LeaseRequest,
        seq: int,
        raw: bytes,
        deadline: int,
        result: LeaseResult,
        taken: list[tuple[int, bytes]],
    ) -> tuple[int, int]:
        """Lease the ready item the plain leaser declined (strings, a lease key, a
        history, a group), or dead-letter it if it may not be leased again. Returns
        what it adds to the lease's byte budget, and the seq at which a dead head's
        group moved its next item into the FIFO behind the scan (``_NO_FLOOR``: none)."""
        now = self.now
        state = read_state(raw)
        reason = self._death_reason(state)
        if reason:  # expired or out of attempts: never leased again
            item = Item.decode(raw)
            self.store.delete(txn, p, seq, item)
            v.ready -= 1
            v.created_sum -= item.created_at
            hint = v.ready_hint
            self._dead_letter(txn, p, seq, item, item_id(self.uid, p, seq), reason, DEATH_CODES[reason])
            return 0, (v.ready_hint if v.ready_hint < hint else _NO_FLOOR)
        if state.lease_key or request.lease_key:
            # Tagged items change their tag (and their old key loses them).
            if state.lease_key and state.lease_key != request.lease_key:
                self._untag(txn, state.lease_key, seq)
            leased = with_lease_key(
                raw, attempts=state.attempts + 1, deadline=deadline, leased_at=now, lease_key=request.lease_key
            )
        else:
            leased = with_lease(raw, state, attempts=state.attempts + 1, deadline=deadline, leased_at=now)
        if state.group_key:
            v.groups_in_flight += 1
        self.store.put_raw(txn, p, seq, leased)
        self.store.unrank(txn, p, seq, raw)
        taken.append((seq, raw))
        result.add(item_id(self.uid, p, seq), Item.decode(leased))
        self.lease_deadlines.append((deadline, p, seq))
        return len(raw) + _DETAILED_ITEM_OVERHEAD, _NO_FLOOR

    def _replay(self, txn: lmdb.Transaction[bytes], request: LeaseRequest, record: LeaseKeyRecord) -> None:
        """Answer a repeated lease key with the items still leased under it.

        Items whose lease expired and that are ready again are leased again; items
        that left the key (completed, leased by others, dead-lettered) are dropped.
        """
        key, p, now = request.lease_key, record.partition, self.now
        if p >= len(self._base):
            self._ok(request, LeaseResult(0))
            return
        self.enter(p)
        v = self.view(p)
        deadline = now + self.config.lease_timeout_us
        result = LeaseResult(p)
        kept: list[int] = []
        used = 0
        for seq in record.seqs:
            raw = self.store.get_raw(txn, p, seq)
            state = read_state(raw) if raw is not None else None
            if raw is None or state is None or state.lease_key != key:
                continue
            if not state.is_leased:
                if self._death_reason(state):
                    continue  # the lease scan or the lifecycle dead-letters it
                if self.config.paused:  # stays the key's, leased again by a replay after the resume
                    kept.append(seq)
                    continue
                self.store.unrank(txn, p, seq, raw)
                raw = with_lease_key(raw, attempts=state.attempts + 1, deadline=deadline, leased_at=now, lease_key=key)
                self.store.put_raw(txn, p, seq, raw)
                if state.group_key:
                    v.groups_in_flight += 1
                v.ready -= 1
                v.leased += 1
                v.leased_at_sum += now
                self.lease_deadlines.append((deadline, p, seq))
            result.add(item_id(self.uid, p, seq), Item.decode(raw))
            kept.append(seq)
            used += len(raw) + _DETAILED_ITEM_OVERHEAD
        if request.room is not None and not request.future.done():
            request.room.take(used)
            request.charged += used
        if tuple(kept) != record.seqs:
            assert self.keyed is not None
            self.keyed.put_lease_key(txn, key, record._replace(seqs=tuple(kept)), new=False)
        self._ok(request, result)

    def complete_before_lease(self, txn: lmdb.Transaction[bytes], requests: list[LeaseRequest]) -> list[LeaseRequest]:
        """Apply the completions that leases carry; return the leases still to serve.

        A lease whose completion fails is answered with that error and leases nothing.
        """
        kept: list[LeaseRequest] = []
        for request in requests:
            if request.complete_ids:
                done = partial(self._complete, p=request.complete_partition, ids=request.complete_ids, field="complete_ids")
                if not self.apply(txn, request, done):
                    continue
                self.completed_by_lease.append(request)
            kept.append(request)
        return kept

    def fence_leases(self, txn: lmdb.Transaction[bytes], now: int) -> None:
        """Take back leases whose caller hung up or ran out of time before the commit."""
        for request, p, taken, record in self._granted:
            gone = request.future.done() or (request.deadline_us and now >= request.deadline_us - FENCE_MARGIN_US)
            if not gone:
                continue
            v = self.view(p)
            recorded: set[int] = set()
            if record is not None:  # its items' records are as they were: the record goes
                lease_records.delete(txn, self.store.db(p), record.first)
                v.leases.close(record.first)
                recorded.update(record.seqs())
            for seq, raw in taken:
                v.ready_hint = min(v.ready_hint, seq)
                if seq in recorded:
                    continue
                v.ranked += self.store.put_ready(txn, p, seq, raw)
                if grouped(raw):
                    v.groups_in_flight -= 1
            v.ready += len(taken)
            v.leased -= len(taken)
            v.leased_at_sum -= self.now * len(taken)
            taken_seqs = {seq for seq, _ in taken}
            self.lease_deadlines = [d for d in self.lease_deadlines if d[1] != p or d[2] not in taken_seqs]
            self.lease_deadline_runs = [
                (d, q, seqs if q != p else [seq for seq in seqs if seq not in taken_seqs])
                for d, q, seqs in self.lease_deadline_runs
            ]
            # The caller is gone or too late; answer (if anyone listens) with nothing.
            self.results = [(r, LeaseResult(p) if r is request else res) for r, res in self.results]

    def give_back(self, txn: lmdb.Transaction[bytes], request: GiveBackRequest) -> None:
        """Undo the leases of an answer that was never delivered (see GiveBackRequest)."""
        p = request.partition
        self.enter(p)  # a faulty partition: its leases run out once it works again
        v = self.view(p)
        prefix = f"{self.uid:x}.{p:x}."
        given = 0
        if v.leases:
            self._write_out(txn, p, _seqs_of(request.ids, self.uid, p))
        for text in request.ids:
            seq_hex = text[len(prefix) :]
            if not text.startswith(prefix) or not seq_hex or len(seq_hex) > 16 or seq_hex.strip(_HEX_DIGITS):
                continue
            seq = int(seq_hex, 16)
            raw = self.store.get_raw(txn, p, seq)
            if raw is None:
                continue
            state = read_state(raw)
            if not state.is_leased or state.lease_deadline != request.lease_deadline_us or state.lease_key:
                continue  # completed, taken back, extended or re-leased since: not ours to give
            attempts = max(0, state.attempts - 1)
            given += 1
            if request.reached:
                item = Item.decode(raw)
                self._end_lease(txn, p, seq, item)
                item.attempts = attempts
                self._requeue(txn, p, item, seq)
                continue
            v.ranked += self.store.put_ready(txn, p, seq, without_lease(raw, state, attempts=attempts))
            if state.group_key:
                v.groups_in_flight -= 1
            self.lease_ends.append((p, seq))
            v.ready += 1
            v.leased -= 1
            v.leased_at_sum -= state.leased_at
            v.ready_hint = min(v.ready_hint, seq)
        self._ok(request, given)

    # -- complete / retry / extend ----------------------------------------------------

    def _leased_items(
        self,
        txn: lmdb.Transaction[bytes],
        partition: int,
        ids: Sequence[str],
        *,
        check_deadline: bool = False,
        field: str = "ids",
        done: tuple[int, ...] = (),
        already: list[tuple[str, int]] | None = None,
    ) -> list[tuple[int, bytes, ItemState]]:
        """Look up every id as a leased item of ``partition``: (seq, raw, state) for
        all of them, or an error naming each id that is not. With ``done``, an id
        this partition recently ended in one of those ways (done_runs.py) is no error:
        it goes to ``already`` as (id, how)."""
        found: list[tuple[int, bytes, ItemState]] = []
        missing: list[str] = []
        gone: list[tuple[int, str, int]] = []  # (index, id, seq) of ids not stored
        unleased: list[str] = []
        lost: list[str] = []
        if self._peek(partition).leases:
            self._write_out(txn, partition, _seqs_of(ids, self.uid, partition))
        read = self.store.reader(txn, partition)
        # The ids we issue for this partition's items: the prefix, then the seq in hex.
        prefix = f"{self.uid:x}.{partition:x}."
        start = len(prefix)
        for index, text in enumerate(ids):
            seq_hex = text[start:]
            if text.startswith(prefix) and len(seq_hex) <= 16 and seq_hex and not seq_hex.strip(_HEX_DIGITS):
                seq, due, ref = int(seq_hex, 16), 0, None
                raw = read(seq)  # the common case, without parse_id's and _lookup's work
            else:
                ref = parse_id(text)
                seq, due = (ref.seq, ref.due) if ref is not None else (0, 0)
                raw = self._lookup(txn, partition, ref)
            if raw is None:
                ours = ref is None or (ref.uid == self.uid and ref.partition == partition and not ref.due)
                if done and seq and ours:
                    gone.append((index, text, seq))
                else:
                    missing.append(f"{field}[{index}] {quote(text)}")
                continue
            state = read_state(raw)
            if due or not state.is_leased:
                unleased.append(f"{field}[{index}] {quote(text)}")
            elif check_deadline and min(state.lease_deadline, state.expire_deadline) <= self.now:
                lost.append(f"{field}[{index}] {quote(text)}")
            else:
                found.append((seq, raw, state))
        if gone:  # only an id sent again pays for this look
            ended = done_runs.find(txn, self.store.db(partition), [seq for _i, _t, seq in gone])
            for index, text, seq in gone:
                how = ended.get(seq, 0)
                if how in done and already is not None:
                    already.append((text, how))
                else:
                    missing.append(f"{field}[{index}] {quote(text)}")
        if missing:
            raise NotFound(_listing("no such item (completed, moved or never produced)", missing))
        if unleased:
            raise FailedPrecondition(_listing("item is not leased", unleased))
        if lost:
            raise FailedPrecondition(_listing("lease (or item) has expired", lost))
        return found

    def _lookup(self, txn: lmdb.Transaction[bytes], partition: int, ref: ItemRef | None) -> bytes | None:
        if ref is None or ref.uid != self.uid or ref.partition != partition:
            return None
        if ref.due:  # a scheduled item exists but is never leased
            raw: bytes | None = txn.get(scheduled_key(ref.due, ref.seq), db=self.store.db(partition))
            return raw
        return self.store.get_raw(txn, partition, ref.seq)

    def complete(self, txn: lmdb.Transaction[bytes], request: CompleteRequest) -> None:
        if self.faulty and request.lease_keys:
            self._refuse_faulty_keys(txn, request.lease_keys)
        already: list[str] = []
        if request.ids:
            already = self._complete(txn, request.partition, request.ids)
        by_keys = self._complete_keys(txn, request.lease_keys)
        self._ok(request, CompleteResult(already, by_keys))

    def _complete(self, txn: lmdb.Transaction[bytes], p: int, ids: Sequence[str], field: str = "ids") -> list[str]:
        """Complete ``ids``; the ones completed before (a Complete sent again)."""
        self.at = p  # self.enter(p), inlined
        if self.faulty or self.broken:
            self.refuse(p)
        if self._complete_run(txn, p, ids):
            return []
        already: list[tuple[str, int]] = []
        found = self._leased_items(txn, p, ids, field=field, done=(done_runs.COMPLETED,), already=already)
        self._remove_leased(txn, p, [(seq, state) for seq, _raw, state in found])
        self._note_done(txn, p, [seq for seq, _raw, _state in found], done_runs.COMPLETED)
        for seq, _raw, state in found:
            if state.lease_key:
                self._untag(txn, state.lease_key, seq)
        return [text for text, _how in already]

    def _note_done(self, txn: lmdb.Transaction[bytes], p: int, seqs: Sequence[int], how: int) -> None:
        """Remember how items ``seqs`` of ``p`` ended, one record per run (done_runs.py)."""
        db = self.store.db(p)
        for first, last in done_runs.runs(seqs):
            done_runs.put(txn, db, first, last, self.now, how)
        if seqs:
            self.done_added = True

    def _complete_run(self, txn: lmdb.Transaction[bytes], p: int, ids: Sequence[str]) -> bool:
        """Complete ``ids`` in one pass if they are what a plain lease hands out: the ids
        of neighbouring items of ``p``, in order. False, having changed nothing, for
        anything else (the item-by-item path then checks and names each id)."""
        prefix = f"{self.uid:x}.{p:x}."
        start = len(prefix)
        first_hex, last_hex = ids[0][start:], ids[-1][start:]
        if not (
            ids[0].startswith(prefix)
            and 0 < len(first_hex) <= 16
            and 0 < len(last_hex) <= 16
            and not (first_hex + last_hex).strip(_HEX_DIGITS)
        ):
            return False
        first, last = int(first_hex, 16), int(last_hex, 16)
        # The ids a lease of first..last issues, exactly (one string compare each, in C).
        if last - first + 1 != len(ids) or list(ids) != list(map((prefix + "%x").__mod__, range(first, last + 1))):
            return False
        book = self._peek(p).leases
        if book:
            record = book.records.get(first)
            if record is not None and record.last == last and record.contiguous:
                self._complete_lease(txn, p, record)
                return True
        done = self.store.complete_run(txn, p, first, last)
        if done is None:
            return False
        done_runs.put(txn, self.store.db(p), first, last, self.now, done_runs.COMPLETED)
        self.done_added = True
        created, leased_at = done
        self.lease_end_runs.append((p, range(first, last + 1)))
        v = self.view(p)
        v.leased -= len(ids)
        v.completed += len(ids)
        v.created_sum -= created
        v.leased_at_sum -= leased_at
        return True

    def _complete_lease(self, txn: lmdb.Transaction[bytes], p: int, record: LeaseRecord) -> None:
        """Complete the whole lease of ``record``: its items and the record go unread."""
        db = self.store.db(p)
        lease_records.complete(txn, db, record)
        done_runs.put(txn, db, record.first, record.last, self.now, done_runs.COMPLETED)
        self.done_added = True
        self.records_completed += 1
        count = record.count
        self.lease_end_runs.append((p, range(record.first, record.last + 1)))
        v = self.view(p)
        v.leases.close(record.first)
        v.leased -= count
        v.completed += count
        v.created_sum -= record.created_sum
        v.leased_at_sum -= record.leased_at * count

    def _complete_keys(self, txn: lmdb.Transaction[bytes], keys: Sequence[str]) -> int:
        """Complete every item still leased under each key; forget the keys. Idempotent.
        Returns how many items that completed."""
        if self.keyed is None:
            return 0
        count = 0
        for key in keys:
            record = self.keyed.lease_key(txn, key)
            if record is None:
                continue
            p = record.partition
            if p < len(self._base):
                self.enter(p)
                found = self.store.leased_under(txn, p, record.seqs, key)
                self._remove_leased(txn, p, found)
                self._note_done(txn, p, [seq for seq, _state in found], done_runs.COMPLETED)
                count += len(found)
            self.keyed.drop_lease_key(txn, key)
        return count

    def _refuse_faulty_keys(self, txn: lmdb.Transaction[bytes], keys: Sequence[str]) -> None:
        """Answer UNAVAILABLE, before anything is written, if a key's items are on a
        faulty partition (a request is applied whole or not at all)."""
        if self.keyed is None:
            return
        for key in keys:
            record = self.keyed.lease_key(txn, key)
            if record is not None and record.partition in self.faulty:
                raise self.faulty_error(record.partition, self.faulty[record.partition])

    def retry(self, txn: lmdb.Transaction[bytes], request: RetryRequest) -> None:
        p = request.partition
        self.enter(p)
        already: list[tuple[str, int]] = []
        found = self._leased_items(
            txn, p, [o.item_id for o in request.orders], done=(done_runs.RETRIED, done_runs.RETRIED_DEAD), already=already
        )
        sent_again = {text for text, _how in already}
        orders = [o for o in request.orders if o.item_id not in sent_again] if already else request.orders
        dead: list[str] = []
        dead_seqs: list[int] = []
        for (seq, raw, _state), order in zip(found, orders):
            item = Item.decode(raw)
            old_id = item_id(self.uid, p, seq)
            self._end_lease(txn, p, seq, item)
            if order.error:
                item.last_error, item.last_error_at = order.error, self.now
            reason = "retried as dead" if order.dead else self._death_reason(item)
            if reason:
                dead.append(order.item_id)
                dead_seqs.append(seq)
                self._dead_letter(txn, p, seq, item, old_id, reason, DEAD_RETRIED if order.dead else DEATH_CODES[reason])
            elif order.retry_at_us >= self.now + SCHEDULE_MIN_US:
                self._schedule(txn, p, item, order.retry_at_us, seq)
            else:
                self._requeue(txn, p, item, seq)
        dead_set = set(dead_seqs)
        self._note_done(txn, p, [seq for seq, _raw, _state in found if seq not in dead_set], done_runs.RETRIED)
        self._note_done(txn, p, dead_seqs, done_runs.RETRIED_DEAD)
        # Sent again: answered as the first time (those that went dead are named again).
        dead.extend(text for text, how in already if how == done_runs.RETRIED_DEAD)
        self._ok(request, RetryResult(dead, [text for text, _how in already]))

    def extend(self, txn: lmdb.Transaction[bytes], request: ExtendRequest) -> None:
        p = request.partition
        if self.faulty and request.lease_keys:
            self._refuse_faulty_keys(txn, request.lease_keys)
        if request.ids:
            self.enter(p)
        found = self._leased_items(txn, p, request.ids, check_deadline=True) if request.ids else []
        timeout = request.lease_timeout_us or self.config.lease_timeout_us
        deadlines = [self._extend_one(txn, p, seq, raw, state, timeout) for seq, raw, state in found]
        by_keys = 0
        for key in request.lease_keys if self.keyed is not None else ():
            record = self.keyed.lease_key(txn, key)  # type: ignore[union-attr]
            if record is None or record.partition >= len(self._base):
                continue
            self.enter(record.partition)
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

    def _extend_one(self, txn: lmdb.Transaction[bytes], p: int, seq: int, raw: bytes, state: ItemState, timeout: int) -> int:
        deadline = min(self.now + timeout, state.expire_deadline)
        self.store.put_raw(
            txn, p, seq, with_lease(raw, state, attempts=state.attempts, deadline=deadline, leased_at=state.leased_at)
        )
        self.lease_deadlines.append((deadline, p, seq))
        return deadline


def _note_priorities(result: LeaseResult, taken: list[tuple[int, bytes]]) -> None:
    """Set ``result.priorities`` from the leased records (left empty when all are 0)."""
    priorities = [priority_of(raw) for _, raw in taken]
    result.priorities = priorities if any(priorities) else []


def _seqs_of(ids: Sequence[str], uid: int, p: int) -> list[int]:
    """The seqs of partition ``p`` that ``ids`` name (ids of other kinds left out)."""
    prefix = f"{uid:x}.{p:x}."
    start = len(prefix)
    seqs: list[int] = []
    for text in ids:
        seq_hex = text[start:]
        if text.startswith(prefix) and seq_hex and len(seq_hex) <= 16 and not seq_hex.strip(_HEX_DIGITS):
            seqs.append(int(seq_hex, 16))
            continue
        ref = parse_id(text)
        if ref is not None and ref.uid == uid and ref.partition == p and not ref.due:
            seqs.append(ref.seq)
    return seqs


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


def _bare(items: Sequence[NewItem], schedule_from: int) -> bool:
    """Whether every item is a payload to store now (idempotency keys allowed; no
    strings, metadata, priority or schedule)."""
    for new in items:
        if (
            new.encoding
            or new.kind
            or new.reference
            or new.metadata
            or new.group_key
            or new.priority
            or new.enqueue_at_us >= schedule_from
        ):
            return False
    return bool(items)
