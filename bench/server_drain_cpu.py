"""W1's and W4's drain through gRPC against a server process, measured by the server's
CPU, not by wall time: CPU µs per drained item of the whole server process and of its
event loop's thread (``/proc``), and with ``--profile`` the loop's own time by function
(cProfile on the loop thread's CPU clock), so that where a drained item's time goes can
be compared between one queue and ten on a shared, loaded machine, and between this
work tree's server and another commit's (``--at-commit``).

    .venv/bin/python bench/server_drain_cpu.py                       # W1 then W4, the work tree's server
    .venv/bin/python bench/server_drain_cpu.py --at-commit main      # another commit's server
    .venv/bin/python bench/server_drain_cpu.py --profile /tmp/p      # cProfile stats to /tmp/p.w1, /tmp/p.w4
    .venv/bin/python bench/server_drain_cpu.py --py-spy py-spy       # sampled: the loop's busy samples by layer

With ``--py-spy`` the server runs under py-spy (sampling, so Python-heavy layers are not
inflated as under cProfile; the binary is not a dependency of the project: give its
path), and each drain's busy samples of the loop thread are counted by the layer of
their innermost Python frame (C calls are charged to their Python caller), as shares
and as µs per drained item (samples ÷ rate).

The client is ``bench/run.py``'s (``--streams --complete-in-lease``: a LeaseStream per
queue, each batch completed by the loop's next Lease), in a process of its own: W1 is
one queue drained by 8 loops, W4 ten queues drained by one loop each. Items are produced
first (not measured): 100,000 of 256 bytes over all queues. Each drain also reports the
commits it took (every LMDB environment's last transaction id, before and after) and
the Leases per commit.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import HOST, free_port, wait_for_port  # noqa: E402
from querator_target import QueratorClient, export_commit  # noqa: E402

# Run as the server: cProfile of the loop thread between SIGUSR1 and SIGUSR2.
_SERVE = """
import cProfile, os, signal, sys, time
profile_to = os.environ.get("DRAIN_PROFILE", "")
state = {}
def start(*_):
    state["p"] = cProfile.Profile(time.thread_time)
    state["p"].enable()
def stop(*_):
    p = state.pop("p", None)
    if p is not None:
        p.disable()
        p.dump_stats(open(os.path.join(os.environ["DRAIN_WORKDIR"], "profile_to")).read())
if profile_to:
    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
