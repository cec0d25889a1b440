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
from dataclasses import dataclass, field
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


async def _hold_open(message: Any, closed: asyncio.Event) -> AsyncIterator[Any]:
    """A request stream of one message that stays open until ``closed`` is set: etcd
    ends a watch or a keepalive stream whose client side closed, possibly before it
    answered. The caller sets ``closed`` once done with the call: grpc's reader of this
    stream outlives a call that failed (cancelling a finished call does not stop it),
    and would wait here until the garbage collector destroyed it pending."""
    yield message
    await closed.wait()


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

    def unchanged_since(self, prefix: bytes, revision: int) -> Txn:
        """No key under ``prefix`` was created or changed after ``revision`` (deleted
        keys are not seen)."""
        self.compare.append(
            rpc.Compare(
                key=prefix,
                range_end=prefix_end(prefix),
                target=rpc.Compare.MOD,
                result=rpc.Compare.LESS,
                mod_revision=revision + 1,
            )
        )
        return self

    def put(self, key: bytes, value: bytes, lease: int = 0) -> Txn:
        self.success.append(rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease)))
        return self

    def delete(self, key: bytes) -> Txn:
        self.success.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)))
        return self


@dataclass(frozen=True, slots=True)
class Access:
    """How a node proves itself to etcd and checks etcd's identity.

    TLS is on once a CA bundle or a client certificate is given: ``ca`` (PEM) is what
    etcd's certificate must chain to (None: the system's roots), ``cert`` and ``key`` the
    node's client certificate (etcd's ``--client-cert-auth``; with etcd's auth on, its
    common name is the etcd user). ``user`` and ``password``: etcd's own authentication
    (a token per connection, asked for again when etcd forgets it, after a restart say).
    """

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    user: str = ""
    password: str = field(default="", repr=False)

    @property
    def tls(self) -> bool:
        return self.ca is not None or self.cert is not None


def _stale_token(exc: grpc.aio.AioRpcError) -> bool:
    """etcd no longer accepts the token (it restarted, or its auth store changed since):
    authenticate again."""
    details = exc.details() or ""
    return exc.code() == grpc.StatusCode.UNAUTHENTICATED or "auth store is old" in details


