"""The third side of ``run.py --nodes K``: K independent servers doing the cluster's work.

K plain ``querator serve`` processes (no etcd, no ``--cluster``), each with its own data
dir, its own client processes and its own queues: what K nodes would do if they had
nothing to coordinate and no call to route. A cluster of K nodes doing the same work must
reach at least 0.9 of it (coordination and routing may cost at most a tenth).

The same work: the workloads of cluster_bench run unchanged on this side. Client process
*i* is bound to server *i* mod K as it is to node *i* mod K on the cluster, so each server
has the client processes its node has. Each queue a workload creates is split over the
servers as the cluster's placement splits its partitions over the nodes, read from the
cluster itself (the same queues created there, their homes read, then dropped): W1's one
queue of K partitions becomes a queue of 1 partition on every server, W2's likewise, and
each of W4's queues goes to the server whose node homes it. A queue keeps its name on every
server, so the workloads' completion counters count the work of all servers together and a
phase lasts until the last server's work is done: throughput is the total items ÷ that time,
as on the other sides.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from cluster_bench import Target
from querator_target import QueratorService
from workloads import admin, expect_left


class IndependentServers:
    """``count`` plain servers, each its own data dir and port, stopped by PID."""

    name = "independent servers"

    def __init__(self, workdir: str, count: int, source_dir: str | None = None) -> None:
        self.node_ids = [f"s{i + 1}" for i in range(count)]
        self._services = [QueratorService(workdir, source_dir) for _ in range(count)]
        self.addresses: list[str] = []
        self.pids: dict[str, int] = {}

    def start(self) -> list[str]:
        for node, service in zip(self.node_ids, self._services):
            self.addresses.append(service.start().address)
            self.pids[node] = service.pid
        return self.addresses

    def stop(self) -> None:
        for service in self._services[::-1]:
            service.stop()  # also removes its data dir; a no-op for one never started


@dataclass
class IndependentTarget(Target):
    """The servers as one side: queue operations go to every server holding part of a queue.

    ``mirror``: the cluster whose placement the servers copy (its node *j* ↔ server *j*).
    """

    mirror: Target | None = None
    _held: dict[str, Counter[str]] = field(default_factory=dict, repr=False)  # queue -> partitions per server
    _splits: dict[tuple[tuple[str, ...], int], dict[str, Counter[str]]] = field(default_factory=dict, repr=False)

    def _split(self, queues: list[str], partitions: int) -> dict[str, Counter[str]]:
        """Partitions per server of each queue, as the cluster places them (read once per shape)."""
        key = (tuple(queues), partitions)
        if key not in self._splits:
            assert self.mirror is not None and len(self.mirror.nodes) == len(self.nodes)
            homes = self.mirror.placement(queues, partitions)
            to_server = dict(zip(self.mirror.nodes, self.nodes))
            self._splits[key] = {q: Counter(to_server[node] for node in homes[q]) for q in queues}
        return self._splits[key]

    def _by_server(self, queues: list[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = defaultdict(list)
        for q in queues:
            for server in self._held[q]:
                out[server].append(q)
        return out

    def create(self, queues: list[str], partitions: int) -> None:
        split = self._split(queues, partitions)
        for server in self.nodes:
            by_count: dict[int, list[str]] = defaultdict(list)  # one call per partition count
            for q in queues:
                if split[q][server]:
                    by_count[split[q][server]].append(q)
            for count, some in by_count.items():
                admin(self.client_at(server, 0), "create", some, count)
        self._held.update(split)

    def expect_empty(self, queues: list[str]) -> None:
        for server, some in self._by_server(queues).items():
            expect_left(self.client_at(server, 0), some, [0] * len(some))

    def drop(self, queues: list[str]) -> None:
        for server, some in self._by_server(queues).items():
            admin(self.client_at(server, 0), "drop", some)
        for q in queues:
            self._held.pop(q, None)

    def homes(self, queues: list[str]) -> dict[str, list[str]]:
        return {q: sorted(self._held[q].elements(), key=self.nodes.index) for q in queues}
