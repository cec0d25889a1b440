"""How long an LMDB data file must be, read from LMDB's own page format.

LMDB's header (the newer of its two meta pages) names the last page number it has
allocated. A healthy file is often shorter than that: a page that a transaction
allocated at the end of the file and freed again before committing (a "loose" page)
is put on the free list and never written, so the file ends before it. Measured with
random puts and deletes: 285 of 3,000 commits left the file shorter than the header's
last page. Refusing such a file refused healthy storage after an ordinary restart.

What must be in the file is every page *in use*: the header's pages minus the free
list. The free list is LMDB's database 0, which py-lmdb does not open, so it is read
here from the file with plain reads (never through the memory map, where a page past
the end of the file kills the process with SIGBUS). It is small: one record per
transaction whose freed pages are not yet reused.

Layout (LMDB 0.9, 64-bit, little-endian; mdb.c): a page starts with a 16-byte header
(page number, pad, flags, then lower/upper free-space bounds or an overflow page
count); nodes are found through 2-byte offsets after the header. The meta page holds
MDB_meta after the header: magic, version, address, map size, two MDB_db records
(free list, main) of 48 bytes, the last page number and the transaction id.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

_HEADER = 16
_MAGIC = 0xBEEFC0DE
_INVALID_PAGE = (1 << 64) - 1

_P_BRANCH = 0x01
_P_LEAF = 0x02
_P_OVERFLOW = 0x04
_F_BIGDATA = 0x01

_META = struct.Struct("<II8x8x")  # magic, version, address, map size
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_META_TAIL = struct.Struct("<QQ")  # last page number, transaction id
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size


class DamagedFile(Exception):
    """The data file lacks a page in use, or its free list cannot be read."""


class _File:
    def __init__(self, fd: int, size: int, page_size: int) -> None:
        self.fd = fd
        self.size = size
        self.page_size = page_size

    def read(self, pgno: int, pages: int = 1) -> bytes:
        end = (pgno + pages) * self.page_size
        if end > self.size:
            raise DamagedFile(f"page {pgno + pages - 1} in use lies past the end of the file ({self.size} bytes)")
        return os.pread(self.fd, pages * self.page_size, pgno * self.page_size)


@dataclass(frozen=True)
class Layout:
    """What the header and the free list of one transaction say of the file's pages."""

    last_page: int
    free: frozenset[int]

    @property
    def pages_needed(self) -> int:
        """Pages 0 up to the highest page in use: what the file must hold."""
        highest = self.last_page
        while highest > 1 and highest in self.free:
            highest -= 1
        return highest + 1


def read_layout(data_path: str, page_size: int, txnid: int) -> Layout:
    """The layout of ``data_path`` as of transaction ``txnid`` (the environment's
    last, as ``env.info()`` reports it).

    Raises DamagedFile when a page the free list itself lives on is missing, or the
    header is not LMDB's.
    """
    fd = os.open(data_path, os.O_RDONLY)
    try:
        file = _File(fd, os.fstat(fd).st_size, page_size)
        last_page, free_root = _current_meta(file, txnid)
        free = _free_pages(file, free_root) if free_root != _INVALID_PAGE else set()
    finally:
        os.close(fd)
    return Layout(last_page, frozenset(free))


def pages_needed(data_path: str, page_size: int, txnid: int) -> int:
    """The number of pages ``data_path`` must hold for ``txnid`` to read every page it uses."""
    return read_layout(data_path, page_size, txnid).pages_needed


def _current_meta(file: _File, txnid: int) -> tuple[int, int]:
    """(last page number, free-list root) of the meta page written by ``txnid``."""
    for pgno in (0, 1):
        page = file.read(pgno)
        magic, _version = _META.unpack_from(page, _HEADER)
        if magic != _MAGIC:
            raise DamagedFile(f"meta page {pgno} is not LMDB's")
        free_db = _DB.unpack_from(page, _HEADER + _META.size)
        last_page, meta_txnid = _META_TAIL.unpack_from(page, _HEADER + _META.size + 2 * _DB.size)
        if meta_txnid == txnid:
            return last_page, free_db[-1]
    raise DamagedFile(f"no meta page holds transaction {txnid}")


def _free_pages(file: _File, root: int) -> set[int]:
    """Every page number on the free list rooted at ``root``."""
    free: set[int] = set()
    pending = [root]
    visited = 0
    while pending:
        pgno = pending.pop()
        visited += 1
        if visited > file.size // file.page_size + 1:
            raise DamagedFile("the free list's pages form a cycle")
        page = file.read(pgno)
        flags = struct.unpack_from("<H", page, 10)[0]
        lower = struct.unpack_from("<H", page, 12)[0]
        if not flags & (_P_BRANCH | _P_LEAF) or lower < _HEADER or lower > file.page_size:
            raise DamagedFile(f"free-list page {pgno} is not a tree page (flags {flags:#x})")
        for i in range((lower - _HEADER) >> 1):
            offset = struct.unpack_from("<H", page, _HEADER + 2 * i)[0]
            if offset + _NODE.size > file.page_size:
                raise DamagedFile(f"free-list page {pgno} has a node past its end")
            lo, hi, node_flags, key_size = _NODE.unpack_from(page, offset)
            if flags & _P_BRANCH:
                pending.append(lo | hi << 16 | node_flags << 32)
                continue
            data_size = lo | hi << 16
            start = offset + _NODE.size + key_size
            if node_flags & _F_BIGDATA:
                overflow = struct.unpack_from("<Q", page, start)[0]
                head = file.read(overflow)
                if not struct.unpack_from("<H", head, 10)[0] & _P_OVERFLOW:
                    raise DamagedFile(f"free-list page {overflow} is not an overflow page")
                count = struct.unpack_from("<I", head, 12)[0]
                data = file.read(overflow, count)[_HEADER : _HEADER + data_size]
            else:
                data = page[start : start + data_size]
            free.update(_page_list(data, pgno))
    return free


def _page_list(data: bytes, pgno: int) -> tuple[int, ...]:
    """An LMDB ID list: a count, then that many page numbers."""
    if len(data) < 8:
        raise DamagedFile(f"free-list page {pgno} holds a short record")
    count = struct.unpack_from("<Q", data)[0]
    if 8 * (count + 1) > len(data):
        raise DamagedFile(f"free-list page {pgno} holds a record shorter than its count")
    return struct.unpack_from(f"<{count}Q", data, 8)
