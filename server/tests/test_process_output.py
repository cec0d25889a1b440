"""What a server process leaves behind: JSON log lines only, and private files.

A real ``querator serve`` process (started as the container starts it, through the
client's command line, which loads gRPC first) is put through what used to write plain
text to its stderr: reflection and stream clients that hang up mid-call (asyncio's
"Task exception was never retrieved"), plaintext clients knocking on a TLS port (gRPC's
C core), and a call that meets a bug. Every line of its stderr must parse as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from querator.v1 import queue_pb2, queues_pb2
from querator_server.faults import APPLY, REQUEST_FAULT_METADATA, REQUEST_FAULTS_ENV

from conftest import Stubs, free_port


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cert")
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.pem",
        "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1", cwd=d,
    )
    return d


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], address: str, stderr: object) -> None:
        self.proc = proc
        self.address = address
        self.stderr = stderr

    def text(self) -> str:
        self.stderr.seek(0)  # type: ignore[attr-defined]
        return self.stderr.read().decode("utf-8", errors="replace")  # type: ignore[attr-defined, no-any-return]


@pytest.fixture
def served(tmp_path: Path, cert: Path) -> Iterator[Served]:
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, QUERATOR_LOG_LEVEL="info", **{REQUEST_FAULTS_ENV: "1"})
    for name in ("GRPC_VERBOSITY", "GRPC_TRACE"):
        env.pop(name, None)
    querator = os.path.join(os.path.dirname(sys.executable), "querator")
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(
            [querator, "serve", "--address", address, "--data-dir", str(tmp_path / "data"),
             "--tls-cert", str(cert / "server.pem"), "--tls-key", str(cert / "server.key")],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
        )
        served = Served(proc, address, stderr)
        try:
            _wait_tls(served, cert)
            yield served
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _tls(address: str, cert: Path) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=(cert / "server.pem").read_bytes())
    return grpc.secure_channel(address, creds)


def _wait_tls(served: Served, cert: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert served.proc.poll() is None, served.text()
        channel = _tls(served.address, cert)
        try:
            grpc.channel_ready_future(channel).result(timeout=0.5)
            return
        except grpc.FutureTimeoutError:
            pass
        finally:
            channel.close()
    raise AssertionError(f"the server did not answer:\n{served.text()}")


def test_every_stderr_line_is_json(served: Served, cert: Path) -> None:
    channel = _tls(served.address, cert)
    stubs = Stubs(channel)
    stubs.create("q")
    # Reflection clients that hang up in the middle of their stream.
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    for _ in range(3):
        def asks() -> Iterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            time.sleep(0.3)

        call = reflection.ServerReflectionInfo(asks())
        assert next(call).list_services_response.service
        call.cancel()
    # A LeaseStream whose client hangs up while its Lease waits.
    def leases() -> Iterator[queue_pb2.LeaseStreamRequest]:
        yield queue_pb2.LeaseStreamRequest(
            request=queue_pb2.LeaseRequest(queue_name="q", batch_size=1, request_timeout={"seconds": 5})
        )
        time.sleep(0.3)

    stream = stubs.queue.LeaseStream(leases())
    time.sleep(0.5)
    stream.cancel()
    # A call that meets a bug (logged with its traceback).
    with pytest.raises(grpc.RpcError) as failed:
        stubs.queue.Produce(
            queue_pb2.ProduceRequest(queue_name="q", items=[queue_pb2.ProduceItem(payload=b"x")]),
            metadata=((REQUEST_FAULT_METADATA, APPLY),),
            timeout=10,
        )
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    # Plaintext clients on the TLS port: gRPC's C core reports each failed handshake.
    for _ in range(3):
        plain = grpc.insecure_channel(served.address)
        try:
            grpc.channel_ready_future(plain).result(timeout=0.5)
        except grpc.FutureTimeoutError:
            pass
        plain.close()
    stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="q"), timeout=10)
    channel.close()
    time.sleep(0.5)
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(30) == 0
    lines = served.text().splitlines()
    events = []
    for line in lines:
        try:
            events.append(json.loads(line)["event"])
        except (ValueError, KeyError) as exc:
            raise AssertionError(f"not a JSON log line: {line!r}\n(whole stderr:\n{served.text()[-4000:]})") from exc
    assert "server_started" in events and "server_stopped" in events
    assert "request_failed" in events  # the bug's traceback, as JSON


def test_data_files_are_private(served: Served, cert: Path, tmp_path: Path) -> None:
    channel = _tls(served.address, cert)
    stubs = Stubs(channel)
    stubs.create("small")  # in a commit group
    stubs.create("wide", requested_partitions=40)  # a directory of its own
    stubs.produce("small", [b"x"])
    stubs.produce("wide", [b"x"])
    channel.close()
    data = tmp_path / "data"
    seen = {"dir": 0, "file": 0}
    for root, _dirs, files in os.walk(data):
        mode = stat.S_IMODE(os.stat(root).st_mode)
        assert mode == 0o700, f"{root}: {oct(mode)}"
        seen["dir"] += 1
        for name in files:
            mode = stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode)
            assert mode == 0o600, f"{os.path.join(root, name)}: {oct(mode)}"
            seen["file"] += 1
    assert seen["dir"] >= 6 and seen["file"] >= 7  # data, catalog, groups, groups/0, queues, queues/<uid>
