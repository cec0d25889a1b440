"""``querator serve``: run the server."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping, Sequence

from . import logging as qlogging

# Before anything imports grpc: its C core reads these once, when it is loaded. Loaded
# earlier (``querator serve`` comes through the client, which uses grpc), run_serve
# starts the process again.
_GRPC_CORE_LOUD = qlogging.grpc_core_loaded_loud()
qlogging.quiet_grpc_core()

from .auth import check_bootstrap_token  # noqa: E402
from .config import DEFAULT_ADDRESS, DEFAULT_DATA_DIR, ServerConfig  # noqa: E402
from .server import cluster_support_missing, serve  # noqa: E402

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        help=f"host:port to listen on (env QUERATOR_LISTEN_ADDRESS, else a single address in QUERATOR_ADDRESS; "
        f"default {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--data-dir",
        help=f"directory holding the LMDB data (env QUERATOR_DATA_DIR, default {DEFAULT_DATA_DIR})",
    )
    parser.add_argument(
        "--metrics-address",
        help="host:port to serve Prometheus metrics on, at /metrics (env QUERATOR_METRICS_ADDRESS; "
        "default: off)",
    )
    parser.add_argument(
        "--metrics-token-file",
        help="file holding a bearer token that /metrics requires (env QUERATOR_METRICS_TOKEN_FILE; "
        "or the token itself in env QUERATOR_METRICS_TOKEN)",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        help="log level (env QUERATOR_LOG_LEVEL, default info)",
    )
    parser.add_argument(
        "--log-json",
        "--json",
        dest="log_json",
        action="store_true",
        help="log JSON lines even on a terminal (default: coloured text on a terminal, JSON lines otherwise); "
        "--json is the same, as for the client commands",
    )
    parser.add_argument(
        "--auth",
        action="store_true",
        default=None,
        help="require an API key on every call (env QUERATOR_AUTH=true); the bootstrap admin "
        "token comes from env QUERATOR_ADMIN_TOKEN (at least 43 characters)",
    )
    parser.add_argument(
        "--admin-token-until-key",
        action="store_true",
        default=None,
        help="accept the bootstrap admin token only while no admin key for every queue ('*') exists "
        "(env QUERATOR_ADMIN_TOKEN_UNTIL_KEY=true)",
    )
    parser.add_argument(
        "--no-commit-groups",
        dest="commit_groups",
        action="store_false",
        default=None,
        help="give every new queue a storage environment, and a durable commit per cycle, of its own instead "
        "of letting small queues share commits (env QUERATOR_COMMIT_GROUPS=false)",
    )
    parser.add_argument(
        "--fail-queue-after",
        type=float,
        metavar="SECONDS",
        help="mark a queue failed (no longer served, UNAVAILABLE with the reason) once its storage has failed "
        "on every cycle, a full disk aside, for this long (env QUERATOR_FAIL_QUEUE_AFTER, default 60)",
    )
    parser.add_argument("--tls-cert", help="PEM certificate chain for TLS (env QUERATOR_TLS_CERT)")
    parser.add_argument("--tls-key", help="PEM private key for TLS (env QUERATOR_TLS_KEY)")
    parser.add_argument(
        "--tls-client-ca",
        help="PEM CA bundle; clients must present a certificate it signed (mutual TLS; env QUERATOR_TLS_CLIENT_CA)",
    )
    parser.add_argument(
        "--cluster",
        help="run as a node of a cluster whose catalog is in etcd, e.g. etcd://127.0.0.1:2379/prod "
        "(env QUERATOR_CLUSTER; default: a single server, no etcd; see docs/cluster.md)",
    )
    parser.add_argument("--node-id", help="this node's id in the cluster, unique and stable (env QUERATOR_NODE_ID)")
    parser.add_argument(
        "--advertise",
        help="host:port the other nodes and clients reach this node at (env QUERATOR_ADVERTISE; "
        "default: --address)",
    )
    parser.add_argument(
        "--cluster-ca",
        help="with TLS: PEM CA bundle that signed the other nodes' certificates, for forwarded calls "
        "(env QUERATOR_CLUSTER_CA; default: --tls-client-ca, else the system's roots)",
    )
    parser.add_argument(
        "--cluster-lease-ttl",
        type=int,
        dest="cluster_lease_ttl",
        help="seconds the node's membership lasts without renewal (env QUERATOR_CLUSTER_LEASE_TTL, default 5)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        help="copies (on distinct nodes) a new queue gets unless its CreateQueue says (env QUERATOR_REPLICAS, "
        "default 1; above 1 needs --cluster)",
    )
    parser.add_argument(
        "--min-in-sync",
        type=int,
        dest="min_in_sync",
        help="fewest in-sync copies a replicated queue accepts writes with unless its CreateQueue says "
        "(env QUERATOR_MIN_IN_SYNC; default replicas - 1, at least 1; capped at the queue's replicas)",
    )
    parser.add_argument(
        "--replica-lag",
        type=float,
        dest="replica_lag",
        help="seconds a replica may stay silent or behind before the primary drops it from the in-sync set "
        "(env QUERATOR_REPLICA_LAG, default 2)",
    )
    parser.add_argument(
        "--replica-ring",
        type=int,
        dest="replica_ring",
        help="change sets each copy keeps in memory for replicas that catch up by tail; one further behind "
        "gets a snapshot (env QUERATOR_REPLICA_RING, default 20000)",
    )
    parser.add_argument(
        "--etcd-ca",
        help="PEM CA bundle etcd's certificate must chain to; turns TLS to etcd on (env QUERATOR_ETCD_CA)",
    )
    parser.add_argument(
        "--etcd-cert",
        help="PEM client certificate chain presented to etcd; turns TLS to etcd on (env QUERATOR_ETCD_CERT)",
    )
    parser.add_argument("--etcd-key", help="PEM private key of --etcd-cert (env QUERATOR_ETCD_KEY)")
    parser.add_argument(
        "--etcd-user",
        help="etcd user to authenticate as (env QUERATOR_ETCD_USER); its password from --etcd-password-file "
        "or env QUERATOR_ETCD_PASSWORD",
    )
    parser.add_argument(
        "--etcd-password-file",
        help="file holding the password of --etcd-user (env QUERATOR_ETCD_PASSWORD_FILE)",
    )


def run_serve(args: argparse.Namespace, argv: Sequence[str] | None = None) -> int:
    """Run the server; ``argv`` (the arguments ``args`` came from) lets a process that
    loaded gRPC before it could quiet gRPC's C core start again as one that did."""
    if argv is not None and _GRPC_CORE_LOUD:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, "-m", "querator_server.cli", *argv])
    try:
        config = _config(args)
    except ValueError as exc:
        print(f"querator: {exc}", file=sys.stderr)
        return 2
    if "," in config.address:
        print(f"querator: the server listens on one host:port, not a list: --address {config.address!r}", file=sys.stderr)
        return 2
    if config.fail_queue_after_s <= 0:
        print("querator: --fail-queue-after must be above 0 seconds", file=sys.stderr)
        return 2
    if config.log_level.lower() not in LOG_LEVELS:
        print(f"querator: log level {config.log_level!r} must be one of {', '.join(LOG_LEVELS)}", file=sys.stderr)
        return 2
    if config.cluster and not config.node_id:
        print("querator: --cluster needs --node-id (env QUERATOR_NODE_ID)", file=sys.stderr)
        return 2
    if config.cluster and (missing := cluster_support_missing()):
        print(f"querator: {missing}", file=sys.stderr)
        return 2
    if config.cluster and config.cluster_lease_ttl_s < 2:
        print("querator: --cluster-lease-ttl (QUERATOR_CLUSTER_LEASE_TTL) must be a whole number of seconds, at least 2", file=sys.stderr)
        return 2
    if problem := _replication_problem(config):
        print(f"querator: {problem}", file=sys.stderr)
        return 2
    if problem := _etcd_settings_problem(config):
        print(f"querator: {problem}", file=sys.stderr)
        return 2
    if config.auth and config.admin_token and (weak := check_bootstrap_token(config.admin_token)):
        print(f"querator: {weak}", file=sys.stderr)
        return 2
    qlogging.configure(config.log_level, json=True if args.log_json else None, process=True)
    try:
        asyncio.run(serve(config))
    except OSError as exc:
        print(f"querator: {exc}", file=sys.stderr)
        return 1
    return 0


