"""Prometheus metrics, served over HTTP on ``--metrics-address`` (off when unset).

Two kinds of data:

- Gauges (items per state, the age of the oldest ready item, waiting requests, LMDB
  map usage) are read at scrape time by ``QueueCollector``, one series per queue (not
  per partition: 180 queues of 256 partitions gave 250,000 lines and 1.8 s scrapes;
  per queue, 20,000 lines and 0.2 s),
  from the actors' in-memory views, which are exact counts. A scrape reads no storage.
  The head item of each partition and the map usage are refreshed by the actor hook
  after each committed cycle (on the event loop, between transactions, the only time
  the actor's LMDB environment is guaranteed idle) and read from that cache.
- Counters and histograms are updated by small hooks: an interceptor around every
  ``querator.v1`` call (latency, status, items moved), the actor after every cycle
  (duration, batch size, lease expirations, dead letters) and the queue store after
  every commit (commit time). A deleted queue's series are removed with it.
- The event loop's lag: a timer every LOOP_LAG_INTERVAL_S and how late it ran. On a
  cluster node, the node's view of the cluster (ClusterCollector), read at scrape
  time from its cached catalog.

The endpoint renders one scrape at a time (scrapes arriving meanwhile share that
answer), spaces renderings so that they take a bounded share of the interpreter, and,
with a token, answers only ``Authorization: Bearer <token>``.

Nothing here is imported unless metrics are on, and no hook runs when they are off.
See docs/operations.md ("Metrics") for the list.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .errors import NotFound
from .logging import get_logger

if TYPE_CHECKING:
    from .actor import LogicalQueue
    from .actor.cycle import Cycle
    from .manager import QueuesManager

log = get_logger("metrics")

# Only calls of our own API are measured (not health checks or reflection).
_API_PREFIX = "/querator.v1."
# Latencies from 100 us (a cached read) to 15 min (the longest Lease wait).
RPC_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
)  # fmt: skip
STORAGE_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5,
)  # fmt: skip
BATCH_BUCKETS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The loop-lag probe's timer: often enough that a stall of a fraction of a second shows,
# rarely enough to cost nothing (one wake-up of the loop).
LOOP_LAG_INTERVAL_S = 0.5


# Scrapes served at once (one renders, the others wait for its answer); past it, 503.
MAX_SCRAPES = 4
# A rendering starts at least this many times its predecessor's length after that one
# ended, so renderings hold the GIL (and so the event loop) at most 1/(1+4) = 20% of
# the time however many scrapers loop on the endpoint. Measured with 4 curl loops on a
# server of 180 queues / 46,080 partitions (0.2 s per rendering): another queue's
# Produce p50 went from 1.5 ms idle to 27 ms with back-to-back renderings, and stayed
# at its idle 1.6 ms with this spacing (205 ms with the per-partition series rendered
# per scrape, as before). A Prometheus scraping every few seconds never waits; tiny
# renderings (a few queues) space out by milliseconds.
RENDER_SPACING = 4.0
# ... but a scrape never waits longer than this for its turn, well inside Prometheus's
# default 10 s scrape timeout (only renderings over 0.5 s would ask for more).
MAX_RENDER_WAIT_S = 2.0
# A metrics token is as hard to guess as a key's secret: 32 random bytes in URL-safe
# base64 have 43 characters; 32 is the floor, so hex of 16 bytes still passes.
METRICS_TOKEN_MIN_CHARS = 32
# The name of the threads that answer scrapes.
SCRAPE_THREAD = "querator-metrics-scrape"
# A scrape connection that sends nothing is dropped after this long.
_REQUEST_TIMEOUT_S = 10.0
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def parse_address(address: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``:port`` (all interfaces) to (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"metrics address {address!r} must be host:port")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class QueueProbe:
    """Per-queue state the actor hook keeps for the collector, and the hook itself."""

    __slots__ = ("_children", "_metrics", "_queue", "heads", "map_size", "map_used")

    def __init__(self, metrics: Metrics, queue: str) -> None:
        self._metrics = metrics
        self._queue = queue
        # created_at (us) of the first ready item of each partition; 0: none ready.
        self.heads: dict[int, int] = {}
        self.map_used = 0
        self.map_size = 0
        m = metrics
        self._children = (
            m.cycle_duration.labels(queue),
            m.cycle_batch.labels(queue),
            m.lease_expirations.labels(queue),
            m.dead_letters.labels(queue, "moved"),
            m.dead_letters.labels(queue, "dropped"),
        )

    def oldest_head(self) -> int:
        """created_at (us) of the oldest head item of the partitions (0: none known).

        Called from the metrics endpoint's thread: the dict's values are copied in one
        step, since the loop may add partitions meanwhile."""
        heads = [h for h in list(self.heads.values()) if h]
        return min(heads) if heads else 0

    def commit_hook(self) -> Callable[[float], None]:
        return self._metrics.commit_duration.labels(self._queue).observe

    def cycle_done(self, actor: LogicalQueue, cycle: Cycle, batch_size: int, seconds: float) -> None:
        """Called by the actor after each committed cycle, before it answers anyone."""
        duration, batch, expirations, moved, dropped = self._children
        duration.observe(seconds)
        batch.observe(batch_size)
        expired = getattr(cycle, "lease_expirations", 0)
        if expired:
            expirations.inc(expired)
        if cycle.outbox_added:
            moved.inc(len(cycle.outbox_added))
        if cycle.dropped:
            dropped.inc(len(cycle.dropped))
        self.refresh(actor, cycle.views)

    def refresh(self, actor: LogicalQueue, changed: object = ()) -> None:
        """Re-read the head item of changed (or never read) partitions, and map usage.

        Runs on the event loop while the actor is between transactions, so the
        environment is neither being resized nor closed. Faulty partitions are not
        read: their heads stay as last known.
        """
        todo = [p for p in range(actor.partition_count) if p in changed or p not in self.heads]  # type: ignore[operator]
        try:
            if todo:
                # None: the head is past a long run of leased items; keep what was known.
                self.heads.update((p, head) for p, head in actor.ready_heads(todo).items() if head is not None)
            self.map_used, self.map_size = actor.map_usage()
        except Exception as exc:  # noqa: BLE001 -- metrics never break the actor
            log.debug("metrics_refresh_failed", queue=self._queue, error=repr(exc))


class QueueCollector(Collector):
    """Per-queue gauges read at scrape time from the actors' in-memory counts."""

    def __init__(self, manager: QueuesManager) -> None:
        self._manager = manager

    def collect(self) -> Iterator[GaugeMetricFamily]:
        items = GaugeMetricFamily(
            "querator_queue_items",
            "Items of the queue by state: ready (leasable now), leased, scheduled, waiting_in_group "
            "(behind the first item of their ordered group) (exact).",
            labels=["queue", "state"],
        )
        partitions = GaugeMetricFamily("querator_queue_partitions", "Partitions of the queue.", labels=["queue"])
        faulty = GaugeMetricFamily(
            "querator_queue_partitions_faulty",
            "Partitions of the queue whose storage failed: no produce or lease goes to them "
            "until a probe finds them working (GetQueueStats says why).",
            labels=["queue"],
        )
        head_age = GaugeMetricFamily(
            "querator_queue_oldest_ready_age_seconds",
            "Age since produce of the oldest of the items at the head of the queue's partitions "
            "(the ones the next Leases take); 0 when nothing is ready.",
            labels=["queue"],
        )
        avg_age = GaugeMetricFamily(
            "querator_queue_average_age_seconds",
            "Average age since produce of the ready and leased items of the queue.",
            labels=["queue"],
        )
        lease_waiting = GaugeMetricFamily(
            "querator_queue_lease_waiting", "Lease calls waiting for items.", labels=["queue"]
        )
        produce_waiting = GaugeMetricFamily(
            "querator_queue_produce_waiting", "Produce calls waiting for the next cycle.", labels=["queue"]
        )
        groups = GaugeMetricFamily(
            "querator_queue_groups_in_flight",
            "Ordered groups (ProduceItem.group_key) of the queue whose first item is leased right now.",
            labels=["queue"],
        )
        paused = GaugeMetricFamily(
            "querator_queue_paused",
            "Whether the queue is paused (PauseQueue): 0 no, 1 leases wait, 2 produce is refused too.",
            labels=["queue"],
        )
        map_used = GaugeMetricFamily(
            "querator_lmdb_map_used_bytes", "Bytes of the queue's LMDB map in use (a commit group's, for a queue in one).", labels=["queue"]
        )
        map_size = GaugeMetricFamily(
            "querator_lmdb_map_size_bytes",
            "Size of the queue's LMDB map (it doubles when full).",
            labels=["queue"],
        )
        now_us = time.time() * 1e6
        actors = list(self._manager.queues())  # one atomic copy; the loop may change the dict
        for actor in actors:
            name = actor.name
            try:
                totals = actor.totals()
            except Exception as exc:  # noqa: BLE001 -- a scrape must not fail for one queue
                log.debug("metrics_totals_failed", queue=name, error=repr(exc))
                continue
            items.add_metric([name, "ready"], totals.ready)
            items.add_metric([name, "leased"], totals.leased)
            items.add_metric([name, "scheduled"], totals.scheduled)
            partitions.add_metric([name], totals.partitions)
            faulty.add_metric([name], totals.faulty)
            items.add_metric([name, "waiting_in_group"], totals.waiting)
            groups.add_metric([name], totals.groups_in_flight)
            held = totals.ready + totals.leased + totals.waiting
            avg_age.add_metric([name], max(0.0, now_us - totals.created_sum / held) / 1e6 if held else 0.0)
            lease_waiting.add_metric([name], totals.lease_waiting)
            produce_waiting.add_metric([name], totals.produce_waiting)
            config = actor.config
            paused.add_metric([name], 2 if config.produce_paused else 1 if config.paused else 0)
            probe = getattr(actor, "observer", None)
            oldest = probe.oldest_head() if isinstance(probe, QueueProbe) and totals.ready else 0
            head_age.add_metric([name], max(0.0, now_us - oldest) / 1e6 if oldest else 0.0)
            if isinstance(probe, QueueProbe) and probe.map_size:
                map_used.add_metric([name], probe.map_used)
                map_size.add_metric([name], probe.map_size)
        queues = GaugeMetricFamily("querator_queues", "Queues on this server, including failed ones.")
        queues.add_metric([], self._manager.queue_count())
        failed = GaugeMetricFamily(
            "querator_queues_failed", "Queues not served because their storage failed (GetQueue says why)."
        )
        failed.add_metric([], self._manager.failed_queues())
        yield from (
            queues, failed, items, partitions, faulty, head_age, avg_age, lease_waiting, produce_waiting, groups, paused, map_used, map_size
        )


