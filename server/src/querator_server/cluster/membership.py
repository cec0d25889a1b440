"""This node's membership: ``members/<node>`` under an etcd lease that we keep alive.

The keepalive is our own loop of single renewals with deadlines, independent of any
watch. etcd answers a renewal of an expired lease with TTL 0 and no error, so the TTL
is checked; the node then registers again under a new lease. Admin writes stop at a
local monotonic deadline (the start of the last successful renewal + TTL - margin),
before etcd could have expired the lease, and every admin transaction also compares
the member key's create revision: a node that was paused past its TTL, or cut off,
cannot have an admin write applied with its old registration (the fencing token).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable

from ..errors import FailedPrecondition, Unavailable
from ..logging import get_logger
from .etcd import Etcd, EtcdError, Txn

log = get_logger("cluster")


class Membership:
    def __init__(
        self,
        etcd: Etcd,
        key: bytes,
        node: str,
        address: str,
        ttl_s: int,
        on_standing: Callable[[bool], Awaitable[None]],
    ) -> None:
        self._etcd = etcd
        self._key = key
        self.node = node
        self.address = address
        self.ttl_s = ttl_s
        # Renew three times per TTL; stop admin writes a third of the TTL before etcd
        # would expire the lease (a renewal that is late by more than that fences).
        self._interval = ttl_s / 3
        self._margin = ttl_s / 3
        self._on_standing = on_standing
        self.lease = 0
        self.create_revision = 0  # the fencing token admin transactions compare
        self._renewed_at = 0.0  # monotonic time a successful renewal was sent
        self._standing = False
        self.registrations = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def fenced(self) -> bool:
        return not self.create_revision or time.monotonic() > self._renewed_at + self.ttl_s - self._margin

    def check(self) -> None:
        """Raise unless this node may make admin writes now."""
        if self.fenced:
            raise Unavailable(
                f"node {self.node!r} cannot reach the cluster catalog (etcd) or lost its membership; "
                "admin changes are refused until it is back, data calls still work"
            )

    async def register(self, timeout: float) -> None:
        """Put ``members/<node>`` under a fresh lease; wait out a previous one's TTL."""
        deadline = time.monotonic() + timeout
        value = json.dumps({"address": self.address, "pid": os.getpid()}).encode()
        if self.lease:
            _, kv = await self._etcd.get(self._key)
            if kv is not None and kv.lease == self.lease:  # still ours: taken for lost too early
                self.create_revision = kv.create_revision
                return
        while True:
            sent = time.monotonic()
            lease = await self._etcd.grant(self.ttl_s)
            ok, revision = await self._etcd.txn(Txn().created_at(self._key, 0).put(self._key, value, lease))
            if ok:
                self.lease, self.create_revision, self._renewed_at = lease, revision, sent
                self.registrations += 1
                log.info("cluster_member_registered", node=self.node, lease=lease, revision=revision)
                return
            await self._etcd.revoke(lease)
            if time.monotonic() > deadline:
                raise FailedPrecondition(
                    f"node id {self.node!r} is registered by another live process; "
                    "each node needs an id of its own"
                )
            await asyncio.sleep(0.5)  # the key of an earlier run of this node expires within its TTL

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="querator-membership")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.lease:
            try:  # others see this node leave now rather than after its TTL
                await self._etcd.revoke(self.lease)
            except EtcdError:
                pass

    def lost(self) -> None:
        """The member key vanished (revoked or deleted by hand): register again."""
        self.create_revision = 0

    async def _run(self) -> None:
        while True:
            await self._tick()
            await asyncio.sleep(self._interval)

    async def _tick(self) -> None:
        try:
            if not self.create_revision:
                await self.register(timeout=0)
            else:
                sent = time.monotonic()
                ttl = await self._etcd.keep_alive(self.lease, timeout=self._interval)
                if ttl <= 0:
                    log.warning("cluster_lease_expired", node=self.node, lease=self.lease)
                    self.create_revision = 0
                    await self.register(timeout=0)
                else:
                    self._renewed_at = sent
        except (EtcdError, FailedPrecondition) as exc:
            log.warning("cluster_keepalive_failed", node=self.node, error=str(exc))
        except Exception:
            log.exception("cluster_keepalive_failed", node=self.node)
        standing = not self.fenced
        if standing != self._standing:
            self._standing = standing
            # Losing standing is news for an operator; holding it (at start, or again) is not.
            if standing:
                log.info("cluster_standing", node=self.node, fenced=False)
            else:
                log.warning("cluster_standing", node=self.node, fenced=True)
            await self._on_standing(standing)
