"""python -m querator_server.backup: a copy taken while the server runs starts as a server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc

from querator.v1 import queues_pb2

from conftest import Stubs, ThreadServer


def run_backup(src: str, dest: str) -> subprocess.CompletedProcess[str]:
    # Its own process, as operators run it: LMDB must not open an environment twice in
    # one process, and the server (in this process) has them open.
    return subprocess.run(
        [sys.executable, "-m", "querator_server.backup", src, dest],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_backup_while_serving_restores_items_leases_and_settings(data_dir: str, tmp_path: Path) -> None:
    backup_dir = str(tmp_path / "backup")
    server = ThreadServer(data_dir)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stubs = Stubs(channel)
            stubs.create("dead")
            stubs.create("work", dead_queue="dead", max_attempts=3, requested_partitions=2)
            stubs.produce("work", [f"item {n}".encode() for n in range(50)])
            leased = stubs.lease("work", batch_size=5)
            stubs.create("doomed")
            stubs.queues.DeleteQueue(queues_pb2.DeleteQueueRequest(queue_name="doomed"), timeout=10)
            # Too many partitions for a commit group: an environment of its own (uid 4).
            stubs.create("wide", requested_partitions=40)
            stubs.produce("wide", [b"wide item"])
            result = run_backup(data_dir, backup_dir)
            assert result.returncode == 0, result.stderr
            copied = [line.split("\t")[0] for line in result.stdout.splitlines()]
            assert copied == ["catalog", os.path.join("groups", "0"), os.path.join("queues", "4")]
            # The server keeps serving while and after the copy is taken.
            stubs.produce("work", [b"after the backup"])
    finally:
        server.stop()

    restored = ThreadServer(backup_dir)
    try:
        with grpc.insecure_channel(restored.address) as channel:
            stubs = Stubs(channel)
            info = stubs.queues.GetQueue(queues_pb2.GetQueueRequest(queue_name="work"), timeout=10).queue
            assert (info.dead_queue, info.max_attempts, info.requested_partitions) == ("dead", 3, 2)
            stats = stubs.stats("work")
            assert sum(p.total for p in stats.partitions) == 50
            assert sum(p.total_leased for p in stats.partitions) == 5
            # The leases are still held: their ids complete in the restored copy.
            stubs.complete("work", leased.partition, [i.id for i in leased.items])
            assert sum(p.total for p in stubs.stats("work").partitions) == 45
            assert sum(p.total for p in stubs.stats("wide").partitions) == 1
    finally:
        restored.stop()


def test_backup_refuses_a_non_empty_destination_and_a_non_data_dir(tmp_path: Path) -> None:
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "x").write_text("")
    (tmp_path / "src" / "catalog").mkdir(parents=True)
    refused = run_backup(str(tmp_path / "src"), str(tmp_path / "dest"))
    assert refused.returncode == 1 and "not an empty directory" in refused.stderr
    not_data = run_backup(str(tmp_path), str(tmp_path / "other"))
    assert not_data.returncode == 1 and "not a Querator data directory" in not_data.stderr
