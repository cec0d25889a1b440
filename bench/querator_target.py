"""Querator as a benchmark target: the server as a subprocess, a raw grpc.aio client.

The client uses the generated stubs directly (no SDK), one channel per client
process, so the figures measure the server and the wire, not a client library.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from common import HOST, Pipe, free_port, on_exit, start_owned, wait_for_port

NAME = "Querator"
_MAX_MESSAGE = 64 << 20
LEASE_TIMEOUT_S = 300  # long enough that no lease expires during a workload


def _serve_argv(address: str, data_dir: str) -> list[str]:
    # The server package's own entry point (what `querator serve` runs).
    return [sys.executable, "-m", "querator_server.cli", "--address", address, "--data-dir", data_dir, "--log-level", "warning"]


def export_commit(rev: str, repo_dir: str, dest: str) -> str:
    """Copy the server and client sources of one commit into dest (git archive); returns the commit."""
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--verify", rev + "^{commit}"], cwd=repo_dir, capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.Popen(["git", "archive", commit, "server/src", "clients/python/src"], cwd=repo_dir, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise RuntimeError(f"git archive {commit} failed")
    return commit


class QueratorService:
    """`querator serve` on a free 127.0.0.1 port with a throw-away data dir (durable, fsync on)."""

    name = NAME

    def __init__(self, workdir: str, source_dir: str | None = None) -> None:
        self.workdir = workdir
        self.source_dir = source_dir  # an exported commit (export_commit); None: the installed packages
        self.pid = 0
        self._stop = None

    def start(self) -> QueratorClient:
        data_dir = tempfile.mkdtemp(prefix="querator-data-", dir=self.workdir)
        port = free_port()
        address = f"{HOST}:{port}"
        env = dict(os.environ)
        if self.source_dir:
            paths = [os.path.join(self.source_dir, "server", "src"), os.path.join(self.source_dir, "clients", "python", "src")]
            env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        log = os.path.join(self.workdir, "querator.log")
        proc, stop = start_owned("querator server", _serve_argv(address, data_dir), log, env=env)

        def stop_and_remove() -> None:
            stop()
            shutil.rmtree(data_dir, ignore_errors=True)

        self._stop = on_exit("querator server", stop_and_remove)
        self.pid = proc.pid
        wait_for_port(port, 30, proc, log)
        return QueratorClient(address=address)

    def memory_mib(self) -> float:
        from common import rss_mib

        return rss_mib(self.pid)

    def memory_label(self) -> str:
        return "RSS of the server process"

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None


@dataclass
class QueratorClient:
    """Picklable connection details; open() builds the channel inside the client process."""

    address: str
    complete_in_lease: bool = False  # use Lease.complete_ids instead of a separate Complete call
    streams: bool = False  # Produce and Lease over a ProduceStream / LeaseStream per queue, as the SDK does
    compact: bool = True  # ProduceRequest.payloads (as the SDK sends bare payloads), when the stubs have it
    _state: dict[str, Any] = field(default_factory=dict, repr=False)

    async def open(self) -> None:
        import grpc

        from querator.v1 import queue_pb2, queue_pb2_grpc, queues_pb2, queues_pb2_grpc

        channel = grpc.aio.insecure_channel(
            self.address,
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE), ("grpc.max_send_message_length", _MAX_MESSAGE)],
        )
        await channel.channel_ready()
        self._state.update(
            channel=channel,
            pb=queue_pb2,
            qpb=queues_pb2,
            queue=queue_pb2_grpc.QueueServiceStub(channel),
            queues=queues_pb2_grpc.QueuesServiceStub(channel),
            pending={},  # client_id -> (queue, partition, ids) to complete with the next Lease
        )

    async def close(self) -> None:
        for pipe in self._state.pop("pipes", {}).values():
            await pipe.close()
        channel = self._state.pop("channel", None)
        if channel is not None:
            await channel.close()

    async def create_queue(self, name: str, partitions: int) -> None:
        from google.protobuf.duration_pb2 import Duration

        qpb = self._state["qpb"]
        info = qpb.QueueInfo(
            queue_name=name,
            requested_partitions=partitions,
            lease_timeout=Duration(seconds=LEASE_TIMEOUT_S),
            expire_timeout=Duration(seconds=24 * 3600),
        )
        await self._state["queues"].CreateQueue(qpb.CreateQueueRequest(queue=info), timeout=30)

    async def drop_queue(self, name: str) -> None:
        qpb = self._state["qpb"]
        await self._state["queues"].DeleteQueue(qpb.DeleteQueueRequest(queue_name=name, force=True), timeout=120)

    async def count(self, name: str) -> int:
        """Ready, leased and scheduled items."""
        qpb = self._state["qpb"]
        stats = await self._state["queues"].GetQueueStats(qpb.GetQueueStatsRequest(queue_name=name), timeout=30)
        return sum(p.total + p.scheduled for p in stats.partitions)

    async def produce(self, queue: str, payloads: list[bytes]) -> None:
        pb = self._state["pb"]
        if self.compact and "payloads" in pb.ProduceRequest.DESCRIPTOR.fields_by_name:
            request = pb.ProduceRequest(queue_name=queue, payloads=payloads)
        else:
            request = pb.ProduceRequest(queue_name=queue, items=[pb.ProduceItem(payload=p) for p in payloads])
        if self.streams:
            await _ask(self._pipe("ProduceStream", queue), pb.ProduceStreamRequest(request=request))
            return
        await self._state["queue"].Produce(request, timeout=60)

    def _pipe(self, method: str, queue: str) -> Pipe:
        """The process's stream of ``method`` for ``queue``: one per queue, as the SDK
        keeps (answers come in the order asked, so queues sharing a stream would wait
        on each other's answers)."""
        pipes = self._state.setdefault("pipes", {})
        pipe = pipes.get((method, queue))
        if pipe is None:
            pipe = pipes[(method, queue)] = Pipe(getattr(self._state["queue"], method)())
        return pipe  # type: ignore[no-any-return]

    async def lease(self, queue: str, client_id: str, batch: int, wait_s: float) -> tuple[object, list[bytes]]:
        from google.protobuf.duration_pb2 import Duration

        pb = self._state["pb"]
        request = pb.LeaseRequest(
            queue_name=queue,
            batch_size=batch,
            client_id=client_id,
            request_timeout=Duration(nanos=int(wait_s * 1e9)) if wait_s < 1 else Duration(seconds=int(wait_s)),
        )
        columnar = "columnar" in pb.LeaseRequest.DESCRIPTOR.fields_by_name  # not in --at-commit's older stubs
        if columnar:
            request.columnar = True  # as the SDK asks
        if self.complete_in_lease:
            previous = self._state["pending"].pop(client_id, None)
            if previous is not None:
                request.complete_partition = previous[0]
                request.complete_ids.extend(previous[1])
        if self.streams:
            reply = await _ask(self._pipe("LeaseStream", queue), pb.LeaseStreamRequest(request=request))
        else:
            reply = await self._state["queue"].Lease(request, timeout=wait_s + 30)
        if columnar and reply.columns.ids:
            return (reply.partition, list(reply.columns.ids), client_id), list(reply.columns.payloads)
        items = reply.items  # a server from before columnar replies (--at-commit)
        return (reply.partition, [item.id for item in items], client_id), [item.payload for item in items]

    async def complete(self, queue: str, token: object) -> None:
        partition, ids, client_id = token  # type: ignore[misc]
        if not ids:
            return
        if self.complete_in_lease:  # completed by this loop's next Lease (or by finish())
            self._state["pending"][client_id] = (partition, ids)
            return
        pb = self._state["pb"]
        await self._state["queue"].Complete(pb.CompleteRequest(queue_name=queue, partition=partition, ids=ids), timeout=60)

    async def finish(self, queue: str, client_id: str) -> None:
        """Complete what a loop still holds (only with complete_in_lease)."""
        previous = self._state["pending"].pop(client_id, None)
        if previous is not None:
            pb = self._state["pb"]
            request = pb.CompleteRequest(queue_name=queue, partition=previous[0], ids=previous[1])
            await self._state["queue"].Complete(request, timeout=60)


async def _ask(pipe: Any, message: Any) -> Any:
    """One request on a ProduceStream / LeaseStream: its response, or its error raised."""
    answer = await pipe.ask(message)
    if answer.WhichOneof("result") == "error":
        raise RuntimeError(f"status {answer.error.code}: {answer.error.message}")
    return answer.response
