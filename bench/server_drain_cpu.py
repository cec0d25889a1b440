"""W1's and W4's drain through gRPC against a server process, measured by the server's
CPU, not by wall time: CPU µs per drained item of the whole server process and of its
event loop's thread (``/proc``), and with ``--profile`` the loop's own time by function
(cProfile on the loop thread's CPU clock), so that where a drained item's time goes can
be compared between one queue and ten on a shared, loaded machine, and between this
work tree's server and another commit's (``--at-commit``).

    .venv/bin/python bench/server_drain_cpu.py                       # W1 then W4, the work tree's server
    .venv/bin/python bench/server_drain_cpu.py --at-commit main      # another commit's server
    .venv/bin/python bench/server_drain_cpu.py --profile /tmp/p      # cProfile stats to /tmp/p.w1, /tmp/p.w4

The client is ``bench/run.py``'s (``--streams --complete-in-lease``: a LeaseStream per
queue, each batch completed by the loop's next Lease), in a process of its own: W1 is
one queue drained by 8 loops, W4 ten queues drained by one loop each. Items are produced
first (not measured): 100,000 of 256 bytes over all queues.
"""

from __future__ import annotations

import argparse
import asyncio
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


def measure(shapes: list[str], source: str | None, workdir: str, items: int, profile: str) -> list[str]:
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
    server = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
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
                server.send_signal(signal.SIGUSR1)
                time.sleep(0.2)
            cpu0, loop0 = _cpu(server.pid), _cpu(server.pid, server.pid)
            go.put(None)
            elapsed = out.get(timeout=600)
            cpu1, loop1 = _cpu(server.pid), _cpu(server.pid, server.pid)
            if profile:
                server.send_signal(signal.SIGUSR2)
                time.sleep(1.0)
            queues = SHAPES[shape][0]
            drained = items // len(queues) * len(queues)
            lines.append(
                f"{shape}: server {(cpu1 - cpu0) / drained * 1e6:.2f} µs CPU/item, its loop thread "
                f"{(loop1 - loop0) / drained * 1e6:.2f}; {drained / elapsed:,.0f} items/s"
            )
        proc.join(120)
    finally:
        if proc.is_alive():
            proc.kill()
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at-commit", metavar="REV", help="run this commit's server (git archive)")
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--shape", default="w1,w4", help="w1, w4, or both in turn (default)")
    parser.add_argument("--rounds", type=int, default=1, help="the shapes in turn this many times, one server")
    parser.add_argument("--profile", default="", metavar="PATH", help="cProfile stats of the loop thread to PATH.<shape>.<index>")
    args = parser.parse_args()
    root = os.path.dirname(HERE)
    with tempfile.TemporaryDirectory() as workdir:
        source = None
        if args.at_commit:
            source = os.path.join(workdir, "src")
            export_commit(args.at_commit, root, source)
        os.environ["DRAIN_WORKDIR"] = workdir
        for line in measure(args.shape.split(",") * args.rounds, source, workdir, args.items, args.profile):
            print(line, flush=True)


if __name__ == "__main__":
    main()
