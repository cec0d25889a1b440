"""Failure text through the SDK: ``retry(error=...)``, ``dead(error=...)``, the context
managers and the worker send what went wrong; the next lease, the listings and the dead
letter show it as ``last_error``; ``querator items list`` and ``querator dlq show`` print
it. A real server (the embedded one) over real gRPC."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

import querator
from querator import DeadLetter, failure_text
from querator.cli import main
from querator.embedded import EmbeddedServer

from sdk_helpers import client, run, run_until_empty, srv, unique, wait_until  # noqa: F401 (fixtures)

BOUND = 2048  # RetryItem.error's documented bound, in bytes of UTF-8


def _raise_deep(depth: int, message: str) -> None:
    if depth:
        _and_back(depth - 1, message)  # two functions in turn: no frame repeats the one before
    raise ValueError(message)


def _and_back(depth: int, message: str) -> None:
    _raise_deep(depth, message)


def _caught(depth: int, message: str) -> BaseException:
    try:
        _raise_deep(depth, message)
    except ValueError as exc:
        return exc
    raise AssertionError("not raised")


def test_failure_text_puts_type_and_message_first_then_the_last_frames_that_fit() -> None:
    short = failure_text(_caught(2, "bad row 7"))
    lines = short.splitlines()
    assert lines[0] == "ValueError: bad row 7" and lines[1] == "Traceback (most recent call last):"
    assert lines[-1].strip() == "raise ValueError(message)" and "left out" not in short
    assert short.count("in _raise_deep") == 3 and short.count("in _and_back") == 2

    deep = failure_text(_caught(200, "deep"))
    assert len(deep.encode()) <= BOUND and deep.startswith("ValueError: deep\nTraceback")
    assert deep.rstrip().endswith("raise ValueError(message)")  # the frame that raised is kept
    (note,) = [line for line in deep.splitlines() if "left out" in line]
    left_out = int(note.split()[1])
    assert left_out + deep.count("\n  File ") == 402  # every frame is shown or counted

    huge = failure_text(ValueError("x" * 5000))  # the message alone passes the bound: sent whole
    assert huge == "ValueError: " + "x" * 5000
    assert failure_text(KeyError("k")) == "KeyError: 'k'"  # never raised: no traceback


def test_errors_reach_the_next_lease_and_the_dead_letter(
    srv: EmbeddedServer, client: querator.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq)
    client.produce(name, ["by-hand", "by-block", "dies"])
    leased = {i.text: i for i in client.lease(name, batch_size=3, wait=0)}
    before = datetime.now(UTC)
    leased["by-hand"].retry(error="smtp: 421 try later")
    with pytest.raises(ZeroDivisionError), leased["by-block"]:
        1 / 0  # noqa: B018 - the block fails; the item is retried with the exception
    with leased["dies"]:
        raise DeadLetter("customer 42 is gone")

    again = {i.text: i for i in client.lease(name, batch_size=2, wait=0)}
    assert again["by-hand"].last_error == "smtp: 421 try later"
    at = again["by-hand"].last_error_at
    assert at is not None and before - timedelta(seconds=1) <= at <= datetime.now(UTC)
    block = again["by-block"].last_error
    assert block.startswith("ZeroDivisionError: division by zero\nTraceback") and "1 / 0" in block
    listed = {i.payload: i for i in client.list_items(name)}
    assert listed[b"by-hand"].last_error == "smtp: 421 try later" and listed[b"by-hand"].last_error_at == at
    for item in again.values():
        item.retry(error="")  # no text: the items keep the error they had
    assert main(["lease", name, "-n", "2", "--json", "--address", srv.address]) == 0
    by_cli = {i["payload"]: i for i in json.loads(capsys.readouterr().out)["items"]}
    assert by_cli["by-hand"]["last_error"] == "smtp: 421 try later"
    assert by_cli["by-block"]["last_error"] == block and by_cli["by-block"]["last_error_at"]

    wait_until(lambda: list(client.list_items(dlq)))
    (letter,) = client.list_items(dlq)
    assert letter.dead_reason == querator.DeadReason.RETRY_DEAD
    assert letter.last_error.startswith("querator.errors.DeadLetter: customer 42 is gone\nTraceback")
    # Import keeps it (a copy of the dead letter elsewhere says the same).
    copy = unique("copy")
    client.create_queue(copy)
    client.import_items(copy, [letter])
    assert [i.last_error for i in client.list_items(copy)] == [letter.last_error]


def test_the_async_client_sends_errors_too(srv: EmbeddedServer) -> None:
    async def scenario() -> str:
        async with querator.AsyncClient(srv.address) as client:
            name = unique()
            await client.create_queue(name)
            await client.produce(name, ["a"])
            (item,) = await client.lease(name, wait=0)
            await client.retry([item], error=RuntimeError("async failure"))
            (again,) = await client.lease(name, wait=0)
            return again.last_error

    assert run(scenario()) == "RuntimeError: async failure"


def failing_handler(item: querator.LeasedItem) -> None:
    if item.text == "fatal":
        raise DeadLetter("no such customer")
    raise ConnectionError(f"upstream refused {item.text} on attempt {item.attempts}")


def test_the_worker_records_the_exception_on_every_retry_and_dead_letter(
    srv: EmbeddedServer, client: querator.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    dlq, name = unique("dlq"), unique()
    client.create_queue(dlq)
    client.create_queue(name, dead_queue=dlq, max_attempts=2)
    client.produce(name, ["flaky", "fatal"])
    seen: list[str] = []

    def handler(item: querator.LeasedItem) -> None:
        seen.append(f"{item.text}#{item.attempts}: {item.last_error.splitlines()[0] if item.last_error else ''}")
        failing_handler(item)

    worker = querator.Worker(client, name, handler, handle_signals=False, retry_backoff=lambda attempt: timedelta(0))
    run_until_empty(worker)
    # The second attempt's handler sees why the first failed.
    assert "flaky#2: ConnectionError: upstream refused flaky on attempt 1" in seen
    wait_until(lambda: len(list(client.list_items(dlq))) == 2)
    letters = {i.payload: i for i in client.list_items(dlq)}
    flaky, fatal = letters[b"flaky"], letters[b"fatal"]
    assert flaky.last_error.startswith("ConnectionError: upstream refused flaky on attempt 2\nTraceback")
    assert "in failing_handler" in flaky.last_error and flaky.dead_reason is not None
    assert fatal.last_error.startswith("querator.errors.DeadLetter: no such customer\n")

    # The command line: the table's error column, and one dead letter in full.
    assert main(["items", "list", dlq, "--address", srv.address]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == [
        "PARTITION", "ID", "STATE", "KIND", "PRIORITY", "ATTEMPTS", "LEASE_DEADLINE", "REASON", "ERROR", "PAYLOAD"
    ]  # fmt: skip
    row = next(line for line in table if line.rstrip().endswith("flaky"))
    assert f" {flaky.dead_reason} " in row and "ConnectionError: upstream refused flaky on atte..." in row

    assert main(["dlq", "show", dlq, flaky.message_id, "--address", srv.address]) == 0
    shown = capsys.readouterr().out
    assert f"id:             {flaky.id}\n" in shown and f"dead_reason:    {flaky.dead_reason}\n" in shown
    assert "\nlast_error:\n  ConnectionError: upstream refused flaky on attempt 2\n  Traceback" in shown
    assert "in failing_handler" in shown
    assert main(["dlq", "show", dlq, flaky.id, "--json", "--address", srv.address]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert as_json["last_error"] == flaky.last_error and as_json["dead_reason"] == flaky.dead_reason
    assert main(["dlq", "show", dlq, "no-such-id", "--address", srv.address]) == 1
    assert "no item 'no-such-id'" in capsys.readouterr().err
