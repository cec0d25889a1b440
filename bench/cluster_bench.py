"""W1, W2 and W4 against an N-node cluster beside one server and N independent servers (``run.py --nodes N``).

Starts a real etcd and N ``querator serve --cluster`` nodes (each its own data dir, free
127.0.0.1 ports) next to a single server and N plain servers (independent.py: the same
work split over servers that never coordinate), and runs the same workloads against the
three, interleaved. The clients are raw generated stubs (``RoutedClient``, as querator_target's
client, so the figures measure the servers, not a client library) that route by
``ClusterInfo``: Produce and Lease to the node the process is bound to among the queue's
homes, Complete to the partition's home (no hop). A single server answers ClusterInfo
as one node, so every side runs the same client code.

Also measured: what one forwarding hop costs (Produce and Lease through a node that homes
nothing of the queue, against its home), and a node killed -9 during W2 (items/s before,
during and after; how long until the clients stop sending to it). CPU of every process
(nodes, etcd, clients) is read per phase, so every figure also says how much of the
machine it took.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import common
from common import HOST, free_port, process_cpu_s, start_owned, wait_for_port
from querator_target import LEASE_TIMEOUT_S, QueratorClient, QueratorService, _serve_argv
from sdk_cluster_client import SdkClusterClient
from workloads import Consumer, PhaseFailed, Producer, Settings, admin, expect_left, run_phase

NODE_TTL_S = 3  # membership TTL of the bench's nodes: a killed node is seen dead after this
KILL_LEASE_TIMEOUT_S = 5  # the kill test's queue: leases lost with the dead node come back soon
_RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "INTERNAL")
_STATUS_UNAVAILABLE = 14


# --- processes -----------------------------------------------------------------------------


class ClusterService:
    """etcd and ``nodes`` ``querator serve --cluster`` processes, stopped by PID at exit."""

    name = "cluster"

    def __init__(self, workdir: str, nodes: int, source_dir: str | None = None) -> None:
        self.workdir = workdir
        self.size = nodes
        self.source_dir = source_dir
        self.addresses: list[str] = []
        self.node_ids = [f"n{i + 1}" for i in range(nodes)]
        self.pids: dict[str, int] = {}
        self._stops: dict[str, Any] = {}
        self._data: list[str] = []
        self.url = ""

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.source_dir:
            paths = [os.path.join(self.source_dir, "server", "src"), os.path.join(self.source_dir, "clients", "python", "src")]
            env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        return env

    def start(self) -> list[str]:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("--nodes needs the etcd binary (Debian: apt-get install etcd-server)")
        etcd_dir = tempfile.mkdtemp(prefix="etcd-", dir=self.workdir)
        port, peer = free_port(), f"http://{HOST}:{free_port()}"
        argv = [
            binary, "--name", "bench", "--data-dir", etcd_dir,
            "--listen-client-urls", f"http://{HOST}:{port}", "--advertise-client-urls", f"http://{HOST}:{port}",
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"bench={peer}",
            "--log-level", "warn",
        ]  # fmt: skip
        proc, stop = start_owned("etcd", argv, os.path.join(self.workdir, "etcd.log"))
        self.pids["etcd"], self._stops["etcd"] = proc.pid, stop
        wait_for_port(port, 30, proc, os.path.join(self.workdir, "etcd.log"))
        self.url = f"etcd://{HOST}:{port}/bench"
        for node in self.node_ids:
            self._data.append(tempfile.mkdtemp(prefix=f"querator-{node}-", dir=self.workdir))
            self.addresses.append(f"{HOST}:{free_port()}")
        for i in range(self.size):
            self.start_node(i)
        self.wait_live(set(self.node_ids))
        return self.addresses

    def start_node(self, i: int) -> None:
        node, address = self.node_ids[i], self.addresses[i]
        argv = _serve_argv(address, self._data[i]) + ["--cluster", self.url, "--node-id", node, "--cluster-lease-ttl", str(NODE_TTL_S)]
        log = os.path.join(self.workdir, f"{node}.log")
        proc, stop = start_owned(f"querator node {node}", argv, log, env=self._env())
        self.pids[node], self._stops[node] = proc.pid, stop
        wait_for_port(int(address.rsplit(":", 1)[1]), 60, proc, log)

    def kill9(self, i: int) -> None:
        node = self.node_ids[i]
        os.kill(self.pids[node], 9)
        self._stops.pop(node)()  # reaps it

    def live(self, via: int = 0) -> set[str]:
        import grpc

        from querator.v1 import cluster_pb2, cluster_pb2_grpc

        with grpc.insecure_channel(self.addresses[via]) as channel:
            info = cluster_pb2_grpc.ClusterServiceStub(channel).ClusterInfo(cluster_pb2.ClusterInfoRequest(), timeout=5)
        return {m.node_id for m in info.members if m.live}

    def homes(self, queues: list[str]) -> dict[str, list[str]]:
        import grpc

        from querator.v1 import cluster_pb2, cluster_pb2_grpc

        with grpc.insecure_channel(self.addresses[0]) as channel:
            info = cluster_pb2_grpc.ClusterServiceStub(channel).ClusterInfo(cluster_pb2.ClusterInfoRequest(queue_names=queues), timeout=10)
        return {q.queue_name: list(q.homes) for q in info.queues}

    def wait_live(self, want: set[str], via: int = 0, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if want <= self.live(via):
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the cluster did not show {sorted(want)} live within {timeout:.0f} s")

    def stop(self) -> None:
        for name in list(self._stops)[::-1]:
            self._stops.pop(name)()
        for d in self._data:
            shutil.rmtree(d, ignore_errors=True)


# --- the routing client ----------------------------------------------------------------------


@dataclass
class RoutedClient(QueratorClient):
    """querator_target's raw-stub client, routing by ClusterInfo.

    Produce and Lease go to the ``prefer``-th live node among the queue's homes (the node
    serves from its own partitions, and a Lease asks the other homes when it has none
    ready); Complete goes to the partition's home. A node that fails a call is skipped for
    a backoff (0.5 s doubling to 10 s) and ClusterInfo is read again; the call is retried
    on another home (Produce, Lease) or given up (Complete: its items come back when their
    lease runs out). Records what it sent where, for the kill test.
    """

    prefer: int = 0
    lease_timeout_s: int = LEASE_TIMEOUT_S

    async def create_queue(self, name: str, partitions: int) -> None:
        from google.protobuf.duration_pb2 import Duration

        qpb = self._state["qpb"]
        info = qpb.QueueInfo(queue_name=name, requested_partitions=partitions, lease_timeout=Duration(seconds=self.lease_timeout_s),
                             expire_timeout=Duration(seconds=24 * 3600))  # fmt: skip
        await self._state["queues"].CreateQueue(qpb.CreateQueueRequest(queue=info), timeout=30)

    def _sent(self, node: str) -> None:
        self._state["sends"].extend((time.monotonic_ns(), int(node[1:]) if node[1:].isdigit() else 0))

    async def open(self) -> None:
        await super().open()
        self._state.update(nodes={}, homes={}, stubs={}, down={}, backoff={}, sends=array("q"), first_error={}, seen_dead={},
                           produced=array("q"), completed=array("q"), unsure_produce=0, unsure_complete=0, errors=0,
                           refreshing=None, last_refresh=0.0, clustered=False)  # fmt: skip
        await self._refresh()

    async def close(self) -> None:
        for pipe in self._state.pop("pipes", {}).values():
            try:
                await pipe.close()
            except Exception:  # noqa: BLE001 - a dead node's stream
                pass
        for channel, _ in self._state.get("stubs", {}).values():
            if channel is not self._state["channel"]:
                await channel.close()
        await super().close()

    # map

    async def _refresh(self) -> None:
        """Read ClusterInfo from the bootstrap node or any live member (single-flight)."""
        running = self._state["refreshing"]
        if running is not None:
            await running
            return
        fut = asyncio.get_running_loop().create_future()
        self._state["refreshing"] = fut
        try:
            from querator.v1 import cluster_pb2, cluster_pb2_grpc

            known = [n for n, a in self._state["nodes"].items() if a]
            for node in [None, *known]:
                channel = self._state["channel"] if node is None else self._channel(node)
                try:
                    info = await cluster_pb2_grpc.ClusterServiceStub(channel).ClusterInfo(cluster_pb2.ClusterInfoRequest(), timeout=2)
                except Exception:  # noqa: BLE001 - try the next node
                    continue
                self._apply(info)
                break
        finally:
            self._state["refreshing"] = None
            self._state["last_refresh"] = time.monotonic()
            fut.set_result(None)

    def _apply(self, info: Any) -> None:
        st = self._state
        if info.revision < st.get("revision", -1):
            return
        st["revision"], st["clustered"] = info.revision, info.clustered
        now = time.monotonic_ns()
        for m in info.members:
            if not m.live:  # the first time this client's map showed it dead
                st["seen_dead"].setdefault(m.node_id, now)
        st["nodes"] = {m.node_id: (m.address if info.clustered else self.address) if m.live else "" for m in info.members}
        st["homes"] = {q.queue_name: list(q.homes) for q in info.queues}

    def _channel(self, node: str) -> Any:
        import grpc

        stubs = self._state["stubs"]
        address = self._state["nodes"].get(node) or ""
        entry = stubs.get(node)
        if entry is None or entry[1] != address:  # new, or the node came back at another address
            channel = self._state["channel"] if address == self.address else grpc.aio.insecure_channel(
                address, options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
            )
            entry = stubs[node] = (channel, address)
        return entry[0]

    def _queue_stub(self, node: str) -> Any:
        from querator.v1 import queue_pb2_grpc

        channel = self._channel(node)
        stubs = self._state.setdefault("queue_stubs", {})
        if stubs.get(node, (None,))[0] is not channel:
            stubs[node] = (channel, queue_pb2_grpc.QueueServiceStub(channel))
        return stubs[node][1]

    async def _homes(self, queue: str) -> list[str]:
        homes = self._state["homes"].get(queue)
        if homes is None:
            await self._refresh()
            homes = self._state["homes"].get(queue)
            if homes is None:
                raise PhaseFailed(f"queue {queue!r} is not in ClusterInfo")
        return homes  # type: ignore[no-any-return]

    def _usable(self, node: str) -> bool:
        return bool(self._state["nodes"].get(node)) and self._state["down"].get(node, 0.0) <= time.monotonic()

    async def _pick(self, queue: str) -> str:
        """The node for a Produce or Lease: the process's own among the queue's live homes."""
        st = self._state
        if any(not self._usable(n) for n in set(await self._homes(queue))) and time.monotonic() - st["last_refresh"] > 1.0:
            await self._refresh()  # a node is down: look now and then whether it is back
        nodes = sorted(set(await self._homes(queue)))
        usable = [n for n in nodes if self._usable(n)]
        while not usable:  # every home down: wait for one to come back (bounded by the phase's time limit)
            await asyncio.sleep(0.1)
            await self._refresh()
            nodes = sorted(set(await self._homes(queue)))
            usable = [n for n in nodes if self._usable(n)]
        return usable[self.prefer % len(usable)]

    async def _failed(self, node: str) -> None:
        st = self._state
        st["errors"] += 1
        st["first_error"].setdefault(node, time.monotonic_ns())
        if st["down"].get(node, 0.0) > time.monotonic():
            return  # another call in flight to it failed too: one failure, one backoff step
        backoff = min(st["backoff"].get(node, 0.25) * 2, 10.0)
        st["backoff"][node] = backoff
        st["down"][node] = time.monotonic() + backoff
        for key in [k for k in st.get("pipes", {}) if k[2] == node]:
            st["pipes"].pop(key)  # its streams are dead; not awaited (they may never answer)
        await self._refresh()

    def _ok(self, node: str) -> None:
        self._state["backoff"].pop(node, None)

    @staticmethod
    def _retryable(exc: BaseException) -> bool:
        import grpc

        if isinstance(exc, grpc.aio.AioRpcError):
            return exc.code().name in _RETRYABLE
        if isinstance(exc, RuntimeError) and str(exc).startswith(f"status {_STATUS_UNAVAILABLE}:"):
            return True
        return isinstance(exc, (ConnectionError, grpc.aio.UsageError, asyncio.InvalidStateError))

    def _pipe_at(self, method: str, queue: str, node: str) -> Any:
        pipes = self._state.setdefault("pipes", {})
        pipe = pipes.get((method, queue, node))
        if pipe is None:
            pipe = pipes[(method, queue, node)] = common.Pipe(getattr(self._queue_stub(node), method)())
        return pipe

    # data calls

    async def produce(self, queue: str, payloads: list[bytes]) -> None:
        from querator_target import _ask

        pb = self._state["pb"]
        request = pb.ProduceRequest(queue_name=queue, payloads=payloads)
        for attempt in range(1000):
            node = await self._pick(queue)
            self._sent(node)
            try:
                if self.streams:
                    await _ask(self._pipe_at("ProduceStream", queue, node), pb.ProduceStreamRequest(request=request))
                else:
                    await self._queue_stub(node).Produce(request, timeout=60)
            except Exception as exc:
                if not self._retryable(exc):
                    raise
                self._state["unsure_produce"] += len(payloads) if attempt == 0 else 0
                await self._failed(node)
                continue
            self._ok(node)
            self._state["produced"].extend((time.monotonic_ns(), len(payloads)))
            return
        raise PhaseFailed("a Produce failed on every node 1000 times")

    async def lease(self, queue: str, client_id: str, batch: int, wait_s: float) -> tuple[object, list[bytes]]:
        from google.protobuf.duration_pb2 import Duration

        from querator_target import _ask

        pb = self._state["pb"]
        while True:
            node = await self._pick(queue)
            request = pb.LeaseRequest(queue_name=queue, batch_size=batch, client_id=client_id, columnar=True,
                                      request_timeout=Duration(nanos=int(wait_s * 1e9)))  # fmt: skip
            previous = self._state["pending"].get(client_id)
            if previous is not None:
                partition, ids = previous
                home = (await self._homes(queue))[partition]
                if home == node:
                    request.complete_partition = partition
                    request.complete_ids.extend(ids)
                else:  # its home is elsewhere: complete there, no hop
                    self._state["pending"].pop(client_id)
                    await self._complete_at(queue, partition, ids)
                    previous = None
            self._sent(node)
            try:
                if self.streams:
                    reply = await _ask(self._pipe_at("LeaseStream", queue, node), pb.LeaseStreamRequest(request=request))
                else:
                    reply = await self._queue_stub(node).Lease(request, timeout=wait_s + 30)
            except Exception as exc:
                if not self._retryable(exc):
                    raise
                if previous is not None:  # its completion's outcome is unknown: their leases run out
                    self._state["pending"].pop(client_id, None)
                    self._state["unsure_complete"] += len(previous[1])
                await self._failed(node)
                continue
            self._ok(node)
            if previous is not None:
                self._state["pending"].pop(client_id, None)
                self._state["completed"].extend((time.monotonic_ns(), len(previous[1])))
            return (reply.partition, list(reply.columns.ids), client_id), list(reply.columns.payloads)

    async def _complete_at(self, queue: str, partition: int, ids: list[bytes]) -> None:
        pb = self._state["pb"]
        for attempt in range(2):  # once more after a refresh, in case the map was stale
            home = (await self._homes(queue))[partition]
            self._sent(home)
            try:
                await self._queue_stub(home).Complete(pb.CompleteRequest(queue_name=queue, partition=partition, ids=ids), timeout=60)
            except Exception as exc:
                if not self._retryable(exc):
                    raise
                await self._failed(home)
                if attempt == 1 or not self._usable(home):
                    self._state["unsure_complete"] += len(ids)
                    return
                continue
            self._ok(home)
            self._state["completed"].extend((time.monotonic_ns(), len(ids)))
            return

    async def complete(self, queue: str, token: object) -> None:
        partition, ids, client_id = token  # type: ignore[misc]
        if not ids:
            return
        if self.complete_in_lease:
            self._state["pending"][client_id] = (partition, ids)
            return
        await self._complete_at(queue, partition, ids)

    async def finish(self, queue: str, client_id: str) -> None:
        previous = self._state["pending"].pop(client_id, None)
        if previous is not None:
            await self._complete_at(queue, previous[0], previous[1])

    def phase_report(self) -> dict[str, Any]:
        st = self._state
        return {
            "sends": st["sends"].tobytes(),
            "first_error": dict(st["first_error"]),
            "seen_dead": dict(st["seen_dead"]),
            "produced": st["produced"].tobytes(),
            "completed": st["completed"].tobytes(),
            "unsure_produce": st["unsure_produce"],
            "unsure_complete": st["unsure_complete"],
            "errors": st["errors"],
        }


# --- measuring -----------------------------------------------------------------------------


class CpuMeter:
    """CPU seconds of the server-side processes between a phase's start signal and its end."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0 = self.t1 = 0.0
        self.c0: dict[str, float] = {}
        self.c1: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        out = {}
        for name, pid in self.pids.items():
            try:
                out[name] = process_cpu_s(pid)
            except OSError:
                out[name] = float("nan")
        return out

    @staticmethod
    def _machine() -> float:
        """CPU seconds the whole machine has been busy (every core; /proc/stat minus idle and iowait)."""
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")

    def go(self, _counters: Any = None) -> None:
        self.t0, self.c0, self.m0 = time.monotonic(), self._read(), self._machine()

    def done(self) -> None:
        self.t1, self.c1, self.m1 = time.monotonic(), self._read(), self._machine()

    def cores(self, clients_cpu_s: float) -> dict[str, float]:
        """Cores per process, ``clients`` (the phase's client processes) and ``machine``
        (everything this machine ran meanwhile, this benchmark's processes and others')."""
        wall = max(self.t1 - self.t0, 1e-9)
        out = {name: (self.c1[name] - self.c0[name]) / wall for name in self.pids}
        out["clients"] = clients_cpu_s / wall
        out["machine"] = (self.m1 - self.m0) / wall
        return out


