"""Server settings: command-line flags with environment-variable twins."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .model import MAX_MESSAGE_BYTES, SERVER_UNSENT_BYTES, STALL_SECONDS, STREAM_UNSENT_BYTES

DEFAULT_ADDRESS = "127.0.0.1:2319"
DEFAULT_DATA_DIR = "./querator-data"
# Where the server listens. QUERATOR_ADDRESS is the clients' (one server, or a
# cluster's comma list of nodes); the server reads it only when LISTEN_ADDRESS_ENV is
# unset and it names one address, as servers did before they had a variable of their own.
LISTEN_ADDRESS_ENV = "QUERATOR_LISTEN_ADDRESS"
CLIENT_ADDRESS_ENV = "QUERATOR_ADDRESS"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    address: str = DEFAULT_ADDRESS
    data_dir: str = DEFAULT_DATA_DIR
    log_level: str = "info"
    # host:port serving Prometheus metrics over HTTP (/metrics); empty: off.
    metrics_address: str = ""
    # With it, /metrics answers only "Authorization: Bearer <token>"; from the
    # environment or a file (a flag would show the token in ps).
    metrics_token: str = ""
    metrics_token_file: str = ""
    # The largest message received or sent (model.MAX_MESSAGE_BYTES says why).
    max_receive_bytes: int = MAX_MESSAGE_BYTES
    # Commit with fsync. Off only for throw-away data (tests, benchmarks of the CPU path).
    sync: bool = True
    max_inbox: int = 10_000
    # Small queues share durable commits in commit groups (docs/architecture.md); off:
    # every new queue gets an LMDB environment, and an fsync per cycle, of its own.
    commit_groups: bool = True
    # Initial LMDB map size per environment (a commit group's or a queue's own); the
    # map doubles whenever it fills.
    map_size: int = 1 << 30
    shutdown_grace_s: float = 10.0
    # A queue whose storage fails on every cycle (not for a full disk) for this long is
    # marked failed and no longer served, instead of failing every call in a loop.
    fail_queue_after_s: float = 60.0
    # LeaseStream answers made but not yet sent: bytes server-wide and per stream, and
    # how long one may wait before its stream is ended (grpc_api/send_room.py).
    unsent_bytes: int = SERVER_UNSENT_BYTES
    stream_unsent_bytes: int = STREAM_UNSENT_BYTES
    stream_stall_s: float = STALL_SECONDS
    # API keys required on every call (health and reflection excepted).
    auth: bool = False
    # With auth: a token that acts as an admin key for every queue, to create the
    # first keys. Never stored; given through the environment, not a flag.
    admin_token: str = ""
    # Accept admin_token only while no admin key for every queue exists.
    admin_token_until_key: bool = False
    # TLS: PEM files of the server's certificate chain and key; with a client CA,
    # clients must present a certificate signed by it (mutual TLS).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Cluster mode (docs/cluster.md): etcd://host:port/prefix of the catalog; empty: a
    # single server, no etcd. The node's id, and the host:port others reach it at.
    cluster: str = ""
    node_id: str = ""
    advertise: str = ""
    cluster_lease_ttl_s: int = 5
    # Replication (docs/cluster.md, "Replication"): the copies a new queue gets when its
    # CreateQueue names none, and the fewest in-sync copies it writes with (0: by rule,
    # replicas - 1 and at least 1).
    replicas: int = 1
    min_in_sync: int = 0
    # How long a replica may stay silent or behind before the primary drops it from the
    # in-sync set (and writes stop waiting for it).
    replica_lag_s: float = 2.0
    # Change sets each copy keeps in memory so a replica that was away catches up by tail
    # (beyond them it gets a snapshot).
    replica_ring: int = 20_000
    # With TLS on: the PEM CA bundle that signed the other nodes' certificates, for the
    # calls a node forwards to another (default: tls_client_ca, else the system's roots).
    cluster_ca: str = ""
    # The connection to etcd beyond plaintext (docs/cluster.md, "etcd beyond plaintext"):
    # TLS with a CA bundle and/or a client certificate, and etcd's own user and
    # password (the password from the environment or a file, never a flag: ps shows flags).
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    etcd_user: str = ""
    etcd_password: str = ""
    etcd_password_file: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ServerConfig:
        """The settings from ``env`` (default: this process's environment), then ``overrides``."""
        env = os.environ if env is None else env
        values: dict[str, object] = {
            "address": _listen_address(env, given=overrides.get("address") is not None),
            "data_dir": env.get("QUERATOR_DATA_DIR", DEFAULT_DATA_DIR),
            "log_level": env.get("QUERATOR_LOG_LEVEL", "info"),
            "metrics_address": env.get("QUERATOR_METRICS_ADDRESS", ""),
            "metrics_token": env.get("QUERATOR_METRICS_TOKEN", ""),
            "metrics_token_file": env.get("QUERATOR_METRICS_TOKEN_FILE", ""),
            "auth": _flag(env.get("QUERATOR_AUTH", "")),
            "commit_groups": _flag(env.get("QUERATOR_COMMIT_GROUPS", "true")),
            "admin_token": env.get("QUERATOR_ADMIN_TOKEN", ""),
            "admin_token_until_key": _flag(env.get("QUERATOR_ADMIN_TOKEN_UNTIL_KEY", "")),
            "tls_cert": env.get("QUERATOR_TLS_CERT", ""),
            "tls_key": env.get("QUERATOR_TLS_KEY", ""),
            "tls_client_ca": env.get("QUERATOR_TLS_CLIENT_CA", ""),
            "cluster": env.get("QUERATOR_CLUSTER", ""),
            "node_id": env.get("QUERATOR_NODE_ID", ""),
            "advertise": env.get("QUERATOR_ADVERTISE", ""),
            "cluster_ca": env.get("QUERATOR_CLUSTER_CA", ""),
            "cluster_lease_ttl_s": _whole_seconds(env.get("QUERATOR_CLUSTER_LEASE_TTL", "5")),
            "replicas": _whole_number(env.get("QUERATOR_REPLICAS", "1")),
            "min_in_sync": _whole_number(env.get("QUERATOR_MIN_IN_SYNC", "0")),
            "replica_lag_s": _seconds(env.get("QUERATOR_REPLICA_LAG", "2"), "QUERATOR_REPLICA_LAG"),
            "replica_ring": _whole_number(env.get("QUERATOR_REPLICA_RING", "20000")),
            "etcd_ca": env.get("QUERATOR_ETCD_CA", ""),
            "etcd_cert": env.get("QUERATOR_ETCD_CERT", ""),
            "etcd_key": env.get("QUERATOR_ETCD_KEY", ""),
            "etcd_user": env.get("QUERATOR_ETCD_USER", ""),
            "etcd_password": env.get("QUERATOR_ETCD_PASSWORD", ""),
            "etcd_password_file": env.get("QUERATOR_ETCD_PASSWORD_FILE", ""),
        }
        if "QUERATOR_FAIL_QUEUE_AFTER" in env:
            values["fail_queue_after_s"] = _seconds(env["QUERATOR_FAIL_QUEUE_AFTER"], "QUERATOR_FAIL_QUEUE_AFTER")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]


def _listen_address(env: Mapping[str, str], given: bool) -> str:
    """The listen address from the environment; ``given``: --address was, and wins."""
    listen = env.get(LISTEN_ADDRESS_ENV, "").strip()
    if listen or given:
        return listen or DEFAULT_ADDRESS
    shared = env.get(CLIENT_ADDRESS_ENV, "").strip()
    if "," in shared:
        raise ValueError(
            f"{CLIENT_ADDRESS_ENV}={shared!r} is a list of servers, which clients connect to; the server "
            f"listens on one address: set {LISTEN_ADDRESS_ENV} (or --address), e.g. {DEFAULT_ADDRESS}"
        )
    return shared or DEFAULT_ADDRESS


def _seconds(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name} must be a number of seconds above 0, got {text!r}")
    return value


def _whole_seconds(text: str) -> int:
    """A whole number of seconds from the environment; 0 (refused by the caller) when not one."""
    try:
        return int(text.strip())
    except ValueError:
        return 0


def _whole_number(text: str) -> int:
    """A whole number from the environment; -1 (refused by the caller) when not one."""
    try:
        return int(text.strip())
    except ValueError:
        return -1


def _flag(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")
