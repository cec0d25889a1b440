"""ProduceStream and LeaseStream: Produce and Lease carried on one call each, several
requests in flight, one answer per request in the order sent, a failed request answered
with its error while the stream goes on."""

from __future__ import annotations

import queue
import time
import threading
from collections.abc import Iterator

import grpc
import pytest
from querator.v1 import queue_pb2

from conftest import Stubs, ThreadServer, dur


def _produce(name: str, payloads: list[bytes], **kw: object) -> queue_pb2.ProduceStreamRequest:
    items = [queue_pb2.ProduceItem(payload=p) for p in payloads]
    return queue_pb2.ProduceStreamRequest(request=queue_pb2.ProduceRequest(queue_name=name, items=items, **kw))  # type: ignore[arg-type]


def _lease(name: str, batch_size: int, **kw: object) -> queue_pb2.LeaseStreamRequest:
    return queue_pb2.LeaseStreamRequest(request=queue_pb2.LeaseRequest(queue_name=name, batch_size=batch_size, **kw))  # type: ignore[arg-type]


def test_produce_stream_answers_every_request_in_order(stubs: Stubs) -> None:
    stubs.create("q")
    requests = [_produce("q", [f"{n}-{i}".encode() for i in range(10)]) for n in range(50)]
    answers = list(stubs.queue.ProduceStream(iter(requests), timeout=30))
    assert len(answers) == 50
    assert all(a.WhichOneof("result") == "response" and len(a.response.ids) == 10 for a in answers)
    ids = [i for a in answers for i in a.response.ids]
    assert len(set(ids)) == 500
    # Stored in the order sent: the ids of the answers are the order of the queue.
    stored = stubs.list_items("q")
    assert [item.id for item in stored] == ids
    assert [item.payload for item in stored] == [f"{n}-{i}".encode() for n in range(50) for i in range(10)]


