"""PostgreSQL as a peer: a private cluster (initdb + pg_ctl) and a psycopg 3 asyncio client.

Durability: `fsync=on`, `synchronous_commit=on`, `full_page_writes=on`; every statement
is its own (autocommit) transaction, so each reply means the change is flushed to WAL.

Mapping of the queue operations (a table per queue, `id bigserial` primary key):
- produce: `INSERT INTO q (payload) SELECT unnest($1::bytea[])`: 100 rows per statement;
- lease:   an UPDATE lease that mirrors our lease semantics (lease column, expiry, attempts):
             WITH picked AS (SELECT id FROM q WHERE lease_deadline IS NULL OR lease_deadline < now()
                             ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED)
             UPDATE q SET lease_deadline = now() + 300 s, attempts = q.attempts + 1, leased_by = $1
             FROM picked WHERE q.id = picked.id RETURNING q.id, q.payload
           PostgreSQL has no blocking read: an empty lease polls again after 1 ms, backing
           off to 10 ms, until the wait time is up;
- complete: `DELETE FROM q WHERE id = ANY($1)`.
Each concurrent call uses its own connection (a connection runs one statement at a time).

initdb refuses to run as root: as root the cluster is created and run as the `postgres`
user (Debian's packages create it), or else as a system user `querator-bench` created here.
"""

from __future__ import annotations

import asyncio
import glob
import os
import pwd
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from common import HOST, free_port, on_exit, stop_pid, tree_pss_mib, wait_for_port

NAME = "PostgreSQL"
LEASE_SECONDS = 300
_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.010


def _bin_dir() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    if not found:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        result = subprocess.run(["apt-get", "install", "-y", "-q", "postgresql"], env=env, capture_output=True, text=True, timeout=900)
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            raise RuntimeError("PostgreSQL could not be installed: " + result.stderr.strip()[-500:])
    return os.path.dirname(found[-1])


