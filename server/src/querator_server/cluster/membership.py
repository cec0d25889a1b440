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
import uuid
from collections.abc import Awaitable, Callable

from ..errors import FailedPrecondition, Unavailable
from ..logging import get_logger
from .etcd import CALL_TIMEOUT_S, Etcd, EtcdError, Txn

log = get_logger("cluster")

# How long a data call may wait for etcd to say who holds this node's id (verify).
_VERIFY_TIMEOUT_S = 1.0


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
        # What the member key says of the process holding it: this data directory's uuid
        # (cluster/identity.py) and this process's own, to tell a re-registration of
        # this process from another process that took the node id over.
        self.data_dir = ""
        self.instance = uuid.uuid4().hex
        # Set once another process holds this node id: this one must serve nothing more.
        self.superseded: dict[str, object] | None = None
        self.on_superseded: Callable[[dict[str, object]], None] | None = None
        self._verifying: asyncio.Task[None] | None = None
        self._verified_at = 0.0
        self._unreachable = False  # the last check could not reach etcd

    @property
    def fenced(self) -> bool:
        return not self.create_revision or time.monotonic() > self._renewed_at + self.ttl_s - self._margin

    def held_until(self) -> tuple[int, float]:
        """This node's registration (its member key's create revision; 0: none) and the
        monotonic time until which etcd surely keeps it: a renewal's send time + TTL
        (etcd counts the TTL from when it took the renewal, later). Before then no
        other node can see this one gone, so none can have taken its shards over."""
        if not self.create_revision:
            return 0, 0.0
        return self.create_revision, self._renewed_at + self.ttl_s

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
        value = json.dumps(
            {"address": self.address, "pid": os.getpid(), "data_dir": self.data_dir, "instance": self.instance}
        ).encode()
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

    # -- another process with this node id -------------------------------------------

    async def _check_holder(self, timeout: float = CALL_TIMEOUT_S) -> None:
        """After this process held the member key and may have lost it: if the key is now
        another process's, this one is superseded (on_superseded)."""
        if not self.registrations or self.superseded is not None:
            return
        _, kv = await self._etcd.get(self._key, timeout)
        if kv is None or kv.create_revision == self.create_revision:
            return
        try:
            holder = json.loads(kv.value)
        except ValueError:
            holder = {}
        if not isinstance(holder, dict) or holder.get("instance") == self.instance:
            return
        self.superseded = holder
        log.error(
            "cluster_node_id_taken_over",
            node=self.node,
            holder_pid=holder.get("pid"),
            holder_address=holder.get("address"),
            holder_data_dir=holder.get("data_dir"),
            data_dir=self.data_dir,
            detail="another process registered this node id while this one's lease had lapsed; "
            "this process stops serving and exits",
        )
        if self.on_superseded is not None:
            self.on_superseded(holder)

    @property
    def lapsed(self) -> bool:
        """Whether etcd may have expired this process's lease (no renewal for a whole TTL)."""
        return bool(self.registrations) and time.monotonic() > self._renewed_at + self.ttl_s

    async def verify(self) -> None:
        """Around a data call while the lease may have lapsed (a pause, say): make sure no
        other process holds this node id now. etcd out of reach proves nothing either way:
        the call goes on, as data calls do while etcd is away, and while it stays out of
        reach calls no longer wait for the check, made again in the background an
        interval on (on_superseded still ends the process if it finds another holder)."""
        if self.superseded is None and self.lapsed and time.monotonic() > self._verified_at + self._interval:
            if self._verifying is None or self._verifying.done():
                self._verifying = asyncio.create_task(self._verify_once())
            if not self._unreachable:
                await asyncio.shield(self._verifying)
        if self.superseded is not None:
            raise Unavailable(
                f"node id {self.node!r} is now held by another process; this one serves nothing more, "
                "send the call to another node"
            )

    async def _verify_once(self) -> None:
        try:
            await self._check_holder(timeout=_VERIFY_TIMEOUT_S)
            self._unreachable = False
        except EtcdError:
            self._unreachable = True
        self._verified_at = time.monotonic()

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
        if self.superseded is not None:
            return
        try:
            if not self.create_revision:
                await self._check_holder()
                if self.superseded is None:
                    await self.register(timeout=0)
            else:
                sent = time.monotonic()
                ttl = await self._etcd.keep_alive(self.lease, timeout=self._interval)
                if ttl <= 0:
                    log.warning("cluster_lease_expired", node=self.node, lease=self.lease)
                    await self._check_holder()
                    if self.superseded is not None:
                        return
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
