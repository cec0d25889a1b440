"""Stopping the manager when an actor's task has already ended abnormally: the rest
of the server still stops (every other queue drained and its storage closed, the
catalog closed, the data directory unlocked), and the dead actor's failure is logged
rather than raised out of the shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import pytest

from querator_server.actor import LeaseRequest, LeaseResult, ProduceRequest
from querator_server.logging import EVENT_ATTR
from querator_server.manager import QueuesManager
from querator_server.model import NewItem, QueueConfig


@pytest.mark.parametrize("grouped", [False, True], ids=["own-directory", "commit-group"])
def test_stop_stops_everything_else_and_logs_the_actor_task_that_died(
    tmp_path: Path, grouped: bool, caplog: pytest.LogCaptureFixture
) -> None:
    data = str(tmp_path / "data")

    async def main() -> None:
        manager = QueuesManager(data, workers=2, commit_groups=grouped)
        await manager.start()
        for name in ("dead", "alive"):
            await manager.create(QueueConfig(name=name, partitions=1))
        await manager.actor("alive").submit(ProduceRequest(items=[NewItem(payload=b"kept")]))
        # The actor's own task (LogicalQueue names it queue:<name>), ended from outside
        # while it runs: what stop then finds is a task that did not finish its loop.
        task = next(t for t in asyncio.all_tasks() if t.get_name() == "queue:dead")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert task.cancelled()

        with caplog.at_level(logging.ERROR, logger="querator.server"):
            await manager.stop()
        events = [getattr(r, EVENT_ATTR, {}) for r in caplog.records]
        assert [e.get("queue") for e in events if e.get("event") == "queue_stop_failed"] == ["dead"]

        # Everything else stopped: the lock on the data directory is free and the other
        # queue's item was kept; the queue whose actor died loads again too.
        again = QueuesManager(data, workers=2, commit_groups=grouped)
        await again.start()
        try:
            leased = await again.actor("alive").submit(LeaseRequest(batch_size=10, client_id="", wait_until_us=0))
            assert isinstance(leased, LeaseResult)
            assert leased.payloads == [b"kept"]
            assert again.failed_queues() == 0
            assert again.actor("dead").totals().ready == 0
        finally:
            await again.stop()

    asyncio.run(asyncio.wait_for(main(), timeout=60))
