"""The server needs the generated code (querator-proto), not the SDK (querator-client)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
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


@contextlib.contextmanager
def _serving(script: str, *args: str, data_dir: Path) -> Iterator[Stubs]:
    """A server run by ``python -c script ARGS``, and stubs to it; it must exit 0 on SIGTERM."""
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, *args, "--address", address, "--data-dir", str(data_dir), "--log-level", "warning"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip

        def text() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")

        try:
            wait_for_server(address, proc, 60, text)
            with grpc.insecure_channel(address) as channel:
                yield Stubs(channel)
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
        assert code == 0, text()


def test_the_server_runs_without_the_sdk(tmp_path: Path) -> None:
    with _serving(_WITHOUT_SDK, _sdk_path_entry(), data_dir=tmp_path / "d") as stubs:
        stubs.create("q")
        stubs.produce("q", [b"a"])
        reply = stubs.queue.Lease(queue_pb2.LeaseRequest(queue_name="q", batch_size=1), timeout=10)
        assert [i.payload for i in reply.items] == [b"a"]
        assert stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="q"), timeout=10).queue.queue_name == "q"


# A Python in which the etcd client is not installed (the ``cluster`` extra left out).
_WITHOUT_ETCD_CLIENT = """
import sys
sys.modules["aetcd"] = None  # find_spec answers None, import raises: as if never installed
from querator_server.cli import main
import querator_server.server
assert "querator_server.cluster" not in sys.modules
sys.exit(main(sys.argv[1:]))
"""


def test_the_single_server_runs_without_the_cluster_extra(tmp_path: Path) -> None:
    """aetcd is the ``cluster`` extra: a single server never imports the cluster package."""
    with _serving(_WITHOUT_ETCD_CLIENT, data_dir=tmp_path / "d") as stubs:
        stubs.create("q")


def test_serve_cluster_without_the_cluster_extra_says_how_to_install_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_")}
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_ETCD_CLIENT, "--address", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"),
         "--cluster", "etcd://127.0.0.1:1/querator", "--node-id", "n1", "--advertise", "127.0.0.1:1"],
        env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "pip install 'querator-server[cluster]'" in done.stderr.decode(), done.stderr
    assert not (tmp_path / "d").exists()  # refused before anything was opened
