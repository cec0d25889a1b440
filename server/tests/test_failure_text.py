"""Failure text travels with the item.

A Retry may say what went wrong (per item, or once for the request); the item keeps it
as ``last_error`` with the time (``last_error_at``) through re-queues, scheduling,
dead-lettering and redrive, so the next attempt's handler and whoever reads the dead
letter see it. A lease that runs out records the server's own text. Real servers over
real gRPC on real LMDB; waits poll with bounded timeouts.
"""

from __future__ import annotations

import time

import grpc

from querator.v1 import queue_pb2, storage_pb2

from conftest import ProcessServer, Stubs, dur, wait_until

EVENTUALLY = 10.0
MAX_ERROR_BYTES = 2048  # the bound RetryItem.error documents


def lease_now(stubs: Stubs, name: str, batch_size: int = 10, **kw: object) -> queue_pb2.LeaseResponse:
    return stubs.lease(name, batch_size=batch_size, request_timeout=dur(0.2), **kw)


def retry(stubs: Stubs, name: str, items: list[queue_pb2.RetryItem], **kw: object) -> queue_pb2.RetryResponse:
    request = queue_pb2.RetryRequest(queue_name=name, partition=0, items=items, **kw)  # type: ignore[arg-type]
    return stubs.queue.Retry(request, timeout=10)


def by_payload(items: object) -> dict[bytes, object]:
    return {item.payload: item for item in items}  # type: ignore[attr-defined]


def test_a_retry_error_is_seen_by_the_next_lease_in_items_columns_and_listings(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"own", b"shared", b"silent"])
    leased = by_payload(lease_now(stubs, "q").items)
    before = time.time()
    retry(
        stubs,
        "q",
        [
            queue_pb2.RetryItem(id=leased[b"own"].id, error="ValueError: bad row 7"),  # type: ignore[attr-defined]
            queue_pb2.RetryItem(id=leased[b"shared"].id),  # type: ignore[attr-defined]
        ],
        error="ConnectionError: smtp down",
    )
    retry(stubs, "q", [queue_pb2.RetryItem(id=leased[b"silent"].id)])  # type: ignore[attr-defined]

    listed = by_payload(stubs.list_items("q"))
    assert {p: i.last_error for p, i in listed.items()} == {  # type: ignore[attr-defined]
        b"own": "ValueError: bad row 7",
        b"shared": "ConnectionError: smtp down",
        b"silent": "",
    }
    assert before - 1 <= listed[b"own"].last_error_at.ToMicroseconds() / 1e6 <= time.time() + 1  # type: ignore[attr-defined]
    assert not listed[b"silent"].HasField("last_error_at")  # type: ignore[attr-defined]

    again = by_payload(lease_now(stubs, "q").items)
    assert again[b"own"].last_error == "ValueError: bad row 7"  # type: ignore[attr-defined]
    assert again[b"own"].last_error_at == listed[b"own"].last_error_at  # type: ignore[attr-defined]
    assert again[b"silent"].last_error == "" and not again[b"silent"].HasField("last_error_at")  # type: ignore[attr-defined]
    # A retry without text keeps the error the item had.
    retry(stubs, "q", [queue_pb2.RetryItem(id=i.id) for i in again.values()])  # type: ignore[attr-defined]
    columns = lease_now(stubs, "q", columnar=True).columns
    errors = dict(zip(columns.payloads, columns.last_errors, strict=True))
    assert errors == {b"own": "ValueError: bad row 7", b"shared": "ConnectionError: smtp down", b"silent": ""}
    at = dict(zip(columns.payloads, columns.last_error_at_us, strict=True))
    assert at[b"own"] == listed[b"own"].last_error_at.ToMicroseconds() and at[b"silent"] == 0  # type: ignore[attr-defined]


def test_a_scheduled_retry_keeps_its_error_while_it_waits(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"later"])
    (item,) = lease_now(stubs, "q").items
    later = queue_pb2.RetryItem(id=item.id, error="TimeoutError: upstream")
    later.retry_at.FromMicroseconds(int((time.time() + 3600) * 1e6))
    retry(stubs, "q", [later])
    request = storage_pb2.ListScheduledItemsRequest(queue_name="q", partition=0)
    (scheduled,) = stubs.storage.ListScheduledItems(request, timeout=10).items
    assert scheduled.last_error == "TimeoutError: upstream" and scheduled.HasField("last_error_at")


def test_the_error_that_killed_a_dead_letter_stays_beside_its_reason_and_through_redrive(stubs: Stubs) -> None:
    stubs.create("dlq")
    stubs.create("q", dead_queue="dlq")
    stubs.produce("q", [b"doomed"])
    (item,) = lease_now(stubs, "q").items
    dead = retry(stubs, "q", [queue_pb2.RetryItem(id=item.id, dead=True, error="KeyError: 'customer'")])
    assert list(dead.dead_ids) == [item.id]
    wait_until(lambda: len(stubs.list_items("dlq")) == 1, timeout=EVENTUALLY)
    (letter,) = stubs.list_items("dlq")
    assert (letter.dead_reason, letter.last_error) == (queue_pb2.DEAD_REASON_RETRY_DEAD, "KeyError: 'customer'")
    assert letter.HasField("last_error_at") and letter.message_id == item.message_id

    moved = stubs.storage.RedriveItems(storage_pb2.RedriveItemsRequest(queue_name="dlq"), timeout=30)
    assert moved.moved == 1
    (back,) = lease_now(stubs, "q").items
    # Redriven, it is a fresh item again, but its handler still sees why it failed before.
    assert (back.dead_reason, back.last_error) == (queue_pb2.DEAD_REASON_UNSPECIFIED, "KeyError: 'customer'")


