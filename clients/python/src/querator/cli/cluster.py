"""``querator cluster ...``: an operator's view of a cluster, and retiring a dead node."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from typing import Any

from .._client import Client
from .._models import ClusterView, SetAsideQueue
from ..errors import NotFound
from ._common import Commands, UsageError, done
from ._output import emit_json, emit_table

#: ``querator cluster status`` exits with this when something needs an operator.
UNHEALTHY = 3

MEMBER_HEADERS = ["NODE", "ADDRESS", "LIVE", "FENCED", "PARTITIONS", "FAULTY"]
FAULTY_HEADERS = ["QUEUE", "PARTITION", "NODE", "FAILURE"]
REPLICATED_HEADERS = ["QUEUE", "PRIMARY", "EPOCH", "REPLICAS", "IN_SYNC", "MIN_IN_SYNC", "MOVING"]
DIED_FOR_GOOD = "docs/cluster.md, \"A node that died for good\""


@dataclass(frozen=True, slots=True)
class Faulty:
    queue: str
    partition: int
    node: str
    failure: str


def _faulty(client: Client, view: ClusterView) -> list[Faulty]:
    """Every faulty partition of every queue in the view (one GetQueueStats per queue:
    in a cluster that call also lists the partitions of a home that is down)."""
    out: list[Faulty] = []
    for name, homes in sorted(view.homes.items()):
        try:
            stats = client.queue_stats(name)
        except NotFound:  # deleted since the view was read
            continue
        for p in stats.partitions:
            if p.faulty:
                node = homes[p.partition] if p.partition < len(homes) else ""
                out.append(Faulty(name, p.partition, node, p.failure))
    return out


def _fenced_cell(fenced: bool, live: bool, check_error: str) -> str:
    if not live:
        return "-"
    if check_error:
        return "?"
    return "yes" if fenced else "no"


def cmd_status(args: argparse.Namespace, client: Client) -> int:
    view = client.cluster_info(check_members=True)
    faulty = _faulty(client, view)
    members: list[dict[str, Any]] = [
        {
            "node_id": m.node_id,
            "address": m.address,
            "live": m.live,
            "fenced": m.fenced,
            "check_error": m.check_error,
            "partitions": view.partitions_of(m.node_id),
            "faulty": sum(1 for f in faulty if f.node == m.node_id),
        }
        for m in view.members
    ]
    problems = [f"node {m['node_id']} is not live" for m in members if not m["live"]]
    problems += [f"node {m['node_id']} is fenced" for m in members if m["live"] and m["fenced"]]
    problems += [f"node {m['node_id']} did not answer: {m['check_error']}" for m in members if m["check_error"]]
    if faulty:
        problems.append(f"{len(faulty)} faulty partition{'s' if len(faulty) > 1 else ''}")
    if not view.admin_writable:
        problems.append(f"the answering node {view.node_id} is fenced")
    live_nodes = {m.node_id for m in view.members if m.live}
    for name, copies in sorted(view.replicated.items()):
        if copies.primary not in live_nodes:
            problems.append(f"queue {name}: its primary {copies.primary} is not live")
            if copies.failover_blocked or not any(n in live_nodes for n in copies.in_sync if n != copies.primary):
                # Only an in-sync copy holds every acknowledged write: none may take over.
                waiting = ",".join(n for n in copies.in_sync if n not in live_nodes) or copies.primary
                problems.append(
                    f"queue {name}: no live in-sync copy can take over without losing acknowledged writes; "
                    f"it waits for {waiting}" + (f" ({copies.failover_blocked})" if copies.failover_blocked else "")
                )
            if not any(n in live_nodes for n in copies.replicas):
                problems.append(
                    f"queue {name}: no live node keeps a copy of it; if its nodes are gone for good, "
                    f"'querator cluster retire {copies.primary} --discard-data' re-makes it empty (its items lost)"
                )
        if len(copies.in_sync) < copies.min_in_sync:
            problems.append(
                f"queue {name}: {len(copies.in_sync)} in-sync copies, below its minimum of {copies.min_in_sync} (writes refused)"
            )
    if args.json:
        emit_json(
            {
                "clustered": view.clustered,
                "node_id": view.node_id,
                "revision": view.revision,
                "admin_writable": view.admin_writable,
                "members": members,
                "faulty": faulty,
                "replicated": [{"queue": name, **asdict(copies)} for name, copies in sorted(view.replicated.items())],
                "healthy": not problems,
                "problems": problems,
            },
            sys.stdout,
        )
        return UNHEALTHY if problems else 0
    if view.clustered:
        live = sum(1 for m in view.members if m.live)
        print(f"cluster: {live} of {len(view.members)} nodes live, catalog revision {view.revision}, answered by {view.node_id}")
    else:
        print("a single server (not a cluster)")
    rows = [
        [
            m["node_id"] or "-",
            m["address"] or "-",
            "yes" if m["live"] else "no",
            _fenced_cell(m["fenced"], m["live"], m["check_error"]),
            m["partitions"],
            m["faulty"],
        ]
        for m in members
    ]
    emit_table(MEMBER_HEADERS, rows, sys.stdout)
    if view.replicated:
        print()
        emit_table(
            REPLICATED_HEADERS,
            [
                [
                    name,
                    c.primary,
                    c.epoch,
                    ",".join(c.replicas),
                    ",".join(c.in_sync),
                    c.min_in_sync,
                    f"{c.moving_from}->{c.moving_to}" if c.moving_to else "-",
                ]
                for name, c in sorted(view.replicated.items())
            ],
            sys.stdout,
        )
    if faulty:
        print()
        emit_table(FAULTY_HEADERS, [[f.queue, f.partition, f.node or "-", f.failure] for f in faulty], sys.stdout)
    if problems:
        print(f"\nunhealthy: {'; '.join(problems)}", file=sys.stderr)
        if any(not m["live"] for m in members):
            print(f"a node that is gone for good: see {DIED_FOR_GOOD}", file=sys.stderr)
        return UNHEALTHY
    return 0


def _warning(view: ClusterView, node: str) -> str:
    queues = sorted(name for name, homes in view.homes.items() if node in homes)
    partitions = view.partitions_of(node)
    shown = ", ".join(queues[:10]) + (f" and {len(queues) - 10} more" if len(queues) > 10 else "")
    return (
        f"Retiring node {node} DISCARDS THE ITEMS of the {partitions} partition{'s' if partitions != 1 else ''} it homes"
        f"{' (queues: ' + shown + ')' if queues else ''}: each is recreated, empty, on a live node, and the items "
        f"left in {node}'s data directory are never served again. The id {node} can never join the cluster again.\n"
        f"If {node}'s data directory can be recovered, restore it on a new host under the same --node-id "
        f"instead: nothing is lost that way ({DIED_FOR_GOOD}). A replicated queue whose only in-sync copy {node} "
        f"held gets its most advanced other copy as primary: what {node} acknowledged after that copy's position is lost; "
        f"one of which {node} was the primary and no live node keeps a copy is re-made empty on the live nodes."
    )


def cmd_retire(args: argparse.Namespace, client: Client) -> int:
    node = args.node_id
    view = client.cluster_info()
    # Nothing to lose (not a cluster, a node that homes nothing, one already retired, one
    # keeping only copies of replicated queues, made again from their other copies): the
    # server's answer says which, without a warning or a question.
    at_stake = view.clustered and view.partitions_of(node) > 0
    if at_stake and not args.discard_data:
        raise UsageError("retiring a node loses the items it holds: say so with --discard-data")
    if at_stake:
        print(_warning(view, node), file=sys.stderr)
    if at_stake and not args.yes:
        if not sys.stdin.isatty():
            raise UsageError("not confirmed: add --yes (standard input is not a terminal to ask on)")
        answer = input(f"Type the node id ({node}) to retire it and discard its items: ").strip()
        if answer != node:
            print("not retired", file=sys.stderr)
            return 1
    # --discard-data also accepts losing what the node alone acknowledged: a replicated
    # queue whose only in-sync copy it held gets its most advanced other copy as primary.
    retired = client.retire_node(node, promote_copies_behind=bool(args.discard_data))
    moved = retired.partitions_recreated
    lines = [f"retired node {node}: {moved} partition{'s' if moved != 1 else ''} recreated, empty, on the live nodes"]
    lines += [
        f"queue {c.queue_name}: {node} held its only in-sync copy; the copy on {c.node_id} (epoch {c.epoch}, lsn {c.lsn}) "
        f"is its primary now (epoch {c.new_epoch}): the changes {node} acknowledged after that position are LOST"
        for c in retired.copies_promoted
    ]
    return done(
        args,
        "\n".join(lines),
        node_id=node,
        partitions_recreated=moved,
        copies_recreated=retired.copies_recreated,
        copies_promoted=[asdict(c) for c in retired.copies_promoted],
    )


def cmd_move(args: argparse.Namespace, client: Client) -> int:
    copies = client.move_queue(args.queue, args.node_id, from_node_id=args.from_node or "")
    return done(
        args,
        f"queue {args.queue}: primary {copies.primary}, epoch {copies.epoch}, in sync {','.join(copies.in_sync)}",
        queue=args.queue,
        **asdict(copies),
    )


def cmd_drain(args: argparse.Namespace, client: Client) -> int:
    moved, kept = client.drain_node(args.node_id)
    if args.json:
        emit_json({"node_id": args.node_id, "moved": moved, "kept": kept}, sys.stdout)
    else:
        print(f"node {args.node_id}: {len(moved)} queue{'' if len(moved) == 1 else 's'} moved off")
        for name in moved:
            print(f"moved  {name}")
        for why in kept:
            print(f"kept   {why}")
    return UNHEALTHY if kept else 0


# -- queues set aside ---------------------------------------------------------------------------

SET_ASIDE_HEADERS = ["NODE", "SET_ASIDE_ID", "QUEUE", "ITEMS", "PARTITIONS", "SET_ASIDE_AT", "REASON"]


def set_aside_row(queue: SetAsideQueue) -> list[Any]:
    items = "unknown" if queue.items < 0 else queue.items
    return [queue.node_id, queue.set_aside_id, queue.queue_name, items, queue.partitions, queue.set_aside_at, queue.reason]


def cmd_set_aside_list(args: argparse.Namespace, client: Client) -> int:
    listed = client.list_set_aside_queues(args.node or "")
    if args.json:
        emit_json(listed, sys.stdout)
    else:
        emit_table(SET_ASIDE_HEADERS, [set_aside_row(q) for q in listed.queues], sys.stdout)
    if listed.unanswered_nodes:
        print(f"querator: not listed (did not answer): {', '.join(listed.unanswered_nodes)}", file=sys.stderr)
        return 1
    return 0


def cmd_set_aside_remove(args: argparse.Namespace, client: Client) -> int:
    removed = client.remove_set_aside_queue(args.node, args.set_aside_id)
    items = "an unknown number of" if removed.items < 0 else str(removed.items)
    return done(
        args,
        f"removed set-aside queue {removed.set_aside_id} ({removed.queue_name!r}, {items} items) from node {removed.node_id}",
        removed=removed,
    )


def register_set_aside(cluster: Commands) -> None:
    set_aside = cluster.group(
        "set-aside", "queues a node set aside (held items, no longer matched the catalog); needs an admin key for '*'"
    )
    p = set_aside.leaf("list", cmd_set_aside_list, "list set-aside queues (every live node's, or one node's)")
    p.add_argument("--node", help="only this node's")
    p = set_aside.leaf("remove", cmd_set_aside_remove, "delete a set-aside queue and its items from its node, for good")
    p.add_argument("node", help="the node holding it (NODE in the list)")
    p.add_argument("set_aside_id", help="its id (SET_ASIDE_ID in the list)")


def register(commands: Commands) -> None:
    cluster = commands.group("cluster", "a cluster's members and health; retire a dead node (docs/cluster.md)")
    cluster.leaf(
        "status",
        cmd_status,
        "members (address, live, fenced), partitions per node, faulty partitions and the catalog revision; "
        f"exits {UNHEALTHY} when a node is down, fenced or unreachable or a partition is faulty",
    )
    p = cluster.leaf(
        "retire",
        cmd_retire,
        "retire a dead node for good: its partitions are recreated EMPTY on the live nodes, its items are lost; "
        "its copies of replicated queues are made again on live nodes from the other copies (nothing lost)",
    )
    p.add_argument("node_id", metavar="NODE", help="the dead node's id")
    p.add_argument(
        "--discard-data",
        action="store_true",
        help="required when the node homes partitions: acknowledges that their items are lost",
    )
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    p = cluster.leaf(
        "move",
        cmd_move,
        "make NODE serve a replicated queue: the primary is handed over to NODE's in-sync copy, or, when NODE "
        "has none, the primary's copy moves there (a copy is added, caught up, then the old one dropped); "
        "nothing is lost. Running it again finishes a move its deadline cut short",
    )
    p.add_argument("queue", metavar="QUEUE", help="the replicated queue")
    p.add_argument("node_id", metavar="NODE", help="its new primary, or with --from the node taking the copy")
    p.add_argument(
        "--from", dest="from_node", metavar="NODE",
        help="move this node's copy to NODE (which holds none) instead; the primary moves with it if it was the primary",
    )
    p = cluster.leaf(
        "drain",
        cmd_drain,
        "move every replicated queue's primary and copy off NODE (before decommissioning it): primaries to "
        "another live in-sync copy, copies to live nodes without one (caught up first); exits "
        f"{UNHEALTHY} when something stays (listed as kept)",
    )
    p.add_argument("node_id", metavar="NODE", help="the node to drain")
    register_set_aside(cluster)
