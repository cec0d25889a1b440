"""Helpers shared by the SDK tests (a module name of its own: server/tests has a conftest too)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

import querator
from querator.embedded import EmbeddedServer

T = TypeVar("T")


def unique(prefix: str = "q") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def run(coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
    """Run a coroutine in a fresh event loop, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll ``predicate`` until true; fail after ``timeout`` seconds (always bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


# -- fixtures -------------------------------------------------------------------------
# No conftest.py here: server/tests has one and both would be imported as "conftest".
# Test modules import these by name; they build on the querator_server fixture of the
# installed pytest plugin (querator.pytest_plugin): a real server per test on tmp_path.



@pytest.fixture
def srv(querator_server: EmbeddedServer) -> EmbeddedServer:
    return querator_server


@pytest.fixture
def client(querator_client: querator.Client) -> querator.Client:
    return querator_client


@pytest.fixture
def queue(client: querator.Client) -> str:
    name = unique()
    client.create_queue(name)
    return name


def run_until_empty(worker: querator.Worker, timeout: float = 60) -> float:
    """worker.run(until_empty=True) on a thread, bounded in time; the seconds it took."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            worker.run(until_empty=True)
        except BaseException as exc:
            errors.append(exc)

    began = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        worker.stop(wait=False)
        raise AssertionError("run(until_empty=True) did not return")
    if errors:
        raise errors[0]
    return time.monotonic() - began
