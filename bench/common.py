"""Shared helpers: free ports, owned child processes, payloads, statistics, memory.

Everything the benchmark starts is registered here and stopped by PID at exit,
also when a workload fails or the run is interrupted.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

HOST = "127.0.0.1"
PAYLOAD_BYTES = 256
STAMP = struct.Struct(">Q")  # first 8 payload bytes: produce time, time.monotonic_ns()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(line.strip() for line in f.readlines()[-lines:])
    except OSError:
        return ""


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen[bytes] | None = None, log_path: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before listening on {port}: {tail(log_path)}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {HOST}:{port} after {timeout:.0f} s")


# --- cleanup -------------------------------------------------------------------------------

_cleanups: list[tuple[str, Callable[[], None]]] = []


def on_exit(name: str, action: Callable[[], None]) -> Callable[[], None]:
    """Register a stop action; returns a function that runs it once and unregisters it."""
    entry = (name, action)
    _cleanups.append(entry)

    def run_once() -> None:
        if entry in _cleanups:
            _cleanups.remove(entry)
            action()

    return run_once


def _run_cleanups() -> None:
    while _cleanups:
        name, action = _cleanups.pop()
        try:
            action()
        except Exception as exc:  # keep stopping the rest
            print(f"bench: stopping {name} failed: {exc}", file=sys.stderr)


def _on_signal(signum: int, _frame: object) -> None:
    _run_cleanups()
    sys.exit(128 + signum)


def install_cleanup_handlers() -> None:
    atexit.register(_run_cleanups)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)


def stop_pid(pid: int, grace: float = 10.0) -> None:
    """SIGTERM one process by PID, then SIGKILL it if it lingers."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        except ChildProcessError:  # not our child: poll for existence
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def start_owned(name: str, argv: Sequence[str], log_path: str, **kwargs: object) -> tuple[subprocess.Popen[bytes], Callable[[], None]]:
    """Start a long-running child process whose output goes to log_path; stop it at exit."""
    log = open(log_path, "ab")  # noqa: SIM115 - closed by the stop action
    proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]

    def stop() -> None:
        stop_pid(proc.pid)
        log.close()

    return proc, on_exit(name, stop)


# --- payloads ------------------------------------------------------------------------------


class Payloads:
    """256-byte payloads: an 8-byte produce timestamp, then random bytes (incompressible)."""

    def __init__(self, pool_items: int = 4096) -> None:
        self._rest = PAYLOAD_BYTES - STAMP.size
        self._pool = os.urandom(self._rest * (pool_items + 1))
        self._items = pool_items
        self._next = 0

    def batch(self, count: int, stamp_ns: int | None = None) -> list[bytes]:
        stamp = STAMP.pack(time.monotonic_ns() if stamp_ns is None else stamp_ns)
        out = []
        rest, pool, i = self._rest, self._pool, self._next
        for _ in range(count):
            start = (i % self._items) * rest
            out.append(stamp + pool[start : start + rest])
            i += 7  # stride so consecutive batches differ
        self._next = i
        return out


def stamp_of(payload: bytes) -> int:
    return int(STAMP.unpack_from(payload)[0])


# --- statistics ----------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, int(round(p / 100 * (len(sorted_values) - 1)))))
    return float(sorted_values[k])


def median(values: Sequence[float]) -> float:
    return percentile(sorted(values), 50)


# --- memory --------------------------------------------------------------------------------


def _status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mib(pid: int) -> float:
    return _status_kb(pid, "VmRSS") / 1024


def peak_rss_mib(pid: int) -> float:
    return _status_kb(pid, "VmHWM") / 1024


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process has used so far, all its threads, user and system."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return out


def tree_pss_mib(pid: int) -> float:
    """Proportional set size of a process and all its descendants (shared memory counted once)."""
    total_kb = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        stack.extend(_children(p))
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total_kb += int(line.split()[1])
                        break
        except OSError:
            pass
    return total_kb / 1024


def git_commit(repo_dir: str) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo_dir, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_dir, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() + (" (work tree has uncommitted changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Pipe:
    """Requests written one at a time on one bidirectional stream, answers taken in the
    order sent (the server answers each request once, in order)."""

    def __init__(self, call: Any) -> None:
        import asyncio
        from collections import deque

        self._call = call
        self._waiting: deque[Any] = deque()
        self._lock = asyncio.Lock()
        self._reader = asyncio.create_task(self._read())

    async def ask(self, message: Any) -> Any:
        import asyncio

        answer = asyncio.get_running_loop().create_future()
        async with self._lock:
            self._waiting.append(answer)
            await self._call.write(message)
        return await answer

    async def _read(self) -> None:
        import grpc

        try:
            while (answer := await self._call.read()) is not grpc.aio.EOF:
                self._waiting.popleft().set_result(answer)
        finally:
            while self._waiting:
                self._waiting.popleft().set_exception(ConnectionError("the stream ended"))

    async def close(self) -> None:
        await self._call.done_writing()
        await self._reader
