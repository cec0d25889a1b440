"""Storage requests in a cycle: list, import, delete and clear items."""

from __future__ import annotations

import lmdb

from ..model import ITEM_REPLY_OVERHEAD, REPLY_ITEMS_BYTES, SCHEDULE_MIN_US
from ..storage import Item
from .cycle_base import CycleBase
from .ids import item_id, parse_id, scheduled_id
from .requests import (
    ClearRequest,
    DeleteItemsRequest,
    ImportItemsRequest,
    ListItemsRequest,
    PageResult,
    StoredItem,
)
from .view import PartitionView


class StorageSteps(CycleBase):
    def list_items(self, txn: lmdb.Transaction[bytes], request: ListItemsRequest) -> None:
        """A page of up to ``limit`` items, cut before the item that would take the
        reply past REPLY_ITEMS_BYTES (one item always fits)."""
        p = request.partition
        self.enter(p)
        out: list[StoredItem] = []
        cursors: list[tuple[int, int]] = []
        if request.scheduled:
            rows = self.store.page_scheduled(txn, p, request.after, request.limit + 1)
            listed = [(scheduled_id(self.uid, p, seq, due), item, (due, seq)) for due, seq, item in rows]
        else:
            page = self._as_leased(p, self.store.page_items(txn, p, request.after[0], request.limit + 1))
            listed = [(item_id(self.uid, p, seq), item, (seq, 0)) for seq, item in page]
        size = 0
        for stored_id, item, cursor in listed[: request.limit]:
            size += _reply_size(item)
            if size > REPLY_ITEMS_BYTES and out:
                break
            out.append(StoredItem(stored_id, item))
            cursors.append(cursor)
        more = len(out) < len(listed)
        self._ok(request, PageResult(out, cursors[-1] if more else None, cursors))

    def import_items(self, txn: lmdb.Transaction[bytes], request: ImportItemsRequest) -> None:
        p = request.partition
        self.enter(p)
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
                metadata=given.metadata,
                created_at=given.created_at_us or now,
                expire_deadline=given.expire_deadline_us or now + self.config.expire_timeout_us,
                enqueue_at=given.enqueue_at_us,
                attempts=given.attempts,
                message_id=given.message_id,
                dead_reason=given.dead_reason,
                dead_at=given.dead_at_us,
                dead_attempts=given.dead_attempts,
                last_error=given.last_error,
                last_error_at=given.last_error_at_us,
                priority=given.priority,
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
                v.ranked += 1 if item.priority else 0
            v.created_sum += item.created_at
            self.store.append(txn, p, seq, item)
            ids.append(item_id(self.uid, p, seq))
        self._ok(request, ids)

    def delete_items(self, txn: lmdb.Transaction[bytes], request: DeleteItemsRequest) -> None:
        p = request.partition
        self.enter(p)
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
                    if item.group_key:  # a head held by a delayed retry
                        self._release_group(txn, p, item.group_key)
                continue
            self._write_out(txn, p, (ref.seq,))
            item = self.store.get(txn, p, ref.seq)
            if item is None:
                continue
            self.store.delete(txn, p, ref.seq, item)
            v.created_sum -= item.created_at
            if item.is_leased:
                v.leased -= 1
                v.leased_at_sum -= item.leased_at
                self.lease_ends.append((p, ref.seq))
                if item.group_key:
                    v.groups_in_flight -= 1
            else:
                v.ready -= 1
            if item.group_key:
                self._release_group(txn, p, item.group_key)
        self._ok(request, None)

    def clear(self, txn: lmdb.Transaction[bytes], request: ClearRequest) -> None:
        if self.faulty:  # all or nothing: refused before anything is cleared
            p = min(self.faulty)
            raise self.faulty_error(p, self.faulty[p])
        for p in range(len(self._base)):
            self.enter(p)
            removed = self.store.clear(
                txn,
                p,
                ready=request.ready,
                leased=request.ready and request.destructive,
                scheduled=request.scheduled,
            )
            self.lease_ends.extend((p, seq) for seq in removed)
            scan = self.store.scan(txn, p)
            v = self.view(p)
            fresh = PartitionView.from_scan(scan)
            fresh.next_seq = v.next_seq
            fresh.seq_dirty = v.seq_dirty
            fresh.produced, fresh.completed = v.produced, v.completed
            self.views[p] = fresh
        self._ok(request, None)


def _reply_size(item: Item) -> int:
    """A bound on what ``item`` takes in a listing reply."""
    size = len(item.payload) + ITEM_REPLY_OVERHEAD
    for text in (item.reference, item.encoding, item.kind, item.source_id, item.message_id, item.last_error):
        if text:
            size += len(text.encode())
    for name, value in item.metadata.items():
        size += len(name.encode()) + len(value.encode()) + 11
    return size
