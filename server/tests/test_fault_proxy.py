"""The network-fault harness of the cluster tests (cluster_helpers.Proxy, Flapping) on
real loopback sockets, and the test-only peer address override that sends one node's
calls to a peer through a proxy of its own (cluster/forwarding.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from cluster_helpers import DOWN, DROP, HOLD, UP, Flapping, Proxy
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from querator_server.cluster.forwarding import TEST_PEER_ADDRESSES_ENV, Peers, peer_address_overrides


class Echo:
    """A TCP echo server on loopback that also keeps what it received."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.received = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                self.received += data
                conn.sendall(data)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def echo() -> Iterator[tuple[Echo, Proxy]]:
    server = Echo()
    proxy = Proxy(server.address)
    yield server, proxy
    proxy.close()
    server.close()


def _connect(proxy: Proxy) -> socket.socket:
    host, port = proxy.address.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=5)
    conn.settimeout(0.4)
    return conn


def _echoes(conn: socket.socket, data: bytes) -> bool:
    conn.sendall(data)
    got = b""
    try:
        while len(got) < len(data):
            chunk = conn.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            got += chunk
    except TimeoutError:
        return False
    assert got == data
    return True


def test_a_blackhole_keeps_the_connection_silent_and_delivers_nothing_until_restored(echo: tuple[Echo, Proxy]) -> None:
    server, proxy = echo
    conn = _connect(proxy)
    assert _echoes(conn, b"one")
    proxy.blackhole()
    assert not _echoes(conn, b"two")  # no answer, and no error: the socket stays open
    late = _connect(proxy)  # a new connection is accepted, and silent too
    assert not _echoes(late, b"three")
    assert bytes(server.received) == b"one"
    proxy.restore()
    conn.settimeout(2)
    assert conn.recv(16) == b"two"  # what was held goes on
    assert _echoes(conn, b"four")
    conn.close()
    late.close()


def test_one_direction_at_a_time(echo: tuple[Echo, Proxy]) -> None:
    server, proxy = echo
    conn = _connect(proxy)
    proxy.mode(UP, HOLD)  # the request never reaches the server
    assert not _echoes(conn, b"a")
    assert bytes(server.received) == b""
    proxy.restore()
    conn.settimeout(2)
    assert conn.recv(16) == b"a"
    proxy.mode(DOWN, DROP)  # the server gets it, the answer is lost
    assert not _echoes(conn, b"b")
    assert bytes(server.received) == b"ab"
    proxy.mode(DOWN, HOLD)  # ... or held
    assert not _echoes(conn, b"c")
    proxy.restore()
    assert conn.recv(16) == b"c" and _echoes(conn, b"d")
    with pytest.raises(ValueError, match="sideways"):
        proxy.mode("sideways", HOLD)
    conn.close()


def test_a_delay_holds_each_chunk_and_a_cut_refuses(echo: tuple[Echo, Proxy]) -> None:
    _server, proxy = echo
    conn = _connect(proxy)
    conn.settimeout(5)
    proxy.delay(150)
    started = time.monotonic()
    assert _echoes(conn, b"x")
    assert time.monotonic() - started >= 0.3  # 150 ms each way
    proxy.restore()
    proxy.cut()
    with pytest.raises((ConnectionError, OSError)):
        _echoes(conn, b"y")
        _echoes(conn, b"y")
    refused = _connect(proxy)  # accepted by the kernel, closed by the proxy at once
    assert refused.recv(1) == b""
    proxy.restore()
    assert _echoes(_connect(proxy), b"z")


def test_flapping_switches_the_fault_on_and_off_and_ends_restored(echo: tuple[Echo, Proxy]) -> None:
    _server, proxy = echo
    with Flapping([proxy], seconds=1.5, low_s=0.2, high_s=0.3, seed=1) as flapping:
        seen = set()
        until = time.monotonic() + 1.4
        while time.monotonic() < until:
            seen.add(proxy._modes[UP])
            time.sleep(0.02)
    assert flapping.flips >= 4 and seen == {"pass", HOLD}
    assert _echoes(_connect(proxy), b"after")
    with pytest.raises(ValueError):
        Flapping([proxy], 1.0, fault="melt")


def test_the_peer_address_override_is_parsed_and_checked() -> None:
    assert peer_address_overrides("") == {}
    assert peer_address_overrides("n2=127.0.0.1:7001, n3=127.0.0.1:7002") == {"n2": "127.0.0.1:7001", "n3": "127.0.0.1:7002"}
    for bad in ("n2", "n2=127.0.0.1", "=127.0.0.1:1", "n2=127.0.0.1:x"):
        with pytest.raises(ValueError, match=TEST_PEER_ADDRESSES_ENV):
            peer_address_overrides(bad)


class _Member:
    def __init__(self, address: str) -> None:
        self.address = address


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_node_reaches_a_peer_through_its_own_proxy_when_the_override_names_one(monkeypatch: Any) -> None:
    """The membership says n2 is at an address where nothing listens; the override
    sends this node's calls to n2 through a proxy, which a test can then blackhole."""

    async def main() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        proxy = Proxy(f"127.0.0.1:{port}")
        members = {"n2": _Member(_dead_address())}
        try:
            monkeypatch.delenv(TEST_PEER_ADDRESSES_ENV, raising=False)
            plain = Peers("n1", lambda: members)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health_pb2_grpc.HealthStub(plain.channel("n2")).Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            await plain.close()

            monkeypatch.setenv(TEST_PEER_ADDRESSES_ENV, f"n2={proxy.address}")
            peers = Peers("n1", lambda: members)
            stub = health_pb2_grpc.HealthStub(peers.channel("n2"))
            answer = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            proxy.blackhole()
            with pytest.raises(grpc.aio.AioRpcError) as silent:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            assert silent.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            proxy.restore()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            await peers.close()
        finally:
            proxy.close()
            await server.stop(None)

    asyncio.run(main())
