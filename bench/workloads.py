"""The workloads W1-W4, written once against a small client interface and run for every system.

A *client* (querator_target.QueratorClient, peers.*Client) is a picklable object with async
methods open, close, create_queue, drop_queue, produce(queue, payloads),
lease(queue, client_id, batch, wait_s) -> (token, payloads), complete(queue, token) and
finish(queue, client_id). Every producer and consumer is a separate process (multiprocessing,
spawn) running asyncio with several calls in flight; all processes connect first, then start
together. Times are time.monotonic_ns(), one clock for every process of the machine.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import queue as queue_mod
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

from common import Payloads, percentile, stamp_of


@dataclass
class Settings:
    items: int = 100_000  # W1 and W3's drained count
    w2_items: int = 200_000
    w3_stored: int = 1_000_000
    w4_items: int = 200_000
    w4_queues: int = 10
    batch: int = 100
    produce_inflight: int = 8  # concurrent Produce calls per producer process
    consume_inflight: int = 8  # concurrent Lease+Complete loops per consumer process
    w4_per_queue: int = 1  # W4: calls in flight per queue (produce) and loops per queue (drain)
    lease_wait_s: float = 0.5  # how long an empty Lease waits before the loop looks again
    time_limit_s: float = 900.0  # per phase; a phase past it stops and is reported as failed


@dataclass
class Producer:
    queues: list[str]
    items: int
    inflight: int
    rate: float | None = None  # items/s; None: as fast as the system answers


@dataclass
class Consumer:
    loops: list[str]  # one entry per concurrent Lease+Complete loop: the queue it leases from
    latency: bool = False


@dataclass
class Phase:
    """What the processes of one phase reported, on the shared monotonic clock."""

    t_go: int
    results: list[dict[str, Any]]
    elapsed_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)

    def role(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.results if r["kind"] == kind]

    def elapsed_of(self, kind: str) -> float:
        ends = [r["t_last"] for r in self.role(kind) if r["t_last"]]
        return (max(ends) - self.t_go) / 1e9 if ends else float("nan")

    def items_of(self, kind: str) -> int:
        return sum(r["items"] for r in self.role(kind))


class PhaseFailed(RuntimeError):
    pass


# --- child processes ---------------------------------------------------------------------


async def _produce(client: Any, spec: Producer, settings: Settings, t_go: int, deadline: float) -> dict[str, Any]:
    batches = math.ceil(spec.items / settings.batch)
    payloads = Payloads()
    state = {"next": 0, "items": 0, "t_last": 0}

    async def task() -> None:
        while time.monotonic() < deadline:
            b = state["next"]
            if b >= batches:
                return
            state["next"] = b + 1
            count = min(settings.batch, spec.items - b * settings.batch)
            stamp = None
            if spec.rate:  # open loop: batch b is due at t_go + b * batch / rate and stamped so
                stamp = t_go + int(b * settings.batch / spec.rate * 1e9)
                delay = (stamp - time.monotonic_ns()) / 1e9
                if delay > 0:
                    await asyncio.sleep(delay)
            await client.produce(spec.queues[b % len(spec.queues)], payloads.batch(count, stamp))
            state["items"] += count
            state["t_last"] = time.monotonic_ns()

    await asyncio.gather(*(task() for _ in range(spec.inflight)))
    return {"items": state["items"], "t_last": state["t_last"], "calls_in_flight": spec.inflight}


async def _consume(
    client: Any, spec: Consumer, settings: Settings, counters: dict[str, Any], targets: dict[str, int], tag: str, deadline: float
) -> dict[str, Any]:
    latencies = array("q")
    state = {"items": 0, "t_last": 0}

    async def loop(i: int, queue: str) -> None:
        client_id = f"{tag}-{i}"
        counter = counters[queue]
        while time.monotonic() < deadline and counter.value < targets[queue]:
            token, payloads = await client.lease(queue, client_id, settings.batch, settings.lease_wait_s)
            if not payloads:
                continue
            if spec.latency:
                received = time.monotonic_ns()
                latencies.extend(received - stamp_of(p) for p in payloads)
            await client.complete(queue, token)
            with counter.get_lock():
                counter.value += len(payloads)
            state["items"] += len(payloads)
            state["t_last"] = time.monotonic_ns()
        await client.finish(queue, client_id)

    await asyncio.gather(*(loop(i, q) for i, q in enumerate(spec.loops)))
    return {"items": state["items"], "t_last": state["t_last"], "latencies": latencies.tobytes(), "loops": len(spec.loops)}


def _child(client: Any, role: Producer | Consumer, index: int, settings: Settings, go: Any, out: Any, counters: dict[str, Any], targets: dict[str, int]) -> None:
    async def main() -> dict[str, Any]:
        await client.open()
        try:
            out.put(("ready", index, None))
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            t_go = int(go_time.value)
            deadline = time.monotonic() + settings.time_limit_s
            cpu_at_go = time.process_time()  # every thread of this process, from the start signal on
            if isinstance(role, Producer):
                result = await _produce(client, role, settings, t_go, deadline)
                result["kind"] = "produce"
            else:
                result = await _consume(client, role, settings, counters, targets, f"c{index}", deadline)
                result["kind"] = "consume"
            result["timed_out"] = time.monotonic() >= deadline
            result["cpu_s"] = time.process_time() - cpu_at_go
            report = getattr(client, "phase_report", None)
            if report is not None:  # what a routing client saw (cluster runs)
                result["client"] = report()
            return result
        finally:
            await client.close()

    go_time = counters["__go__"]
    try:
        result = asyncio.run(main())
        out.put(("done", index, result))
    except BaseException as exc:  # report, then let the parent stop everything
        out.put(("error", index, f"{type(exc).__name__}: {exc}"))


def run_phase(
    client: Any,
    roles: list[Producer | Consumer],
    settings: Settings,
    targets: dict[str, int] | None = None,
    *,
    on_go: Any = None,
    on_done: Any = None,
) -> Phase:
    """Start one process per role, start them together, wait for all; kill leftovers by PID.

    ``client``: one client for every process, or a list with one per role. ``on_go(counters)``
    runs right after the start signal (the shared completion counters: setting a queue's
    to its target stops its consumers), ``on_done()`` once every process has reported."""
    clients = client if isinstance(client, list) else [client] * len(roles)
    ctx = mp.get_context("spawn")
    targets = targets or {}
    counters: dict[str, Any] = {q: ctx.Value("q", 0) for q in targets}
    counters["__go__"] = ctx.Value("q", 0)
    go = ctx.Event()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(clients[i], role, i, settings, go, out, counters, targets), daemon=True)
        for i, role in enumerate(roles)
    ]
    try:
        for p in procs:
            p.start()
        ready = 0
        while ready < len(procs):
            kind, index, payload = _get(out, 120, procs)
            if kind == "error":
                raise PhaseFailed(f"process {index} failed while connecting: {payload}")
            ready += 1
        t_go = time.monotonic_ns()
        counters["__go__"].value = t_go
        go.set()
        if on_go is not None:
            on_go(counters)
        results: list[dict[str, Any]] = []
        while len(results) < len(procs):
            kind, index, payload = _get(out, settings.time_limit_s + 120, procs)
            if kind == "error":
                raise PhaseFailed(f"process {index} failed: {payload}")
            if kind == "done":
                if payload.get("timed_out"):
                    raise PhaseFailed(f"process {index} ({payload['kind']}) ran out of time ({settings.time_limit_s:.0f} s)")
                results.append(payload)
        if on_done is not None:
            on_done()
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    phase = Phase(t_go=t_go, results=results)
    lat = array("q")
    for r in phase.role("consume"):
        lat.frombytes(r.pop("latencies", b""))
    phase.latencies_ms = sorted(x / 1e6 for x in lat)
    return phase


def _get(out: Any, timeout: float, procs: list[Any]) -> tuple[str, int, Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return out.get(timeout=1.0)  # type: ignore[no-any-return]
        except queue_mod.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise PhaseFailed(f"a client process exited with {dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise PhaseFailed(f"no answer from the client processes in {timeout:.0f} s") from None


def _admin(client: Any, action: str, queues: list[str], partitions: int, out: Any) -> None:
    async def main() -> list[int]:
        counts = []
        await client.open()
        try:
            for q in queues:
                if action == "create":
                    await client.create_queue(q, partitions)
                elif action == "count":
                    counts.append(await client.count(q))
                else:
                    await client.drop_queue(q)
        finally:
            await client.close()
        return counts

    try:
        out.put((None, asyncio.run(main())))
    except BaseException as exc:
        out.put((f"{type(exc).__name__}: {exc}", None))


def admin(client: Any, action: str, queues: list[str], partitions: int = 1) -> list[int]:
    """Create, count or drop queues from a short-lived process (the orchestrator opens no client)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_admin, args=(client, action, queues, partitions, out), daemon=True)
    p.start()
    try:
        error, counts = out.get(timeout=300)
        if error:
            raise PhaseFailed(f"{action} {queues[0]}...: {error}")
        p.join(30)
        return counts  # type: ignore[no-any-return]
    finally:
        if p.is_alive():
            p.terminate()
            p.join(5)


