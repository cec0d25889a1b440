"""Tasks by name (querator.Tasks), options per kind (querator.Kind) and worker settings
(querator.WorkerSettings, `querator worker MODULE:SETTINGS`); all on a real server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgpack
import pytest

import querator
from querator.embedded import EmbeddedServer

from sdk_helpers import client, run, run_until_empty, srv, unique, wait_until  # noqa: F401 (fixtures)

FAST = querator.Backoff(initial=timedelta(milliseconds=1), maximum=timedelta(milliseconds=1), jitter=0)


# -- tasks by name ------------------------------------------------------------------------


def test_a_task_is_produced_by_name_with_json_arguments_and_run_by_the_worker(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    tasks = querator.Tasks(name, client=client)
    got: list[tuple[str, str, int]] = []

    @tasks.task("email")
    def send_email(to: str, subject: str, retries: int = 0) -> None:
        got.append((to, subject, querator.current_item().attempts))

    ids = [send_email.send(to="a@example.com", subject="hi"), tasks.send("email", to="b@example.com", subject="yo")]
    stored = {i.id: i for i in client.list_items(name)}
    assert sorted(stored) == sorted(ids)
    first = stored[ids[0]]
    assert (first.kind, first.encoding) == ("email", "application/json")
    assert json.loads(first.payload) == {"to": "a@example.com", "subject": "hi"}  # any language can produce it
    with pytest.raises(LookupError, match="called from a task's function"):
        send_email("direct@example.com", "called")  # still the function; no item outside a worker

    worker = querator.Worker(client, name, handle_signals=False)
    worker.include(tasks)
    run_until_empty(worker)
    assert sorted(got) == [("a@example.com", "hi", 1), ("b@example.com", "yo", 1)]
    assert worker.stats.completed == 2


def test_an_unknown_kind_or_bad_arguments_are_refused_before_anything_is_produced(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    tasks = querator.Tasks(name, client=client)

    @tasks.task("email")
    def send_email(to: str, subject: str) -> None: ...

    with pytest.raises(querator.UnknownTask, match=r"no task of kind 'emial' on queue .* \(known: email\)"):
        tasks.send("emial", to="a@example.com", subject="hi")
    with pytest.raises(TypeError, match="task 'email': .*'subject'"):
        send_email.send(to="a@example.com")
    with pytest.raises(TypeError, match="keyword arguments only"):
        send_email.send("a@example.com", "hi")
    with pytest.raises(ValueError, match="registered already"):
        tasks.task("email")(send_email.function)
    with pytest.raises(ValueError, match="timezone-aware"):
        send_email.send_at(datetime(2030, 1, 1), to="a", subject="b")  # noqa: DTZ001
    assert client.queue_stats(name).total == 0
    # A worker on another queue cannot take these tasks.
    with pytest.raises(ValueError, match="the tasks are for queue"):
        querator.Worker(client, unique()).include(tasks)


def test_a_payload_that_does_not_fit_the_task_is_dead_lettered_without_calling_it(client: querator.Client) -> None:
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq, max_attempts=5)
    tasks = querator.Tasks(name)
    called: list[object] = []

    @tasks.task("email")
    def send_email(to: str) -> None:
        called.append(to)

    client.produce(name, ["not json", '{"too": "a"}', "[1, 2]"], kind="email")  # by hand, as another program might
    dead: list[str] = []

    class Hooks(querator.WorkerHooks):
        def on_dead(self, item: object, error: BaseException | None) -> None:
            dead.append(str(error))

    worker = querator.Worker(client, name, handle_signals=False, hooks=Hooks())
    worker.include(tasks)
    run_until_empty(worker)
    assert called == []
    assert len(list(client.list_items(dlq))) == 3 and worker.stats.dead == 3 and worker.stats.retried == 0
    assert all(reason.startswith("task 'email': bad arguments in the payload") for reason in dead), dead


def test_async_tasks_enqueue_and_enqueue_at_with_msgpack_and_bytes_codecs(srv: EmbeddedServer) -> None:
    name = unique()
    got: list[tuple[str, object]] = []

    async def main() -> None:
        async with querator.AsyncClient(srv.address) as aclient:
            await aclient.create_queue(name)
            tasks = querator.Tasks(name, client=aclient)

            @tasks.task("thumb", codec="msgpack")
            async def thumbnail(image: bytes, width: int) -> None:
                got.append(("thumb", (image, width)))

            @tasks.task("raw", codec="bytes")
            def raw(data: bytes) -> None:  # a sync task on an AsyncWorker: on a thread
                got.append(("raw", data))

            await thumbnail.enqueue(image=b"\x89PNG\x00", width=64)
            await raw.enqueue(b"\x00\x01\x02")
            later = await thumbnail.enqueue_at(datetime.now(UTC) + timedelta(seconds=1), image=b"later", width=8)
            [stored_later] = [i async for i in aclient.list_scheduled_items(name)]
            assert stored_later.id == later and stored_later.encoding == "application/msgpack"
            assert msgpack.unpackb(stored_later.payload) == {"image": b"later", "width": 8}
            with pytest.raises(TypeError, match="one positional bytes argument"):
                await raw.enqueue("text")  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="blocks: it needs a querator.Client"):
                raw.send(b"x")
            worker = querator.AsyncWorker(aclient, name, handle_signals=False)
            worker.include(tasks)
            await worker.run(until_empty=True)  # waits for the scheduled one too
            assert worker.stats.completed == 3

    run(main(), timeout=60)
    assert sorted(got, key=repr) == sorted(
        [("thumb", (b"\x89PNG\x00", 64)), ("raw", b"\x00\x01\x02"), ("thumb", (b"later", 8))], key=repr
    )


def test_a_task_registry_needs_a_client_to_produce() -> None:
    tasks = querator.Tasks("jobs")

    @tasks.task("noop")
    def noop() -> None: ...

    with pytest.raises(RuntimeError, match="has no client"):
        noop.send()
    with pytest.raises(ValueError, match="codec is 'json', 'msgpack', 'bytes' or a Codec"):
        tasks.task("x", codec="yaml")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="executor='process' runs the sync function of a task"):

        @tasks.task("y", executor="process")
        async def not_in_a_process() -> None: ...


# -- options per kind ---------------------------------------------------------------------


def test_options_per_kind_override_the_workers(client: querator.Client) -> None:
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq, max_attempts=10)
    client.produce(name, [f"s{i}" for i in range(8)], kind="serial")
    client.produce(name, ["v1"], kind="strict")  # ValueError: dead at once for this kind only
    client.produce(name, ["v2"], kind="lenient")  # ValueError: retried (the worker's default)
    client.produce(name, ["t1"], kind="twice")  # dead after its kind's max_attempts
    running, most = [0], [0]
    lock = threading.Lock()
    attempts: Counter[str] = Counter()

    def serial(item: querator.LeasedItem) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1

    def fail(item: querator.LeasedItem) -> None:
        attempts[item.text] += 1
        if item.text == "v2" and item.attempts >= 2:
            return
        raise ValueError(item.text)

    settings = querator.WorkerSettings(
        queue=name,
        handlers={
            "serial": querator.Kind(serial, concurrency=1),
            "strict": querator.Kind(fail, dead_on=[ValueError]),
            "lenient": fail,
            "twice": querator.Kind(fail, max_attempts=2, retry_backoff=FAST),
        },
        options=querator.WorkerOptions(concurrency=8, retry_backoff=FAST, handle_signals=False),
    )
    worker = settings.worker(client)
    run_until_empty(worker)
    assert most[0] == 1  # the kind's concurrency, within the worker's 8
    assert attempts == Counter({"v1": 1, "v2": 2, "t1": 2})
    assert sorted(i.payload for i in client.list_items(dlq)) == [b"t1", b"v1"]
    assert worker.stats.completed == 9


def test_a_kinds_handler_timeout_applies_to_it_alone(srv: EmbeddedServer) -> None:
    name = unique()
    timed_out: list[str] = []

    async def main() -> None:
        async with querator.AsyncClient(srv.address) as aclient:
            await aclient.create_queue(name, max_attempts=1)
            await aclient.produce(name, ["q"], kind="quick")
            await aclient.produce(name, ["s"], kind="slow")

            class Hooks(querator.WorkerHooks):
                def on_dead(self, item: querator.AnyLeasedItem, error: BaseException | None) -> None:
                    timed_out.append(f"{item.text}: {type(error).__name__}")

            worker = querator.AsyncWorker(aclient, name, handle_signals=False, hooks=Hooks(), handler_timeout=30)

            @worker.handler("quick", handler_timeout=0.2)
            async def quick(item: querator.AsyncLeasedItem) -> None:
                await asyncio.sleep(5)

            @worker.handler("slow")
            async def slow(item: querator.AsyncLeasedItem) -> None:
                await asyncio.sleep(0.5)  # within the worker's 30 s

            await worker.run(until_empty=True)
            assert worker.stats.timed_out == 1 and worker.stats.completed == 1

    run(main(), timeout=30)
    assert timed_out == ["q: HandlerTimeout"]


def test_kind_options_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="time_limit needs executor='process'"):
        querator.KindOptions(time_limit=1)
    with pytest.raises(ValueError, match="concurrency must be at least 1"):
        querator.Kind(print, concurrency=0)
    with pytest.raises(ValueError, match="both retry_on and dead_on"):
        querator.Kind(print, retry_on=[KeyError], dead_on=[KeyError])
    with pytest.raises(ValueError, match="handler_timeout must be positive"):
        querator.KindOptions(handler_timeout=0)
    with pytest.raises(ValueError, match="time_limit must be positive"):
        querator.KindOptions(executor="process", time_limit=0)
    with pytest.raises(ValueError, match="executor is 'thread' or 'process'"):
        querator.KindOptions(executor="fork")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="executor='process' runs the sync function of a task"):
        querator.Worker(querator.Client("127.0.0.1:1"), "q").handler("x", executor="process")(print)
    with pytest.raises(ValueError, match="needs a queue"):
        querator.WorkerSettings(handler=print)
    with pytest.raises(ValueError, match="no handler"):
        querator.WorkerSettings(queue="q")


# -- `querator worker MODULE:SETTINGS` ------------------------------------------------------

APP = textwrap.dedent(
    """
    import os, time
    from datetime import timedelta
    import querator

    RECORD = os.environ["RECORD"]
    tasks = querator.Tasks(os.environ["QUEUE"])

    class Invalid(Exception):
        pass

    @tasks.task("email", concurrency=2)
    def send_email(to, subject):
        with open(RECORD, "a") as f:
            f.write(f"email {to} {subject}\\n")

    @tasks.task("check")
    def check(value):
        if value < 0:
            raise Invalid(value)

    def slow(item):
        time.sleep(1.5 if item.attempts == 1 else 0)

    settings = querator.WorkerSettings(
        tasks=tasks,
        handlers={"slow": slow},
        options=querator.WorkerOptions(concurrency=4, dead_on=[Invalid], retry_backoff=querator.Backoff(timedelta(0), timedelta(0), jitter=0)),
    )
    """
)

QUERATOR = str(Path(sys.executable).with_name("querator"))


def _runner(srv: EmbeddedServer, tmp_path: Path, queue: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "app.py").write_text(APP)
    return subprocess.run(
        [QUERATOR, "--address", srv.address, "worker", "app:settings", "--burst", "--json", *args],
        cwd=tmp_path, env=dict(os.environ, RECORD=str(tmp_path / "record"), QUEUE=queue),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_runner_runs_settings_from_code_and_flags_override_them(
    srv: EmbeddedServer, client: querator.Client, tmp_path: Path
) -> None:
    name, dlq = unique(), unique("dlq")
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq, max_attempts=5)
    producer = querator.Tasks(name, client=client)  # the producer's side knows only the kinds

    @producer.task("email")
    def send_email(to: str, subject: str) -> None: ...

    @producer.task("check")
    def check(value: int) -> None: ...

    send_email.send(to="a@example.com", subject="hi")
    check.send(value=-1)  # Invalid: dead_on of the settings
    check.send(value=1)
    client.produce(name, ["s"], kind="slow")
    result = _runner(srv, tmp_path, name)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert (stats["completed"], stats["dead"], stats["timed_out"]) == (3, 1, 0), stats
    assert stats["failures"] == {"Invalid": 1}
    assert (tmp_path / "record").read_text() == "email a@example.com hi\n"
    assert [i.payload for i in client.list_items(dlq)] == [b'{"value":-1}']
    assert "worker on queue " + name in result.stderr

    # --handler-timeout overrides the settings (none): the slow handler's first try is given up.
    client.produce(name, ["s"], kind="slow")
    result = _runner(srv, tmp_path, name, "--handler-timeout", "0.3", "--concurrency", "1")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert (stats["timed_out"], stats["retried"], stats["completed"]) == (1, 1, 1), stats
    assert "concurrency 1" in result.stderr

    # Settings hold their queue: --queue cannot move their tasks elsewhere.
    result = _runner(srv, tmp_path, name, "--queue", "elsewhere")
    assert result.returncode != 0 and "the settings' tasks are for queue" in result.stderr


TWO_QUEUES = textwrap.dedent(
    """
    import os
    import querator

    RECORD = os.environ["RECORD"]

    def note(item):
        with open(RECORD, "a") as f:
            f.write(f"{item.queue_name} {item.text}\\n")

    settings = [
        querator.WorkerSettings(queue=os.environ["QUEUE_A"], handler=note),
        querator.WorkerSettings(queue=os.environ["QUEUE_B"], handler=note, options=querator.WorkerOptions(concurrency=2)),
    ]
    """
)


def test_the_runner_runs_a_list_of_settings_one_worker_per_queue(
    srv: EmbeddedServer, client: querator.Client, tmp_path: Path
) -> None:
    a, b = unique("a"), unique("b")
    client.create_queue(a)
    client.create_queue(b)
    client.produce(a, ["a1", "a2"])
    client.produce(b, ["b1"])
    (tmp_path / "two.py").write_text(TWO_QUEUES)
    record = tmp_path / "record"
    env = dict(os.environ, RECORD=str(record), QUEUE_A=a, QUEUE_B=b)
    command = [QUERATOR, "--address", srv.address, "worker", "two:settings", "--json"]
    result = subprocess.run([*command, "--burst"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(record.read_text().splitlines()) == [f"{a} a1", f"{a} a2", f"{b} b1"]
    assert [(s["queue"], s["completed"]) for s in json.loads(result.stdout)] == [(a, 2), (b, 1)]

    # Until SIGTERM: it stops both workers gracefully.
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client.produce(b, ["b2"])
        wait_until(lambda: f"{b} b2" in record.read_text(), timeout=30)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert [(s["queue"], s["completed"]) for s in json.loads(out)] == [(a, 0), (b, 1)]
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([*command, "--queue", a], cwd=tmp_path, env=env, capture_output=True, check=True, timeout=60)


def test_enqueue_with_a_blocking_client_and_settings_for_an_async_worker(srv: EmbeddedServer, client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    tasks = querator.Tasks(name, client=client)  # a blocking client: enqueue() runs it off the loop
    got: list[int] = []

    @tasks.task("add")
    async def add(a: int, b: int) -> None:
        got.append(a + b)

    async def main() -> None:
        await add.enqueue(a=1, b=2)
        await tasks.enqueue("add", a=3, b=4)
        async with querator.AsyncClient(srv.address) as aclient:
            worker = querator.WorkerSettings(tasks=tasks, options=querator.WorkerOptions(handle_signals=False)).async_worker(
                aclient
            )
            await worker.run(until_empty=True)

    run(main(), timeout=30)
    assert sorted(got) == [3, 7]
