"""The node's cached copy of the cluster catalog, kept current by watching etcd.

List the prefix at a revision, then watch from the next one; after an error watch
again from the last revision seen + 1, after a compaction list again. Data calls
read only this cache, so they keep working while etcd is away; admin calls write
etcd and wait until the cache (and the local storage, see Coordinator.reconcile)
has caught up with their write.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..errors import Unavailable
from ..logging import get_logger
from .etcd import Compacted, Etcd, EtcdError, Event, KeyValue
from .placement import QueueEntry
from .shard_table import ShardTable

log = get_logger("cluster")

# Backoff between two failed watch attempts: short, as a node re-watches once etcd is
# back; capped, so a long outage costs a call a second at most.
_RETRY_FIRST_S = 0.1
_RETRY_MAX_S = 1.0
# How long an admin call, or a data call that found a queue not applied here yet, waits
# for this node's local storage to catch up with the catalog.
APPLY_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Member:
    node: str
    address: str
    create_revision: int


class Keys:
    """Key names under the cluster prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.encode()

    def member(self, node: str) -> bytes:
        return self.prefix + b"members/" + node.encode()

    def queue(self, name: str) -> bytes:
        return self.prefix + b"queues/" + name.encode()

    def deleted(self, name: str) -> bytes:
        return self.prefix + b"deleted/" + name.encode()

    def api_key(self, key_id: str) -> bytes:
        return self.prefix + b"keys/" + key_id.encode()

    def retired(self, node: str) -> bytes:
        return self.prefix + b"retired/" + node.encode()

    def shard(self, uid: str) -> bytes:
        """A replicated queue's shard record (shard_record.py; "" for the prefix of all)."""
        return self.prefix + b"shards/" + uid.encode()

    def binding(self, node: str) -> bytes:
        """Which data directory node id ``node`` is bound to (cluster/identity.py); no lease."""
        return self.prefix + b"bindings/" + node.encode()

    @property
    def cluster_uuid(self) -> bytes:
        """The cluster's own id, made by its first node: a data directory records it."""
        return self.prefix + b"cluster-uuid"

    @property
    def token_secret(self) -> bytes:
        return self.prefix + b"page-token-secret"


class _Rewatch(Exception):
    """A rewatch asked for during an apply, made once the apply is done."""