# --- the workloads -----------------------------------------------------------------------


def expect_left(client: Any, queues: list[str], expected: list[int]) -> None:
    """Every item produced was stored once and every item drained is gone (no loss, no double)."""
    counts = admin(client, "count", queues)
    if counts != expected:
        raise PhaseFailed(f"items left in {queues}: {counts}, expected {expected}")


def w1(client: Any, s: Settings) -> dict[str, Any]:
    """100 k items into one queue (1 partition) by one process, then drained by one process."""
    q = "w1"
    admin(client, "create", [q], 1)
    produce = run_phase(client, [Producer([q], s.items, s.produce_inflight)], s)
    drain = run_phase(client, [Consumer([q] * s.consume_inflight)], s, targets={q: s.items})
    expect_left(client, [q], [0])
    admin(client, "drop", [q])
    p_s, d_s = produce.elapsed_of("produce"), drain.elapsed_of("consume")
    return {
        "produce": produce.items_of("produce") / p_s,
        "drain": drain.items_of("consume") / d_s,
        "wall_s": p_s + d_s,
        "produce_s": p_s,
        "drain_s": d_s,
    }


def _latency(phase: Phase) -> dict[str, float]:
    lat = phase.latencies_ms
    return {"p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99), "max_ms": lat[-1] if lat else float("nan")}


def w2(client: Any, s: Settings, half_items: int | None = None, *, half: bool = True) -> dict[str, Any]:
    """2 producers + 2 consumers at once on a 4-partition queue; then (``half``) the same at half the rate."""
    n = s.w2_items
    q = "w2"
    admin(client, "create", [q], 4)
    roles: list[Producer | Consumer] = [
        Producer([q], n // 2, s.produce_inflight),
        Producer([q], n - n // 2, s.produce_inflight),
        Consumer([q] * s.consume_inflight, latency=True),
        Consumer([q] * s.consume_inflight, latency=True),
    ]
    full = run_phase(client, roles, s, targets={q: n})
    expect_left(client, [q], [0])
    admin(client, "drop", [q])
    total = full.items_of("consume") / full.elapsed_of("consume")
    result: dict[str, Any] = {
        "total": total,
        "produce": full.items_of("produce") / full.elapsed_of("produce"),
        "wall_s": full.elapsed_of("consume"),
        "full": _latency(full),
    }
    if not half:
        return result
    # Half load: producers paced (open loop) to half the measured end-to-end maximum.
    half_n = half_items or n // 2
    rate = total / 2
    q = "w2-half"
    admin(client, "create", [q], 4)
    roles = [
        Producer([q], half_n // 2, s.produce_inflight, rate=rate / 2),
        Producer([q], half_n - half_n // 2, s.produce_inflight, rate=rate / 2),
        Consumer([q] * s.consume_inflight, latency=True),
        Consumer([q] * s.consume_inflight, latency=True),
    ]
    half = run_phase(client, roles, s, targets={q: half_n})
    expect_left(client, [q], [0])
    admin(client, "drop", [q])
    result["half"] = _latency(half)
    result["half"]["target_rate"] = rate
    result["half"]["achieved"] = half.items_of("consume") / half.elapsed_of("consume")
    result["half"]["items"] = half_n
    return result


def w3(client: Any, s: Settings, memory: Any) -> dict[str, Any]:
    """1 M items stored in one queue; then lease+complete of W1's count from its head."""
    q = "w3"
    admin(client, "create", [q], 1)
    fill = run_phase(client, [Producer([q], s.w3_stored, s.produce_inflight)], s)
    expect_left(client, [q], [s.w3_stored])
    mem_full = memory()
    drain = run_phase(client, [Consumer([q] * s.consume_inflight)], s, targets={q: s.items})
    mem_after = memory()
    expect_left(client, [q], [s.w3_stored - drain.items_of("consume")])
    admin(client, "drop", [q])
    # The same drain from a queue holding only what is drained, right away: a reference
    # taken within the same minute, less exposed to the machine's changing load than W1.
    q = "w3-shallow"
    admin(client, "create", [q], 1)
    run_phase(client, [Producer([q], s.items, s.produce_inflight)], s)
    shallow = run_phase(client, [Consumer([q] * s.consume_inflight)], s, targets={q: s.items})
    expect_left(client, [q], [0])
    admin(client, "drop", [q])
    return {
        "fill": fill.items_of("produce") / fill.elapsed_of("produce"),
        "drain": drain.items_of("consume") / drain.elapsed_of("consume"),
        "shallow_drain": shallow.items_of("consume") / shallow.elapsed_of("consume"),
        "drained": drain.items_of("consume"),
        "memory_mib": mem_full,
        "memory_after_drain_mib": mem_after,
    }


def w4(client: Any, s: Settings) -> dict[str, Any]:
    """W1 over several queues at once: one producer process, then one consumer process."""
    queues = [f"w4-{i}" for i in range(s.w4_queues)]
    admin(client, "create", queues, 1)
    per_queue = {q: 0 for q in queues}
    for b in range(math.ceil(s.w4_items / s.batch)):
        per_queue[queues[b % len(queues)]] += min(s.batch, s.w4_items - b * s.batch)
    inflight = s.w4_per_queue * len(queues)
    produce = run_phase(client, [Producer(queues, s.w4_items, inflight)], s)
    drain = run_phase(client, [Consumer(queues * s.w4_per_queue)], s, targets=per_queue)
    expect_left(client, queues, [0] * len(queues))
    admin(client, "drop", queues)
    return {
        "produce": produce.items_of("produce") / produce.elapsed_of("produce"),
        "drain": drain.items_of("consume") / drain.elapsed_of("consume"),
        "inflight": inflight,
    }
