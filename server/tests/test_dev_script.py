"""``./dev serve`` on a fresh copy of the checkout: it installs what serving needs, and
nothing more, then serves.

The copy holds the tracked files as they are in the work tree (uncommitted changes
included) and no .venv; ./dev creates one and pip installs into it, from pip's cache
when ``./dev setup`` filled it (as it does in CI before the tests), else from the index.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
# Not needed to serve: the SDK's Spark extra, the type checker, the test tools.
NOT_FOR_SERVING = ("pyspark", "mypy", "pytest", "hypothesis", "ruff", "croniter")
INSTALL_TIMEOUT_S = 600


def _copy_checkout(to: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():  # a file deleted in the work tree is not copied
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.mark.timeout(INSTALL_TIMEOUT_S + 120)
def test_dev_serve_on_a_fresh_checkout_installs_only_the_server_and_serves(tmp_path: Path) -> None:
    checkout = tmp_path / "querator"
    _copy_checkout(checkout)
    assert not (checkout / ".venv").exists()
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUERATOR_") and k != "VIRTUAL_ENV"}
    env["PYTHON"] = sys._base_executable  # the interpreter this venv was made from, not the venv's
    # pip byte-compiles every installed module by default: about half this test's time on
    # 2 cores, and nothing it checks (what is installed, and that it serves) depends on it.
    env["PIP_NO_COMPILE"] = "1"
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        # ./dev execs querator serve: this pid is the server's once it serves.
        proc = subprocess.Popen(
            [str(checkout / "dev"), "serve", "--address", address, "--data-dir", str(tmp_path / "data")],
            cwd=checkout, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + INSTALL_TIMEOUT_S
        while not _serving(address):
            assert proc.poll() is None, f"./dev serve exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"./dev serve did not serve within {INSTALL_TIMEOUT_S} s:\n{log.read_text()}"
            time.sleep(0.5)
        python = checkout / ".venv" / "bin" / "python"
        probe = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m)))"
        found = subprocess.run(
            [str(python), "-c", probe, *NOT_FOR_SERVING, "querator_server", "querator", "aetcd"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.split()  # fmt: skip
        assert found == ["querator_server", "querator", "aetcd"], f"installed for ./dev serve: {found}"
        assert not (checkout / "clients" / "typescript" / "node_modules").exists(), "serve needs no npm packages"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
