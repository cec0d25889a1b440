"""``querator items ...``: inspect and repair stored items."""

from __future__ import annotations

import argparse
import sys

from .._client import Client
from .._models import StoredItem
from ._common import Commands, done
from ._input import import_items, open_input, read_ids
from ._output import Progress, emit_json, emit_table, error_cell, payload_cell, stored_json


def _partitions(args: argparse.Namespace, client: Client) -> list[int]:
    if args.partition is not None:
        return [args.partition]
    return list(range(client.get_queue(args.queue).partitions))


def _list_items(args: argparse.Namespace, client: Client, scheduled: bool) -> int:
    # JSON lines are printed as they arrive (a long listing can be piped and watched);
    # the table needs every row for its widths, so progress goes to stderr meanwhile.
    listing = client.list_scheduled_items if scheduled else client.list_items
    found: list[StoredItem] = []
    count = 0
    progress = Progress(sys.stderr, "listed")
    try:
        for partition in _partitions(args, client):
            for item in listing(args.queue, partition=partition, page_size=args.page_size):
                count += 1
                if args.json:
                    emit_json(stored_json(item), sys.stdout)
                else:
                    found.append(item)
                progress(count)
                if args.limit and count >= args.limit:
                    break
            if args.limit and count >= args.limit:
                break
    finally:
        progress.finish()
    if args.json:
        return 0
    when = "ENQUEUE_AT" if scheduled else "LEASE_DEADLINE"
    rows = [
        [i.partition, i.id, "leased" if i.is_leased else ("scheduled" if scheduled else "ready"), i.kind or None,
         i.priority, i.attempts, i.enqueue_at if scheduled else i.lease_deadline, i.dead_reason, error_cell(i.last_error, 50),
         payload_cell(i.payload, 40)]
        for i in found
    ]  # fmt: skip
    headers = ["PARTITION", "ID", "STATE", "KIND", "PRIORITY", "ATTEMPTS", when, "REASON", "ERROR", "PAYLOAD"]
    emit_table(headers, rows, sys.stdout)
    return 0


def cmd_list(args: argparse.Namespace, client: Client) -> int:
    return _list_items(args, client, scheduled=False)


def cmd_scheduled(args: argparse.Namespace, client: Client) -> int:
    return _list_items(args, client, scheduled=True)


def cmd_import(args: argparse.Namespace, client: Client) -> int:
    source = open_input(args.file)
    try:
        ids = client.import_items(args.queue, import_items(source, args.file), partition=args.partition)
    finally:
        if source is not sys.stdin:
            source.close()
    if args.json:
        emit_json({"count": len(ids), "ids": ids}, sys.stdout)
    else:
        print(f"imported {len(ids)} items into {args.queue} partition {args.partition}")
    return 0


def cmd_delete(args: argparse.Namespace, client: Client) -> int:
    ids = read_ids(args.ids)
    client.delete_items(args.queue, ids, partition=args.partition)
    return done(args, f"deleted {len(ids)} items", deleted=len(ids))


def register(commands: Commands) -> None:
    items = commands.group("items", "inspect and repair stored items")
    for name, func, text in (
        ("list", cmd_list, "list ready and leased items in FIFO order"),
        ("scheduled", cmd_scheduled, "list scheduled items by due time"),
    ):
        p = items.leaf(name, func, text)
        p.add_argument("queue")
        p.add_argument("-p", "--partition", type=int, help="one partition (default: all)")
        p.add_argument("--limit", type=int, default=0, help="stop after this many items")
        p.add_argument("--page-size", type=int, default=1000, help="items per call")
    p = items.leaf("import", cmd_import, "store items from JSON lines as given (attempts, times kept)")
    p.add_argument("queue")
    p.add_argument("file", help="JSON lines file ('-' = standard input); fields as `items list --json` prints")
    p.add_argument("-p", "--partition", type=int, default=0)
    p = items.leaf("delete", cmd_delete, "delete items by id, whatever their state", rest="ids")
    p.add_argument("queue")
    p.add_argument("ids", nargs="*", help="item ids; none or '-': read them from standard input")
    p.add_argument("-p", "--partition", type=int, default=0)