def _phase(clients: list[Any], roles: list[Any], s: Settings, pids: dict[str, int], targets: dict[str, int] | None = None) -> tuple[Any, dict[str, float]]:
    meter = CpuMeter(pids)
    phase = run_phase(clients, roles, s, targets, on_go=meter.go, on_done=meter.done)
    return phase, meter.cores(sum(r.get("cpu_s", 0.0) for r in phase.results))


@dataclass
class Target:
    """One system under test: a single server or a cluster, with its clients' settings.

    ``nodes[i]`` is the node (cluster) or server listening at ``addresses[i]``; a single
    server is one node named "", as its ClusterInfo names it. Client process *i* is bound to
    ``addresses[i % len]``. The queue operations go through the first address: a cluster
    places the partitions itself (independent.IndependentTarget splits them over its servers).
    """

    label: str
    addresses: list[str]
    pids: dict[str, int]
    service: Any
    nodes: list[str]
    streams: bool = False
    complete_in_lease: bool = False
    sdk: bool = False  # the clients: the Python SDK (sdk_cluster_client.py), not raw routing stubs

    def client(self, i: int) -> Any:
        return self.client_at(self.nodes[i % len(self.nodes)], i)

    def client_at(self, node: str, i: int) -> Any:
        """Client process ``i``, bound to ``node`` (with ``sdk``: a cluster's every node, ``node`` first)."""
        at = self.nodes.index(node)
        address = self.addresses[at]
        if self.sdk:  # the SDK spreads the calls over a cluster itself; a plain server is its one address
            addresses = self.addresses[at:] + self.addresses[:at] if isinstance(self.service, ClusterService) else [address]
            return SdkClusterClient(addresses=addresses, streams=self.streams, complete_in_lease=self.complete_in_lease)
        return RoutedClient(address=address, prefer=i, streams=self.streams, complete_in_lease=self.complete_in_lease)

    def create(self, queues: list[str], partitions: int) -> None:
        admin(self.client(0), "create", queues, partitions)

    def expect_empty(self, queues: list[str]) -> None:
        expect_left(self.client(0), queues, [0] * len(queues))

    def drop(self, queues: list[str]) -> None:
        admin(self.client(0), "drop", queues)

    def homes(self, queues: list[str]) -> dict[str, list[str]]:
        """Each queue's node per partition (read after ``create``)."""
        if isinstance(self.service, ClusterService):
            return self.service.homes(queues)
        return {q: [""] for q in queues}

    def placement(self, queues: list[str], partitions: int) -> dict[str, list[str]]:
        """Where ``create`` would put these queues' partitions: created, read and dropped."""
        self.create(queues, partitions)
        try:
            return self.homes(queues)
        finally:
            self.drop(queues)


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def cw1(t: Target, s: Settings, procs: int, partitions: int) -> dict[str, Any]:
    """W1 spread: one queue with a partition (at least) on every node, ``procs`` producers then ``procs`` consumers."""
    q = "cw1"
    t.create([q], partitions)
    clients = [t.client(i) for i in range(procs)]
    produce, p_cpu = _phase(clients, [Producer([q], n, s.produce_inflight) for n in _shares(s.items, procs)], s, t.pids)
    drain, d_cpu = _phase(clients, [Consumer([q] * s.consume_inflight) for _ in range(procs)], s, t.pids, targets={q: s.items})
    t.expect_empty([q])
    t.drop([q])
    return {
        "produce": produce.items_of("produce") / produce.elapsed_of("produce"),
        "drain": drain.items_of("consume") / drain.elapsed_of("consume"),
        "cpu": {"produce": p_cpu, "drain": d_cpu},
    }


