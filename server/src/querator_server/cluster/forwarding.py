"""Forwarding: the channels to the other nodes and the one-hop call over them.

Where a call should go is router.py's business; this module only carries a
call to a named node and brings its answer (or its error, as if raised here) back. A
forwarded call carries the ``x-querator-forwarded`` header, and a node never forwards
a call that has it: at most one hop, loops impossible by construction. It keeps the
caller's deadline and metadata (API key, trace context).

The header is honoured only from a peer: the forwarding node signs it (the
``x-querator-peer-proof`` header, an HMAC of its node id, the time and a nonce under a
key derived from the cluster's shared secret in etcd). A client that sends the header
without a valid proof is routed as any other call: the marker alone would let it skip
a DeleteQueue's emptiness check on the other homes or an idempotency key's home.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status

from querator.v1.queue_pb2 import LeaseRequest

from ..errors import InvalidArgument, Relayed, Unavailable
from ..logging import RepeatedFailure, get_logger
from ..model import DEFAULT_WAIT_US, MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES, MAX_WAIT_US

log = get_logger("cluster")

FORWARDED = "x-querator-forwarded"
PROOF = "x-querator-peer-proof"
# How far a proof's time may be from the receiving node's clock: the nodes' clock skew
# plus the time a call takes to arrive. A proof is good this long, so on a network
# where peer traffic can be read, peers use TLS (then it cannot be).
PROOF_WINDOW_S = 60
_PROOF_LABEL = b"querator peer proof v1"
# Headers gRPC itself sets; everything else the caller sent travels with a forwarded call
# (not the forwarded marker and its proof: a node sets its own).
_TRANSPORT_HEADERS = frozenset({"user-agent", "grpc-accept-encoding", "grpc-timeout", "te", "content-type"})
# A forwarded call whose caller set no deadline still ends, never held for ever by a
# paused or stuck node: after what the request itself asks to wait (a Lease's wait, a
# Produce's request_timeout) and a margin for the answer, and at least after
# _UNARY_CAP_S (a call that does not wait by design answers in far less).
_UNARY_CAP_S = 30.0
_WAIT_MARGIN_S = 10.0
# Calls from this node to one peer still unanswered, and the bytes of their requests:
# past either bound a call is not sent (UNAVAILABLE, so it may be retried or sent
# elsewhere). Without them a paused peer held every call sent to it, each with copies
# of its request of up to 5 MB: 40 Completes of 4.9 MB took a node from 48 to 736 MiB.
PEER_CALLS = 1000
PEER_BYTES = 4 * MAX_REQUEST_BYTES
# How long a node has to answer a health check before a call that asks for one
# (``probe``) is sent to it; at most a quarter of the time the call has.
PROBE_S = 1.0
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"

# A ping on the connection to a peer every KEEPALIVE_S, and the connection dropped when
# one is not answered in KEEPALIVE_TIMEOUT_S: a peer that died without a word (power,
# network) or is paused is noticed then, not when a call to it times out. It also ends
# calls whose large request sits in a full TCP send buffer to a paused peer: their own
# deadline did not (still waiting 80 s after a 30 s deadline, without keepalive).
KEEPALIVE_S = 10
KEEPALIVE_TIMEOUT_S = 5
_CHANNEL_OPTIONS = (
    # Whatever a node may send (a listing page or a Lease answer of one ~5 MB item),
    # and a forwarded request as large as a client may send.
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted peer is reached again within seconds (gRPC's default backoff grows
    # to two minutes, all the while failing every call sent to that node).
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
)
# What a node's server must allow for its peers' keepalive pings (else it answers
# them with GOAWAY "too many pings" and drops the connection).
SERVER_OPTIONS = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_S * 1000 // 2),
)

M = TypeVar("M", bound=Message)


class Unreachable(Unavailable):
    """A forwarded call that never reached its node (no connection, too many calls
    unanswered there, no answer to a health check): safe to send elsewhere."""


@dataclass(frozen=True, slots=True)
class PeerTls:
    """How a node reaches the others over TLS: the roots it trusts (None: the system's)
    and its own certificate chain and key, which mutual-TLS nodes ask for."""

    roots: bytes | None
    chain: bytes
    key: bytes


@dataclass(slots=True)
class _Load:
    """The calls sent to one peer and not yet answered."""

    calls: int = 0
    bytes: int = 0


class _Member(Protocol):
    @property
    def address(self) -> str: ...


# For tests only: network faults between nodes on one machine need each node to reach
# each peer through a proxy of its own, but a node learns its peers' addresses from their
# membership records, which every node reads alike. "n2=127.0.0.1:7001,n3=..." sends this
# node's calls to n2 to 127.0.0.1:7001 instead. Ignored unless set; never set in production.
TEST_PEER_ADDRESSES_ENV = "QUERATOR_TEST_PEER_ADDRESSES"


def peer_address_overrides(value: str) -> dict[str, str]:
    """The node -> address pairs of ``QUERATOR_TEST_PEER_ADDRESSES`` (see above)."""
    out: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in value.split(","))):
        node, sep, address = entry.partition("=")
        host, colon, port = address.rpartition(":")
        if not (sep and node and host and colon and port.isdigit()):
            raise ValueError(f"{TEST_PEER_ADDRESSES_ENV}: {entry!r} is not node=host:port")
        out[node] = address
    return out


# Where an error about a node that is down sends an operator.
NODE_GONE_HELP = 'if it is gone for good, see docs/cluster.md, "A node that died for good"'


class Peers:
    """One channel per other node's address, and the forwarded call over it.

    ``members`` gives the live membership (node id -> its record with ``address``), read
    at each call, so a node that left is refused before anything is sent."""

    def __init__(self, node: str, members: Callable[[], Mapping[str, _Member]], tls: PeerTls | None = None) -> None:
        self.node = node
        self._members = members
        self._credentials = (
            None
            if tls is None
            else grpc.ssl_channel_credentials(root_certificates=tls.roots, private_key=tls.key, certificate_chain=tls.chain)
        )
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.forwarded = 0  # calls sent to another node, for the metrics
        self._load: defaultdict[str, _Load] = defaultdict(_Load)  # by node id
        self._key: bytes | None = None  # signs and checks the forwarded marker
        # Calls that carried the marker without a valid proof (counted, logged now and then).
        self.forged = RepeatedFailure(every_s=60.0)
        self._test_addresses = peer_address_overrides(os.environ.get(TEST_PEER_ADDRESSES_ENV, ""))

    def set_secret(self, cluster_secret: bytes) -> None:
        """The cluster's shared secret (kept in etcd); the marker's key is derived from
        it, so a proof says nothing about the secret's other uses."""
        self._key = hmac.new(cluster_secret, _PROOF_LABEL, hashlib.sha256).digest()

    def _proof(self) -> str:
        if self._key is None:
            raise Unavailable(f"node {self.node!r} has not joined the cluster yet; retry")
        stamp = f"{time.time_ns() // 1_000_000}.{secrets.token_hex(8)}"
        return f"{stamp}.{self._mac(self._key, self.node, stamp)}"

    @staticmethod
    def _mac(key: bytes, node: str, stamp: str) -> str:
        return hmac.new(key, f"{node}\n{stamp}".encode(), hashlib.sha256).hexdigest()

    def proof_metadata(self) -> tuple[tuple[str, str], ...]:
        """The headers that prove a call of this node's own (not a forwarded one) to a peer:
        for calls ``forward`` does not make (streams)."""
        return ((FORWARDED, self.node), (PROOF, self._proof()))

    def is_forwarded(self, context: grpc.aio.ServicerContext[Any, Any]) -> bool:
        """Whether the call came from another node (then it is served here, never sent
        on): it carries the marker with a valid proof. A marker without one is ignored."""
        node = proof = None
        for key, value in context.invocation_metadata() or ():
            if key == FORWARDED:
                node = value
            elif key == PROOF:
                proof = value
        if node is None:
            return False
        why = self._check(str(node), proof if isinstance(proof, str) else None)
        if why is None:
            return True
        reported = self.forged.failed()
        if reported:
            log.warning(
                "forwarded_marker_ignored",
                claimed_node=str(node)[:100],
                peer=context.peer(),
                reason=why,
                calls=reported,
                total=self.forged.failures,
                detail=f"a call carried {FORWARDED} without a valid proof; routed as a client's call",
            )
        return False

    def _check(self, node: str, proof: str | None) -> str | None:
        """Why ``proof`` does not prove ``node`` sent the call (None: it does)."""
        if proof is None:
            return "no proof"
        if self._key is None:
            return "this node has not joined yet"
        stamp, _, mac = proof.rpartition(".")
        millis = stamp.split(".", 1)[0]
        if not millis.isdigit():
            return "malformed proof"
        if not hmac.compare_digest(mac.encode(), self._mac(self._key, node, stamp).encode()):
            return "wrong proof"
        if abs(time.time() - int(millis) / 1000) > PROOF_WINDOW_S:
            return f"proof older or newer than {PROOF_WINDOW_S} s (clocks apart?)"
        return None

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        await asyncio.gather(*(c.close(None) for c in channels.values()), return_exceptions=True)

    def channel(self, node: str) -> grpc.aio.Channel:
        member = self._members().get(node)
        if member is None:
            raise Unavailable(
                f"node {node!r} is not live; its partitions are unavailable until it returns ({NODE_GONE_HELP})"
            )
        address = self._test_addresses.get(node) or member.address
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = (
                grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
                if self._credentials is None
                else grpc.aio.secure_channel(address, self._credentials, options=_CHANNEL_OPTIONS)
            )
        return channel

    async def _probe(self, node: str, channel: grpc.aio.Channel, timeout: float) -> None:
        check = channel.unary_unary(
            _HEALTH_CHECK,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            await check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                raise Unreachable(
                    f"node {node!r} did not answer a health check within {timeout:.2g} s "
                    f"(paused, overloaded or down: {exc.code().name}); the call was not sent to it"
                ) from None
            # Any other answer (UNIMPLEMENTED, say) is an answer: the node is there.

    async def forward(
        self,
        node: str,
        method: str,
        request: Message,
        response_type: type[M],
        context: grpc.aio.ServicerContext[Any, Any] | None,
        timeout: float | None = None,
        *,
        probe: bool = False,
    ) -> M:
        """``request`` sent to ``node`` as the caller's own call (``context``: the
        caller's; None for a call of this node's own); its answer, or its error raised
        here (Unreachable when it never left, so another node may be tried).

        With ``probe``, the node must first answer a health check within PROBE_S, else
        the call is not sent (Unreachable): a paused node's connection stays open, and a
        call sent to it waits out its whole deadline, where one that can be passed over
        (a RedriveItems visiting every node) should move on to the others."""
        metadata = [
            (k, v)
            for k, v in ((context.invocation_metadata() or ()) if context is not None else ())
            if k not in _TRANSPORT_HEADERS and k not in (FORWARDED, PROOF) and not k.startswith("grpc-")
        ]
        metadata += ((FORWARDED, self.node), (PROOF, self._proof()))
        remaining = context.time_remaining() if context is not None else None
        if timeout is None or (remaining is not None and remaining < timeout):
            timeout = remaining
        if timeout is None:
            timeout = _no_deadline_cap(request)
        channel = self.channel(node)
        if probe:
            await self._probe(node, channel, min(PROBE_S, timeout / 4))
        data = request.SerializeToString()
        load = self._load[node]
        if load.calls and (load.calls >= PEER_CALLS or load.bytes + len(data) > PEER_BYTES):
            raise Unreachable(
                f"node {node!r} (forwarded to) has {load.calls} calls from this node unanswered "
                f"({load.bytes / 1e6:.1f} MB of requests): paused or overloaded; this call was not sent, retry later"
            )
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=response_type.FromString)
        self.forwarded += 1
        load.calls += 1
        load.bytes += len(data)
        try:
            return await call(data, timeout=timeout, metadata=metadata)  # type: ignore[no-any-return]
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNAVAILABLE:
                if "failed to connect" in (exc.details() or ""):
                    raise Unreachable(f"node {node!r} (forwarded to) is unreachable: {exc.details()}") from None
                raise Unavailable(f"node {node!r} (forwarded to) is unavailable: {exc.details()}") from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                violations = _violations(exc)
                if violations:  # the same error, fields and all, as if raised here
                    raise InvalidArgument(violations) from None
            raise Relayed(code.value[0], exc.details() or code.name) from None
        finally:
            load.calls -= 1
            load.bytes -= len(data)


def _no_deadline_cap(request: Message) -> float:
    """How long a forwarded call may take when its caller set no deadline (seconds)."""
    wait = 0.0
    if "request_timeout" in request.DESCRIPTOR.fields_by_name:
        if request.HasField("request_timeout"):
            given = request.request_timeout  # type: ignore[attr-defined]
            wait = min(given.seconds + given.nanos / 1e9, MAX_WAIT_US / 1e6)
        elif isinstance(request, LeaseRequest):  # waits its default
            wait = DEFAULT_WAIT_US / 1e6
    return max(_UNARY_CAP_S, wait + _WAIT_MARGIN_S)


def _violations(exc: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    """The (field, description) pairs of an INVALID_ARGUMENT's google.rpc.BadRequest."""
    status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    out: list[tuple[str, str]] = []
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out.extend((v.field, v.description) for v in bad.field_violations)
    return out
