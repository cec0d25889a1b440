"""W1 through the client SDKs: the Python SDK (AsyncClient) and the TypeScript client.

A durable server in its own process (as ``run.py`` starts it). For each client in turn,
in the same run: one process produces W1's items (256 random bytes, batches of 100,
8 requests in flight) into a fresh one-partition queue, then one process drains them
with 8 Lease (batch 100) + Complete loops. Each figure is the median of ``--repeat``
rounds; rounds alternate the clients so both see the same machine.

    .venv/bin/python bench/sdk_clients.py [--items 100000] [--repeat 3]

The TypeScript side (``bench/ts_client.mjs``) imports the built package
(``clients/typescript/dist``): ``./dev test clients/typescript`` builds it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import querator  # noqa: E402
from common import median, process_cpu_s  # noqa: E402
from querator_target import QueratorService  # noqa: E402

ROOT = os.path.dirname(HERE)
TS_BUILD = os.path.join(ROOT, "clients", "typescript", "dist", "src", "index.js")


# -- the Python SDK's side: this script run with --role ------------------------------------


async def python_role(role: str, address: str, queue: str, items: int, batch: int, inflight: int) -> dict[str, float]:
    async with querator.AsyncClient(address) as client:
        await client.get_queue(queue)  # connected before the clock starts
        done = 0
        if role == "produce":
            pool = os.urandom(256 * 4096)
            payloads = [pool[(i % 4096) * 256 : (i % 4096 + 1) * 256] for i in range(items)]
            cpu0, t0 = time.process_time(), time.perf_counter()
            result = await client.produce(queue, payloads, batch_size=batch, max_in_flight=inflight)
            done = len(result.ids)
        else:
            cpu0, t0 = time.process_time(), time.perf_counter()

            async def loop(n: int) -> None:
                nonlocal done
                while done < items:
                    leased = await client.lease(queue, batch_size=batch, wait=0.5, client_id=f"py-drain-{n}")
                    if leased:
                        await client.complete(leased)
                        done += len(leased)

            await asyncio.gather(*(loop(n) for n in range(inflight)))
        return {"items": done, "seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}


# -- the driver ----------------------------------------------------------------------------


def run_role(client: str, role: str, address: str, queue: str, args: argparse.Namespace, limit: float) -> dict[str, float]:
    common = [address, queue, str(args.items), str(args.batch), str(args.inflight)]
    if client == "python":
        argv = [sys.executable, os.path.abspath(__file__), "--role", role, *common]
    else:
        argv = ["node", os.path.join(HERE, "ts_client.mjs"), role, *common]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=limit)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    if result["items"] != args.items:
        raise RuntimeError(f"{client} {role}: {result['items']} items, expected {args.items}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--inflight", type=int, default=8, help="produce requests in flight; drain loops")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per phase before giving up")
    parser.add_argument("--role", choices=("produce", "drain"), help=argparse.SUPPRESS)
    parser.add_argument("target", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        address, queue = args.target[0], args.target[1]
        items, batch, inflight = (int(v) for v in args.target[2:5])
        print(json.dumps(asyncio.run(python_role(args.role, address, queue, items, batch, inflight))))
        return
    if not os.path.exists(TS_BUILD):
        sys.exit("the TypeScript client is not built: run ./dev test clients/typescript (or npx tsc in clients/typescript)")

    figures: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="querator-bench-") as workdir:
        service = QueratorService(workdir)
        address = service.start().address
        try:
            with querator.Client(address) as admin:
                for round_ in range(args.repeat):
                    order = ("python", "typescript") if round_ % 2 == 0 else ("typescript", "python")
                    for client in order:
                        queue = f"sdk-{client}-{round_}"
                        admin.create_queue(queue, lease_timeout=300)
                        for role in ("produce", "drain"):
                            server_cpu = process_cpu_s(service.pid)
                            r = run_role(client, role, address, queue, args, args.time_limit)
                            server_used = process_cpu_s(service.pid) - server_cpu
                            figures.setdefault((client, role), []).append(r["items"] / r["seconds"])
                            cpu.setdefault((client, role), []).append(r["cpu_s"])
                            cpu.setdefault((client, role + "/server"), []).append(server_used)
                            print(f"round {round_ + 1} {client:>10} {role:>7}: {r['items'] / r['seconds']:>9,.0f} items/s", flush=True)
                        left = admin.queue_stats(queue)
                        if left.total or left.scheduled:
                            raise RuntimeError(f"{queue}: {left.total} items left after the drain")
                        admin.delete_queue(queue)
        finally:
            service.stop()

    per = 1e6 / args.items
    print()
    print(f"W1 through the SDKs: {args.items:,} items of 256 B, batches of {args.batch}, "
          f"{args.inflight} in flight, median of {args.repeat}")
    print()
    print("| client | phase | items/s | client CPU µs/item | server CPU µs/item |")
    print("|---|---|---:|---:|---:|")
    for client in ("python", "typescript"):
        for role in ("produce", "drain"):
            print(f"| {client} | {role} | {median(figures[(client, role)]):,.0f} | "
                  f"{median(cpu[(client, role)]) * per:.1f} | {median(cpu[(client, role + '/server')]) * per:.1f} |")
    for role in ("produce", "drain"):
        ratio = median(figures[("python", role)]) / median(figures[("typescript", role)])
        print(f"\n{role}: Python SDK ÷ TypeScript client = {ratio:.2f}")


if __name__ == "__main__":
    main()
