"""``produce``, ``lease``, ``complete`` and ``retry``: the work-queue calls."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import IO

from .._client import Client
from .._models import Item, ItemRef
from ._common import Commands, UsageError, done, parse_duration, parse_time
from ._input import open_input, produce_items, read_ids
from ._output import Progress, emit_json, emit_table, leased_json, payload_cell


def cmd_produce(args: argparse.Namespace, client: Client) -> int:
    if args.payloads and args.file:
        raise UsageError("give payloads as arguments or with --file, not both")
    enqueue_at = args.at
    if args.delay is not None:
        if enqueue_at is not None:
            raise UsageError("give --at or --delay, not both")
        enqueue_at = datetime.now(UTC) + args.delay
    source: IO[str] | None = None
    if args.payloads:
        items: Iterable[Item | bytes] = [p.encode() for p in args.payloads]
    else:
        path = args.file or "-"
        source = open_input(path)
        jsonl = args.jsonl or path.endswith(".jsonl")
        items = produce_items(source, "<stdin>" if path == "-" else path, jsonl)
    # -q: nothing on success, progress included.
    progress = None if args.quiet else Progress(sys.stderr)
    try:
        result = client.produce(
            args.queue,
            items,
            encoding=args.encoding,
            kind=args.kind,
            reference=args.reference,
            enqueue_at=enqueue_at,
            priority=args.priority,
            batch_size=args.batch_size,
            max_in_flight=args.in_flight,
            on_progress=progress,
        )
    finally:
        if progress is not None:
            progress.finish()
        if source is not None and source is not sys.stdin:
            source.close()
    if args.json:
        emit_json(
            {"count": len(result), "ids": result.ids, "partitions": result.partitions, "duplicates": result.duplicates},
            sys.stdout,
        )
    elif args.quiet:
        pass
    elif len(result) <= 20:
        emit_table(["PARTITION", "ID"], zip(result.partitions, result.ids), sys.stdout)
    else:
        print(f"produced {len(result)} items into {args.queue}")
    if result.duplicates and not args.json and not args.quiet:
        print(f"{result.duplicates} duplicates (idempotency_key seen before) stored nothing", file=sys.stderr)
    return 0


def cmd_lease(args: argparse.Namespace, client: Client) -> int:
    items = client.lease(
        args.queue, batch_size=args.batch_size, wait=args.wait, client_id=args.client_id, lease_key=args.lease_key
    )
    if args.json:
        emit_json(
            {"queue_name": args.queue, "partition": items[0].partition if items else None, "items": [leased_json(i) for i in items]},
            sys.stdout,
        )
    elif items:
        rows = [[i.partition, i.id, i.attempts, i.lease_deadline, payload_cell(i.payload)] for i in items]
        emit_table(["PARTITION", "ID", "ATTEMPTS", "LEASE_DEADLINE", "PAYLOAD"], rows, sys.stdout)
    else:
        print("no items", file=sys.stderr)
    return 0


def _refs(args: argparse.Namespace) -> list[ItemRef]:
    return [ItemRef(args.queue, args.partition, i) for i in read_ids(args.ids)]


def cmd_complete(args: argparse.Namespace, client: Client) -> int:
    if args.lease_key and not args.ids:
        client.complete(lease_keys=args.lease_key, queue_name=args.queue)
        keys = len(args.lease_key)
        return done(args, f"completed the items of {keys} lease keys", completed_keys=keys)
    refs = _refs(args)
    client.complete(refs, lease_keys=args.lease_key, queue_name=args.queue)
    return done(args, f"completed {len(refs)} items", completed=len(refs))


def cmd_retry(args: argparse.Namespace, client: Client) -> int:
    if args.at is not None and args.in_ is not None:
        raise UsageError("give --at or --in, not both")
    refs = _refs(args)
    dead = len(client.retry(refs, at=args.at, in_=args.in_, dead=args.dead, error=args.error))
    retried = len(refs) - dead
    if retried and dead:
        message = f"retried {retried} items; {dead} were out of attempts and went to the dead-letter queue"
    elif dead and not args.dead:
        message = f"dead-lettered {dead} items (out of attempts)"
    elif dead:
        message = f"dead-lettered {dead} items"
    else:
        message = f"retried {retried} items"
    return done(args, message, retried=retried, dead_lettered=dead)


def register(commands: Commands) -> None:
    p = commands.leaf("produce", cmd_produce, "add items: arguments, lines of a file, or standard input", rest="payloads")
    p.add_argument("queue")
    p.add_argument("payloads", nargs="*", help="payloads (UTF-8 text); none: read --file or standard input")
    p.add_argument("-f", "--file", help="read payloads from this file, one per line ('-' = standard input)")
    p.add_argument(
        "--jsonl",
        action="store_true",
        help="lines are JSON objects: payload (or payload_base64), kind, encoding, reference, enqueue_at, "
        "idempotency_key, metadata (an object of strings) (implied for *.jsonl files)",
    )
    p.add_argument("--kind", default="", help="kind of every item (JSON lines may set their own)")
    p.add_argument("--encoding", default="", help="encoding label of every item")
    p.add_argument("--reference", default="", help="reference of every item")
    p.add_argument(
        "--priority", type=int, default=0, help="priority of every item, 0-9, higher leased first (JSON lines may set their own)"
    )
    p.add_argument("--at", type=parse_time, help="schedule the items for this time (ISO 8601, UTC if no zone)")
    p.add_argument("--delay", type=parse_duration, help="schedule the items this long from now")
    p.add_argument("--batch-size", type=int, default=1000, help="items per request (at most 1000)")
    p.add_argument(
        "--in-flight",
        type=int,
        default=1,
        help="requests in flight (default 1: the queue keeps the input's order; more is faster, "
        "but requests may then be stored in any order)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")

    p = commands.leaf("lease", cmd_lease, "lease items (prints their ids and partition)")
    p.add_argument("queue")
    p.add_argument("-n", "--batch-size", type=int, default=10, help="most items to lease (1..1000, default 10)")
    p.add_argument("--wait", type=parse_duration, default=timedelta(0), help="wait this long for items (default 0)")
    p.add_argument("--client-id", default="", help="consumer id (one waiting Lease per id)")
    p.add_argument(
        "--lease-key", default="", help="idempotent lease: the same key returns the same items (complete with it too)"
    )

    p = commands.leaf("complete", cmd_complete, "complete leased items", rest="ids")
    _ids(p)
    p.add_argument(
        "--lease-key",
        action="append",
        default=[],
        help="complete every item leased under this key (repeatable; no ids needed)",
    )
    p = commands.leaf(
        "retry", cmd_retry, "give leased items back: now, later (--at/--in) or to the DLQ (--dead)", rest="ids"
    )
    _ids(p)
    p.add_argument("--at", type=parse_time, help="retry at this time (ISO 8601)")
    p.add_argument("--in", dest="in_", type=parse_duration, help="retry after this long")
    p.add_argument("--dead", action="store_true", help="send to the dead-letter queue")
    p.add_argument("--error", default="", help="what went wrong: kept as the items' last_error (at most 2,048 bytes)")


def _ids(p: argparse.ArgumentParser) -> None:
    p.add_argument("queue")
    p.add_argument("ids", nargs="*", help="item ids; none or '-': read them from standard input")
    p.add_argument("-p", "--partition", type=int, default=0, help="the partition the lease named (default 0)")
