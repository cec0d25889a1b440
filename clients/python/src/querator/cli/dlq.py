"""``querator dlq redrive``: dead letters back to their queues (RedriveItems)."""

from __future__ import annotations

import argparse
import sys

from .._client import Client
from .._models import DeadReason, RedriveResult
from ..errors import QueratorError
from ._common import Commands
from ._output import emit_json


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
    dlq = commands.group("dlq", "dead-letter queues: move dead letters back")
    p = dlq.leaf("redrive", cmd_redrive, "move ready dead letters back to the queues they died in (or --to one)")
    p.add_argument("queue", help="the dead-letter queue")
    p.add_argument("--to", help="move every item to this queue instead of its source queue")
    p.add_argument("--kind", help="only items of this kind")
    p.add_argument(
        "--reason", choices=[reason.value for reason in DeadReason], help="only items that died for this reason"
    )
    p.add_argument("--limit", type=int, help="move at most this many items (default: every matching one)")
