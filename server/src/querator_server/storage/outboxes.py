"""A partition's outboxes: dead letters on their way to the dead-letter queue, and
redriven items on their way to their target queue, each kept until the receiver has
stored them (actor/handover.py)."""

from __future__ import annotations

import lmdb

from .queue_env import QueueEnv
from .record import TAG_ITEM, TAG_OUTBOX, TAG_REDRIVE, Item, decode_u64, encode_u64, outbox_key, redrive_key, seq_of_item_key


class Outboxes(QueueEnv):
    def put_outbox(self, txn: lmdb.Transaction[bytes], p: int, seq: int, item: Item) -> None:
        item.expiry_run = False
        txn.put(outbox_key(seq), item.encode(), db=self._dbs[p])

    def delete_outbox(self, txn: lmdb.Transaction[bytes], p: int, seq: int) -> None:
        txn.delete(outbox_key(seq), db=self._dbs[p])

    def outbox(self, txn: lmdb.Transaction[bytes], p: int) -> list[tuple[int, Item]]:
        cursor = txn.cursor(db=self._dbs[p])
        out: list[tuple[int, Item]] = []
        if not cursor.set_range(TAG_OUTBOX):
            return out
        for key, raw in cursor:
            if key[:1] != TAG_OUTBOX:
                break
            out.append((seq_of_item_key(TAG_ITEM + key[1:]), Item.decode(raw)))
        return out

    # -- the redrive outbox ------------------------------------------------------

    def put_redrive(self, txn: lmdb.Transaction[bytes], p: int, seq: int, target_uid: int, item: Item) -> None:
        item.expiry_run = False
        txn.put(redrive_key(seq), encode_u64(target_uid) + item.encode(), db=self._dbs[p])

    def delete_redrive(self, txn: lmdb.Transaction[bytes], p: int, seq: int) -> None:
        txn.delete(redrive_key(seq), db=self._dbs[p])

    def get_redrive(self, txn: lmdb.Transaction[bytes], p: int, seq: int) -> tuple[int, Item] | None:
        raw = txn.get(redrive_key(seq), db=self._dbs[p])
        return None if raw is None else (decode_u64(raw[:8]), Item.decode(raw[8:]))

    def redrive_outbox(self, txn: lmdb.Transaction[bytes], p: int) -> list[tuple[int, int, Item]]:
        """(seq, target queue uid, item) of every item on its way out of partition ``p``."""
        cursor = txn.cursor(db=self._dbs[p])
        out: list[tuple[int, int, Item]] = []
        if not cursor.set_range(TAG_REDRIVE):
            return out
        for key, raw in cursor:
            if key[:1] != TAG_REDRIVE:
                break
            out.append((seq_of_item_key(TAG_ITEM + key[1:]), decode_u64(raw[:8]), Item.decode(raw[8:])))
        return out
