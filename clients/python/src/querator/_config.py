"""The one configuration both clients share, and the channel built from it."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import grpc

from ._convert import Seconds, as_timedelta, seconds

DEFAULT_ADDRESS = "127.0.0.1:2319"
ADDRESS_ENV = "QUERATOR_ADDRESS"

# The contract's request limits; batches stay a little under the byte limit.
MAX_BATCH = 1000
MAX_REQUEST_BYTES = 5_000_000
BATCH_BYTES = 4_000_000

Metadata = Sequence[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter: ``initial * multiplier**n``, capped at ``maximum``.

    ``jitter`` is the random fraction taken off each delay (0.2: 80-100 % of it), so
    many clients that failed together do not come back together. Call it with the
    attempt number (1 for the first retry) to get the delay.
    """

    initial: timedelta = timedelta(seconds=1)
    maximum: timedelta = timedelta(minutes=5)
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.initial < timedelta(0) or self.maximum < self.initial:
            raise ValueError("Backoff needs 0 <= initial <= maximum")
        if self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ValueError("Backoff needs multiplier >= 1 and 0 <= jitter <= 1")

    def __call__(self, attempt: int) -> timedelta:
        base = self.initial.total_seconds() * self.multiplier ** max(0, attempt - 1)
        delay = min(base, self.maximum.total_seconds())
        return timedelta(seconds=delay * (1 - self.jitter * random.random()))


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    """Settings shared by :class:`~querator.Client` and :class:`~querator.AsyncClient`.

    Every field is also a keyword argument of both clients' constructors, and a
    client's ``config`` can be handed to the other kind (``AsyncClient(config=c.config)``).
    """

    #: host:port of the server; default: $QUERATOR_ADDRESS, else 127.0.0.1:2319. With
    #: several (a list, or ``"a:1,b:2"``) it is the first of ``addresses``.
    address: str = ""
    #: Bootstrap addresses of a cluster: ClusterInfo is asked of the first that answers,
    #: then each call goes to the node that serves it (docs/sdk.md, "Clusters").
    addresses: tuple[str, ...] = ()
    #: How often the cluster map is read again (it is also read when a node goes away
    #: or a queue is not in it yet).
    cluster_refresh: timedelta = timedelta(seconds=30)
    #: Deadline of each call (Lease: its wait plus ``lease_margin``).
    timeout: timedelta = timedelta(seconds=30)
    #: Extra time a Lease call gets over its ``wait`` before the client gives up.
    lease_margin: timedelta = timedelta(seconds=5)
    #: Use TLS. Implied by any of the certificate fields or ``channel_credentials``.
    tls: bool = False
    #: PEM root certificates to trust (None: the system's roots).
    root_certificates: bytes | None = None
    #: PEM client key and certificate chain, for mutual TLS.
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    #: Full control: channel credentials built by the caller (implies TLS or local).
    channel_credentials: grpc.ChannelCredentials | None = None
    #: Per-call credentials (e.g. ``grpc.metadata_call_credentials(plugin)``); gRPC sends
    #: them on secure channels only.
    call_credentials: grpc.CallCredentials | None = None
    #: Sent as ``authorization: Bearer <token>`` metadata on every call (any channel).
    bearer_token: str | None = None
    #: Metadata sent on every call.
    metadata: tuple[tuple[str, str], ...] = ()
    #: Called before every call; its pairs are added to the metadata (rotating tokens).
    metadata_provider: Callable[[], Iterable[tuple[str, str]]] | None = None
    #: How many times a call that is safe to repeat is retried after UNAVAILABLE.
    retries: int = 3
    #: Delay before each of those retries.
    backoff: Backoff = field(default_factory=lambda: Backoff(timedelta(milliseconds=100), timedelta(seconds=2)))
    #: Retry Produce after UNAVAILABLE too. Off by default: the lost reply of a stored
    #: batch would store it twice.
    retry_produce: bool = False
    #: Retry Complete, Retry and a Lease that completes items (``complete=``) after
    #: UNAVAILABLE. Safe with servers that answer an id sent again as done
    #: (``CompleteResponse.already_completed``); turn it off against older servers,
    #: whose answer to a repeat after a lost reply is NOT_FOUND.
    retry_complete: bool = True
    #: Produce requests a single ``produce()`` call keeps in flight.
    max_in_flight: int = 4
    #: Wait for the channel to connect instead of failing at once when the server is down.
    wait_for_ready: bool = False
    #: AsyncClient: send Produce and Lease over one ProduceStream / LeaseStream per queue,
    #: in a cluster per node and queue (about half the server CPU per request; unary
    #: calls with servers that lack them).
    #: The sync Client always uses unary calls.
    streams: bool = True
    #: Extra grpc channel options, e.g. ``(("grpc.keepalive_time_ms", 30000),)``.
    channel_options: tuple[tuple[str, Any], ...] = ()
    #: OpenTelemetry (:mod:`querator.tracing`, the ``otel`` extra): produce writes the
    #: current trace context into each item's metadata, and workers run each handler in
    #: a CONSUMER span that continues the producer's trace.
    tracing: bool = False

    def __post_init__(self) -> None:
        given: Any = self.address
        if isinstance(given, str):
            given = [a.strip() for a in given.split(",") if a.strip()]
        addresses = tuple(dict.fromkeys([*given, *self.addresses]))
        if not addresses:
            addresses = tuple(a.strip() for a in (os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS).split(",") if a.strip())
        object.__setattr__(self, "address", addresses[0])
        object.__setattr__(self, "addresses", addresses)
        object.__setattr__(self, "cluster_refresh", as_timedelta(self.cluster_refresh))
        object.__setattr__(self, "timeout", as_timedelta(self.timeout))
        object.__setattr__(self, "lease_margin", as_timedelta(self.lease_margin))
        if self.retries < 0:
            raise ValueError("retries must not be negative")
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")

    def replace(self, **changes: Any) -> ClientConfig:
        return replace(self, **changes)

    @property
    def secure(self) -> bool:
        return bool(
            self.tls
            or self.channel_credentials is not None
            or self.root_certificates
            or self.private_key
            or self.certificate_chain
        )

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The channel credentials, or None for a plain-text channel."""
        if not self.secure:
            if self.call_credentials is not None:
                raise ValueError(
                    "call_credentials need a secure channel (tls=True); use bearer_token or "
                    "metadata_provider to send credentials over plain text"
                )
            return None
        creds = self.channel_credentials or grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )
        if self.call_credentials is not None:
            creds = grpc.composite_channel_credentials(creds, self.call_credentials)
        return creds

    def options(self) -> list[tuple[str, Any]]:
        given = {name for name, _ in self.channel_options}
        defaults = [
            # The server keeps a reply within 4 MiB, but one item may be up to 5 MB.
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", MAX_REQUEST_BYTES + (1 << 20)),
            # gRPC's own reconnect backoff grows to 120 s: a node (or server) back after
            # a restart would be left unused that long. Bounded like a node marked down.
            ("grpc.max_reconnect_backoff_ms", 10_000),
        ]
        # gRPC reads the first of two equal names: a channel option given replaces ours.
        return [*(option for option in defaults if option[0] not in given), *self.channel_options]

    def call_metadata(self) -> list[tuple[str, str]]:
        out = list(self.metadata)
        if self.bearer_token:
            out.append(("authorization", f"Bearer {self.bearer_token}"))
        if self.metadata_provider is not None:
            out.extend(self.metadata_provider())
        return out

    def call_timeout(self, timeout: Seconds | None) -> float:
        return seconds(self.timeout if timeout is None else timeout)


def make_config(address: str | Sequence[str] | None, config: ClientConfig | None, options: dict[str, Any]) -> ClientConfig:
    base = config or ClientConfig()
    changes = {k: v for k, v in options.items() if v is not None}
    if address:
        listed = [address] if isinstance(address, str) else list(address)
        changes["address"] = ",".join(listed)
        changes.setdefault("addresses", ())
    elif "addresses" in changes:
        changes["address"] = ""
    return base.replace(**changes) if changes else base
