"""The data-file length check made when storage opens (storage/lmdb_file.py).

A restarted node once refused its healthy commit-group file as "truncated or damaged"
(CI: "the file is 167936 bytes but its LMDB header needs 180224"): LMDB leaves a file
shorter than its header's last page when a transaction's last allocated pages were
freed again before it committed. The check now counts only the pages in use. Each
acceptance below is proved safe by reading every record in a child process, where a
page missing from the file would end it with SIGBUS.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from querator_server.storage.environment import StorageError, check_data_file
from querator_server.storage.group_layout import open_group_env
from querator_server.storage.lmdb_file import pages_needed, read_layout

_READ_ALL = """
import lmdb, sys
env = lmdb.open(sys.argv[1], max_dbs=8, readonly=True, lock=False)
n = 0
with env.begin() as txn:
    for name, _ in txn.cursor():
        db = env.open_db(name, txn=txn, create=False)
        for _, value in txn.cursor(db=db):
            n += len(value)
print(n)
"""


def _reads_everything(path: Path) -> int:
    """Read every record of the environment at ``path`` in a child process; the bytes read."""
    done = subprocess.run([sys.executable, "-c", _READ_ALL, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode != -signal.SIGBUS, "a page in use lies past the end of the file"
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def _header_pages(env: lmdb.Environment) -> int:
    return int(env.info()["last_pgno"]) + 1


def _refused_once_cut_to(path: Path, size: int) -> None:
    """Cut ``path``'s data file to ``size`` bytes: the check refuses it."""
    os.truncate(path / "data.mdb", size)
    env = lmdb.open(str(path), max_dbs=8)
    try:
        with pytest.raises(StorageError, match="truncated or damaged"):
            check_data_file(env, str(path))
    finally:
        env.close()


def _churn_until_short(path: Path, seed: int) -> tuple[int, int]:
    """Commit random puts and deletes (some freed within their own transaction) until a
    commit leaves data.mdb shorter than the header's last page. (size, header bytes)."""
    env = lmdb.open(str(path), map_size=1 << 28, max_dbs=8)
    db = env.open_db(b"items")
    rnd = random.Random(seed)
    data = path / "data.mdb"
    try:
        for _ in range(3000):
            with env.begin(write=True) as txn:
                for _ in range(rnd.randint(1, 40)):
                    key = rnd.randrange(5000).to_bytes(4, "big")
                    if rnd.random() < 0.6:
                        txn.put(key, rnd.randbytes(rnd.randint(10, 600)), db=db)
                    else:
                        txn.delete(key, db=db)
                passing = [rnd.randrange(1 << 30).to_bytes(4, "big") for _ in range(rnd.randint(0, 200))]
                for key in passing:
                    txn.put(key, b"x" * 300, db=db)
                for key in passing:
                    txn.delete(key, db=db)
            header = _header_pages(env) * env.stat()["psize"]
            if os.path.getsize(data) < header:
                return os.path.getsize(data), header
    finally:
        env.close()
    pytest.fail("3,000 commits never left the file shorter than its header")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_healthy_file_lmdb_left_shorter_than_its_header_opens(tmp_path: Path, seed: int) -> None:
    size, header = _churn_until_short(tmp_path, seed)
    assert size < header
    env = open_group_env(str(tmp_path), map_size=1 << 28, sync=True)  # refused before the fix
    env.close()
    assert _reads_everything(tmp_path) > 0


def test_a_file_cut_below_its_pages_in_use_is_refused_and_cut_to_them_is_not(tmp_path: Path) -> None:
    _churn_until_short(tmp_path, 4)
    data = tmp_path / "data.mdb"
    env = lmdb.open(str(tmp_path), max_dbs=8)
    psize = env.stat()["psize"]
    need = pages_needed(str(data), psize, env.info()["last_txnid"]) * psize
    env.close()
    assert need <= os.path.getsize(data)

    os.truncate(data, need)
    env = lmdb.open(str(tmp_path), max_dbs=8)
    check_data_file(env, str(tmp_path))
    env.close()
    assert _reads_everything(tmp_path) > 0

    _refused_once_cut_to(tmp_path, need - psize)


def test_a_free_list_record_spanning_overflow_pages_is_read(tmp_path: Path) -> None:
    """Deleting thousands of pages in one transaction makes a free-list record longer
    than a page: LMDB keeps it in overflow pages, which the check follows."""
    env = lmdb.open(str(tmp_path), map_size=1 << 28, max_dbs=8)
    db = env.open_db(b"items")
    with env.begin(write=True) as txn:
        for i in range(20_000):
            txn.put(i.to_bytes(4, "big"), b"v" * 500, db=db)
    with env.begin(write=True) as txn:
        for i in range(2_000, 20_000):
            txn.delete(i.to_bytes(4, "big"), db=db)
    for value in (b"a", b"bb"):  # later commits reuse freed pages and free the delete's own
        with env.begin(write=True) as txn:
            txn.put(b"last", value, db=db)
    psize = env.stat()["psize"]
    data = tmp_path / "data.mdb"
    layout = read_layout(str(data), psize, env.info()["last_txnid"])
    assert len(layout.free) > psize // 8  # more page numbers than one page holds
    assert layout.pages_needed < _header_pages(env)
    env.close()
    os.truncate(data, layout.pages_needed * psize)
    assert _reads_everything(tmp_path) == 2_000 * 500 + 2
    _refused_once_cut_to(tmp_path, (layout.pages_needed - 1) * psize)
