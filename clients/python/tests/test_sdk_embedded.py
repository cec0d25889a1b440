"""Embedded mode and querator.testing: a real server inside the process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import querator
from querator.embedded import EmbeddedServer
from querator.testing import server

from sdk_helpers import run


def test_embedded_server_keeps_data_across_restarts(tmp_path: Path) -> None:
    data = tmp_path / "app-queue"
    with EmbeddedServer(data) as embedded:
        assert embedded.running and embedded.address.startswith("127.0.0.1:")
        with embedded.client() as c:
            c.create_queue("outbox")
            c.produce("outbox", ["kept"])
    assert not embedded.running
    with pytest.raises(RuntimeError):
        embedded.client()

    again = EmbeddedServer(data).start()
    try:
        with again.client() as c:
            items = c.lease("outbox", wait=0)
            assert [i.text for i in items] == ["kept"]
            items[0].complete()

        async def use_async() -> int:
            async with again.async_client() as ac:
                await ac.produce("outbox", ["async"])
                return (await ac.queue_stats("outbox")).total

        assert run(use_async()) == 1
    finally:
        again.stop()
    assert data.exists()  # a given data_dir is the application's: never removed


def test_testing_server_uses_a_temp_dir_and_removes_it() -> None:
    with server() as srv, srv.client() as c:
        data_dir = Path(srv.data_dir)
        assert data_dir.exists()
        c.create_queue("t")
        assert [q.name for q in c.list_queues()] == ["t"]
    assert not data_dir.exists()


def test_plugin_fixtures(querator_server: EmbeddedServer, querator_client: querator.Client) -> None:
    assert querator_client.address == querator_server.address
    querator_client.create_queue("from-fixture")
    assert querator_client.get_queue("from-fixture").name == "from-fixture"


def test_missing_server_package_is_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "querator_server" or m.startswith("querator_server.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "querator_server", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install querator-server"):
        EmbeddedServer().start()


_HOST_APP = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="HOST %(name)s %(levelname)s %(message)s")
from querator.embedded import EmbeddedServer
with EmbeddedServer() as srv, srv.client() as c:
    c.create_queue("q")
    try:
        c.create_queue("q")
    except Exception:
        pass
    print("app output")
"""


def test_embedded_server_logs_through_the_hosts_logging_and_never_to_stdout() -> None:
    import subprocess

    result = subprocess.run([sys.executable, "-c", _HOST_APP], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "app output\n"  # the application's own output only
    lines = result.stderr.splitlines()
    # Formatted by the host's handler, under the server's logger names.
    assert any(line.startswith("HOST querator.server INFO server_started address=127.0.0.1:") for line in lines)
    assert any(line.startswith("HOST querator.server.rpc INFO rpc_error") and "ALREADY_EXISTS" in line for line in lines)


def test_embedded_server_log_records_carry_the_event(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="querator.server"):
        with EmbeddedServer() as srv, srv.client() as c:
            c.create_queue("logged")
    created = [r for r in caplog.records if getattr(r, "querator_event", {}).get("event") == "queue_created"]
    assert created and created[0].name == "querator.server.manager"
    assert created[0].querator_event["queue"] == "logged"  # type: ignore[attr-defined]
