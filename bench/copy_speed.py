"""How long a copy added to a replicated queue takes to be in sync, by its size.

Starts etcd and 3 ``querator serve --cluster`` nodes (cluster_bench.ClusterService) with
a ring of 4 change sets (so a new copy is filled by a snapshot, as a copy of a queue
older than the ring is), creates a queue of 2 copies and 2 partitions, fills it with N
items of 100 bytes (Produce of 1,000), then raises its replicas to 3 and times, from the
UpdateQueue, until ClusterInfo shows the third copy in sync. From the nodes' logs it
splits that time at the snapshot's start (``replica_snapshot_sent`` on the primary)
and its install (``replica_snapshot_installed`` on the new copy).

    .venv/bin/python bench/copy_speed.py --items 20000,200000 --runs 2

Bounded: each size's fill and copy must finish within ``--timeout`` s (120 by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import datetime
from typing import Any

import grpc
from google.protobuf import field_mask_pb2

from cluster_bench import ClusterService
from querator.v1 import cluster_pb2, cluster_pb2_grpc, queues_pb2, queues_pb2_grpc

ITEM_BYTES = 100
BATCH = 1_000


class RingedCluster(ClusterService):
    """ClusterService whose nodes keep a ring of 4 change sets and log at info (the
    snapshot's events)."""

    def start_node(self, i: int) -> None:
        import cluster_bench

        serve = cluster_bench._serve_argv

        def argv(address: str, data_dir: str) -> list[str]:
            out = serve(address, data_dir)
            out[out.index("--log-level") + 1] = "info"
            return out + ["--replica-ring", "4"]

        cluster_bench._serve_argv = argv
        try:
            super().start_node(i)
        finally:
            cluster_bench._serve_argv = serve


def _events(path: str, name: str) -> list[float]:
    """Wall-clock times (s) of the log events ``name`` in a node's log."""
    out: list[float] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if f'"{name}"' not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == name and "timestamp" in event:
                out.append(datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp())
    return out


def one(cluster: RingedCluster, items: int, tag: str, timeout: float) -> dict[str, Any]:
    name = f"copy-{tag}"
    with grpc.insecure_channel(cluster.addresses[0]) as channel:
        queues = queues_pb2_grpc.QueuesServiceStub(channel)
        info = cluster_pb2_grpc.ClusterServiceStub(channel)
        queues.CreateQueue(
            queues_pb2.CreateQueueRequest(queue=queues_pb2.QueueInfo(queue_name=name, requested_partitions=2, replicas=2)),
            timeout=30,
        )

        def placement() -> cluster_pb2.QueuePlacement:
            (found,) = info.ClusterInfo(cluster_pb2.ClusterInfoRequest(queue_names=[name]), timeout=5).queues
            return found

        deadline = time.monotonic() + timeout
        while len(placement().in_sync) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: 2 copies not in sync within {timeout:.0f} s")
            time.sleep(0.05)
        primary = placement().primary
        with grpc.insecure_channel(cluster.addresses[cluster.node_ids.index(primary)]) as direct:
            from querator.v1 import queue_pb2, queue_pb2_grpc

            stub = queue_pb2_grpc.QueueServiceStub(direct)
            filled = time.monotonic()
            for i in range(items // BATCH):
                batch = [queue_pb2.ProduceItem(payload=f"{tag}-{i}-{j}".encode().ljust(ITEM_BYTES, b".")) for j in range(BATCH)]
                stub.Produce(queue_pb2.ProduceRequest(queue_name=name, items=batch), timeout=60)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: filling took over {timeout:.0f} s")
            filled = time.monotonic() - filled
        (added,) = set(cluster.node_ids) - set(placement().replicas)
        started_wall = time.time()
        started = time.monotonic()
        queues.UpdateQueue(
            queues_pb2.UpdateQueueRequest(
                queue=queues_pb2.QueueInfo(queue_name=name, replicas=3), update_mask=field_mask_pb2.FieldMask(paths=["replicas"])
            ),
            timeout=30,
        )
        deadline = time.monotonic() + timeout
        while len(placement().in_sync) < 3:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the added copy on {added} not in sync within {timeout:.0f} s")
            time.sleep(0.02)
        took = time.monotonic() - started
    log = os.path.join(cluster.workdir, "{}.log")
    sent = [t for t in _events(log.format(primary), "replica_snapshot_sent") if t >= started_wall]
    installed = [t for t in _events(log.format(added), "replica_snapshot_installed") if t >= started_wall]
    out: dict[str, Any] = {"items": items, "fill_s": round(filled, 2), "in_sync_s": round(took, 2)}
    if sent and installed:
        out["to_snapshot_s"] = round(sent[0] - started_wall, 2)
        out["snapshot_s"] = round(installed[-1] - sent[0], 2)
        out["after_install_s"] = round(started_wall + took - installed[-1], 2)
    out["snapshots"] = len(sent)
    done = _events(log.format(primary), "replica_snapshot_done")
    if done:  # the primary's read time (logged by servers that have this event)
        with open(log.format(primary), encoding="utf-8", errors="replace") as f:
            for line in f:
                if '"replica_snapshot_done"' in line:
                    out["primary_read_s"] = json.loads(line).get("read_s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", default="20000,200000", help="queue sizes, comma-separated")
    parser.add_argument("--runs", type=int, default=1, help="runs of each size (a new queue each)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds each fill and each copy may take")
    parser.add_argument("--rev", default="", help="run the servers of this git commit (default: the working tree)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.items.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="copy-speed-") as workdir:
        source = None
        if args.rev:
            from querator_target import export_commit

            source = os.path.join(workdir, "src")
            print("servers of", export_commit(args.rev, os.path.dirname(os.path.dirname(os.path.abspath(__file__))), source))
        cluster = RingedCluster(workdir, 3, source)
        try:
            cluster.start()
            results: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
            for run in range(args.runs):
                for n in sizes:
                    found = one(cluster, n, f"{n}-{run}", args.timeout)
                    results[n].append(found)
                    print(json.dumps(found), flush=True)
        finally:
            cluster.stop()
    for n, runs in results.items():
        took = [r["in_sync_s"] for r in runs]
        print(f"{n:>9,} items: in sync {statistics.median(took):.2f} s (runs: {', '.join(f'{t:.2f}' for t in took)})")


if __name__ == "__main__":
    main()
