"""Group environments: one LMDB environment shared by up to ``GROUP_QUEUES`` small queues.

Each queue in a group keeps its databases (one per partition, four for the keyed
indexes) in the group's environment under its own prefix, ``q<uid>.``, so that one
durable commit can carry the cycles of all of them (storage/commit_group.py).

LMDB sizes every transaction by the environment's ``max_dbs`` (a nested transaction
allocates and clears an array of that many entries), so a group holds a bounded
number of queues, each with room for ``GROUP_MAX_PARTITIONS`` partitions: 2-6 µs per
nested transaction at this size, against 130-260 µs at 66,000. A queue with more
partitions has an environment of its own.
"""

from __future__ import annotations

import os

import lmdb

from .queue_store import (
    FILE_MODE,
    MAX_GROWTHS,
    QueueStore,
    StorageError,
    StorageFull,
    check_data_file,
    database_names,
    make_private_dir,
)

GROUP_MAX_PARTITIONS = 32
GROUP_QUEUES = 28
KEYED_DATABASES = 4
GROUP_MAX_DBS = GROUP_QUEUES * (GROUP_MAX_PARTITIONS + KEYED_DATABASES) + 8


def queue_prefix(uid: int) -> bytes:
    """The prefix of queue ``uid``'s database names in a group environment."""
    return b"q%d." % uid


def open_group_env(path: str, *, map_size: int, sync: bool) -> lmdb.Environment:
    make_private_dir(path)
    try:
        env = lmdb.open(
            path, mode=FILE_MODE, map_size=map_size, max_dbs=GROUP_MAX_DBS, sync=sync, metasync=sync, subdir=True, lock=True
        )
    except lmdb.Error as exc:
        raise StorageError(f"cannot open group storage {os.path.join(path, 'data.mdb')!r}: {exc}") from exc
    try:
        env.reader_check()
        check_data_file(env, path)
    except lmdb.Error as exc:
        env.close()
        raise StorageError(f"cannot open group storage {os.path.join(path, 'data.mdb')!r}: {exc}") from exc
    except StorageError:
        env.close()
        raise
    return env


def queue_uids(env: lmdb.Environment) -> set[int]:
    """The uids of the queues that have databases in a group environment."""
    uids: set[int] = set()
    with env.begin() as txn:
        for name in database_names(env, txn, b"q"):
            head, dot, _ = name[1:].partition(b".")
            if dot and head.isdigit():
                uids.add(int(head))
    return uids


def drop_queues(env: lmdb.Environment, uids: set[int]) -> None:
    """Delete every database of these queues, durably, in one transaction (start-up)."""
    if not uids:
        return
    for _ in range(MAX_GROWTHS):
        try:
            with env.begin(write=True) as txn:
                for uid in sorted(uids):
                    for name in database_names(env, txn, queue_prefix(uid)):
                        txn.drop(env.open_db(name, txn=txn, create=False), delete=True)
            return
        except lmdb.MapFullError:
            # Only at start-up, before anything else reads the environment.
            env.set_mapsize(env.info()["map_size"] * 2)
        except lmdb.Error as exc:
            raise StorageError(f"storage write failed: {exc}") from exc
    raise StorageFull("storage is full: the LMDB map could not grow enough")


def copy_out(source: QueueStore, path: str, partitions: int, *, map_size: int, sync: bool) -> QueueStore:
    """Copy a grouped queue's databases into a new environment of its own at ``path``,
    durably, and open it with ``partitions`` partitions.

    Runs with no write transaction of the group open; the group's environment is only
    read. A failure leaves no directory behind.
    """
    env = source.env
    prefix = source.prefix
    store = QueueStore(path, 0, map_size=map_size, sync=sync)
    try:

        def copy(txn: lmdb.Transaction[bytes]) -> None:
            with env.begin() as read:
                for name in database_names(env, read, prefix):
                    src = env.open_db(name, txn=read, create=False)
                    dst = store.env.open_db(name[len(prefix) :], txn=txn, create=True)
                    txn.cursor(db=dst).putmulti(read.cursor(db=src).iternext(), append=True)

        store.write(copy)
        store.ensure_partitions(partitions)
    except BaseException:
        store.destroy()
        raise
    return store
