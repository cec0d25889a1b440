"""Hard time limits: a task run with executor="process" is killed at its time_limit, so
its side effect never happens; on a thread (handler_timeout) the limit is soft and the
side effect happens anyway. On a real server; the tasks live in sdk_tasks.py, where the
child processes find them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import sdk_tasks

import querator
from querator.embedded import EmbeddedServer

from sdk_helpers import client, run_until_empty, srv, unique, wait_until  # noqa: F401 (fixtures)

given_up: list[float] = []


def _dead_reasons(client: querator.Client) -> tuple[querator.Worker, list[str]]:
    reasons: list[str] = []

    class Hooks(querator.WorkerHooks):
        def on_dead(self, item: querator.AnyLeasedItem, error: BaseException | None) -> None:
            reasons.append(f"{item.kind}: {type(error).__name__}: {error}")
            given_up.append(time.time())

    worker = querator.Worker(client, sdk_tasks.QUEUE, handle_signals=False, hooks=Hooks(), concurrency=4)
    worker.include(sdk_tasks.tasks)
    return worker, reasons


def test_past_its_time_limit_a_process_task_is_killed_and_its_side_effect_never_happens(
    client: querator.Client, tmp_path: Path
) -> None:
    dlq = "hard-limits-dlq"
    client.create_queue(dlq)
    client.create_queue(sdk_tasks.QUEUE, dead_queue=dlq, max_attempts=5)
    sdk_tasks.tasks.client = client
    killed, quick = tmp_path / "killed", tmp_path / "quick"
    sdk_tasks.write_after.send(path=str(killed), seconds=3)  # past time_limit=1
    sdk_tasks.write_after.send(path=str(quick), seconds=0)  # well within
    worker, reasons = _dead_reasons(client)
    began = time.monotonic()
    run_until_empty(worker)
    took = time.monotonic() - began
    assert quick.exists(), (worker.stats, reasons)  # the same function ran to its end in a child process
    assert int(quick.read_text()) != os.getpid()
    # Dead-lettered (the kind's max_attempts=1) with the time limit as its reason, and
    # without waiting for the handler's 3 s.
    assert reasons == ["killed: TimeLimitExceeded: time limit: the handler ran past 1s and its process was killed"]
    assert worker.stats.dead == 1 and worker.stats.timed_out == 1 and worker.stats.completed == 1
    (letter,) = client.list_items(dlq)
    assert letter.kind == "killed"
    # The dead letter says so too: the kill's text, first line first.
    assert letter.last_error.splitlines()[0] == (
        "querator.errors.TimeLimitExceeded: time limit: the handler ran past 1s and its process was killed"
    )
    # No bound on `took`: under load the pool's start-up alone can take seconds. What
    # shows the kill is the side effect: past the moment the handler would have
    # written (3 s after it began, so before `began + 3.5`), had it lived.
    time.sleep(max(0.0, 3.5 - took))
    assert not killed.exists()


def test_on_a_thread_the_limit_is_soft_and_the_side_effect_happens_anyway(client: querator.Client, tmp_path: Path) -> None:
    """What executor="process" is for: the same work abandoned at handler_timeout on a
    thread runs on and writes after its item was given up."""
    client.create_queue(sdk_tasks.QUEUE, max_attempts=5)
    sdk_tasks.tasks.client = client
    late = tmp_path / "late"
    sdk_tasks.write_after_on_a_thread.send(path=str(late), seconds=2)
    given_up.clear()
    worker, reasons = _dead_reasons(client)
    run_until_empty(worker)
    assert reasons == ["abandoned: HandlerTimeout: the handler ran past handler_timeout (1s) and was abandoned"]
    wait_until(late.exists, timeout=10)
    assert late.stat().st_mtime > given_up[0]  # written after its item was given up


def test_a_process_tasks_error_crosses_back_and_children_are_reused(client: querator.Client, tmp_path: Path) -> None:
    dlq = "hard-limits-dlq"
    client.create_queue(dlq)
    client.create_queue(sdk_tasks.QUEUE, dead_queue=dlq, max_attempts=5)
    sdk_tasks.tasks.client = client
    sdk_tasks.refuse.send(reason="no funds")
    pids = tmp_path / "pids"
    for _ in range(20):
        sdk_tasks.note_pid.send(path=str(pids))
    worker, reasons = _dead_reasons(client)
    run_until_empty(worker)
    assert reasons == ["refused: Refused: no funds"]  # the kind's dead_on, with the child's exception
    # The dead letter's error has the child's frames: the handler that raised is the last.
    (letter,) = [i for i in client.list_items(dlq) if i.kind == "refused"]
    assert letter.last_error.startswith("sdk_tasks.Refused: no funds\nTraceback (most recent call last):\n")
    assert letter.last_error.rstrip().endswith("raise Refused(reason)") and ", in refuse\n" in letter.last_error
    assert worker.stats.completed == 20
    children = set(pids.read_text().split())
    assert 1 <= len(children) <= 4  # at most concurrency children, kept for the next call


APP = textwrap.dedent(
    """
    import os, time
    import querator

    tasks = querator.Tasks(os.environ["QUEUE"])

    @tasks.task("slow", executor="process", time_limit=1, max_attempts=1)
    def slow(seconds: float) -> None:
        time.sleep(seconds)
        print(f"slow done after {seconds}s", flush=True)

    settings = querator.WorkerSettings(tasks=tasks)
    """
)


def test_the_runner_runs_process_tasks_of_a_module_it_imported(srv: EmbeddedServer, client: querator.Client, tmp_path: Path) -> None:
    """The children find the task in the module the runner imported from the current
    directory (the fork server has the runner's sys.path)."""
    name = unique()
    client.create_queue(name)
    client.produce(name, ['{"seconds": 0}', '{"seconds": 3}'], kind="slow")
    (tmp_path / "app.py").write_text(APP)
    result = subprocess.run(
        [str(Path(sys.executable).with_name("querator")), "--address", srv.address, "worker", "app:settings", "--burst", "--json"],
        cwd=tmp_path, env=dict(os.environ, QUEUE=name), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout.splitlines()[-1])
    assert (stats["completed"], stats["dead"], stats["failures"]) == (1, 1, {"TimeLimitExceeded": 1}), stats
    assert "slow done after 0s" in result.stdout and "slow done after 3s" not in result.stdout