from querator_server.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _cpu(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of process ``pid``, or of its thread ``tid``."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


SHAPES = {"w1": (["d"], 8), "w4": ([f"d{i}" for i in range(10)], 1)}


def _client(address: str, shapes: list[str], items: int, go: Any, out: Any) -> None:
    async def main() -> None:
        client = QueratorClient(address, complete_in_lease=True, streams=True)
        await client.open()
        payloads = [os.urandom(256) for _ in range(100)]
        for index, shape in enumerate(shapes):
            queues, loops = SHAPES[shape]
            queues = [f"{q}-{index}" for q in queues]
            for q in queues:
                await client.create_queue(q, 1)
            per_queue = items // len(queues)
            for q in queues:
                await asyncio.gather(*(client.produce(q, payloads) for _ in range(per_queue // 100)))
            out.put("produced")
            await asyncio.get_running_loop().run_in_executor(None, go.get)
            counts = dict.fromkeys(queues, 0)
            t0 = time.monotonic()

            async def loop(q: str, client_id: str, counts: dict[str, int] = counts, per_queue: int = per_queue) -> None:
                while counts[q] < per_queue:
                    token, got = await client.lease(q, client_id, 100, 0.5)
                    counts[q] += len(got)
                    await client.complete(q, token)
                await client.finish(q, client_id)

            await asyncio.gather(*(loop(q, f"{q}-{i}") for q in queues for i in range(loops)))
            out.put(time.monotonic() - t0)
            for q in queues:
                left = await client.count(q)
                if left:
                    raise RuntimeError(f"{q} still holds {left} items")
                await client.drop_queue(q)
        await client.close()

    asyncio.run(main())


SPY_RATE = 500  # samples per second

# The layer of a sample: the first of these found in its innermost frame's file name.
LAYERS = (
    ("storage/", "storage: queue_store, record, commit group, LMDB calls"),
    ("actor/cycle", "cycle bodies (cycle*.py, batch.py)"),
    ("actor/batch", "cycle bodies (cycle*.py, batch.py)"),
    ("actor/", "actor loop, transaction, leases, health"),
    ("grpc_api/", "grpc_api: stream, handler, reply"),
    ("_cython", "gRPC core callbacks (Cython)"),
    ("grpc/", "gRPC aio (Python)"),
    ("asyncio/", "asyncio: turns, tasks, futures, handles"),
)


def _samples(path: str) -> list[tuple[int, int, tuple[str, ...]]]:
    """(ts µs, thread, stack of "function file", outermost first) per sample of a
    py-spy chrometrace file (its begin/end events rebuilt into stacks)."""
    with open(path) as f:
        events = json.load(f)
    stacks: dict[int, list[str]] = collections.defaultdict(list)
    out: list[tuple[int, int, tuple[str, ...]]] = []
    last: dict[int, int] = {}
    for event in events:
        tid, ts = event["tid"], event["ts"]
        if tid in last and last[tid] != ts and stacks[tid]:
            out.append((last[tid], tid, tuple(stacks[tid])))
        last[tid] = ts
        if event["ph"] == "B":
            stacks[tid].append(f"{event['name']} {event['args'].get('filename', '')}")
        elif stacks[tid]:
            stacks[tid].pop()
    for tid, ts in last.items():
        if stacks[tid]:
            out.append((ts, tid, tuple(stacks[tid])))
    return out


def spy_table(path: str, windows: list[tuple[str, float, float, int]], inclusive_top: int = 0) -> list[str]:
    """The loop thread's busy samples in each drain window, by layer."""
    samples = _samples(path)
    loop_tids = collections.Counter(tid for _, tid, stack in samples if any("run_forever" in f for f in stack))
    loop_tid = loop_tids.most_common(1)[0][0] if loop_tids else None
    lines = []
    for shape, start, end, drained in windows:
        layers: collections.Counter[str] = collections.Counter()
        functions: collections.Counter[str] = collections.Counter()
        # Samples with the function anywhere on the stack (once each): what a call costs
        # with everything under it.
        inclusive: collections.Counter[str] = collections.Counter()
        for ts, tid, stack in samples:
            if tid != loop_tid or not start <= ts / 1e6 <= end:
                continue
            leaf = stack[-1]
            layers[next((name for key, name in LAYERS if key in leaf), "other")] += 1
            name, _, file = leaf.partition(" ")
            functions[f"{name} ({file.rsplit('/', 1)[-1]})"] += 1
            inclusive.update({f"{n} ({f.rsplit('/', 1)[-1]})" for n, _, f in (frame.partition(" ") for frame in stack)})
        total = sum(layers.values()) or 1
        lines.append(f"{shape}: {total} busy samples of the loop thread, {total / SPY_RATE / drained * 1e6:.2f} µs/item")
        for name, n in layers.most_common():
            lines.append(f"  {n / total:6.1%}  {n / SPY_RATE / drained * 1e6:6.2f} µs/item  {name}")
        for name, n in functions.most_common(30):
            lines.append(f"      {n / total:6.1%}  {name}")
        if inclusive_top:
            lines.append(f"  with what they call (the first {inclusive_top}):")
            for name, n in inclusive.most_common(inclusive_top):
                lines.append(f"      {n / total:6.1%}  {name}")
    return lines


def _commits(data: str) -> int:
    """Write transactions committed so far in every LMDB environment under ``data``
    (the last transaction id of each, read from its meta pages beside the server)."""
    import lmdb

    total = 0
    for root, _dirs, files in os.walk(data):
        if "data.mdb" in files:
            env = lmdb.open(root, readonly=True, lock=False, max_dbs=0)
            try:
                total += env.info()["last_txnid"]
            finally:
                env.close()
    return total


def _child(pid: int) -> int:
    """The process py-spy started (the server)."""
    for _ in range(100):
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = f.read().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise RuntimeError("py-spy started no server")


def measure(
    shapes: list[str], source: str | None, workdir: str, items: int, profile: str, py_spy: str = "", inclusive: int = 0
) -> list[str]:
    """Each of ``shapes`` drained in turn against one server process."""
    env = dict(os.environ)
    if source:
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(source, "server", "src"), os.path.join(source, "clients", "python", "src")]
        )
    port = free_port()
    data = tempfile.mkdtemp(dir=workdir)
    argv = [sys.executable, "-c", _SERVE, "--address", f"{HOST}:{port}", "--data-dir", data, "--log-level", "warning"]
    lines = []
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Queue(), ctx.Queue()
    if profile:
        env.update(DRAIN_PROFILE="1")
    trace = os.path.join(workdir, "spy.json")
    if py_spy:
        argv = [py_spy, "record", "-r", str(SPY_RATE), "-f", "chrometrace", "-t", "-o", trace, "--nonblocking", "--", *argv]
    launched = time.monotonic()
    server = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL if py_spy else None)
    pid = _child(server.pid) if py_spy else server.pid
    windows: list[tuple[str, float, float, int]] = []
    proc = ctx.Process(target=_client, args=(f"{HOST}:{port}", shapes, items, go, out))
    try:
        wait_for_port(port, 60, server)
        proc.start()
        for index, shape in enumerate(shapes):
            assert out.get(timeout=600) == "produced"
            time.sleep(0.3)
            if profile:
                with open(os.path.join(workdir, "profile_to"), "w") as f:
                    f.write(f"{profile}.{shape}.{index}")
                os.kill(pid, signal.SIGUSR1)
                time.sleep(0.2)
            cpu0, loop0, commits0 = _cpu(pid), _cpu(pid, pid), _commits(data)
            began = time.monotonic() - launched
            go.put(None)
            elapsed = out.get(timeout=600)
            cpu1, loop1, commits = _cpu(pid), _cpu(pid, pid), _commits(data) - commits0
            if profile:
                os.kill(pid, signal.SIGUSR2)
                time.sleep(1.0)
            queues = SHAPES[shape][0]
            drained = items // len(queues) * len(queues)
            windows.append((f"{shape}.{index}", began, began + elapsed, drained))
            lines.append(
                f"{shape}: server {(cpu1 - cpu0) / drained * 1e6:.2f} µs CPU/item, its loop thread "
                f"{(loop1 - loop0) / drained * 1e6:.2f}; {drained / elapsed:,.0f} items/s; "
                f"{commits} commits, {drained / 100 / max(commits, 1):.2f} Leases per commit"
            )
        proc.join(120)
    finally:
        if proc.is_alive():
            proc.kill()
        if py_spy:
            os.kill(pid, signal.SIGTERM)  # py-spy writes its file once the server has ended
        else:
            server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    if py_spy:
        lines += spy_table(trace, windows, inclusive)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at-commit", metavar="REV", help="run this commit's server (git archive)")
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--shape", default="w1,w4", help="w1, w4, or both in turn (default)")
    parser.add_argument("--rounds", type=int, default=1, help="the shapes in turn this many times, one server")
    parser.add_argument("--profile", default="", metavar="PATH", help="cProfile stats of the loop thread to PATH.<shape>.<index>")
    parser.add_argument("--py-spy", default="", metavar="BINARY", help="sample the server with this py-spy binary")
    parser.add_argument(
        "--inclusive", type=int, default=0, metavar="N", help="with --py-spy: also the N functions most often on the stack"
    )
    args = parser.parse_args()
    root = os.path.dirname(HERE)
    with tempfile.TemporaryDirectory() as workdir:
        source = None
        if args.at_commit:
            source = os.path.join(workdir, "src")
            export_commit(args.at_commit, root, source)
        os.environ["DRAIN_WORKDIR"] = workdir
        for line in measure(
            args.shape.split(",") * args.rounds, source, workdir, args.items, args.profile, args.py_spy, args.inclusive
        ):
            print(line, flush=True)


if __name__ == "__main__":
    main()
