"""Network faults between the processes of one machine, for the replication tests and
bench/replication_network.py: an etcd and three nodes whose every connection to a peer
and to etcd goes through a loopback proxy of its own (cluster_helpers.Proxy), and a
seeded schedule that breaks one node's links at a time, for a bounded time.

Node ``i`` reaches node ``j`` through proxy ``(i, j)`` (``QUERATOR_TEST_PEER_ADDRESSES``)
and etcd through proxy ``(i, "etcd")`` (its ``--cluster`` URL names that proxy), so a
fault can cut a node off from etcd, from its peers, or from both, in one direction or
both: ``cut`` (connections reset, new ones refused), ``blackhole`` (silent: bytes held
both ways), ``one-way`` (what it sends is held, or what it is answered is lost) and
``delay`` (every chunk held a while). Clients reach the nodes directly.

Acknowledgements: each node logs, at debug level, every cycle its primary answered
(``replicated_answers``: epoch, lsn). ``epochs()`` gathers them from every node, so a
run can check that at most one epoch's primary acknowledged at a time: each epoch's
acknowledgements come from one node, and the last of one epoch precedes the first of
the next.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime

import grpc
from cluster_helpers import DOWN, DROP, HOLD, UP, Cluster, Node, Proxy
from failover_helpers import QUEUE, placement

MODES = ("cut", "blackhole", "one-way-out", "one-way-in", "delay")
SCOPES = ("all", "etcd", "peers")


class Network:
    """An etcd and ``size`` nodes n1..n<size>, every node-to-node and node-to-etcd
    connection through a proxy of its own."""

    def __init__(self, root: str, size: int = 3, ttl: int = 2, args: list[str] | None = None) -> None:
        self.cluster = Cluster(root, size=0, ttl=ttl)
        self.size = size
        self.ttl = ttl
        self.args = args or []
        self.proxies: dict[tuple[str, str], Proxy] = {}

    def start(self) -> Network:
        cluster = self.cluster
        cluster.etcd.start()
        env = {"QUERATOR_LOG_LEVEL": "debug"}
        nodes = [
            Node(f"n{i}", os.path.join(cluster.root, f"n{i}"), cluster.url, self.ttl, dict(env), self.args)
            for i in range(1, self.size + 1)
        ]
        for node in nodes:
            for peer in nodes:
                if peer is not node:
                    self.proxies[(node.node_id, peer.node_id)] = Proxy(peer.address)
            etcd = self.proxies[(node.node_id, "etcd")] = Proxy(cluster.etcd.endpoint)
            node.cluster_url = f"etcd://{etcd.address}/{cluster.prefix}"
            node.env["QUERATOR_TEST_PEER_ADDRESSES"] = ",".join(
                f"{peer.node_id}={self.proxies[(node.node_id, peer.node_id)].address}" for peer in nodes if peer is not node
            )
        for node in nodes:
            cluster.nodes.append(node)
            node.start()
        return self

    def __enter__(self) -> Network:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.restore()
        for node in self.cluster.nodes:  # first, while they reach etcd (a stopping primary hands over)
            node.stop()
        for proxy in self.proxies.values():
            proxy.close()
        self.cluster.stop()

    def links(self, node: str, scope: str) -> list[tuple[Proxy, bool]]:
        """The proxies of ``node``'s links in ``scope``, each with whether the node is
        its client side (True: the node's own calls; False: its peers' calls to it)."""
        out = []
        for (a, b), proxy in self.proxies.items():
            if b == "etcd":
                if a == node and scope in ("all", "etcd"):
                    out.append((proxy, True))
            elif scope in ("all", "peers") and node in (a, b):
                out.append((proxy, a == node))
        return out

    def restore(self) -> None:
        for proxy in self.proxies.values():
            proxy.restore()


def apply(links: list[tuple[Proxy, bool]], mode: str, delay_ms: float = 300) -> None:
    """Break ``links`` one way: ``one-way-out`` holds what the node sends (its calls'
    requests, its answers to its peers), ``one-way-in`` loses what reaches it."""
    for proxy, outgoing in links:
        if mode == "cut":
            proxy.cut()
        elif mode == "blackhole":
            proxy.blackhole()
        elif mode == "delay":
            proxy.delay(delay_ms)
        elif mode == "one-way-out":
            proxy.mode(UP if outgoing else DOWN, HOLD)
        elif mode == "one-way-in":
            proxy.mode(DOWN if outgoing else UP, DROP)
        else:
            raise ValueError(f"no such mode: {mode!r}")


@dataclass
class Flaps:
    """Faults on one node's links at a time, switched on and off for ``seconds``:
    a node (the queue's primary more often than not), a scope (all its links, etcd
    only, peers only) and a mode, for ``low_s``-``high_s`` seconds, then everything
    restored for as long. Left restored."""

    network: Network
    seconds: float
    seed: int = 0
    low_s: float = 0.5
    high_s: float = 3.5
    log: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Flaps:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _primary(self) -> str:
        for node in self.network.cluster.nodes:
            try:
                found = placement(node)
            except grpc.RpcError:
                continue
            if found is not None and found.primary:
                return found.primary
        return ""

    def _run(self) -> None:
        rng = random.Random(self.seed)
        started = time.monotonic()
        until = started + self.seconds
        nodes = [n.node_id for n in self.network.cluster.nodes]
        try:
            while not self._stop.is_set() and time.monotonic() < until:
                primary = self._primary()
                victim = primary if primary and rng.random() < 0.6 else rng.choice(nodes)
                scope = rng.choice(SCOPES)
                mode = rng.choice(MODES)
                held = rng.uniform(self.low_s, self.high_s)
                apply(self.network.links(victim, scope), mode)
                what = f"{mode} {scope} of {victim}{' (primary)' if victim == primary else ''}"
                self.log.append(f"{time.monotonic() - started:6.1f} s: {what} for {held:.1f} s")
                self.counts[f"{mode} {scope}"] = self.counts.get(f"{mode} {scope}", 0) + 1
                self._stop.wait(max(0.0, min(held, until - time.monotonic())))
                self.network.restore()
                self._stop.wait(max(0.0, min(rng.uniform(self.low_s, self.high_s), until - time.monotonic())))
        finally:
            self.network.restore()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)


@dataclass
class Epoch:
    epoch: int
    nodes: set[str]
    first: float  # wall-clock seconds of its first and last acknowledged cycle
    last: float
    cycles: int
    answers: int


def epochs(nodes: list[Node]) -> list[Epoch]:
    """Every epoch that acknowledged anything, from the nodes' logs, in epoch order."""
    found: dict[int, Epoch] = {}
    for node in nodes:
        for line in node.stderr_text(1 << 30).splitlines():
            if '"replicated_answers"' not in line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") != "replicated_answers" or record.get("queue") != QUEUE:
                continue
            at = datetime.fromisoformat(str(record["timestamp"])).timestamp()
            epoch = int(record["epoch"])
            entry = found.get(epoch)
            if entry is None:
                entry = found[epoch] = Epoch(epoch, set(), at, at, 0, 0)
            entry.nodes.add(node.node_id)
            entry.first, entry.last = min(entry.first, at), max(entry.last, at)
            entry.cycles += 1
            entry.answers += int(record.get("answers", 0))
    return [found[e] for e in sorted(found)]


def overlaps(found: list[Epoch]) -> list[str]:
    """Where more than one epoch's primary acknowledged at a time (or one epoch on two nodes)."""
    out = [f"epoch {e.epoch} acknowledged on {sorted(e.nodes)}" for e in found if len(e.nodes) > 1]
    for before, after in zip(found, found[1:], strict=False):
        if after.first <= before.last:
            out.append(
                f"epoch {after.epoch} ({sorted(after.nodes)}) acknowledged from {after.first:.3f}, "
                f"epoch {before.epoch} ({sorted(before.nodes)}) until {before.last:.3f}"
            )
    return out


def gaps(found: list[Epoch]) -> list[float]:
    """Seconds from each epoch's last acknowledgement to the next one's first."""
    return [after.first - before.last for before, after in zip(found, found[1:], strict=False)]


__all__ = ["MODES", "SCOPES", "Epoch", "Flaps", "Network", "apply", "epochs", "gaps", "overlaps", "QUEUE"]