class Etcd:
    """One gRPC channel to etcd; tries the given endpoints in turn on failure."""

    def __init__(self, targets: Sequence[str], access: Access | None = None) -> None:
        self._targets = list(targets)
        self._index = 0
        self._access = access or Access()
        self._token: str | None = None
        self._open()

    def _open(self) -> None:
        target = self._targets[self._index % len(self._targets)]
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
        access = self._access
        if access.tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=access.ca, private_key=access.key, certificate_chain=access.cert
            )
            self.channel = grpc.aio.secure_channel(target, credentials, options=options)
        else:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        self._kv = rpc.KVStub(self.channel)
        self._lease = rpc.LeaseStub(self.channel)
        self._watch = rpc.WatchStub(self.channel)
        self._auth = rpc.AuthStub(self.channel)
        self._token = None  # a token belongs to the etcd member that issued it

    async def _metadata(self) -> tuple[tuple[str, str], ...]:
        """The token every call carries when etcd authentication is used."""
        access = self._access
        if not access.user:
            return ()
        if self._token is None:
            try:
                reply = await self._auth.Authenticate(
                    rpc.AuthenticateRequest(name=access.user, password=access.password), timeout=CALL_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as exc:
                raise await self._failed(exc) from None
            self._token = str(reply.token)
        return (("token", self._token),)

    async def _failed(self, exc: grpc.aio.AioRpcError) -> EtcdError:
        if _stale_token(exc):
            self._token = None
        if len(self._targets) > 1:  # the next endpoint, for the next call
            old = self.channel
            self._index += 1
            self._open()
            await old.close(None)
        return EtcdError(f"etcd: {exc.code().name}: {exc.details()}{self._hint(exc)}")

    def _hint(self, exc: grpc.aio.AioRpcError) -> str:
        details = (exc.details() or "").lower()
        code = exc.code()
        if code == grpc.StatusCode.PERMISSION_DENIED:
            who = f"user {self._access.user!r}" if self._access.user else "this node's etcd identity"
            return f" ({who} needs read and write permission on the cluster's prefix)"
        if "authentication failed" in details:
            return f" (etcd user {self._access.user!r}: check the user and its password file)"
        if "user name is empty" in details or "user name not found" in details:
            return " (etcd has authentication on: give --etcd-user and a password, or a client certificate)"
        if code == grpc.StatusCode.UNAVAILABLE and self._access.tls and any(
            word in details for word in ("ssl", "handshake", "certificate", "tsi_")
        ):
            return " (TLS to etcd failed: check --etcd-ca against etcd's certificate, and --etcd-cert/--etcd-key)"
        if code == grpc.StatusCode.UNAVAILABLE and not self._access.tls and "socket closed" in details:
            return " (does etcd expect TLS? give --etcd-ca)"
        return ""

    async def _unary(self, method: Any, request: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """One call with a deadline; a token etcd no longer accepts is renewed once."""
        for attempt in (1, 2):
            try:
                return await method(request, timeout=timeout, metadata=await self._metadata())
            except grpc.aio.AioRpcError as exc:
                if attempt == 1 and self._access.user and _stale_token(exc):
                    self._token = None
                    continue
                raise await self._failed(exc) from None
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.channel.close(None)

    async def range_prefix(self, prefix: bytes) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the revision they were read at (linearizable)."""
        reply = await self._unary(self._kv.Range, rpc.RangeRequest(key=prefix, range_end=prefix_end(prefix)))
        return reply.header.revision, [_kv(kv) for kv in reply.kvs]

    async def cluster_id(self, key: bytes) -> int:
        """The etcd cluster's id, from the header of a read of ``key`` (one the caller may
        read: every answer carries the id). A fresh etcd has a new one."""
        reply = await self._unary(self._kv.Range, rpc.RangeRequest(key=key, keys_only=True))
        return int(reply.header.cluster_id)

    async def get(self, key: bytes, timeout: float = CALL_TIMEOUT_S) -> tuple[int, KeyValue | None]:
        reply = await self._unary(self._kv.Range, rpc.RangeRequest(key=key), timeout)
        return reply.header.revision, (_kv(reply.kvs[0]) if reply.kvs else None)

    async def txn(self, txn: Txn) -> tuple[bool, int]:
        """Send ``txn``: whether every comparison held (and so it was written), and the revision."""
        reply = await self._unary(self._kv.Txn, rpc.TxnRequest(compare=txn.compare, success=txn.success))
        return bool(reply.succeeded), int(reply.header.revision)

    async def grant(self, ttl_s: int) -> int:
        reply = await self._unary(self._lease.LeaseGrant, rpc.LeaseGrantRequest(TTL=ttl_s))
        if reply.error:
            raise EtcdError(f"etcd refused a lease: {reply.error}")
        return int(reply.ID)

    async def keep_alive(self, lease: int, timeout: float) -> int:
        """Renew ``lease`` once; its remaining TTL in seconds, 0 when it had expired.

        etcd answers an expired lease with TTL 0 and no error, so the caller must
        look at the TTL.
        """
        closed = asyncio.Event()
        call = self._lease.LeaseKeepAlive(
            _hold_open(rpc.LeaseKeepAliveRequest(ID=lease), closed), timeout=timeout, metadata=await self._metadata()
        )
        try:
            async for reply in call:
                return int(reply.TTL)
        except grpc.aio.AioRpcError as exc:
            raise await self._failed(exc) from None
        finally:
            closed.set()
            call.cancel()
        raise EtcdError("etcd closed the keepalive without an answer")

    async def revoke(self, lease: int) -> None:
        await self._unary(self._lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease))

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
        closed = asyncio.Event()
        call = self._watch.Watch(
            _hold_open(rpc.WatchRequest(create_request=create), closed), metadata=await self._metadata()
        )
        try:
            async for reply in call:
                if reply.compact_revision:
                    raise Compacted(int(reply.compact_revision))
                if reply.canceled:
                    if "auth" in reply.cancel_reason:  # a token etcd forgot: a new one next time
                        self._token = None
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
            closed.set()
            call.cancel()
        raise EtcdError("etcd ended the watch")
