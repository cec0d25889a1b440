"""``querator dlq redrive``: dead letters back to their queues (RedriveItems), from the
command line. Kept apart from the other commands: it only needs a parser group to
join and a client."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from ._client import Client
from ._models import DeadReason

Leaf = Callable[[Any, str, Callable[[argparse.Namespace, Client], int], str], argparse.ArgumentParser]


def add_dlq_commands(commands: Any, leaf: Leaf) -> None:
    """Add ``dlq redrive`` to the ``querator`` parser (``leaf`` adds one command)."""
    dlq = commands.add_parser("dlq", help="dead-letter queues: move dead letters back")
    sub = dlq.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    p = leaf(sub, "redrive", cmd_dlq_redrive, "move ready dead letters back to the queues they died in (or --to one)")
    p.add_argument("queue", help="the dead-letter queue")
    p.add_argument("--to", help="move every item to this queue instead of its source queue")
    p.add_argument("--kind", help="only items of this kind")
    p.add_argument(
        "--reason", choices=[reason.value for reason in DeadReason], help="only items that died for this reason"
    )
    p.add_argument("--limit", type=int, help="move at most this many items (default: every matching one)")


def cmd_dlq_redrive(args: argparse.Namespace, client: Client) -> int:
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be at least 1, got {args.limit}")
    done = client.redrive_items(args.queue, to=args.to, kind=args.kind, dead_reason=args.reason, limit=args.limit)
    if args.json:
        json.dump({"moved": done.moved, "skipped": done.skipped, "message_ids": list(done.message_ids)}, sys.stdout)
        sys.stdout.write("\n")
    else:
        where = args.to or "their source queues"
        print(f"moved {done.moved} items from {args.queue} to {where}")
        if done.skipped:
            print(f"{done.skipped} matching items stayed: their source queue no longer exists", file=sys.stderr)
    return 0
