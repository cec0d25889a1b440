"""The data directory: what it may hold, checked at start, and the lock that keeps a
second server out of it."""

from __future__ import annotations

import fcntl
import os

from ..storage import StorageError

# What a data directory may hold; start-up refuses anything else (docs/operations.md).
_LOCK_FILE = "querator.lock"
_DATA_DIR_ENTRIES = frozenset({"catalog", "queues", "groups", "lost+found", _LOCK_FILE})
_LMDB_FILES = frozenset({"data.mdb", "lock.mdb"})


class DataDirError(StorageError, OSError):
    """The data directory holds something start-up cannot trust, so the server does not start.

    Also an OSError, so ``querator serve`` prints the message (naming the file) and exits 1.
    """


def _foreign(path: str) -> DataDirError:
    return DataDirError(
        f"{path}: not something Querator keeps in its data directory; refusing to start "
        "(move it away, or point the data directory at the right place)"
    )


def _check_lmdb_dir(path: str) -> None:
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise _foreign(path)
    for entry in sorted(os.listdir(path)):
        if entry not in _LMDB_FILES or not os.path.isfile(os.path.join(path, entry)):
            raise _foreign(os.path.join(path, entry))


def lock_data_dir(data_dir: str) -> int:
    """Hold an exclusive lock on the data directory while this server runs.

    Two servers writing one directory would corrupt it (each believes it is the only
    writer of every queue); the second one refuses to start instead.
    """
    path = os.path.join(data_dir, _LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise DataDirError(f"{path}: another Querator server is using this data directory") from None
    return fd


def check_layout(data_dir: str) -> None:
    """Refuse foreign files in the data directory, and queue data without a catalog.

    A queue directory the catalog does not know is not refused: a crash during a delete,
    or a backup taken while a queue was created, leaves one; start-up removes it.
    """
    for entry in sorted(os.listdir(data_dir)):
        if entry not in _DATA_DIR_ENTRIES:
            raise _foreign(os.path.join(data_dir, entry))
    _check_lmdb_dir(os.path.join(data_dir, "catalog"))
    catalog = os.path.join(data_dir, "catalog", "data.mdb")
    for name in ("queues", "groups"):
        root = os.path.join(data_dir, name)
        if _numbered_lmdb_dirs(root) and (not os.path.isfile(catalog) or os.path.getsize(catalog) == 0):
            # Checked before LMDB would create a fresh, empty catalog in its place.
            raise DataDirError(
                f"{catalog}: the catalog is missing or empty but {root} holds queue data; "
                "refusing to start rather than delete that data"
            )


def _numbered_lmdb_dirs(root: str) -> list[int]:
    """The numbers naming the LMDB directories under ``root`` (queues/, groups/)."""
    if not os.path.lexists(root):
        return []
    if not os.path.isdir(root):
        raise _foreign(root)
    numbers: list[int] = []
    for entry in sorted(os.listdir(root)):
        path = os.path.join(root, entry)
        if not (entry.isascii() and entry.isdigit() and str(int(entry)) == entry and os.path.isdir(path)):
            raise _foreign(path)
        _check_lmdb_dir(path)
        numbers.append(int(entry))
    return numbers
