"""Copy a data directory while the server runs: ``python -m querator_server.backup SRC DEST``.

Each LMDB environment (the catalog first, then every commit group and every queue
with an environment of its own) is copied inside one read
transaction with LMDB's own copy (``mdb_env_copy2`` with compaction, as ``mdb_copy -c``),
so each copy is a consistent snapshot of that environment even while the server writes
to it. Compaction also matters for another reason: LMDB's plain copy takes the writer
lock, which a running server always holds (queue_store.py, the held transaction). The
environments are copied one after another, so the backup as a whole is not
one instant: see docs/operations.md ("Backups") for what that means and when to use a
file-system snapshot instead. DEST must not exist (or be an empty directory); start a
server on it to restore.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import lmdb


def _copy_env(src: str, dest: str) -> int:
    os.makedirs(dest, mode=0o700)
    env = lmdb.open(src, readonly=True, lock=True, max_dbs=0, subdir=True, create=False)
    try:
        env.copy(dest, compact=True)
    finally:
        env.close()
    copy = os.path.join(dest, "data.mdb")
    os.chmod(copy, 0o600)  # LMDB writes the copy 0o644 (after the umask): users' data
    return os.path.getsize(copy)


def backup(src: str, dest: str) -> list[tuple[str, int]]:
    """Copy the catalog, every group and every queue environment of ``src`` into ``dest``.

    Returns (relative path, bytes written) per environment.
    """
    if not os.path.isdir(os.path.join(src, "catalog")):
        raise OSError(f"{src}: not a Querator data directory (no catalog)")
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise OSError(f"{dest}: already exists and is not an empty directory")
    os.makedirs(dest, mode=0o700, exist_ok=True)
    copied: list[tuple[str, int]] = []
    # The catalog first: a queue created later is absent from it, and its copied
    # directory (if any) is removed as an orphan when a server starts on the backup.
    copied.append(("catalog", _copy_env(os.path.join(src, "catalog"), os.path.join(dest, "catalog"))))
    for folder in ("groups", "queues"):
        root = os.path.join(src, folder)
        if not os.path.isdir(root):
            continue
        os.makedirs(os.path.join(dest, folder), mode=0o700)
        for number in sorted((e for e in os.listdir(root) if e.isdigit()), key=int):
            source = os.path.join(root, number)
            if not os.path.exists(os.path.join(source, "data.mdb")):
                continue  # deleted while we were copying
            try:
                size = _copy_env(source, os.path.join(dest, folder, number))
            except lmdb.Error:
                if os.path.exists(source):
                    raise
                continue  # deleted while we were copying
            copied.append((os.path.join(folder, number), size))
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m querator_server.backup",
        description="Copy a Querator data directory, consistently per queue, while the server runs.",
    )
    parser.add_argument("src", help="the server's data directory (--data-dir)")
    parser.add_argument("dest", help="where to write the copy (must not exist, or be empty)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        copied = backup(args.src, args.dest)
    except (OSError, lmdb.Error) as exc:
        print(f"backup failed: {exc}", file=sys.stderr)
        return 1
    total = sum(size for _, size in copied)
    for path, size in copied:
        print(f"{path}\t{size}")
    print(f"copied {len(copied)} environments, {total} bytes, in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
