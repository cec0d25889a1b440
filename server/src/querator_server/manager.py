"""The queues manager: the catalog of queues and one running actor per queue.

Admin changes (create, update, delete) are serialised by one lock and written to the
catalog before they take effect, so a crash never leaves an actor the catalog does
not know, and a queue the catalog knows always gets its actor back at start.
"""

from __future__ import annotations

import asyncio
import bisect
import builtins
import contextlib
import fcntl
import itertools
import os
import re
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from .actor import LogicalQueue
from .actor.replication import Replication
from .auth import ApiKey, KeyRing, Role, new_key
from .clock import now_us
from .errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable
from .logging import get_logger
from .model import QueueConfig
from .queue_admin import check_dead_queue, check_deletable, check_update, key_from_record, key_record
from .storage import Catalog, QueueStore, StorageError
from .storage.change_set import ChangeSet
from .storage.group_layout import copy_out
from .storage.group_placement import GROUP_MAX_PARTITIONS, CommitGroups, queue_prefix
from .storage.lane import StorageLane
from .storage.queue_store import DEFAULT_MAP_SIZE
from .storage.replica_copy import ReplicaCopy
from .storage.replica_state import ReplicaState

log = get_logger("manager")

# How long start-up waits for dead letters left by a crash to reach their queues.
_RESUME_TIMEOUT_S = 30.0

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


def _lock_data_dir(data_dir: str) -> int:
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


def _check_layout(data_dir: str) -> None:
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


_PATH = re.compile(r"""['"]?/[^\s'"]+['"]?""")


def _storage_failed(exc: BaseException) -> Unavailable:
    """A storage failure during an admin change: nothing changed, the caller may retry.

    The caller learns why (a full disk, an I/O error) but not the server's file paths.
    """
    log.error("admin_storage_failed", error=str(exc))
    reason = _PATH.sub("<file>", str(exc))[:300]
    return Unavailable(f"storage failed ({reason}); the change was not made, retry later")


