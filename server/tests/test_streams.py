"""ProduceStream and LeaseStream: Produce and Lease carried on one call each, several
requests in flight, one answer per request in the order sent, a failed request answered
with its error while the stream goes on."""

from __future__ import annotations

import queue
import threading
import time
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


def _unary_outcome(call: object, request: object) -> tuple[str, object]:
    from conftest import bad_request_fields

    try:
        return "ok", call(request, timeout=10)  # type: ignore[operator]
    except grpc.RpcError as error:
        fields = bad_request_fields(error) if error.code() == grpc.StatusCode.INVALID_ARGUMENT else []  # type: ignore[attr-defined]
        return error.code().name, fields  # type: ignore[attr-defined]


def _stream_outcome(call: object, wrapper: type, request: object) -> tuple[str, object]:
    [answer] = list(call(iter([wrapper(request=request)]), timeout=10))  # type: ignore[operator]
    if answer.WhichOneof("result") == "response":
        return "ok", answer.response
    return grpc.StatusCode(_CODES[answer.error.code]).name, list(answer.error.fields)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def test_each_request_means_on_a_stream_what_it_means_alone(stubs: Stubs) -> None:
    """The same requests, on two identical queues: one as unary calls, one on streams.
    Every answer (status, fields at fault, items) must match."""
    for name in ("unary", "streamed"):
        stubs.create(name, lease_timeout=dur(30))
        stubs.produce(name, [b"a", b"b", b"c", b"d"])
    p = queue_pb2

    def cases(name: str, held: list[str]) -> list[tuple[str, object]]:
        return [
            ("produce", p.ProduceRequest(queue_name=name, items=[p.ProduceItem(payload=b"e", kind="k")])),
            ("produce", p.ProduceRequest(queue_name=name, payloads=[b"f"])),
            ("produce", p.ProduceRequest(queue_name=name)),
            ("produce", p.ProduceRequest(queue_name=name, payloads=[b"x"], items=[p.ProduceItem(payload=b"y")])),
            ("produce", p.ProduceRequest(queue_name="no-such-queue", payloads=[b"x"])),
            ("produce", p.ProduceRequest(queue_name="Bad Name", payloads=[b"x"])),
            ("produce", p.ProduceRequest(queue_name=name, items=[p.ProduceItem(payload=b"x", idempotency_key="k" * 600)])),
            ("lease", p.LeaseRequest(queue_name=name, batch_size=0)),
            ("lease", p.LeaseRequest(queue_name=name, batch_size=2, request_timeout=dur(0))),
            ("lease", p.LeaseRequest(queue_name=name, batch_size=1, request_timeout=dur(0), complete_ids=["1.0.zz"])),
            ("lease", p.LeaseRequest(queue_name=name, batch_size=1, request_timeout=dur(0), complete_ids=["x", "x"])),
            ("lease", p.LeaseRequest(queue_name=name, batch_size=1, request_timeout=dur(0), complete_partition=3, complete_ids=held[:1])),
            ("lease", p.LeaseRequest(queue_name=name, batch_size=10, request_timeout=dur(0), complete_ids=held, columnar=True)),
            ("lease", p.LeaseRequest(queue_name=name, batch_size=10, request_timeout=dur(0))),
        ]

    def held_ids(name: str) -> list[str]:
        return [item.id for item in stubs.list_items(name) if item.is_leased]

    outcomes: dict[str, list[tuple[str, object]]] = {"unary": [], "streamed": []}
    for index in range(len(cases("unary", []))):
        for name in ("unary", "streamed"):
            kind, request = cases(name, held_ids(name))[index]
            if name == "unary":
                call = stubs.queue.Produce if kind == "produce" else stubs.queue.Lease
                outcome = _unary_outcome(call, request)
            else:
                stream = stubs.queue.ProduceStream if kind == "produce" else stubs.queue.LeaseStream
                wrapper = p.ProduceStreamRequest if kind == "produce" else p.LeaseStreamRequest
                outcome = _stream_outcome(stream, wrapper, request)
            outcomes[name].append(_comparable(outcome))
    assert outcomes["streamed"] == outcomes["unary"]
    assert [status for status, _ in outcomes["unary"]] == [
        "ok", "ok", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "NOT_FOUND", "INVALID_ARGUMENT", "INVALID_ARGUMENT",
        "INVALID_ARGUMENT", "ok", "NOT_FOUND", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "ok", "ok",
    ]  # fmt: skip
    assert [item.payload for item in stubs.list_items("unary")] == [item.payload for item in stubs.list_items("streamed")]


def _comparable(outcome: tuple[str, object]) -> tuple[str, object]:
    """Ids differ between the two queues (their uids); everything else must not."""
    status, body = outcome
    if status != "ok":
        return status, body
    if isinstance(body, queue_pb2.ProduceResponse):
        return status, (body.partition, len(body.ids), body.duplicates)
    assert isinstance(body, queue_pb2.LeaseResponse)
    rows = [(i.payload, i.kind, i.attempts) for i in body.items]
    columns = list(zip(body.columns.payloads, body.columns.attempts))
    return status, (body.partition, rows, columns)
