"""The SDK over a queue with a faulty partition: produce goes on, a complete of its items
raises Unavailable with the reason, and queue_stats tells which partition and why."""

from __future__ import annotations

from pathlib import Path

import pytest

import querator
from querator.embedded import EmbeddedServer

from sdk_helpers import wait_until


def test_sdk_sees_a_faulty_partition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fault = tmp_path / "fault"
    monkeypatch.setenv("QUERATOR_FAULT_FILE", str(fault))
    with EmbeddedServer(tmp_path / "data", sync=False, commit_groups=False) as srv, srv.client(retries=0) as client:
        client.create_queue("q", partitions=2)
        client.produce("q", [b"a", b"b"])
        client.produce("q", [b"c", b"d"])
        batch = client.lease("q", batch_size=2)
        bad = batch[0].partition
        uid = int(batch[0].id.split(".")[0], 16)
        fault.write_text(f"partition-error queues/{uid} p{bad}\n")

        with pytest.raises(querator.Unavailable, match=f"partition {bad} of queue 'q' is faulty"):
            client.complete(batch, timeout=5)
        stats = client.queue_stats("q")
        faulty = [p for p in stats.partitions if p.faulty]
        assert [p.partition for p in faulty] == [bad]
        assert "injected fault" in faulty[0].failure and faulty[0].faulty_since is not None
        assert all(p.failure == "" and p.faulty_since is None for p in stats.partitions if p.partition != bad)
        assert client.produce("q", [b"e"]).partitions != [bad]

        fault.unlink()
        wait_until(lambda: not any(p.faulty for p in client.queue_stats("q").partitions), timeout=30)
        client.complete(batch)
        assert sorted(i.payload for i in client.lease("q", batch_size=10, wait=0)) in ([b"a", b"b", b"e"], [b"c", b"d", b"e"])
