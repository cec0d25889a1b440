"""Redis Streams as a peer: a private durable redis-server and a redis-py asyncio client.

Durability: `appendonly yes`, `appendfsync always` (Redis fsyncs the AOF before it
answers the clients of each event-loop round, so a pipeline of 100 XADDs costs one
fsync), `save ""` (no RDB snapshots).

Mapping of the queue operations:
- produce: one pipeline of 100 `XADD stream * p <payload>` (no MULTI), one round trip;
- lease:   `XREADGROUP GROUP g <consumer> COUNT 100 BLOCK <ms> STREAMS stream >`
           (the entries move to the consumer's pending list: Redis' lease);
- complete: one pipeline of `XACK stream g ids...` + `XDEL stream ids...` (removes the
           entries, as our Complete does).
A queue is one stream with one consumer group; partitions are not used (Redis executes
commands on one thread, more streams would not add parallelism).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any

from common import HOST, free_port, on_exit, start_owned, tree_pss_mib, wait_for_port

NAME = "Redis Streams"
GROUP = "bench"


def ensure_installed() -> str:
    """The redis-server binary, installed from Debian's packages when missing."""
    path = shutil.which("redis-server")
    if path:
        return path
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "install", "-y", "-q", "redis-server"], check=False, env=env, capture_output=True, timeout=600)
    path = shutil.which("redis-server")
    if not path:
        subprocess.run(["apt-get", "update", "-q"], check=False, env=env, capture_output=True, timeout=600)
        result = subprocess.run(["apt-get", "install", "-y", "-q", "redis-server"], env=env, capture_output=True, text=True, timeout=600)
        path = shutil.which("redis-server")
        if not path:
            raise RuntimeError("redis-server could not be installed: " + result.stderr.strip()[-500:])
    return path


def _check_durable(port: int) -> None:
    import redis

    client = redis.Redis(host=HOST, port=port)
    try:
        for _ in range(100):  # the server answers LOADING while it opens its AOF
            try:
                config = {**client.config_get("appendonly"), **client.config_get("appendfsync")}
                break
            except redis.exceptions.BusyLoadingError:
                import time

                time.sleep(0.1)
        if config != {"appendonly": "yes", "appendfsync": "always"}:
            raise RuntimeError(f"redis-server is not durable as configured: {config}")
    finally:
        client.close()


class RedisService:
    name = NAME

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.pid = 0
        self._stop = None

    def start(self) -> RedisClient:
        binary = ensure_installed()
        home = os.path.join(self.workdir, "redis")
        os.makedirs(home, exist_ok=True)
        port = free_port()
        conf = os.path.join(home, "redis.conf")
        with open(conf, "w") as f:
            f.write(
                "\n".join(
                    [
                        f"bind {HOST}",
                        f"port {port}",
                        "protected-mode yes",
                        "daemonize no",
                        f"dir {home}",
                        'save ""',
                        "appendonly yes",
                        "appendfsync always",
                        "maxmemory 0",
                        "io-threads 1",
                        "",
                    ]
                )
            )
        log = os.path.join(home, "redis.log")
        proc, stop = start_owned("redis-server", [binary, conf], log)
        self._stop = on_exit("redis-server", stop)
        self.pid = proc.pid
        wait_for_port(port, 30, proc, log)
        _check_durable(port)
        return RedisClient(port=port)

    def memory_mib(self) -> float:
        return tree_pss_mib(self.pid)

    def memory_label(self) -> str:
        return "PSS of redis-server"

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None


@dataclass
class RedisClient:
    port: int
    _state: dict[str, Any] = field(default_factory=dict, repr=False)

    async def open(self) -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis(host=HOST, port=self.port, max_connections=256)
        await client.ping()
        self._state["r"] = client

    async def close(self) -> None:
        client = self._state.pop("r", None)
        if client is not None:
            await client.aclose()

    async def create_queue(self, name: str, partitions: int) -> None:
        await self._state["r"].xgroup_create(name, GROUP, id="0", mkstream=True)

    async def drop_queue(self, name: str) -> None:
        await self._state["r"].delete(name)

    async def count(self, name: str) -> int:
        return int(await self._state["r"].xlen(name))

    async def produce(self, queue: str, payloads: list[bytes]) -> None:
        pipe = self._state["r"].pipeline(transaction=False)
        for payload in payloads:
            pipe.xadd(queue, {"p": payload})
        await pipe.execute()

    async def lease(self, queue: str, client_id: str, batch: int, wait_s: float) -> tuple[object, list[bytes]]:
        reply = await self._state["r"].xreadgroup(GROUP, client_id, {queue: ">"}, count=batch, block=max(1, int(wait_s * 1000)))
        if not reply:
            return [], []
        entries = reply[0][1]
        return [entry_id for entry_id, _ in entries], [fields[b"p"] for _, fields in entries]

    async def complete(self, queue: str, token: object) -> None:
        ids = token
        if not ids:
            return
        pipe = self._state["r"].pipeline(transaction=False)
        pipe.xack(queue, GROUP, *ids)  # type: ignore[misc]
        pipe.xdel(queue, *ids)  # type: ignore[misc]
        await pipe.execute()

    async def finish(self, queue: str, client_id: str) -> None:
        return None