def test_a_lease_that_runs_out_says_so_and_a_death_by_it_says_after_how_many_attempts(stubs: Stubs) -> None:
    stubs.create("dlq")
    stubs.create("q", lease_timeout=dur(1), max_attempts=2, dead_queue="dlq")
    stubs.produce("q", [b"slow"])
    first = lease_now(stubs, "q").items[0]
    assert first.last_error == ""
    retry(stubs, "q", [queue_pb2.RetryItem(id=first.id, error="RuntimeError: first try")])
    second = lease_now(stubs, "q").items[0]
    assert second.last_error == "RuntimeError: first try"
    # The second lease runs out with max_attempts (2) reached: a dead letter that says so.
    wait_until(lambda: len(stubs.list_items("dlq")) == 1, timeout=EVENTUALLY)
    (letter,) = stubs.list_items("dlq")
    assert letter.dead_reason == queue_pb2.DEAD_REASON_MAX_ATTEMPTS
    assert letter.last_error == "lease expired after 2 attempts"

    stubs.create("once", lease_timeout=dur(1), max_attempts=5)
    stubs.produce("once", [b"again"])
    lease_now(stubs, "once")
    wait_until(lambda: not stubs.list_items("once")[0].is_leased, timeout=EVENTUALLY)
    assert lease_now(stubs, "once").items[0].last_error == "lease expired after 1 attempt"


def test_longer_text_is_cut_to_the_bound_with_a_marker_and_import_keeps_what_it_is_given(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"long", b"wide"])
    leased = by_payload(lease_now(stubs, "q").items)
    long_text = "Traceback (most recent call last):\n" + "x" * 5000
    wide_text = "é" * 1500  # 3,000 bytes of UTF-8: cut on a character boundary
    retry(
        stubs,
        "q",
        [
            queue_pb2.RetryItem(id=leased[b"long"].id, error=long_text),  # type: ignore[attr-defined]
            queue_pb2.RetryItem(id=leased[b"wide"].id, error=wide_text),  # type: ignore[attr-defined]
        ],
    )
    listed = by_payload(stubs.list_items("q"))
    for payload, text in ((b"long", long_text), (b"wide", wide_text)):
        kept = listed[payload].last_error  # type: ignore[attr-defined]
        size = len(kept.encode())
        assert MAX_ERROR_BYTES - 3 <= size <= MAX_ERROR_BYTES
        head, _, marker = kept.rpartition("... [cut ")
        assert text.startswith(head) and marker == f"{len(text.encode()) - len(head.encode())} bytes]"

    imported = storage_pb2.StorageItem(payload=b"moved", last_error="OSError: disk", dead_reason=queue_pb2.DEAD_REASON_RETRY_DEAD)
    imported.last_error_at.FromSeconds(1_700_000_000)
    untimed = storage_pb2.StorageItem(payload=b"untimed", last_error="y" * 3000)
    request = storage_pb2.ImportItemsRequest(queue_name="q", partition=0, items=[imported, untimed])
    stubs.storage.ImportItems(request, timeout=10)
    listed = by_payload(stubs.list_items("q"))
    assert listed[b"moved"].last_error == "OSError: disk"  # type: ignore[attr-defined]
    assert listed[b"moved"].last_error_at.ToSeconds() == 1_700_000_000  # type: ignore[attr-defined]
    assert len(listed[b"untimed"].last_error.encode()) == MAX_ERROR_BYTES  # type: ignore[attr-defined]
    assert listed[b"untimed"].last_error_at.ToSeconds() >= time.time() - 60  # type: ignore[attr-defined]


def test_an_acknowledged_retry_error_survives_kill_9(process_server: ProcessServer) -> None:
    with grpc.insecure_channel(process_server.address) as channel:
        stubs = Stubs(channel)
        stubs.create("dlq")
        stubs.create("q", dead_queue="dlq")
        stubs.produce("q", [b"requeued", b"dead"])
        leased = by_payload(lease_now(stubs, "q").items)
        retry(
            stubs,
            "q",
            [
                queue_pb2.RetryItem(id=leased[b"requeued"].id, error="first"),  # type: ignore[attr-defined]
                queue_pb2.RetryItem(id=leased[b"dead"].id, error="fatal", dead=True),  # type: ignore[attr-defined]
            ],
        )
    process_server.kill9()  # right after the OK: nothing had time to flush on its own
    process_server.start()
    with grpc.insecure_channel(process_server.address) as channel:
        stubs = Stubs(channel)
        assert [i.last_error for i in stubs.list_items("q")] == ["first"]
        # The dead letter was in the outbox or in the dead-letter queue at the kill: either
        # way it arrives with its error.
        wait_until(lambda: len(stubs.list_items("dlq")) == 1, timeout=EVENTUALLY)
        assert stubs.list_items("dlq")[0].last_error == "fatal"
