"""A real etcd and real ``querator serve --cluster`` node processes, for the cluster tests.

etcd runs from the ``etcd`` binary (Debian's etcd-server package; ``./dev test``
installs it when it can) on free loopback ports with its data in a temp dir, and is
stopped by its PID. Without the binary the tests are skipped with the reason, except
in CI (CI=true), where they fail: cluster tests must never silently vanish there.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from typing import IO, TypeVar

import grpc
import pytest

from querator.v1 import cluster_pb2, cluster_pb2_grpc
from querator_server.cluster.etcd import Etcd as EtcdClient

from conftest import Stubs, free_port, wait_for_server

T = TypeVar("T")


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        message = (
            "the cluster tests need the etcd binary (Debian: apt-get install etcd-server; "
            "./dev test installs it when run as root)"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return path


class Etcd:
    """One etcd member on loopback, its data in a temp dir."""

    def __init__(
        self, data_dir: str, args: list[str] | None = None, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        self.binary = etcd_binary()
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        #: Extra etcd flags (TLS: --cert-file ...); with ``credentials`` clients speak TLS.
        self.args = args or []
        self.credentials = credentials
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def channel(self) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(self.endpoint)
        return grpc.secure_channel(self.endpoint, self.credentials)

    def start(self, timeout: float = 30) -> None:
        self._log = tempfile.TemporaryFile()
        client = f"{'https' if self.credentials is not None else 'http'}://{self.endpoint}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--name", "test",
                "--data-dir", self.data_dir,
                "--listen-client-urls", client,
                "--advertise-client-urls", client,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"test={peer}",
                "--log-level", "warn",
                *self.args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        deadline = time.monotonic() + timeout
        channel = self.channel()
        try:
            from aetcd import rpc  # type: ignore[import-untyped]

            kv = rpc.KVStub(channel)
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"etcd exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    kv.Range(rpc.RangeRequest(key=b"probe"), timeout=1)
                    return
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:  # auth on: it answers
                        return
                    if time.monotonic() > deadline:
                        raise AssertionError(f"etcd did not answer within {timeout}s:\n{self.log()}") from None
                    time.sleep(0.1)
        finally:
            channel.close()

    def log(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode("utf-8", errors="replace")[-4000:]

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Etcd:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def with_etcd_client(etcd: Etcd, body: Callable[[EtcdClient], Awaitable[T]]) -> T:
    """Run ``body`` with an etcd client of ``etcd`` (the server's own), closed after."""

    async def run() -> T:
        client = EtcdClient([etcd.endpoint])
        try:
            return await body(client)
        finally:
            await client.close()

    return asyncio.run(run())


class Node:
    """``querator serve --cluster`` as a child process (kill -9, SIGSTOP)."""

    def __init__(
        self,
        node_id: str,
        data_dir: str,
        cluster_url: str,
        ttl: int = 3,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
        metrics: bool = False,
    ) -> None:
        self.env = env or {}
        self.args = args or []
        self.credentials = channel_credentials
        #: Where the node serves its Prometheus metrics ("" when it does not).
        self.metrics_address = f"127.0.0.1:{free_port()}" if metrics else ""
        self.node_id = node_id
        self.data_dir = data_dir
        self.cluster_url = cluster_url
        self.ttl = ttl
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._starts = 0
        self.channel: grpc.Channel | None = None
        self.stubs: Stubs

    def start(self, timeout: float = 60) -> None:
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the process without waiting for it to serve (``wait_ready`` does)."""
        if self._stderr is not None:
            self._stderr.close()
        keep = os.environ.get("QUERATOR_TEST_NODE_LOGS")  # a directory: every start's log kept, for a soak's post-mortem
        if keep:
            os.makedirs(keep, exist_ok=True)
            self._starts += 1  # a file per start: stderr_text() is still the last start's
            path = os.path.join(keep, f"{self.node_id}-{self.port}-{self._starts}.log")
            self._stderr = open(path, "w+b")  # noqa: SIM115
        else:
            self._stderr = tempfile.TemporaryFile()
        env = {**os.environ, "QUERATOR_LOG_LEVEL": "warning", **self.env}
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "querator_server.cli",
                "--address", self.address,
                "--data-dir", self.data_dir,
                "--cluster", self.cluster_url,
                "--node-id", self.node_id,
                "--cluster-lease-ttl", str(self.ttl),
                *(["--metrics-address", self.metrics_address] if self.metrics_address else []),
                *self.args,
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )

    def wait_ready(self, timeout: float = 60) -> None:
        """Until the launched process serves; then the test's channel and stubs."""
        assert self.proc is not None
        if self.credentials is None:
            wait_for_server(self.address, self.proc, timeout, self.stderr_text)
        else:  # TLS: wait for the port with a TLS channel of our own
            _wait_tls(self.address, self.proc, self.credentials, timeout, self.stderr_text)
        if self.channel is None:
            self.channel = (
                grpc.insecure_channel(self.address)
                if self.credentials is None
                else grpc.secure_channel(self.address, self.credentials)
            )
            self.stubs = Stubs(self.channel)

    def stderr_text(self, limit: int = 6000) -> str:
        """The end of what the node wrote to stderr (its log), at most ``limit`` characters."""
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", errors="replace")[-limit:]

    def gauge(self, line_start: str) -> float | None:
        """The value of the metric line that starts with ``line_start`` (name and
        labels, e.g. ``querator_queue_paused{queue="q"}``) in a scrape of the node's
        metrics (started with ``metrics=True``); None when there is no such line."""
        assert self.metrics_address, "the node serves no metrics: start it with metrics=True"
        text = urllib.request.urlopen(f"http://{self.metrics_address}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(line_start + " "):
                return float(line.rsplit(" ", 1)[1])
        return None

    def info(self, timeout: float = 10) -> cluster_pb2.ClusterInfoResponse:
        stub = cluster_pb2_grpc.ClusterServiceStub(self.channel)
        return stub.ClusterInfo(cluster_pb2.ClusterInfoRequest(), timeout=timeout)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


def _wait_tls(address: str, proc: subprocess.Popen[bytes], credentials: grpc.ChannelCredentials, timeout: float, log) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    with grpc.secure_channel(address, credentials) as channel:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited with {proc.returncode}:\n{log()}")
            try:
                grpc.channel_ready_future(channel).result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the server did not answer on {address}:\n{log()}") from None


class Cluster:
    """An etcd and ``size`` nodes n1..n<size>, each with its own data dir under ``root``."""

    def __init__(
        self,
        root: str,
        size: int = 3,
        ttl: int = 3,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
        metrics: bool = False,
    ) -> None:
        self.env = env
        self.args = args
        self.credentials = channel_credentials
        self.metrics = metrics
        self.root = root
        self.etcd = Etcd(os.path.join(root, "etcd"))
        self.prefix = f"test-{uuid.uuid4().hex[:8]}"
        self.nodes: list[Node] = []
        self.size = size
        self.ttl = ttl

    @property
    def url(self) -> str:
        return f"etcd://{self.etcd.endpoint}/{self.prefix}"

    def start(self) -> Cluster:
        self.etcd.start()
        # Every node's process at once, then wait for each: their starts (mostly imports)
        # overlap instead of adding up. Nothing depends on which registers first.
        for i in range(1, self.size + 1):
            node = Node(
                f"n{i}", os.path.join(self.root, f"n{i}"), self.url, self.ttl, self.env, self.args, self.credentials, self.metrics
            )
            self.nodes.append(node)
            node.launch()
        for node in self.nodes:
            node.wait_ready()
        return self

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:  # a node that did not come up: stop what did
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        self.etcd.stop()

    def live(self, via: Node) -> set[str]:
        return {m.node_id for m in via.info().members if m.live}


# What a Proxy does with the bytes of one direction.
PASS = "pass"  # forward them
DROP = "drop"  # read and throw away: lost on the way, the connection still up
HOLD = "hold"  # stop reading: nothing flows, no error either side (TCP buffers fill)
UP, DOWN = "up", "down"  # client -> target, target -> client


class Proxy:
    """A TCP proxy on loopback in front of ``target``.

    ``cut()`` drops every connection and refuses new ones until ``restore()`` (a node cut
    off: calls fail at once). ``blackhole()`` keeps every socket but stops pumping, new
    connections included (a silent partition: calls time out, as Jepsen's do).
    ``mode(direction, PASS | DROP | HOLD)`` sets one direction alone (``UP``: what the
    client sends; ``DOWN``: what the target answers), for one-way faults;
    ``drop_replies()`` is ``mode(DOWN, DROP)``. ``delay(ms)`` holds every chunk that
    long before passing it on. ``restore()`` undoes all of them."""

    def __init__(self, target: str) -> None:
        import socket
        import threading

        self._socket = socket
        self.target = ("127.0.0.1", int(target.rsplit(":", 1)[1]))
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.open = threading.Event()
        self.open.set()
        self._modes = {UP: PASS, DOWN: PASS}
        self._delay_s = {UP: 0.0, DOWN: 0.0}
        # Set whenever something changes, so that held pumps look again.
        self._changed = threading.Condition()
        self._lock = threading.Lock()
        self._conns: list[object] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                client.close()
                continue
            try:
                upstream = self._socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            for a, b, direction in ((client, upstream, UP), (upstream, client, DOWN)):
                threading.Thread(target=self._pump, args=(a, b, direction), daemon=True).start()

    def _pump(self, source, sink, direction: str) -> None:  # type: ignore[no-untyped-def]
        import time

        try:
            while not self._closed:
                with self._changed:
                    # Bounded waits: a pump of a closed connection ends within a second.
                    while self._modes[direction] == HOLD and not self._closed:
                        self._changed.wait(1.0)
                data = source.recv(65536)
                if not data:
                    break
                delay = self._delay_s[direction]
                if delay:
                    time.sleep(delay)
                mode = self._modes[direction]
                if mode == HOLD:  # held while this chunk was read: it waits with the rest
                    with self._changed:
                        while self._modes[direction] == HOLD and not self._closed:
                            self._changed.wait(1.0)
                    mode = self._modes[direction]
                if mode == PASS:
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.close()
                except OSError:
                    pass

    def _set(self, modes: dict[str, str] | None = None, delays: dict[str, float] | None = None) -> None:
        with self._changed:
            self._modes.update(modes or {})
            self._delay_s.update(delays or {})
            self._changed.notify_all()

    def mode(self, direction: str, mode: str) -> None:
        """``direction`` (UP or DOWN) passes, drops or holds its bytes from now on."""
        if direction not in (UP, DOWN) or mode not in (PASS, DROP, HOLD):
            raise ValueError(f"no such direction or mode: {direction!r}, {mode!r}")
        self._set({direction: mode})

    def blackhole(self, up: bool = True, down: bool = True) -> None:
        """Stop pumping (both ways by default), sockets kept open."""
        self._set({d: HOLD for d, on in ((UP, up), (DOWN, down)) if on})

    def delay(self, ms: float, direction: str | None = None) -> None:
        """Hold each chunk ``ms`` milliseconds before passing it on (one direction, or both)."""
        self._set(delays={d: ms / 1000 for d in ((direction,) if direction else (UP, DOWN))})

    def cut(self) -> None:
        self.open.clear()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            try:
                conn.shutdown(self._socket.SHUT_RDWR)  # type: ignore[attr-defined]
                conn.close()  # type: ignore[attr-defined]
            except OSError:
                pass

    def restore(self) -> None:
        """Undo every fault: connections accepted, both ways passing, no delay."""
        self._set({UP: PASS, DOWN: PASS}, {UP: 0.0, DOWN: 0.0})
        self.open.set()

    def drop_replies(self, drop: bool = True) -> None:
        self.mode(DOWN, DROP if drop else PASS)

    def close(self) -> None:
        self._closed = True
        self._set()
        self.cut()
        self.listener.close()


class Flapping:
    """Faults switched on and off at random intervals, for a bounded time, on a thread:
    ``fault(proxy)`` for ``low_s``-``high_s`` seconds, then ``proxy.restore()`` as long,
    until ``seconds`` have passed or ``stop()``; left restored either way."""

    def __init__(
        self,
        proxies: list[Proxy],
        seconds: float,
        *,
        fault: str = "blackhole",
        low_s: float = 1.0,
        high_s: float = 3.0,
        seed: int = 0,
    ) -> None:
        import random
        import threading

        if fault not in ("blackhole", "cut"):
            raise ValueError(f"no such fault: {fault!r}")
        self.proxies = proxies
        self.seconds = seconds
        self.fault = fault
        self.low_s, self.high_s = low_s, high_s
        self.rng = random.Random(seed)
        self.flips = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Flapping:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        import time

        until = time.monotonic() + self.seconds
        broken = False
        try:
            while not self._stop.is_set() and time.monotonic() < until:
                for proxy in self.proxies:
                    if broken:
                        proxy.restore()
                    else:
                        getattr(proxy, self.fault)()
                broken = not broken
                self.flips += 1
                left = until - time.monotonic()
                self._stop.wait(max(0.0, min(left, self.rng.uniform(self.low_s, self.high_s))))
        finally:
            for proxy in self.proxies:
                proxy.restore()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
