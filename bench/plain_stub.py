"""The plain generated-stub caller: blocking unary calls, one in flight, items as sub-messages.

Most callers of the service use the stubs `protoc` generates and nothing else: a blocking
`Produce` with `ProduceItem` sub-messages, a `Lease`, then a `Complete` with the ids, one
call at a time. No streams, no compact form, no `complete_ids`, no columnar replies. This
module drives the server (and Redis Streams, the same way) like that:

- ``PlainQueratorClient`` / ``PlainRedisClient``: workload clients (workloads.py's
  interface) whose calls block the client process's loop, so a process has exactly one
  call in flight. W5 runs W1 and W2 with them.
- ``latency``: p50/p99 of Produce(1 item), Produce(100), Lease(100) and Complete(100 ids)
  from one blocking stub, and the floors of the same run: a grpc.aio server that answers
  Produce without storing anything, and one durable LMDB commit of one put.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import workloads
from common import HOST, PAYLOAD_BYTES, free_port, median, on_exit, percentile, stop_pid, wait_for_port

_MAX_MESSAGE = 64 << 20
LEASE_TIMEOUT_S = 300


def _duration(seconds: float) -> Any:
    from google.protobuf.duration_pb2 import Duration

    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


@dataclass
class PlainQueratorClient:
    """Blocking generated stubs, one call at a time, ``ProduceItem`` sub-messages."""

    address: str
    _state: dict[str, Any] = field(default_factory=dict, repr=False)

    async def open(self) -> None:
        self.open_sync()

    def open_sync(self) -> None:
        import grpc

        from querator.v1 import queue_pb2, queue_pb2_grpc, queues_pb2, queues_pb2_grpc

        channel = grpc.insecure_channel(
            self.address,
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE), ("grpc.max_send_message_length", _MAX_MESSAGE)],
        )
        grpc.channel_ready_future(channel).result(timeout=30)
        self._state.update(
            channel=channel,
            pb=queue_pb2,
            qpb=queues_pb2,
            queue=queue_pb2_grpc.QueueServiceStub(channel),
            queues=queues_pb2_grpc.QueuesServiceStub(channel),
        )

    async def close(self) -> None:
        channel = self._state.pop("channel", None)
        if channel is not None:
            channel.close()

    async def create_queue(self, name: str, partitions: int) -> None:
        qpb = self._state["qpb"]
        info = qpb.QueueInfo(
            queue_name=name,
            requested_partitions=partitions,
            lease_timeout=_duration(LEASE_TIMEOUT_S),
            expire_timeout=_duration(24 * 3600),
        )
        self._state["queues"].CreateQueue(qpb.CreateQueueRequest(queue=info), timeout=30)

    async def drop_queue(self, name: str) -> None:
        qpb = self._state["qpb"]
        self._state["queues"].DeleteQueue(qpb.DeleteQueueRequest(queue_name=name, force=True), timeout=120)

    async def count(self, name: str) -> int:
        qpb = self._state["qpb"]
        stats = self._state["queues"].GetQueueStats(qpb.GetQueueStatsRequest(queue_name=name), timeout=30)
        return sum(p.total + p.scheduled for p in stats.partitions)

    async def produce(self, queue: str, payloads: list[bytes]) -> None:
        self.produce_sync(queue, payloads)

    def produce_sync(self, queue: str, payloads: list[bytes]) -> None:
        pb = self._state["pb"]
        request = pb.ProduceRequest(queue_name=queue, items=[pb.ProduceItem(payload=p) for p in payloads])
        self._state["queue"].Produce(request, timeout=60)

    async def lease(self, queue: str, client_id: str, batch: int, wait_s: float) -> tuple[object, list[bytes]]:
        return self.lease_sync(queue, client_id, batch, wait_s)

    def lease_sync(self, queue: str, client_id: str, batch: int, wait_s: float) -> tuple[object, list[bytes]]:
        pb = self._state["pb"]
        request = pb.LeaseRequest(queue_name=queue, batch_size=batch, client_id=client_id, request_timeout=_duration(wait_s))
        reply = self._state["queue"].Lease(request, timeout=wait_s + 30)
        items = reply.items
        return (reply.partition, [item.id for item in items]), [item.payload for item in items]

    async def complete(self, queue: str, token: object) -> None:
        self.complete_sync(queue, token)

    def complete_sync(self, queue: str, token: object) -> None:
        partition, ids = token  # type: ignore[misc]
        if ids:
            pb = self._state["pb"]
            self._state["queue"].Complete(pb.CompleteRequest(queue_name=queue, partition=partition, ids=ids), timeout=60)

    async def finish(self, queue: str, client_id: str) -> None:
        return None


@dataclass
class PlainRedisClient:
    """Redis Streams driven the same way: a blocking client, one pipeline per batch."""

    port: int
    _state: dict[str, Any] = field(default_factory=dict, repr=False)

    async def open(self) -> None:
        import redis

        client = redis.Redis(host=HOST, port=self.port)
        client.ping()
        self._state["r"] = client

    async def close(self) -> None:
        client = self._state.pop("r", None)
        if client is not None:
            client.close()

    async def create_queue(self, name: str, partitions: int) -> None:
        from peers.redis_peer import GROUP

        self._state["r"].xgroup_create(name, GROUP, id="0", mkstream=True)

    async def drop_queue(self, name: str) -> None:
        self._state["r"].delete(name)

    async def count(self, name: str) -> int:
        return int(self._state["r"].xlen(name))

    async def produce(self, queue: str, payloads: list[bytes]) -> None:
        pipe = self._state["r"].pipeline(transaction=False)
        for payload in payloads:
            pipe.xadd(queue, {"p": payload})
        pipe.execute()

    async def lease(self, queue: str, client_id: str, batch: int, wait_s: float) -> tuple[object, list[bytes]]:
        from peers.redis_peer import GROUP

        reply = self._state["r"].xreadgroup(GROUP, client_id, {queue: ">"}, count=batch, block=max(1, int(wait_s * 1000)))
        if not reply:
            return [], []
        entries = reply[0][1]
        return [entry_id for entry_id, _ in entries], [fields[b"p"] for _, fields in entries]

    async def complete(self, queue: str, token: object) -> None:
        from peers.redis_peer import GROUP

        ids = token
        if ids:
            pipe = self._state["r"].pipeline(transaction=False)
            pipe.xack(queue, GROUP, *ids)  # type: ignore[misc]
            pipe.xdel(queue, *ids)  # type: ignore[misc]
            pipe.execute()

    async def finish(self, queue: str, client_id: str) -> None:
        return None


def plain_client(client: Any) -> Any:
    """The plain-stub twin of a run.py client (ours or Redis)."""
    if hasattr(client, "address"):
        return PlainQueratorClient(client.address)
    return PlainRedisClient(client.port)


# --- latency table ------------------------------------------------------------------------


def _null_server(port: int) -> None:
    """A grpc.aio server whose Produce parses the request and answers without storing."""
    import asyncio

    import grpc

    from querator.v1 import queue_pb2

    async def produce(request: Any, context: Any) -> Any:
        return queue_pb2.ProduceResponse()

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler(
            "querator.v1.QueueService",
            {
                "Produce": grpc.unary_unary_rpc_method_handler(
                    produce,
                    request_deserializer=queue_pb2.ProduceRequest.FromString,
                    response_serializer=queue_pb2.ProduceResponse.SerializeToString,
                )
            },
        )
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", _MAX_MESSAGE)])
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"{HOST}:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _stats(samples_ns: list[int]) -> dict[str, float]:
    ms = sorted(x / 1e6 for x in samples_ns)
    return {"p50": percentile(ms, 50), "p99": percentile(ms, 99), "n": float(len(ms))}


def _time_calls(fn: Any, n: int, time_limit_s: float) -> list[int]:
    out: list[int] = []
    deadline = time.monotonic() + time_limit_s
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t)
        if time.monotonic() > deadline:
            break
    return out


def _latency_child(address: str, null_address: str, calls: int, time_limit_s: float, out: Any) -> None:
    """Runs in its own process so the client never shares a GIL with anything measured."""
    try:
        payload = os.urandom(PAYLOAD_BYTES)
        hundred = [payload] * 100
        ours = PlainQueratorClient(address)
        ours.open_sync()
        null = PlainQueratorClient(null_address)
        null.open_sync()
        import asyncio

        queue = f"latency-{os.getpid()}"
        asyncio.run(ours.create_queue(queue, 1))
        results: dict[str, dict[str, float]] = {}
        for _ in range(50):  # warm both channels and the server's paths
            ours.produce_sync(queue, [payload])
            null.produce_sync(queue, [payload])
        results["floor: gRPC Produce(1) answered without storing"] = _stats(_time_calls(lambda: null.produce_sync(queue, [payload]), calls, time_limit_s))
        results["floor: gRPC Produce(100) answered without storing"] = _stats(_time_calls(lambda: null.produce_sync(queue, hundred), calls // 2, time_limit_s))
        results["Produce, 1 item of 256 B"] = _stats(_time_calls(lambda: ours.produce_sync(queue, [payload]), calls, time_limit_s))
        results["Produce, 100 items"] = _stats(_time_calls(lambda: ours.produce_sync(queue, hundred), calls // 2, time_limit_s))
        # Lease and Complete alternate: each Lease takes 100 of the items produced above.
        tokens: list[Any] = []
        lease_ns: list[int] = []
        complete_ns: list[int] = []
        deadline = time.monotonic() + time_limit_s
        for _ in range(calls // 2):
            t = time.perf_counter_ns()
            token, got = ours.lease_sync(queue, "latency", 100, 0.01)
            lease_ns.append(time.perf_counter_ns() - t)
            if not got:
                lease_ns.pop()
                break
            t = time.perf_counter_ns()
            ours.complete_sync(queue, token)
            complete_ns.append(time.perf_counter_ns() - t)
            tokens.append(len(got))
            if time.monotonic() > deadline:
                break
        results["Lease, batch 100"] = _stats(lease_ns)
        results["Complete, 100 ids"] = _stats(complete_ns)
        asyncio.run(ours.drop_queue(queue))
        out.put((None, results))
    except BaseException as exc:
        out.put((f"{type(exc).__name__}: {exc}", None))


def lmdb_one_put(workdir: str, commits: int, time_limit_s: float = 30.0) -> dict[str, float]:
    """One durable LMDB commit of one 256-byte put (sync, metasync, as the server opens its stores)."""
    import lmdb

    path = tempfile.mkdtemp(prefix="lmdb-one-", dir=workdir)
    try:
        env = lmdb.open(path, map_size=1 << 30, sync=True, metasync=True)
        payload = os.urandom(PAYLOAD_BYTES)
        samples: list[int] = []
        deadline = time.monotonic() + time_limit_s
        for i in range(commits):
            t = time.perf_counter_ns()
            with env.begin(write=True) as txn:
                txn.put(i.to_bytes(8, "big"), payload)
            samples.append(time.perf_counter_ns() - t)
            if time.monotonic() > deadline:
                break
        env.close()
        return _stats(samples)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def latency(address: str, workdir: str, calls: int = 2000, time_limit_s: float = 60.0) -> dict[str, dict[str, float]]:
    """The four calls' p50/p99 against ``address`` and the two floors, in one run."""
    ctx = mp.get_context("spawn")
    port = free_port()
    server = ctx.Process(target=_null_server, args=(port,), daemon=True)
    server.start()
    stop = on_exit("null server", lambda: stop_pid(server.pid, 5) if server.pid else None)
    try:
        wait_for_port(port, 30)
        out = ctx.Queue()
        child = ctx.Process(target=_latency_child, args=(address, f"{HOST}:{port}", calls, time_limit_s, out), daemon=True)
        child.start()
        error, results = out.get(timeout=time_limit_s * 6 + 60)
        child.join(30)
        if error:
            raise RuntimeError(f"latency client failed: {error}")
    finally:
        stop()
    results["floor: one durable LMDB commit of one put"] = lmdb_one_put(workdir, calls)
    return results  # type: ignore[no-any-return]


def w5(client: Any, workdir: str, s: workloads.Settings, repeat: int, *, with_latency: bool) -> dict[str, Any]:
    """W1 (median of ``repeat``) and W2 at full load through the plain client of ``client``,
    every process with one call in flight; for ours also the latency table."""
    plain = plain_client(client)
    one = dataclasses.replace(s, produce_inflight=1, consume_inflight=1)
    runs = [workloads.w1(plain, one) for _ in range(repeat)]
    w2 = workloads.w2(plain, one, half=False)
    result: dict[str, Any] = {
        "produce": median([r["produce"] for r in runs]),
        "drain": median([r["drain"] for r in runs]),
        "total": w2["total"],
        "runs": runs,
    }
    if with_latency:
        result["latency"] = latency(client.address, workdir)
    return result
