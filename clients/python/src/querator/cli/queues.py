"""``querator queues ...``: create, inspect, change, clear, pause, resume and delete queues."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._client import Client
from .._models import QUEUE_SETTINGS, QueueInfo
from ._common import Commands, UsageError, done, parse_duration
from ._output import emit_json, emit_table, plain

QUEUE_HEADERS = ["NAME", "PARTITIONS", "LEASE", "EXPIRE", "MAX_ATTEMPTS", "DEAD_QUEUE", "PAUSED", "REFERENCE"]


def paused_text(q: QueueInfo) -> str:
    return "leases+produce" if q.produce_paused else "leases" if q.paused else "-"


def queue_row(q: QueueInfo) -> list[Any]:
    return [
        q.name, q.partitions, q.lease_timeout, q.expire_timeout, q.max_attempts or "-", q.dead_queue or "-",
        paused_text(q), q.reference,
    ]


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in QUEUE_SETTINGS}


def _show_queue(args: argparse.Namespace, info: QueueInfo) -> None:
    if args.json:
        emit_json(info, sys.stdout)
    else:
        emit_table(QUEUE_HEADERS, [queue_row(info)], sys.stdout)


def cmd_create(args: argparse.Namespace, client: Client) -> int:
    _show_queue(args, client.create_queue(args.name, **_settings(args)))
    return 0


def cmd_get(args: argparse.Namespace, client: Client) -> int:
    _show_queue(args, client.get_queue(args.name))
    return 0


def cmd_list(args: argparse.Namespace, client: Client) -> int:
    queues = list(client.list_queues(page_size=args.page_size))
    if args.json:
        emit_json(queues, sys.stdout)
    else:
        emit_table(QUEUE_HEADERS, [queue_row(q) for q in queues], sys.stdout)
    return 0


def cmd_update(args: argparse.Namespace, client: Client) -> int:
    settings = _settings(args)
    if all(v is None for v in settings.values()):
        raise UsageError("name at least one setting to change (e.g. --max-attempts 5)")
    _show_queue(args, client.update_queue(args.name, **settings))
    return 0


def cmd_delete(args: argparse.Namespace, client: Client) -> int:
    client.delete_queue(args.name, force=args.force)
    return done(args, f"deleted queue {args.name}", deleted=args.name)


def cmd_clear(args: argparse.Namespace, client: Client) -> int:
    scheduled = args.scheduled or args.all
    ready = not args.scheduled or args.all
    client.clear_queue(args.name, ready=ready, scheduled=scheduled, destructive=args.destructive)
    what = " and ".join(w for w, on in (("ready", ready), ("scheduled", scheduled)) if on)
    return done(args, f"cleared {what} items of {args.name}", cleared=args.name, ready=ready, scheduled=scheduled)


def cmd_pause(args: argparse.Namespace, client: Client) -> int:
    _show_queue(args, client.pause_queue(args.name, produce=args.produce))
    return 0


def cmd_resume(args: argparse.Namespace, client: Client) -> int:
    _show_queue(args, client.resume_queue(args.name))
    return 0


def cmd_stats(args: argparse.Namespace, client: Client) -> int:
    stats = client.queue_stats(args.name)
    if args.json:
        emit_json({**plain(stats), "total": stats.total, "total_leased": stats.total_leased, "scheduled": stats.scheduled}, sys.stdout)
        return 0
    faulty = any(p.faulty for p in stats.partitions)  # the column only when it says something
    groups = any(p.groups_in_flight or p.oldest_waiting_in_group is not None for p in stats.partitions)
    rows = [
        [p.partition, p.total, p.ready, p.total_leased, p.scheduled, p.average_age, p.average_leased_age]
        + ([p.groups_in_flight, p.oldest_waiting_in_group or "-"] if groups else [])
        + ([p.failure or "-"] if faulty else [])
        for p in stats.partitions
    ]
    headers = ["PARTITION", "TOTAL", "READY", "LEASED", "SCHEDULED", "AVG_AGE", "AVG_LEASED_AGE"]
    headers += ["GROUPS_IN_FLIGHT", "OLDEST_WAITING_IN_GROUP"] if groups else []
    emit_table(headers + (["FAULTY"] if faulty else []), rows, sys.stdout)
    print(f"lease_waiting={stats.lease_waiting} produce_waiting={stats.produce_waiting} in_flight={stats.in_flight}")
    return 0


def _queue_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dead-queue", help="dead-letter queue name ('' to remove)")
    parser.add_argument("--reference", help="free-form note")
    parser.add_argument("--lease-timeout", type=parse_duration, help="lease length, e.g. 30s (default 1m)")
    parser.add_argument("--expire-timeout", type=parse_duration, help="item lifetime, e.g. 24h (default 24h)")
    parser.add_argument("--max-attempts", type=int, help="leases before dead-lettering (0 = unlimited)")
    parser.add_argument("--partitions", type=int, help="number of partitions (may be raised, not lowered)")
    parser.add_argument(
        "--dedup-window", type=parse_duration, help="how long idempotency keys are remembered (default 24h)"
    )
    parser.add_argument("--lease-key-ttl", type=parse_duration, help="how long lease keys are remembered (default 1h)")


def register(commands: Commands) -> None:
    queues = commands.group("queues", "create, inspect, change, clear, pause, resume and delete queues")
    p = queues.leaf("create", cmd_create, "create a queue")
    p.add_argument("name")
    _queue_settings(p)
    p = queues.leaf("get", cmd_get, "show a queue's settings")
    p.add_argument("name")
    p = queues.leaf("list", cmd_list, "list queues by name")
    p.add_argument("--page-size", type=int, default=0, help="queues per call (default: server's)")
    p = queues.leaf("update", cmd_update, "change the settings given")
    p.add_argument("name")
    _queue_settings(p)
    p = queues.leaf("delete", cmd_delete, "delete a queue and its items")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="delete even when it still holds items")
    p = queues.leaf("clear", cmd_clear, "remove ready items (default), scheduled items, or both")
    p.add_argument("name")
    p.add_argument("--scheduled", action="store_true", help="remove scheduled items instead of ready ones")
    p.add_argument("--all", action="store_true", help="remove ready and scheduled items")
    p.add_argument("--destructive", action="store_true", help="remove leased items too")
    p = queues.leaf("pause", cmd_pause, "hand out no items until resumed (leases wait; produce goes on)")
    p.add_argument("name")
    p.add_argument("--produce", action="store_true", help="refuse produce too while paused")
    p = queues.leaf("resume", cmd_resume, "end a pause: leases get items again")
    p.add_argument("name")
    p = queues.leaf("stats", cmd_stats, "item counts per partition")
    p.add_argument("name")
