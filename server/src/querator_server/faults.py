"""Fault injection for reliability tests: named crash points and storage write faults.

Crash points. Setting ``QUERATOR_CRASH_AT=<name>`` in a server's environment makes the
process kill itself with SIGKILL when it reaches that point, so tests can prove recovery
from a crash at exactly the worst moment. Unset, a crash point costs one dict lookup.

Write faults. Setting ``QUERATOR_FAULT_FILE=<path>`` makes every storage commit look at
that path first. While no file is there nothing happens; while it exists, its first word
names the fault that every commit meets:

- ``no-space``: the commit fails as on a full file system.
- ``io-error``: the commit fails with an I/O error.
- ``map-full``: the LMDB map is full and cannot grow.
- ``stall``: the commit waits (a slow disk) until the file is removed or changed.

The file may hold several lines, one fault each. One word names no write fault:
``lifecycle-error`` makes the lifecycle step of a cycle
(expired leases, due and expired items) raise ``InjectedFault`` after its writes, while
commits go through.

A second word limits the fault to the storage whose directory ends with it (for example
``io-error queues/1``: the queue with uid 1 that has an environment of its own); every
other commit goes through.

Partition faults. ``partition-error <storage> <database>`` names no write fault either:
every step of a cycle that works on that one partition (and the probe that checks whether
it works again) fails as on a damaged database, while the rest of the storage works. The
database is the partition's LMDB database in that storage: ``p1`` in ``queues/7``,
``q7.p1`` in a commit group's ``groups/0``. The partition is marked faulty
(actor/cycle_base.py) until the line is gone.

A test creates, rewrites or removes the file while the server runs, so one server process
can be made to fail and then recover. An empty file names no fault: rewriting the file
truncates it before writing, and a commit that read it in between (a stalled one polls
it every 10 ms) took the empty file for ``no-space``, failing calls of a test that never
asked for that. Unset, a commit pays one dict lookup.

Request faults. Setting ``QUERATOR_REQUEST_FAULTS=1`` in a server's environment makes a
call that carries the metadata ``querator-fault: apply`` raise ``InjectedFault`` in the
step that applies its request, after the step's writes (``GetQueueStats``, which reads
no storage: while it reads the queue's counters), so tests can prove that one failing
request fails alone. Read when the server starts; unset, a call pays nothing.
"""

from __future__ import annotations

import contextvars
import os
import signal
import time
from collections.abc import Iterable

DEAD_LETTER_STORED = "dead-letter-stored"
"""After the dead-letter queue committed an outbox batch, before the source dropped it."""

REDRIVE_TAKEN = "redrive-taken"
"""A redrive committed its items to the origin's redrive outbox, before any target took them."""

REDRIVE_STORED = "redrive-stored"
"""A redrive's target committed the items, before the origin dropped them from its outbox."""

LEASE_RECORDED = "lease-recorded"
"""A cycle that wrote a lease record (storage/lease_records.py) committed, before its
answers were adopted."""

LEASE_COMPLETED = "lease-completed"
"""A cycle that completed a whole lease by its record committed."""

LEASE_WRITTEN_OUT = "lease-written-out"
"""A cycle that wrote a lease record out into its items' records committed."""

MOVE_COPIED = "move-copied"
"""Moving a queue out of its commit group: its copy is durable, the catalog not yet changed."""

MOVE_RECORDED = "move-recorded"
"""Moving a queue out of its commit group: the catalog names the copy, the group's is not dropped."""

REPLICA_MOVE_ADDED = "replica-move-added"
"""A move of a replicated queue's copy (cluster/copy_moves.py): the new copy is in the shard record."""

REPLICA_MOVE_CATCHING_UP = "replica-move-catching-up"
"""A move of a replicated queue's copy: its node waits for the new copy, not in sync yet."""

REPLICA_MOVE_IN_SYNC = "replica-move-in-sync"
"""A move of a replicated queue's copy: the new copy is in sync, not handed the primary or the old copy dropped."""

