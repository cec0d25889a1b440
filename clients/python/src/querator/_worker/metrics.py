"""Prometheus metrics of a worker (the ``metrics`` extra: prometheus_client)."""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime
from typing import Any

# Seconds: handlers from a millisecond to ten minutes; lease lag up to a day.
_HANDLER_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600)
_LAG_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 86400)

_lock = threading.Lock()
_families: dict[str, Any] | None = None
_servers: dict[int, tuple[Any, Any]] = {}


def _load() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ImportError(
            "worker metrics need prometheus_client: pip install 'querator-client[metrics]'"
        ) from None
    return prometheus_client


def _shared() -> dict[str, Any]:
    """The metric families, registered once per process in the default registry
    (every worker of the process adds its own label values)."""
    global _families
    with _lock:
        if _families is None:
            pc = _load()
            _families = {
                "handled": pc.Counter(
                    "querator_worker_handled", "Items whose handler returned and that were completed.", ["queue", "kind"]
                ),
                "failed": pc.Counter(
                    "querator_worker_failed",
                    "Handlers that raised (error: the exception's type name), timed out or had no handler.",
                    ["queue", "kind", "error"],
                ),
                "dead": pc.Counter("querator_worker_dead", "Items sent to the dead-letter queue.", ["queue", "kind"]),
                "seconds": pc.Histogram(
                    "querator_worker_handler_seconds", "Time in the handler.", ["queue", "kind"], buckets=_HANDLER_BUCKETS
                ),
                "lag": pc.Histogram(
                    "querator_worker_lease_lag_seconds",
                    "From an item's created_at (server clock) to its lease by this worker.",
                    ["queue"],
                    buckets=_LAG_BUCKETS,
                ),
            }
        return _families


class WorkerMetrics:
    """The metrics of one worker's queue, label children cached per kind."""

    def __init__(self, queue_name: str, port: int | None, host: str = "127.0.0.1") -> None:
        self.queue_name = queue_name
        families = _shared()
        self._families = families
        self._lag = families["lag"].labels(queue_name)
        self._kinds: dict[str, tuple[Any, Any, Any]] = {}
        self.port: int | None = None
        if port is not None:
            self.port = serve(port, host)

    def _for(self, kind: str) -> tuple[Any, Any, Any]:
        found = self._kinds.get(kind)
        if found is None:
            f = self._families
            q = self.queue_name
            found = self._kinds[kind] = (f["handled"].labels(q, kind), f["dead"].labels(q, kind), f["seconds"].labels(q, kind))
        return found

    def leased(self, created: list[datetime]) -> None:
        now = datetime.now(UTC)
        for at in created:
            self._lag.observe(max(0.0, (now - at).total_seconds()))

    def handled(self, kind: str, elapsed: float) -> None:
        handled, _, histogram = self._for(kind)
        handled.inc()
        histogram.observe(elapsed)

    def failed(self, kind: str, error: BaseException, elapsed: float | None) -> None:
        self._families["failed"].labels(self.queue_name, kind, type(error).__qualname__).inc()
        if elapsed is not None:
            self._for(kind)[2].observe(elapsed)

    def dead(self, kind: str) -> None:
        self._for(kind)[1].inc()


def serve(port: int, host: str = "127.0.0.1") -> int:
    """Serve the default registry over HTTP on ``host``:``port`` (once per port and
    process); returns the port bound (``port=0``: a free one)."""
    pc = _load()
    with _lock:
        if port and port in _servers:
            return port
        started = pc.start_http_server(port, addr=host)
        bound = int(started[0].server_port)
        _servers[bound] = started
    logging.getLogger("querator.worker").info("serving worker metrics on %s port %d", host, bound)
    return bound

