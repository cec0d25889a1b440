"""Throughput and latency of Querator next to Redis Streams and PostgreSQL, in one run.

    .venv/bin/python bench/run.py [--quick] [--only W1,W2,W3,W4] [--peers redis,postgres|none]

Starts a durable Querator server, a durable redis-server and a PostgreSQL cluster, all
private, on free 127.0.0.1 ports in a temp dir, runs the workloads against each with
the same client processes (workloads.py), measures the machine's ceilings (ceilings.py),
prints the tables and a markdown section for bench/RESULTS.md, and stops everything it
started. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

import common
import workloads
from workloads import Settings

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
WORKLOADS = ("W1", "W2", "W3", "W4", "W5")
PEERS = ("redis", "postgres")
OURS = "Querator"
# The plain-stub latency targets (p50, ms) of the performance issue for one call in flight.
LATENCY_TARGETS_MS = {"Produce, 1 item of 256 B": 1.2, "Produce, 100 items": 1.8, "Lease, batch 100": 1.8, "Complete, 100 ids": 1.4}


def ensure_requirements() -> None:
    missing = [m for m in ("redis", "hiredis", "psycopg") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"bench: installing {', '.join(missing)} into {sys.prefix} (bench/requirements.txt)", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r", os.path.join(BENCH_DIR, "requirements.txt")],
            check=True,
        )
        importlib.invalidate_caches()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = Settings()
    p = argparse.ArgumentParser(description="Querator throughput and latency next to Redis Streams and PostgreSQL.")
    p.add_argument("--quick", action="store_true", help="1/10 of every item count: a smoke check of the harness")
    p.add_argument("--only", default=",".join(WORKLOADS), help="workloads to run, e.g. W1,W2 (default: all)")
    p.add_argument("--peers", default=",".join(PEERS), help="peers to run: redis,postgres or none (default: both)")
    p.add_argument("--no-ceilings", action="store_true", help="skip the gRPC echo and LMDB commit ceilings")
    p.add_argument("--produce-inflight", type=int, default=d.produce_inflight, help=f"concurrent Produce calls per producer process (default {d.produce_inflight})")
    p.add_argument("--consume-inflight", type=int, default=d.consume_inflight, help=f"concurrent Lease+Complete loops per consumer process (default {d.consume_inflight})")
    p.add_argument("--w4-per-queue", type=int, default=d.w4_per_queue, help=f"W4: calls in flight per queue (default {d.w4_per_queue})")
    p.add_argument("--items", type=int, default=d.items, help=f"W1 items, also W3's drained count (default {d.items:,})")
    p.add_argument("--w2-items", type=int, default=d.w2_items, help=f"W2 items at full load; half load uses half as many (default {d.w2_items:,})")
    p.add_argument("--w3-stored", type=int, default=d.w3_stored, help=f"W3 items stored (default {d.w3_stored:,})")
    p.add_argument("--w4-items", type=int, default=d.w4_items, help=f"W4 items over all queues (default {d.w4_items:,})")
    p.add_argument("--w4-queues", type=int, default=d.w4_queues, help=f"W4 queues (default {d.w4_queues})")
    p.add_argument("--repeat", type=int, default=3, help="runs of W1 and W4 per system, medians reported (default 3)")
    p.add_argument("--complete-in-lease", action="store_true", help="ours: complete each batch with the next Lease (complete_ids) instead of a Complete call")
    p.add_argument("--item-produce", action="store_true", help="ours: one ProduceItem per item instead of the compact form (ProduceRequest.payloads), which the SDK sends for bare payloads")
    p.add_argument("--streams", action="store_true", help="ours: Produce and Lease over a ProduceStream / LeaseStream per queue in each client process (as the SDK does) instead of unary calls")
    p.add_argument("--at-commit", metavar="REV", help="run the server from this commit's sources (git archive into the temp dir) instead of the work tree")
    p.add_argument("--nodes", type=int, default=0, help="run W1, W2 and W4 against an etcd and this many `querator serve --cluster` nodes beside one server and beside this many independent servers doing the same work (and the forwarding and node-kill figures); needs the etcd binary")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="with --nodes: cores to plan client processes for, max(nodes, cores / 2) per role (default: this machine's)")
    p.add_argument("--no-forwarding", action="store_true", help="with --nodes: skip the forwarding-hop figures")
    p.add_argument("--no-kill", action="store_true", help="with --nodes: skip the node killed during W2")
    p.add_argument("--replicas", metavar="R,R,...", help="with --nodes: replicated queues instead: W1, W2 and Produce/Lease latency on the cluster alone, once per R in each round (e.g. 1,2,3; replication_bench.py); --only W1,W2,latency picks them (latency runs with W1 unless --only names it alone)")
    p.add_argument("--node-nice", type=int, default=0, help="with --replicas: run etcd, the nodes and the latency client at this nice value (e.g. -15, as root: ahead of other work on a shared machine, roughly what a core of their own would give)")
    p.add_argument("--sdk", action="store_true", help="with --nodes: W1, W2 and W4's client processes use the Python SDK (AsyncClient given every node's address, routing itself) instead of raw routing stubs, on every side; the forwarding and node-kill figures keep the raw stubs")
    p.add_argument("--time-limit", type=float, default=d.time_limit_s, help=f"seconds per phase before it is stopped as failed (default {d.time_limit_s:.0f})")
    args = p.parse_args(argv)
    args.only = [w.strip().upper() for w in args.only.split(",") if w.strip()]
    bad = [w for w in args.only if w not in WORKLOADS and not (w == "LATENCY" and args.replicas is not None)]
    if bad:
        p.error(f"unknown workload {bad[0]!r}; choose from {', '.join(WORKLOADS)} (with --replicas also latency)")
    if args.nodes < 0 or args.cores < 1:
        p.error("--nodes must be >= 1 and --cores >= 1")
    if args.replicas is not None:
        if not args.nodes:
            p.error("--replicas applies to the cluster benchmark: give --nodes N")
        try:
            args.replicas = [int(r) for r in args.replicas.split(",") if r.strip()]
        except ValueError:
            p.error(f"--replicas: a comma-separated list of copy counts, not {args.replicas!r}")
        if not args.replicas or 1 not in args.replicas or any(r < 1 or r > args.nodes for r in args.replicas):
            p.error(f"--replicas: counts between 1 and --nodes ({args.nodes}), 1 among them (the ratios are to R = 1)")
    if args.sdk and not args.nodes:
        p.error("--sdk applies to the cluster benchmark: give --nodes N")
    args.peers = [] if args.peers.strip().lower() == "none" else [x.strip().lower() for x in args.peers.split(",") if x.strip()]
    bad = [x for x in args.peers if x not in PEERS]
    if bad:
        p.error(f"unknown peer {bad[0]!r}; choose from {', '.join(PEERS)} or none")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    scale = 10 if args.quick else 1
    return Settings(
        items=args.items // scale,
        w2_items=args.w2_items // scale,
        w3_stored=args.w3_stored // scale,
        w4_items=args.w4_items // scale,
        w4_queues=args.w4_queues,
        produce_inflight=args.produce_inflight,
        consume_inflight=args.consume_inflight,
        w4_per_queue=args.w4_per_queue,
        time_limit_s=args.time_limit,
    )


def services(args: argparse.Namespace, workdir: str, source_dir: str | None) -> list[Any]:
    from querator_target import QueratorService

    out: list[Any] = [QueratorService(workdir, source_dir)]
    if "redis" in args.peers:
        from peers.redis_peer import RedisService

        out.append(RedisService(workdir))
    if "postgres" in args.peers:
        from peers.postgres_peer import PostgresService

        out.append(PostgresService(workdir))
    return out


def run_workload(name: str, client: Any, service: Any, s: Settings, repeat: int) -> dict[str, Any]:
    """W2 and W3 run once; W1 and W4 (a few seconds each) `repeat` times, reporting medians."""
    if name == "W2":
        return workloads.w2(client, s)
    if name == "W3":
        return workloads.w3(client, s, service.memory_mib)
    if name == "W5":
        import plain_stub

        return plain_stub.w5(client, service.workdir, s, repeat, with_latency=service.name == OURS)
    fn = workloads.w1 if name == "W1" else workloads.w4
    runs = [fn(client, s) for _ in range(repeat)]
    merged = {k: common.median([r[k] for r in runs]) if isinstance(v, float) else v for k, v in runs[0].items()}
    merged["runs"] = runs
    return merged


# --- reporting ---------------------------------------------------------------------------


def _n(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.0f}"


def _ms(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:,.1f}"


def _ratio(ours: float | None, other: float | None) -> str:
    if not ours or not other or math.isnan(ours) or math.isnan(other):
        return "n/a"
    return f"{ours / other:.2f}x"


def throughput_rows(results: dict[str, dict[str, Any]], s: Settings) -> list[tuple[str, str, float | None]]:
    """(workload label, key path) for every items/s figure."""
    figures = [
        ("W1", "produce", f"W1 produce ({s.items:,} items, 1 partition, 1 process)"),
        ("W1", "drain", "W1 drain, Lease+Complete (1 process)"),
        ("W2", "total", f"W2 total, 2+2 processes, 4 partitions ({s.w2_items:,})"),
        ("W3", "drain", f"W3 Lease+Complete with {s.w3_stored:,} stored"),
        ("W4", "produce", f"W4 produce, {s.w4_queues} queues ({s.w4_items:,})"),
        ("W4", "drain", f"W4 drain, {s.w4_queues} queues"),
        ("W5", "produce", f"W5 produce, plain blocking stubs, 1 call in flight ({s.items:,})"),
        ("W5", "drain", "W5 drain, plain stubs: Lease then Complete, 1 call in flight"),
        ("W5", "total", f"W5 2+2 processes, plain stubs, 1 call in flight each ({s.w2_items:,})"),
    ]
    rows = []
    for w, key, label in figures:
        if w in results:
            value = results[w].get(key) if isinstance(results[w], dict) else None
            rows.append((label, f"{w}.{key}", value))
    return rows


def _get(results: dict[str, Any], path: str) -> Any:
    w, key = path.split(".")
    r = results.get(w)
    return r.get(key) if isinstance(r, dict) else None


def report(all_results: dict[str, dict[str, Any]], ceilings: dict[str, Any], args: argparse.Namespace, s: Settings, meta: dict[str, str]) -> str:
    lines: list[str] = []
    add = lines.append
    ours = all_results.get(OURS, {})
    systems = list(all_results)
    add(f"Run {meta['date']}, commit {meta['commit']}, {meta['machine']}; {meta['duration']}.")
    add(
        f"Client settings: batches of {s.batch}; {s.produce_inflight} Produce calls in flight per producer process; "
        f"{s.consume_inflight} Lease+Complete loops per consumer process; lease wait {s.lease_wait_s} s; "
        f"W4: {s.w4_per_queue} call(s) in flight per queue ({s.w4_per_queue * s.w4_queues} per process); "
        f"W1 and W4: median of {args.repeat} runs, W2 and W3: one run"
        + ("; ours completes via the next Lease (complete_ids)" if args.complete_in_lease else "")
        + ("; ours sends Produce and Lease over a ProduceStream / LeaseStream per queue and process, as the SDK does" if args.streams else "")
        + ("; ours produces one ProduceItem per item" if args.item_produce else "; ours produces in the compact form (ProduceRequest.payloads), as the SDK does for bare payloads")
        + "."
    )
    add("")
    add("| system | workload | items/s | ours ÷ this |")
    add("|---|---|---:|---:|")
    for system in systems:
        res = all_results[system]
        for label, path, value in throughput_rows(res, s):
            if isinstance(res.get(path.split(".")[0]), str):
                add(f"| {system} | {label} | failed: {res[path.split('.')[0]]} | |")
                continue
            ratio = "1.00x" if system == OURS else _ratio(_get(ours, path), value)
            add(f"| {system} | {label} | {_n(value)} | {ratio} |")
        for w in WORKLOADS:
            if isinstance(res.get(w), str) and not any(p.startswith(w + ".") for _, p, _ in throughput_rows(res, s)):
                add(f"| {system} | {w} | failed: {res[w]} | |")
    add("")
    walls = [f"{system} {r['W1']['wall_s']:.1f} s" for system, r in all_results.items() if isinstance(r.get("W1"), dict)]
    if walls:
        add(f"W1 wall time, produce + drain of {s.items:,} items (median): " + ", ".join(walls) + ".")
        add("")
    if any(isinstance(r.get("W2"), dict) for r in all_results.values()):
        add("W2 produce → lease latency (timestamp in the payload, over every item), ms:")
        add("")
        add("| system | full load p50 | full load p99 | half load: items/s paced | half load p50 | half load p99 |")
        add("|---|---:|---:|---:|---:|---:|")
        for system in systems:
            r = all_results[system].get("W2")
            if isinstance(r, dict):
                f, h = r["full"], r["half"]
                add(f"| {system} | {_ms(f['p50_ms'])} | {_ms(f['p99_ms'])} | {_n(h['target_rate'])} | {_ms(h['p50_ms'])} | {_ms(h['p99_ms'])} |")
        add("")
    if any(isinstance(r.get("W3"), dict) for r in all_results.values()):
        add(f"W3 ({s.w3_stored:,} items of 256 B stored, then {s.items:,} leased and completed from the head):")
        add("")
        add("| system | fill items/s | Lease+Complete items/s | ÷ W1 drain | ÷ shallow drain, same minute | memory after fill, MiB | measured as |")
        add("|---|---:|---:|---:|---:|---:|---|")
        for system, svc_label in meta["memory_labels"].items():  # type: ignore[attr-defined]
            r = all_results[system].get("W3")
            w1 = all_results[system].get("W1")
            if isinstance(r, dict):
                w1_drain = w1.get("drain") if isinstance(w1, dict) else None
                vs = f"{r['drain'] / w1_drain:.2f}" if w1_drain else "n/a"
                same = f"{r['drain'] / r['shallow_drain']:.2f}"
                add(f"| {system} | {_n(r['fill'])} | {_n(r['drain'])} | {vs} | {same} | {r['memory_mib']:,.0f} | {svc_label} |")
        add("")
        add(f"(shallow drain: the same {s.items:,} leased and completed from a queue holding only them, right after.)")
        add("")
    lat = ours.get("W5", {}).get("latency") if isinstance(ours.get("W5"), dict) else None
    if lat:
        add("W5 latency: one blocking generated stub, one call in flight, items as sub-messages; ms, and ours minus the floor of the same run:")
        add("")
        add("| call | p50 | p99 | p50 − floor | p50 target | met |")
        add("|---|---:|---:|---:|---:|---|")
        floor_grpc = lat["floor: gRPC Produce(1) answered without storing"]["p50"]
        floor_grpc100 = lat["floor: gRPC Produce(100) answered without storing"]["p50"]
        floor_lmdb = lat["floor: one durable LMDB commit of one put"]["p50"]
        for call, st in lat.items():
            if call.startswith("floor"):
                add(f"| {call} | {st['p50']:.3f} | {st['p99']:.3f} | | | |")
                continue
            floor = (floor_grpc if "1 item" in call else floor_grpc100) + floor_lmdb
            target = LATENCY_TARGETS_MS.get(call)
            met = "n/a" if target is None else ("yes" if st["p50"] <= target else "**no**")
            add(f"| {call} | {st['p50']:.3f} | {st['p99']:.3f} | {st['p50'] - floor:+.3f} | {target if target else ''} | {met} |")
        add("")
        add("(floor of a call: the gRPC floor for the same request size plus one durable commit; a Lease or "
            "Complete carries 100 items or ids, so the 100-item gRPC floor is used for them.)")
        add("")
    if ceilings:
        add("Ceilings of this machine, same run (measured at its start and at its end; the better one counts):")
        add("")
        add("| ceiling | per second (start / end) | as items/s (100 per call or commit), better one |")
        add("|---|---:|---:|")

        def samples(c: dict[str, Any]) -> str:
            return " / ".join(_n(x) for x in c.get("samples", []))

        e = ceilings.get("echo")
        if isinstance(e, dict):
            add(f"| gRPC echo of a 100-item ProduceRequest, {e['inflight']} in flight, 1 client process | {samples(e)} calls | {_n(e['items_per_s'])} |")
        elif e:
            add(f"| gRPC echo | failed: {e} | |")
        es = ceilings.get("echo_stream")
        if isinstance(es, dict):
            add(f"| the same echo on one bidirectional stream, {es['inflight']} in flight | {samples(es)} calls | {_n(es['items_per_s'])} |")
        elif es:
            add(f"| gRPC echo on a stream | failed: {es} | |")
        if args.streams and isinstance(es, dict):
            e = es  # ours sent its calls on streams: that is the bound that applies
        lm = ceilings.get("lmdb")
        if isinstance(lm, dict):
            add(f"| LMDB durable commit of 100 × 256 B (sync, metasync) | {samples(lm)} commits | {_n(lm['items_per_s'])} |")
        elif lm:
            add(f"| LMDB commit | failed: {lm} | |")
        add("")
        if isinstance(e, dict) and isinstance(lm, dict) and ours:
            drain_calls = 1 if args.complete_in_lease else 2
            drain_how = "one to drain (a Lease that completes the last batch)" if args.complete_in_lease else "two to drain (Lease, Complete)"
            add("Ours as a fraction of the ceilings. gRPC: calls/s needed ÷ echo calls/s"
                + (" (the stream echo: ours used streams)" if e is es else "")
                + ", counting per batch one call "
                f"to produce, {drain_how}, {1 + drain_calls} end to end (W2). LMDB: items/s ÷ the items/s of one "
                "100-item durable commit at a time (the server puts many batches in one commit, so it can pass 1).")
            add("")
            add("| figure | items/s | ÷ gRPC echo items/s | ÷ LMDB commit items/s |")
            add("|---|---:|---:|---:|")
            for label, path, value in throughput_rows(ours, s):
                if isinstance(value, float):
                    calls = 1 + drain_calls if path.startswith("W2") else drain_calls if path.endswith("drain") else 1
                    add(f"| {label} | {_n(value)} | {value * calls / e['items_per_s']:.2f} | {value / lm['items_per_s']:.2f} |")
            add("")
    add("Targets (from the issue):")
    add("")
    add("| target | figure | met |")
    add("|---|---|---|")
    for target, figure, met in targets(all_results):
        add(f"| {target} | {figure} | {met} |")
    e = ceilings.get("echo_stream") if args.streams and isinstance(ceilings.get("echo_stream"), dict) else ceilings.get("echo")
    needs = peer_needs(all_results, args) if isinstance(e, dict) else []
    if needs:
        add("")
        add("What each peer ratio asks of ours, against the gRPC echo ceiling of the same run (a server "
            "that only parses each call and answers it"
            + ("; the stream echo, as ours used streams" if args.streams and e is ceilings.get("echo_stream") else "")
            + "). A share above about 1 cannot be reached by any "
            "server behind Python gRPC here, whatever it does per item.")
        add("")
        add("| target | ours would need, items/s | calls/s at 100 items per call | ÷ echo calls/s |")
        add("|---|---:|---:|---:|")
        for target, items_per_s, calls_per_s in needs:
            add(f"| {target} | {_n(items_per_s)} | {_n(calls_per_s)} | {calls_per_s / e['calls_per_s']:.2f} |")
    return "\n".join(lines)


def peer_needs(all_results: dict[str, dict[str, Any]], args: argparse.Namespace) -> list[tuple[str, float, float]]:
    """(target, items/s ours would need, calls/s that takes) for every peer-ratio target."""
    drain_calls = 1 if args.complete_in_lease else 2
    calls_per_batch = {"W1.produce": 1, "W1.drain": drain_calls, "W2.total": 1 + drain_calls}
    out = []
    for peer, factor in (("Redis Streams", 1.5), ("PostgreSQL", 2.0)):
        other = all_results.get(peer) or {}
        for path, calls in calls_per_batch.items():
            b = _get(other, path)
            if isinstance(b, float):
                need = factor * b
                out.append((f"{path} >= {factor}x {peer}", need, need * calls / 100))
    return out


def targets(all_results: dict[str, dict[str, Any]]) -> list[tuple[str, str, str]]:
    ours = all_results.get(OURS, {})
    out: list[tuple[str, str, str]] = []

    def check(target: str, value: float | None, ok: bool | None, figure: str) -> None:
        out.append((target, figure if value is not None else "not run", "n/a" if ok is None else ("yes" if ok else "**no**")))

    w1, w2, w3, w4 = (ours.get(w) if isinstance(ours.get(w), dict) else None for w in ("W1", "W2", "W3", "W4"))
    if w1:
        check("W1 produce >= 50,000 items/s", w1["produce"], w1["produce"] >= 50_000, _n(w1["produce"]))
        check("W1 drain >= 35,000 items/s", w1["drain"], w1["drain"] >= 35_000, _n(w1["drain"]))
    if w2:
        check("W2 total >= 35,000 items/s", w2["total"], w2["total"] >= 35_000, _n(w2["total"]))
        check("W2 half-load p99 <= 50 ms", w2["half"]["p99_ms"], w2["half"]["p99_ms"] <= 50, _ms(w2["half"]["p99_ms"]) + " ms")
    for peer, factor in (("Redis Streams", 1.5), ("PostgreSQL", 2.0)):
        other = all_results.get(peer)
        if not other:
            continue
        for path in ("W1.produce", "W1.drain", "W2.total"):
            a, b = _get(ours, path), _get(other, path)
            if isinstance(a, float) and isinstance(b, float):
                check(f"{path} >= {factor}x {peer}", a, a >= factor * b, f"{a / b:.2f}x")
    if w1 and w3:
        ratio = w3["drain"] / w1["drain"]
        check("W3 Lease+Complete within 20 % of W1 drain", ratio, ratio >= 0.8, f"{ratio:.2f} of W1")
        same = w3["drain"] / w3["shallow_drain"]
        check("(same, against the shallow drain of the same minute)", same, same >= 0.8, f"{same:.2f}")
    w5 = ours.get("W5") if isinstance(ours.get("W5"), dict) else None
    redis5 = (all_results.get("Redis Streams") or {}).get("W5")
    if w5 and isinstance(redis5, dict):
        for key, factor in (("produce", 1.5), ("drain", 1.2), ("total", 1.2)):
            ratio = w5[key] / redis5[key]
            check(f"W5.{key} >= {factor}x Redis Streams", ratio, ratio >= factor, f"{ratio:.2f}x")
    if w1 and w4:
        check("W4 produce >= W1 produce", w4["produce"], w4["produce"] >= w1["produce"], f"{w4['produce'] / w1['produce']:.2f}x")
        check("W4 drain >= W1 drain", w4["drain"], w4["drain"] >= w1["drain"], f"{w4['drain'] / w1['drain']:.2f}x")
    return out


# --- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    s = settings_from(args)
    common.install_cleanup_handlers()
    if args.peers:
        ensure_requirements()
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    workdir = tempfile.mkdtemp(prefix="querator-bench-")
    common.on_exit("bench temp dir", lambda: shutil.rmtree(workdir, ignore_errors=True))
    print(f"bench: work dir {workdir}; workloads {','.join(args.only)}; peers {','.join(args.peers) or 'none'}"
          + (" (quick: 1/10 of the items)" if args.quick else ""), flush=True)

    source_dir = None
    commit = common.git_commit(REPO_DIR)
    if args.at_commit:
        from querator_target import export_commit

        source_dir = os.path.join(workdir, "source")
        commit = export_commit(args.at_commit, REPO_DIR, source_dir)[:10] + " (server and client stubs from `git archive` of that commit)"
        # Client processes (spawned: they inherit sys.path) import that commit's stubs too.
        sys.path.insert(0, os.path.join(source_dir, "clients", "python", "src"))
    print(f"bench: server code from {commit}", flush=True)

    if args.nodes:
        return run_cluster(args, s, workdir, source_dir, commit, started, load_start, argv)

    ceilings: dict[str, Any] = {}
    if not args.no_ceilings:
        measure_ceilings(ceilings, s, workdir, "start", streams=args.streams)

    running: list[tuple[Any, Any]] = []
    all_results: dict[str, dict[str, Any]] = {}
    memory_labels: dict[str, str] = {}
    try:
        for service in services(args, workdir, source_dir):
            try:
                client = service.start()
                if args.complete_in_lease and service.name == OURS:
                    client.complete_in_lease = True
                if args.streams and service.name == OURS:
                    client.streams = True
                if args.item_produce and service.name == OURS:
                    client.compact = False
                running.append((service, client))
                memory_labels[service.name] = service.memory_label()
                all_results[service.name] = {}
                print(f"bench: started {service.name} (pid {service.pid})", flush=True)
            except Exception as exc:
                all_results[service.name] = {w: f"could not start: {type(exc).__name__}: {exc}" for w in args.only}
                print(f"bench: {service.name} could not start: {exc}", flush=True)
        # Interleaved by workload, so each comparison is made minutes apart, not a whole run apart.
        for w in sorted(args.only, key=lambda x: ("W1", "W2", "W4", "W3", "W5").index(x)):
            for service, client in running:
                t = time.monotonic()
                try:
                    all_results[service.name][w] = run_workload(w, client, service, s, args.repeat)
                    print(f"bench: {service.name} {w} ({time.monotonic() - t:.0f} s): {_brief(all_results[service.name][w])}", flush=True)
                except Exception as exc:
                    all_results[service.name][w] = f"{type(exc).__name__}: {exc}"
                    print(f"bench: {service.name} {w} failed: {exc}", flush=True)
                    traceback.print_exc()
    finally:
        for service, _ in reversed(running):
            service.stop()
    if not args.no_ceilings:
        measure_ceilings(ceilings, s, workdir, "end", streams=args.streams)

    duration = time.monotonic() - started
    meta = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "commit": commit,
        "machine": f"{os.cpu_count()} cores, Python {platform.python_version()}",
        "duration": f"the whole run took {duration / 60:.1f} min; 1-minute load average {load_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end (2 would fill both cores)",
    }
    meta["memory_labels"] = memory_labels  # type: ignore[assignment]
    body = report(all_results, ceilings, args, s, meta)
    print()
    print("----- results (markdown, for bench/RESULTS.md) -----")
    print()
    print("## Throughput and latency (`bench/run.py`)")
    print()
    print("Command: `.venv/bin/python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`. "
          "The machine is shared and noisy: compare systems by the ratios from this same run.")
    print()
    print(body)
    failed = any(isinstance(v, str) for r in all_results.values() for v in r.values())
    return 1 if failed else 0


def run_cluster(args: argparse.Namespace, s: Settings, workdir: str, source_dir: str | None, commit: str, started: float, load_start: float, argv: list[str] | None) -> int:
    """``--nodes N``: W1, W2, W4 on one server, on N nodes and on N independent servers, interleaved; see cluster_bench.py."""
    import cluster_bench

    if args.replicas:
        return run_replicas(args, s, workdir, source_dir, commit, started, load_start, argv)
    out, plan = cluster_bench.run(args, s, workdir, source_dir)
    print()
    print("----- results (markdown, for bench/RESULTS.md) -----")
    print()
    print(f"## A cluster of {args.nodes} nodes beside one server and {args.nodes} independent servers (`bench/run.py --nodes`)")
    print()
    print("Command: `.venv/bin/python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`. "
          f"Run {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, commit {commit}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{(time.monotonic() - started) / 60:.1f} min; 1-minute load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.")
    print()
    print(cluster_bench.report(out, plan, s, args))
    return 0


def run_replicas(args: argparse.Namespace, s: Settings, workdir: str, source_dir: str | None, commit: str, started: float, load_start: float, argv: list[str] | None) -> int:
    """``--nodes N --replicas 1,2,3``: W1, W2 and Produce/Lease latency per R on one cluster, interleaved; see replication_bench.py."""
    import replication_bench

    out = replication_bench.run(args, s, workdir, source_dir)
    print()
    print("----- results (markdown, for bench/RESULTS.md) -----")
    print()
    print(f"## Replicated queues, R = {', '.join(map(str, args.replicas))} on {args.nodes} nodes (`bench/run.py --nodes --replicas`)")
    print()
    print("Command: `.venv/bin/python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`. "
          f"Run {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, commit {commit}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{(time.monotonic() - started) / 60:.1f} min; 1-minute load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end. "
          "The machine is shared and noisy: read the ratios of this run, not the absolute figures.")
    print()
    print(replication_bench.report(out, s, args))
    return 0


def measure_ceilings(ceilings: dict[str, Any], s: Settings, workdir: str, when: str, *, streams: bool = False) -> None:
    """Measured at the start and at the end of the run; the better of the two counts."""
    import ceilings as ceil

    calls = max(300, s.items // s.batch)
    measures: list[tuple[str, str, Any]] = [
        ("echo", "calls_per_s", lambda: ceil.grpc_echo(s, calls=calls)),
        ("lmdb", "commits_per_s", lambda: ceil.lmdb_commit(workdir, commits=calls)),
    ]
    if streams:
        measures.append(("echo_stream", "calls_per_s", lambda: ceil.grpc_echo(s, calls=calls, stream=True)))
    for key, per_s, fn in measures:
        try:
            result = fn()
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"bench: ceiling {key} at the {when}: {result}", flush=True)
        result = {**result, "samples": [*ceilings.get(key, {}).get("samples", []), result.get(per_s)]}
        best = ceilings.get(key)
        if "error" in result and not isinstance(best, dict):
            ceilings[key] = result["error"]
        elif "error" not in result and (not isinstance(best, dict) or result[per_s] > best[per_s]):
            ceilings[key] = result
        elif isinstance(best, dict):
            best["samples"] = result["samples"]


def _brief(result: dict[str, Any]) -> str:
    parts = []
    for k, v in result.items():
        if isinstance(v, float):
            parts.append(f"{k}={v:,.1f}" if v < 100 else f"{k}={v:,.0f}")
        elif k == "runs":
            parts.append("runs=[" + "; ".join(" ".join(f"{kk}={vv:,.0f}" for kk, vv in r.items() if kk in ("produce", "drain")) for r in v) + "]")
        elif isinstance(v, dict):
            parts.append(f"{k}=(" + ", ".join(f"{kk}={vv['p50']:.3f} ms" if isinstance(vv, dict) else f"{kk}={vv:,.1f}" for kk, vv in v.items()) + ")")
    return " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