def _replication_problem(config: ServerConfig) -> str:
    """What is wrong with --replicas and --min-in-sync; empty when nothing."""
    if config.replicas < 1:
        return "--replicas (QUERATOR_REPLICAS) must be a whole number, at least 1"
    if config.replicas > 1 and not config.cluster:
        return "--replicas above 1 keeps copies on other nodes: give --cluster too"
    if config.min_in_sync < 0:
        return "--min-in-sync (QUERATOR_MIN_IN_SYNC) must be a whole number, at least 1"
    if config.min_in_sync and not config.cluster:
        return "--min-in-sync applies to replicated queues of a cluster: give --cluster too"
    if not config.replica_lag_s > 0:
        return "--replica-lag (QUERATOR_REPLICA_LAG) must be a number of seconds above 0"
    if config.replica_ring < 1:
        return "--replica-ring (QUERATOR_REPLICA_RING) must be a whole number, at least 1"
    return ""


def _etcd_settings_problem(config: ServerConfig) -> str:
    """What is wrong with the etcd TLS and authentication settings; empty when nothing."""
    etcd = (config.etcd_ca, config.etcd_cert, config.etcd_key, config.etcd_user, config.etcd_password, config.etcd_password_file)
    if any(etcd) and not config.cluster:
        return "the --etcd-* settings (QUERATOR_ETCD_*) apply to a cluster node: give --cluster too"
    if bool(config.etcd_cert) != bool(config.etcd_key):
        return "a client certificate for etcd needs both --etcd-cert and --etcd-key"
    if config.etcd_password and config.etcd_password_file:
        return "give the etcd password (QUERATOR_ETCD_PASSWORD) or its file (--etcd-password-file), not both"
    has_password = bool(config.etcd_password or config.etcd_password_file)
    if config.etcd_user and not has_password:
        return "--etcd-user needs its password: --etcd-password-file, or env QUERATOR_ETCD_PASSWORD"
    if has_password and not config.etcd_user:
        return "an etcd password needs --etcd-user (env QUERATOR_ETCD_USER)"
    return ""


