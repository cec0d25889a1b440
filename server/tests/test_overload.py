"""Overload: a bounded inbox, and thousands of idle long-poll leases that block nobody.

The short form of bench/overload.py (same functions), against servers in child processes
so their memory is their own. docs/operations.md, "Faults and what they return".

- Each queue's inbox holds at most ``max_inbox`` requests; past it a call gets
  RESOURCE_EXHAUSTED at once, not after the disk: here the disk is stalled
  (QUERATOR_FAULT_FILE=stall) for the whole flood, so every refusal came before it. The
  server's memory stays flat from wave to wave although each wave offers more data, and
  everything accepted is stored once the disk returns.
- 2,000 Lease calls waiting on an empty queue do not slow a producer on another queue
  beyond a small factor, cost a bounded amount of memory, and each gets an item when
  items arrive; also when all 2,000 calls start at the same instant.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from overload import measure_flood, measure_waiting_leases

LEASES = 2000


def test_a_flood_past_max_inbox_is_refused_at_once_with_flat_memory_and_nothing_accepted_is_lost(
    tmp_path: Path,
) -> None:
    max_inbox, waves, wave, size = 100, 16, 250, 40_000
    figures = measure_flood(str(tmp_path), max_inbox=max_inbox, waves=waves, wave=wave, payload_bytes=size)
    report = "\n".join(figures.lines())
    # Exactly the stalled produce plus a full inbox went through; all others were refused.
    assert figures.produce_waiting_stat == max_inbox, report
    assert figures.codes == {"OK": max_inbox + 1, "RESOURCE_EXHAUSTED": waves * wave - max_inbox}, report
    assert "overloaded" in figures.refusal, report
    assert figures.stored == figures.accepted == max_inbox + 1, report
    # Waves 2..16 offer 150 MB more; a server that kept refused requests would grow by
    # that much, one that does not stays within what a wave has in flight.
    growth = max(figures.rss_after_wave_mb[1:]) - figures.rss_after_wave_mb[0]
    assert growth < 50, report


def test_2000_idle_long_poll_leases_do_not_block_a_producer_and_all_get_served(tmp_path: Path) -> None:
    figures = measure_waiting_leases(str(tmp_path), LEASES, produces=150)
    report = "\n".join(figures.lines())
    assert figures.lease_waiting_stat == LEASES, report
    # Produce latency with the leases waiting stays within a small factor of idle.
    idle = max(figures.idle_p50_ms, figures.idle_after_p50_ms)
    assert figures.waiting_p50_ms <= 3 * idle + 2, report
    # Memory per waiting lease is bounded (tens of KB, not MB).
    assert figures.rss_waiting_mb - figures.rss_before_mb < 150, report
    # And the waiting leases were alive: items shared among all of them.
    assert figures.lease_codes == {"OK": LEASES} and figures.served == LEASES, report


def test_2000_lease_calls_started_at_the_same_instant_all_wait_and_none_is_cancelled(tmp_path: Path) -> None:
    """Workers that all reconnect at once (a deploy, a network blip) open their long polls
    together; every one must be served, not dropped with an undocumented CANCELLED."""
    figures = measure_waiting_leases(str(tmp_path), LEASES, produces=20, step=0)
    report = "\n".join(figures.lines())
    assert figures.lease_codes == {"OK": LEASES} and figures.served == LEASES, report


def test_a_stream_that_floods_without_reading_holds_a_bounded_amount(tmp_path: Path) -> None:
    """A ProduceStream client that sends 1 MB requests as fast as it can while nothing is
    answered (the disk stalls, and it never reads): the server reads at most its window
    of requests, so its memory grows by a bounded amount, not by what is sent."""
    import os
    import threading

    import grpc

    from crash_loop import ServerProcess
    from overload import FAULT_FILE_ENV, rss_mb, wait_for
    from querator.v1 import queue_pb2, queue_pb2_grpc, queues_pb2, queues_pb2_grpc

    stall = str(tmp_path / "stall")
    server = ServerProcess(str(tmp_path / "data"), str(tmp_path / "server.log"), env={FAULT_FILE_ENV: stall})
    server.start()
    channel = grpc.insecure_channel(server.address)
    sent = 0
    stop = threading.Event()

    def flood() -> object:
        nonlocal sent
        message = queue_pb2.ProduceStreamRequest(request=queue_pb2.ProduceRequest(queue_name="s", payloads=[b"m" * 1_000_000]))
        while sent < 400 and not stop.is_set():
            sent += 1
            yield message

    try:
        queues_pb2_grpc.QueuesServiceStub(channel).CreateQueue(
            queues_pb2.CreateQueueRequest(queue=queues_pb2.QueueInfo(queue_name="s")), timeout=10
        )
        before = rss_mb(server.pid)
        with open(stall, "w") as f:
            f.write("stall")
        call = queue_pb2_grpc.QueueServiceStub(channel).ProduceStream(flood(), timeout=60)
        wait_for(lambda: sent > 20, "the flood to start")
        time.sleep(3)  # as much as flow control lets through
        grown = rss_mb(server.pid) - before
        assert sent < 400, f"nothing held the client back: {sent} MB sent"
        assert grown < 120, f"the server grew by {grown:.0f} MB with {sent} MB sent"
        stop.set()
        call.cancel()
        os.remove(stall)
        # The server is well: a unary produce goes through.
        reply = queue_pb2_grpc.QueueServiceStub(channel).Produce(
            queue_pb2.ProduceRequest(queue_name="s", payloads=[b"after"]), timeout=30
        )
        assert len(reply.ids) == 1
    finally:
        stop.set()
        if os.path.exists(stall):
            os.remove(stall)
        channel.close()
        server.kill9()
