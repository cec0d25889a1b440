"""A queue's storage: one named database per partition, in an LMDB environment of the
queue's own, or under the queue's prefix in a commit group's shared one (groups.py).

A queue's actor is the only writer of its own environment, so LMDB's single-writer
lock is never contended and such a queue commits (and fsyncs) independently of the
others. ``QueueStore`` is put together from a module per role:

- queue_env.py: the environment, its transactions (the held one included), growing,
  closing, each partition's next sequence number;
- item_records.py: item records and their index entries, ordered groups' records;
- lease_walks.py: leasing ready items, FIFO and by priority;
- due_records.py: scheduled items and the expiry index;
- outboxes.py: the dead-letter and redrive outboxes;
- partition_scan.py: a partition read or cleared whole, listing pages.
"""

from __future__ import annotations

from .environment import (
    DIR_MODE,
    FILE_MODE,
    MapFull,
    StorageError,
    StorageFull,
    aborted_on_failure,
    check_data_file,
    database_names,
    disk_full,
    free_bytes,
    inject_write_fault,
    low_on_space,
    make_private_dir,
    write_failure,
)
from .lease_walks import LeasedRun, LeaseWalks
from .partition_scan import PartitionScan, PartitionScans
from .queue_env import DEFAULT_MAP_SIZE, MAX_GROWTHS

# The environment's failures and checks (environment.py) stay importable from here.
__all__ = [
    "DEFAULT_MAP_SIZE",
    "DIR_MODE",
    "FILE_MODE",
    "MAX_GROWTHS",
    "LeasedRun",
    "MapFull",
    "PartitionScan",
    "QueueStore",
    "StorageError",
    "StorageFull",
    "aborted_on_failure",
    "check_data_file",
    "database_names",
    "disk_full",
    "free_bytes",
    "inject_write_fault",
    "low_on_space",
    "make_private_dir",
    "write_failure",
]


class QueueStore(PartitionScans, LeaseWalks):
    """The LMDB environment holding one queue's partitions."""
