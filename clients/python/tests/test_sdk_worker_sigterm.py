"""SIGTERM mid-batch: a worker process stops gracefully and no item is lost."""

from __future__ import annotations

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

WORKER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import querator

    address, queue, record, handler_seconds, shutdown_timeout = sys.argv[1:6]

    class Hooks(querator.WorkerHooks):
        def on_start(self, item):
            with open(record + ".started", "a") as f:
                f.write(item.text + "\\n")

        def on_complete(self, item, elapsed):
            # Called only once the Complete call succeeded.
            with open(record, "a") as f:
                f.write(item.text + "\\n")

    def handler(item):
        time.sleep(float(handler_seconds))

    with querator.Client(address) as client:
        worker = querator.Worker(
            client, queue, handler, concurrency=4, batch_size=8, lease_wait=1,
            shutdown_timeout=float(shutdown_timeout), hooks=Hooks(),
        )
        worker.run()  # returns after SIGTERM
    print("stopped", worker.stats.completed, worker.stats.released, flush=True)
    """
)


@pytest.mark.parametrize(
    ("handler_seconds", "shutdown_timeout"),
    [(0.3, 10.0), (1.5, 0.3)],
    ids=["in-flight-finish", "in-flight-released"],
)
def test_sigterm_mid_batch_loses_nothing(
    srv: EmbeddedServer, client: querator.Client, tmp_path: Path, handler_seconds: float, shutdown_timeout: float
) -> None:
    name = unique()
    client.create_queue(name, lease_timeout=timedelta(minutes=5))  # nothing may come back by expiry
    payloads = [f"p{i:03d}" for i in range(60)]
    client.produce(name, payloads)
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    record = tmp_path / "completed.txt"
    started = Path(str(record) + ".started")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, str(script), srv.address, name, str(record), str(handler_seconds), str(shutdown_timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        # Mid-batch: handlers are running and more items are buffered.
        wait_until(lambda: started.exists() and len(started.read_text().split()) >= 4, timeout=20)
        wait_until(lambda: client.queue_stats(name).total_leased >= 5, timeout=10)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert out.startswith("stopped"), (out, err)

    completed = record.read_text().split() if record.exists() else []
    remaining = list(client.list_items(name, page_size=1000))
    assert not any(item.is_leased for item in remaining)  # released, not left to expire
    back = [item.payload.decode() for item in remaining]
    assert len(completed) == len(set(completed))
    assert set(completed).isdisjoint(back)
    assert sorted(completed + back) == payloads  # every item either completed or back in the queue
    if handler_seconds < shutdown_timeout:
        assert len(completed) >= 4  # the in-flight handlers were allowed to finish
    else:
        assert completed == []  # too slow for the shutdown timeout: released unfinished



EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    import querator

    address, queue, stop = sys.argv[1:4]
    # Events, not sleeps, order the lines: on a loaded machine the slow handler once had
    # not started within the main's 0.5 s, or main's stop took longer than its 2 s.
    started, main_ended = threading.Event(), threading.Event()

    def handler(item):
        if item.text == "slow":
            started.set()
            main_ended.wait(30)  # still running when the main ends (a stop that waited for it: 30 s)
            time.sleep(0.5)
            print("slow handler finished", flush=True)

    client = querator.Client(address)
    worker = querator.Worker(client, queue, handler, concurrency=4, shutdown_timeout=0.2, handle_signals=False)
    worker.start()
    assert started.wait(30), "the slow handler did not start"
    time.sleep(0.5)
    if stop == "stop":
        worker.stop()  # gives up on the slow handler after 0.2 s; its thread runs on
    print("main ends", flush=True)
    main_ended.set()
    """
)


@pytest.mark.parametrize("stop", ["stop", "no-stop"])
def test_a_program_ends_after_its_sync_handlers(srv: EmbeddedServer, client: querator.Client, stop: str) -> None:
    """Python waits for a sync handler still running when the program ends (its thread
    cannot be stopped), and for nothing else: idle handler threads do not hold it up."""
    name = unique()
    client.create_queue(name)
    client.produce(name, ["slow"] + ["quick"] * 20)
    done = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, srv.address, name, stop], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["main ends", "slow handler finished"], done.stdout
