"""The audit: a cluster under random faults, every call recorded, the history checked.

An etcd and three ``querator serve --cluster`` nodes (2 s membership TTL, 2 s leases, six
partitions). Producers on plain gRPC stubs (a random node per call; now and then a request
the server must refuse whole; a batch of unknown outcome is sent again half the time, and
always when its items carry idempotency keys, as 30% of batches do) and on the SDK's
AsyncClient (its ProduceStreams, one per node). Consumers on plain stubs (a random node per
call; some leases keyed and completed by two keys at once; now and then too slow for their
lease) and on the SDK's LeaseStreams (half their completes riding on the next Lease), which
complete, retry or abandon what they get. Meanwhile a seeded random schedule of faults, one
after another: kill -9 and restart, SIGSTOP and SIGCONT (some longer than the TTL) of a
node or of etcd, some node faults inside etcd's. Every call is recorded with its outcome
(ok, failed, unknown) and its items (bench/history.py). After the faults every process is
running again, a drain leases and completes what is left, and the history is checked:
nothing acknowledged lost, nothing delivered after its Complete was acknowledged, nothing
unexpected, every duplicate explained (a lease ran out, a retry, an unknown outcome).

    .venv/bin/python bench/audit.py --duration 600 --seed 7

server/tests/test_audit.py runs it with 45 s of faults in CI (QUERATOR_AUDIT_SECONDS=N for longer). The seed fixes the fault
schedule and the clients' choices, not the threads' timing: a failing seed shows where to
look, it does not replay the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc

from history import COMPLETE, LEASE, PRODUCE, RETRY, UNKNOWN, Delivery, History, Verdict, calls_by_outcome, check
from querator.v1 import (
    cluster_pb2,
    cluster_pb2_grpc,
    queue_pb2,
    queue_pb2_grpc,
    queues_pb2,
    queues_pb2_grpc,
    storage_pb2,
    storage_pb2_grpc,
)

QUEUE = "audit"
NODES = 3
PARTITIONS = 6
TTL_S = 2
LEASE_TIMEOUT_S = 2
RPC_TIMEOUT_S = 3.0
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
]
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def fixed_port(rng: random.Random, taken: set[int]) -> int:
    """A free port below the kernel's ephemeral range, for a process restarted on it: no
    outgoing connection takes it as its source port while the process is down, as one
    could take a port from the range (and neither does a listener on port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in taken:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            taken.add(port)
            return port
    raise RuntimeError("no free port below the ephemeral range")


class Process:
    """A child on fixed loopback ports (restarts keep its address), stderr to ``log_path``."""

    def __init__(self, name: str, command: Callable[[], list[str]], ready: Callable[[], bool], log_path: str) -> None:
        self.name = name
        self._command = command
        self._ready = ready
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    def start(self, timeout: float = 60) -> None:
        env = dict(os.environ, QUERATOR_LOG_LEVEL="warning")
        with open(self.log_path, "ab") as log:
            log.write(f"--- {self.name} started at {time.monotonic():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self._command(), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {tail(self.log_path)}")
            if self._ready():
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s: {tail(self.log_path)}")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.paused = False

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def tail(path: str, lines: int = 6) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:])
    except OSError:
        return ""


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _etcd_ready(port: int) -> bool:
    """etcd answers a read: it is up and has elected itself (a port alone is not enough
    for a node that starts next)."""
    from aetcd import rpc  # type: ignore[import-untyped]

    if not _port_open(port):
        return False
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            rpc.KVStub(channel).Range(rpc.RangeRequest(key=b"probe"), timeout=1)
            return True
        except grpc.RpcError:
            return False


def _grpc_ready(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=0.5)
            return True
        except grpc.FutureTimeoutError:
            return False


