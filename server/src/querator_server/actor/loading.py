"""Loading a queue's state from its storage at start: every partition read in a
transaction of its own, so one whose database is damaged is faulty (its view empty until
a probe reads it) and the others serve."""

from __future__ import annotations

import os
from dataclasses import dataclass

import lmdb

from ..faults import FAULT_FILE_ENV, InjectedPartitionFault, partition_faults
from ..storage import Item, QueueStore
from .view import PartitionView


@dataclass(slots=True)
class Loaded:
    views: list[PartitionView]
    leases: list[tuple[int, int, int]]  # (deadline, partition, seq)
    outbox: dict[tuple[int, int], Item]  # dead letters not yet handed over
    redrive: dict[tuple[int, int], tuple[int, Item]]  # redriven items: (target uid, item)
    faulty: dict[int, str]  # partition -> why


def load(store: QueueStore) -> Loaded:
    """Read every partition (an error ends the read transaction it happens in)."""
    out = Loaded([], [], {}, {}, {})
    broken = broken_partitions(store)
    for p in range(store.partitions):
        try:
            with store.env.begin() as txn:
                if p in broken:
                    raise InjectedPartitionFault(f"partition {p} is damaged (injected fault)")
                scan = store.scan(txn, p)
                stored = store.outbox(txn, p)
                moving = store.redrive_outbox(txn, p)
        except (lmdb.CorruptedError, lmdb.PageNotFoundError, InjectedPartitionFault) as exc:
            out.faulty[p] = f"its storage failed: {type(exc).__name__}: {exc}"
            out.views.append(PartitionView())
            continue
        out.views.append(PartitionView.from_scan(scan))
        out.leases.extend((deadline, p, seq) for deadline, seq in scan.leases)
        out.outbox.update(((p, seq), item) for seq, item in stored)
        out.redrive.update(((p, seq), (uid, item)) for seq, uid, item in moving)
    return out


def broken_partitions(store: QueueStore) -> frozenset[int]:
    """The partitions the ``partition-error`` fault names now (tests; faults.py)."""
    if not os.environ.get(FAULT_FILE_ENV):
        return frozenset()
    names = partition_faults(store.path)
    if not names:
        return frozenset()
    return frozenset(p for p in range(store.partitions) if store.database_name(p) in names)
