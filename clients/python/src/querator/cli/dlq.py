"""``querator dlq``: read one dead letter in full (``show``), move dead letters back to
their queues (``redrive``, RedriveItems)."""

from __future__ import annotations

import argparse
import sys

from .._client import Client
from .._models import DeadReason, RedriveResult, StoredItem
from ..errors import QueratorError
from ._common import Commands
from ._output import emit_json, payload_cell, plain, stored_json

# The fields `dlq show` prints, in order, before the error and the payload.
_SHOWN = (
    "id", "partition", "message_id", "source_id", "kind", "dead_reason", "dead_at", "dead_attempts",
    "last_error_at", "attempts", "created_at", "is_leased", "lease_deadline", "encoding", "reference",
)  # fmt: skip


def find_items(client: Client, queue: str, wanted: str, partition: int | None) -> list[StoredItem]:
    """The stored items of ``queue`` whose id, message id or source id is ``wanted``, at
    most one a partition: a listing of each partition (or of ``partition``), page by
    page, until found there. Every partition is read: in a cluster ids and message ids
    are unique per partition only (each home issues its own), so two may match."""
    partitions = [partition] if partition is not None else range(client.get_queue(queue).partitions)
    found: list[StoredItem] = []
    for p in partitions:
        for item in client.list_items(queue, partition=p, page_size=1000):
            if wanted in (item.id, item.message_id, item.source_id):
                found.append(item)
                break
    return found


def cmd_show(args: argparse.Namespace, client: Client) -> int:
    found = find_items(client, args.queue, args.id, args.partition)
    if not found:
        print(f"querator: no item {args.id!r} in {args.queue} (looked for it as id, message_id and source_id)", file=sys.stderr)
        return 1
    if len(found) > 1:
        where = ", ".join(str(i.partition) for i in found)
        print(f"querator: {len(found)} items match {args.id!r} in {args.queue}, in partitions {where}; name one with -p", file=sys.stderr)
        return 1
    (item,) = found
    if args.json:
        emit_json(stored_json(item), sys.stdout)
        return 0
    out = sys.stdout
    fields = plain(item)
    for name in _SHOWN:
        value = fields[name]
        if value in ("", None) or (name in ("is_leased",) and not value):
            continue
        out.write(f"{name + ':':<16}{value}\n")
    if item.metadata:
        out.write(f"{'metadata:':<16}{fields['metadata']}\n")
    out.write(f"{'payload:':<16}{payload_cell(item.payload, 200)}\n")
    out.write("last_error:\n")
    for line in (item.last_error or "(none)").splitlines():
        out.write(f"  {line}\n")
    return 0


def cmd_redrive(args: argparse.Namespace, client: Client) -> int:
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    try:
        done = client.redrive_items(args.queue, to=args.to, kind=args.kind, dead_reason=args.reason, limit=args.limit)
    except QueratorError as exc:
        # Items earlier calls moved are in their targets now: say which, then the error.
        if exc.redriven is not None:
            _report(args, exc.redriven, " before the error")
        raise
    _report(args, done)
    return 0


def _report(args: argparse.Namespace, done: RedriveResult, when: str = "") -> None:
    if args.json:
        emit_json({"moved": done.moved, "skipped": done.skipped, "message_ids": list(done.message_ids)}, sys.stdout)
        return
    where = args.to or "their source queues"
    print(f"moved {done.moved} items from {args.queue} to {where}{when}")
    if done.skipped:
        print(f"{done.skipped} matching items stayed: their source queue no longer exists", file=sys.stderr)


def register(commands: Commands) -> None:
    dlq = commands.group("dlq", "dead-letter queues: read a dead letter, move dead letters back")
    p = dlq.leaf("show", cmd_show, "print one dead letter in full: why, when, after how many attempts, its error")
    p.add_argument("queue", help="the dead-letter queue")
    p.add_argument("id", help="the item's id in it, its message_id, or its id in the queue it died in (source_id)")
    p.add_argument("-p", "--partition", type=int, help="look in this partition only (default: all)")
    p = dlq.leaf("redrive", cmd_redrive, "move ready dead letters back to the queues they died in (or --to one)")
    p.add_argument("queue", help="the dead-letter queue")
    p.add_argument("--to", help="move every item to this queue instead of its source queue")
    p.add_argument("--kind", help="only items of this kind")
    p.add_argument(
        "--reason", choices=[reason.value for reason in DeadReason], help="only items that died for this reason"
    )
    p.add_argument("--limit", type=int, help="move at most this many items (default: every matching one)")
