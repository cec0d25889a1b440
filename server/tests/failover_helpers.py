"""Replicated queues under faults, with real node processes (cluster_helpers.py): the
load and the history checker of the audit (bench/audit.py, bench/history.py), the
shard's primary as ClusterInfo names it, the failover gap, and the digests of the
copies once the nodes are stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import grpc
from cluster_helpers import Cluster, Node

import audit
from audit import LEASE_TIMEOUT_S, QUEUE, Load, _drain, stub_consumer, stub_producer
from history import PRODUCE, Verdict, check
from querator.v1 import cluster_pb2, cluster_pb2_grpc, queues_pb2, queues_pb2_grpc

__all__ = [
    "LEASE_TIMEOUT_S",
    "LOAD_S",
    "QUEUE",
    "Run",
    "create_queue",
    "digests",
    "events",
    "in_sync",
    "wait_in_sync",
    "primary_of",
    "wait_primary",
]


# A load phase (before a fault, and on a new primary before the next step): at least
# LOAD_S seconds and LOAD_CALLS acknowledged Produce calls, at most LOAD_BOUND_S seconds.
# Short where the machine is quick, as long as needed where it is loaded, so the cases
# fit the suite's time; bench/replication_chaos.py runs them at length.
LOAD_S = 1.5
LOAD_CALLS = 100
LOAD_BOUND_S = 10.0


def create_queue(node: Node, replicas: int, partitions: int = 2, min_in_sync: int = 0) -> None:
    stub = queues_pb2_grpc.QueuesServiceStub(node.channel)
    info = queues_pb2.QueueInfo(
        queue_name=QUEUE,
        lease_timeout={"seconds": LEASE_TIMEOUT_S},
        requested_partitions=partitions,
        replicas=replicas,
        min_in_sync=min_in_sync,
    )
    stub.CreateQueue(queues_pb2.CreateQueueRequest(queue=info), timeout=20)


def placement(node: Node) -> cluster_pb2.QueuePlacement | None:
    stub = cluster_pb2_grpc.ClusterServiceStub(node.channel)
    info = stub.ClusterInfo(cluster_pb2.ClusterInfoRequest(), timeout=5)
    return next((q for q in info.queues if q.queue_name == QUEUE), None)


def primary_of(node: Node) -> tuple[str, int]:
    """The shard's primary and epoch as ``node`` sees them."""
    found = placement(node)
    assert found is not None, f"{QUEUE} is not in ClusterInfo"
    return found.primary, found.epoch


def in_sync(cluster: Cluster, via: Node) -> list[str]:
    """The in-sync set as ``via`` sees it."""
    found = placement(via)
    assert found is not None
    return list(found.in_sync)


def _log_records(node: Node) -> Iterator[tuple[str, dict[str, object]]]:
    """The node's log lines (JSON on its stderr, since its last start), each with its record."""
    for line in node.stderr_text(1 << 30).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield line, record


def events(node: Node, event: str) -> list[dict[str, object]]:
    """The node's log events named ``event``."""
    return [record for _, record in _log_records(node) if record.get("event") == event]


def errors_logged(node: Node) -> list[str]:
    """The node's log lines at error level or above (since its last start): an ordinary
    failover or hand-over logs none (it is no fault; the deposition has its own warning)."""
    return [line[:300] for line, record in _log_records(node) if record.get("level") in ("error", "critical")]


def wait_in_sync(cluster: Cluster, via: Node, count: int, timeout: float = 30) -> float:
    """Seconds until ``via`` sees ``count`` copies in sync."""
    started = time.monotonic()
    seen: list[str] = []
    while time.monotonic() < started + timeout:
        try:
            seen = in_sync(cluster, via)
        except grpc.RpcError:
            seen = []
        if len(seen) >= count:
            return time.monotonic() - started
        time.sleep(0.1)
    raise AssertionError(f"{count} copies not in sync after {timeout} s: {seen}")


def wait_primary(cluster: Cluster, via: Node, not_on: str = "", timeout: float = 30) -> tuple[str, int]:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            primary, epoch = primary_of(via)
            if primary and primary != not_on:
                return primary, epoch
            last = (primary, epoch)
        except grpc.RpcError as exc:
            last = exc.code()
        time.sleep(0.1)
    raise AssertionError(
        f"no primary other than {not_on!r} after {timeout} s (last seen {last}); {via.node_id}'s log:\n{via.stderr_text(3000)}"
    )


