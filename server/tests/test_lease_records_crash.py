"""kill -9 at each write of a lease record (storage/lease_records.py), then a restart.

A ``querator serve`` child kills itself (``QUERATOR_CRASH_AT``, faults.py) right after
the commit of a cycle that wrote a lease record, completed a whole lease by its record,
or wrote one out into its items. After the restart on the same data directory: no item
acknowledged is lost or stored twice, a lease still holds its items until its deadline
(they are not handed out again before), and they come back once it passes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import pytest
from test_durability import list_all

from querator.v1 import queue_pb2

from conftest import ProcessServer, Stubs, wait_until

LEASE_S = 3
# The lease that must outlive a kill -9 and a restart: under a load average of 8-9 a
# restart once took longer than LEASE_S, and the held lease was seen run out.
HELD_LEASE_S = 10


@pytest.fixture
def stubs_of() -> Iterator[list[Stubs]]:
    opened: list[Stubs] = []
    yield opened
    for stubs in opened:
        stubs.channel.close()


def _connect(proc: ProcessServer, opened: list[Stubs]) -> Stubs:
    stubs = Stubs(grpc.insecure_channel(proc.address))
    opened.append(stubs)
    return stubs


def _crashes(proc: ProcessServer, call: object) -> None:
    """``call`` makes the server kill itself; the caller may or may not hear back."""
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN), exc
    assert proc.proc is not None and proc.proc.wait(20) == -9, "the crash point did not fire"


def _ten_items(data_dir: str, crash_at: str, lease_s: int, opened: list[Stubs]) -> tuple[ProcessServer, Stubs, list[bytes]]:
    """A server that kills itself at ``crash_at``, with queue "q" (leases of ``lease_s``)
    holding ten items; their payloads."""
    proc = ProcessServer(data_dir, env={"QUERATOR_CRASH_AT": crash_at})
    proc.start()
    stubs = _connect(proc, opened)
    stubs.create("q", lease_timeout={"seconds": lease_s})
    payloads = [b"i%d" % n for n in range(10)]
    stubs.produce("q", payloads)
    return proc, stubs, payloads


def _leased_now(stubs: Stubs) -> dict[bytes, tuple[bool, int]]:
    """payload -> (leased, attempts) of every stored item."""
    return {i.payload: (i.is_leased, i.attempts) for items in list_all(stubs, "q").values() for i in items}


def _lease_all(stubs: Stubs) -> queue_pb2.LeaseResponse:
    return stubs.lease("q", batch_size=100, request_timeout={"nanos": 200_000_000})


def test_kill9_after_a_lease_record_is_committed_keeps_the_lease(data_dir: str, stubs_of: list[Stubs]) -> None:
    proc, stubs, payloads = _ten_items(data_dir, "lease-recorded", HELD_LEASE_S, stubs_of)
    leased_at = time.monotonic()
    _crashes(proc, lambda: stubs.lease("q", batch_size=4))
    proc.env = {}
    proc.start()
    try:
        stubs = _connect(proc, stubs_of)
        found = _leased_now(stubs)
        stats = stubs.stats("q").partitions[0]
        # Not handed out again while the lease holds: the next lease gets the other six.
        again = _lease_all(stubs)
        assert time.monotonic() - leased_at < HELD_LEASE_S, "too slow to tell a held lease from one that ran out"
        assert found == {p: (n < 4, 1 if n < 4 else 0) for n, p in enumerate(payloads)}
        assert (stats.total, stats.total_leased) == (10, 4)
        assert [i.payload for i in again.items] == payloads[4:]
        stubs.complete("q", again.partition, [i.id for i in again.items])
        # Once its deadline passes the four come back, each with its attempt counted.
        wait_until(lambda: stubs.stats("q").partitions[0].total_leased == 0, timeout=HELD_LEASE_S + 10)
        back = _lease_all(stubs)
        assert sorted(i.payload for i in back.items) == payloads[:4]
        assert [i.attempts for i in back.items] == [2] * 4
        stubs.complete("q", back.partition, [i.id for i in back.items])
        assert stubs.stats("q").partitions[0].total == 0
    finally:
        proc.stop()


def test_kill9_after_a_whole_lease_completes_by_its_record_loses_and_keeps_nothing(
    data_dir: str, stubs_of: list[Stubs]
) -> None:
    proc, stubs, payloads = _ten_items(data_dir, "lease-completed", 600, stubs_of)
    lease = stubs.lease("q", batch_size=4)
    ids = [i.id for i in lease.items]
    _crashes(proc, lambda: stubs.complete("q", lease.partition, ids))
    proc.env = {}
    proc.start()
    try:
        stubs = _connect(proc, stubs_of)
        assert _leased_now(stubs) == {p: (False, 0) for p in payloads[4:]}
        # The Complete sent again (its answer was lost) is answered as done.
        again = stubs.queue.Complete(queue_pb2.CompleteRequest(queue_name="q", partition=lease.partition, ids=ids), timeout=10)
        assert list(again.already_completed) == ids
        rest = _lease_all(stubs)
        assert [i.payload for i in rest.items] == payloads[4:]
    finally:
        proc.stop()


def test_kill9_after_a_lease_is_written_out_keeps_the_rest_of_it(data_dir: str, stubs_of: list[Stubs]) -> None:
    proc, stubs, payloads = _ten_items(data_dir, "lease-written-out", 600, stubs_of)
    lease = stubs.lease("q", batch_size=4)
    ids = [i.id for i in lease.items]
    deadline = lease.items[0].lease_deadline
    _crashes(proc, lambda: stubs.complete("q", lease.partition, ids[1:3]))
    proc.env = {}
    proc.start()
    try:
        stubs = _connect(proc, stubs_of)
        stored = {i.payload: i for items in list_all(stubs, "q").values() for i in items}
        assert sorted(stored) == sorted([payloads[0], payloads[3], *payloads[4:]])
        for payload in (payloads[0], payloads[3]):
            assert stored[payload].is_leased and stored[payload].attempts == 1
            assert stored[payload].lease_deadline == deadline
        assert [i.payload for i in _lease_all(stubs).items] == payloads[4:]
        stubs.complete("q", lease.partition, [ids[0], ids[3]])
        assert stubs.stats("q").partitions[0].total_leased == 6
    finally:
        proc.stop()