def cw2(t: Target, s: Settings, procs: int, partitions: int) -> dict[str, Any]:
    """W2 at full load: ``procs`` producers and ``procs`` consumers at once on one queue."""
    q, n = "cw2", s.w2_items
    t.create([q], partitions)
    roles: list[Any] = [Producer([q], k, s.produce_inflight) for k in _shares(n, procs)]
    roles += [Consumer([q] * s.consume_inflight, latency=True) for _ in range(procs)]
    clients = [t.client(i) for i in range(procs)] * 2  # producer i and consumer i on the same node
    phase, cpu = _phase(clients, roles, s, t.pids, targets={q: n})
    t.expect_empty([q])
    t.drop([q])
    lat = phase.latencies_ms
    return {
        "total": phase.items_of("consume") / phase.elapsed_of("consume"),
        "p50_ms": common.percentile(lat, 50),
        "p99_ms": common.percentile(lat, 99),
        "cpu": {"total": cpu},
    }


def _by_home(queues: list[str], homes: dict[str, list[str]], nodes: list[str], procs: int) -> list[list[str]]:
    """The queues of one partition split over ``procs`` processes, each taking queues of one home only.

    Processes go to the nodes in proportion to the queues they home (one each at least), so
    no process needs two nodes: an independent server holds only its own queues.
    """
    on = {n: [q for q in queues if homes[q][0] == n] for n in nodes}
    on = {n: qs for n, qs in on.items() if qs}
    count = dict.fromkeys(on, 1)
    for _ in range(procs - len(on)):
        busiest = max(on, key=lambda n: len(on[n]) / count[n])  # the first such node on a tie
        count[busiest] += 1
    groups = [qs[i * len(qs) // count[n] : (i + 1) * len(qs) // count[n]] for n, qs in on.items() for i in range(count[n])]
    return [g for g in groups if g]


def cw4(t: Target, s: Settings, procs: int) -> dict[str, Any]:
    """W4 spread: queues of one partition; each process takes the queues homed on one node."""
    queues = [f"cw4-{i}" for i in range(s.w4_queues)]
    t.create(queues, 1)
    homes = t.homes(queues)
    groups = _by_home(queues, homes, t.nodes, procs)
    clients = [t.client_at(homes[g[0]][0], i) for i, g in enumerate(groups)]
    per_queue = {q: 0 for q in queues}
    producers = []
    share = {id(g): s.w4_items * len(g) // len(queues) for g in groups}
    share[id(groups[-1])] += s.w4_items - sum(share.values())
    for g in groups:
        n = share[id(g)]
        for b in range(math.ceil(n / s.batch)):
            per_queue[g[b % len(g)]] += min(s.batch, n - b * s.batch)
        producers.append(Producer(g, n, s.w4_per_queue * len(g)))
    produce, p_cpu = _phase(clients, producers, s, t.pids)
    drain, d_cpu = _phase(clients, [Consumer(g * s.w4_per_queue) for g in groups], s, t.pids, targets=per_queue)
    t.expect_empty(queues)
    t.drop(queues)
    return {
        "produce": produce.items_of("produce") / produce.elapsed_of("produce"),
        "drain": drain.items_of("consume") / drain.elapsed_of("consume"),
        "cpu": {"produce": p_cpu, "drain": d_cpu},
        "placement": {node: n for node in t.nodes if (n := sum(1 for q in queues if homes[q][0] == node))},
    }


# --- the cost of a forwarding hop ------------------------------------------------------------


async def _forwarding(home: str, other: str, queue: str, calls: int, items: int, inflight: int) -> dict[str, Any]:
    """Produce and Lease sent to the queue's home and through a node that homes none of it."""
    import grpc
    from google.protobuf.duration_pb2 import Duration

    from querator.v1 import queue_pb2 as pb
    from querator.v1 import queue_pb2_grpc

    payloads = common.Payloads()
    channels = {via: grpc.aio.insecure_channel(addr) for via, addr in (("direct", home), ("hop", other))}
    stubs = {via: queue_pb2_grpc.QueueServiceStub(c) for via, c in channels.items()}
    home_stub = stubs["direct"]
    lat: dict[str, list[float]] = {f"{call} {via}": [] for call in ("Produce", "Lease") for via in stubs}
    rates: dict[str, float] = {}

    async def produce(via: str) -> float:
        t = time.perf_counter()
        await stubs[via].Produce(pb.ProduceRequest(queue_name=queue, payloads=payloads.batch(100)), timeout=30)
        return (time.perf_counter() - t) * 1000

    async def lease(via: str, loop: int = 0) -> tuple[float, int]:
        t = time.perf_counter()
        reply = await stubs[via].Lease(
            pb.LeaseRequest(queue_name=queue, batch_size=100, client_id=f"fwd-{via}-{loop}", columnar=True, request_timeout=Duration(nanos=500_000_000)), timeout=30
        )
        ms = (time.perf_counter() - t) * 1000
        if reply.columns.ids:  # completed at the home: only the Lease's path differs
            await home_stub.Complete(pb.CompleteRequest(queue_name=queue, partition=reply.partition, ids=reply.columns.ids), timeout=30)
        return ms, len(reply.columns.ids)

    try:
        for c in channels.values():
            await c.channel_ready()
        for _ in range(3):  # warm both paths (the forwarding node opens its channel to the home)
            await produce("direct"), await produce("hop"), await lease("direct"), await lease("hop")
        for r in range(4):  # rounds, alternating which path goes first
            order = ("direct", "hop") if r % 2 == 0 else ("hop", "direct")
            for via in order:
                lat[f"Produce {via}"] += [await produce(via) for _ in range(calls)]
            for via in order:
                lat[f"Lease {via}"] += [(await lease(via))[0] for _ in range(calls)]
        for via in ("direct", "hop", "direct", "hop"):  # items/s, `inflight` calls at once, each path twice
            rates.setdefault(f"Produce {via}", []).append(await _rate_produce(produce, via, items // 100, inflight))  # type: ignore[attr-defined]
            rates.setdefault(f"Lease+Complete {via}", []).append(await _rate_drain(lease, via, items // 100 * 100, inflight))  # type: ignore[attr-defined]
    finally:
        for c in channels.values():
            await c.close()
    return {
        "p50_ms": {k: statistics.median(v) for k, v in lat.items()},
        "items_per_s": {k: max(v) for k, v in rates.items()},  # type: ignore[arg-type]
    }


async def _rate_produce(produce: Any, via: str, batches: int, inflight: int) -> float:
    left = [batches]
    t = time.perf_counter()

    async def pusher() -> None:
        while left[0] > 0:
            left[0] -= 1
            await produce(via)

    await asyncio.gather(*(pusher() for _ in range(inflight)))
    return batches * 100 / (time.perf_counter() - t)


async def _rate_drain(lease: Any, via: str, items: int, inflight: int) -> float:
    got = [0]
    t = time.perf_counter()
    done = [0.0]

    async def drainer(loop: int) -> None:
        while got[0] < items:
            _, n = await lease(via, loop)  # awaited first: `got[0] += await ...` would lose updates
            got[0] += n
            if got[0] >= items and not done[0]:
                done[0] = time.perf_counter()  # not the other loops' last empty Lease

    await asyncio.gather(*(drainer(i) for i in range(inflight)))
    return got[0] / (done[0] - t)


def _forwarding_child(args: tuple[Any, ...], out: Any) -> None:
    try:
        out.put((None, asyncio.run(_forwarding(*args))))
    except BaseException as exc:  # noqa: BLE001
        out.put((f"{type(exc).__name__}: {exc}", None))


def forwarding(cluster: ClusterService, s: Settings, pids: dict[str, int]) -> dict[str, Any]:
    """A queue of one partition (homed on one node); calls direct to it and through another node."""
    q = "fwd"
    client = RoutedClient(address=cluster.addresses[0])
    admin(client, "create", [q], 1)
    home = cluster.homes([q])[q][0]
    i_home = cluster.node_ids.index(home)
    i_other = (i_home + 1) % cluster.size
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    calls = max(50, s.items // 1000)
    args = (cluster.addresses[i_home], cluster.addresses[i_other], q, calls, max(2000, s.items // 2), s.produce_inflight)
    meter = CpuMeter(pids)
    p = ctx.Process(target=_forwarding_child, args=(args, out), daemon=True)
    p.start()
    meter.go()
    try:
        error, result = out.get(timeout=s.time_limit_s)
    finally:
        meter.done()
        p.join(10)
        if p.is_alive():
            p.kill()
    if error:
        raise PhaseFailed(f"forwarding: {error}")
    admin(client, "drop", [q])
    result["home"], result["via"] = home, cluster.node_ids[i_other]
    result["calls"], result["items"] = calls, args[4]
    result["cpu"] = meter.cores(0.0)
    return result


# --- a node killed during W2 -------------------------------------------------------------------


def kill_during_w2(cluster: ClusterService, s: Settings, procs: int, partitions: int, rate_hint: float) -> dict[str, Any]:
    """W2 on the cluster; one node kill -9'd after ``before`` s, restarted ``dead`` s later."""
    q = "cw2-kill"
    before_s, dead_s = 2.5, 4.0
    n = int(max(rate_hint, 20_000) * (before_s + dead_s + 3.0))
    victim = cluster.size - 1
    survivor = 0
    client0 = RoutedClient(address=cluster.addresses[survivor], lease_timeout_s=KILL_LEASE_TIMEOUT_S)
    admin(client0, "create", [q], partitions)
    roles: list[Any] = [Producer([q], k, s.produce_inflight) for k in _shares(n, procs)]
    roles += [Consumer([q] * s.consume_inflight) for _ in range(procs)]
    clients = [RoutedClient(address=cluster.addresses[i % cluster.size], prefer=i, streams=False, complete_in_lease=False) for i in range(procs)] * 2
    stop_at = 10**15
    events: dict[str, int] = {}
    problems: list[str] = []

    def orchestrate(counters: dict[str, Any]) -> None:
        try:
            t_go = counters["__go__"].value
            time.sleep(max(0.0, t_go / 1e9 + before_s - time.monotonic()))
            events["kill"] = time.monotonic_ns()
            cluster.kill9(victim)
            while time.monotonic_ns() < events["kill"] + dead_s * 1e9:
                if "seen_dead" not in events and cluster.node_ids[victim] not in cluster.live(survivor):
                    events["seen_dead"] = time.monotonic_ns()
                time.sleep(0.05)
            events["restart"] = time.monotonic_ns()
            cluster.start_node(victim)
            cluster.wait_live(set(cluster.node_ids), survivor)
            events["back"] = time.monotonic_ns()
            quiet = 0
            deadline = time.monotonic() + s.time_limit_s
            while time.monotonic() < deadline:  # done: every item consumed and none left
                done = counters[q].value >= n and _left(cluster.addresses[survivor], q) == 0
                quiet = quiet + 1 if done else 0
                if quiet >= 3:
                    break
                time.sleep(0.3)
            events["end"] = time.monotonic_ns()
        except Exception as exc:  # noqa: BLE001 - reported with the figures
            problems.append(f"{type(exc).__name__}: {exc}")
        finally:
            counters[q].value = stop_at

    holder: dict[str, threading.Thread] = {}

    def on_go(counters: dict[str, Any]) -> None:
        holder["t"] = threading.Thread(target=orchestrate, args=(counters,), daemon=True)
        holder["t"].start()

    phase = run_phase(clients, roles, s, targets={q: stop_at}, on_go=on_go)
    holder["t"].join(60)
    if problems:
        raise PhaseFailed("kill test: " + "; ".join(problems))
    left = _left(cluster.addresses[survivor], q)
    admin(client0, "drop", [q])
    return _kill_figures(phase, events, cluster.node_ids[victim], n, left, before_s)


def _left(address: str, q: str) -> int:
    import grpc

    from querator.v1 import queues_pb2, queues_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stats = queues_pb2_grpc.QueuesServiceStub(channel).GetQueueStats(queues_pb2.GetQueueStatsRequest(queue_name=q), timeout=10)
    return sum(p.total + p.scheduled for p in stats.partitions)


def _kill_figures(phase: Any, events: dict[str, int], victim: str, n: int, left: int, before_s: float) -> dict[str, Any]:
    completed, produced = array("q"), array("q")
    victim_no = int(victim[1:])
    sends_to_dead: list[int] = []
    seen_dead, first_error = [], []
    unsure_p = unsure_c = 0
    for r in phase.results:
        c = r.get("client") or {}
        completed.frombytes(c.get("completed", b""))
        produced.frombytes(c.get("produced", b""))
        sends = array("q")
        sends.frombytes(c.get("sends", b""))
        sends_to_dead += [sends[i] for i in range(0, len(sends), 2) if sends[i + 1] == victim_no and events["kill"] <= sends[i] < events["restart"]]
        if victim in c.get("seen_dead", {}):
            seen_dead.append(c["seen_dead"][victim])
        if victim in c.get("first_error", {}):
            first_error.append(c["first_error"][victim])
        unsure_p += c.get("unsure_produce", 0)
        unsure_c += c.get("unsure_complete", 0)

    def rate(series: array, a: int, b: int) -> float:  # type: ignore[type-arg]
        got = sum(series[i + 1] for i in range(0, len(series), 2) if a <= series[i] < b)
        return got / max((b - a) / 1e9, 1e-9)

    t_go = phase.t_go
    kill, back, restart = events["kill"], events["back"], events["restart"]
    end = max(completed[i] for i in range(0, len(completed), 2)) if completed else events["end"]
    return {
        "items": n,
        "windows_s": {"before": (kill - t_go) / 1e9, "dead": (back - kill) / 1e9, "after": (end - back) / 1e9},
        "completed_per_s": {"before": rate(completed, t_go, kill), "dead": rate(completed, kill, back), "after": rate(completed, back, end)},
        "produced_per_s": {"before": rate(produced, t_go, kill), "dead": rate(produced, kill, back), "after": rate(produced, back, end)},
        "last_send_to_dead_ms": (max(sends_to_dead) - kill) / 1e6 if sends_to_dead else float("nan"),
        "sends_to_dead": len(sends_to_dead),
        "first_error_ms": (min(first_error) - kill) / 1e6 if first_error else float("nan"),
        "clients_saw_dead_ms": (max(seen_dead) - kill) / 1e6 if seen_dead else float("nan"),
        "cluster_saw_dead_ms": (events["seen_dead"] - kill) / 1e6 if "seen_dead" in events else float("nan"),
        "restart_to_serving_ms": (back - restart) / 1e6,
        "completed": sum(completed[i + 1] for i in range(0, len(completed), 2)),
        "produced": sum(produced[i + 1] for i in range(0, len(produced), 2)),
        "unsure_produce": unsure_p,
        "unsure_complete": unsure_c,
        "left": left,
        "before_s": before_s,
    }


# --- the run -------------------------------------------------------------------------------

TARGETS = {  # on 2 cores with 2 nodes (the issue): N nodes ÷ one server at least
    ("W4", "produce"): 1.25,
    ("W4", "drain"): 1.25,
    ("W2", "total"): 1.15,
    ("W1", "produce"): 1.0,
    ("W1", "drain"): 1.0,
}
INDEPENDENT_TARGET = 0.9  # any N: N nodes ÷ N independent servers doing the same work (coordination and routing cost at most a tenth)


@dataclass
class Plan:
    nodes: int
    cores: int
    procs: int = field(init=False)  # client processes per role (producers, consumers)

    def __post_init__(self) -> None:
        # Half the cores per role (producers and consumers of W2 run at once), at least one per node.
        self.procs = max(self.nodes, self.cores // 2)

    @property
    def w1_partitions(self) -> int:
        return self.nodes

    @property
    def w2_partitions(self) -> int:
        return max(4, 2 * self.nodes)


def run(args: Any, s: Settings, workdir: str, source_dir: str | None) -> tuple[dict[str, Any], Plan]:
    from independent import IndependentServers, IndependentTarget  # builds on this module's Target

    plan = Plan(args.nodes, args.cores)
    single_svc = QueratorService(workdir, source_dir)
    single_addr = single_svc.start().address
    cluster = ClusterService(workdir, args.nodes, source_dir)
    servers = IndependentServers(workdir, args.nodes, source_dir)
    try:
        cluster.start()
        servers.start()
        print(f"bench: one server (pid {single_svc.pid}), {args.nodes} nodes {cluster.pids} and {args.nodes} independent servers "
              f"{servers.pids} started; {plan.procs} client process(es) per role, cores {plan.cores}", flush=True)  # fmt: skip
        clients = {"streams": args.streams, "complete_in_lease": args.complete_in_lease, "sdk": args.sdk}
        one = Target("one server", [single_addr], {"server": single_svc.pid}, single_svc, [""], **clients)
        many = Target(f"{args.nodes} nodes", cluster.addresses, dict(cluster.pids), cluster, cluster.node_ids, **clients)
        apart = IndependentTarget(f"{args.nodes} independent servers", servers.addresses, dict(servers.pids), servers, servers.node_ids,
                                  **clients, mirror=many)  # fmt: skip
        sides = [one, many, apart]
        out: dict[str, Any] = {"runs": {}, "load": {}}
        jobs = {
            "W1": lambda t: cw1(t, s, plan.procs, plan.w1_partitions),
            "W2": lambda t: cw2(t, s, plan.procs, plan.w2_partitions),
            "W4": lambda t: cw4(t, s, plan.procs),
        }
        for w in [w for w in ("W1", "W2", "W4") if w in args.only]:
            out["load"][w] = os.getloadavg()[0]
            for r in range(args.repeat):
                for t in sides[r % len(sides) :] + sides[: r % len(sides)]:  # rotate who goes first
                    started = time.monotonic()
                    res = jobs[w](t)
                    res["load"] = os.getloadavg()[0]
                    out["runs"].setdefault(w, {}).setdefault(t.label, []).append(res)
                    print(f"bench: {t.label} {w} run {r + 1} ({time.monotonic() - started:.0f} s): "
                          + ", ".join(f"{k}={v:,.0f}" for k, v in res.items() if isinstance(v, float) and k != "load"), flush=True)  # fmt: skip
        if not args.no_forwarding and args.nodes >= 2:
            out["load"]["forwarding"] = os.getloadavg()[0]
            out["forwarding"] = forwarding(cluster, s, dict(cluster.pids))
            print(f"bench: forwarding {out['forwarding']['p50_ms']} {out['forwarding']['items_per_s']}", flush=True)
        if not args.no_kill and args.nodes >= 2:
            out["load"]["kill"] = os.getloadavg()[0]
            runs = out["runs"].get("W2", {}).get(many.label, [])
            hint = statistics.median([r["total"] for r in runs]) if runs else 50_000
            out["kill"] = kill_during_w2(cluster, s, plan.procs, plan.w2_partitions, hint)
            print(f"bench: kill {out['kill']}", flush=True)
        out["load"]["end"] = os.getloadavg()[0]
        out["labels"] = (one.label, many.label, apart.label)
        return out, plan
    finally:
        try:
            servers.stop()
        finally:
            cluster.stop()
            single_svc.stop()


def _med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median([r[key] for r in runs])


def _cpu_med(runs: list[dict[str, Any]], phase: str) -> dict[str, float]:
    names = runs[0]["cpu"][phase].keys()
    return {n: statistics.median([r["cpu"][phase][n] for r in runs]) for n in names}


def _ratio(runs: dict[str, list[dict[str, Any]]], top: str, bottom: str, key: str) -> str:
    """The ratio of the medians, and of each run's pair (runs pair up by repetition)."""
    each = ", ".join(f"{y[key] / x[key]:.2f}" for x, y in zip(runs[bottom], runs[top], strict=True))
    return f"{_med(runs[top], key) / _med(runs[bottom], key):.2f}x (runs: {each})"


def _met(ratio: float, target: float | None, applies: bool = True) -> str:
    return "n/a" if not applies or target is None else ("yes" if ratio >= target else "**no**")


def clients_text(args: Any) -> str:
    """The report's words for the W1/W2/W4 clients."""
    if getattr(args, "sdk", False):
        return (f"bound to the nodes (servers) in turn; clients are the Python SDK's `AsyncClient`, given every node's address on the "
                f"cluster (its own node's first) and its server's on the others, routing by ClusterInfo itself: Produce to a node "
                f"homing the queue weighted by its partitions and against what already waits there, Lease to a node whose partitions "
                f"hold ready items weighted by them (from GetQueueStats, at most once a second per queue), Complete to the partition's "
                f"home; {'Produce and Lease on streams (per node and queue in the cluster)' if args.streams else 'unary calls'}"
                f"{'; completes ride on the next Lease, which the SDK sends to their home' if args.complete_in_lease else ''}; "
                f"the forwarding and node-kill figures use the raw stubs")  # fmt: skip
    return (f"bound to the nodes (servers) in turn; clients are raw generated stubs routing by ClusterInfo (Produce and Lease to the "
            f"process's node among the queue's homes, Complete to the partition's home){'; Produce and Lease on streams' if args.streams else ''}"
            f"{'; completes ride on the next Lease when its node is the home' if args.complete_in_lease else ''}")  # fmt: skip


def report(out: dict[str, Any], plan: Plan, s: Settings, args: Any) -> str:
    lines: list[str] = []
    add = lines.append
    one, many, apart = out["labels"]
    runs = out["runs"]
    add(f"{plan.nodes} nodes (etcd {shutil.which('etcd') and 'on this machine'}, `--cluster-lease-ttl {NODE_TTL_S}`) beside one server "
        f"and beside {plan.nodes} independent servers (plain servers, no etcd: each with its own client processes and its part of "
        f"the queues, split as the cluster places them over its nodes), "
        f"`--cores {plan.cores}`: {plan.procs} client process(es) per role, {clients_text(args)}. "
        f"Each workload: {args.repeat} runs per system, rotating which goes first; medians, and the ratio of the medians.")  # fmt: skip
    add("")
    add(f"| workload | one server items/s | {many} items/s | {apart} items/s | {many} ÷ one server | target | met "
        f"| {many} ÷ {plan.nodes} independent | target | met | 1-min load avg at its start |")  # fmt: skip
    add("|---|---:|---:|---:|---:|---:|---|---:|---:|---|---:|")
    labels = {
        ("W1", "produce"): f"W1 produce, 1 queue of {plan.w1_partitions} partitions, {plan.procs} producer process(es) ({s.items:,})",
        ("W1", "drain"): f"W1 drain, {plan.procs} consumer process(es)",
        ("W2", "total"): f"W2 total, {plan.procs}+{plan.procs} processes, {plan.w2_partitions} partitions ({s.w2_items:,})",
        ("W4", "produce"): f"W4 produce, {s.w4_queues} queues of 1 partition, {plan.procs} producer process(es) ({s.w4_items:,})",
        ("W4", "drain"): f"W4 drain, {plan.procs} consumer process(es)",
    }
    for (w, key), label in labels.items():
        if w not in runs:
            continue
        a, b, c = (_med(runs[w][side], key) for side in (one, many, apart))
        target = TARGETS.get((w, key))
        add(f"| {label} | {a:,.0f} | {b:,.0f} | {c:,.0f} "
            f"| {_ratio(runs[w], many, one, key)} | {f'{target:.2f}x' if target else ''} | {_met(b / a, target, plan.nodes == 2)} "
            f"| {_ratio(runs[w], many, apart, key)} | {INDEPENDENT_TARGET:.2f}x | {_met(b / c, INDEPENDENT_TARGET)} "
            f"| {out['load'][w]:.1f} |")  # fmt: skip
    add("")
    if "W4" in runs:
        for side, what in ((many, "home node"), (apart, "server")):
            placement = runs["W4"][side][0]["placement"]
            add(f"W4's queues by {what} ({side}): " + ", ".join(f"{n}: {c}" for n, c in placement.items()) + ".")
        add("")
    add("CPU per process, cores (CPU seconds ÷ the phase's wall time from the start signal to the last reply; medians of the runs). "
        "The last column is every process of the machine meanwhile (/proc/stat): what it leaves beside this run's total is other work.")
    add("")
    add(f"| phase | system | items/s | server processes (etcd, nodes; servers) | clients | this run's total | server µs of CPU per item | the machine, all processes (of {os.cpu_count()}) |")
    add("|---|---|---:|---|---:|---:|---:|---:|")
    for w, phases in (("W1", ("produce", "drain")), ("W2", ("total",)), ("W4", ("produce", "drain"))):
        if w not in runs:
            continue
        for phase in phases:
            for system in (one, many, apart):
                cpu = _cpu_med(runs[w][system], phase)
                rate = _med(runs[w][system], phase)
                server = {n: c for n, c in cpu.items() if n not in ("clients", "machine")}
                servers = ", ".join(f"{n} {c:.2f}" for n, c in server.items())
                ours = sum(server.values()) + cpu["clients"]
                add(f"| {w} {phase} | {system} | {rate:,.0f} | {servers} | {cpu['clients']:.2f} | {ours:.2f} | "
                    f"{sum(server.values()) / rate * 1e6:.1f} | {cpu['machine']:.2f} |")
    add("")
    f = out.get("forwarding")
    if f:
        add(f"Forwarding: one queue of 1 partition homed on {f['home']}; Produce (100 items) and Lease (batch 100) sent to "
            f"{f['home']} (direct) or to {f['via']}, which homes none of it and forwards one hop. p50 over {4 * f['calls']} "
            f"sequential calls per path (4 rounds, alternating), items/s with {s.produce_inflight} calls in flight "
            f"({f['items']:,} items, best of 2 per path; Lease+Complete: the Complete always goes to the home). "
            f"1-min load avg {out['load']['forwarding']:.1f}.")  # fmt: skip
        add("")
        add("| call | direct p50 ms | via another node p50 ms | hop costs | direct items/s | via another node items/s | ratio |")
        add("|---|---:|---:|---:|---:|---:|---:|")
        p, r = f["p50_ms"], f["items_per_s"]
        for call, rk in (("Produce", "Produce"), ("Lease", "Lease+Complete")):
            d, h = p[f"{call} direct"], p[f"{call} hop"]
            rd, rh = r[f"{rk} direct"], r[f"{rk} hop"]
            add(f"| {call if call == 'Produce' else 'Lease (+ Complete at the home)'} | {d:.2f} | {h:.2f} | +{h - d:.2f} ms | {rd:,.0f} | {rh:,.0f} | {rh / rd:.2f} |")
        add("")
    k = out.get("kill")
    if k:
        add(f"A node killed -9 during W2 ({k['items']:,} items, {plan.procs}+{plan.procs} processes, unary calls, leases of "
            f"{KILL_LEASE_TIMEOUT_S} s): killed {k['windows_s']['before']:.1f} s after the start, restarted {k['windows_s']['dead'] - k['restart_to_serving_ms'] / 1000:.1f} s later, "
            f"serving {k['restart_to_serving_ms'] / 1000:.1f} s after its restart; 1-min load avg {out['load']['kill']:.1f}.")  # fmt: skip
        add("")
        add("| window | seconds | completed items/s | produced items/s |")
        add("|---|---:|---:|---:|")
        for wname, label in (("before", "before the kill"), ("dead", "node dead (kill → serving again)"), ("after", "after (serving again → last completion)")):
            add(f"| {label} | {k['windows_s'][wname]:.1f} | {k['completed_per_s'][wname]:,.0f} | {k['produced_per_s'][wname]:,.0f} |")
        add("")
        add(f"After the kill: first client error {k['first_error_ms']:,.0f} ms; last call sent to the dead node {k['last_send_to_dead_ms']:,.0f} ms "
            f"({k['sends_to_dead']} calls while it was dead, the backoff's probes included); the cluster's ClusterInfo showed it not live after "
            f"{k['cluster_saw_dead_ms']:,.0f} ms, every client's map after {k['clients_saw_dead_ms']:,.0f} ms. Items: {k['produced']:,} produced, "
            f"{k['completed']:,} completions acknowledged, {k['left']} left in the queue at the end; {k['unsure_produce']} produced items and "
            f"{k['unsure_complete']} completions had an unknown outcome (a call in flight to the dead node).")  # fmt: skip
        add("")
    return "\n".join(lines)