@dataclass
class Run:
    """Producers and consumers (the audit's, on plain stubs) over every node, recorded."""

    cluster: Cluster
    producers: int = 2
    consumers: int = 2
    load: Load = field(init=False)
    threads: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        from history import History

        self.load = Load(History(), {n.node_id: n.address for n in self.cluster.nodes})

    def start(self) -> None:
        for i in range(self.producers):
            self.threads.append(threading.Thread(target=stub_producer, args=(self.load, f"p{i}", 100 + i), daemon=True))
        for i in range(self.consumers):
            self.threads.append(threading.Thread(target=stub_consumer, args=(self.load, f"c{i}", 200 + i), daemon=True))
        for thread in self.threads:
            if thread.ident is None:  # not the direct Produces' (produce_to), started already
                thread.start()

    def load_for(self, seconds: float = LOAD_S, calls: int = LOAD_CALLS, bound: float = LOAD_BOUND_S) -> None:
        """Let the load run ``seconds``, then on until ``calls`` Produce calls sent since
        were acknowledged, ``bound`` seconds at most in all."""
        started = time.monotonic()
        time.sleep(seconds)
        while self.acknowledged_since(started) < calls and time.monotonic() < started + bound:
            time.sleep(0.1)

    def stop(self) -> None:
        self.load.stop.set()
        for thread in self.threads:
            thread.join(30)
        assert not any(t.is_alive() for t in self.threads), "a client did not stop"
        assert not self.load.errors, self.load.errors

    def finish(self, drain_s: float = 40) -> Verdict:
        """Stop the clients, drain the queue, check the history."""
        self.stop()
        drained = _drain(self.load, drain_s)
        verdict = check(self.load.history.calls(), LEASE_TIMEOUT_S * 1_000_000)
        assert drained, "the drain did not empty the queue: " + verdict.figures()
        return verdict

    def gap_after(self, at: float) -> float:
        """Seconds from ``at`` (monotonic) to the first Produce acknowledged that was sent after it."""
        oks = [c.ended for c in self.load.history.calls() if c.kind == PRODUCE and c.outcome == "ok" and c.invoked >= at]
        assert oks, "no Produce was acknowledged after the fault"
        return min(oks) - at

    def produce_to(self, node: Node, count: int, timeout: float) -> list[threading.Thread]:
        """``count`` Produce calls sent straight to ``node`` with a long deadline, each on
        a thread of its own (recorded: the checker judges them like the others)."""
        from audit import Stubs
        from querator.v1 import queue_pb2

        def send(i: int) -> None:
            stubs = Stubs({node.node_id: node.address})
            keys = [f"direct-{node.node_id}-{i}"]
            request = queue_pb2.ProduceRequest(queue_name=QUEUE, payloads=[k.encode() for k in keys])
            history = self.load.history
            call = history.invoke(PRODUCE, "direct", node.node_id, keys=keys)
            try:
                stubs.queue[node.node_id].Produce(request, timeout=timeout)
            except grpc.RpcError as exc:
                history.ended(call, exc.code().name)
            else:
                history.ended(call, None)
            finally:
                stubs.close()

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(count)]
        for thread in threads:
            thread.start()
        self.threads.extend(threads)
        return threads

    def slowest_produce_since(self, at: float) -> float:
        """The longest an acknowledged Produce in flight at ``at`` or sent after it took
        from ``at`` (or from when it was sent) to its answer (seconds)."""
        took = [
            c.ended - max(c.invoked, at)
            for c in self.load.history.calls()
            if c.kind == PRODUCE and c.outcome == "ok" and c.ended >= at
        ]
        return max(took, default=0.0)

    def acknowledged_since(self, at: float) -> int:
        return sum(1 for c in self.load.history.calls() if c.kind == PRODUCE and c.outcome == "ok" and c.invoked >= at)


_DIGEST = """
import asyncio, json, sys
from querator_server.manager import QueuesManager

async def main(path, name):
    manager = QueuesManager(path)
    await manager.start()
    try:
        copy = manager.copy(name)
        return {"digest": copy.digest(), "position": list(copy.position()), "incarnation": copy.incarnation}
    finally:
        await manager.stop()

print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
"""


# After its last Complete a partition still forgets its records of completed items in
# one more cycle, up to two lease timeouts later (actor/lifecycle.py): a copy stopped
# before that cycle lacks the primary's last change. A SIGTERM hands the queue over,
# another change the copies stopped before it lack. So: wait out the sweep, then
# kill -9 every node at once.
QUIET_S = 2 * LEASE_TIMEOUT_S + 1.5


def stop_quietly(nodes: Iterable[Node]) -> None:
    """Stop the nodes for a digest check: once the queue is quiet, every node at once."""
    time.sleep(QUIET_S)
    running = [n for n in nodes if n.proc is not None and n.proc.poll() is None]
    for node in running:
        node.signal(signal.SIGKILL)
    for node in running:
        node.stop()


def digests(node: Node) -> dict[str, object]:
    """This node's copy of the queue, read from its data directory (the node stopped):
    its digest, position and incarnation."""
    assert node.proc is None or node.proc.poll() is not None, "stop the node first"
    out = subprocess.run(
        [sys.executable, "-c", _DIGEST, node.data_dir, QUEUE], capture_output=True, text=True, timeout=60, env=dict(os.environ)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


__all__ += ["audit", "placement", "stop_quietly", "QUIET_S"]
