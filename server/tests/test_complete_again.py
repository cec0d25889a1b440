"""Complete and Retry are safe to send again (issue 31, part 4).

An id its partition completed (or retried) within the queue's lease_timeout (and at
least a minute) answers as done; anything else that is not leased fails the whole request as before. Real server,
real gRPC, real LMDB; the crash test really ``kill -9``s a ``querator serve`` child.
"""

from __future__ import annotations

import signal
import tarfile
import time
from pathlib import Path

import grpc
import pytest

from querator.v1 import queue_pb2
from querator_server.actor import lifecycle

from conftest import ProcessServer, Stubs, ThreadServer, dur, wait_until

NOT_FOUND = grpc.StatusCode.NOT_FOUND
LONG_LEASE = {"seconds": 600}


def complete(
    stubs: Stubs, name: str, partition: int, ids: list[str], keys: list[str] | None = None
) -> queue_pb2.CompleteResponse:
    request = queue_pb2.CompleteRequest(queue_name=name, partition=partition, ids=ids, lease_keys=keys or [])
    response: queue_pb2.CompleteResponse = stubs.queue.Complete(request, timeout=10)
    return response


def retry(stubs: Stubs, name: str, partition: int, items: list[queue_pb2.RetryItem]) -> queue_pb2.RetryResponse:
    response: queue_pb2.RetryResponse = stubs.queue.Retry(
        queue_pb2.RetryRequest(queue_name=name, partition=partition, items=items), timeout=10
    )
    return response


def not_found(call: object, *args: object) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call(*args)  # type: ignore[operator]
    assert info.value.code() == NOT_FOUND, info.value
    return info.value.details() or ""  # type: ignore[attr-defined]


def lease(stubs: Stubs, name: str, n: int, **kw: object) -> queue_pb2.LeaseResponse:
    return stubs.lease(name, batch_size=n, request_timeout=dur(0.5), **kw)


def leased(stubs: Stubs, name: str) -> int:
    return sum(p.total_leased for p in stubs.stats(name).partitions)


def test_a_complete_sent_again_completes_the_rest_and_names_the_done(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=LONG_LEASE)
    stubs.produce("q", [b"a", b"b", b"c"])
    got = lease(stubs, "q", 3)
    a, b, c = (i.id for i in got.items)
    assert list(complete(stubs, "q", got.partition, [a]).already_completed) == []
    # The answer to [a, b] was lost after a was done: sent again, b is completed too.
    again = complete(stubs, "q", got.partition, [a, b])
    assert list(again.already_completed) == [a]
    assert leased(stubs, "q") == 1
    # The whole lease run sent again (the run path of the server) answers as done.
    assert list(complete(stubs, "q", got.partition, [a, b, c]).already_completed) == [a, b]
    assert list(complete(stubs, "q", got.partition, [a, b, c]).already_completed) == [a, b, c]
    assert stubs.stats("q").partitions[0].total == 0


def test_ids_never_leased_still_fail_the_whole_request_and_change_nothing(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=LONG_LEASE)
    produced = stubs.produce("q", [b"a", b"b", b"c", b"d"]).ids
    got = lease(stubs, "q", 2)
    a, b = (i.id for i in got.items)
    complete(stubs, "q", got.partition, [a])
    prefix = a.rsplit(".", 1)[0]
    unknown = f"{prefix}.{int(produced[-1].rsplit('.', 1)[1], 16) + 100:x}"
    for bad in (unknown, "nonsense", f"{int(prefix.split('.')[0], 16) + 1:x}.0.1"):
        message = not_found(stubs.queue.Complete, queue_pb2.CompleteRequest(queue_name="q", partition=0, ids=[a, b, bad]))
        assert bad in message and a not in message
    assert leased(stubs, "q") == 1  # b is still leased: nothing was applied
    # A completed id is no answer to Retry or Extend.
    not_found(stubs.queue.Retry, queue_pb2.RetryRequest(queue_name="q", partition=0, items=[queue_pb2.RetryItem(id=a)]))
    not_found(stubs.queue.Extend, queue_pb2.ExtendRequest(queue_name="q", partition=0, ids=[a]))
    assert list(complete(stubs, "q", got.partition, [b, a]).already_completed) == [a]


def test_an_id_re_queued_by_its_lease_running_out_is_not_done(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout={"nanos": 300_000_000})
    stubs.produce("q", [b"a"])
    first = lease(stubs, "q", 1).items[0]
    wait_until(lambda: stubs.list_items("q")[0].id != first.id, timeout=10)
    not_found(stubs.queue.Complete, queue_pb2.CompleteRequest(queue_name="q", partition=0, ids=[first.id]))
    again = lease(stubs, "q", 1).items[0]
    assert again.payload == b"a" and again.id != first.id


