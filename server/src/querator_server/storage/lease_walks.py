"""The walks that lease ready items of a partition: a FIFO run from a seq on
(``lease_run``), and the priority index, highest first (``lease_ranked``). Each
rewrites the records it leases through the cursor that found them (or leaves them for
a lease record to hold) and stops at the reply's byte limit."""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import lmdb

from .queue_env import QueueEnv
from .record import (
    _FLAG_LEASED,
    TAG_ITEM,
    TAG_PRIORITY,
    PlainLeaser,
    item_key,
    parse_priority_key,
    priority_of,
    seq_of_item_key,
)


@dataclass(slots=True)
class LeasedRun:
    """What ``lease_run`` leased, oldest first, as parallel lists."""

    seqs: list[int] = field(default_factory=list)
    # Each item's record as it was before the lease (put back if the lease is fenced).
    records: list[bytes] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    created_at: list[int] = field(default_factory=list)
    # The last ready seq looked at, 0 for none.
    last_seq: int = 0
    # The ready item the run stopped at, which the leaser declined: (seq, record).
    other: tuple[int, bytes] | None = None
    # What the leased records add up to (with the overhead per item), and whether the
    # run stopped at an item that would have taken it past ``max_bytes``.
    size: int = 0
    full: bool = False


class LeaseWalks(QueueEnv):
    def lease_run(
        self,
        txn: lmdb.Transaction[bytes],
        p: int,
        from_seq: int,
        quota: int,
        lease: Callable[[bytes], tuple[Any, bytes, int, int] | None],
        max_bytes: int,
        item_overhead: int,
        *,
        take_first: bool,
        skip: Container[int] = (),
    ) -> LeasedRun:
        """Lease up to ``quota`` ready items of partition ``p`` from ``from_seq`` on, in
        FIFO order, as ``lease`` rewrites them, until one it declines (``other``) or
        one that would take the records leased past ``max_bytes`` (each record counted
        with ``item_overhead`` more; with ``take_first`` the first item is taken
        whatever its size).

        Each record is rewritten through the cursor that found it, which needs no
        search of the tree, and leased items on the way are skipped by their flag, or,
        when held by a lease record (lease_records.py), by being in ``skip``. A lease
        by record walks with ``lease_records.lease_walk`` instead, which leaves the
        records as they are.
        """
        run = LeasedRun()
        cursor = txn.cursor(db=self._dbs[p])
        if not cursor.set_range(item_key(from_seq)):
            return run
        seqs, records, payloads, attempts, created_at = run.seqs, run.records, run.payloads, run.attempts, run.created_at
        put, seq_of = cursor.put, seq_of_item_key
        seq = 0
        # ``quota`` records of at most ``small`` bytes stay within ``max_bytes``: the sum
        # is kept item by item only from the first longer one on (most runs never see one).
        small = max_bytes // max(quota, 1) - item_overhead
        counting = False
        size = 0
        for key, raw in cursor:
            if key[:1] != TAG_ITEM:
                break
            if raw[0] & _FLAG_LEASED or (skip and seq_of(key) in skip):
                continue
            if counting or len(raw) > small:
                if not counting:
                    counting = True
                    size = sum(map(len, records)) + len(records) * item_overhead
                cost = len(raw) + item_overhead
                if size + cost > max_bytes and (seqs or not take_first):
                    run.full = True
                    break
                size += cost  # an item declined below ends the run: its size is not used
            seq = seq_of(key)
            leased = lease(raw)
            if leased is None:
                run.other = (seq, raw)
                break
            put(key, leased[0])
            seqs.append(seq)
            records.append(raw)
            payloads.append(leased[1])
            attempts.append(leased[2])
            created_at.append(leased[3])
            if len(seqs) >= quota:
                break
        run.last_seq = seq
        run.size = sum(map(len, records)) + len(records) * item_overhead
        return run

    def lease_ranked(
        self,
        txn: lmdb.Transaction[bytes],
        p: int,
        quota: int,
        lease: PlainLeaser,
        max_bytes: int,
        item_overhead: int,
        *,
        take_first: bool,
    ) -> LeasedRun:
        """``lease_run`` over the priority index of partition ``p``: ready items of
        priority 1 to 9, highest first, FIFO within a priority. Each item leased leaves
        the index; ``other`` (declined) stays in it, for the caller to lease or drop.
        ``last_seq`` is 0 when the index ran out (nothing of priority above 0 is
        ready), else the seq the run stopped at.

        An entry whose item is gone, leased or of another priority is dropped.
        """
        run = LeasedRun(last_seq=-1)
        db = self._dbs[p]
        index, items = txn.cursor(db=db), txn.cursor(db=db)
        seqs, records, payloads, attempts, created_at = run.seqs, run.records, run.payloads, run.attempts, run.created_at
        size = 0
        found = index.set_range(TAG_PRIORITY)
        while found:
            key = index.key()
            if key[:1] != TAG_PRIORITY:
                break
            priority, seq = parse_priority_key(key)
            raw = items.value() if items.set_key(item_key(seq)) else None
            if raw is None or raw[0] & _FLAG_LEASED or priority_of(raw) != priority:
                found = index.delete()
                continue
            cost = len(raw) + item_overhead
            if size + cost > max_bytes and (seqs or not take_first):
                run.full = True
                run.last_seq = seq
                break
            leased = lease(raw)
            if leased is None:
                run.other = (seq, raw)
                run.last_seq = seq
                break
            size += cost
            items.put(item_key(seq), leased[0])
            seqs.append(seq)
            records.append(raw)
            payloads.append(leased[1])
            attempts.append(leased[2])
            created_at.append(leased[3])
            found = index.delete()
            if len(seqs) >= quota:
                run.last_seq = seq
                break
        if run.last_seq < 0:
            run.last_seq = 0  # the index ran out
        run.size = size
        return run