class Cluster:
    """etcd and NODES nodes, their data and one log under ``root``."""

    def __init__(self, root: str) -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise RuntimeError("the audit needs the etcd binary (Debian: apt-get install etcd-server)")
        self.log_path = os.path.join(root, "cluster.log")
        ports, taken = random.Random(), set[int]()  # not the run's seed: two runs at once must not collide
        client_port, peer_port = fixed_port(ports, taken), fixed_port(ports, taken)
        client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        etcd_argv = [
            etcd, "--name", "audit", "--data-dir", os.path.join(root, "etcd"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"audit={peer}", "--log-level", "warn",
        ]  # fmt: skip
        self.etcd = Process("etcd", lambda: etcd_argv, lambda: _etcd_ready(client_port), self.log_path)
        url = f"etcd://127.0.0.1:{client_port}/audit"
        self.addresses: dict[str, str] = {}
        self.nodes: dict[str, Process] = {}
        for i in range(1, NODES + 1):
            node_id, address = f"n{i}", f"127.0.0.1:{fixed_port(ports, taken)}"
            argv = [
                sys.executable, "-m", "querator_server.cli", "--address", address,
                "--data-dir", os.path.join(root, node_id), "--cluster", url, "--node-id", node_id,
                "--cluster-lease-ttl", str(TTL_S),
            ]  # fmt: skip
            self.addresses[node_id] = address
            self.nodes[node_id] = Process(node_id, lambda argv=argv: argv, lambda a=address: _grpc_ready(a), self.log_path)

    def start(self) -> None:
        self.etcd.start()
        for node in self.nodes.values():
            node.start()

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        self.etcd.stop()

    def process(self, name: str) -> Process:
        return self.etcd if name == "etcd" else self.nodes[name]


# -- faults --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    after_s: float  # quiet time before it
    kind: str  # "kill" (kill -9, then restart) or "pause" (SIGSTOP, then SIGCONT)
    target: str  # "etcd" or a node id
    hold_s: float  # how long the target stays down
    # A node fault that starts ``during.after_s`` into this one (of etcd) and ends after it.
    during: Fault | None = None

    def __str__(self) -> str:
        text = f"{self.kind} {self.target} for {self.hold_s:.1f}s"
        return text + (f", {self.during.after_s:.1f}s in: {self.during}" if self.during else "")


def schedule(rng: random.Random, duration_s: float) -> list[Fault]:
    """Faults one after another for about ``duration_s``: a node (2 in 3) or etcd, killed
    or paused; a third of the pauses outlast the TTL; half of etcd's later faults have a
    node fault inside. Each of kill and long pause, of a node and of etcd, comes once among
    the first four, in a random order."""
    first = [("kill", "node", False), ("pause", "node", True), ("kill", "etcd", False), ("pause", "etcd", True)]
    rng.shuffle(first)
    faults: list[Fault] = []
    elapsed = 0.0
    while elapsed < duration_s:
        if first:
            kind, what, long = first.pop()
        else:
            what = "etcd" if rng.random() < 1 / 3 else "node"
            kind = "kill" if rng.random() < 0.5 else "pause"
            long = kind == "pause" and rng.random() < 1 / 3
        target = "etcd" if what == "etcd" else f"n{rng.randint(1, NODES)}"
        hold = rng.uniform(TTL_S + 0.5, TTL_S + 3.0) if long else rng.uniform(0.2, 1.5)
        during = None
        if what == "etcd" and not first and rng.random() < 0.5:
            node_kind = "kill" if rng.random() < 0.5 else "pause"
            node_hold = rng.uniform(0.2, TTL_S + 3.0)
            during = Fault(rng.uniform(0, hold), node_kind, f"n{rng.randint(1, NODES)}", node_hold)
        fault = Fault(rng.uniform(0.5, 3.0), kind, target, hold, during)
        faults.append(fault)
        elapsed += fault.after_s + fault.hold_s + (2.0 if kind == "kill" else 0.0)  # a restart takes a while
        if during is not None:
            elapsed += during.hold_s + 2.0
    return faults


def label(fault: Fault) -> str:
    what = "etcd" if fault.target == "etcd" else "node"
    longer = " past the TTL" if fault.kind == "pause" and fault.hold_s > TTL_S else ""
    return f"{fault.kind} {what}{longer}"


# -- clients -------------------------------------------------------------------------------


def _code(exc: grpc.RpcError) -> str:
    return exc.code().name  # type: ignore[no-any-return]


def _us(ts: Any) -> int:
    return int(ts.seconds) * 1_000_000 + int(ts.nanos) // 1000


def _deliveries(reply: queue_pb2.LeaseResponse) -> list[Delivery]:
    """A Lease answer's items, by the key in their payload and their copy's (partition, message_id)."""
    return [
        Delivery(i.payload.decode(), reply.partition, i.message_id or i.id, i.id, _us(i.lease_deadline)) for i in reply.items
    ]


class Stubs:
    """A channel and the queue stub per node, kept across restarts (addresses are fixed)."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self.channels = {n: grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for n, a in addresses.items()}
        self.queue = {n: queue_pb2_grpc.QueueServiceStub(c) for n, c in self.channels.items()}

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


@dataclass
class Load:
    history: History
    addresses: dict[str, str]
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)  # a client that broke (a bug of the audit or the SDK)


def stub_producer(load: Load, tag: str, seed: int) -> None:
    rng = random.Random(seed)
    stubs = Stubs(load.addresses)
    nodes = sorted(load.addresses)
    n = 0
    try:
        while not load.stop.is_set():
            keys = [f"{tag}-{n + i}" for i in range(rng.randint(1, 10))]
            n += len(keys)
            invalid = rng.random() < 0.04  # one item the server must refuse, and with it the request
            keyed = rng.random() < 0.3  # a send again must not store it twice
            items = [queue_pb2.ProduceItem(payload=k.encode(), idempotency_key=k if keyed else "") for k in keys]
            if invalid:
                items[-1].kind = "k" * 300
            if invalid or keyed or rng.random() < 0.5:
                request = queue_pb2.ProduceRequest(queue_name=QUEUE, items=items)
            else:
                request = queue_pb2.ProduceRequest(queue_name=QUEUE, payloads=[k.encode() for k in keys])
            node = rng.choice(nodes)
            outcome = _produce(load.history, stubs, tag, node, keys, request, keyed)
            if outcome == UNKNOWN and (keyed or rng.random() < 0.5) and not load.stop.is_set():
                # At least once: the same items again, elsewhere (stored twice, unless keyed).
                _produce(load.history, stubs, tag, rng.choice([x for x in nodes if x != node]), keys, request, keyed)
            time.sleep(rng.uniform(0, 0.02))
    except Exception as exc:  # reported as a broken client
        load.errors.append(f"{tag}: {exc!r}")
    finally:
        stubs.close()


def _produce(history: History, stubs: Stubs, tag: str, node: str, keys: list[str], request: Any, keyed: bool) -> str:
    call = history.invoke(PRODUCE, tag, node, keys=keys, keyed=keyed)
    try:
        stubs.queue[node].Produce(request, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        return history.ended(call, _code(exc))
    return history.ended(call, None)


def stub_consumer(load: Load, tag: str, seed: int) -> None:
    rng = random.Random(seed)
    stubs = Stubs(load.addresses)
    nodes = sorted(load.addresses)
    by_key: list[tuple[str, list[Delivery]]] = []  # keyed leases, to complete by their keys
    leases = 0
    try:
        while not load.stop.is_set():
            node = rng.choice(nodes)
            request = queue_pb2.LeaseRequest(
                queue_name=QUEUE, batch_size=rng.randint(1, 10), request_timeout={"nanos": 300_000_000}
            )
            keyed = rng.random() < 0.15
            if keyed:  # served at the key's home; completed later by key, two keys at once
                leases += 1
                request.lease_key = f"{tag}-lease-{leases}"
            call = load.history.invoke(LEASE, tag, node, note=f"lease_key {request.lease_key}" if keyed else "")
            try:
                reply = stubs.queue[node].Lease(request, timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as exc:
                load.history.ended(call, _code(exc))
                continue
            got = load.history.delivered(call, _deliveries(reply))
            load.history.ended(call, None)
            if keyed:
                by_key.append((request.lease_key, got))
                if len(by_key) == 2:
                    _complete_by_keys(load.history, stubs, tag, rng.choice(nodes), by_key)
                    by_key = []
                continue
            if not got:
                continue
            complete, retry = _choose(rng, got)
            if rng.random() < 0.03:
                # Too slow: the lease runs out first (cut short when the load stops, so a
                # run's end does not wait for it; the settle that follows is judged as any).
                load.stop.wait(LEASE_TIMEOUT_S + 0.3)
            via = node if rng.random() < 0.5 else rng.choice(nodes)  # settled through any node: forwarded to the home
            for kind, chosen in ((COMPLETE, complete), (RETRY, retry)):
                if not chosen:
                    continue
                settle = load.history.invoke(kind, tag, via, deliveries=chosen)
                ids = [d.item_id for d in chosen]
                try:
                    if kind == COMPLETE:
                        req = queue_pb2.CompleteRequest(queue_name=QUEUE, partition=reply.partition, ids=ids)
                        stubs.queue[via].Complete(req, timeout=RPC_TIMEOUT_S)
                    else:
                        items = [queue_pb2.RetryItem(id=i) for i in ids]
                        stubs.queue[via].Retry(
                            queue_pb2.RetryRequest(queue_name=QUEUE, partition=reply.partition, items=items),
                            timeout=RPC_TIMEOUT_S,
                        )
                except grpc.RpcError as exc:
                    load.history.ended(settle, _code(exc))
                    continue
                load.history.ended(settle, None)
    except Exception as exc:
        load.errors.append(f"{tag}: {exc!r}")
    finally:
        stubs.close()


def _complete_by_keys(
    history: History, stubs: Stubs, tag: str, node: str, leased: list[tuple[str, list[Delivery]]]
) -> None:
    """Complete by lease keys. Its OK covers the items still leased under each key when it
    was applied: a delivery whose lease ran out before the OK came back may or may not
    have been completed (unknown). Its keys may live on several homes, and an error from
    one may come after others applied their part: any error leaves the outcome unknown."""
    held = [d for _, got in leased for d in got]
    keys = [key for key, _ in leased]
    call = history.invoke(COMPLETE, tag, node, deliveries=held, note=f"lease_keys {', '.join(keys)}")
    request = queue_pb2.CompleteRequest(queue_name=QUEUE, lease_keys=keys)
    try:
        stubs.queue[node].Complete(request, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as exc:
        history.end(call, UNKNOWN, _code(exc))
        return
    acknowledged_us = time.time_ns() // 1000
    if all(acknowledged_us < d.deadline_us for d in held):
        history.ended(call, None)
    else:
        history.end(call, UNKNOWN, "OK after a lease ran out")


def _choose(rng: random.Random, got: list[Any]) -> tuple[list[Any], list[Any]]:
    """Of a lease's items: those to complete (about 70%), to retry (10%); the rest are abandoned."""
    complete, retry = [], []
    for item in got:
        roll = rng.random()
        if roll < 0.7:
            complete.append(item)
        elif roll < 0.8:
            retry.append(item)
    return complete, retry


def sdk_clients(load: Load, seed: int, producers: int, consumers: int) -> None:
    """Producers and consumers on one AsyncClient (streams per node), in this thread's loop."""
    import querator

    async def produce(client: querator.AsyncClient, tag: str, rng: random.Random) -> None:
        n = 0
        while not load.stop.is_set():
            keys = [f"{tag}-{n + i}" for i in range(rng.randint(1, 10))]
            n += len(keys)
            # Keyed, the SDK sends it again itself after UNAVAILABLE: stored once all the same.
            keyed = rng.random() < 0.3
            call = load.history.invoke(PRODUCE, tag, "sdk", keys=keys, keyed=keyed)
            try:
                await client.produce(QUEUE, [querator.Item(k.encode(), idempotency_key=k if keyed else "") for k in keys])
            except querator.QueratorError as exc:
                load.history.ended(call, exc.status)
            else:
                load.history.ended(call, None)
            await asyncio.sleep(rng.uniform(0, 0.02))

    async def consume(client: querator.AsyncClient, tag: str, rng: random.Random) -> None:
        carried: dict[Delivery, Any] = {}  # to complete with the next Lease (complete=)
        while not load.stop.is_set():
            riding = load.history.invoke(COMPLETE, tag, "sdk", deliveries=carried) if carried else None
            call = load.history.invoke(LEASE, tag, "sdk")
            try:
                items = await client.lease(
                    QUEUE, batch_size=rng.randint(1, 10), wait=0.3, complete=list(carried.values()) or None
                )
            except querator.QueratorError as exc:
                for c in (call, riding):
                    if c is not None:
                        load.history.ended(c, exc.status)
                carried = {}
                continue
            if riding is not None:
                load.history.ended(riding, None)
                carried = {}
            got = load.history.delivered(
                call,
                [
                    Delivery(i.payload.decode(), i.partition, i.message_id, i.id, (i.lease_deadline - EPOCH) // timedelta(microseconds=1))
                    for i in items
                ],
            )
            load.history.ended(call, None)
            by_delivery = dict(zip(got, items))
            complete, retry = _choose(rng, got)
            if rng.random() < 0.5:  # completed by the next Lease, in the same call
                carried, complete = {d: by_delivery[d] for d in complete}, []
            for kind, chosen in ((COMPLETE, complete), (RETRY, retry)):
                if not chosen:
                    continue
                settle = load.history.invoke(kind, tag, "sdk", deliveries=chosen)
                leased = [by_delivery[d] for d in chosen]
                try:
                    await (client.complete(leased) if kind == COMPLETE else client.retry(leased))
                except querator.QueratorError as exc:
                    load.history.ended(settle, exc.status)
                else:
                    load.history.ended(settle, None)

    async def main() -> None:
        rng = random.Random(seed)
        async with querator.AsyncClient(list(load.addresses.values()), timeout=RPC_TIMEOUT_S, cluster_refresh=1) as client:
            tasks = [produce(client, f"sdk-p{i}", random.Random(rng.getrandbits(32))) for i in range(producers)]
            tasks += [consume(client, f"sdk-c{i}", random.Random(rng.getrandbits(32))) for i in range(consumers)]
            await asyncio.gather(*tasks)

    try:
        asyncio.run(main())
    except Exception as exc:
        load.errors.append(f"sdk: {exc!r}")


# -- the run -------------------------------------------------------------------------------


@dataclass
class Report:
    seed: int
    verdict: Verdict
    calls: dict[str, Counter[str]]
    sdk_calls: dict[str, Counter[str]]  # those of the SDK's clients (also in ``calls``)
    faults: Counter[str]
    fault_log: list[str]
    seconds: float
    drained: bool
    client_errors: list[str]
    server_errors: list[str]
    stories: list[str] = field(default_factory=list)
    partitions: list[str] = field(default_factory=list)

    @property
    def odd_codes(self) -> dict[str, int]:
        """Calls that ended INTERNAL or UNKNOWN: never the server's answer to a request
        (docs/operations.md, "Faults and what they return")."""
        return {
            f"{kind} {o}": n for kind, c in self.calls.items() for o, n in c.items() if o.split()[-1] in ("INTERNAL", "UNKNOWN")
        }

    @property
    def ok(self) -> bool:
        return self.verdict.ok and self.drained and not self.client_errors and not self.odd_codes

    def text(self) -> str:
        lines = [
            f"audit seed={self.seed}: {'OK' if self.ok else 'FAILED'} in {self.seconds:.0f}s"
            + ("" if self.drained else " (the drain did not empty the queue)"),
            "faults: " + ", ".join(f"{k}: {n}" for k, n in sorted(self.faults.items())),
            "calls: "
            + "; ".join(
                f"{kind} " + ", ".join(f"{o}: {n}" for o, n in sorted(c.items())) for kind, c in sorted(self.calls.items())
            ),
            "of which on the SDK: "
            + "; ".join(
                f"{kind} " + ", ".join(f"{o}: {n}" for o, n in sorted(c.items())) for kind, c in sorted(self.sdk_calls.items())
            ),
            self.verdict.figures(),
            f"server log lines at error level: {len(self.server_errors)}",
        ]
        lines += [f"  client broke: {e}" for e in self.client_errors]
        lines += [f"  calls that ended {o}: {n}" for o, n in self.odd_codes.items()]
        if not self.ok:
            lines += [f"  {f}" for f in self.verdict.findings[:20]]
            lines += ["fault log:", *(f"  {f}" for f in self.fault_log)]
            lines += self.stories + self.partitions
            lines += [f"  server: {e}" for e in self.server_errors[:20]]
        return "\n".join(lines)


def _create_queue(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = queues_pb2_grpc.QueuesServiceStub(channel)
        info = queues_pb2.QueueInfo(
            queue_name=QUEUE, lease_timeout={"seconds": LEASE_TIMEOUT_S}, requested_partitions=PARTITIONS
        )
        stub.CreateQueue(queues_pb2.CreateQueueRequest(queue=info), timeout=10)


def _live(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        info = cluster_pb2_grpc.ClusterServiceStub(channel).ClusterInfo(cluster_pb2.ClusterInfoRequest(), timeout=5)
    return {m.node_id for m in info.members if m.live}


def _wait_live(cluster: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if all(_live(a) == set(cluster.nodes) for a in cluster.addresses.values()):
                return
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the nodes do not all see each other live after {timeout:.0f} s")


def _inject(
    cluster: Cluster, faults: list[Fault], stop: threading.Event, log: list[str], counts: Counter[str], errors: list[str]
) -> None:
    try:
        _faults(cluster, faults, stop, log, counts)
    except Exception as exc:  # a process that did not come back
        errors.append(f"fault injection: {exc!r}")


def _faults(cluster: Cluster, faults: list[Fault], stop: threading.Event, log: list[str], counts: Counter[str]) -> None:
    def down(fault: Fault) -> None:
        process = cluster.process(fault.target)
        process.kill9() if fault.kind == "kill" else process.pause()
        log.append(f"{time.monotonic():.3f} {fault}")
        counts[label(fault)] += 1

    def up(fault: Fault, at: float) -> None:
        time.sleep(max(0.0, at - time.monotonic()))
        process = cluster.process(fault.target)
        process.start() if fault.kind == "kill" else process.resume()
        log.append(f"{time.monotonic():.3f} {fault.target} back")

    for fault in faults:
        if stop.wait(fault.after_s):
            return
        began = time.monotonic()
        down(fault)
        if fault.during is not None:  # a node down while etcd is: it comes back after etcd
            counts["a node fault inside an etcd fault"] += 1
            time.sleep(fault.during.after_s)
            down(fault.during)
        up(fault, began + fault.hold_s)
        if fault.during is not None:
            up(fault.during, began + fault.during.after_s + fault.during.hold_s)


def _stats(address: str) -> Any:
    with grpc.insecure_channel(address) as channel:
        stub = queues_pb2_grpc.QueuesServiceStub(channel)
        return stub.GetQueueStats(queues_pb2.GetQueueStatsRequest(queue_name=QUEUE), timeout=5)


def _drain(load: Load, timeout: float) -> bool:
    """Lease and complete until every partition is empty (none faulty); False if it never is."""
    stubs = Stubs(load.addresses)
    deadline = time.monotonic() + timeout
    nodes = sorted(load.addresses)
    try:
        while time.monotonic() < deadline:
            for node in nodes:
                call = load.history.invoke(LEASE, "drain", node)
                request = queue_pb2.LeaseRequest(queue_name=QUEUE, batch_size=100, request_timeout={"nanos": 200_000_000})
                try:
                    reply = stubs.queue[node].Lease(request, timeout=RPC_TIMEOUT_S)
                except grpc.RpcError as exc:
                    load.history.ended(call, _code(exc))
                    continue
                got = load.history.delivered(call, _deliveries(reply))
                load.history.ended(call, None)
                if got:
                    settle = load.history.invoke(COMPLETE, "drain", node, deliveries=got)
                    request = queue_pb2.CompleteRequest(queue_name=QUEUE, partition=reply.partition, ids=[d.item_id for d in got])
                    try:
                        stubs.queue[node].Complete(request, timeout=RPC_TIMEOUT_S)
                    except grpc.RpcError as exc:
                        load.history.ended(settle, _code(exc))
                        continue
                    load.history.ended(settle, None)
            try:
                stats = _stats(load.addresses[nodes[0]])
            except grpc.RpcError:
                continue
            if all(not p.faulty and p.total == 0 and p.scheduled == 0 for p in stats.partitions):
                return True
        return False
    finally:
        stubs.close()


def _partitions(address: str) -> list[str]:
    """Each partition's stats and first items, for a report."""
    lines = ["partitions:"]
    try:
        with grpc.insecure_channel(address) as channel:
            info = cluster_pb2_grpc.ClusterServiceStub(channel).ClusterInfo(cluster_pb2.ClusterInfoRequest(), timeout=5)
            homes = next((list(q.homes) for q in info.queues if q.queue_name == QUEUE), [])
            lines.append(f"  members: {[(m.node_id, m.live) for m in info.members]}, homes: {homes}")
            storage = storage_pb2_grpc.StorageServiceStub(channel)
            for p in _stats(address).partitions:
                lines.append(
                    f"  [{p.partition}] total {p.total} leased {p.total_leased} scheduled {p.scheduled} faulty {p.faulty} {p.failure}"
                )
                try:
                    page = storage.ListItems(
                        storage_pb2.ListItemsRequest(queue_name=QUEUE, partition=p.partition, page_size=20), timeout=5
                    )
                except grpc.RpcError as exc:
                    lines.append(f"    ListItems: {exc.code().name} {exc.details()}")
                    continue
                for item in page.items:
                    lines.append(
                        f"    {item.payload.decode(errors='replace')} id {item.id} message {item.message_id} "
                        f"leased {item.is_leased} deadline {_us(item.lease_deadline)} attempts {item.attempts}"
                    )
    except grpc.RpcError as exc:
        lines.append(f"  unavailable: {exc.code().name} {exc.details()}")
    return lines


def _server_errors(log_path: str) -> list[str]:
    out = []
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    if "Traceback" in line:
                        out.append(line.strip()[:300])
                    continue
                if isinstance(event, dict) and event.get("level") in ("error", "critical"):
                    out.append(line.strip()[:300])
    except OSError:
        pass
    return out


def run(
    root: str,
    *,
    seed: int,
    duration_s: float,
    stub_producers: int = 2,
    sdk_producers: int = 1,
    stub_consumers: int = 2,
    sdk_consumers: int = 1,
    drain_s: float = 60.0,
    progress: Callable[[str], None] | None = None,
) -> Report:
    """Faults for about ``duration_s`` under load, then the drain and the check."""
    started = time.monotonic()
    rng = random.Random(seed)
    faults = schedule(rng, duration_s)
    os.makedirs(root, exist_ok=True)
    cluster = Cluster(root)
    history = History()
    load = Load(history, cluster.addresses)
    fault_log: list[str] = []
    fault_counts: Counter[str] = Counter()
    drained = False
    stories: list[str] = []
    partitions: list[str] = []
    stop_faults = threading.Event()
    try:
        cluster.start()
        _wait_live(cluster, 60)
        _create_queue(cluster.addresses["n1"])
        threads = [
            threading.Thread(target=stub_producer, args=(load, f"p{i}", rng.getrandbits(32)), daemon=True)
            for i in range(stub_producers)
        ]
        threads += [
            threading.Thread(target=stub_consumer, args=(load, f"c{i}", rng.getrandbits(32)), daemon=True)
            for i in range(stub_consumers)
        ]
        threads.append(
            threading.Thread(target=sdk_clients, args=(load, rng.getrandbits(32), sdk_producers, sdk_consumers), daemon=True)
        )
        for t in threads:
            t.start()
        injector = threading.Thread(target=_inject, args=(cluster, faults, stop_faults, fault_log, fault_counts, load.errors))
        injector.start()
        injector.join(duration_s * 3 + 120)
        stop_faults.set()  # the fault under way ends: every process runs again
        injector.join(120)
        if injector.is_alive():
            raise RuntimeError("the fault injection did not end")
        load.stop.set()
        for t in threads:
            t.join(30)  # a call's deadline, the SDK's retries of a Lease, a slow consumer
            if t.is_alive():
                load.errors.append(f"{t.name} did not stop")
        if progress:
            progress(f"faults done after {time.monotonic() - started:.0f}s; draining")
        _wait_live(cluster, 60)
        drained = _drain(load, drain_s)
        verdict = check(history.calls(), LEASE_TIMEOUT_S * 1_000_000)
        if not verdict.ok or not drained:
            for finding in verdict.findings[:5]:
                stories += [f"history of {finding.key}:", *(f"  {line}" for line in history.story(finding.key))]
            partitions = _partitions(cluster.addresses["n1"])
    finally:
        stop_faults.set()  # on an error too: nothing the run started goes on after it
        load.stop.set()
        cluster.stop()
    return Report(
        seed=seed,
        verdict=verdict,
        calls=calls_by_outcome(history.calls()),
        sdk_calls=calls_by_outcome(c for c in history.calls() if c.node == "sdk"),
        faults=fault_counts,
        fault_log=fault_log,
        seconds=time.monotonic() - started,
        drained=drained,
        client_errors=list(load.errors),
        server_errors=_server_errors(cluster.log_path),
        stories=stories,
        partitions=partitions,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300, help="seconds of faults under load (default 300)")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--data-dir", help="where to keep data and logs (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    root = args.data_dir or tempfile.mkdtemp(prefix="querator-audit-")
    print(f"audit: seed {seed}, {args.duration:.0f}s of faults", flush=True)
    try:
        report = run(root, seed=seed, duration_s=args.duration, progress=lambda m: print(m, flush=True))
    finally:
        if not args.data_dir:
            shutil.rmtree(root, ignore_errors=True)
    print(report.text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
