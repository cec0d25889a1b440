"""The catalog: every queue's settings, in an LMDB environment of its own.

Queue settings are stored as JSON under a digest of the queue's name. Each queue also gets a
numeric uid that names its storage directory, so deleting a queue and creating one
with the same name never finds the old items.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import lmdb

from ..model import (
    DEFAULT_DEDUP_WINDOW_US,
    DEFAULT_LEASE_KEY_TTL_US,
    MAX_LEASE_TIMEOUT_US,
    MAX_LONG_DURATION_US,
    QueueConfig,
)
from .queue_store import FILE_MODE, StorageError, check_data_file, inject_write_fault, make_private_dir

_NEXT_UID = b"next_uid"
# The key that signs page tokens (grpc_api/convert.py): made once, kept with the data
# (and its backups), so a token stays good across restarts and restores.
_TOKEN_SECRET = b"page_token_secret"
_TOKEN_SECRET_BYTES = 32
_FORMAT = b"format"
# Which cluster, prefix and node id this data directory joined as (cluster/identity.py):
# a JSON record the storage keeps and never reads.
_CLUSTER_IDENTITY = b"cluster_identity"
# 2: a produced batch is indexed for expiry by one entry (an expiry run, queue_store.py),
# which a server of format 1 would read as an entry of the batch's first item only.
# 3: a queue may keep its storage in a group environment (groups/<n>, its "group"),
# where a server of format 2 would find no directory and refuse to start.
# 4: an item record may carry a history block (record.py), which a server of format 3
# would read as the start of the payload.
# 5: a record's history block may end with the item's last error (record.py), which a
# server of format 4 would read as the start of the payload.
# 6: a record may carry a group block (record.py), and a partition ordered groups' keys
# (ordered_groups.py), which a server of format 5 would misread or hand out out of turn.
# 7: a lease may be one record (lease_records.py) whose items' records still read as
# ready, which a server of format 6 would hand out again.
_FORMAT_VERSION = b"querator-catalog-7"
# Formats this server reads as they are; opening one stamps it with _FORMAT_VERSION, so
# an older server then refuses the directory instead of misreading it.
_UPGRADABLE_FORMATS = (
    b"querator-catalog-1",
    b"querator-catalog-2",
    b"querator-catalog-3",
    b"querator-catalog-4",
    b"querator-catalog-5",
    b"querator-catalog-6",
)


class CatalogError(StorageError):
    """The catalog cannot be opened or read."""


class Catalog:
    """Queue settings by name, durable on commit."""

    def __init__(self, path: str, *, sync: bool = True) -> None:
        self.path = path
        make_private_dir(path)
        try:
            self.env = lmdb.open(path, mode=FILE_MODE, map_size=64 << 20, max_dbs=8, sync=sync, metasync=sync)
            self.env.reader_check()
            check_data_file(self.env, path)
            with self.env.begin(write=True) as txn:
                self._queues = self.env.open_db(b"queues", txn=txn)
                self._meta = self.env.open_db(b"meta", txn=txn)
                self._keys = self.env.open_db(b"keys", txn=txn)
                # Queues set aside (manager.set_aside): their settings and why, by id.
                self._aside = self.env.open_db(b"aside", txn=txn)
                found = txn.get(_FORMAT, db=self._meta)
                if found is None or found in _UPGRADABLE_FORMATS:
                    txn.put(_FORMAT, _FORMAT_VERSION, db=self._meta)
                elif found != _FORMAT_VERSION:
                    raise CatalogError(f"{path}: unknown catalog format {found!r}")
                secret = txn.get(_TOKEN_SECRET, db=self._meta)
                if secret is None or len(secret) != _TOKEN_SECRET_BYTES:
                    secret = os.urandom(_TOKEN_SECRET_BYTES)
                    txn.put(_TOKEN_SECRET, secret, db=self._meta)
                self.token_secret = bytes(secret)
        except lmdb.Error as exc:
            raise CatalogError(f"cannot open the catalog {os.path.join(path, 'data.mdb')!r}: {exc}") from exc

    def load(self) -> list[QueueConfig]:
        """Every stored queue, sorted by name."""
        out: list[QueueConfig] = []
        with self.env.begin() as txn:
            for key, raw in txn.cursor(db=self._queues):
                try:
                    out.append(_decode(raw))
                except (ValueError, TypeError, KeyError) as exc:
                    raise CatalogError(f"{self.path}: queue {key!r} has unreadable settings: {exc}") from exc
        return out

    def next_uid(self) -> int:
        """Reserve a storage uid, durably, so it is never handed out twice."""

        def reserve(txn: lmdb.Transaction[bytes]) -> int:
            raw = txn.get(_NEXT_UID, db=self._meta)
            uid = int(raw) if raw else 1
            txn.put(_NEXT_UID, str(uid + 1).encode(), db=self._meta)
            return uid

        uid: int = self._write(reserve)
        return uid

    def put(self, config: QueueConfig) -> None:
        self._write(lambda txn: txn.put(_key(config.name), _encode(config), db=self._queues))

    def delete(self, name: str) -> None:
        self._write(lambda txn: txn.delete(_key(name), db=self._queues))

    # -- the cluster identity ------------------------------------------------------

    def cluster_identity(self) -> dict[str, Any] | None:
        with self.env.begin() as txn:
            raw = txn.get(_CLUSTER_IDENTITY, db=self._meta)
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except ValueError as exc:
            raise CatalogError(f"{self.path}: the cluster identity record is unreadable: {exc}") from exc
        if not isinstance(record, dict):
            raise CatalogError(f"{self.path}: the cluster identity record is not an object")
        return record

    def put_cluster_identity(self, record: dict[str, Any]) -> None:
        raw = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
        self._write(lambda txn: txn.put(_CLUSTER_IDENTITY, raw, db=self._meta))

    # -- queues set aside: out of the served namespace, storage kept ------------------

    def load_aside(self) -> list[tuple[QueueConfig, dict[str, Any]]]:
        """Every queue set aside: its settings (as when it was set aside) and the record."""
        out: list[tuple[QueueConfig, dict[str, Any]]] = []
        with self.env.begin() as txn:
            for key, raw in txn.cursor(db=self._aside):
                try:
                    record = json.loads(raw)
                    out.append((_decode(json.dumps(record["config"]).encode()), record))
                except (ValueError, TypeError, KeyError) as exc:
                    raise CatalogError(f"{self.path}: set-aside queue {key!r} is unreadable: {exc}") from exc
        return out

    def set_aside(self, config: QueueConfig, record: dict[str, Any]) -> None:
        """Move ``config`` out of the queues into the set-aside table, in one transaction."""
        full = dict(record, config=json.loads(_encode(config)))
        raw = json.dumps(full, separators=(",", ":")).encode()

        def move(txn: lmdb.Transaction[bytes]) -> None:
            txn.put(str(record["id"]).encode(), raw, db=self._aside)
            txn.delete(_key(config.name), db=self._queues)

        self._write(move)

    def delete_aside(self, aside_id: str) -> None:
        self._write(lambda txn: txn.delete(aside_id.encode(), db=self._aside))

    # -- API keys: JSON records under the key id; only a hash of each secret ----------

    def load_keys(self) -> list[dict[str, Any]]:
        with self.env.begin() as txn:
            out: list[dict[str, Any]] = []
            for key, raw in txn.cursor(db=self._keys):
                try:
                    out.append(json.loads(raw))
                except ValueError as exc:
                    raise CatalogError(f"{self.path}: API key {key!r} is unreadable: {exc}") from exc
            return out

    def put_key(self, key_id: str, record: dict[str, Any]) -> None:
        raw = json.dumps(record, separators=(",", ":")).encode()
        self._write(lambda txn: txn.put(key_id.encode(), raw, db=self._keys))

    def delete_key(self, key_id: str) -> None:
        self._write(lambda txn: txn.delete(key_id.encode(), db=self._keys))

    def _write(self, fn: Any) -> Any:
        try:
            with self.env.begin(write=True) as txn:
                result = fn(txn)
                inject_write_fault(self.path)
                return result
        except lmdb.MapFullError:
            self.env.set_mapsize(self.env.info()["map_size"] * 2)
            return self._write(fn)
        except lmdb.Error as exc:
            raise StorageError(f"catalog write failed: {exc}") from exc

    def close(self) -> None:
        self.env.close()


def _key(name: str) -> bytes:
    # A 512-character name can exceed LMDB's 511-byte key limit, so the key is a
    # digest; the name itself is in the value and the manager sorts names in memory.
    return hashlib.sha256(name.encode()).digest()


def _encode(config: QueueConfig) -> bytes:
    return json.dumps(
        {
            "name": config.name,
            "uid": config.uid,
            "dead_queue": config.dead_queue,
            "reference": config.reference,
            "lease_timeout_us": config.lease_timeout_us,
            "expire_timeout_us": config.expire_timeout_us,
            "max_attempts": config.max_attempts,
            "partitions": config.partitions,
            "created_at_us": config.created_at_us,
            "updated_at_us": config.updated_at_us,
            "dedup_window_us": config.dedup_window_us,
            "lease_key_ttl_us": config.lease_key_ttl_us,
            "group": config.group,
            "paused": config.paused,
            "produce_paused": config.produce_paused,
            "shard_copy": config.shard_copy,
        },
        separators=(",", ":"),
    ).encode()


def _decode(raw: bytes) -> QueueConfig:
    data = json.loads(raw)
    # Settings stored before their maximums existed are held to them, so that no time
    # computed from one (a lease deadline in year 10056) leaves the Timestamp range.
    return QueueConfig(
        name=str(data["name"]),
        uid=int(data["uid"]),
        dead_queue=str(data["dead_queue"]),
        reference=str(data["reference"]),
        lease_timeout_us=min(int(data["lease_timeout_us"]), MAX_LEASE_TIMEOUT_US),
        expire_timeout_us=min(int(data["expire_timeout_us"]), MAX_LONG_DURATION_US),
        max_attempts=int(data["max_attempts"]),
        partitions=int(data["partitions"]),
        created_at_us=int(data["created_at_us"]),
        updated_at_us=int(data["updated_at_us"]),
        dedup_window_us=min(int(data.get("dedup_window_us", DEFAULT_DEDUP_WINDOW_US)), MAX_LONG_DURATION_US),
        lease_key_ttl_us=min(int(data.get("lease_key_ttl_us", DEFAULT_LEASE_KEY_TTL_US)), MAX_LONG_DURATION_US),
        group=int(data.get("group", -1)),
        # Absent in catalogs written before pausing existed: not paused.
        paused=bool(data.get("paused", False)),
        produce_paused=bool(data.get("produce_paused", False)),
        shard_copy=bool(data.get("shard_copy", False)),
    )
