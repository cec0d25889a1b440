"""Periodic jobs (querator.Periodic): every worker produces each tick, the server keeps
one (idempotency key ``name@tick``); missed ticks are produced only when asked. On a
real server, with real worker processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import querator
from querator._worker.periodic import TICK_KEY
from querator.embedded import EmbeddedServer

from sdk_helpers import client, run, srv, unique, wait_until  # noqa: F401 (fixtures)

APP = textwrap.dedent(
    """
    import os
    from datetime import timedelta

    import querator

    RECORD = os.environ["RECORD"]
    tasks = querator.Tasks(os.environ["QUEUE"])

    @tasks.task("tick")
    def tick(schedule: str) -> None:
        item = querator.current_item()
        with open(RECORD, "a") as f:  # one short append per line: whole lines from each process
            f.write(f"{schedule} {item.metadata['querator-tick']} {os.getpid()}\\n")

    settings = querator.WorkerSettings(
        tasks=tasks,
        periodic=[
            querator.Periodic(name="every-second", every=timedelta(seconds=1), task=tick, kwargs={"schedule": "every"}),
            querator.Periodic(name="cron-second", cron="* * * * * *", task=tick, kwargs={"schedule": "cron"}),
        ],
    )
    """
)

QUERATOR = str(Path(sys.executable).with_name("querator"))


def _ticks(record: Path) -> list[tuple[str, datetime, str]]:
    if not record.exists():
        return []
    out = []
    for line in record.read_text().splitlines():
        schedule, tick, pid = line.split()
        out.append((schedule, datetime.fromisoformat(tick), pid))
    return out


def test_three_workers_produce_each_tick_once_and_none_from_before_they_ran(
    srv: EmbeddedServer, client: querator.Client, tmp_path: Path
) -> None:
    name = unique()
    client.create_queue(name)
    (tmp_path / "app.py").write_text(APP)
    record = tmp_path / "record"
    env = dict(os.environ, RECORD=str(record), QUEUE=name, PYTHONUNBUFFERED="1")
    started = datetime.now(UTC)
    procs = [
        subprocess.Popen(
            [QUERATOR, "--address", srv.address, "worker", "app:settings", "--log-level", "WARNING"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for _ in range(3)
    ]
    try:
        # Each worker handles ticks (so each runs); then a few more seconds with all three.
        wait_until(lambda: len({pid for _, _, pid in _ticks(record)}) == 3, timeout=60, interval=0.2)
        all_running = datetime.now(UTC)
        wait_until(lambda: max(t for _, t, _ in _ticks(record)) >= all_running + timedelta(seconds=4), timeout=30)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        outputs = [proc.communicate(timeout=60) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], outputs
    ticks = _ticks(record)
    for schedule in ("every", "cron"):
        mine = sorted(t for s, t, _ in ticks if s == schedule)
        counts = Counter(mine)
        assert max(counts.values()) == 1, [str(t) for t, n in counts.items() if n > 1]  # no tick twice
        assert mine[0] > started  # nothing from before the first worker ran (no back-fill)
        # Every second from the first to the last, none missed: the clock ticked each second.
        assert all(b - a == timedelta(seconds=1) for a, b in zip(mine, mine[1:])), [str(t) for t in mine]
        assert len(mine) >= 5
        assert all(t.microsecond == 0 for t in mine)


def test_catch_up_produces_recent_missed_ticks_once_and_without_it_none(srv: EmbeddedServer) -> None:
    work, target = unique(), unique("ticks")  # ticks go to a queue nobody consumes

    async def worker_for(aclient: querator.AsyncClient, job: querator.Periodic, seconds: float) -> None:
        worker = querator.AsyncWorker(aclient, work, handle_signals=False)

        @worker.handler("")
        async def noop(item: querator.AsyncLeasedItem) -> None: ...

        worker.schedule(job)
        async with worker:
            await asyncio.sleep(seconds)

    async def main() -> tuple[datetime, datetime, list[datetime]]:
        async with querator.AsyncClient(srv.address) as aclient:
            await aclient.create_queue(work)
            await aclient.create_queue(target)
            job = querator.Periodic(
                name="report", every=timedelta(seconds=1), kind="report", queue=target, catch_up=timedelta(seconds=4)
            )
            began = datetime.now(UTC)
            await worker_for(aclient, job, 1.5)
            await worker_for(aclient, job, 1.5)  # a second worker later: the same window, nothing twice
            ticks = sorted([datetime.fromisoformat(i.metadata[TICK_KEY]) async for i in aclient.list_items(target)])
            assert ticks[0] <= began - timedelta(seconds=3)  # back-filled
            keys = Counter(ticks)
            assert max(keys.values()) == 1
            assert all(b - a == timedelta(seconds=1) for a, b in zip(ticks, ticks[1:]))
            # Without catch_up: only ticks after the worker started.
            plain = querator.Periodic(name="plain", every=timedelta(seconds=1), kind="plain", queue=target)
            began = datetime.now(UTC)
            await worker_for(aclient, plain, 2.5)
            ended = datetime.now(UTC)
            ticks = [datetime.fromisoformat(i.metadata[TICK_KEY]) async for i in aclient.list_items(target) if i.kind == "plain"]
            return began, ended, ticks

    began, ended, plain_ticks = run(main(), timeout=60)
    # Only ticks due while the worker ran (its stop, slow on a loaded machine, included):
    # none before it started, at most one per whole second it ran through.
    whole_seconds = int(ended.timestamp()) - int(began.timestamp())
    assert 1 <= len(plain_ticks) <= whole_seconds, (began, ended, plain_ticks)
    assert all(began < t <= ended for t in plain_ticks), (began, ended, plain_ticks)
    assert len(set(plain_ticks)) == len(plain_ticks)
    assert all(t.microsecond == 0 for t in plain_ticks)


def test_a_tick_carries_its_key_and_the_schedule_is_checked_when_made() -> None:
    job = querator.Periodic(name="nightly", cron="0 3 * * *", kind="cleanup", payload=b"x")
    tick = job.next_tick(datetime(2030, 5, 1, 12, 0, tzinfo=UTC))
    assert tick == datetime(2030, 5, 2, 3, 0, tzinfo=UTC)
    item = job.item(tick)
    assert item.idempotency_key == "nightly@2030-05-02T03:00:00.000000+00:00"
    assert (item.kind, item.payload, item.metadata[TICK_KEY]) == ("cleanup", b"x", "2030-05-02T03:00:00.000000+00:00")
    every = querator.Periodic(name="p", every=timedelta(minutes=5), kind="k")
    assert every.next_tick(datetime(2030, 5, 1, 12, 4, 59, tzinfo=UTC)) == datetime(2030, 5, 1, 12, 5, tzinfo=UTC)
    assert every.next_tick(datetime(2030, 5, 1, 12, 5, tzinfo=UTC)) == datetime(2030, 5, 1, 12, 10, tzinfo=UTC)
    with pytest.raises(ValueError, match="bad cron expression"):
        querator.Periodic(name="bad", cron="61 * * * *", kind="k")
    with pytest.raises(ValueError, match="give cron or every"):
        querator.Periodic(name="both", cron="* * * * *", every=60, kind="k")
    with pytest.raises(ValueError, match="without '@'"):
        querator.Periodic(name="a@b", every=60, kind="k")
    with pytest.raises(ValueError, match="at least 1 second"):
        querator.Periodic(name="fast", every=0.5, kind="k")
    tasks = querator.Tasks("q")

    @tasks.task("t")
    def t(n: int) -> None: ...

    with pytest.raises(TypeError, match="task 't'"):
        querator.Periodic(name="args", every=60, task=t, kwargs={"m": 1})
    worker = querator.Worker(querator.Client("127.0.0.1:1"), "q")
    worker.schedule(every)
    with pytest.raises(ValueError, match="names must differ"):
        worker.schedule(every)


def test_a_periodic_task_goes_to_its_registrys_queue(srv: EmbeddedServer) -> None:
    work, reports = unique(), unique("reports")
    tasks = querator.Tasks(reports)

    @tasks.task("report")
    def report(day: str) -> None: ...

    async def main() -> list[str]:
        async with querator.AsyncClient(srv.address) as aclient:
            await aclient.create_queue(work)
            await aclient.create_queue(reports)
            worker = querator.AsyncWorker(aclient, work, handle_signals=False)

            @worker.handler("")
            async def noop(item: querator.AsyncLeasedItem) -> None: ...

            worker.schedule(querator.Periodic(name="daily", every=1, task=report, kwargs={"day": "today"}))
            async with worker:
                await asyncio.sleep(2.2)
            return [i.kind async for i in aclient.list_items(reports)]

    kinds = run(main(), timeout=30)
    assert kinds and set(kinds) == {"report"}
