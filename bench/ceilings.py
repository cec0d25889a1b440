"""The machine's own ceilings, measured in the same run as the workloads.

- gRPC echo: a grpc.aio server whose only handler parses a ProduceRequest of 100 items and
  sends it back; the client is the workloads' producer (same process model, same message
  building, same calls in flight). Calls/s here bound any gRPC produce or lease path.
  With ``stream=True`` the same messages travel on one bidirectional stream (the server
  reads and answers in order, as ProduceStream / LeaseStream do): the bound of those.
- LMDB durable commit: one write transaction of 100 × 256-byte items (keys in order,
  `putmulti(append=True)`), committed with `sync=True, metasync=True` as the server does.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from common import HOST, PAYLOAD_BYTES, Pipe, free_port, on_exit, stop_pid, wait_for_port
from workloads import Producer, Settings, run_phase

_ECHO_METHOD = "Echo"
_ECHO_STREAM = "EchoStream"
_ECHO_SERVICE = "bench.Echo"


def _echo_server(port: int) -> None:
    import grpc

    from querator.v1 import queue_pb2

    async def echo(request: Any, context: Any) -> Any:
        return request

    async def echo_stream(requests: Any, context: Any) -> Any:
        # Read ahead while answering, as the server's streams do.
        pending: asyncio.Queue[Any] = asyncio.Queue(maxsize=64)

        async def read() -> None:
            async for request in requests:
                await pending.put(request)
            await pending.put(None)

        reader = asyncio.create_task(read())
        while (request := await pending.get()) is not None:
            yield request
        await reader

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler(
            _ECHO_SERVICE,
            {
                _ECHO_METHOD: grpc.unary_unary_rpc_method_handler(
                    echo,
                    request_deserializer=queue_pb2.ProduceRequest.FromString,
                    response_serializer=queue_pb2.ProduceRequest.SerializeToString,
                ),
                _ECHO_STREAM: grpc.stream_stream_rpc_method_handler(
                    echo_stream,
                    request_deserializer=queue_pb2.ProduceRequest.FromString,
                    response_serializer=queue_pb2.ProduceRequest.SerializeToString,
                ),
            },
        )
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"{HOST}:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


@dataclass
class EchoClient:
    """Looks like a workload client; produce() is one echo call."""

    address: str
    stream: bool = False
    _state: dict[str, Any] = field(default_factory=dict, repr=False)

    async def open(self) -> None:
        import grpc

        from querator.v1 import queue_pb2

        channel = grpc.aio.insecure_channel(self.address, options=[("grpc.max_receive_message_length", 64 << 20)])
        await channel.channel_ready()
        codec = {
            "request_serializer": queue_pb2.ProduceRequest.SerializeToString,
            "response_deserializer": queue_pb2.ProduceRequest.FromString,
        }
        call = channel.unary_unary(f"/{_ECHO_SERVICE}/{_ECHO_METHOD}", **codec)
        self._state.update(channel=channel, call=call, pb=queue_pb2)
        if self.stream:
            self._state["pipe"] = Pipe(channel.stream_stream(f"/{_ECHO_SERVICE}/{_ECHO_STREAM}", **codec)())

    async def close(self) -> None:
        pipe = self._state.pop("pipe", None)
        if pipe is not None:
            await pipe.close()
        await self._state["channel"].close()

    async def produce(self, queue: str, payloads: list[bytes]) -> None:
        pb = self._state["pb"]
        request = pb.ProduceRequest(queue_name=queue, items=[pb.ProduceItem(payload=p) for p in payloads])
        if self.stream:
            reply = await self._state["pipe"].ask(request)
        else:
            reply = await self._state["call"](request, timeout=60)
        for item in reply.items:  # touch what came back, as a lease reply would be read
            _ = item.payload


def grpc_echo(settings: Settings, calls: int, *, stream: bool = False) -> dict[str, float]:
    port = free_port()
    ctx = mp.get_context("spawn")
    server = ctx.Process(target=_echo_server, args=(port,), daemon=True)
    server.start()
    stop = on_exit("echo server", lambda: stop_pid(server.pid, 5) if server.pid else None)
    try:
        wait_for_port(port, 30)
        client = EchoClient(f"{HOST}:{port}", stream=stream)
        phase = run_phase(client, [Producer(["echo"], calls * settings.batch, settings.produce_inflight)], settings)
        seconds = phase.elapsed_of("produce")
        return {"calls_per_s": calls / seconds, "items_per_s": calls * settings.batch / seconds, "inflight": settings.produce_inflight}
    finally:
        stop()


def lmdb_commit(workdir: str, commits: int, batch: int = 100, time_limit_s: float = 30.0) -> dict[str, float]:
    import lmdb

    path = tempfile.mkdtemp(prefix="lmdb-ceiling-", dir=workdir)
    env = lmdb.open(path, map_size=1 << 30, sync=True, metasync=True)
    try:
        value = os.urandom(PAYLOAD_BYTES)
        key = struct.Struct(">Q")
        n = 0
        start = time.perf_counter()
        deadline = start + time_limit_s
        done = 0
        for _ in range(commits):
            with env.begin(write=True) as txn:
                txn.cursor().putmulti([(key.pack(n + i), value) for i in range(batch)], append=True)
            n += batch
            done += 1
            if time.perf_counter() > deadline:
                break
        seconds = time.perf_counter() - start
        return {"commits_per_s": done / seconds, "items_per_s": done * batch / seconds}
    finally:
        env.close()
        shutil.rmtree(path, ignore_errors=True)
