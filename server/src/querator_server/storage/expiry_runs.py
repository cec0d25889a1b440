"""The expiry index's runs (record.py): one entry ``x`` + deadline + first item key ->
last seq for a batch of items produced together with one deadline. An entry goes once
none of its items is stored any more; the paths that delete items find it here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lmdb

from .record import TAG_ITEM, decode_u64, encode_u64, expiry_key, expiry_prefix, item_key

_RUN_KEY_SIZE = len(expiry_key(0, item_key(0)))


def find_run(cursor: Any, deadline: int, seq: int) -> tuple[int, int] | None:
    """(first, last) of the expiry run with this deadline that holds ``seq``, leaving
    ``cursor`` on its entry; None when there is none."""
    start = expiry_prefix(deadline) + TAG_ITEM
    # The run holding seq is the last entry at or before (deadline, seq).
    if cursor.set_range(start + encode_u64(seq + 1)):
        if not cursor.prev():
            return None
    elif not cursor.last():
        return None
    key = cursor.key()
    if len(key) != _RUN_KEY_SIZE or not key.startswith(start):
        return None
    value = cursor.value()
    if len(value) != 8:
        return None  # one item's own entry, not a run
    first, last = decode_u64(key[len(start) :]), decode_u64(value)
    return (first, last) if first <= seq <= last else None


def drop_empty_runs(txn: lmdb.Transaction[bytes], db: Any, left: Iterable[tuple[int, int]]) -> None:
    """Delete the expiry runs of these items, (deadline, seq) each, that no longer
    hold any stored item. Items of one run in a row cost one lookup."""
    index, items = txn.cursor(db=db), txn.cursor(db=db)
    run_deadline = run_first = 0
    run_last = -1
    for deadline, seq in left:
        if deadline == run_deadline and run_first <= seq <= run_last:
            continue
        found = find_run(index, deadline, seq)
        if found is None:
            continue
        run_deadline, (run_first, run_last) = deadline, found
        if not (items.set_range(item_key(run_first)) and items.key() <= item_key(run_last)):
            index.delete()


def drop_empty_runs_over(txn: lmdb.Transaction[bytes], db: Any, deadline: int, first: int, last: int) -> None:
    """``drop_empty_runs`` for the items ``first``..``last``, all indexed by runs with
    this deadline: one lookup per run they span, however many items."""
    index, items = txn.cursor(db=db), txn.cursor(db=db)
    seq = first
    while seq <= last:
        found = find_run(index, deadline, seq)
        if found is None:
            seq += 1
            continue
        run_first, run_last = found
        if not (items.set_range(item_key(run_first)) and items.key() <= item_key(run_last)):
            index.delete()
        seq = run_last + 1
