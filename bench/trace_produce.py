"""Where one plain call's time goes: a timestamp at every step from send to reply.

    .venv/bin/python bench/trace_produce.py [--call produce|lease|complete] [--calls 2000]
                                            [--items 1] [--idle-queues 0] [--at-commit REV]

Starts a server process whose functions on the call's path are wrapped to take a
``time.perf_counter_ns()`` stamp (CLOCK_MONOTONIC: one clock for every process), then
sends ``--calls`` blocking calls from a generated stub in another process, one at a
time: Produce of ``--items`` items, or Lease of a batch of ``--items`` (from items
produced beforehand), or Complete of the ``--items`` ids of one such Lease; with
``--idle-queues N``, N more queues exist and share the traced queue's commit group
without being called. Prints, for each step, the median time since the previous step
and its share of the whole call. The wrappers add about a microsecond per stamp; the figures are for finding where the
time goes, not for the latency table (bench/run.py --only W5).

Steps, in order: the client sends; the handler starts (after gRPC read and parsed the
request); the request is in the queue's inbox; the actor's cycle starts; the cycle has
applied the request (Produce: the puts); the lane begins the commit; the fsync returns;
the loop takes the lane's result; the request's future is resolved; the handler returns
the reply; the client has it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from common import HOST, free_port, median, stop_pid, wait_for_port

STEPS = ["sent", "handler", "inbox", "cycle", "applied", "commit", "fsync", "delivered", "answered", "replied", "received"]


def _install(stamps: list[tuple[str, int]]) -> None:
    """Wrap the functions on the paths of Produce, Lease and Complete with stamps (in the server process)."""
    import functools

    from querator_server.actor import cycle, logical_queue
    from querator_server.grpc_api import queue_service
    from querator_server.storage import commit_group, lane, queue_store

    clock = time.perf_counter_ns

    def around(owner: Any, name: str, before: str | None, after: str | None) -> None:
        fn = getattr(owner, name)
        if asyncio_iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                if before:
                    stamps.append((before, clock()))
                try:
                    return await fn(*args, **kwargs)
                finally:
                    if after:
                        stamps.append((after, clock()))

            setattr(owner, name, wrapped_async)
            return

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if before:
                stamps.append((before, clock()))
            try:
                return fn(*args, **kwargs)
            finally:
                if after:
                    stamps.append((after, clock()))

        setattr(owner, name, wrapped)

    for call in ("produce", "lease", "complete"):
        around(queue_service.QueueService, call, "handler", "replied")
        around(cycle.Cycle, call, None, "applied")
    acks = getattr(logical_queue, "_ACK", {})  # the actor calls acks through this table
    for request_type in list(acks):
        if request_type.__name__ == "CompleteRequest":
            acks[request_type] = cycle.Cycle.complete
    around(logical_queue.LogicalQueue, "submit", "inbox", None)
    around(logical_queue.LogicalQueue, "_cycle", "cycle", None)
    around(commit_group.CommitGroup, "_commit", "commit", "fsync")
    around(queue_store.QueueStore, "_commit", "commit", "fsync")
    around(lane._Mailbox, "_deliver", "delivered", None)
    around(logical_queue, "_answer", "answered", None)


def asyncio_iscoroutinefunction(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def _server(port: int, data_dir: str, out_path: str, source_dir: str | None) -> None:
    if source_dir:
        sys.path[:0] = [os.path.join(source_dir, "server", "src"), os.path.join(source_dir, "clients", "python", "src")]
    from querator_server.cli import main as serve_main

    stamps: list[tuple[str, int]] = []
    _install(stamps)

    def dump(*_: Any) -> None:
        with open(out_path, "w") as f:
            f.writelines(f"{step} {t}\n" for step, t in stamps)

    signal.signal(signal.SIGUSR1, dump)
    serve_main(["--address", f"{HOST}:{port}", "--data-dir", data_dir, "--log-level", "warning"])


def _client(address: str, call: str, calls: int, items: int, idle_queues: int, out: Any) -> None:
    from plain_stub import PlainQueratorClient

    client = PlainQueratorClient(address)
    client.open_sync()
    import asyncio

    asyncio.run(client.create_queue("trace", 1))
    for n in range(idle_queues):  # members of the same commit group that stay quiet
        asyncio.run(client.create_queue(f"idle-{n}", 1))
    payload = os.urandom(256)
    batch = [payload] * items
    # Warm-up (its stamps are dropped), and what the timed calls need: items to lease,
    # leases to complete.
    for _ in range(200):
        client.produce_sync("trace", batch)
    for _ in range(100):
        client.complete_sync("trace", client.lease_sync("trace", "trace", items, 0.01)[0])
    tokens: list[object] = []
    if call != "produce":
        for _ in range(calls):
            client.produce_sync("trace", batch)
    if call == "complete":
        tokens = [client.lease_sync("trace", "trace", items, 0.01)[0] for _ in range(calls)]
    one = {
        "produce": lambda: client.produce_sync("trace", batch),
        "lease": lambda: client.lease_sync("trace", "trace", items, 0.01),
        "complete": lambda: client.complete_sync("trace", tokens.pop()),
    }[call]
    out.put("warm")
    assert out_ack.get() == "go"
    times: list[tuple[int, int]] = []
    for _ in range(calls):
        t = time.perf_counter_ns()
        one()
        times.append((t, time.perf_counter_ns()))
    out.put(times)


out_ack: Any = None


def _client_main(address: str, call: str, calls: int, items: int, idle_queues: int, out: Any, ack: Any) -> None:
    global out_ack
    out_ack = ack
    _client(address, call, calls, items, idle_queues, out)


def breakdown(stamps: list[tuple[str, int]], client_times: list[tuple[int, int]]) -> list[tuple[str, float, float]]:
    """(step, median µs since the previous step, share of the median call) per step."""
    # Calls are one at a time: the server's stamps between one call's send and its
    # reply belong to it. Each step is the first stamp of its name after the step
    # before, so a stamp of the same name from elsewhere (another request answered in
    # the same window) cannot put the steps out of order.
    gaps: dict[str, list[float]] = {s: [] for s in STEPS[1:]}
    totals: list[float] = []
    i = 0
    for sent, received in client_times:
        while i < len(stamps) and stamps[i][1] < sent:
            i += 1
        window: list[tuple[str, int]] = []
        while i < len(stamps) and stamps[i][1] <= received:
            window.append(stamps[i])
            i += 1
        seq = [("sent", sent)]
        at = 0
        for step in STEPS[1:-1]:
            while at < len(window) and window[at][0] != step:
                at += 1
            if at == len(window):
                break
            seq.append(window[at])
            at += 1
        seq.append(("received", received))
        if len(seq) != len(STEPS):
            continue  # a step missing (e.g. a cycle that held two calls): not this call's own path
        for (_, a), (step, b) in zip(seq, seq[1:]):
            gaps[step].append((b - a) / 1000)
        totals.append((received - sent) / 1000)
    whole = median(totals) if totals else float("nan")
    return [(step, median(v) if v else float("nan"), (median(v) / whole) if v else float("nan")) for step, v in gaps.items()] + [
        ("whole call", whole, 1.0 if totals else float("nan"))
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--call", choices=("produce", "lease", "complete"), default="produce")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--items", type=int, default=None, help="items per call (default: 1 for produce, else 100)")
    p.add_argument("--idle-queues", type=int, default=0, help="queues created beside the traced one (its commit group's other members), never called")
    p.add_argument("--at-commit", metavar="REV")
    args = p.parse_args(argv)
    if args.items is None:
        args.items = 1 if args.call == "produce" else 100
    workdir = tempfile.mkdtemp(prefix="querator-trace-")
    source_dir = None
    if args.at_commit:
        from querator_target import export_commit

        source_dir = os.path.join(workdir, "source")
        export_commit(args.at_commit, os.path.dirname(os.path.dirname(os.path.abspath(__file__))), source_dir)
    ctx = mp.get_context("spawn")
    port = free_port()
    stamps_path = os.path.join(workdir, "stamps")
    server = ctx.Process(target=_server, args=(port, os.path.join(workdir, "data"), stamps_path, source_dir), daemon=True)
    server.start()
    try:
        wait_for_port(port, 60)
        out, ack = ctx.Queue(), ctx.Queue()
        client = ctx.Process(target=_client_main, args=(f"{HOST}:{port}", args.call, args.calls, args.items, args.idle_queues, out, ack), daemon=True)
        client.start()
        assert out.get(timeout=args.calls * 0.1 + 120) == "warm"
        os.kill(server.pid, signal.SIGUSR1)  # drop the warm-up's stamps from what counts
        time.sleep(0.5)
        with open(stamps_path) as f:
            skip = sum(1 for _ in f)
        ack.put("go")
        client_times = out.get(timeout=args.calls * 0.1 + 120)
        client.join(30)
        os.kill(server.pid, signal.SIGUSR1)
        time.sleep(0.5)
        with open(stamps_path) as f:
            lines = f.read().splitlines()[skip:]
        stamps = [(step, int(t)) for step, t in (line.split() for line in lines)]
    finally:
        if server.pid:
            stop_pid(server.pid, 5)
        shutil.rmtree(workdir, ignore_errors=True)
    rows = breakdown(stamps, client_times)
    print(f"{args.call.capitalize()}({args.items}) through a blocking stub, {len(client_times)} calls, one in flight; median µs per step:")
    print()
    print("| step (time since the previous one) | µs | share |")
    print("|---|---:|---:|")
    for step, us, share in rows:
        print(f"| {step} | {us:,.0f} | {share:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
