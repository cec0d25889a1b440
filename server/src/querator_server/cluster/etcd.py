"""A thin etcd v3 client: unary calls with deadlines, one keepalive, one watch.

It speaks etcd's own gRPC API through the stubs the ``aetcd`` package ships (generated
from etcd's protos). aetcd's ``Client`` is not used: its watches share one stream and
all end, never re-established, on the first error; its lease refresh hides an expired
lease behind TTL 0; it has no per-call deadline. Those loops are ours (catalog.py,
membership.py); this module only makes single calls, each with a deadline, so a
paused or unreachable etcd costs a bounded wait, never a hang.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc
from aetcd import rpc  # type: ignore[import-untyped]

from ..errors import InvalidArgument

# One unary call to etcd: long enough for a loaded 2-core machine, short enough that
# an admin call on a node cut off from etcd answers UNAVAILABLE within seconds.
CALL_TIMEOUT_S = 3.0


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the cluster's catalog lives: ``etcd://host:port[,host:port...]/prefix``."""

    targets: tuple[str, ...]
    prefix: str  # "/name/", every key of the cluster starts with it

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme != "etcd" or not parts.netloc:
            raise InvalidArgument("cluster", f"must look like etcd://host:port/prefix, got {url!r}")
        name = parts.path.strip("/")
        if not name:
            raise InvalidArgument("cluster", f"needs a prefix naming the cluster (etcd://host:port/prod), got {url!r}")
        return cls(tuple(parts.netloc.split(",")), f"/{name}/")


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class EtcdError(Exception):
    """etcd did not answer (in time): nothing is known to have changed."""


class Compacted(Exception):
    """A watch asked for history etcd has compacted away: re-list."""

    def __init__(self, revision: int) -> None:
        super().__init__(f"revision compacted up to {revision}")
        self.revision = revision


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


async def _hold_open(message: Any) -> AsyncIterator[Any]:
    """A request stream of one message that stays open: etcd ends a watch or a
    keepalive stream whose client side closed, possibly before it answered."""
    yield message
    await asyncio.Event().wait()


def _kv(kv: Any) -> KeyValue:
    return KeyValue(bytes(kv.key), bytes(kv.value), kv.create_revision, kv.mod_revision, kv.lease)


@dataclass(frozen=True, slots=True)
class Event:
    deleted: bool
    kv: KeyValue


class Txn:
    """Compare-and-write, built up and then sent by ``Etcd.txn``."""

    def __init__(self) -> None:
        self.compare: list[Any] = []
        self.success: list[Any] = []

    def created_at(self, key: bytes, revision: int) -> Txn:
        """``key``'s create revision is ``revision`` (0: the key does not exist)."""
        self.compare.append(
            rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=revision)
        )
        return self

    def modified_at(self, key: bytes, revision: int) -> Txn:
        self.compare.append(
            rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)
        )
        return self

    def put(self, key: bytes, value: bytes, lease: int = 0) -> Txn:
        self.success.append(rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease)))
        return self

    def delete(self, key: bytes) -> Txn:
        self.success.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)))
        return self


class Etcd:
    """One gRPC channel to etcd; tries the given endpoints in turn on failure."""

    def __init__(self, targets: Sequence[str]) -> None:
        self._targets = list(targets)
        self._index = 0
        self._open()

    def _open(self) -> None:
        target = self._targets[self._index % len(self._targets)]
        self.channel = grpc.aio.insecure_channel(
            target,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self._kv = rpc.KVStub(self.channel)
        self._lease = rpc.LeaseStub(self.channel)
        self._watch = rpc.WatchStub(self.channel)

    async def _failed(self, exc: grpc.aio.AioRpcError) -> EtcdError:
        if len(self._targets) > 1:  # the next endpoint, for the next call
            old = self.channel
            self._index += 1
            self._open()
            await old.close(None)
        return EtcdError(f"etcd: {exc.code().name}: {exc.details()}")

    async def close(self) -> None:
        await self.channel.close(None)

    async def range_prefix(self, prefix: bytes) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the revision they were read at (linearizable)."""
        try:
            reply = await self._kv.Range(
                rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix)), timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from None
        return reply.header.revision, [_kv(kv) for kv in reply.kvs]

    async def get(self, key: bytes) -> tuple[int, KeyValue | None]:
        try:
            reply = await self._kv.Range(rpc.RangeRequest(key=key), timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from None
        return reply.header.revision, (_kv(reply.kvs[0]) if reply.kvs else None)

    async def txn(self, txn: Txn) -> tuple[bool, int]:
        """Send ``txn``: whether every comparison held (and so it was written), and the revision."""
        try:
            reply = await self._kv.Txn(
                rpc.TxnRequest(compare=txn.compare, success=txn.success), timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from None
        return bool(reply.succeeded), int(reply.header.revision)

    async def grant(self, ttl_s: int) -> int:
        try:
            reply = await self._lease.LeaseGrant(rpc.LeaseGrantRequest(TTL=ttl_s), timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from None
        if reply.error:
            raise EtcdError(f"etcd refused a lease: {reply.error}")
        return int(reply.ID)

    async def keep_alive(self, lease: int, timeout: float) -> int:
        """Renew ``lease`` once; its remaining TTL in seconds, 0 when it had expired.

        etcd answers an expired lease with TTL 0 and no error, so the caller must
        look at the TTL.
        """
        call = self._lease.LeaseKeepAlive(_hold_open(rpc.LeaseKeepAliveRequest(ID=lease)), timeout=timeout)
        try:
            async for reply in call:
                return int(reply.TTL)
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from None
        finally:
            call.cancel()
        raise EtcdError("etcd closed the keepalive without an answer")

    async def revoke(self, lease: int) -> None:
        try:
            await self._lease.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease), timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from None

    async def watch(self, prefix: bytes, start_revision: int) -> AsyncIterator[tuple[int, list[Event]]]:
        """Changes under ``prefix`` from ``start_revision`` on: (revision, events) per answer,
        where every change up to ``revision`` has been yielded.

        Raises ``Compacted`` when that history is gone, ``EtcdError`` when the stream
        breaks. Silence is not proof that etcd is alive (a paused etcd keeps the stream
        open and says nothing): liveness is the keepalive's job.
        """
        create = rpc.WatchCreateRequest(
            key=prefix, range_end=prefix_end(prefix), start_revision=start_revision, progress_notify=True
        )
        call = self._watch.Watch(_hold_open(rpc.WatchRequest(create_request=create)))
        try:
            async for reply in call:
                if reply.compact_revision:
                    raise Compacted(int(reply.compact_revision))
                if reply.canceled:
                    raise EtcdError(f"etcd cancelled the watch: {reply.cancel_reason}")
                events = [Event(e.type == rpc.Event.DELETE, _kv(e.kv)) for e in reply.events]
                if events:
                    # Not the header's revision: a watch catching up from an old
                    # revision gets its history in chunks that all carry the store's
                    # current revision, so that one would claim changes not yet seen.
                    yield max(e.kv.mod_revision for e in events), events
                elif not reply.created:
                    # A progress note (etcd sends one only to a watch that has caught
                    # up): nothing changed up to the header's revision. The created
                    # answer also has no events and the current revision, but comes
                    # *before* the history from ``start_revision``: it says nothing.
                    yield int(reply.header.revision), events
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from None
        finally:
            call.cancel()
        raise EtcdError("etcd ended the watch")