def test_a_retry_sent_again_retries_nothing_twice(stubs: Stubs) -> None:
    stubs.create("dlq")
    stubs.create("q", lease_timeout=LONG_LEASE, dead_queue="dlq")
    stubs.produce("q", [b"back", b"dies", b"later", b"more"])
    got = {i.payload: i.id for i in lease(stubs, "q", 4).items}
    later = queue_pb2.RetryItem(id=got[b"later"])
    later.retry_at.FromSeconds(int(time.time()) + 600)
    orders = [queue_pb2.RetryItem(id=got[b"back"]), queue_pb2.RetryItem(id=got[b"dies"], dead=True), later]
    first = retry(stubs, "q", 0, orders)
    assert (list(first.dead_ids), list(first.already_retried)) == ([got[b"dies"]], [])
    # Sent again with one more item: only that one is retried; the answer names the
    # dead letter again, as the lost first answer did.
    again = retry(stubs, "q", 0, [*orders, queue_pb2.RetryItem(id=got[b"more"])])
    assert list(again.already_retried) == [got[b"back"], got[b"dies"], got[b"later"]]
    assert list(again.dead_ids) == [got[b"dies"]]
    items = stubs.list_items("q")
    assert sorted(i.payload for i in items) == [b"back", b"more"]  # each once, ready
    assert not any(i.is_leased for i in items)
    assert stubs.stats("q").partitions[0].scheduled == 1
    wait_until(lambda: len(stubs.list_items("dlq")) == 1, timeout=10)
    # A retried id is not completed by a Complete.
    not_found(stubs.queue.Complete, queue_pb2.CompleteRequest(queue_name="q", partition=0, ids=[got[b"back"]]))


def test_items_completed_by_lease_key_or_by_a_lease_answer_as_done(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=LONG_LEASE)
    stubs.produce("q", [b"k1", b"k2", b"x1", b"x2"])
    by_key = lease(stubs, "q", 2, lease_key="job-1")
    keyed = [i.id for i in by_key.items]
    first = complete(stubs, "q", 0, [], ["job-1"])
    assert (first.key_items_completed, list(first.already_completed)) == (2, [])
    again = complete(stubs, "q", 0, keyed, ["job-1"])
    assert (again.key_items_completed, list(again.already_completed)) == (0, keyed)
    # complete_ids carried by a Lease: the Lease sent again completes nothing twice.
    plain = [i.id for i in lease(stubs, "q", 2).items]
    request = queue_pb2.LeaseRequest(
        queue_name="q", batch_size=1, complete_ids=plain, complete_partition=0, request_timeout=dur(0.2)
    )
    for _ in range(2):
        assert not stubs.queue.Lease(request, timeout=10).items
        assert stubs.stats("q").partitions[0].total == 0


