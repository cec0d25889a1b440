"""Tasks the worker tests run in child processes (``executor="process"``): a child finds
a task by its module and name, so they live in a module of their own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import querator

QUEUE = "hard-limits"

tasks = querator.Tasks(QUEUE)


def _write_after(path: str, seconds: float) -> None:
    time.sleep(seconds)
    Path(path).write_text(str(os.getpid()))


@tasks.task("killed", executor="process", time_limit=1, max_attempts=1)
def write_after(path: str, seconds: float) -> None:
    """The side effect comes after the sleep: past the time limit, it must never happen."""
    _write_after(path, seconds)


@tasks.task("abandoned", handler_timeout=1, max_attempts=1)
def write_after_on_a_thread(path: str, seconds: float) -> None:
    """The same on a thread: abandoned at the soft limit, it runs on and writes anyway."""
    _write_after(path, seconds)


class Refused(Exception):
    pass


@tasks.task("refused", executor="process", time_limit=5, dead_on=[Refused])
def refuse(reason: str) -> None:
    raise Refused(reason)


@tasks.task("pid", executor="process", time_limit=5)
def note_pid(path: str) -> None:
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
