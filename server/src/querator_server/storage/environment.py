"""What every LMDB environment of the server shares: how storage failures are told
apart and reported, the private file modes, and the checks made when one is opened."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import lmdb

from ..faults import MAP_FULL, NO_SPACE, write_fault
from .lmdb_file import DamagedFile, pages_needed


class StorageError(Exception):
    """The storage failed (I/O error, full disk); the operation did not happen."""


class StorageFull(StorageError):
    """The LMDB map cannot grow any further."""


class MapFull(Exception):
    """The held transaction ran out of map: call ``grow`` and run the cycle again."""


def inject_write_fault(storage: str = "") -> None:
    """Fail this commit of the storage in directory ``storage`` as ``QUERATOR_FAULT_FILE``
    asks (reliability tests; see faults.py)."""
    fault = write_fault(storage)
    if not fault:
        return
    if fault == MAP_FULL:
        raise StorageFull("storage is full: the LMDB map cannot grow (injected fault)")
    if fault == NO_SPACE:
        raise StorageError("storage write failed: No space left on device (injected fault)")
    raise StorageError("storage write failed: Input/output error (injected fault)")


def disk_full(exc: BaseException) -> bool:
    """Whether a storage failure is a full map or file system, which clears up once space
    is freed, rather than a failing or damaged disk. LMDB reports only errno texts."""
    return isinstance(exc, StorageFull) or "No space left on device" in str(exc)


# Below this much free space a failed write is reported as a full file system.
_LOW_SPACE_BYTES = 1 << 20


def free_bytes(path: str) -> int | None:
    """The bytes of the file system holding ``path`` that this process may still use
    (None: unknown)."""
    try:
        fs = os.statvfs(path)
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize


def low_on_space(path: str) -> bool:
    """Whether the file system holding ``path`` counts as full (as a failed write says)."""
    free = free_bytes(path)
    return free is not None and free < _LOW_SPACE_BYTES


def write_failure(exc: lmdb.Error, path: str) -> str:
    """What a failed commit tells the caller. LMDB reports a short write as EIO, and a
    file system that fills up in the middle of a commit causes exactly that."""
    text = f"storage write failed: {exc}"
    free = free_bytes(path)
    if free is None:
        return text
    if free < _LOW_SPACE_BYTES and "space" not in text.lower():
        return f"storage write failed: No space left on device ({free} bytes free; LMDB said: {exc})"
    return text


@contextmanager
def aborted_on_failure(txn: lmdb.Transaction[bytes], path: str) -> Iterator[None]:
    """Abort ``txn`` if the block fails; LMDB errors become MapFull or StorageError."""
    try:
        yield
    except lmdb.MapFullError as exc:
        txn.abort()
        raise MapFull() from exc
    except lmdb.Error as exc:
        txn.abort()
        raise StorageError(write_failure(exc, path)) from exc
    except BaseException:
        txn.abort()
        raise


# Queue data is the users' data: readable by the server's user alone. LMDB creates its
# files with the mode it is given (py-lmdb's default is 0o755, 0o644 after the umask).
FILE_MODE = 0o600
DIR_MODE = 0o700


def make_private_dir(path: str) -> None:
    """Create ``path`` and its parent (groups/, queues/) readable by this user alone."""
    os.makedirs(os.path.dirname(path), mode=DIR_MODE, exist_ok=True)
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)


def check_data_file(env: lmdb.Environment, path: str) -> None:
    """Refuse an LMDB file that lacks a page in use (truncated or damaged).

    Reading a page past the end of the file would kill the process with SIGBUS. The
    header's last page is not the measure: LMDB leaves healthy files shorter than
    that (see lmdb_file.py).
    """
    data = os.path.join(path, "data.mdb")
    info = env.info()
    size = os.path.getsize(data)
    psize = env.stat()["psize"]
    if size >= (info["last_pgno"] + 1) * psize:
        return
    try:
        need = pages_needed(data, psize, info["last_txnid"]) * psize
    except DamagedFile as exc:
        raise StorageError(f"{data}: {exc}: truncated or damaged") from exc
    if size < need:
        raise StorageError(f"{data}: the file is {size} bytes but its pages in use need {need}: truncated or damaged")


def database_names(env: lmdb.Environment, txn: lmdb.Transaction[bytes], prefix: bytes) -> list[bytes]:
    """The names of the named databases in ``env`` that start with ``prefix`` (not empty)."""
    cursor = txn.cursor()
    names: list[bytes] = []
    if cursor.set_range(prefix):
        for key in cursor.iternext(keys=True, values=False):
            if not key.startswith(prefix):
                break
            names.append(bytes(key))
    return names
