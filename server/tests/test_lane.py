"""Storage lanes: jobs run in order on the lane's one thread and their results reach the
awaiting coroutine, however many lanes finish while the loop is busy."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from querator_server.storage.lane import StorageLane


def test_jobs_run_in_order_on_one_thread_and_return_their_results() -> None:
    lane = StorageLane("test-lane")
    seen: list[tuple[int, int]] = []

    def job(n: int) -> int:
        seen.append((n, threading.get_ident()))
        return n * n

    async def scenario() -> list[int]:
        futures = [lane.run(lambda n=n: job(n)) for n in range(200)]
        return list(await asyncio.gather(*futures))

    try:
        assert asyncio.run(scenario()) == [n * n for n in range(200)]
    finally:
        lane.shutdown()
    assert [n for n, _ in seen] == list(range(200))
    assert len({thread for _, thread in seen}) == 1
    assert seen[0][1] != threading.get_ident()


def test_an_exception_reaches_the_caller_and_the_lane_goes_on() -> None:
    lane = StorageLane("test-lane")

    def fail() -> None:
        raise ValueError("disk on fire")

    async def scenario() -> int:
        with pytest.raises(ValueError, match="disk on fire"):
            await lane.run(fail)
        return await lane.run(lambda: 7)

    try:
        assert asyncio.run(scenario()) == 7
    finally:
        lane.shutdown()


def test_results_of_many_lanes_finishing_together_all_arrive() -> None:
    lanes = [StorageLane(f"test-lane-{i}") for i in range(4)]

    def slow(n: int) -> int:
        time.sleep(0.0005 if n % 7 == 0 else 0)
        return n

    async def scenario() -> None:
        futures = [lanes[n % 4].run(lambda n=n: slow(n)) for n in range(2_000)]
        busy_until = time.monotonic() + 0.05
        while time.monotonic() < busy_until:  # a busy loop: results pile up meanwhile
            pass
        assert await asyncio.gather(*futures) == list(range(2_000))

    try:
        asyncio.run(scenario())
    finally:
        for lane in lanes:
            lane.shutdown()


def test_a_cancelled_waiter_does_not_stop_the_job_or_the_others() -> None:
    lane = StorageLane("test-lane")
    release = threading.Event()
    ran: list[str] = []

    def blocked() -> str:
        release.wait(5)
        ran.append("blocked")
        return "blocked"

    async def scenario() -> str:
        first = lane.run(blocked)
        second = lane.run(lambda: "second")
        first.cancel()
        release.set()
        return await second

    try:
        assert asyncio.run(scenario()) == "second"
    finally:
        lane.shutdown()
    assert ran == ["blocked"]


def test_run_in_executor_works_and_shutdown_waits_for_queued_jobs() -> None:
    lane = StorageLane("test-lane")
    done: list[int] = []

    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(lane, lambda: 41) + 1

    assert asyncio.run(scenario()) == 42
    for n in range(50):
        lane.submit(lambda n=n: done.append(n))
    lane.shutdown(wait=True)
    assert done == list(range(50))
    with pytest.raises(RuntimeError, match="shut down"):
        lane.submit(lambda: None)
