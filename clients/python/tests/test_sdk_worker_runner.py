"""`querator worker MODULE:FUNCTION`: the worker runner, as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

import querator
from querator.embedded import EmbeddedServer

from sdk_helpers import client, srv, unique, wait_until  # noqa: F401 (fixtures)

TASKS = textwrap.dedent(
    """
    import os, time

    RECORD = os.environ["RECORD"]

    def _note(suffix, item):
        with open(RECORD + suffix, "a") as f:
            f.write(item.text + "\\n")

    def handle(item):
        _note(".started", item)
        time.sleep(float(os.environ.get("HANDLER_SECONDS", "0")))
        _note(".finished", item)

    def email(item):
        _note(".email", item)

    def stuck_once(item):
        if item.attempts == 1:
            time.sleep(6)  # past --handler-timeout: given up, and retried
            _note(".late", item)
        else:
            _note(".finished", item)
    """
)


# The console script, as users run it.
QUERATOR = str(Path(sys.executable).with_name("querator"))


def _querator(srv: EmbeddedServer, tmp_path: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    (tmp_path / "mytasks.py").write_text(TASKS)
    return subprocess.Popen(
        [QUERATOR, "--address", srv.address, "worker", *args],
        cwd=tmp_path,
        env=dict(os.environ, RECORD=str(tmp_path / "record"), PYTHONUNBUFFERED="1", **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_finishes_in_flight_items_and_gives_the_rest_back(
    srv: EmbeddedServer, client: querator.Client, tmp_path: Path, sig: signal.Signals
) -> None:
    name = unique()
    client.create_queue(name, lease_timeout=timedelta(minutes=5))  # nothing may come back by expiry
    payloads = [f"p{i:03d}" for i in range(40)]
    client.produce(name, payloads)
    proc = _querator(srv, tmp_path, "mytasks:handle", "--queue", name, "--concurrency", "4", HANDLER_SECONDS="0.5")
    try:
        wait_until(lambda: len(_lines(tmp_path / "record.started")) >= 4, timeout=30)
        wait_until(lambda: client.queue_stats(name).total_leased >= 5, timeout=10)  # some buffered, too
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert "worker stopped" in err
    started, finished = _lines(tmp_path / "record.started"), _lines(tmp_path / "record.finished")
    assert started and sorted(started) == sorted(finished)  # every handler that started, finished
    remaining = list(client.list_items(name, page_size=1000))
    assert not any(item.is_leased for item in remaining)  # given back, not left to expire
    back = [item.payload.decode() for item in remaining]
    assert sorted(finished + back) == payloads  # each item completed once, or back in the queue
    assert len(back) > 0


def test_burst_exits_0_once_the_queue_is_empty(srv: EmbeddedServer, client: querator.Client, tmp_path: Path) -> None:
    name = unique()
    client.create_queue(name)
    client.produce(name, [f"b{i}" for i in range(30)])
    client.produce(name, ["e1", "e2"], kind="email")
    proc = _querator(
        srv, tmp_path, "mytasks:handle", "--queue", name, "--kind", "email=mytasks:email", "--burst", "--json"
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(_lines(tmp_path / "record.finished")) == sorted(f"b{i}" for i in range(30))
    assert sorted(_lines(tmp_path / "record.email")) == ["e1", "e2"]
    assert json.loads(out)["completed"] == 32
    stats = client.queue_stats(name)
    assert (stats.total, stats.scheduled) == (0, 0)


def test_burst_waits_for_a_faulty_partition_and_faulty_timeout_exits_1_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partition whose storage failed reads as 0 items while it holds some: --burst
    does not exit 0 "done" before it is back; --faulty-timeout makes it exit 1 instead."""
    fault = tmp_path / "fault"
    monkeypatch.setenv("QUERATOR_FAULT_FILE", str(fault))
    data = tmp_path / "data"
    with EmbeddedServer(data, sync=False, commit_groups=False) as server, server.client() as admin:
        admin.create_queue("q", partitions=2)
        kept = admin.produce("q", ["kept"])
        served = admin.produce("q", ["served"])
        assert kept.partitions != served.partitions
        bad = kept.partitions[0]
        uid = int(kept.ids[0].split(".")[0], 16)
    fault.write_text(f"partition-error queues/{uid} p{bad}\n")  # faulty from the start
    with EmbeddedServer(data, sync=False, commit_groups=False) as server, server.client() as admin:
        assert [p.partition for p in admin.queue_stats("q").partitions if p.faulty] == [bad]
        proc = _querator(server, tmp_path, "mytasks:handle", "--queue", "q", "--burst", "--faulty-timeout", "1s")
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, err
        assert "UNAVAILABLE" in err and "stayed faulty" in err and f"partition {bad}:" in err, err
        assert _lines(tmp_path / "record.finished") == ["served"]

        proc = _querator(server, tmp_path, "mytasks:handle", "--queue", "q", "--burst")
        try:
            # Its Lease waits: it looked at the stats first, found the partition faulty,
            # and did not exit.
            wait_until(lambda: admin.queue_stats("q").lease_waiting > 0, timeout=30)
            assert proc.poll() is None
            fault.unlink()  # the partition works again: the probe puts it back, the worker drains it
            _, err = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err
        assert "waiting for 1 faulty partitions" in err, err
        assert _lines(tmp_path / "record.finished") == ["served", "kept"]


def test_a_bad_handler_path_is_a_usage_error(srv: EmbeddedServer, client: querator.Client, tmp_path: Path) -> None:
    name = unique()
    client.create_queue(name)
    for path, message in (
        ("mytasks", "not MODULE:FUNCTION"),
        ("nosuchmodule:handle", "no module named 'nosuchmodule'"),
        ("mytasks:nosuch", "has no attribute 'nosuch'"),
    ):
        proc = _querator(srv, tmp_path, path, "--queue", name, "--burst")
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, (path, err)
        assert message in err, (path, err)


def test_a_missing_queue_exits_1(srv: EmbeddedServer, tmp_path: Path) -> None:
    proc = _querator(srv, tmp_path, "mytasks:handle", "--queue", unique("missing"), "--burst")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "NOT_FOUND" in err, err


def test_handler_timeout_retries_the_item_and_the_process_waits_for_the_stuck_thread(
    srv: EmbeddedServer, client: querator.Client, tmp_path: Path
) -> None:
    name = unique()
    client.create_queue(name)
    client.produce(name, ["slow"])
    proc = _querator(srv, tmp_path, "mytasks:stuck_once", "--queue", name, "--handler-timeout", "500ms", "--burst")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert _lines(tmp_path / "record.finished") == ["slow"]  # the retry, handled
    assert "1 sync handler(s) still running" in err
    assert _lines(tmp_path / "record.late") == ["slow"]  # the process ended after the given-up call
