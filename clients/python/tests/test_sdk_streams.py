"""AsyncClient over ProduceStream / LeaseStream: the same results and errors as unary
calls, one stream per queue, a new stream after the server restarts, and unary calls
for a server without the streams."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import querator
from querator._cluster import never_sent, node_gone
from querator.testing import server
from querator.v1 import queue_pb2

from conftest import ProcessServer
from sdk_helpers import run, unique


def _calls(srv: Any) -> dict[tuple[str, str, str], float]:
    """querator_rpc_requests_total by (queue, method, code), scraped from the server."""
    url = f"http://127.0.0.1:{srv._server.metrics.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "querator_rpc_requests_total":
                labels = sample.labels
                out[(labels["queue"], labels["method"], labels["code"])] = sample.value
    return out


def test_produce_and_lease_travel_on_streams_with_unary_results(tmp_path: Path) -> None:
    with server(tmp_path / "data", metrics_address="127.0.0.1:0") as srv:

        async def main() -> None:
            async with srv.async_client() as c:
                name, other = unique(), unique()
                await c.create_queue(name, lease_timeout=30)
                await c.create_queue(other)
                result = await c.produce(name, [f"item-{i}" for i in range(2_500)], batch_size=100)
                assert len(result.ids) == 2_500 and len(set(result.ids)) == 2_500
                await c.produce(other, ["o"])
                got: list[bytes] = []
                complete: list[Any] = []
                while True:
                    leased = await c.lease(name, batch_size=300, wait=0, complete=complete)
                    if not leased:
                        break
                    got.extend(item.payload for item in leased)
                    complete = leased
                assert got == [f"item-{i}".encode() for i in range(2_500)]
                assert (await c.queue_stats(name)).total == 0
                # Errors arrive as the unary call's exceptions; the stream goes on.
                with pytest.raises(querator.QueueNotFound):
                    await c.produce(unique("missing"), ["x"])
                with pytest.raises(querator.InvalidRequest) as bad:
                    await c.lease(name, batch_size=5_000, wait=0)
                assert bad.value.field_violations[0].field == "batch_size"
                # The first item, completed by then: sent again, it is answered as done.
                await c.lease(name, batch_size=1, wait=0, complete=[querator.ItemRef(name, 0, result.ids[0])])
                with pytest.raises(querator.ItemNotFound):
                    never = result.ids[0].rsplit(".", 1)[0] + ".fffffff"  # never produced
                    await c.lease(name, batch_size=1, wait=0, complete=[querator.ItemRef(name, 0, never)])
                assert [item.payload for item in await c.lease(other, batch_size=10, wait=0)] == [b"o"]

        run(main())
        calls = _calls(srv)
    produce_ok = sum(v for (q, m, code), v in calls.items() if m == "ProduceStream" and code == "OK")
    lease_ok = sum(v for (q, m, code), v in calls.items() if m == "LeaseStream" and code == "OK")
    assert produce_ok == 26 and lease_ok >= 10
    assert not [key for key in calls if key[1] in ("Produce", "Lease")]


def test_a_restarted_server_gets_a_new_stream(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with server(data) as first:
        address = first.address

        async def before() -> querator.AsyncClient:
            c = querator.AsyncClient(address, retries=0)
            await c.create_queue("jobs")
            await c.produce("jobs", ["one"])
            return c

        loop = asyncio.new_event_loop()
        client = loop.run_until_complete(before())
    try:
        with pytest.raises(querator.Unavailable):  # the stream broke with the server
            loop.run_until_complete(asyncio.wait_for(client.produce("jobs", ["lost"]), 10))
        with server(data, address=address):

            async def after() -> list[bytes]:
                for _ in range(100):  # the channel reconnects on its own
                    try:
                        await client.produce("jobs", ["two"])
                        break
                    except querator.Unavailable:
                        await asyncio.sleep(0.05)
                return [item.payload for item in await client.lease("jobs", batch_size=10, wait=0)]

            assert loop.run_until_complete(asyncio.wait_for(after(), 20)) == [b"one", b"two"]
    finally:
        loop.run_until_complete(client.close())
        loop.close()


def test_a_server_without_streams_gets_unary_calls() -> None:
    """A server of an older version: QueueService with unary Produce and Lease only."""

    async def main() -> None:
        calls: list[str] = []

        async def produce(request: queue_pb2.ProduceRequest, context: Any) -> queue_pb2.ProduceResponse:
            calls.append("Produce")
            count = len(request.payloads) + len(request.items)
            return queue_pb2.ProduceResponse(partition=0, ids=[f"1.0.{i + 1:x}" for i in range(count)])

        async def lease(request: queue_pb2.LeaseRequest, context: Any) -> queue_pb2.LeaseResponse:
            calls.append("Lease")
            return queue_pb2.LeaseResponse(queue_name=request.queue_name, partition=0)

        handlers = {
            "Produce": grpc.unary_unary_rpc_method_handler(
                produce,
                request_deserializer=queue_pb2.ProduceRequest.FromString,
                response_serializer=queue_pb2.ProduceResponse.SerializeToString,
            ),
            "Lease": grpc.unary_unary_rpc_method_handler(
                lease,
                request_deserializer=queue_pb2.LeaseRequest.FromString,
                response_serializer=queue_pb2.LeaseResponse.SerializeToString,
            ),
        }
        old = grpc.aio.server()
        old.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("querator.v1.QueueService", handlers),))
        port = old.add_insecure_port("127.0.0.1:0")
        await old.start()
        try:
            async with querator.AsyncClient(f"127.0.0.1:{port}") as c:
                assert (await c.produce("q", ["a", "b"])).ids == ["1.0.1", "1.0.2"]
                assert await c.lease("q", batch_size=5, wait=0) == []
                await c.produce("q", ["c"])
            assert calls == ["Produce", "Lease", "Produce"]
            # Every new client finds out again, and gets its answer.
            for _ in range(20):
                async with querator.AsyncClient(f"127.0.0.1:{port}") as fresh:
                    assert len((await fresh.produce("q", [b"x"])).ids) == 1
            calls.clear()
            async with querator.AsyncClient(f"127.0.0.1:{port}") as c:
                async with querator.AsyncProducer(c, "q", max_items=2, max_latency=0.01) as producer:
                    assert await (await producer.produce(b"i")) == "1.0.1"
            assert calls == ["Produce"]
        finally:
            await old.stop(None)

    run(main())


def test_streams_can_be_turned_off(tmp_path: Path) -> None:
    with server(tmp_path / "data", metrics_address="127.0.0.1:0") as srv:

        async def main() -> None:
            async with querator.AsyncClient(srv.address, streams=False) as c:
                await c.create_queue("u")
                await c.produce("u", ["x"])
                assert [item.payload for item in await c.lease("u", batch_size=1, wait=0)] == [b"x"]

        run(main())
        calls = _calls(srv)
    assert calls[("u", "Produce", "OK")] == 1 and calls[("u", "Lease", "OK")] == 1
    assert not [key for key in calls if key[1].endswith("Stream")]


def test_an_abandoned_lease_takes_nothing(tmp_path: Path) -> None:
    with server(tmp_path / "data") as srv:

        async def main() -> None:
            async with srv.async_client() as waiter, srv.async_client() as other:
                await waiter.create_queue("w", lease_timeout=60)
                waiting = asyncio.create_task(waiter.lease("w", batch_size=5, wait=10))
                patient = asyncio.create_task(waiter.lease("w", batch_size=5, wait=10))
                await asyncio.sleep(0.3)  # both parked on the server, nothing ready
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                # The other lease on the same stream lost its call with it, and asks again.
                await asyncio.sleep(0.2)
                await other.produce("w", ["for the patient one"])
                assert [item.payload for item in await patient] == [b"for the patient one"]
                await asyncio.sleep(0.2)  # the cancelled stream reaches the server
                await other.produce("w", ["x"])
                got = await other.lease("w", batch_size=5, wait=5)
                assert [item.payload for item in got] == [b"x"]
                # The waiter's next lease opens a new stream and works.
                await other.produce("w", ["y"])
                assert [item.payload for item in await waiter.lease("w", batch_size=5, wait=5)] == [b"y"]

        run(main())


def test_a_client_keeps_a_bounded_number_of_streams_open(tmp_path: Path) -> None:
    from querator._streams import MAX_STREAMS

    with server(tmp_path / "data") as srv:
        open_streams = srv._server._queue_service._stream_readers  # the server's own count

        async def main() -> None:
            async with srv.async_client() as c:
                names = [f"many-{i}" for i in range(MAX_STREAMS + 8)]
                for name in names:
                    await c.create_queue(name)
                    await c.produce(name, ["x"])
                await asyncio.sleep(0.2)  # closed streams reach the server
                assert len(open_streams) <= MAX_STREAMS
                for name in names:  # every queue still works, reopening as needed
                    assert [item.payload for item in await c.lease(name, batch_size=5, wait=0)] == [b"x"]
                await asyncio.sleep(0.2)
                assert len(open_streams) <= MAX_STREAMS

        run(main())


def test_a_write_on_a_stream_whose_server_was_killed_is_a_lost_node_not_a_server_error(tmp_path: Path) -> None:
    """kill -9 with one Produce in flight on the stream, then a Produce written on the
    same stream before this process learnt of the kill: gRPC fails that write and ends
    the call INTERNAL "Internal error from Core" (its own status, not the server's).
    Both are the node going away: the one in flight has an unknown outcome, the one
    whose write failed never reached the server (safe to send to another node)."""
    srv = ProcessServer(str(tmp_path / "data"))
    srv.start()
    try:

        async def main() -> list[BaseException]:
            async with querator.AsyncClient(srv.address, timeout=20) as client:
                name = unique()
                await client.create_queue(name)
                await client.produce(name, ["opens the stream"])
                assert srv.proc is not None
                srv.proc.send_signal(signal.SIGSTOP)  # the next one is written, never answered
                in_flight = asyncio.create_task(client.produce(name, ["in flight"]))
                await asyncio.sleep(0.5)
                channel = client._transport._node("")[0]
                srv.kill9()
                # Blocking, so this loop does not run: the stream's call does not learn of
                # the kill, while the channel connects again to the restarted server and
                # so looks fit to write on.
                srv.start()
                deadline = time.monotonic() + 30
                while channel.get_state(try_to_connect=True) is not grpc.ChannelConnectivity.READY:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                unwritten = asyncio.create_task(client.produce(name, ["unwritten"]))
                outcomes = await asyncio.gather(in_flight, unwritten, return_exceptions=True)
                errors = [o for o in outcomes if isinstance(o, BaseException)]
                assert len(errors) == 2, outcomes
                # The server is back: the next request opens a new stream and is stored.
                await client.produce(name, ["after"])
                assert [i.payload for i in await client.lease(name, batch_size=10, wait=0)] == [b"opens the stream", b"after"]
                return errors

        in_flight, unwritten = run(main(), timeout=90)
    finally:
        srv.stop()
    for error in (in_flight, unwritten):
        assert isinstance(error, querator.Unavailable), repr(error)  # not ServerError INTERNAL
        assert node_gone(error)
    assert not never_sent(in_flight)  # written: its outcome is unknown
    assert never_sent(unwritten)
    assert isinstance(unwritten.__cause__, grpc.aio.AioRpcError)
    assert unwritten.__cause__.code() is grpc.StatusCode.INTERNAL  # what gRPC said of the write


def test_an_internal_answer_on_a_stream_still_reaches_the_caller_as_a_server_error(tmp_path: Path) -> None:
    """A request the server answers INTERNAL on the stream (its step raised: an injected
    fault, faults.py) is the server's answer, not a broken connection: ServerError, and
    the stream goes on."""
    srv = ProcessServer(str(tmp_path / "data"), env={"QUERATOR_REQUEST_FAULTS": "1"})
    srv.start()
    try:

        async def main() -> None:
            async with querator.AsyncClient(srv.address, timeout=20) as healthy:
                name = unique()
                await healthy.create_queue(name)
            faulty = querator.AsyncClient(srv.address, timeout=20, metadata=(("querator-fault", "apply"),))
            async with faulty:
                for _ in range(2):
                    with pytest.raises(querator.ServerError) as raised:
                        await faulty.produce(name, ["x"])
                    assert raised.value.code is grpc.StatusCode.INTERNAL
                    assert not node_gone(raised.value) and not never_sent(raised.value)
                (stream,) = faulty._transport.streams.all()
                assert stream._current is not None and not stream._current.call.done()  # it went on

        run(main(), timeout=60)
    finally:
        srv.stop()


def test_a_key_whose_role_may_not_use_a_stream_fails_its_request_at_once(tmp_path: Path) -> None:
    # The server ends such a stream PERMISSION_DENIED as it opens: the request fails with
    # the unary call's PermissionDenied, neither retried nor sent again as a unary call.
    admin_token = "bootstrap-admin-token-for-stream-tests-0123456789"
    with server(tmp_path / "data", admin_token=admin_token, metrics_address="127.0.0.1:0") as srv:
        with srv.client() as admin:
            admin.create_queue("orders")
            producer = admin.create_key("producer", ["orders"])
            consumer = admin.create_key("consumer", ["orders"])

        async def main() -> None:
            async with srv.async_client(bearer_token=producer.token, timeout=20) as c:
                assert (await c.produce("orders", ["a"])).ids
                for _ in range(2):  # the next request opens a stream again, and is refused again
                    started = time.monotonic()
                    with pytest.raises(querator.PermissionDenied) as denied:
                        await c.lease("orders", wait=5)
                    assert time.monotonic() - started < 4  # not the wait, nor the 20 s timeout
                    assert str(denied.value).endswith(f"key {producer.key_id} (producer) may not consume")
            async with srv.async_client(bearer_token=consumer.token, timeout=20) as c:
                with pytest.raises(querator.PermissionDenied) as denied:
                    await c.produce("orders", ["b"])
                assert str(denied.value).endswith(f"key {consumer.key_id} (consumer) may not produce")
                assert [item.payload for item in await c.lease("orders", wait=0)] == [b"a"]

        run(main())
        calls = _calls(srv)
    assert not [key for key in calls if key[1] in ("Produce", "Lease")]  # no unary fallback
    assert calls[("orders", "ProduceStream", "OK")] == 1 and calls[("orders", "LeaseStream", "OK")] == 1
    # Refused as the streams opened, not message by message on an open stream.
    assert not [key for key in calls if key[2] == "PERMISSION_DENIED"]