class CatalogCache:
    """Queues, members, API keys, tombstones, retired nodes and shard records, at ``revision``."""

    def __init__(self, etcd: Etcd, keys: Keys, on_change: Callable[[], Awaitable[None]]) -> None:
        self._etcd = etcd
        self.keys = keys
        self._on_change = on_change
        self.revision = 0  # the catalog revision the cache reflects
        self.applied = 0  # the revision the local storage has been brought in step with
        self.queues: dict[str, QueueEntry] = {}
        self.members: dict[str, Member] = {}
        self.api_keys: dict[str, dict[str, object]] = {}
        self.deleted: set[str] = set()
        self.retired: set[str] = set()
        self.shards = ShardTable(etcd, keys.prefix)
        self.watching = False
        self.relists = 0
        self._caught_up = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        # A rewatch asked for while a change is being applied waits for it to finish:
        # cancelled half-way, the change was never applied (its events are behind the
        # new watch's start), and a call waiting for it hung until some later change or
        # the apply timeout (10 s): 2 of 3 loaded runs of test_cluster_contract.py had a
        # first CreateQueue answer DEADLINE_EXCEEDED that way, the node's standing
        # (registered, so rewatch) coming while its first change was applied.
        self._applying = False
        self._rewatch_due = False

    def routed(self, entry: QueueEntry) -> QueueEntry:
        """``entry`` as calls are routed: a replicated queue's partitions all at its
        shard's current primary (as the cached record says)."""
        if not entry.shard:
            return entry
        record = self.shards.get(entry.shard)
        return entry if record is None else entry.served_by(record.primary, record.epoch)

    # -- loading ---------------------------------------------------------------------

    def _apply(self, kv: KeyValue, deleted: bool) -> None:
        try:
            self._apply_key(kv, deleted)
        except (ValueError, KeyError, TypeError) as exc:  # not written by us: skipped, never fatal
            log.error("catalog_key_unreadable", key=kv.key[:200].decode(errors="replace"), error=str(exc)[:200])

    def _apply_key(self, kv: KeyValue, deleted: bool) -> None:
        key = kv.key[len(self.keys.prefix) :].decode()
        kind, _, name = key.partition("/")
        if kind == "queues":
            if deleted:
                self.queues.pop(name, None)
            else:
                self.queues[name] = QueueEntry.decode(name, kv.value, kv.mod_revision, kv.create_revision)
        elif kind == "members":
            if deleted:
                self.members.pop(name, None)
            else:
                address = json.loads(kv.value)["address"]
                self.members[name] = Member(name, address, kv.create_revision)
        elif kind == "keys":
            if deleted:
                self.api_keys.pop(name, None)
            else:
                self.api_keys[name] = json.loads(kv.value)
        elif kind == "deleted":
            (self.deleted.discard if deleted else self.deleted.add)(name)
        elif kind == "retired":
            (self.retired.discard if deleted else self.retired.add)(name)
        elif kind == "shards":
            self.shards.apply(int(name), kv, deleted)

    async def load(self) -> None:
        """List everything (a start, or a watch whose history was compacted)."""
        revision, kvs = await self._etcd.range_prefix(self.keys.prefix)
        self.queues.clear()
        self.members.clear()
        self.api_keys.clear()
        self.deleted.clear()
        self.retired.clear()
        self.shards.clear()
        for kv in kvs:
            self._apply(kv, False)
        self.shards.prune()
        self.revision = revision
        await self._changed()

    async def _changed(self) -> None:
        await self._on_change()
        async with self._caught_up:
            self.applied = self.revision
            self._caught_up.notify_all()

    def apply_events(self, revision: int, events: list[Event]) -> None:
        for event in events:
            self._apply(event.kv, event.deleted)
        self.revision = max(self.revision, revision)

    # -- the watch -------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="querator-catalog-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def rewatch(self) -> None:
        """Drop the current watch and start another (etcd came back: the old stream may
        be one a paused etcd left silent)."""
        if self._applying:
            self._rewatch_due = True
        elif self._watch is not None:
            self._watch.cancel()

    async def _run(self) -> None:
        delay = _RETRY_FIRST_S
        relist = False
        while True:
            try:
                if relist:
                    await self.load()
                    self.relists += 1
                    relist = False
                self._watch = asyncio.create_task(self._follow())
                await self._watch
            except Compacted as exc:
                log.warning("catalog_watch_compacted", revision=self.revision, compacted=exc.revision)
                relist = True
                continue
            except (asyncio.CancelledError, _Rewatch):
                if self._task is not None and self._task.cancelling():
                    raise
                delay = _RETRY_FIRST_S  # rewatch(): at once
                continue
            except EtcdError as exc:
                log.warning("catalog_watch_lost", error=str(exc), revision=self.revision)
            except Exception:
                log.exception("catalog_watch_failed", revision=self.revision)
            finally:
                self.watching = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)

    async def _follow(self) -> None:
        async for revision, events in self._etcd.watch(self.keys.prefix, self.revision + 1):
            self.watching = True
            self.apply_events(revision, events)
            if events:
                self._applying = True
                try:
                    await self._changed()
                finally:
                    self._applying = False
                if self._rewatch_due:
                    self._rewatch_due = False
                    raise _Rewatch
            else:  # a progress note: nothing changed up to ``revision``
                async with self._caught_up:
                    self.applied = max(self.applied, revision)
                    self._caught_up.notify_all()

    async def wait_applied(self, revision: int, timeout: float) -> None:
        """Return once the local storage reflects catalog ``revision``."""
        async with self._caught_up:
            try:
                await asyncio.wait_for(self._caught_up.wait_for(lambda: self.applied >= revision), timeout)
            except TimeoutError:
                raise Unavailable(
                    f"the change was made (catalog revision {revision}) but this node has not applied it yet; "
                    "read it again shortly"
                ) from None
