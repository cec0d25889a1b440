"""Replicated queues: R = 1, 2, 3 on one cluster (``run.py --nodes 3 --replicas 1,2,3``).

One etcd and N ``querator serve --cluster`` nodes (cluster_bench.ClusterService); every
workload runs once per R in a round, the order of the R values rotating from round to
round, so the ratios compare runs made seconds apart on the same (shared, noisy) machine:

- W1: one queue of 1 partition; one producer process (``--produce-inflight`` Produce calls
  of 100 in flight), then one consumer process (``--consume-inflight`` Lease + Complete
  loops). With R > 1 the queue's partitions all live on its primary, with R - 1 copies.
- W2: 2 producer and 2 consumer processes at once on one queue of 4 partitions. With
  R = 1 the partitions spread over the nodes (today's placement); with R > 1 they are all
  on the primary: the comparison is what a user gets, not the same placement.
- Latency: Produce (100 items) and Lease (batch 100, its Complete untimed) sent one at a
  time by plain generated stubs to the queue's primary (its home with R = 1): p50 and p99.

The clients are cluster_bench's raw routing stubs (Produce and Lease to the queue's
home, which is the shard's primary with R > 1; no forwarding hop). CPU of etcd and of
every node is read per phase, so each figure says where the machine's time went: with
R > 1 the copies' apply and fsync run on the same cores as the primary and the clients.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import common
from cluster_bench import NODE_TTL_S, ClusterService, RoutedClient, _phase, _shares
from workloads import Consumer, PhaseFailed, Producer, Settings, admin, expect_left

# The targets (R = 2 against R = 1 on the same cluster).
PRODUCE_RATIO_TARGET = 0.6
DRAIN_RATIO_TARGET = 0.6
PRODUCE_P50_EXTRA_MS = 1.0
W2_PARTITIONS = 4


@dataclass
class ReplicatedClient(RoutedClient):
    """RoutedClient whose CreateQueue asks for ``replicas`` copies (0: the cluster's default)."""

    replicas: int = 0

    async def create_queue(self, name: str, partitions: int) -> None:
        from google.protobuf.duration_pb2 import Duration

        qpb = self._state["qpb"]
        info = qpb.QueueInfo(queue_name=name, requested_partitions=partitions, lease_timeout=Duration(seconds=self.lease_timeout_s),
                             expire_timeout=Duration(seconds=24 * 3600), replicas=self.replicas)  # fmt: skip
        await self._state["queues"].CreateQueue(qpb.CreateQueueRequest(queue=info), timeout=30)


def _client(cluster: ClusterService, replicas: int, i: int) -> ReplicatedClient:
    return ReplicatedClient(address=cluster.addresses[i % cluster.size], prefer=i, replicas=replicas)


def _primary(cluster: ClusterService, queue: str) -> str:
    """The address of the queue's (first partition's) home: the primary with R > 1."""
    home = cluster.homes([queue])[queue][0]
    return cluster.addresses[cluster.node_ids.index(home)]


def _wait_in_sync(cluster: ClusterService, queue: str, replicas: int, timeout: float = 60) -> None:
    """Until ClusterInfo shows every copy in sync (the primary counts a copy once it claimed it)."""
    if replicas <= 1:
        return
    import grpc

    from querator.v1 import cluster_pb2, cluster_pb2_grpc

    deadline = time.monotonic() + timeout
    seen: list[str] = []
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        stub = cluster_pb2_grpc.ClusterServiceStub(channel)
        while time.monotonic() < deadline:
            info = stub.ClusterInfo(cluster_pb2.ClusterInfoRequest(queue_names=[queue]), timeout=5)
            found = next((q for q in info.queues if q.queue_name == queue), None)
            seen = list(found.in_sync) if found is not None else []
            if len(seen) >= replicas:
                return
            time.sleep(0.1)
    raise PhaseFailed(f"{queue}: {replicas} copies not in sync after {timeout:.0f} s: {seen}")


def rw1(cluster: ClusterService, s: Settings, replicas: int, tag: str) -> dict[str, Any]:
    q = f"rw1-{tag}"
    client = _client(cluster, replicas, 0)
    admin(client, "create", [q], 1)
    _wait_in_sync(cluster, q, replicas)
    pids = dict(cluster.pids)
    produce, p_cpu = _phase([client], [Producer([q], s.items, s.produce_inflight)], s, pids)
    drain, d_cpu = _phase([client], [Consumer([q] * s.consume_inflight)], s, pids, targets={q: s.items})
    expect_left(client, [q], [0])
    home = cluster.homes([q])[q][0]
    admin(client, "drop", [q])
    return {
        "produce": produce.items_of("produce") / produce.elapsed_of("produce"),
        "drain": drain.items_of("consume") / drain.elapsed_of("consume"),
        "cpu": {"produce": p_cpu, "drain": d_cpu},
        "primary": home,
    }


def rw2(cluster: ClusterService, s: Settings, replicas: int, tag: str) -> dict[str, Any]:
    q, n, procs = f"rw2-{tag}", s.w2_items, 2
    admin(_client(cluster, replicas, 0), "create", [q], W2_PARTITIONS)
    _wait_in_sync(cluster, q, replicas)
    roles: list[Any] = [Producer([q], k, s.produce_inflight) for k in _shares(n, procs)]
    roles += [Consumer([q] * s.consume_inflight, latency=True) for _ in range(procs)]
    clients = [_client(cluster, replicas, i) for i in range(procs)] * 2
    phase, cpu = _phase(clients, roles, s, dict(cluster.pids), targets={q: n})
    expect_left(clients[0], [q], [0])
    admin(clients[0], "drop", [q])
    lat = phase.latencies_ms
    return {
        "total": phase.items_of("consume") / phase.elapsed_of("consume"),
        "p50_ms": common.percentile(lat, 50),
        "p99_ms": common.percentile(lat, 99),
        "cpu": {"total": cpu},
    }


async def _latency(address: str, queue: str, calls: int) -> dict[str, list[float]]:
    """``calls`` sequential Produce(100) and then as many Lease(100) (+ an untimed Complete) on plain stubs."""
    import grpc
    from google.protobuf.duration_pb2 import Duration

    from querator.v1 import queue_pb2 as pb
    from querator.v1 import queue_pb2_grpc

    payloads = common.Payloads()
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = queue_pb2_grpc.QueueServiceStub(channel)
        out: dict[str, list[float]] = {"Produce": [], "Lease": []}
        for i in range(calls + 10):  # the first 10 warm the path, not counted
            t = time.perf_counter()
            await stub.Produce(pb.ProduceRequest(queue_name=queue, payloads=payloads.batch(100)), timeout=30)
            if i >= 10:
                out["Produce"].append((time.perf_counter() - t) * 1000)
        for i in range(calls + 10):
            t = time.perf_counter()
            reply = await stub.Lease(pb.LeaseRequest(queue_name=queue, batch_size=100, client_id="lat", columnar=True,
                                                     request_timeout=Duration(nanos=500_000_000)), timeout=30)  # fmt: skip
            ms = (time.perf_counter() - t) * 1000
            if not reply.columns.ids:
                raise PhaseFailed(f"Lease {i} found nothing in {queue}")
            if i >= 10:
                out["Lease"].append(ms)
            await stub.Complete(pb.CompleteRequest(queue_name=queue, partition=reply.partition, ids=reply.columns.ids), timeout=30)
        return out


def _latency_child(args: tuple[Any, ...], out: Any, nice: int = 0) -> None:
    try:
        if nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        out.put((None, asyncio.run(_latency(*args))))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out.put((f"{type(exc).__name__}: {exc}", None))


def rlat(cluster: ClusterService, s: Settings, replicas: int, tag: str, calls: int, nice: int = 0) -> dict[str, Any]:
    q = f"rlat-{tag}"
    client = _client(cluster, replicas, 0)
    admin(client, "create", [q], 1)
    _wait_in_sync(cluster, q, replicas)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_latency_child, args=((_primary(cluster, q), q, calls), out, nice), daemon=True)
    p.start()
    try:
        error, result = out.get(timeout=s.time_limit_s)
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    if error:
        raise PhaseFailed(f"latency: {error}")
    admin(client, "drop", [q])
    return {
        f"{call} {pct}": common.percentile(sorted(v), pct) for call, v in result.items() for pct in (50, 99)
    } | {"calls": calls}