def test_completed_ids_are_forgotten_after_the_lease_timeout(stubs: Stubs, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no floor (it is a minute: the next test), a queue of 1 s leases forgets."""
    monkeypatch.setattr(lifecycle, "DONE_RETENTION_FLOOR_US", 0)  # the server runs in this process
    stubs.create("q", lease_timeout={"seconds": 1})
    stubs.produce("q", [b"a", b"b"])
    got = lease(stubs, "q", 2)
    a, b = (i.id for i in got.items)
    complete(stubs, "q", 0, [a, b])
    assert list(complete(stubs, "q", 0, [b]).already_completed) == [b]
    time.sleep(2.5)  # past the lease timeout and the sweep's gap
    stubs.produce("q", [b"wake"])  # any cycle; the sweep also runs on its own timer
    wait_until(lambda: _forgotten(stubs, a), timeout=10)


def test_a_complete_sent_again_across_a_pause_longer_than_the_lease_timeout_is_done(proc: ProcessServer) -> None:
    """Seen in a soak: the answer of a Complete was lost, the node was paused 3.2 s, and
    the resend it found waiting was answered NOT_FOUND (the 2 s lease timeout had passed
    in the server's clock), reported as a refused Complete of items in fact done."""
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        stubs.create("q", lease_timeout={"seconds": 2})
        stubs.produce("q", [b"a", b"b"])
        got = lease(stubs, "q", 2)
        ids = [i.id for i in got.items]
        complete(stubs, "q", got.partition, ids)  # its answer, say, lost
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGSTOP)
        try:
            resent = stubs.queue.Complete.future(
                queue_pb2.CompleteRequest(queue_name="q", partition=got.partition, ids=ids), timeout=20
            )
            time.sleep(3.2)
        finally:
            proc.proc.send_signal(signal.SIGCONT)
        assert sorted(resent.result().already_completed) == sorted(ids)  # NOT_FOUND before
    finally:
        stubs.channel.close()


def _forgotten(stubs: Stubs, item_id: str) -> bool:
    try:
        complete(stubs, "q", 0, [item_id])
    except grpc.RpcError as exc:
        return exc.code() == NOT_FOUND  # type: ignore[attr-defined, no-any-return]
    return False


@pytest.fixture
def proc(process_server: ProcessServer) -> ProcessServer:
    """A ``querator serve`` child, started (conftest's process_server)."""
    return process_server


def test_what_each_path_remembers_survives_kill9(proc: ProcessServer) -> None:
    """Every place that writes a record (a lease run completed whole, ids one by one,
    a lease key, a Retry) is on disk when its OK is: kill -9 right after, and the
    restarted server answers each sent again as done."""
    stubs = Stubs(grpc.insecure_channel(proc.address))
    stubs.create("q", lease_timeout=LONG_LEASE)
    stubs.produce("q", [f"i{n}".encode() for n in range(8)])
    run = [i.id for i in lease(stubs, "q", 2).items]
    loose = [i.id for i in lease(stubs, "q", 2).items]
    keyed = [i.id for i in lease(stubs, "q", 2, lease_key="k").items]
    retried = [i.id for i in lease(stubs, "q", 2).items]
    complete(stubs, "q", 0, run)
    complete(stubs, "q", 0, loose[::-1])  # not in lease order: the id-by-id path
    complete(stubs, "q", 0, [], ["k"])
    retry(stubs, "q", 0, [queue_pb2.RetryItem(id=retried[0]), queue_pb2.RetryItem(id=retried[1], dead=True)])
    stubs.channel.close()
    proc.kill9()
    proc.start()
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        done = run + loose + keyed
        assert list(complete(stubs, "q", 0, done).already_completed) == done
        again = retry(stubs, "q", 0, [queue_pb2.RetryItem(id=i) for i in retried])
        assert (list(again.already_retried), list(again.dead_ids)) == (retried, [retried[1]])
        assert [i.payload for i in stubs.list_items("q")] == [b"i6"]
    finally:
        stubs.channel.close()


FIXTURE = Path(__file__).resolve().parents[2] / "testdata" / "storage" / "before-done-records.tar.gz"


def test_a_data_directory_from_before_the_records_serves_unchanged(tmp_path: Path) -> None:
    """A queue written by the server before records of completed items existed (the
    fixture's README) opens and serves: its items are all there, an id it completed
    then is unknown (nothing remembered it), and what is completed now is remembered."""
    data = tmp_path / "data"
    with tarfile.open(FIXTURE) as archive:
        archive.extractall(data, filter="data")
    server = ThreadServer(str(data))
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            items = stubs.list_items("old")
            assert sorted(i.payload for i in items) == [b"leased-before", b"ready-before"]
            not_found(stubs.queue.Complete, queue_pb2.CompleteRequest(queue_name="old", partition=0, ids=["1.0.1"]))
            # Whatever is leased now (the fixture's lease, unless its 24 h ran out), then the rest.
            held = [i.id for i in items if i.is_leased]
            taken = held + [i.id for i in lease(stubs, "old", 10).items]
            assert len(taken) == 2
            assert list(complete(stubs, "old", 0, taken).already_completed) == []
            assert list(complete(stubs, "old", 0, taken).already_completed) == taken
            assert stubs.stats("old").partitions[0].total == 0
    finally:
        server.stop()


def test_records_left_at_a_kill9_are_still_forgotten_after_the_restart(proc: ProcessServer) -> None:
    """The sweep's timer is set again from the records found at start, so what a kill -9
    left is forgotten on time with no new completion to wake it."""
    stubs = Stubs(grpc.insecure_channel(proc.address))
    stubs.create("q", lease_timeout={"seconds": 2})
    stubs.produce("q", [b"a"])
    (item,) = lease(stubs, "q", 1).items
    complete(stubs, "q", 0, [item.id])
    assert list(complete(stubs, "q", 0, [item.id]).already_completed) == [item.id]
    stubs.channel.close()
    proc.kill9()
    proc.env = {lifecycle.DONE_RETENTION_FLOOR_ENV: "0"}  # the queue's 2 s alone, not the minute
    proc.start()
    stubs = Stubs(grpc.insecure_channel(proc.address))
    try:
        wait_until(lambda: _forgotten(stubs, item.id), timeout=15)
    finally:
        stubs.channel.close()