REPLICA_MOVE_HANDED_OVER = "replica-move-handed-over"
"""A move of a replicated queue's primary copy: the new copy is primary, the old copy not dropped yet."""

FAULT_FILE_ENV = "QUERATOR_FAULT_FILE"
REQUEST_FAULTS_ENV = "QUERATOR_REQUEST_FAULTS"
REQUEST_FAULT_METADATA = "querator-fault"
APPLY = "apply"
NO_SPACE = "no-space"
IO_ERROR = "io-error"
MAP_FULL = "map-full"
STALL = "stall"
WRITE_FAULTS = (NO_SPACE, IO_ERROR, MAP_FULL, STALL)
LIFECYCLE_ERROR = "lifecycle-error"
PARTITION_ERROR = "partition-error"

# A stalled commit gives up waiting after this long, so a forgotten switch cannot hang
# a test run forever.
STALL_LIMIT_S = 120.0
_STALL_POLL_S = 0.01


def crash_point(name: str) -> None:
    if os.environ.get("QUERATOR_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _read_fault(path: str, storage: str, *, lifecycle: bool = False) -> str:
    """The first fault of the file for ``storage``: a lifecycle fault or a write fault.
    Each line names one: ``<word> [<storage>]`` (an empty file: none)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read(1024).splitlines()
    except OSError:  # no file: no fault
        return ""
    for line in lines:
        words = line.split()
        if not words or words[0] == PARTITION_ERROR or (words[0] == LIFECYCLE_ERROR) != lifecycle:
            continue
        if len(words) > 1 and not storage.rstrip(os.sep).endswith(words[1].rstrip("/")):
            continue
        return words[0]
    return ""


def write_fault(storage: str = "") -> str:
    """The write fault a commit of the storage in directory ``storage`` meets now: ""
    for none, else one of WRITE_FAULTS.

    A ``stall`` is served here: the call returns only once the stall is over (with the
    fault that replaced it, if any). An unknown word counts as ``io-error``.
    """
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return ""
    fault = _read_fault(path, storage)
    if fault == STALL:
        give_up = time.monotonic() + STALL_LIMIT_S
        while fault == STALL and time.monotonic() < give_up:
            time.sleep(_STALL_POLL_S)
            fault = _read_fault(path, storage)
        if fault == STALL:
            fault = ""
    if fault and fault not in WRITE_FAULTS:
        fault = IO_ERROR
    return fault


def lifecycle_fault(storage: str) -> bool:
    """Whether the lifecycle step of the storage in directory ``storage`` is to fail now."""
    path = os.environ.get(FAULT_FILE_ENV)
    return path is not None and _read_fault(path, storage, lifecycle=True) == LIFECYCLE_ERROR


def partition_faults(storage: str) -> frozenset[str]:
    """The databases of the storage in directory ``storage`` that ``partition-error``
    lines of the fault file name now (empty: none, or no fault file)."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path:
        return frozenset()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read(4096).splitlines()
    except OSError:
        return frozenset()
    names: set[str] = set()
    for line in lines:
        words = line.split()
        if len(words) == 3 and words[0] == PARTITION_ERROR and storage.rstrip(os.sep).endswith(words[1].rstrip("/")):
            names.add(words[2])
    return frozenset(names)


class InjectedFault(RuntimeError):
    """The failure ``QUERATOR_REQUEST_FAULTS`` injects: stands for any bug."""


class InjectedPartitionFault(RuntimeError):
    """What a ``partition-error`` fault raises: stands for a damaged partition database
    (LMDB's MDB_CORRUPTED or MDB_PAGE_NOTFOUND in that database alone)."""


# Whether the call being handled asked for a fault (set by the gRPC layer, read by the
# actor when the call submits its request).
faulty_call: contextvars.ContextVar[bool] = contextvars.ContextVar("faulty_call", default=False)


def request_faults_on() -> bool:
    return os.environ.get(REQUEST_FAULTS_ENV) == "1"


def asks_for_fault(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    return any(key == REQUEST_FAULT_METADATA and value == APPLY for key, value in metadata or ())
