"""Build, run and stop the grpc.aio server around a QueuesManager."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import resource
import signal
import sys
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from .config import ServerConfig
from .errors import QueratorError
from .grpc_api import QueueService, QueuesService, StorageService
from .grpc_api.authz import Guard
from .grpc_api.cluster_service import SERVICE as CLUSTER_SERVICE
from .grpc_api.cluster_service import ClusterService
from .grpc_api.health_service import HealthService
from .grpc_api.keys_service import SERVICE as KEYS_SERVICE
from .grpc_api.keys_service import KeysService
from .grpc_api.queue_service import SERVICE as QUEUE_SERVICE
from .grpc_api.queues_service import SERVICE as QUEUES_SERVICE
from .grpc_api.storage_service import SERVICE as STORAGE_SERVICE
from .logging import get_logger
from .manager import QueuesManager
from .reflection import ReflectionServicer

if TYPE_CHECKING:
    from .cluster.etcd import Access

log = get_logger()

# The exit status of a node whose id another process took over (cluster/membership.py).
EXIT_SUPERSEDED = 3
SERVICES = (QUEUE_SERVICE, QUEUES_SERVICE, STORAGE_SERVICE, KEYS_SERVICE, CLUSTER_SERVICE)
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}
# After its queues stopped, the server answers UNAVAILABLE until no call came for
# SHUTDOWN_LULL_S, at most SHUTDOWN_DRAIN_S (see stop()).
SHUTDOWN_LULL_S = 0.05
SHUTDOWN_DRAIN_S = 0.5
_REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
# A health check name of its own: NOT_SERVING while any partition of any queue is faulty
# (GetQueueStats says which and why). The server itself stays SERVING: its other
# partitions serve, and a balancer taking the node out would fail them too.
PARTITIONS_HEALTH = "querator.partitions"


def _partitions_status(faulty: int) -> Any:
    return health_pb2.HealthCheckResponse.NOT_SERVING if faulty else health_pb2.HealthCheckResponse.SERVING


def _reflection_v1(servicer: ReflectionServicer) -> grpc.GenericRpcHandler[Any, Any]:
    # grpcio-reflection serves only v1alpha; v1 is wire-identical, so the same
    # servicer answers under the v1 name for newer tools.
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(_REFLECTION_V1, {"ServerReflectionInfo": method})


class QueratorServer:
    """A running server: gRPC, health, reflection and the queues manager."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.manager = QueuesManager(
            config.data_dir,
            sync=config.sync,
            commit_groups=config.commit_groups,
            max_inbox=config.max_inbox,
            map_size=config.map_size,
            bootstrap_token=config.admin_token if config.auth else "",
            bootstrap_until_key=config.admin_token_until_key,
            fail_queue_after_s=config.fail_queue_after_s,
        )
        self.health = HealthService()
        self._health_updates: set[asyncio.Task[None]] = set()
        self._server: grpc.aio.Server | None = None
        self._queue_service: QueueService | None = None
        self._reflection: ReflectionServicer | None = None
        self.port = 0
        self._stopped = asyncio.Event()
        self.cluster: Any = None  # cluster.Coordinator with --cluster (imported only then)
        # Set by serve(): exit the process when another process takes the node id over.
        self.exit_when_superseded = False
        self.metrics = None
        if config.metrics_address:  # prometheus_client is imported only when metrics are on
            from .metrics import Metrics

            self.metrics = self.manager.observer = Metrics(self.manager)

    async def start(self) -> None:
        if self.metrics is not None:
            self.metrics.serve(self.config.metrics_address, self._metrics_token())
        await self.manager.start()
        if self.config.cluster:
            await self._join_cluster()
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", self.config.max_receive_bytes),
            ("grpc.max_send_message_length", self.config.max_receive_bytes),
            ("grpc.so_reuseport", 0),
            # gRPC core cancels calls beyond its pending-request limit before any
            # handler runs (CANCELLED, not a documented code); admission is the
            # actors' bounded inboxes' job, so lift it.
            ("grpc.server.max_pending_requests", 10_000),
            ("grpc.server.max_pending_requests_hard_limit", 20_000),
        ]
        if self.cluster is not None:  # the other nodes' keepalive pings
            from .cluster.forwarding import SERVER_OPTIONS

            options.extend(SERVER_OPTIONS)
        server = grpc.aio.server(
            interceptors=self.metrics.interceptors() if self.metrics is not None else None, options=options
        )
        guard = Guard(lambda: self.manager.keyring) if self.config.auth else None
        cluster = self.cluster
        router = cluster.router if cluster is not None else None
        self._queue_service = queue_service = QueueService(
            self.manager,
            guard,
            router,
            unsent_bytes=self.config.unsent_bytes,
            stream_unsent_bytes=self.config.stream_unsent_bytes,
            stall_s=self.config.stream_stall_s,
        )
        if self.metrics is not None:
            room = queue_service.send_room
            queue_service.lease_sending.on_stall = self.metrics.watch_streams(lambda: room.unsent)
        server.add_generic_rpc_handlers(
            (
                queue_service.handler(),
                QueuesService(self.manager, guard, cluster).handler(),
                StorageService(self.manager, guard, router).handler(),
                KeysService(self.manager, guard, cluster).handler(),
                ClusterService(self.manager, lambda: self.address, guard, cluster).handler(),
            )
        )
        if router is not None:
            from .grpc_api.peer_service import PeerService

            assert cluster is not None
            peer_service = PeerService(
                router.give_backs, queue_service.give_back_here, cluster.roles.host, cluster.dead_letters, cluster.redrives
            )
            server.add_generic_rpc_handlers((peer_service.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        # Serves our files with their proto comments (see reflection.py).
        servicer = self._reflection = ReflectionServicer(
            (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME, _REFLECTION_V1)
        )
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
        server.add_generic_rpc_handlers((_reflection_v1(servicer),))
        try:
            credentials = self._tls_credentials()
            if credentials is None:
                self.port = server.add_insecure_port(self.config.address)
            else:
                self.port = server.add_secure_port(self.config.address, credentials)
        except RuntimeError:  # grpcio raises instead of returning 0 when the bind fails
            self.port = 0
        except OSError:
            await self._leave_cluster()
            await self.manager.stop()
            raise
        if not self.port:
            await self._leave_cluster()
            await self.manager.stop()
            raise OSError(f"cannot listen on {self.config.address} (address in use or invalid)")
        await server.start()
        self._server = server
        if self.metrics is not None:
            self.metrics.watch_loop()
            if cluster is not None:
                self.metrics.watch_cluster(cluster.metrics_view)
        for name in ("", *SERVICES):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if cluster is not None and cluster.membership.fenced:
            await self._cluster_standing(False)
        await self.health.set(PARTITIONS_HEALTH, _partitions_status(self.manager.faulty_partitions()))
        self.manager.on_faulty_partitions = self._faulty_partitions_changed
        log.info(
            "server_started",
            address=self.address,
            data_dir=self.manager.data_dir,
            pid=os.getpid(),
            tls=credentials is not None,
            mutual_tls=bool(self.config.tls_client_ca),
            auth=self.config.auth,
        )
        host = self.config.address.rsplit(":", 1)[0]
        if not self.config.auth and host not in _LOOPBACK_HOSTS:
            log.warning(
                "AUTHENTICATION_IS_OFF",
                address=self.address,
                detail="anyone who can reach this address can read, change and delete every queue; "
                "set QUERATOR_AUTH=true (and QUERATOR_ADMIN_TOKEN) to require API keys",
            )
        keyring = self.manager.keyring
        if self.config.auth and not self.config.admin_token and not keyring.keys():
            log.warning("no_api_keys", detail="auth is on but there are no keys and no QUERATOR_ADMIN_TOKEN")
        if self.config.auth:
            keyring.warn_if_bootstrap_active()

    def _metrics_token(self) -> str:
        config = self.config
        if config.metrics_token and config.metrics_token_file:
            raise OSError("set the metrics token or its file (QUERATOR_METRICS_TOKEN_FILE), not both")
        if not config.metrics_token_file:
            return config.metrics_token
        try:
            with open(config.metrics_token_file, encoding="utf-8") as f:
                return f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise OSError(f"cannot read the metrics token file {config.metrics_token_file!r}: {reason}") from exc

    async def _join_cluster(self) -> None:
        if missing := cluster_support_missing():
            await self.manager.stop()
            raise OSError(missing)
        from .cluster import ClusterSettings, Coordinator
        from .cluster.forwarding import PeerTls

        config = self.config
        advertise = config.advertise or config.address
        if advertise.rsplit(":", 1)[-1] in ("", "0"):
            await self.manager.stop()
            raise OSError("a cluster node needs --advertise host:port (or a fixed port in --address)")
        peer_tls = None
        if config.tls_cert and config.tls_key:
            ca = config.cluster_ca or config.tls_client_ca
            try:
                peer_tls = PeerTls(
                    roots=_read(ca, "cluster CA") if ca else None,
                    chain=_read(config.tls_cert, "certificate"),
                    key=_read(config.tls_key, "key"),
                )
            except OSError:
                await self.manager.stop()
                raise
        try:
            etcd_access = _etcd_access(config)
        except OSError:
            await self.manager.stop()
            raise
        settings = ClusterSettings(
            config.cluster,
            config.node_id,
            advertise,
            config.cluster_lease_ttl_s,
            peer_tls,
            etcd_access,
            replicas=config.replicas,
            min_in_sync=config.min_in_sync,
            replica_lag_s=config.replica_lag_s,
            replica_ring=config.replica_ring,
        )
        try:
            self.cluster = Coordinator(
                self.manager,
                settings,
                on_standing=self._cluster_standing,
            )
            self.cluster.membership.on_superseded = self._superseded
            await self.cluster.start()
            if self.metrics is not None:
                shards, node = self.cluster.catalog.shards, self.cluster.node
                self.metrics.watch_replication(lambda: shards.gauges(node))
        except QueratorError as exc:  # a malformed --cluster URL, say
            self.cluster = None
            await self.manager.stop()
            raise OSError(exc.message) from None
        except BaseException:
            self.cluster = None
            await self.manager.stop()
            raise

    def _superseded(self, holder: dict[str, object]) -> None:
        """Another process holds this node's id: every partition here may now be served by
        it, so this process must acknowledge nothing more, not even what its queues have
        in hand: a server process exits at once (as a crash, which storage survives).
        Started in-process, data calls are refused (cluster lookups) and the server stops."""
        if self.exit_when_superseded:
            log.error("server_exiting", code=EXIT_SUPERSEDED, reason="node id taken over by another process")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(EXIT_SUPERSEDED)
        task = asyncio.get_running_loop().create_task(self.stop(grace=0))
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def _cluster_standing(self, standing: bool) -> None:
        # The node keeps serving data either way: only ClusterService's health says
        # whether it holds its membership (and so takes admin changes).
        status = health_pb2.HealthCheckResponse.SERVING if standing else health_pb2.HealthCheckResponse.NOT_SERVING
        if self._server is not None:
            await self.health.set(CLUSTER_SERVICE, status)

    async def _leave_cluster(self) -> None:
        if self.cluster is not None:
            await self.cluster.stop()
            self.cluster = None

    def _tls_credentials(self) -> grpc.ServerCredentials | None:
        config = self.config
        if not (config.tls_cert or config.tls_key or config.tls_client_ca):
            return None
        if not (config.tls_cert and config.tls_key):
            raise OSError("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")

        chain = _read(config.tls_cert, "certificate")
        key = _read(config.tls_key, "key")
        client_ca = _read(config.tls_client_ca, "client CA") if config.tls_client_ca else None
        return grpc.ssl_server_credentials(
            [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
        )

    @property
    def unsent_stream_bytes(self) -> int:
        """Bytes of LeaseStream answers made and not yet sent (send_room.py)."""
        return self._queue_service.send_room.unsent if self._queue_service is not None else 0

    @property
    def address(self) -> str:
        host = self.config.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def _faulty_partitions_changed(self, faulty: int) -> None:
        task = asyncio.get_running_loop().create_task(self.health.set(PARTITIONS_HEALTH, _partitions_status(faulty)))
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, fail waiting leases, drain the queues, close storage."""
        if self._server is None:
            return
        server, self._server = self._server, None
        log.info("server_stopping")
        grace = self.config.shutdown_grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        await self._leave_cluster()
        # The queues stop first, while gRPC still hands calls to their handlers, and
        # gRPC keeps doing so until calls stop coming: a call arriving meanwhile is
        # answered UNAVAILABLE ("shutting down", safe to retry). Calls that gRPC has
        # taken in but not yet handed over when it stops are cancelled by gRPC itself
        # (CANCELLED), which a client cannot tell from a lost reply.
        await self.manager.stop()
        # Open streams end (OK) once answered, rather than holding the grace period.
        if self._queue_service is not None:
            self._queue_service.end_streams()
        if self._reflection is not None:
            self._reflection.end_streams()
        await self.health.end_watches()
        await self._await_lull(min(SHUTDOWN_DRAIN_S, grace))
        await server.stop(grace)
        if self.metrics is not None:
            self.metrics.close()
        self._stopped.set()
        log.info("server_stopped")

    async def _await_lull(self, limit: float) -> None:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + limit
        seen = -1
        while seen != self.manager.refused_while_closing and loop.time() < give_up:
            seen = self.manager.refused_while_closing
            await asyncio.sleep(SHUTDOWN_LULL_S)

    async def wait(self) -> None:
        await self._stopped.wait()


def cluster_support_missing() -> str:
    """Why cluster mode cannot run here ("" when it can): its etcd client is the
    ``cluster`` extra, which a single server does not need."""
    if importlib.util.find_spec("aetcd") is not None:
        return ""
    return (
        "--cluster needs the etcd client, which is not installed: "
        "pip install 'querator-server[cluster]' (or install the aetcd package)"
    )


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise OSError(f"cannot read the TLS {what} {path!r}: {exc.strerror}") from exc


def _etcd_access(config: ServerConfig) -> Access | None:
    """TLS and authentication towards etcd, from the settings (files read here)."""
    from .cluster.etcd import Access

    password = config.etcd_password
    if config.etcd_password_file:
        try:
            with open(config.etcd_password_file, encoding="utf-8") as f:
                password = f.read().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise OSError(f"cannot read the etcd password file {config.etcd_password_file!r}: {reason}") from exc
    if not (config.etcd_ca or config.etcd_cert or config.etcd_user):
        return None
    return Access(
        ca=_read(config.etcd_ca, "etcd CA") if config.etcd_ca else None,
        cert=_read(config.etcd_cert, "etcd client certificate") if config.etcd_cert else None,
        key=_read(config.etcd_key, "etcd client key") if config.etcd_key else None,
        user=config.etcd_user,
        password=password,
    )


def _raise_open_file_limit() -> None:
    # Each LMDB environment (a commit group's, or a wide queue's own) holds two or three
    # files open, so a server with many queues outgrows the usual soft limit of 1024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            log.warning("open_file_limit", soft=soft, hard=hard, detail="could not raise the limit")


#: Allocations between two young-generation passes of the cyclic garbage collector in
#: a server process (Python's default is 700). Every leased item allocates a handful of
#: short-lived objects, so with the default a 1,000,000-item Spark write and read
#: cost 11,765 young, 1,069 middle and 97 full passes, 2.3 s of the server's loop;
#: with 10,000 it was 451, 40 and 3 passes, 0.5 s (bench/RESULTS.md). Not higher:
#: garbage in reference cycles lives until a pass, and a cycle that holds a request
#: holds its payload (up to 5 MB).
GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """Fewer, larger garbage-collector passes, for a process that is a server.

    Call it once the server has started: ``gc.freeze`` keeps everything start-up built
    (modules, stubs, descriptors) out of every later pass. Not done by the embedded
    server, whose host process owns its collector settings.
    """
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


async def serve(config: ServerConfig) -> None:
    """Run until SIGTERM or SIGINT; a second signal exits at once."""
    _raise_open_file_limit()
    server = QueratorServer(config)
    server.exit_when_superseded = True
    loop = asyncio.get_running_loop()
    signals = 0
    started = False

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("shutdown_requested")
            if started:
                asyncio.ensure_future(server.stop())
        else:
            log.warning("shutdown_forced")
            os._exit(130)

    # Before start: the port answers before start returns, and a SIGTERM sent as soon as
    # it does (a supervisor, a test) must stop the server cleanly, not kill it.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await server.start()
    started = True
    tune_gc()
    if signals:  # asked to stop while starting
        asyncio.ensure_future(server.stop())
    await server.wait()