def _config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ServerConfig:
    """The settings ``querator serve`` runs with: the flags over the environment (``env``,
    default this process's)."""
    return ServerConfig.from_env(
        env,
        address=args.address,
        data_dir=args.data_dir,
        log_level=args.log_level,
        metrics_address=args.metrics_address,
        metrics_token_file=args.metrics_token_file,
        auth=args.auth,
        admin_token_until_key=args.admin_token_until_key,
        commit_groups=args.commit_groups,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        fail_queue_after_s=args.fail_queue_after,
        cluster=args.cluster,
        node_id=args.node_id,
        advertise=args.advertise,
        cluster_lease_ttl_s=args.cluster_lease_ttl,
        replicas=args.replicas,
        min_in_sync=args.min_in_sync,
        replica_lag_s=args.replica_lag,
        replica_ring=args.replica_ring,
        cluster_ca=args.cluster_ca,
        etcd_ca=args.etcd_ca,
        etcd_cert=args.etcd_cert,
        etcd_key=args.etcd_key,
        etcd_user=args.etcd_user,
        etcd_password_file=args.etcd_password_file,
    )


def effective_config(argv: Sequence[str], env: Mapping[str, str]) -> ServerConfig:
    """The settings ``querator serve ARGV`` runs with in environment ``env`` (a container
    definition can be checked without running it)."""
    parser = argparse.ArgumentParser(prog="querator serve")
    add_serve_arguments(parser)
    return _config(parser.parse_args(list(argv)), env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="querator serve", description="Run the Querator server.")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))  # loaded by this module, so quiet already


if __name__ == "__main__":
    sys.exit(main())
