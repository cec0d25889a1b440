"""A LeaseStream whose client stops reading: the server keeps the bytes of answers it
cannot send within bounds (per stream and server-wide), leases nothing more for it,
and after the stall timeout ends the stream and gives the unsent items back without
burning an attempt."""

from __future__ import annotations

import queue
import re
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from querator.v1 import queue_pb2, storage_pb2

from conftest import Stubs, ThreadServer, dur, wait_until

MIB = 1 << 20
ITEM = 10_000
ITEMS = 4000
STALL_S = 2.0
# A stream's next answer may take a full reply (4 MiB) past its stream's bound.
HEAD_ALLOWANCE = 4 * MIB


def _server(data_dir: str, *, unsent: int, stream: int, stall_s: float) -> ThreadServer:
    return ThreadServer(
        data_dir,
        unsent_bytes=unsent,
        stream_unsent_bytes=stream,
        stream_stall_s=stall_s,
        metrics_address="127.0.0.1:0",
    )


@pytest.fixture
def bounded(data_dir: str) -> Iterator[ThreadServer]:
    """Streams bounded at 1 MiB each, ended after 2 s without a read."""
    srv = _server(data_dir, unsent=16 * MIB, stream=MIB, stall_s=STALL_S)
    yield srv
    srv.stop()


@pytest.fixture
def crowded(data_dir: str) -> Iterator[ThreadServer]:
    """Room for 2 MiB of unsent answers in all, less than one stream may hold."""
    srv = _server(data_dir, unsent=2 * MIB, stream=8 * MIB, stall_s=60)
    yield srv
    srv.stop()


def _fill(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(120), max_attempts=2)
    for start in range(0, ITEMS, 400):
        stubs.produce("q", [f"{n:06d}".encode().ljust(ITEM, b".") for n in range(start, start + 400)])


def _never_read(stubs: Stubs, streams: int) -> list[grpc.Call]:
    """Streams of 60 Leases of 100 items each, whose client reads nothing (yet)."""
    message = queue_pb2.LeaseStreamRequest(request=queue_pb2.LeaseRequest(queue_name="q", batch_size=100))
    return [stubs.queue.LeaseStream(iter([message] * 60), timeout=60) for _ in range(streams)]  # type: ignore[misc]


def _metric(srv: ThreadServer, name: str) -> float:
    assert srv.server.metrics is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics.port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def _all_items(stubs: Stubs) -> list[storage_pb2.StorageItem]:
    items: list[storage_pb2.StorageItem] = []
    token = ""
    while True:
        page = stubs.storage.ListItems(
            storage_pb2.ListItemsRequest(queue_name="q", page_size=1000, page_token=token), timeout=10
        )
        items.extend(page.items)
        token = page.next_page_token
        if not token:
            return items


def test_streams_that_never_read_are_bounded_then_ended_and_their_items_given_back(bounded: ThreadServer) -> None:
    channel = grpc.insecure_channel(bounded.address, options=[("grpc.max_receive_message_length", 64 * MIB)])
    stubs = Stubs(channel)
    try:
        _fill(stubs)
        calls = _never_read(stubs, 2)
        started = time.monotonic()
        peak = 0
        while time.monotonic() - started < STALL_S * 0.75:
            peak = max(peak, bounded.server.unsent_stream_bytes)
            time.sleep(0.01)
        assert 0 < peak <= 2 * (MIB + HEAD_ALLOWANCE)
        assert 0 < _metric(bounded, "querator_lease_stream_unsent_bytes") <= 2 * (MIB + HEAD_ALLOWANCE)
        leased_while_stuck = stubs.stats("q").partitions[0].total_leased
        assert 0 < leased_while_stuck < ITEMS

        # The stall timeout ends both streams: what they could not send is given back,
        # and the stream ends DEADLINE_EXCEEDED for a client that reads at last.
        wait_until(lambda: _metric(bounded, "querator_lease_streams_stalled_total") == 2, timeout=30)
        wait_until(lambda: stubs.stats("q").partitions[0].total_leased < leased_while_stuck, timeout=30)
        received: set[str] = set()
        for call in calls:
            with pytest.raises(grpc.RpcError) as ended:
                for answer in call:
                    received.update(item.id for item in answer.response.items)
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "given back" in (ended.value.details() or "")
        wait_until(lambda: bounded.server.unsent_stream_bytes == 0, timeout=30)
        assert _metric(bounded, "querator_lease_stream_unsent_bytes") == 0

        stored = _all_items(stubs)
        # Nothing lost or doubled.
        assert sorted(item.payload[:6] for item in stored) == [f"{n:06d}".encode() for n in range(ITEMS)]
        leased = [item for item in stored if item.is_leased]
        ready = [item for item in stored if not item.is_leased]
        # Only items the client holds are still leased; the rest were given back with
        # the attempt their lease took.
        assert {item.id for item in leased} <= received
        assert len(ready) > ITEMS - leased_while_stuck
        assert all(item.attempts == 0 for item in ready)
        # And they are served again.
        again = stubs.lease("q", batch_size=100, request_timeout=dur(0))
        assert len(again.items) > 0 and all(item.attempts == 1 for item in again.items)
    finally:
        channel.close()


