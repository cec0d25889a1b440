"""The server needs the generated code (querator-proto), not the SDK (querator-client)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc

from querator.v1 import queue_pb2, queues_pb2

from conftest import Stubs, free_port, wait_for_server

# A Python that cannot see the SDK: its directory is taken off sys.path before any
# querator import, so ``querator`` is only the querator-proto namespace portion.
_WITHOUT_SDK = """
import os, sys
sdk = sys.argv.pop(1)
sys.path[:] = [p for p in sys.path if os.path.abspath(p) != sdk]
import querator, querator.v1
assert not hasattr(querator, "Client") and sdk not in str(list(querator.__path__)), querator.__path__
from querator_server.cli import main
code = main(sys.argv[1:])
leaked = sorted(m for m in sys.modules if m.startswith("querator.") and not m.startswith("querator.v1"))
assert not leaked, leaked
sys.exit(code)
"""


def _sdk_path_entry() -> str:
    spec = importlib.util.find_spec("querator._client")
    assert spec is not None and spec.origin is not None
    entry = str(Path(spec.origin).parent.parent)
    assert not entry.endswith("site-packages"), "the SDK must be its own path entry (an editable install)"
    return entry


def test_the_server_runs_without_the_sdk(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WITHOUT_SDK, _sdk_path_entry(), "--address", address, "--data-dir", str(tmp_path / "d"),
             "--log-level", "warning"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip

        def text() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")

        try:
            wait_for_server(address, proc, 60, text)
            channel = grpc.insecure_channel(address)
            stubs = Stubs(channel)
            try:
                stubs.create("q")
                stubs.produce("q", [b"a"])
                reply = stubs.queue.Lease(queue_pb2.LeaseRequest(queue_name="q", batch_size=1), timeout=10)
                assert [i.payload for i in reply.items] == [b"a"]
                assert stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="q"), timeout=10).queue.queue_name == "q"
            finally:
                channel.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
        assert code == 0, text()