class ReplicaState(Protocol):
    """A replicated queue this node keeps a copy of (cluster/shard_table.ShardGauges)."""

    @property
    def queue(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def in_sync(self) -> int: ...
    @property
    def min_in_sync(self) -> int: ...
    @property
    def primary(self) -> bool: ...
    @property
    def elections(self) -> int: ...


class ReplicationCollector(Collector):
    """Per replicated queue kept here, read at scrape time from the cached shard records."""

    def __init__(self, states: Callable[[], Iterable[ReplicaState]]) -> None:
        self._states = states

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        epoch = GaugeMetricFamily(
            "querator_replication_epoch", "The epoch of the queue's primary (one more per election).", labels=["queue"]
        )
        in_sync = GaugeMetricFamily(
            "querator_replication_in_sync", "Copies of the queue in its in-sync set, the primary included.", labels=["queue"]
        )
        minimum = GaugeMetricFamily(
            "querator_replication_min_in_sync", "The fewest in-sync copies the queue takes writes with.", labels=["queue"]
        )
        primary = GaugeMetricFamily(
            "querator_replication_primary", "1 when this node is the queue's primary, else 0.", labels=["queue"]
        )
        elections = CounterMetricFamily(
            "querator_replication_elections",
            "Elections of a new primary (failovers and hand-overs) this node has seen since it started.",
            labels=["queue"],
        )
        for state in self._states():
            epoch.add_metric([state.queue], state.epoch)
            in_sync.add_metric([state.queue], state.in_sync)
            minimum.add_metric([state.queue], state.min_in_sync)
            primary.add_metric([state.queue], 1 if state.primary else 0)
            elections.add_metric([state.queue], state.elections)
        yield from (epoch, in_sync, minimum, primary, elections)


class ClusterCollector(Collector):
    """A cluster node's view of the cluster, read at scrape time.

    ``view`` returns (live members, this node fenced, partitions homed on a node that is
    not live); it runs on the scrape's thread and reads the node's cached catalog only."""

    def __init__(self, view: Callable[[], tuple[int, bool, int]]) -> None:
        self._view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            members, fenced, down = self._view()
        except Exception as exc:  # noqa: BLE001 -- a scrape must not fail for the cluster's view
            log.debug("metrics_cluster_view_failed", error=repr(exc))
            return
        yield GaugeMetricFamily(
            "querator_cluster_members",
            "Live members of the cluster (nodes holding their membership in etcd), as this node sees them.",
            value=members,
        )
        yield GaugeMetricFamily(
            "querator_cluster_fenced",
            "1 while this node cannot renew its membership: it refuses admin changes and still serves data.",
            value=1 if fenced else 0,
        )
        yield GaugeMetricFamily(
            "querator_cluster_partitions_down",
            "Partitions of the cluster's queues whose home node is not a live member, as this node sees "
            "them: their items wait until the node is back, or retired.",
            value=down,
        )


def _queue_of(request: Any) -> str:
    name = getattr(request, "queue_name", None)
    if name is None:
        queue = getattr(request, "queue", None)
        name = getattr(queue, "queue_name", "")
    return name if isinstance(name, str) else ""


# Items each successful call moved: (action, count(request, response)).
_ITEMS: dict[str, tuple[str, Callable[[Any, Any], int]]] = {
    "Produce": ("produced", lambda req, _resp: len(req.items) or len(req.payloads)),
    "Lease": ("leased", lambda _req, resp: len(resp.items) or len(resp.columns.ids)),
    "Complete": ("completed", lambda req, _resp: len(req.ids)),
    "Retry": ("retried", lambda req, _resp: len(req.items)),
    "Extend": ("extended", lambda req, _resp: len(req.ids)),
}


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class MetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]  # generic only in the stubs
    """Latency, status and items of every querator.v1 call, by queue and method."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        method_path = handler_call_details.method
        if handler is None or not method_path.startswith(_API_PREFIX):
            return handler
        if handler.unary_unary is None and handler.stream_stream is None:
            return handler
        cached = self._wrapped.get(method_path)
        if cached is not None and cached[0] is handler:
            return cached[1]
        method = method_path.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            wrapped = grpc.unary_unary_rpc_method_handler(
                self._measure(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        else:
            assert handler.stream_stream is not None
            wrapped = grpc.stream_stream_rpc_method_handler(
                self._measure_stream(method, handler.stream_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        self._wrapped[method_path] = (handler, wrapped)
        return wrapped

    def _measure_stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        """Each message of a stream counted as a call of ``method`` would be: the
        stream answers every message once and in order, so answers pair with messages."""
        metrics = self._metrics
        counted = _ITEMS.get(method.removesuffix("Stream"))

        async def measured(messages: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            sent: deque[tuple[float, Any]] = deque()

            async def noted() -> AsyncIterator[Any]:
                async for message in messages:
                    sent.append((time.perf_counter(), getattr(message, "request", None)))
                    yield message

            async for answer in behavior(noted(), context):
                started, request = sent.popleft()
                queue = _queue_of(request)
                label = queue if metrics.known_queue(queue) else ""
                if answer.response is not None:
                    code = "OK"
                    if counted is not None:
                        action, count = counted
                        metrics.items.labels(label, action).inc(count(request, answer.response))
                    if method == "LeaseStream" and request.complete_ids:
                        metrics.items.labels(label, "completed").inc(len(request.complete_ids))
                else:
                    code = _CODE_NAMES.get(answer.error.code, str(answer.error.code))
                metrics.rpc_duration.labels(label, method).observe(time.perf_counter() - started)
                metrics.rpc_requests.labels(label, method, code).inc()
                yield answer

        return measured

    def _measure(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        metrics = self._metrics
        counted = _ITEMS.get(method)

        async def measured(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            queue = _queue_of(request)
            started = time.perf_counter()
            code = "OK"
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                found = context.code()
                code = found.name if isinstance(found, grpc.StatusCode) else type(exc).__name__
                raise
            else:
                # Labelled when the call ends: a call that outlived its queue's delete
                # must not bring the deleted queue's series back.
                label = queue if metrics.known_queue(queue) else ""
                if counted is not None:
                    action, count = counted
                    metrics.items.labels(label, action).inc(count(request, response))
                if method == "Lease" and request.complete_ids:
                    metrics.items.labels(label, "completed").inc(len(request.complete_ids))
                return response
            finally:
                elapsed = time.perf_counter() - started
                label = queue if metrics.known_queue(queue) else ""
                metrics.rpc_duration.labels(label, method).observe(elapsed)
                metrics.rpc_requests.labels(label, method, code).inc()

        return measured


class Metrics:
    """The registry, the event metrics, the collector and the HTTP endpoint."""

    def __init__(self, manager: QueuesManager) -> None:
        self.manager = manager
        disable_created_metrics()  # no *_created series: half the output, no use here
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rpc_duration = Histogram(
            "querator_rpc_duration_seconds",
            "Time to answer a querator.v1 call, by queue and method. Lease includes the time spent waiting for items.",
            ["queue", "method"],
            buckets=RPC_BUCKETS,
            registry=r,
        )
        self.rpc_requests = Counter(
            "querator_rpc_requests",
            "querator.v1 calls answered, by queue, method and status code.",
            ["queue", "method", "code"],
            registry=r,
        )
        self.items = Counter(
            "querator_items",
            "Items moved by successful calls: produced, leased, completed, retried, extended.",
            ["queue", "action"],
            registry=r,
        )
        self.lease_expirations = Counter(
            "querator_lease_expirations",
            "Leases that ran out (the item went back to the queue or was dead-lettered).",
            ["queue"],
            registry=r,
        )
        self.dead_letters = Counter(
            "querator_dead_letters",
            "Items dead-lettered: moved to the dead-letter queue, or dropped (no dead_queue).",
            ["queue", "outcome"],
            registry=r,
        )
        self.cycle_duration = Histogram(
            "querator_cycle_duration_seconds",
            "Time an actor cycle spends in its storage transaction, commit included.",
            ["queue"],
            buckets=STORAGE_BUCKETS,
            registry=r,
        )
        self.cycle_batch = Histogram(
            "querator_cycle_batch_requests",
            "Requests applied per actor cycle (0: a cycle run only by the lifecycle timers).",
            ["queue"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.commit_duration = Histogram(
            "querator_lmdb_commit_duration_seconds",
            "Time of the LMDB commit (with fsync) of a queue's write transaction.",
            ["queue"],
            buckets=STORAGE_BUCKETS,
            registry=r,
        )
        self.stream_unsent = Gauge(
            "querator_lease_stream_unsent_bytes",
            "Bytes of LeaseStream answers made and not yet sent, server-wide.",
            registry=r,
        )
        self.streams_stalled = Counter(
            "querator_lease_streams_stalled",
            "LeaseStreams ended because their client read nothing for the stall timeout.",
            registry=r,
        )
        self.loop_lag = Histogram(
            "querator_event_loop_lag_seconds",
            f"How late the event loop ran a timer due every {LOOP_LAG_INTERVAL_S} s: how long calls and cycles "
            "waited behind other work then.",
            buckets=LOOP_LAG_BUCKETS,
            registry=r,
        )
        self._loop_probe: asyncio.Task[None] | None = None
        r.register(QueueCollector(manager))
        self._labelled = (
            self.rpc_duration,
            self.rpc_requests,
            self.items,
            self.lease_expirations,
            self.dead_letters,
            self.cycle_duration,
            self.cycle_batch,
            self.commit_duration,
        )
        self._http: WSGIServer | None = None
        self.port = 0

    # -- wiring (called by the manager and the server) ---------------------------------

    def attach(self, actor: LogicalQueue) -> None:
        """Hook a new actor and its store before the actor starts."""
        probe = QueueProbe(self, actor.name)
        actor.observer = probe
        actor.store.on_commit = probe.commit_hook()

    def detach(self, name: str) -> None:
        """Remove every series of a deleted queue (a queue created again starts afresh)."""
        for metric in self._labelled:
            metric.remove_by_labels({"queue": name})

    def watch_streams(self, unsent_bytes: Callable[[], int]) -> Callable[[], None]:
        """Read the unsent bytes at scrape time; the callable returned counts a stalled stream."""
        self.stream_unsent.set_function(unsent_bytes)
        return self.streams_stalled.inc

    def watch_replication(self, states: Callable[[], Iterable[ReplicaState]]) -> None:
        """Export the replicated queues ``states`` lists at every scrape (a cluster node)."""
        self.registry.register(ReplicationCollector(states))

    def watch_cluster(self, view: Callable[[], tuple[int, bool, int]]) -> None:
        """A cluster node's gauges (ClusterCollector), read from ``view`` at scrape time."""
        self.registry.register(ClusterCollector(view))

    def watch_loop(self) -> None:
        """Measure the event loop's lag until close(); called on the loop."""
        self._loop_probe = asyncio.get_running_loop().create_task(self._probe_loop(), name="querator-loop-lag")

    async def _probe_loop(self) -> None:
        loop = asyncio.get_running_loop()
        observe = self.loop_lag.observe
        while True:
            due = loop.time() + LOOP_LAG_INTERVAL_S
            await asyncio.sleep(LOOP_LAG_INTERVAL_S)
            observe(max(0.0, loop.time() - due))

    def interceptors(self) -> list[grpc.aio.ServerInterceptor[Any, Any]]:
        return [MetricsInterceptor(self)]

    def known_queue(self, name: str) -> bool:
        if not name:
            return False
        try:
            self.manager.get(name)
        except NotFound:
            return False
        return True

    # -- the HTTP endpoint ----------------------------------------------------------------

    def serve(self, address: str, token: str = "") -> None:
        """Serve /metrics on ``address`` (with ``token``: only to ``Authorization: Bearer
        <token>``); raises OSError when it cannot be bound or the token is too weak."""
        try:
            host, port = parse_address(address)
        except ValueError as exc:
            raise OSError(str(exc)) from None
        if token and (len(token) < METRICS_TOKEN_MIN_CHARS or any(ch.isspace() for ch in token)):
            raise OSError(
                f"the metrics token must have at least {METRICS_TOKEN_MIN_CHARS} characters and no whitespace "
                f"(it has {len(token)}; openssl rand -base64 32 makes one)"
            )
        app = Exposition(self.registry, token)
        server_class = _ExpositionServer6 if ":" in host else _ExpositionServer
        try:
            server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {address}: {exc.strerror or exc}") from exc
        thread = threading.Thread(target=server.serve_forever, name="querator-metrics", daemon=True)
        thread.start()
        self._http = server
        self.port = int(server.server_port)
        log.info("metrics_started", address=f"{address.rpartition(':')[0]}:{self.port}", token=bool(token))
        if not token and host not in _LOOPBACK:
            log.warning(
                "METRICS_UNPROTECTED",
                address=f"{host}:{self.port}",
                detail="anyone who can reach this address reads every queue's name and depth; "
                "set QUERATOR_METRICS_TOKEN (or --metrics-token-file), or serve metrics on 127.0.0.1",
            )

    def close(self) -> None:
        probe, self._loop_probe = self._loop_probe, None
        if probe is not None:
            probe.cancel()
        server, self._http = self._http, None
        if server is not None:
            server.shutdown()
            server.server_close()