def test_the_server_wide_bound_holds_across_streams(crowded: ThreadServer) -> None:
    channel = grpc.insecure_channel(crowded.address, options=[("grpc.max_receive_message_length", 64 * MIB)])
    stubs = Stubs(channel)
    try:
        _fill(stubs)
        calls = _never_read(stubs, 3)
        # Leasing stops once the transport holds what it takes and the room is used up.
        last, steady_since = -1, time.monotonic()
        deadline = time.monotonic() + 30
        peak = 0
        while time.monotonic() - steady_since < 1.0:
            assert time.monotonic() < deadline, "leasing never stopped"
            peak = max(peak, crowded.server.unsent_stream_bytes)
            leased = stubs.stats("q").partitions[0].total_leased
            if leased != last:
                last, steady_since = leased, time.monotonic()
            time.sleep(0.02)
        # Within the room, give or take one item (a Lease always takes its first).
        assert 0 < peak <= 2 * MIB + 2 * ITEM
        assert 0 < last < ITEMS
        for call in calls:
            call.cancel()
        # Ended by the client: their unsent answers are given back too.
        wait_until(lambda: crowded.server.unsent_stream_bytes == 0, timeout=30)
        wait_until(lambda: stubs.stats("q").partitions[0].total_leased < last, timeout=30)
    finally:
        channel.close()


@pytest.fixture
def roomy(data_dir: str) -> Iterator[ThreadServer]:
    """Room for every answer the window of a stream holds: its Leases all complete."""
    srv = _server(data_dir, unsent=64 * MIB, stream=64 * MIB, stall_s=60)
    yield srv
    srv.stop()


def test_an_answer_made_beyond_the_window_is_given_back_when_the_call_is_cancelled(roomy: ThreadServer) -> None:
    # The client reads nothing, so the transport soon holds an answer it cannot send,
    # the window of answers waiting behind it fills, and the message read after them
    # waits for a place in the window while its Lease is already answered (and its
    # bytes counted). A cancel then must uncount that answer too, or the server-wide
    # room loses it for good.
    channel = grpc.insecure_channel(roomy.address, options=[("grpc.max_receive_message_length", 64 * MIB)])
    stubs = Stubs(channel)
    try:
        _fill(stubs)
        message = queue_pb2.LeaseStreamRequest(request=queue_pb2.LeaseRequest(queue_name="q", batch_size=100))
        call = stubs.queue.LeaseStream(iter([message] * 30), timeout=60)  # type: ignore[misc]
        last, steady_since = -1, time.monotonic()
        deadline = time.monotonic() + 30
        while time.monotonic() - steady_since < 1.0:
            assert time.monotonic() < deadline, "leasing never stopped"
            leased = stubs.stats("q").partitions[0].total_leased
            if leased != last:
                last, steady_since = leased, time.monotonic()
            time.sleep(0.02)
        # More answers than the window holds were made: the reader waits with one.
        assert last > 100 * 17
        assert roomy.server.unsent_stream_bytes > 0
        call.cancel()
        wait_until(lambda: roomy.server.unsent_stream_bytes == 0, timeout=30)
        # The items of the answers never sent are given back (those sent stay leased).
        wait_until(lambda: stubs.stats("q").partitions[0].total_leased < last, timeout=30)
    finally:
        channel.close()


def test_a_slow_reader_is_not_ended_and_gets_every_item(bounded: ThreadServer) -> None:
    # Reading an answer every quarter of a second: never stuck for the 2 s stall timeout.
    channel = grpc.insecure_channel(bounded.address, options=[("grpc.max_receive_message_length", 64 * MIB)])
    stubs = Stubs(channel)
    try:
        stubs.create("q", lease_timeout=dur(120))
        produced: list[str] = []
        for _ in range(3):
            produced.extend(stubs.produce("q", [b"s" * ITEM] * 400).ids)
        message = queue_pb2.LeaseStreamRequest(
            request=queue_pb2.LeaseRequest(queue_name="q", batch_size=100, request_timeout=dur(0))
        )
        outbox: queue.Queue[queue_pb2.LeaseStreamRequest | None] = queue.Queue()
        for _ in range(8):
            outbox.put(message)
        received: list[str] = []
        answers = 0
        for answer in stubs.queue.LeaseStream(iter(outbox.get, None), timeout=60):
            answers += 1
            received.extend(item.id for item in answer.response.items)
            time.sleep(STALL_S / 8)  # slow, but never stuck for the stall timeout
            outbox.put(message if len(received) < len(produced) and answers < 100 else None)
        assert sorted(received) == sorted(produced)
        assert bounded.server.unsent_stream_bytes == 0
    finally:
        channel.close()
