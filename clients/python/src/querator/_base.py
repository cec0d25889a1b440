"""What the sync and async clients share: construction, settings, result assembly."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

import grpc

from . import _operations as ops
from . import _protocol as p
from . import tracing as _tracing
from ._config import Backoff, ClientConfig, make_config
from ._convert import Seconds
from ._failure import failure_text
from ._models import Item, ProduceResult
from .errors import QueratorError


class BaseClient:
    """Construction shared by Client and AsyncClient: ``address`` (or several: a cluster's
    bootstrap addresses) plus keyword settings.

    Every keyword is a :class:`~querator.ClientConfig` field; ``config`` supplies the
    rest (keywords win).
    """

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        *,
        config: ClientConfig | None = None,
        addresses: Sequence[str] | None = None,
        cluster_refresh: Seconds | None = None,
        timeout: Seconds | None = None,
        lease_margin: Seconds | None = None,
        tls: bool | None = None,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
        call_credentials: grpc.CallCredentials | None = None,
        bearer_token: str | None = None,
        metadata: Iterable[tuple[str, str]] | None = None,
        metadata_provider: Callable[[], Iterable[tuple[str, str]]] | None = None,
        retries: int | None = None,
        backoff: Backoff | None = None,
        retry_produce: bool | None = None,
        retry_complete: bool | None = None,
        max_in_flight: int | None = None,
        wait_for_ready: bool | None = None,
        streams: bool | None = None,
        channel_options: Iterable[tuple[str, Any]] | None = None,
        tracing: bool | None = None,
    ) -> None:
        options: dict[str, Any] = {
            "addresses": tuple(addresses) if addresses is not None else None,
            "cluster_refresh": cluster_refresh,
            "timeout": timeout,
            "lease_margin": lease_margin,
            "tls": tls,
            "root_certificates": root_certificates,
            "private_key": private_key,
            "certificate_chain": certificate_chain,
            "channel_credentials": channel_credentials,
            "call_credentials": call_credentials,
            "bearer_token": bearer_token,
            "metadata": tuple(metadata) if metadata is not None else None,
            "metadata_provider": metadata_provider,
            "retries": retries,
            "backoff": backoff,
            "retry_produce": retry_produce,
            "retry_complete": retry_complete,
            "max_in_flight": max_in_flight,
            "wait_for_ready": wait_for_ready,
            "streams": streams,
            "channel_options": tuple(channel_options) if channel_options is not None else None,
            "tracing": tracing,
        }
        self._config = make_config(address, config, options)
        # Fails early on impossible combinations (e.g. call credentials without TLS).
        self._config.credentials()
        if self._config.tracing:
            _tracing.require()  # tracing=True without the otel extra: say so now
        self._setup()

    def _setup(self) -> None:
        """Subclasses build their channel here."""

    @property
    def config(self) -> ClientConfig:
        return self._config

    @property
    def address(self) -> str:
        return self._config.address

    def _trace(self) -> dict[str, str] | None:
        """The current trace context for produced items, when tracing is on."""
        return _tracing._carrier() if self._config.tracing else None

    def _produce_plan(
        self,
        queue_name: str,
        items: Iterable[p.ProduceArg] | p.ProduceArg,
        encoding: str,
        kind: str,
        reference: str,
        enqueue_at: datetime | None,
        priority: int,
        timeout: Seconds | None,
        retry: bool | None,
        batch_size: int,
    ) -> Iterator[tuple[int, ops.Call, int]]:
        """The Produce calls of a ``produce()``, lazily: (index, call, number of items)."""
        defaults = Item(b"", encoding=encoding, kind=kind, reference=reference, enqueue_at=enqueue_at, priority=priority)
        call_timeout = self._config.call_timeout(timeout)
        retry = self._config.retry_produce if retry is None else retry
        for index, batch in enumerate(p.produce_batches(items, defaults, max_items=batch_size, trace=self._trace())):
            request = p.produce_request(queue_name, batch, call_timeout)
            yield index, ops.produce_call(request, call_timeout, retry), len(batch)

    @staticmethod
    def _orders_for_retry(
        items: p.ItemsArg, at: datetime | None, in_: Seconds | None, dead: bool, error: str | BaseException
    ) -> list[ops.RetryOrder]:
        when = p.retry_at(at, in_)
        text = error if isinstance(error, str) else failure_text(error)
        return [(ref, when, dead, text) for ref in p.refs(items)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._config.address!r})"


class ProduceCollector:
    """Assembles the ids of a multi-request produce, whatever order replies come in."""

    def __init__(self, on_progress: Callable[[int], None] | None) -> None:
        self._batches: dict[int, tuple[list[str], list[int]]] = {}
        self._sizes: dict[int, int] = {}
        self._done = 0
        self._duplicates = 0
        self._on_progress = on_progress
        self.error: QueratorError | None = None

    def sent(self, index: int, size: int) -> None:
        self._sizes[index] = size

    def stored(self, index: int, ids: list[str], partition: int, duplicates: int = 0) -> None:
        self._batches[index] = (ids, [partition] * len(ids))
        self._done += len(ids)
        self._duplicates += duplicates
        if self._on_progress is not None:
            self._on_progress(self._done)

    def failed(self, error: QueratorError) -> None:
        if self.error is None:
            self.error = error

    def result(self) -> ProduceResult:
        ids: list[str] = []
        partitions: list[int] = []
        for index in sorted(self._sizes):
            got = self._batches.get(index)
            if got is None:
                ids.extend([""] * self._sizes[index])
                partitions.extend([-1] * self._sizes[index])
            else:
                ids.extend(got[0])
                partitions.extend(got[1])
        return ProduceResult(ids, partitions, self._duplicates)

    def finish(self) -> ProduceResult:
        result = self.result()
        if self.error is not None:
            self.error.produced = result if self._batches else None
            raise self.error
        return result