def test_a_failed_request_is_answered_with_its_error_and_the_stream_goes_on(stubs: Stubs) -> None:
    stubs.create("q")
    requests = [
        _produce("q", [b"first"]),
        _produce("missing", [b"x"]),
        _produce("q", []),
        _produce("Not A Name!", [b"x"]),
        _produce("q", [b"last"]),
    ]
    answers = list(stubs.queue.ProduceStream(iter(requests), timeout=30))
    kinds = [a.WhichOneof("result") for a in answers]
    assert kinds == ["response", "error", "error", "error", "response"]
    assert answers[1].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "missing" in answers[1].error.message
    assert answers[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert answers[2].error.fields == ["items"]
    assert answers[3].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert answers[3].error.fields == ["queue_name"]
    assert [item.payload for item in stubs.list_items("q")] == [b"first", b"last"]


def test_a_malformed_message_is_answered_invalid_argument(server: ThreadServer) -> None:
    channel = grpc.insecure_channel(server.address)
    stubs = Stubs(channel)
    stubs.create("q")
    raw = channel.stream_stream(
        "/querator.v1.QueueService/ProduceStream",
        request_serializer=lambda b: b,
        response_deserializer=queue_pb2.ProduceStreamResponse.FromString,
    )
    good = _produce("q", [b"ok"]).SerializeToString()
    answers = list(raw(iter([good, b"\xff\xff\xff", good]), timeout=30))
    assert [a.WhichOneof("result") for a in answers] == ["response", "error", "response"]
    assert answers[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "ProduceStreamRequest" in answers[1].error.message
    channel.close()


def test_lease_stream_leases_and_completes_like_lease(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(30))
    stubs.produce("q", [str(i).encode() for i in range(300)])
    # A consumer that completes each batch with its next lease, over one stream.
    outbox: queue.Queue[queue_pb2.LeaseStreamRequest | None] = queue.Queue()

    def requests() -> Iterator[queue_pb2.LeaseStreamRequest]:
        while (request := outbox.get()) is not None:
            yield request

    outbox.put(_lease("q", 100, request_timeout=dur(0), columnar=True))
    got: list[bytes] = []
    answers = stubs.queue.LeaseStream(requests(), timeout=30)
    for answer in answers:
        assert answer.WhichOneof("result") == "response", answer
        columns = answer.response.columns
        got.extend(columns.payloads)
        if not columns.ids:
            outbox.put(None)
            continue
        outbox.put(
            _lease(
                "q",
                100,
                request_timeout=dur(0),
                columnar=True,
                complete_ids=list(columns.ids),
                complete_partition=answer.response.partition,
            )
        )
    assert got == [str(i).encode() for i in range(300)]
    assert stubs.list_items("q") == []


def test_a_waiting_lease_holds_back_the_answers_behind_it(stubs: Stubs) -> None:
    stubs.create("a")
    stubs.create("b")
    stubs.produce("b", [b"ready"])
    outbox: queue.Queue[queue_pb2.LeaseStreamRequest | None] = queue.Queue()

    def requests() -> Iterator[queue_pb2.LeaseStreamRequest]:
        while (request := outbox.get()) is not None:
            yield request

    outbox.put(_lease("a", 1, request_timeout=dur(10)))  # waits for an item of "a"
    outbox.put(_lease("b", 1, request_timeout=dur(0)))  # served at once, answered second
    answers = stubs.queue.LeaseStream(requests(), timeout=30)
    seen: list[queue_pb2.LeaseStreamResponse] = []
    reader = threading.Thread(target=lambda: seen.extend(answers))
    reader.start()
    reader.join(0.5)
    assert seen == []  # b's answer waits behind a's
    stubs.produce("a", [b"late"])
    outbox.put(None)
    reader.join(10)
    assert [a.response.items[0].payload for a in seen] == [b"late", b"ready"]


def test_a_lease_waiting_on_a_cancelled_stream_takes_nothing(stubs: Stubs) -> None:
    stubs.create("q", lease_timeout=dur(30))
    stubs.produce("q", [b"x"])
    outbox: queue.Queue[queue_pb2.LeaseStreamRequest | None] = queue.Queue()

    def requests() -> Iterator[queue_pb2.LeaseStreamRequest]:
        while (request := outbox.get()) is not None:
            yield request

    outbox.put(_lease("q", 1, request_timeout=dur(10)))
    outbox.put(_lease("q", 1, request_timeout=dur(10)))  # waits: nothing more is ready
    call = stubs.queue.LeaseStream(requests(), timeout=30)
    first = next(call)
    assert first.response.items[0].payload == b"x"
    call.cancel()
    outbox.put(None)
    with pytest.raises(grpc.RpcError) as caught:
        next(call)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    # The second lease was still waiting when the stream ended: a new item goes to others.
    stubs.produce("q", [b"y"])
    assert [item.payload for item in stubs.lease("q", 10, request_timeout=dur(2)).items] == [b"y"]
    assert stubs.stats("q").partitions[0].total_leased == 2  # x by the stream, y by that lease


def test_stopping_the_server_ends_an_idle_stream_at_once(data_dir: str) -> None:
    srv = ThreadServer(data_dir, shutdown_grace_s=10.0)
    channel = grpc.insecure_channel(srv.address)
    stubs = Stubs(channel)
    stubs.create("q")
    outbox: queue.Queue[queue_pb2.ProduceStreamRequest | None] = queue.Queue()

    def requests() -> Iterator[queue_pb2.ProduceStreamRequest]:
        while (request := outbox.get()) is not None:
            yield request

    call = stubs.queue.ProduceStream(requests(), timeout=30)
    outbox.put(_produce("q", [b"a"]))
    assert next(call).WhichOneof("result") == "response"
    started = time.monotonic()
    srv.stop(grace=10.0)
    assert list(call) == []  # ended with OK, nothing unanswered
    assert time.monotonic() - started < 5
    outbox.put(None)
    channel.close()