class QueuesManager:
    """Owns the catalog and the logical queues."""

    def __init__(
        self,
        data_dir: str,
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        sync: bool = True,
        max_inbox: int = 10_000,
        workers: int = 8,
        bootstrap_token: str = "",
        bootstrap_until_key: bool = False,
        commit_groups: bool = True,
        fail_queue_after_s: float = 60.0,
    ) -> None:
        self._bootstrap_token = bootstrap_token
        self._bootstrap_until_key = bootstrap_until_key
        self._fail_queue_after_s = fail_queue_after_s
        self.data_dir = os.path.abspath(data_dir)
        self._map_size = map_size
        self._sync = sync
        self._max_inbox = max_inbox
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="querator-storage")
        # A queue's held write transaction must begin and end on one thread
        # (queue_store.py), so each queue commits on one single-thread lane: the lane
        # with the fewest queues when the queue starts, kept until it is deleted.
        self._lanes = [
            StorageLane(f"querator-lane-{i}") for i in range(max(1, workers))
        ]
        self._lane_of: dict[int, int] = {}  # queue uid -> lane index
        self._groups = CommitGroups(self.data_dir, self._lanes, map_size=map_size, sync=sync, enabled=commit_groups)
        # Calls refused because the server is closing (the shutdown waits for a lull).
        self.refused_while_closing = 0
        self._catalog: Catalog | None = None
        self._configs: dict[str, QueueConfig] = {}
        # Queues set aside (set_aside): not served, storage kept; by set-aside id.
        self._aside: dict[str, SetAside] = {}
        self._names: list[str] = []
        self._actors: dict[str, LogicalQueue] = {}
        # Copies of replicated queues' shards, served here (with an actor) or passive.
        self._copies: dict[str, ReplicaCopy] = {}
        self._stepping_down: set[asyncio.Task[None]] = set()
        # Queues that failed to load or whose storage kept failing: name -> why.
        self._failed: dict[str, str] = {}
        # Queues with faulty partitions: name -> how many (actor/cycle_base.py).
        self._faulty: dict[str, int] = {}
        # Told the number of faulty partitions on the server when it changes (health).
        self.on_faulty_partitions: Callable[[int], None] | None = None
        self._lock = asyncio.Lock()
        self._closing = False
        # Metrics (metrics.Metrics) hooks each actor as it is made; None when off.
        self.observer: Any = None
        # Where dead letters for a queue go when that is not simply its queue here (a
        # cluster's replicated dead-letter queue is served by its primary's node): set
        # by the cluster; None: this node's queue of that name.
        self.dead_queue_route: Callable[[str], Any] | None = None
        # The same for a redrive's targets, by uid (a replicated queue's primary may be
        # another node), and the queues a redrive may reach that are not here.
        self.redrive_route: Callable[[int], Any] | None = None
        self.redrive_targets: Callable[[Callable[[str], bool] | None], dict[int, str]] | None = None
        # What the source ids of this node's one-copy queues start with in a replicated
        # dead-letter queue (cluster/dead_letter_source.py); "" on a single server.
        self.own_source_prefix = ""
        self.keyring = KeyRing()
        # Signs page tokens; kept in the catalog (read at start).
        self.token_secret = b""

    # -- start and stop --------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self._lock_fd: int | None = _lock_data_dir(self.data_dir)
        try:
            await loop.run_in_executor(self._executor, _check_layout, self.data_dir)
        except BaseException:
            self._unlock()
            raise
        try:
            self._catalog = await loop.run_in_executor(
                self._executor, lambda: Catalog(os.path.join(self.data_dir, "catalog"), sync=self._sync)
            )
            configs = await loop.run_in_executor(self._executor, self._catalog.load)
            self.token_secret = self._catalog.token_secret
            aside = await loop.run_in_executor(self._executor, self._catalog.load_aside)
        except StorageError as exc:
            raise DataDirError(f"{exc}; refusing to start") from exc
        for config, record in aside:
            entry = SetAside.from_record(config, record)
            self._aside[entry.aside_id] = entry
        failures = self._check_queue_files(configs)
        try:
            # Set-aside queues own their storage as much as served ones: never dropped here.
            owned = configs + [a.config for a in self._aside.values()]
            by_uid = await loop.run_in_executor(self._executor, self._groups.load, owned)
        except (StorageError, OSError) as exc:
            raise DataDirError(f"{exc}; refusing to start") from exc
        failures.update((c.name, by_uid[c.uid]) for c in configs if c.uid in by_uid)
        records = await loop.run_in_executor(self._executor, self._catalog.load_keys)
        self.keyring = KeyRing(
            (key_from_record(r) for r in records),
            bootstrap_token=self._bootstrap_token,
            bootstrap_until_key=self._bootstrap_until_key,
        )
        for config in configs:
            self._configs[config.name] = config
            if config.name in failures:
                self._queue_failed(config.name, failures[config.name])
                continue
            try:
                if config.shard_copy:  # passive until the cluster promotes it
                    self._copies[config.name] = await self._open_copy_storage(config)
                    continue
                self._actors[config.name] = await self._start_actor(config)
            except Exception as exc:
                home = self._groups.path(config.group) if config.group >= 0 else self._queue_path(config.uid)
                self._queue_failed(config.name, f"cannot load {os.path.join(home, 'data.mdb')}: {exc}")
        self._names = sorted(self._configs)
        await loop.run_in_executor(self._executor, self._remove_orphans)
        pending = [actor.resume_dead_letters() for actor in self._actors.values()]
        if pending:
            done = asyncio.gather(*pending)
            try:
                await asyncio.wait_for(asyncio.shield(done), timeout=_RESUME_TIMEOUT_S)
            except TimeoutError:
                log.warning("dead_letters_pending", detail="still handing over dead letters after start")
        log.info("queues_loaded", queues=len(self._configs), data_dir=self.data_dir)

    def _queue_path(self, uid: int) -> str:
        return os.path.join(self.data_dir, "queues", str(uid))

    def _check_queue_files(self, configs: list[QueueConfig]) -> dict[str, str]:
        """Never serve a queue empty because its file is gone (groups: CommitGroups.load):
        why, by name, the queues with a directory of their own that cannot be served."""
        failures: dict[str, str] = {}
        for config in configs:
            if config.group >= 0:
                continue
            data = os.path.join(self._queue_path(config.uid), "data.mdb")
            if not os.path.isfile(data) or os.path.getsize(data) == 0:
                failures[config.name] = f"{data}: the queue's storage is missing or empty"
        return failures

    def _queue_failed(self, name: str, reason: str) -> None:
        """Serve ``name`` no more: its calls answer UNAVAILABLE with the reason (without
        the server's paths), GetQueue shows it failed, and nothing touches its storage
        until the server starts again (docs/operations.md, "A queue that failed")."""
        self._failed[name] = reason
        log.error("queue_failed", queue=name, reason=reason)

    def failure(self, name: str) -> str:
        """Why queue ``name`` failed, as callers may see it; "" while it serves."""
        reason = self._failed.get(name)
        return "" if reason is None else _PATH.sub("<file>", reason)[:500]

    def failed_queues(self) -> int:
        return len(self._failed)

    def queue_count(self) -> int:
        """Queues the server has, serving or not: one that failed to load has no actor,
        so counting actors would hide it from the queue count."""
        return len(self._configs)

    def faulty_partitions(self) -> int:
        """Partitions of all queues left out because their storage failed."""
        return sum(self._faulty.values())

    def _partitions_faulty(self, name: str, count: int) -> None:
        before = self.faulty_partitions()
        if count:
            self._faulty[name] = count
        else:
            self._faulty.pop(name, None)
        after = self.faulty_partitions()
        if after != before and self.on_faulty_partitions is not None:
            self.on_faulty_partitions(after)

    def _remove_orphans(self) -> None:
        """Delete storage left behind by a queue deletion that a crash interrupted."""
        root = os.path.join(self.data_dir, "queues")
        if not os.path.isdir(root):
            return
        live = {str(c.uid) for c in self._stored_configs() if c.group < 0}
        for entry in os.listdir(root):
            if entry.isdigit() and entry not in live:
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)

    def _stored_configs(self) -> builtins.list[QueueConfig]:
        """Every queue whose storage the data directory keeps: served or set aside."""
        return [*self._configs.values(), *(a.config for a in self._aside.values())]

    def _lane(self, uid: int) -> StorageLane:
        if uid not in self._lane_of:
            users = [0] * len(self._lanes)
            for index in self._lane_of.values():
                users[index] += 1
            self._lane_of[uid] = users.index(min(users))
        return self._lanes[self._lane_of[uid]]

    async def _start_actor(
        self,
        config: QueueConfig,
        stopped: LogicalQueue | None = None,
        *,
        created: bool = False,
        copy: ReplicaCopy | None = None,
        replication: Replication | None = None,
        epoch: int = 0,
    ) -> LogicalQueue:
        """Start an actor for ``config``; on ``stopped``'s open storage when given, or as
        the primary of ``copy`` under ``epoch``. ``created``: the queue is new, so
        storage made for it goes if the start fails."""
        loop = asyncio.get_running_loop()
        lane = self._lane(config.uid)
        group = None
        if copy is not None:
            store, group = copy.state.store, copy.group
            if store.partitions < config.partitions:  # settings changed while it was passive
                grow = partial(store.ensure_partitions, config.partitions)
                await (group.job(grow) if group is not None else lane.run(grow))
        elif stopped is not None:
            store, group = stopped.store, stopped.group
        elif config.group >= 0:
            group = await loop.run_in_executor(self._executor, self._groups.get, config.group)
            store = await group.job(
                lambda: QueueStore(group.path, config.partitions, shared=group.env, prefix=queue_prefix(config.uid))
            )
        else:
            store = await loop.run_in_executor(
                self._executor,
                lambda: QueueStore(
                    self._queue_path(config.uid), config.partitions, map_size=self._map_size, sync=self._sync
                ),
            )
        actor = LogicalQueue(
            config,
            store,
            lane,
            resolve=self._dead_queue,
            resolve_uid=self._redrive_target,
            max_inbox=self._max_inbox,
            group=group,
            fail_after_s=self._fail_queue_after_s,
            on_failed=self._queue_failed,
            on_partitions=self._partitions_faulty,
            replication=None if copy is None else replication or _ALONE,
            epoch=epoch,
            on_deposed=None if copy is None else self._deposed,
        )
        if self.observer is not None:
            self.observer.attach(actor)
        try:
            if copy is not None:
                await actor.start(copy.state.keyed, copy.state)
                return actor
            await actor.start(stopped.keyed_index if stopped is not None else None)
        except BaseException:
            if copy is not None:  # the copy stays as it was
                if self.observer is not None:
                    self.observer.detach(config.name)
            elif created and group is not None:  # its databases would hold slots of max_dbs
                with contextlib.suppress(StorageError):
                    await group.job(store.destroy)
            elif stopped is None and group is None:  # a damaged file stays as it is, closed
                with contextlib.suppress(Exception):
                    await loop.run_in_executor(self._executor, store.close)
            raise
        if group is not None and stopped is None:
            group.members += 1
        return actor

    async def stop(self) -> None:
        """Drain every actor, then close storage."""
        self._closing = True
        async with self._lock:
            passive = [copy for name, copy in self._copies.items() if name not in self._actors]
            await asyncio.gather(*(actor.stop() for actor in self._actors.values()))
            self._actors.clear()
            for copy in passive:
                await copy.close()
            self._copies.clear()
            await self._groups.close()
            if self._catalog is not None:
                self._catalog.close()
                self._catalog = None
        self._executor.shutdown(wait=True)
        for lane in self._lanes:
            lane.shutdown(wait=True)
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # -- lookups ------------------------------------------------------------------------

    def actor(self, name: str) -> LogicalQueue:
        actor = self._actors.get(name)
        if actor is None or name in self._failed:
            if name in self._failed:
                raise self._failed_error(name)
            if self._closing:
                raise self._shutting_down()
            if name in self._copies:
                raise Unavailable(f"queue {name!r} is not served on this node (it keeps a passive copy); retry at its primary")
            raise NotFound(f"queue {name!r} does not exist")
        return actor

    def _failed_error(self, name: str) -> Unavailable:
        return Unavailable(
            f"queue {name!r} has failed and is not served: {self.failure(name)}; "
            "repair or restore its storage and restart the server, or delete the queue"
        )
    def _dead_queue(self, name: str) -> Any:
        """What a queue hands its dead letters to (``submit(DeadLetterRequest)``)."""
        route = self.dead_queue_route
        return self.actor(name) if route is None else route(name)

    def _redrive_target(self, uid: int) -> Any:
        """What a redrive hands the items for queue ``uid`` to (``submit(RedriveInRequest)``),
        or None when that queue is gone."""
        route = self.redrive_route
        return self.actor_by_uid(uid) if route is None else route(uid)

    def actor_by_uid(self, uid: int) -> LogicalQueue | None:
        """The running actor of the queue whose storage uid is ``uid`` (None: none is;
        the queue was deleted)."""
        return next((actor for actor in self._actors.values() if actor.config.uid == uid), None)

    def get(self, name: str) -> QueueConfig:
        config = self._configs.get(name)
        if config is None:
            raise NotFound(f"queue {name!r} does not exist")
        return config

    def list(
        self, after: str, limit: int, visible: Callable[[str], bool] | None = None
    ) -> tuple[list[QueueConfig], bool]:
        """Up to ``limit`` queues named after ``after`` (and ``visible``), and whether more follow."""
        start = bisect.bisect_right(self._names, after) if after else 0
        if visible is None:
            names = self._names[start : start + limit + 1]
        else:
            names = []
            for name in itertools.islice(self._names, start, None):
                if visible(name):
                    names.append(name)
                    if len(names) > limit:
                        break
        return [self._configs[n] for n in names[:limit]], len(names) > limit

    def queues_by_uid(
        self, visible: Callable[[str], bool] | None = None, origin: QueueConfig | None = None
    ) -> dict[int, str]:
        """The name of every queue (that is ``visible``) a redrive out of ``origin`` may
        move items back to, by storage uid; with those it reaches elsewhere
        (``redrive_targets``).

        A replicated origin's items were dead-lettered on whichever node was its primary
        then, or sent there from another node: a one-copy queue's uid in their source_id
        is the uid on *that* node, and here it may name another queue. Only the uids the
        cluster hands out (replicated queues') name a source safely there; the others'
        items stay and are counted skipped.
        """
        here = {c.uid: c.name for c in self._configs.values() if visible is None or visible(c.name)}
        if self.redrive_targets is None:
            return here
        elsewhere = self.redrive_targets(visible)
        if origin is not None and origin.replicas > 1:
            return elsewhere
        return {**elsewhere, **here}

    def own_sources(
        self, visible: Callable[[str], bool] | None, origin: QueueConfig
    ) -> tuple[str, dict[int, str]]:
        """For a redrive out of a replicated ``origin``: the prefix naming this node's
        one-copy sources there, and those queues by uid (``RedriveRequest.own``)."""
        if not self.own_source_prefix or origin.replicas <= 1:
            return "", {}
        mine = {c.uid: c.name for c in self._configs.values() if c.replicas <= 1 and (visible is None or visible(c.name))}
        return self.own_source_prefix, mine

    def uid_of(self, name: str) -> int:
        """The storage uid of queue ``name`` here, or of a replicated queue whose primary
        is another node (a redrive's target_queue); NotFound when neither."""
        config = self._configs.get(name)
        if config is not None:
            return config.uid
        elsewhere = {} if self.redrive_targets is None else self.redrive_targets(None)
        uid = next((u for u, n in elsewhere.items() if n == name), 0)
        if not uid:
            raise NotFound(f"queue {name!r} does not exist")
        return uid

    # -- admin --------------------------------------------------------------------------

    async def create(self, config: QueueConfig, visible: Callable[[str], bool] | None = None) -> QueueConfig:
        """Create a queue; ``visible``: the queues the caller may see (error texts name no other)."""
        async with self._lock:
            self._check_open()
            if config.name in self._configs:
                raise AlreadyExists(f"queue {config.name!r} already exists")
            check_dead_queue(config, self._configs, visible)
            loop = asyncio.get_running_loop()
            catalog = self._require_catalog()
            try:
                uid = await loop.run_in_executor(self._executor, catalog.next_uid)
                now = now_us()
                group = self._groups.place(config, self._stored_configs())
                config = config.replace(uid=uid, created_at_us=now, updated_at_us=now, group=group)
                actor = await self._start_actor(config, created=True)
            except (StorageError, OSError) as exc:
                self._lane_of.pop(config.uid, None)
                raise _storage_failed(exc) from exc
            try:
                await loop.run_in_executor(self._executor, catalog.put, config)
            except Exception as exc:
                await actor.stop()
                if actor.group is not None:
                    actor.group.members -= 1
                    # Its databases hold slots of the group's max_dbs: drop them now
                    # (or, if that fails too, at the next start).
                    with contextlib.suppress(StorageError):
                        await actor.group.job(actor.store.destroy)
                self._lane_of.pop(config.uid, None)
                if self.observer is not None:
                    self.observer.detach(config.name)
                if isinstance(exc, StorageError | OSError):
                    raise _storage_failed(exc) from exc
                raise
            self._configs[config.name] = config
            bisect.insort(self._names, config.name)
            self._actors[config.name] = actor
            log.info("queue_created", queue=config.name, partitions=config.partitions)
            return config

    async def update(
        self, name: str, changes: dict[str, object], visible: Callable[[str], bool] | None = None
    ) -> QueueConfig:
        async with self._lock:
            self._check_open()
            current = self.get(name)
            if name in self._failed:
                raise self._failed_error(name)
            updated = current.replace(**changes, updated_at_us=now_us())
            check_update(current, updated)
            if "dead_queue" in changes:
                check_dead_queue(updated, self._configs, visible)
            loop = asyncio.get_running_loop()
            actor = self._actors.get(name)
            copy = self._copies.get(name)
            if copy is not None and copy.group is not None and updated.partitions + 1 > GROUP_MAX_PARTITIONS:
                # Its copies would have to leave their groups in step; not done yet.
                raise FailedPrecondition(
                    f"replicated queue {name!r} keeps its storage in a commit group here, which holds at most "
                    f"{GROUP_MAX_PARTITIONS - 1} of its partitions"
                )
            if actor is not None and actor.group is not None and updated.partitions > GROUP_MAX_PARTITIONS:
                await self._move_out(actor, updated.replace(group=-1))
                return self._configs[name]
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().put, updated)
            except (StorageError, OSError) as exc:
                raise _storage_failed(exc) from exc
            self._configs[name] = updated
            if actor is not None:  # a passive copy opens partitions as change sets name them
                await actor.reconfigure(updated)
            return updated

    async def _move_out(self, actor: LogicalQueue, updated: QueueConfig) -> None:
        """Give a grouped queue that outgrew its group a directory of its own."""
        loop = asyncio.get_running_loop()
        group = actor.group
        assert group is not None
        path = self._queue_path(updated.uid)
        copy = partial(copy_out, path=path, partitions=updated.partitions, map_size=self._map_size, sync=self._sync)

        async def persist() -> None:
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().put, updated)
            except (StorageError, OSError) as exc:
                raise _storage_failed(exc) from exc
            self._configs[updated.name] = updated
            group.members -= 1

        await actor.move_out(updated, copy, persist)
        log.info("queue_moved_out_of_group", queue=updated.name, partitions=updated.partitions)

    async def delete(self, name: str, force: bool, visible: Callable[[str], bool] | None = None) -> None:
        async with self._lock:
            self._check_open()
            self.get(name)
            check_deletable(name, self._configs.values(), visible)
            if name in self._copies:
                raise FailedPrecondition(f"queue {name!r} is a copy of a replicated queue here; the cluster drops it")
            if name in self._failed:
                await self._delete_failed(name, force)
                return
            actor = self._actors[name]
            await actor.delete(force)
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().delete, name)
            except (StorageError, OSError) as exc:
                # The actor stopped but the catalog still has the queue: bring the
                # queue back as it was on its still-open storage (reading needs no
                # write), so nothing is half-deleted.
                self._actors[name] = await self._start_actor(self._configs[name], actor)
                raise _storage_failed(exc) from exc
            del self._configs[name]
            self._names.remove(name)
            del self._actors[name]
            self._partitions_faulty(name, 0)
            if self.observer is not None:
                self.observer.detach(name)
            # A crash before this point leaves an orphan directory that start-up removes.
            if actor.group is not None:
                actor.group.members -= 1
                try:
                    await actor.group.job(actor.store.destroy)
                except StorageError as exc:  # the catalog forgot it: start-up drops them
                    log.warning("queue_storage_left", queue=name, error=str(exc))
            else:
                await loop.run_in_executor(self._lane(actor.config.uid), actor.store.destroy)
            del self._lane_of[actor.config.uid]
            log.info("queue_deleted", queue=name)

    async def _delete_failed(self, name: str, force: bool) -> None:
        """Delete a failed queue: what it holds is unknown, so only with ``force``. A
        directory of its own goes; databases in a commit group go at the next start that
        loads the group (start-up drops what the catalog does not know)."""
        if not force:
            raise FailedPrecondition(f"queue {name!r} has failed and what it holds is unknown; set force to delete it")
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._require_catalog().delete, name)
        except (StorageError, OSError) as exc:
            raise _storage_failed(exc) from exc
        config = self._configs.pop(name)
        self._names.remove(name)
        del self._failed[name]
        actor = self._actors.pop(name, None)
        if actor is not None:
            await actor.stop()
            if actor.group is not None:
                actor.group.members -= 1
        if config.group < 0:
            path = self._queue_path(config.uid)
            await loop.run_in_executor(self._executor, partial(shutil.rmtree, path, ignore_errors=True))
        self._lane_of.pop(config.uid, None)
        if self.observer is not None:
            self.observer.detach(name)
        log.info("queue_deleted", queue=name, failed=True)

    # -- copies of replicated queues (the cluster's data path drives them) -----------------

    def copy(self, name: str) -> ReplicaCopy:
        """This node's copy of replicated queue ``name``."""
        copy = self._copies.get(name)
        if copy is None:
            if name in self._failed:
                raise Unavailable(f"queue {name!r}: this node's copy failed to load ({self.failure(name)}); reset it")
            raise NotFound(f"queue {name!r} has no copy on this node")
        return copy

    async def reset_copy(self, name: str) -> ReplicaCopy:
        """Throw this node's copy of ``name`` away and make it anew, empty, as another
        incarnation: for a copy that failed to load (a damaged file) or diverged. A
        snapshot then fills it (``install_snapshot``)."""
        async with self._lock:
            self._check_open()
            config = self.get(name)
            if not config.shard_copy:
                raise FailedPrecondition(f"queue {name!r} is not a copy of a replicated queue here")
            if name in self._actors:
                raise FailedPrecondition(f"queue {name!r} is served here; demote it first")
            copy = self._copies.pop(name, None)
            loop = asyncio.get_running_loop()
            if copy is not None:
                await self._destroy_copy(copy)
            elif config.group >= 0:
                group = await loop.run_in_executor(self._executor, self._groups.get, config.group)
                try:
                    store = await group.job(
                        lambda: QueueStore(group.path, config.partitions, shared=group.env, prefix=queue_prefix(config.uid))
                    )
                    await group.job(store.destroy)
                except StorageError as exc:
                    raise _storage_failed(exc) from exc
            else:
                await loop.run_in_executor(
                    self._executor, partial(shutil.rmtree, self._queue_path(config.uid), ignore_errors=True)
                )
            self._failed.pop(name, None)
            try:
                copy = await self._open_copy_storage(config)
            except (StorageError, OSError) as exc:
                self._queue_failed(name, f"cannot make its copy anew: {exc}")
                raise _storage_failed(exc) from exc
            self._copies[name] = copy
            log.warning("shard_copy_reset", queue=name, uid=config.uid, incarnation=copy.incarnation)
            return copy

    def copy_configs(self) -> builtins.list[QueueConfig]:
        """The copies of replicated queues this node keeps (served, passive or failed)."""
        return [config for config in self._configs.values() if config.shard_copy]

    async def drop_copy(self, name: str, uid: int) -> bool:
        """Remove this node's copy of shard ``uid`` (queue ``name``) for good, storage
        and all: the queue was deleted, or the copy left the shard (moved, retired). A
        copy served here is demoted first. False when there is no such copy here."""
        async with self._lock:
            self._check_open()
            config = self._configs.get(name)
            if config is None or not config.shard_copy or config.uid != uid:
                return False
            await self._demote(name, "its copy leaves this node")
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().delete, name)
            except (StorageError, OSError) as exc:
                raise _storage_failed(exc) from exc
            # A crash from here on leaves storage the catalog no longer knows, which
            # start-up removes (a directory of its own, or databases of a group).
            del self._configs[name]
            self._names.remove(name)
            self._failed.pop(name, None)
            copy = self._copies.pop(name, None)
            if copy is not None:
                await self._destroy_copy(copy)
            elif config.group < 0:
                await loop.run_in_executor(
                    self._executor, partial(shutil.rmtree, self._queue_path(config.uid), ignore_errors=True)
                )
            self._lane_of.pop(config.uid, None)
            if self.observer is not None:
                self.observer.detach(name)
            log.info("shard_copy_dropped", queue=name, uid=uid)
            return True

    async def open_copy(self, config: QueueConfig) -> ReplicaCopy:
        """A passive copy of a replicated queue's shard, ``config.uid`` being the shard's
        (the same on every node, so item ids stay valid on any copy): made empty, or
        the one this node has. No actor, no lifecycle until ``promote``."""
        async with self._lock:
            self._check_open()
            name = config.name
            current = self._configs.get(name)
            if name in self._copies and current is not None:
                if current.uid != config.uid:
                    raise FailedPrecondition(f"queue {name!r} has a copy of shard {current.uid} here, not of {config.uid}")
                return self._copies[name]
            if current is not None:
                raise AlreadyExists(f"queue {name!r} exists on this node and is not a copy of shard {config.uid}")
            if config.uid <= 0 or any(c.uid == config.uid for c in self._stored_configs()):
                raise FailedPrecondition(f"storage uid {config.uid} is taken on this node; a shard needs a uid of its own")
            now = now_us()
            # Its replica database takes a slot of a group's max_dbs, as a partition does.
            group = self._groups.place(config.replace(partitions=config.partitions + 1), self._stored_configs())
            config = config.replace(shard_copy=True, group=group, created_at_us=config.created_at_us or now, updated_at_us=now)
            loop = asyncio.get_running_loop()
            try:
                copy = await self._open_copy_storage(config)
            except (StorageError, OSError) as exc:
                self._lane_of.pop(config.uid, None)
                raise _storage_failed(exc) from exc
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().put, config)
            except (StorageError, OSError) as exc:
                await self._destroy_copy(copy)
                self._lane_of.pop(config.uid, None)
                raise _storage_failed(exc) from exc
            self._configs[name] = config
            bisect.insort(self._names, name)
            self._copies[name] = copy
            log.info("shard_copy_opened", queue=name, uid=config.uid, incarnation=copy.incarnation)
            return copy

    async def _open_copy_storage(self, config: QueueConfig) -> ReplicaCopy:
        loop = asyncio.get_running_loop()
        lane = self._lane(config.uid)
        if config.group >= 0:
            group = await loop.run_in_executor(self._executor, self._groups.get, config.group)
            store = await group.job(
                lambda: QueueStore(group.path, config.partitions, shared=group.env, prefix=queue_prefix(config.uid))
            )
            state = await group.job(lambda: ReplicaState(store, None, config.uid))
            group.members += 1
            return ReplicaCopy(config.name, state, lane, group)
        path = self._queue_path(config.uid)
        store = await loop.run_in_executor(
            self._executor, lambda: QueueStore(path, config.partitions, map_size=self._map_size, sync=self._sync)
        )
        try:
            state = await lane.run(lambda: ReplicaState(store, None, config.uid))
        except BaseException:
            await lane.run(store.close)
            raise
        return ReplicaCopy(config.name, state, lane, None)

    async def _destroy_copy(self, copy: ReplicaCopy) -> None:
        with contextlib.suppress(StorageError):
            if copy.group is not None:
                copy.group.members -= 1
                await copy.group.job(copy.state.store.destroy)
            else:
                await copy.lane.run(copy.state.store.destroy)

    async def promote(self, name: str, epoch: int, replication: Replication | None) -> None:
        """Serve ``name`` from this node's copy as its primary under ``epoch``: the copy
        is fenced at ``epoch`` first (durably), then loaded as a restart loads a queue.
        Its cycles answer once ``replication`` has their change sets (None: at once,
        a primary with no other copy to wait for)."""
        async with self._lock:
            self._check_open()
            copy = self.copy(name)
            if name in self._actors:
                if copy.serving_epoch == epoch:
                    return
                raise FailedPrecondition(f"queue {name!r} is served here under epoch {copy.serving_epoch}, not {epoch}")
            config = self._configs[name]
            actor = await copy.serve(
                epoch, partial(self._start_actor, config, copy=copy, replication=replication, epoch=epoch)
            )
            copy.step_down = partial(self._step_down_for, name)
            self._actors[name] = actor
            actor.kick_outboxes()
            log.info("shard_promoted", queue=name, epoch=epoch, position=tuple(copy.position()))

    async def demote(self, name: str) -> None:
        """Stop serving ``name`` here; its copy stays, passive. Calls waiting fail UNAVAILABLE."""
        async with self._lock:
            await self._demote(name, "demoted")

    async def _demote(self, name: str, reason: str) -> None:
        actor = self._actors.get(name)
        copy = self._copies.get(name)
        if actor is None or copy is None:
            return
        del self._actors[name]
        try:
            await actor.step_down(reason)
        finally:
            copy.serving_epoch = 0
            if self.observer is not None:
                self.observer.detach(name)
        log.warning("shard_demoted", queue=name, reason=reason, position=tuple(copy.position()))

    async def _step_down_for(self, name: str, epoch: int) -> None:
        """A later epoch (``epoch``) reached this node's copy: another node was elected."""
        async with self._lock:
            await self._demote(name, f"epoch {epoch} was elected elsewhere")

    def _deposed(self, name: str, reason: str) -> None:
        """A primary here lost its replicas' acknowledgement: it becomes a passive copy."""

        async def demote() -> None:
            async with self._lock:
                await self._demote(name, reason)

        task = asyncio.get_running_loop().create_task(demote())
        self._stepping_down.add(task)
        task.add_done_callback(self._stepping_down.discard)

    # -- queues set aside ------------------------------------------------------------------

    async def set_aside(self, name: str, reason: str) -> SetAside:
        """Stop serving queue ``name`` and move it out of the served namespace, its storage
        kept as it is (a queue whose data must not be served, nor lost: cluster/coordinator.py).
        A queue of the same name may be created afterwards; ``remove_set_aside`` deletes it."""
        async with self._lock:
            self._check_open()
            config = self.get(name)
            actor = self._actors.get(name)
            items = -1  # unknown: a failed queue's storage was not read
            if actor is not None and name not in self._failed:
                totals = actor.totals()
                items = totals.ready + totals.leased + totals.scheduled
            entry = SetAside(
                aside_id=f"{name}@{config.uid}", config=config, reason=reason, items=items, at_us=now_us()
            )
            loop = asyncio.get_running_loop()
            if actor is not None and name in self._failed:
                await actor.stop()
            elif actor is not None:
                await actor.delete(force=True)  # stops it for good; nothing is dropped
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().set_aside, config, entry.record())
            except (StorageError, OSError) as exc:
                if actor is not None:
                    self._actors[name] = await self._start_actor(config, actor)
                raise _storage_failed(exc) from exc
            del self._configs[name]
            self._names.remove(name)
            self._failed.pop(name, None)
            self._partitions_faulty(name, 0)
            if self.observer is not None:
                self.observer.detach(name)
            if actor is not None:
                if actor.group is not None:
                    actor.group.members -= 1  # its databases stay in the group
                else:
                    await loop.run_in_executor(self._lane(config.uid), actor.store.close)
            self._lane_of.pop(config.uid, None)
            self._aside[entry.aside_id] = entry
            log.error(
                "queue_set_aside",
                queue=name,
                aside_id=entry.aside_id,
                items=items,
                reason=reason,
                detail="not served, kept on disk; list with 'querator cluster set-aside list'",
            )
            return entry

    def set_aside_queues(self) -> builtins.list[SetAside]:
        return sorted(self._aside.values(), key=lambda a: (a.config.name, a.at_us))

    async def remove_set_aside(self, aside_id: str) -> SetAside:
        """Delete a set-aside queue's storage for good."""
        async with self._lock:
            self._check_open()
            entry = self._aside.get(aside_id)
            if entry is None:
                raise NotFound(f"no queue set aside with id {aside_id!r}")
            config = entry.config
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().delete_aside, aside_id)
            except (StorageError, OSError) as exc:
                raise _storage_failed(exc) from exc
            del self._aside[aside_id]
            # A crash before the storage goes leaves what start-up removes: a directory or
            # group databases no catalog entry owns.
            if config.group >= 0:
                group = await loop.run_in_executor(self._executor, self._groups.get, config.group)
                try:
                    store = await group.job(
                        lambda: QueueStore(group.path, config.partitions, shared=group.env, prefix=queue_prefix(config.uid))
                    )
                    await group.job(store.destroy)
                except StorageError as exc:
                    log.warning("queue_storage_left", queue=config.name, error=str(exc))
            else:
                path = self._queue_path(config.uid)
                await loop.run_in_executor(self._executor, partial(shutil.rmtree, path, ignore_errors=True))
            log.warning("set_aside_queue_removed", queue=config.name, aside_id=aside_id, items=entry.items)
            return entry

    # -- the cluster identity (kept for cluster/identity.py, not read here) ----------------

    def cluster_identity(self) -> dict[str, Any] | None:
        return self._require_catalog().cluster_identity()

    async def put_cluster_identity(self, record: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._require_catalog().put_cluster_identity, record)

    def _check_open(self) -> None:
        if self._closing:
            raise self._shutting_down()

    def _shutting_down(self) -> Unavailable:
        self.refused_while_closing += 1
        return Unavailable("the server is shutting down")

    def _require_catalog(self) -> Catalog:
        if self._catalog is None:
            raise Unavailable("the server is shutting down")
        return self._catalog

    def queues(self) -> Iterable[LogicalQueue]:
        return self._actors.values()

    # -- API keys -----------------------------------------------------------------------

    async def create_key(self, role: Role, queues: builtins.list[str], description: str) -> tuple[ApiKey, str]:
        key, token = new_key(role, queues, description, now_us())
        record = key_record(key)
        async with self._lock:
            self._check_open()
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().put_key, key.key_id, record)
            except (StorageError, OSError) as exc:
                raise _storage_failed(exc) from exc
            self.keyring.add(key)
        log.info("key_created", key_id=key.key_id, role=key.role.name.lower(), queues=list(key.queues))
        return key, token

    async def revoke_key(self, key_id: str) -> None:
        async with self._lock:
            self._check_open()
            self.keyring.get(key_id)
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().delete_key, key_id)
            except (StorageError, OSError) as exc:
                raise _storage_failed(exc) from exc
            self.keyring.remove(key_id)
        log.info("key_revoked", key_id=key_id)


class _Alone(Replication):
    """The replication of a primary with no other copy to wait for."""

    async def replicated(self, change: ChangeSet) -> None:
        return None


_ALONE = _Alone()


@dataclass(frozen=True, slots=True)
class SetAside:
    """A queue set aside: its settings when it was, how many items it held (-1: unknown)."""

    aside_id: str
    config: QueueConfig
    reason: str
    items: int
    at_us: int

    def record(self) -> dict[str, Any]:
        return {"id": self.aside_id, "reason": self.reason, "items": self.items, "at_us": self.at_us}

    @classmethod
    def from_record(cls, config: QueueConfig, record: dict[str, Any]) -> SetAside:
        return cls(str(record["id"]), config, str(record["reason"]), int(record["items"]), int(record["at_us"]))

