"""Start-up: the data directory checked and locked, the catalog read, one actor per
queue started (a replicated queue's copy opened passive), storage no queue owns
removed, and dead letters a crash left handed over before the server serves calls."""

from __future__ import annotations

import asyncio
import os
import shutil

from ..auth import KeyRing
from ..model import QueueConfig
from ..queue_admin import key_from_record
from ..storage import Catalog, StorageError
from .copies import Copies
from .data_dir import DataDirError, check_layout, lock_data_dir
from .state import SetAside, log

# How long start-up waits for dead letters left by a crash to reach their queues.
_RESUME_TIMEOUT_S = 30.0


class Startup(Copies):
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        self._lock_fd = lock_data_dir(self.data_dir)
        try:
            await loop.run_in_executor(self._executor, check_layout, self.data_dir)
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

    def _remove_orphans(self) -> None:
        """Delete storage left behind by a queue deletion that a crash interrupted."""
        root = os.path.join(self.data_dir, "queues")
        if not os.path.isdir(root):
            return
        live = {str(c.uid) for c in self._stored_configs() if c.group < 0}
        for entry in os.listdir(root):
            if entry.isdigit() and entry not in live:
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
