"""Worker features: burst mode, failure logs, handler time limit, keep-alive cap,
retry rules per exception, dispatch by kind and Prometheus metrics; all on a real server."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from datetime import timedelta

import pytest

import querator
from querator._worker.failures import LOG_BURST, FailureLog
from querator.embedded import EmbeddedServer

from sdk_helpers import client, run, run_until_empty, srv, unique, wait_until  # noqa: F401 (fixtures)

FAST = querator.Backoff(initial=timedelta(milliseconds=1), maximum=timedelta(milliseconds=1), jitter=0)
NEVER = querator.Backoff(initial=timedelta(hours=1), maximum=timedelta(hours=1), jitter=0)


# -- burst mode -------------------------------------------------------------------------


def test_until_empty_waits_for_scheduled_retries(client: querator.Client) -> None:
    """``queue_stats().total`` is 0 while failed items wait to be retried (scheduled);
    burst mode waits for them and handles them too."""
    name = unique()
    client.create_queue(name, max_attempts=5)
    client.produce(name, [f"job-{i}" for i in range(20)])
    done: Counter[str] = Counter()
    retry = querator.Backoff(initial=timedelta(seconds=1.5), maximum=timedelta(seconds=1.5), jitter=0)

    def handle(item: querator.LeasedItem) -> None:
        if item.attempts == 1 and item.text.endswith(("3", "7")):
            raise RuntimeError("first attempt fails")
        done[item.text] += 1

    worker = querator.Worker(client, name, handle, concurrency=4, retry_backoff=retry, handle_signals=False)
    run_until_empty(worker)
    assert set(done) == {f"job-{i}" for i in range(20)} and max(done.values()) == 1
    assert worker.stats.retried == 4 and worker.stats.completed == 20
    stats = client.queue_stats(name)
    assert (stats.total, stats.scheduled) == (0, 0)


def test_until_empty_waits_for_items_leased_elsewhere(client: querator.Client) -> None:
    """An item leased by another consumer may come back: burst mode waits for it."""
    name = unique()
    client.create_queue(name, lease_timeout=timedelta(seconds=2))
    client.produce(name, ["held elsewhere"])
    [taken] = client.lease(name, batch_size=1, wait=5)  # never completed: expires in 2 s
    seen: list[tuple[str, int]] = []
    worker = querator.Worker(client, name, lambda item: seen.append((item.text, item.attempts)), handle_signals=False)
    elapsed = run_until_empty(worker)
    assert seen == [("held elsewhere", 2)]
    assert elapsed >= 1.0  # it did not return while the item was leased by the other consumer
    assert client.queue_stats(name).total == 0


def test_async_worker_until_empty(srv: EmbeddedServer) -> None:
    async def main() -> tuple[int, int]:
        async with srv.async_client() as aclient:
            name = unique()
            await aclient.create_queue(name)
            await aclient.produce(name, [f"a{i}" for i in range(50)])
            handled: list[str] = []

            async def handle(item: querator.AsyncLeasedItem) -> None:
                handled.append(item.text)

            worker = querator.AsyncWorker(aclient, name, handle, concurrency=8, handle_signals=False)
            await asyncio.wait_for(worker.run(until_empty=True), 30)
            return len(handled), (await aclient.queue_stats(name)).total

    assert run(main(), timeout=40) == (50, 0)


def test_until_empty_on_an_empty_queue_returns_at_once(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    worker = querator.Worker(client, name, lambda item: None, lease_wait=30, handle_signals=False)
    assert run_until_empty(worker, timeout=20) < 10  # not one lease_wait of 30 s
    assert worker.stats.leased == 0


# -- failure logs -----------------------------------------------------------------------


def _failing_handler(item: querator.LeasedItem) -> None:
    if item.text.startswith("v"):
        raise ValueError(f"bad {item.text}")
    raise KeyError(item.text)


def test_failure_logs_carry_a_traceback_rate_limited_per_type_and_counted(
    client: querator.Client, caplog: pytest.LogCaptureFixture
) -> None:
    name = unique()
    client.create_queue(name)
    client.produce(name, [f"v{i}" for i in range(10)] + ["k1", "k2"])
    caplog.set_level(logging.WARNING, logger="querator.worker")
    worker = querator.Worker(client, name, _failing_handler, concurrency=4, retry_backoff=NEVER, handle_signals=False)
    with worker:
        wait_until(lambda: worker.stats.retried == 12, timeout=20)
    assert worker.stats.failed == 12
    assert worker.stats.failures == Counter({"ValueError": 10, "KeyError": 2})
    failures = [r for r in caplog.records if r.getMessage().startswith("handler failed")]
    by_type = Counter(r.exc_info[1].__class__.__name__ for r in failures if r.exc_info)
    assert by_type == Counter({"ValueError": LOG_BURST, "KeyError": 2})  # the rest counted, not logged
    assert all(r.exc_info for r in failures)
    text = logging.Formatter().formatException(failures[0].exc_info)  # type: ignore[arg-type]
    assert "Traceback" in text and "_failing_handler" in text


def test_failure_log_reports_how_many_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="querator.worker")
    failures = FailureLog(burst=2, window=1.0)
    for n in range(7):
        try:
            raise ValueError(n)
        except ValueError as exc:
            failures.warning("failed %d", n, error=exc)
    time.sleep(1.05)
    try:
        raise ValueError("after the window")
    except ValueError as exc:
        failures.warning("failed %s", "late", error=exc)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["failed 0", "failed 1", "failed late (5 more ValueError not logged)"]


# -- handler time limit -----------------------------------------------------------------


def test_async_handler_past_its_time_limit_is_cancelled_and_retried(srv: EmbeddedServer) -> None:
    cancelled: list[int] = []
    attempts: list[int] = []

    async def main() -> querator.WorkerStats:
        async with srv.async_client() as aclient:
            name = unique()
            await aclient.create_queue(name)
            await aclient.produce(name, ["slow once"])

            async def handle(item: querator.AsyncLeasedItem) -> None:
                attempts.append(item.attempts)
                if item.attempts == 1:
                    try:
                        await asyncio.sleep(30)
                    except asyncio.CancelledError:
                        cancelled.append(item.attempts)
                        raise

            worker = querator.AsyncWorker(
                aclient, name, handle, handler_timeout=0.5, retry_backoff=FAST, handle_signals=False
            )
            await asyncio.wait_for(worker.run(until_empty=True), 30)
            return worker.stats

    stats = run(main(), timeout=40)
    assert attempts == [1, 2] and cancelled == [1]
    assert (stats.timed_out, stats.retried, stats.completed) == (1, 1, 1)
    assert stats.failures == Counter({"HandlerTimeout": 1})


def test_an_async_handlers_own_timeout_error_is_not_a_time_limit(srv: EmbeddedServer) -> None:
    async def main() -> querator.WorkerStats:
        async with srv.async_client() as aclient:
            name = unique()
            await aclient.create_queue(name)
            await aclient.produce(name, ["x"])

            async def handle(item: querator.AsyncLeasedItem) -> None:
                if item.attempts == 1:
                    raise TimeoutError("the handler's own")

            worker = querator.AsyncWorker(aclient, name, handle, handler_timeout=10, retry_backoff=FAST, handle_signals=False)
            await asyncio.wait_for(worker.run(until_empty=True), 30)
            return worker.stats

    stats = run(main(), timeout=40)
    assert stats.failures == Counter({"TimeoutError": 1}) and stats.timed_out == 0


def test_sync_handler_past_its_time_limit_is_abandoned_and_another_thread_takes_over(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    client.produce(name, ["stuck", "a", "b", "c"])
    release = threading.Event()
    handled: list[tuple[str, int]] = []

    def handle(item: querator.LeasedItem) -> None:
        if item.text == "stuck" and item.attempts == 1:
            release.wait(30)  # a thread cannot be stopped: it is given up on
            return
        handled.append((item.text, item.attempts))

    # concurrency=1: the others are handled only if a thread replaces the stuck one.
    worker = querator.Worker(
        client, name, handle, concurrency=1, handler_timeout=0.5, retry_backoff=FAST, handle_signals=False
    )
    try:
        run_until_empty(worker)
    finally:
        release.set()
    assert sorted(handled) == [("a", 1), ("b", 1), ("c", 1), ("stuck", 2)]
    assert worker.stats.timed_out == 1 and worker.stats.completed == 4


# -- keep-alive cap ---------------------------------------------------------------------


def test_keep_alive_stops_at_max_lease_duration(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name, lease_timeout=timedelta(seconds=2))
    client.produce(name, ["long"])
    started = threading.Event()
    release = threading.Event()

    def handle(item: querator.LeasedItem) -> None:
        started.set()
        release.wait(30)

    worker = querator.Worker(
        client, name, handle, concurrency=1, max_buffered=0, max_lease_duration=5, lease_wait=0.5, handle_signals=False
    )
    with worker:
        assert started.wait(10)
        began = time.monotonic()
        again: list[querator.LeasedItem] = []
        deadline = began + 20
        while not again and time.monotonic() < deadline:
            again = client.lease(name, batch_size=1, wait=0.5)
        back_after = time.monotonic() - began
        release.set()
    assert again and again[0].text == "long" and again[0].attempts == 2
    # Kept alive past its first lease of 2 s, then let go at the cap of 5 s.
    assert worker.stats.extended >= 2 and worker.stats.lease_capped == 1
    assert 3.0 <= back_after <= 5 + 2 + 4  # cap, plus one lease, plus slack for a busy machine
    again[0].complete()


def test_max_lease_duration_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_lease_duration"):
        querator.WorkerOptions(max_lease_duration=0)
    with pytest.raises(ValueError, match="handler_timeout"):
        querator.WorkerOptions(handler_timeout=-1)


# -- retry rules ------------------------------------------------------------------------


def test_retry_rules_per_exception(client: querator.Client) -> None:
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq, max_attempts=10)
    client.produce(name, ["value", "timeout", "connection", "key"])
    attempts: Counter[str] = Counter()

    def handle(item: querator.LeasedItem) -> None:
        attempts[item.text] += 1
        raise {"value": ValueError, "timeout": TimeoutError, "connection": ConnectionError, "key": KeyError}[item.text](
            item.text
        )

    worker = querator.Worker(
        client,
        name,
        handle,
        retry_backoff=NEVER,  # anything not named: retried in an hour
        retry_on=[querator.RetryRule(TimeoutError, backoff=FAST, max_attempts=3)],
        dead_on=(ValueError, OSError),  # TimeoutError is an OSError too: the more specific rule wins
        handle_signals=False,
    )
    with worker:
        wait_until(lambda: len(list(client.list_items(dlq))) == 3, timeout=20)
        wait_until(lambda: worker.stats.retried == 3, timeout=10)
    assert attempts == Counter({"value": 1, "connection": 1, "timeout": 3, "key": 1})
    assert sorted(i.payload for i in client.list_items(dlq)) == [b"connection", b"timeout", b"value"]
    [scheduled] = list(client.list_scheduled_items(name))
    assert scheduled.payload == b"key"  # the default: retry_backoff


def test_retry_rules_are_checked_when_made() -> None:
    with pytest.raises(ValueError, match="both retry_on and dead_on"):
        querator.WorkerOptions(retry_on=(KeyError,), dead_on=(KeyError,))
    with pytest.raises(TypeError):
        querator.RetryRule("ValueError")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dead_on takes exception classes"):
        querator.WorkerOptions(dead_on=("ValueError",))  # type: ignore[arg-type]
    # One class or rule alone stands for a sequence of one.
    policy = querator.WorkerOptions(retry_on=KeyError, dead_on=LookupError).failure_rules()
    assert policy.decide(KeyError()).dead is False and policy.decide(IndexError()).dead is True


# -- dispatch by kind -------------------------------------------------------------------


def test_dispatch_by_kind_with_sync_and_async_handlers(client: querator.Client) -> None:
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq)
    client.produce(name, ["e1", "e2"], kind="email")
    client.produce(name, ["s1"], kind="sms")
    client.produce(name, ["f1"], kind="fax")
    got: list[tuple[str, str, str]] = []
    dead: list[str] = []

    class Hooks(querator.WorkerHooks):
        def on_dead(self, item: object, error: BaseException | None) -> None:
            dead.append(str(error))

    worker = querator.Worker(client, name, handle_signals=False, hooks=Hooks())

    @worker.handler("email")
    def email(item: querator.LeasedItem) -> None:
        got.append(("email", item.text, type(item).__name__))

    @worker.handler("sms")
    async def sms(item: querator.AsyncLeasedItem) -> None:
        got.append(("sms", item.text, type(item).__name__))

    with pytest.raises(ValueError, match="registered already"):
        worker.handler("sms")(email)
    run_until_empty(worker)
    assert sorted(got) == [("email", "e1", "LeasedItem"), ("email", "e2", "LeasedItem"), ("sms", "s1", "AsyncLeasedItem")]
    assert [i.payload for i in client.list_items(dlq)] == [b"f1"]
    assert dead == ["no handler for kind 'fax'"]
    assert worker.stats.dead == 1 and worker.stats.completed == 3
    with pytest.raises(RuntimeError, match="before the worker runs"):
        worker.handler("late")(email)


def test_a_default_handler_takes_the_kinds_not_registered(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    client.produce(name, ["a"], kind="known")
    client.produce(name, ["b"], kind="other")
    client.produce(name, ["c"])
    got: list[tuple[str, str]] = []
    worker = querator.Worker(client, name, lambda item: got.append(("default", item.text)), handle_signals=False)
    worker.handler("known")(lambda item: got.append(("known", item.text)))
    run_until_empty(worker)
    assert sorted(got) == [("default", "b"), ("default", "c"), ("known", "a")]


def test_a_worker_without_handlers_does_not_start(client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    with pytest.raises(ValueError, match="no handler"):
        querator.Worker(client, name, handle_signals=False).run()


# -- metrics ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


def test_the_metrics_port_binds_127_0_0_1_unless_told_another_address(client: querator.Client) -> None:
    """Off the network by default: another loopback address (127.0.0.2) is refused,
    which a port bound to every interface would accept."""
    pytest.importorskip("prometheus_client")
    name = unique()
    client.create_queue(name)
    client.produce(name, ["x"])
    port = _free_port()
    run_until_empty(querator.Worker(client, name, lambda item: None, metrics_port=port, handle_signals=False))
    assert _answers("127.0.0.1", port) and not _answers("127.0.0.2", port)
    port = _free_port()
    told = querator.Worker(client, name, lambda item: None, metrics_port=port, metrics_host="127.0.0.2", handle_signals=False)
    run_until_empty(told)
    assert _answers("127.0.0.2", port) and not _answers("127.0.0.1", port)


def test_prometheus_metrics_on_a_port(client: querator.Client) -> None:
    pytest.importorskip("prometheus_client")
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq, max_attempts=1)
    client.produce(name, ["ok"] * 5, kind="job")
    client.produce(name, ["bad"] * 2, kind="job")

    def handle(item: querator.LeasedItem) -> None:
        if item.text == "bad":
            raise ValueError("bad")

    port = _free_port()
    worker = querator.Worker(client, name, handle, metrics_port=port, handle_signals=False)
    run_until_empty(worker)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()

    def sample(metric: str, **labels: str) -> float:
        wanted = {"queue": name, **labels}
        for line in text.splitlines():
            match = re.fullmatch(r"(\w+)\{(.*)\} (\S+)", line)
            if match and match.group(1) == metric:
                found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
                if found == wanted:
                    return float(match.group(3))
        raise AssertionError(f"{metric} {wanted} not exposed")

    assert sample("querator_worker_handled_total", kind="job") == 5
    assert sample("querator_worker_failed_total", kind="job", error="ValueError") == 2
    assert sample("querator_worker_dead_total", kind="job") == 2
    assert sample("querator_worker_handler_seconds_count", kind="job") == 7
    assert sample("querator_worker_lease_lag_seconds_count") == 7


def test_without_metrics_prometheus_client_is_not_imported(srv: EmbeddedServer, client: querator.Client) -> None:
    name = unique()
    client.create_queue(name)
    client.produce(name, ["a", "b"])
    script = (
        "import sys, querator\n"
        "with querator.Client(sys.argv[1]) as c:\n"
        "    w = querator.Worker(c, sys.argv[2], lambda item: None)\n"
        "    w.run(until_empty=True)\n"
        "print(w.stats.completed, 'prometheus_client' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, srv.address, name], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "False"]