def run(args: Any, s: Settings, workdir: str, source_dir: str | None) -> dict[str, Any]:
    cluster = ClusterService(workdir, args.nodes, source_dir)
    try:
        cluster.start()
        if args.node_nice:  # the nodes and etcd (and the latency client) ahead of everything else on the machine
            for pid in cluster.pids.values():
                os.setpriority(os.PRIO_PROCESS, pid, args.node_nice)
        values = args.replicas
        print(f"bench: {args.nodes} nodes {cluster.pids}; R = {', '.join(map(str, values))}, {args.repeat} rounds", flush=True)
        calls = max(100, s.items // 500)
        jobs = {
            "W1": lambda r, tag: rw1(cluster, s, r, tag),
            "W2": lambda r, tag: rw2(cluster, s, r, tag),
            "latency": lambda r, tag: rlat(cluster, s, r, tag, calls, args.node_nice),
        }
        out: dict[str, Any] = {"runs": {}, "load": {}, "nodes": cluster.node_ids, "calls": calls}
        chosen = {w.upper() for w in args.only}
        if "W1" in chosen:
            chosen.add("LATENCY")
        for w in [w for w in ("W1", "W2", "latency") if w.upper() in chosen]:
            out["load"][w] = os.getloadavg()[0]
            for r in range(args.repeat):
                for replicas in values[r % len(values) :] + values[: r % len(values)]:  # rotate which R goes first
                    started = time.monotonic()
                    res = jobs[w](replicas, f"r{replicas}-{r}")
                    res["load"] = os.getloadavg()[0]
                    out["runs"].setdefault(w, {}).setdefault(replicas, []).append(res)
                    print(f"bench: R={replicas} {w} round {r + 1} ({time.monotonic() - started:.0f} s): "
                          + ", ".join(f"{k}={v:,.2f}" for k, v in res.items() if isinstance(v, float) and k != "load"), flush=True)  # fmt: skip
        out["load"]["end"] = os.getloadavg()[0]
        return out
    finally:
        cluster.stop()


def _med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median([r[key] for r in runs])


def _ratio(runs: dict[int, list[dict[str, Any]]], top: int, key: str) -> tuple[float, str]:
    """R=top ÷ R=1: the ratio of the medians, and each round's (rounds pair up)."""
    each = ", ".join(f"{y[key] / x[key]:.2f}" for x, y in zip(runs[1], runs[top], strict=True))
    return _med(runs[top], key) / _med(runs[1], key), each


def report(out: dict[str, Any], s: Settings, args: Any) -> str:
    lines: list[str] = []
    add = lines.append
    runs = out["runs"]
    values = args.replicas
    n = len(out["nodes"])
    add(f"{n} nodes (real etcd on this machine, `--cluster-lease-ttl {NODE_TTL_S}`), R = {', '.join(map(str, values))} "
        f"(default min in-sync copies: 1 for R = 2, 2 for R = 3); every workload once per R in each of {args.repeat} rounds, the "
        f"order of R rotating; medians, the ratio of the medians to R = 1 and each round's ratio. Clients: raw generated "
        f"stubs, Produce and Lease to the queue's primary (its home with R = 1), no forwarding. {os.cpu_count()} cores shared by "
        f"every node, etcd and the clients, and by other work on this machine (the 1-min load average is given)."
        + (f" etcd, the nodes and the latency client ran at nice {args.node_nice}: ahead of the other work, as with a core each."
           if args.node_nice else ""))  # fmt: skip
    add("")
    add("| figure | " + " | ".join(f"R = {r}" for r in values) + " | " + " | ".join(f"R = {r} ÷ R = 1 (rounds)" for r in values if r != 1) + " | target | met |")
    add("|---|" + "---:|" * len(values) + "---|" * (len(values) - 1) + "---|---|")
    rows = [
        ("W1", "produce", f"W1 produce items/s (1 queue, 1 partition, 1 process, {s.items:,} items)", PRODUCE_RATIO_TARGET, True),
        ("W1", "drain", "W1 drain items/s (1 process, Lease + Complete)", DRAIN_RATIO_TARGET, True),
        ("W2", "total", f"W2 total items/s (2 + 2 processes, {W2_PARTITIONS} partitions, {s.w2_items:,} items)", None, True),
        ("W2", "p50_ms", "W2 produce → lease p50 ms (full load: mostly backlog)", None, False),
        ("W2", "p99_ms", "W2 produce → lease p99 ms", None, False),
    ]
    for w, key, label, target, higher in rows:
        if w not in runs:
            continue
        meds = [_med(runs[w][r], key) for r in values]
        cells = [f"{m:,.0f}" if higher else f"{m:,.1f}" for m in meds]
        ratios = [_ratio(runs[w], r, key) for r in values if r != 1]
        rcells = [f"{x:.2f}x ({each})" for x, each in ratios]
        r2 = dict(zip([r for r in values if r != 1], ratios, strict=True)).get(2)
        met = "" if target is None or r2 is None else ("yes" if r2[0] >= target else "**no**")
        add(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(rcells) + f" | {f'R=2 ≥ {target}x' if target else ''} | {met} |")
    lat = runs.get("latency", {})
    for call in ("Produce", "Lease") if lat else ():
        for pct in (50, 99):
            key = f"{call} {pct}"
            meds = [_med(lat[r], key) for r in values]
            deltas = [f"{_med(lat[r], key) - meds[0]:+.2f} ms ({', '.join(f'{y[key] - x[key]:+.2f}' for x, y in zip(lat[1], lat[r], strict=True))})" for r in values if r != 1]
            target, met = "", ""
            if call == "Produce" and pct == 50 and 2 in values:
                target = f"R=2 ≤ R=1 + {PRODUCE_P50_EXTRA_MS:.1f} ms"
                met = "yes" if _med(lat[2], key) - meds[0] <= PRODUCE_P50_EXTRA_MS else "**no**"
            add(f"| {call}({'100' if call == 'Produce' else 'batch 100'}) p{pct} ms, {out['calls']} sequential calls | "
                + " | ".join(f"{m:.2f}" for m in meds) + " | " + " | ".join(deltas) + f" | {target} | {met} |")  # fmt: skip
    add("")
    add("CPU per process during each phase, cores (CPU seconds ÷ the phase's wall time; medians of the rounds), and server CPU "
        "(etcd and every node) per item. The machine column is every process on it meanwhile (/proc/stat).")
    add("")
    add("| phase | R | items/s | etcd and nodes (cores) | clients | server µs of CPU per item | the machine |")
    add("|---|---:|---:|---|---:|---:|---:|")
    for w, phases in (("W1", ("produce", "drain")), ("W2", ("total",))):
        if w not in runs:
            continue
        for phase in phases:
            for r in values:
                rr = runs[w][r]
                names = rr[0]["cpu"][phase].keys()
                cpu = {k: statistics.median([x["cpu"][phase][k] for x in rr]) for k in names}
                rate = _med(rr, phase)
                server = {k: c for k, c in cpu.items() if k not in ("clients", "machine")}
                add(f"| {w} {phase} | {r} | {rate:,.0f} | {', '.join(f'{k} {c:.2f}' for k, c in server.items())} | "
                    f"{cpu['clients']:.2f} | {sum(server.values()) / rate * 1e6:.1f} | {cpu['machine']:.2f} |")  # fmt: skip
    if "W1" in runs:
        add("")
        add("W1's primary by round: " + "; ".join(f"R = {r}: {', '.join(x['primary'] for x in runs['W1'][r])}" for r in values) + ".")
    add("")
    add("1-min load average at the start of each workload: " + ", ".join(f"{k} {v:.1f}" for k, v in out["load"].items()) + ".")
    return "\n".join(lines)
