"""What the catalog keeps beside the queues: API keys, and the cluster identity
(kept for cluster/identity.py, not read here)."""

from __future__ import annotations

import asyncio
from typing import Any

from ..auth import ApiKey, Role, new_key
from ..clock import now_us
from ..queue_admin import key_record
from ..storage import StorageError
from .state import ManagerState, log, storage_failed


class CatalogRecords(ManagerState):
    async def create_key(self, role: Role, queues: list[str], description: str) -> tuple[ApiKey, str]:
        key, token = new_key(role, queues, description, now_us())
        record = key_record(key)
        async with self._lock:
            self._check_open()
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self._require_catalog().put_key, key.key_id, record)
            except (StorageError, OSError) as exc:
                raise storage_failed(exc) from exc
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
                raise storage_failed(exc) from exc
            self.keyring.remove(key_id)
        log.info("key_revoked", key_id=key_id)

    def cluster_identity(self) -> dict[str, Any] | None:
        return self._require_catalog().cluster_identity()

    async def put_cluster_identity(self, record: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._require_catalog().put_cluster_identity, record)