class Exposition:
    """The /metrics WSGI app: the bearer check, and one rendering at a time.

    Rendering holds the GIL, and so the event loop, for its whole length: parallel
    scrapes (several Prometheus servers, or anyone who can reach the port) each
    rendering would multiply that. Instead a scrape that arrives while another renders
    waits for that answer and returns it, so at most one rendering runs at any time;
    renderings are spaced (RENDER_SPACING) so that they take a bounded share of the
    time; and at most MAX_SCRAPES scrapes are held at once (others: 503). An answer is
    never one finished before the scrape: it comes from a rendering that ended after it
    arrived (the one in progress then, or a new one)."""

    def __init__(self, registry: CollectorRegistry, token: str = "") -> None:
        self._registry = registry
        self._expected = f"Bearer {token}".encode() if token else b""
        self._slots = threading.BoundedSemaphore(MAX_SCRAPES)
        self._done = threading.Condition()
        self._rendering = False
        self._renders = 0  # renderings finished, so a waiter knows when its answer is ready
        self._body: bytes | None = None
        self._next_start = 0.0  # monotonic time before which no rendering starts
        self.rendered = 0  # renderings done (for tests and the curious)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        threading.current_thread().name = SCRAPE_THREAD  # named in thread dumps (and tests)
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            return _reply(start_response, "404 Not Found", b"metrics are at /metrics\n")
        if environ.get("REQUEST_METHOD") != "GET":
            return _reply(start_response, "405 Method Not Allowed", b"GET /metrics\n", [("Allow", "GET")])
        if self._expected:
            given = str(environ.get("HTTP_AUTHORIZATION", "")).encode("latin-1", "replace")
            if not hmac.compare_digest(given, self._expected):
                return _reply(
                    start_response,
                    "401 Unauthorized",
                    b"send the metrics token: Authorization: Bearer <token>\n",
                    [("WWW-Authenticate", 'Bearer realm="querator-metrics"')],
                )
        if not self._slots.acquire(blocking=False):
            return _reply(start_response, "503 Service Unavailable", b"too many scrapes at once\n", [("Retry-After", "1")])
        try:
            body = self._render()
        except Exception as exc:  # noqa: BLE001 -- answered 500, logged; the server goes on
            log.warning("metrics_render_failed", error=repr(exc))
            return _reply(start_response, "500 Internal Server Error", b"rendering the metrics failed\n")
        finally:
            self._slots.release()
        return _reply(start_response, "200 OK", body, content_type=CONTENT_TYPE_LATEST)

    def _render(self) -> bytes:
        with self._done:
            while True:
                if self._rendering:  # join it: its answer is as fresh as ours would be
                    seen = self._renders
                    while self._renders == seen:
                        self._done.wait()
                    if self._body is None:
                        raise RuntimeError("the rendering this scrape waited for failed")
                    return self._body
                delay = self._next_start - time.monotonic()
                if delay <= 0:
                    break
                self._done.wait(delay)  # woken early only if the rendering changed hands
            self._rendering = True
        started = time.monotonic()
        body: bytes | None = None
        try:
            body = generate_latest(self._registry)
            return body
        finally:
            ended = time.monotonic()
            with self._done:
                self._body = body
                self._rendering = False
                self._renders += 1
                self.rendered += 1
                self._next_start = ended + min(RENDER_SPACING * (ended - started), MAX_RENDER_WAIT_S)
                self._done.notify_all()


def _reply(
    start_response: Callable[..., Any],
    status: str,
    body: bytes,
    headers: list[tuple[str, str]] | None = None,
    content_type: str = "text/plain; charset=utf-8",
) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))), *(headers or [])])
    return [body]


class _ExpositionServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ExpositionServer6(_ExpositionServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (logs are JSON lines), and a bound on idle connections."""

    timeout = _REQUEST_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 -- the base class's name
        pass