def _run_as_user() -> str | None:
    """The unprivileged user to run the cluster as, when we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "querator-bench"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "querator-bench"], check=True, capture_output=True)
    return "querator-bench"


def _table(queue: str) -> str:
    return "q_" + re.sub(r"[^a-zA-Z0-9_]", "_", queue)


class PostgresService:
    name = NAME

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.pid = 0
        self._stop = None

    def start(self) -> PostgresClient:
        bindir = _bin_dir()
        user = _run_as_user()
        home = os.path.join(self.workdir, "postgres")
        data = os.path.join(home, "data")
        os.makedirs(home, exist_ok=True)
        prefix: list[str] = []
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chmod(self.workdir, 0o755)  # the user must reach its home below our temp dir
            shutil.chown(home, entry.pw_uid, entry.pw_gid)
            prefix = ["runuser", "-u", user, "--"]
        log = os.path.join(home, "postgres.log")
        port = free_port()
        subprocess.run(
            [*prefix, os.path.join(bindir, "initdb"), "-D", data, "-U", "bench", "--auth=trust", "-E", "UTF8", "--no-sync"],
            check=True,
            capture_output=True,
            timeout=300,
        )
        options = " ".join(
            [
                f"-k {home} -h {HOST} -p {port}",
                "-c fsync=on -c synchronous_commit=on -c full_page_writes=on",
                "-c shared_buffers=1GB -c max_wal_size=8GB -c max_connections=200",
            ]
        )
        ctl = os.path.join(bindir, "pg_ctl")

        def stop() -> None:
            subprocess.run([*prefix, ctl, "-D", data, "-m", "fast", "-w", "-t", "60", "stop"], capture_output=True, timeout=120)
            if self.pid:
                stop_pid(self.pid)  # in case pg_ctl could not stop it

        self._stop = on_exit("postgres", stop)
        subprocess.run([*prefix, ctl, "-D", data, "-l", log, "-w", "-t", "60", "-o", options, "start"], check=True, capture_output=True, timeout=120)
        with open(os.path.join(data, "postmaster.pid")) as f:
            self.pid = int(f.readline())
        wait_for_port(port, 30)
        client = PostgresClient(port=port)
        import psycopg

        with psycopg.connect(client._conninfo()) as conn:
            settings = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in ("fsync", "synchronous_commit")}  # type: ignore[index]
        if settings != {"fsync": "on", "synchronous_commit": "on"}:
            raise RuntimeError(f"PostgreSQL is not durable as configured: {settings}")
        return client

    def memory_mib(self) -> float:
        return tree_pss_mib(self.pid)

    def memory_label(self) -> str:
        return "PSS of the postmaster and its backends"

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None


@dataclass
class PostgresClient:
    port: int
    max_connections: int = 48
    _state: dict[str, Any] = field(default_factory=dict, repr=False)

    def _conninfo(self) -> str:
        return f"host={HOST} port={self.port} user=bench dbname=postgres"

    async def open(self) -> None:
        self._state.update(idle=[], created=0, available=asyncio.Condition(), all=[])
        conn = await self._acquire()
        await conn.execute("SELECT 1")
        await self._release(conn)

    async def _acquire(self) -> Any:
        import psycopg

        state = self._state
        async with state["available"]:
            while not state["idle"] and state["created"] >= self.max_connections:
                await state["available"].wait()
            if state["idle"]:
                return state["idle"].pop()
            state["created"] += 1
        conn = await psycopg.AsyncConnection.connect(self._conninfo(), autocommit=True)
        state["all"].append(conn)
        return conn

    async def _release(self, conn: Any) -> None:
        async with self._state["available"]:
            self._state["idle"].append(conn)
            self._state["available"].notify()

    async def _execute(self, sql: str, params: list[object] | None = None, fetch: bool = False) -> list[tuple[Any, ...]]:
        conn = await self._acquire()
        try:
            cursor = await conn.execute(sql, params)
            return await cursor.fetchall() if fetch else []
        finally:
            await self._release(conn)

    async def close(self) -> None:
        for conn in self._state.get("all", []):
            await conn.close()
        self._state.clear()

    async def create_queue(self, name: str, partitions: int) -> None:
        table = _table(name)
        await self._execute(f"DROP TABLE IF EXISTS {table}")
        await self._execute(
            f"CREATE TABLE {table} (id bigserial PRIMARY KEY, payload bytea NOT NULL, "
            "attempts int NOT NULL DEFAULT 0, lease_deadline timestamptz, leased_by text)"
        )

    async def drop_queue(self, name: str) -> None:
        await self._execute(f"DROP TABLE IF EXISTS {_table(name)}")

    async def count(self, name: str) -> int:
        rows = await self._execute(f"SELECT count(*) FROM {_table(name)}", fetch=True)
        return int(rows[0][0])

    async def produce(self, queue: str, payloads: list[bytes]) -> None:
        await self._execute(f"INSERT INTO {_table(queue)} (payload) SELECT unnest(%s::bytea[])", [payloads])

    async def lease(self, queue: str, client_id: str, batch: int, wait_s: float) -> tuple[object, list[bytes]]:
        table = _table(queue)
        # The rows are picked in a CTE, which PostgreSQL runs exactly once; with
        # `WHERE id IN (subquery)` the planner may run the locking subquery again per
        # row, and one W2 run under full load spun for 14 minutes that way.
        sql = (
            f"WITH picked AS (SELECT id FROM {table} WHERE lease_deadline IS NULL OR lease_deadline < now() "
            "ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED) "
            f"UPDATE {table} AS q SET lease_deadline = now() + interval '{LEASE_SECONDS} seconds', "
            "attempts = q.attempts + 1, leased_by = %s "
            "FROM picked WHERE q.id = picked.id RETURNING q.id, q.payload"
        )
        loop = asyncio.get_running_loop()
        give_up = loop.time() + wait_s
        pause = _POLL_MIN_S
        while True:
            rows = await self._execute(sql, [batch, client_id], fetch=True)
            if rows or loop.time() >= give_up:
                return [row[0] for row in rows], [bytes(row[1]) for row in rows]
            await asyncio.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    async def complete(self, queue: str, token: object) -> None:
        ids = token
        if ids:
            await self._execute(f"DELETE FROM {_table(queue)} WHERE id = ANY(%s)", [ids])

    async def finish(self, queue: str, client_id: str) -> None:
        return None
