"""PauseQueue / ResumeQueue on a single server: leases wait, produce goes on (unless
paused for produce too), the lifecycle goes on, and the pause survives kill -9."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import field_mask_pb2, timestamp_pb2

from querator.v1 import queue_pb2, queues_pb2

from conftest import ProcessServer, Stubs, ThreadServer, bad_request_fields, dur, wait_until


def pause(stubs: Stubs, name: str, produce: bool = False) -> queues_pb2.QueueInfo:
    return stubs.queues.PauseQueue(queues_pb2.PauseQueueRequest(queue_name=name, produce=produce), timeout=10).queue


def resume(stubs: Stubs, name: str) -> queues_pb2.QueueInfo:
    return stubs.queues.ResumeQueue(queues_pb2.ResumeQueueRequest(queue_name=name), timeout=10).queue


def get(stubs: Stubs, name: str) -> queues_pb2.QueueInfo:
    return stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name=name), timeout=10).queue


def payloads(response: queue_pb2.LeaseResponse) -> list[bytes]:
    return [item.payload for item in response.items]


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as executor:
        yield executor


def test_a_paused_queue_keeps_taking_produce_and_hands_out_nothing_until_resumed(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"a"])
    info = pause(stubs, "q")
    assert (info.paused, info.produce_paused) == (True, False)
    assert (get(stubs, "q").paused, get(stubs, "q").produce_paused) == (True, False)
    stubs.produce("q", [b"b"])
    started = time.monotonic()
    assert payloads(stubs.lease("q", request_timeout=dur(0.5))) == []
    assert time.monotonic() - started >= 0.45  # it waited its timeout, as on an empty queue
    assert stubs.lease("q", request_timeout=dur(0)).items == []
    assert stubs.stats("q").partitions[0].total == 2
    info = resume(stubs, "q")
    assert (info.paused, info.produce_paused) == (False, False)
    assert payloads(stubs.lease("q", request_timeout=dur(0))) == [b"a", b"b"]


def test_a_waiting_lease_gets_items_when_the_queue_is_resumed(stubs: Stubs, pool: ThreadPoolExecutor) -> None:
    stubs.create("q")
    pause(stubs, "q")
    waiting = pool.submit(stubs.lease, "q", 10, "", 20, request_timeout=dur(15))
    wait_until(lambda: stubs.stats("q").lease_waiting == 1)
    stubs.produce("q", [b"x", b"y"])  # a cycle runs with the parked lease: still nothing for it
    time.sleep(0.3)
    assert not waiting.done()
    started = time.monotonic()
    resume(stubs, "q")
    assert payloads(waiting.result(10)) == [b"x", b"y"]
    assert time.monotonic() - started < 5  # woken by the resume, not by its timeout
    assert stubs.stats("q").lease_waiting == 0


def test_a_lease_stream_waits_while_paused(stubs: Stubs) -> None:
    stubs.create("q")
    pause(stubs, "q")
    stubs.produce("q", [b"s"])
    more = threading.Event()

    def send() -> Iterator[queue_pb2.LeaseStreamRequest]:
        for wait in (0.3, 15.0):
            yield queue_pb2.LeaseStreamRequest(
                request=queue_pb2.LeaseRequest(queue_name="q", batch_size=5, request_timeout=dur(wait))
            )
            more.wait(20)

    answers = stubs.queue.LeaseStream(send(), timeout=30)
    first = next(answers)
    assert first.response.items == []  # answered empty at its timeout
    more.set()
    wait_until(lambda: stubs.stats("q").lease_waiting == 1)
    resume(stubs, "q")
    second = next(answers)
    assert [i.payload for i in second.response.items] == [b"s"]
    answers.cancel()


def test_paused_for_produce_refuses_produce_naming_the_queue(stubs: Stubs) -> None:
    stubs.create("q")
    info = pause(stubs, "q", produce=True)
    assert (info.paused, info.produce_paused) == (True, True)
    with pytest.raises(grpc.RpcError) as err:
        stubs.produce("q", [b"a"])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'q'" in err.value.details() and "paused for produce" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stubs.queue.Produce(queue_pb2.ProduceRequest(queue_name="q", payloads=[b"a"]), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Pausing again without produce lets producers back in; the leases still wait.
    assert pause(stubs, "q").produce_paused is False
    stubs.produce("q", [b"a"])
    assert stubs.lease("q", request_timeout=dur(0)).items == []
    resume(stubs, "q")
    assert payloads(stubs.lease("q", request_timeout=dur(0))) == [b"a"]


def test_the_lifecycle_goes_on_while_paused(stubs: Stubs) -> None:
    stubs.create("dead")
    stubs.create("q", lease_timeout=dur(0.3), expire_timeout=dur(1.5), dead_queue="dead")
    stubs.produce("q", [b"leased", b"done", b"retried", b"extended"])
    leased = stubs.lease("q", request_timeout=dur(0))
    ids = {item.payload: item.id for item in leased.items}
    soon = timestamp_pb2.Timestamp()
    soon.FromNanoseconds(time.time_ns() + 400_000_000)
    stubs.queue.Produce(
        queue_pb2.ProduceRequest(queue_name="q", items=[queue_pb2.ProduceItem(payload=b"scheduled", enqueue_at=soon)]),
        timeout=10,
    )
    pause(stubs, "q")
    # Items leased before the pause are still settled as usual.
    stubs.complete("q", leased.partition, [ids[b"done"]])
    stubs.queue.Retry(
        queue_pb2.RetryRequest(queue_name="q", partition=leased.partition, items=[queue_pb2.RetryItem(id=ids[b"retried"])]),
        timeout=10,
    )
    stubs.queue.Extend(
        queue_pb2.ExtendRequest(queue_name="q", partition=leased.partition, ids=[ids[b"extended"]], lease_timeout=dur(0.8)),
        timeout=10,
    )
    # The leases run out and the scheduled item comes due: all ready, none handed out.
    wait_until(lambda: (s := stubs.stats("q").partitions[0]) and (s.total, s.total_leased, s.scheduled) == (4, 0, 0), timeout=5)
    assert stubs.lease("q", request_timeout=dur(0)).items == []
    # Then they expire and go to the dead-letter queue, pause or not.
    wait_until(lambda: stubs.stats("dead").partitions[0].total == 4, timeout=5)
    assert stubs.stats("q").partitions[0].total == 0
    dead = stubs.lease("dead", request_timeout=dur(0))
    assert sorted(payloads(dead)) == [b"extended", b"leased", b"retried", b"scheduled"]
    assert {i.dead_reason for i in dead.items} == {queue_pb2.DEAD_REASON_EXPIRED}


def test_a_keyed_lease_answers_empty_at_once_and_a_replay_keeps_its_items(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(0.3))
    stubs.produce("q", [b"k1", b"k2"])
    first = stubs.lease("q", batch_size=1, lease_key="held", request_timeout=dur(5))
    assert payloads(first) == [b"k1"]
    pause(stubs, "q")
    started = time.monotonic()
    assert stubs.lease("q", lease_key="new", request_timeout=dur(5)).items == []
    assert time.monotonic() - started < 2  # a keyed lease never waits
    # The replay still answers the items leased under the key, not the ones whose
    # lease ran out meanwhile (handed out again only after the resume).
    assert payloads(stubs.lease("q", lease_key="held", request_timeout=dur(0))) == [b"k1"]
    time.sleep(0.4)
    assert stubs.lease("q", lease_key="held", request_timeout=dur(0)).items == []
    resume(stubs, "q")
    assert payloads(stubs.lease("q", lease_key="held", request_timeout=dur(0))) == [b"k1"]
    assert payloads(stubs.lease("q", request_timeout=dur(0))) == [b"k2"]


def test_pause_and_resume_are_idempotent_and_checked(stubs: Stubs) -> None:
    stubs.create("q")
    assert resume(stubs, "q").paused is False  # not paused: nothing changes
    updated_at = get(stubs, "q").updated_at
    assert resume(stubs, "q").updated_at == updated_at
    pause(stubs, "q")
    assert pause(stubs, "q").paused is True
    with pytest.raises(grpc.RpcError) as err:
        pause(stubs, "missing")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        pause(stubs, "")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and bad_request_fields(err.value) == ["queue_name"]
    # UpdateQueue does not change the pause; it names the calls that do.
    for index, path in enumerate(("paused", "queue.produce_paused")):
        request = queues_pb2.UpdateQueueRequest(
            queue=queues_pb2.QueueInfo(queue_name="q"), update_mask=field_mask_pb2.FieldMask(paths=["reference", path])
        )
        with pytest.raises(grpc.RpcError) as err:
            stubs.queues.UpdateQueue(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad_request_fields(err.value) == ["update_mask.paths[1]"], index
        assert "PauseQueue" in err.value.details()
    # Other settings change while paused, and the pause stays.
    request = queues_pb2.UpdateQueueRequest(
        queue=queues_pb2.QueueInfo(queue_name="q", reference="r"), update_mask=field_mask_pb2.FieldMask(paths=["reference"])
    )
    assert stubs.queues.UpdateQueue(request, timeout=10).queue.paused is True
    listed = stubs.queues.ListQueues(queues_pb2.ListQueuesRequest(), timeout=10).queues
    assert [(q.queue_name, q.paused) for q in listed] == [("q", True)]


def test_the_pause_survives_kill_9(data_dir: str) -> None:
    server = ProcessServer(data_dir)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            stubs.create("held")
            stubs.create("shut")
            stubs.produce("held", [b"a"])
            pause(stubs, "held")
            pause(stubs, "shut", produce=True)
        server.kill9()
        server.start()
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            assert (get(stubs, "held").paused, get(stubs, "held").produce_paused) == (True, False)
            assert (get(stubs, "shut").paused, get(stubs, "shut").produce_paused) == (True, True)
            assert stubs.lease("held", request_timeout=dur(0.2)).items == []
            with pytest.raises(grpc.RpcError) as err:
                stubs.produce("shut", [b"b"])
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            resume(stubs, "held")
        server.kill9()
        server.start()
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            assert get(stubs, "held").paused is False
            assert payloads(stubs.lease("held", request_timeout=dur(0))) == [b"a"]
    finally:
        server.stop()


def test_the_paused_metric(data_dir: str) -> None:
    server = ThreadServer(data_dir, metrics_address="127.0.0.1:0")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            for name in ("open", "held", "shut"):
                stubs.create(name)
            pause(stubs, "held")
            pause(stubs, "shut", produce=True)
            assert server.server.metrics is not None
            url = f"http://127.0.0.1:{server.server.metrics.port}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            lines = {line for line in text.splitlines() if line.startswith("querator_queue_paused{")}
            assert lines == {
                'querator_queue_paused{queue="open"} 0.0',
                'querator_queue_paused{queue="held"} 1.0',
                'querator_queue_paused{queue="shut"} 2.0',
            }
    finally:
        server.stop()


def test_a_lease_that_completes_while_paused_completes_and_then_waits(stubs: Stubs) -> None:
    stubs.create("q")
    stubs.produce("q", [b"first", b"second"])
    leased = stubs.lease("q", batch_size=1, request_timeout=dur(0))
    pause(stubs, "q")
    started = time.monotonic()
    again = stubs.lease(
        "q", complete_ids=[leased.items[0].id], complete_partition=leased.partition, request_timeout=dur(0.4)
    )
    assert again.items == [] and time.monotonic() - started >= 0.35
    assert stubs.stats("q").partitions[0].total == 1  # "first" is completed for good
    resume(stubs, "q")
    assert payloads(stubs.lease("q", request_timeout=dur(0))) == [b"second"]


def test_pausing_takes_an_admin_key(data_dir: str) -> None:
    from security_helpers import BOOTSTRAP, Authed, new_key

    from querator.v1 import keys_pb2

    server = ThreadServer(data_dir, auth=True, admin_token=BOOTSTRAP)
    try:
        with grpc.insecure_channel(server.address) as channel:
            admin = Authed(channel, BOOTSTRAP)
            admin.create("jobs")
            for role in (keys_pb2.ROLE_PRODUCER, keys_pb2.ROLE_CONSUMER):
                other = Authed(channel, new_key(admin, role, "jobs"))
                for call in (pause, resume):
                    with pytest.raises(grpc.RpcError) as err:
                        call(other, "jobs")
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            scoped = Authed(channel, new_key(admin, keys_pb2.ROLE_ADMIN, "jobs*"))
            assert pause(scoped, "jobs").paused is True
            admin.create("billing")
            with pytest.raises(grpc.RpcError) as err:
                pause(scoped, "billing")
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert resume(scoped, "jobs").paused is False
    finally:
        server.stop()


def test_under_load_nothing_is_handed_out_while_paused_and_everything_once_after(stubs: Stubs) -> None:
    """8 consumers long-polling and a producer adding 500 items while the queue is paused:
    no lease gets an item until the resume, then every item goes out exactly once."""
    stubs.create("busy", requested_partitions=4)
    pause(stubs, "busy")
    stop = threading.Event()
    got: list[bytes] = []
    lock = threading.Lock()

    def consume(index: int) -> None:
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            reply = stubs.lease("busy", 20, f"c{index}", 10, request_timeout=dur(0.3))
            if reply.items:
                stubs.complete("busy", reply.partition, [item.id for item in reply.items])
            with lock:
                got.extend(item.payload for item in reply.items)

    with ThreadPoolExecutor(8) as consumers:
        running = [consumers.submit(consume, i) for i in range(8)]
        for batch in range(50):
            stubs.produce("busy", [f"{batch}-{i}".encode() for i in range(10)])
        wait_until(lambda: stubs.stats("busy").lease_waiting >= 4, timeout=10)
        time.sleep(0.5)
        with lock:
            assert got == []  # 500 ready items, 8 consumers, nothing handed out
        resume(stubs, "busy")
        wait_until(lambda: len(got) >= 500, timeout=30)
        stop.set()
        for future in running:
            future.result(30)
    assert sorted(got) == sorted(f"{b}-{i}".encode() for b in range(50) for i in range(10))
