"""The ``querator`` command line.

``querator serve`` runs the server (needs the querator-server package). Every other
command is a client of a running server: ``--address`` (env QUERATOR_ADDRESS, default
127.0.0.1:2319), ``--token`` (env QUERATOR_TOKEN) for a server with API keys, and
``--tls-ca`` (env QUERATOR_TLS_CA), ``--tls-cert``/``--tls-key`` for TLS and mutual TLS;
these go before or after the command. Output is a table for people, or JSON with
``--json``. Exit codes: 0 ok, 1 the server answered an error (its status name is
printed), 2 bad usage.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, is_dataclass
from datetime import UTC, datetime, timedelta
from typing import IO, Any

from ._cli_dlq import add_dlq_commands
from ._client import Client
from ._config import ADDRESS_ENV, DEFAULT_ADDRESS
from ._items import LeasedItem
from ._models import ROLES, ApiKey, DeadReason, Item, ItemRef, QueueInfo, StoredItem
from .errors import InvalidRequest, QueratorError

TOKEN_ENV = "QUERATOR_TOKEN"
TLS_CA_ENV = "QUERATOR_TLS_CA"
_PROGRESS_EVERY = 10_000


class UsageError(Exception):
    """Bad command-line input: exit code 2."""


# -- parsing values -----------------------------------------------------------------------

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> timedelta:
    """``1.5`` (seconds), ``500ms``, ``30s``, ``5m``, ``1h30m``, ``2d``."""
    value = text.strip()
    try:
        return timedelta(seconds=float(value))
    except ValueError:
        pass
    pos, total = 0, 0.0
    for match in _DURATION.finditer(value):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    if pos != len(value) or not value:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30s, 500ms, 5m, 1h30m)")
    return timedelta(seconds=total)


def parse_time(text: str) -> datetime:
    """An ISO 8601 time; without a zone it is taken as UTC."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r} (e.g. 2030-01-02T03:04:05Z)") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


# -- output -------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in asdict(value).items()}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def emit_json(value: Any, out: IO[str]) -> None:
    json.dump(_plain(value), out, separators=(",", ":"))
    out.write("\n")


def emit_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], out: IO[str]) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for row in [list(headers), *cells]:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"
    if isinstance(value, timedelta):
        return _human_duration(value)
    return str(value)


def _human_duration(value: timedelta) -> str:
    s = value.total_seconds()
    if s and s < 1:
        return f"{s * 1000:g}ms"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size and s % size == 0:
            return f"{s / size:g}{unit}"
    return f"{s:g}s"


def payload_fields(payload: bytes) -> dict[str, str]:
    """JSON form of a payload: ``payload`` when it is UTF-8 text, else ``payload_base64``."""
    try:
        return {"payload": payload.decode()}
    except UnicodeDecodeError:
        return {"payload_base64": base64.b64encode(payload).decode()}


def payload_cell(payload: bytes, width: int = 60) -> str:
    try:
        text = payload.decode().replace("\n", "\\n")
    except UnicodeDecodeError:
        text = ""
    if not text.isprintable() or not text and payload:
        text = "base64:" + base64.b64encode(payload).decode()
    return text if len(text) <= width else text[: width - 3] + "..."


def queue_row(q: QueueInfo) -> list[Any]:
    return [q.name, q.partitions, q.lease_timeout, q.expire_timeout, q.max_attempts or "-", q.dead_queue or "-", q.reference]


QUEUE_HEADERS = ["NAME", "PARTITIONS", "LEASE", "EXPIRE", "MAX_ATTEMPTS", "DEAD_QUEUE", "REFERENCE"]


def leased_json(item: LeasedItem) -> dict[str, Any]:
    return {
        "queue_name": item.queue_name,
        "partition": item.partition,
        "id": item.id,
        "attempts": item.attempts,
        "lease_deadline": item.lease_deadline.isoformat(),
        "created_at": item.created_at.isoformat(),
        "encoding": item.encoding,
        "kind": item.kind,
        "reference": item.reference,
        "metadata": dict(item.metadata),
        **payload_fields(item.payload),
    }


def stored_json(item: StoredItem) -> dict[str, Any]:
    out = _plain(item)
    out.pop("payload")
    out.update(payload_fields(item.payload))
    return dict(out)


# -- reading input ------------------------------------------------------------------------


def _payload_of(obj: dict[str, Any], where: str) -> bytes:
    if "payload_base64" in obj:
        try:
            return base64.b64decode(obj["payload_base64"], validate=True)
        except ValueError:
            raise UsageError(f"{where}: payload_base64 is not base64") from None
    value = obj.get("payload", obj.get("utf8", ""))
    if not isinstance(value, str):
        value = json.dumps(value, separators=(",", ":"))  # a JSON value as the payload
    return value.encode()


def _json_objects(lines: Iterable[str], name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: each line must be a JSON object")
        yield where, obj


def _metadata_of(obj: dict[str, Any], where: str) -> dict[str, str]:
    value = obj.get("metadata")
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise UsageError(f"{where}: metadata must be an object of strings, e.g. {{\"team\": \"billing\"}}")
    return value


def _time_field(obj: dict[str, Any], key: str, where: str) -> datetime | None:
    value = obj.get(key)
    if value in (None, ""):
        return None
    try:
        return parse_time(str(value))
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"{where}: {key}: {exc}") from None


def _dead_reason_field(obj: dict[str, Any], where: str) -> DeadReason | None:
    value = obj.get("dead_reason")
    if not value:
        return None
    try:
        return DeadReason(str(value))
    except ValueError:
        known = ", ".join(reason.value for reason in DeadReason)
        raise UsageError(f"{where}: dead_reason: must be one of {known}, got {value!r}") from None


def produce_items(lines: Iterable[str], name: str, jsonl: bool) -> Iterator[Item | bytes]:
    if not jsonl:
        for line in lines:
            text = line.rstrip("\r\n")
            if text:
                yield text.encode()
        return
    for where, obj in _json_objects(lines, name):
        yield Item(
            _payload_of(obj, where),
            encoding=str(obj.get("encoding", "")),
            kind=str(obj.get("kind", "")),
            reference=str(obj.get("reference", "")),
            enqueue_at=_time_field(obj, "enqueue_at", where),
            idempotency_key=str(obj.get("idempotency_key", "")),
            metadata=_metadata_of(obj, where),
        )


def import_items(lines: Iterable[str], name: str) -> Iterator[StoredItem]:
    for where, obj in _json_objects(lines, name):
        yield StoredItem(
            payload=_payload_of(obj, where),
            is_leased=bool(obj.get("is_leased", False)),
            lease_deadline=_time_field(obj, "lease_deadline", where),
            expire_deadline=_time_field(obj, "expire_deadline", where),
            enqueue_at=_time_field(obj, "enqueue_at", where),
            created_at=_time_field(obj, "created_at", where),
            attempts=int(obj.get("attempts", 0)),
            reference=str(obj.get("reference", "")),
            encoding=str(obj.get("encoding", "")),
            kind=str(obj.get("kind", "")),
            source_id=str(obj.get("source_id", "")),
            metadata=_metadata_of(obj, where),
            message_id=str(obj.get("message_id", "")),
            dead_reason=_dead_reason_field(obj, where),
            dead_at=_time_field(obj, "dead_at", where),
            dead_attempts=int(obj.get("dead_attempts", 0)),
        )


def _open_input(path: str) -> IO[str]:
    if path == "-":
        return sys.stdin
    try:
        return open(path, encoding="utf-8")  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def read_ids(ids: list[str]) -> list[str]:
    if not ids or ids == ["-"]:
        ids = sys.stdin.read().split()
    if not ids:
        raise UsageError("no ids given (as arguments or on standard input)")
    return ids


# -- commands -----------------------------------------------------------------------------

Command = Callable[[argparse.Namespace, Client], int]


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "dead_queue": args.dead_queue,
        "reference": args.reference,
        "lease_timeout": args.lease_timeout,
        "expire_timeout": args.expire_timeout,
        "max_attempts": args.max_attempts,
        "partitions": args.partitions,
        "dedup_window": args.dedup_window,
        "lease_key_ttl": args.lease_key_ttl,
    }


def _show_queue(args: argparse.Namespace, info: QueueInfo) -> None:
    if args.json:
        emit_json(info, sys.stdout)
    else:
        emit_table(QUEUE_HEADERS, [queue_row(info)], sys.stdout)


def cmd_queues_create(args: argparse.Namespace, client: Client) -> int:
    _show_queue(args, client.create_queue(args.name, **_settings(args)))
    return 0


def cmd_queues_get(args: argparse.Namespace, client: Client) -> int:
    _show_queue(args, client.get_queue(args.name))
    return 0


def cmd_queues_list(args: argparse.Namespace, client: Client) -> int:
    queues = list(client.list_queues(page_size=args.page_size))
    if args.json:
        emit_json(queues, sys.stdout)
    else:
        emit_table(QUEUE_HEADERS, [queue_row(q) for q in queues], sys.stdout)
    return 0


def cmd_queues_update(args: argparse.Namespace, client: Client) -> int:
    settings = _settings(args)
    if all(v is None for v in settings.values()):
        raise UsageError("name at least one setting to change (e.g. --max-attempts 5)")
    _show_queue(args, client.update_queue(args.name, **settings))
    return 0


def _done(args: argparse.Namespace, message: str, **fields: Any) -> int:
    if args.json:
        emit_json(fields, sys.stdout)
    else:
        print(message)
    return 0


def cmd_queues_delete(args: argparse.Namespace, client: Client) -> int:
    client.delete_queue(args.name, force=args.force)
    return _done(args, f"deleted queue {args.name}", deleted=args.name)


def cmd_queues_clear(args: argparse.Namespace, client: Client) -> int:
    scheduled = args.scheduled or args.all
    ready = not args.scheduled or args.all
    client.clear_queue(args.name, ready=ready, scheduled=scheduled, destructive=args.destructive)
    what = " and ".join(w for w, on in (("ready", ready), ("scheduled", scheduled)) if on)
    return _done(args, f"cleared {what} items of {args.name}", cleared=args.name, ready=ready, scheduled=scheduled)


def cmd_queues_stats(args: argparse.Namespace, client: Client) -> int:
    stats = client.queue_stats(args.name)
    if args.json:
        emit_json({**_plain(stats), "total": stats.total, "total_leased": stats.total_leased, "scheduled": stats.scheduled}, sys.stdout)
        return 0
    faulty = any(p.faulty for p in stats.partitions)  # the column only when it says something
    rows = [
        [p.partition, p.total, p.ready, p.total_leased, p.scheduled, p.average_age, p.average_leased_age]
        + ([p.failure or "-"] if faulty else [])
        for p in stats.partitions
    ]
    headers = ["PARTITION", "TOTAL", "READY", "LEASED", "SCHEDULED", "AVG_AGE", "AVG_LEASED_AGE"]
    emit_table(headers + (["FAULTY"] if faulty else []), rows, sys.stdout)
    print(f"lease_waiting={stats.lease_waiting} produce_waiting={stats.produce_waiting} in_flight={stats.in_flight}")
    return 0


class Progress:
    """Items stored so far, on stderr: a live line on a terminal, a line per 10,000 otherwise."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.shown = 0
        self.count = 0

    def __call__(self, count: int) -> None:
        self.count = count
        if self.tty:
            self.stream.write(f"\rproduced {count} items")
            self.stream.flush()
            self.shown = count
        elif count - self.shown >= _PROGRESS_EVERY:
            self.stream.write(f"produced {count} items\n")
            self.stream.flush()
            self.shown = count

    def finish(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\n")
        elif self.count >= 1000 and self.shown != self.count:
            self.stream.write(f"produced {self.count} items\n")


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
        source = _open_input(path)
        jsonl = args.jsonl or path.endswith(".jsonl")
        items = produce_items(source, "<stdin>" if path == "-" else path, jsonl)
    progress = Progress(sys.stderr)
    try:
        result = client.produce(
            args.queue,
            items,
            encoding=args.encoding,
            kind=args.kind,
            reference=args.reference,
            enqueue_at=enqueue_at,
            batch_size=args.batch_size,
            max_in_flight=args.in_flight,
            on_progress=progress,
        )
    finally:
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
        return _done(args, f"completed the items of {keys} lease keys", completed_keys=keys)
    refs = _refs(args)
    client.complete(refs, lease_keys=args.lease_key, queue_name=args.queue)
    return _done(args, f"completed {len(refs)} items", completed=len(refs))


def cmd_retry(args: argparse.Namespace, client: Client) -> int:
    if args.at is not None and args.in_ is not None:
        raise UsageError("give --at or --in, not both")
    refs = _refs(args)
    client.retry(refs, at=args.at, in_=args.in_, dead=args.dead)
    verb = "dead-lettered" if args.dead else "retried"
    return _done(args, f"{verb} {len(refs)} items", **{verb.replace("-", "_"): len(refs)})


def _partitions(args: argparse.Namespace, client: Client) -> list[int]:
    if args.partition is not None:
        return [args.partition]
    return list(range(client.get_queue(args.queue).partitions))


def _list_items(args: argparse.Namespace, client: Client, scheduled: bool) -> int:
    found: list[StoredItem] = []
    for partition in _partitions(args, client):
        listing = client.list_scheduled_items if scheduled else client.list_items
        for item in listing(args.queue, partition=partition, page_size=args.page_size):
            found.append(item)
            if args.limit and len(found) >= args.limit:
                break
        if args.limit and len(found) >= args.limit:
            break
    if args.json:
        for item in found:
            emit_json(stored_json(item), sys.stdout)
        return 0
    when = "ENQUEUE_AT" if scheduled else "LEASE_DEADLINE"
    rows = [
        [i.partition, i.id, "leased" if i.is_leased else ("scheduled" if scheduled else "ready"), i.attempts,
         i.enqueue_at if scheduled else i.lease_deadline, payload_cell(i.payload, 40)]
        for i in found
    ]  # fmt: skip
    emit_table(["PARTITION", "ID", "STATE", "ATTEMPTS", when, "PAYLOAD"], rows, sys.stdout)
    return 0


def cmd_items_list(args: argparse.Namespace, client: Client) -> int:
    return _list_items(args, client, scheduled=False)


def cmd_items_scheduled(args: argparse.Namespace, client: Client) -> int:
    return _list_items(args, client, scheduled=True)


def cmd_items_import(args: argparse.Namespace, client: Client) -> int:
    source = _open_input(args.file)
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


def cmd_items_delete(args: argparse.Namespace, client: Client) -> int:
    ids = read_ids(args.ids)
    client.delete_items(args.queue, ids, partition=args.partition)
    return _done(args, f"deleted {len(ids)} items", deleted=len(ids))


KEY_HEADERS = ["KEY_ID", "ROLE", "QUEUES", "DESCRIPTION", "CREATED_AT"]


def key_row(key: ApiKey) -> list[Any]:
    return [key.key_id, key.role, ",".join(key.queues), key.description, key.created_at]


def cmd_keys_create(args: argparse.Namespace, client: Client) -> int:
    created = client.create_key(args.role, args.queues, description=args.description)
    if args.json:
        emit_json({"key": created.key, "token": created.token}, sys.stdout)
        return 0
    # The token alone on standard output (TOKEN=$(querator keys create ...)); the rest on stderr.
    print(created.token)
    key = created.key
    print(
        f"created {key.role} key {key.key_id} for {', '.join(key.queues)}; "
        "the token above is shown only once",
        file=sys.stderr,
    )
    return 0


def cmd_keys_list(args: argparse.Namespace, client: Client) -> int:
    keys = client.list_keys()
    if args.json:
        emit_json(keys, sys.stdout)
    else:
        emit_table(KEY_HEADERS, [key_row(k) for k in keys], sys.stdout)
    return 0


def cmd_keys_revoke(args: argparse.Namespace, client: Client) -> int:
    client.revoke_key(args.key_id)
    return _done(args, f"revoked key {args.key_id}", revoked=args.key_id)


# -- the parser ---------------------------------------------------------------------------


def _add_common(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The connection and output options. Given on the top-level parser (``defaults``)
    and on every command without defaults, so they may come before or after the command."""

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    group = parser.add_argument_group("connection and output")
    group.add_argument(
        "--address",
        default=default(os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS),
        help=f"server host:port (env {ADDRESS_ENV}, default {DEFAULT_ADDRESS})",
    )
    group.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON (one document, or one line per item)"
    )
    group.add_argument(
        "--timeout", type=parse_duration, default=default(timedelta(seconds=30)), help="call deadline (default 30s)"
    )
    group.add_argument(
        "--token",
        default=default(os.environ.get(TOKEN_ENV)),
        help=f"API key sent as 'authorization: Bearer TOKEN' on every call (env {TOKEN_ENV})",
    )
    group.add_argument(
        "--tls", action="store_true", default=default(False), help="connect with TLS (system roots unless --tls-ca)"
    )
    group.add_argument(
        "--tls-ca",
        "--ca-file",
        dest="tls_ca",
        default=default(os.environ.get(TLS_CA_ENV) or None),
        help=f"PEM CA certificates to trust; implies --tls (env {TLS_CA_ENV})",
    )
    group.add_argument(
        "--tls-cert", "--cert-file", dest="tls_cert", default=default(None), help="PEM client certificate chain (mutual TLS)"
    )
    group.add_argument(
        "--tls-key", "--key-file", dest="tls_key", default=default(None), help="PEM client private key (mutual TLS)"
    )


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    _add_common(common, defaults=False)
    return common


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="querator",
        description="Querator work-queue service: run the server, or talk to one.",
        epilog="Exit codes: 0 ok, 1 the server answered an error (status printed), 2 bad usage.",
    )
    _add_common(parser, defaults=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common()

    def leaf(group: Any, name: str, func: Command, help: str) -> argparse.ArgumentParser:
        sub: argparse.ArgumentParser = group.add_parser(name, parents=[common], help=help, description=help)
        sub.set_defaults(func=func)
        return sub

    commands.add_parser("serve", help="run the server (needs the querator-server package)")

    queues = commands.add_parser("queues", help="create, inspect, change, clear and delete queues")
    qsub = queues.add_subparsers(dest="queues_command", required=True, metavar="ACTION")
    p = leaf(qsub, "create", cmd_queues_create, "create a queue")
    p.add_argument("name")
    _queue_settings(p)
    p = leaf(qsub, "get", cmd_queues_get, "show a queue's settings")
    p.add_argument("name")
    p = leaf(qsub, "list", cmd_queues_list, "list queues by name")
    p.add_argument("--page-size", type=int, default=0, help="queues per call (default: server's)")
    p = leaf(qsub, "update", cmd_queues_update, "change the settings given")
    p.add_argument("name")
    _queue_settings(p)
    p = leaf(qsub, "delete", cmd_queues_delete, "delete a queue and its items")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="delete even when it still holds items")
    p = leaf(qsub, "clear", cmd_queues_clear, "remove ready items (default), scheduled items, or both")
    p.add_argument("name")
    p.add_argument("--scheduled", action="store_true", help="remove scheduled items instead of ready ones")
    p.add_argument("--all", action="store_true", help="remove ready and scheduled items")
    p.add_argument("--destructive", action="store_true", help="remove leased items too")
    p = leaf(qsub, "stats", cmd_queues_stats, "item counts per partition")
    p.add_argument("name")

    p = leaf(commands, "produce", cmd_produce, "add items: arguments, lines of a file, or standard input")
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

    p = leaf(commands, "lease", cmd_lease, "lease items (prints their ids and partition)")
    p.add_argument("queue")
    p.add_argument("-n", "--batch-size", type=int, default=10, help="most items to lease (1..1000, default 10)")
    p.add_argument("--wait", type=parse_duration, default=timedelta(0), help="wait this long for items (default 0)")
    p.add_argument("--client-id", default="", help="consumer id (one waiting Lease per id)")
    p.add_argument(
        "--lease-key", default="", help="idempotent lease: the same key returns the same items (complete with it too)"
    )

    for name, func, text in (
        ("complete", cmd_complete, "complete leased items"),
        ("retry", cmd_retry, "give leased items back: now, later (--at/--in) or to the DLQ (--dead)"),
    ):
        p = leaf(commands, name, func, text)
        p.add_argument("queue")
        p.add_argument("ids", nargs="*", help="item ids; none or '-': read them from standard input")
        p.add_argument("-p", "--partition", type=int, default=0, help="the partition the lease named (default 0)")
        if name == "complete":
            p.add_argument(
                "--lease-key",
                action="append",
                default=[],
                help="complete every item leased under this key (repeatable; no ids needed)",
            )
        if name == "retry":
            p.add_argument("--at", type=parse_time, help="retry at this time (ISO 8601)")
            p.add_argument("--in", dest="in_", type=parse_duration, help="retry after this long")
            p.add_argument("--dead", action="store_true", help="send to the dead-letter queue")

    items = commands.add_parser("items", help="inspect and repair stored items")
    isub = items.add_subparsers(dest="items_command", required=True, metavar="ACTION")
    for name, func, text in (
        ("list", cmd_items_list, "list ready and leased items in FIFO order"),
        ("scheduled", cmd_items_scheduled, "list scheduled items by due time"),
    ):
        p = leaf(isub, name, func, text)
        p.add_argument("queue")
        p.add_argument("-p", "--partition", type=int, help="one partition (default: all)")
        p.add_argument("--limit", type=int, default=0, help="stop after this many items")
        p.add_argument("--page-size", type=int, default=1000, help="items per call")
    p = leaf(isub, "import", cmd_items_import, "store items from JSON lines as given (attempts, times kept)")
    p.add_argument("queue")
    p.add_argument("file", help="JSON lines file ('-' = standard input); fields as `items list --json` prints")
    p.add_argument("-p", "--partition", type=int, default=0)
    p = leaf(isub, "delete", cmd_items_delete, "delete items by id, whatever their state")
    p.add_argument("queue")
    p.add_argument("ids", nargs="*", help="item ids; none or '-': read them from standard input")
    p.add_argument("-p", "--partition", type=int, default=0)

    keys = commands.add_parser("keys", help="API keys (a server with auth on; needs an admin token for '*')")
    ksub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    p = leaf(ksub, "create", cmd_keys_create, "create a key and print its token (shown only once)")
    p.add_argument(
        "--queues", nargs="+", action="extend", required=True, metavar="PATTERN",
        help="queue-name patterns the key may touch, e.g. 'orders*' or '*'",
    )  # fmt: skip
    p.add_argument("--role", required=True, choices=ROLES, help="producer, consumer or admin")
    p.add_argument("--description", default="", help="a note, e.g. the service that uses the key")
    leaf(ksub, "list", cmd_keys_list, "list keys (never their tokens)")
    p = leaf(ksub, "revoke", cmd_keys_revoke, "revoke a key: calls with its token fail from now on")
    p.add_argument("key_id")
    add_dlq_commands(commands, leaf)
    return parser


def _client(args: argparse.Namespace) -> Client:
    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror}") from None

    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("mutual TLS needs both --tls-cert and --tls-key")
    return Client(
        args.address,
        timeout=args.timeout,
        tls=args.tls or None,
        root_certificates=read(args.tls_ca),
        certificate_chain=read(args.tls_cert),
        private_key=read(args.tls_key),
        bearer_token=args.token or None,
    )


def _serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="querator serve", description="Run the Querator server.")
    try:
        from querator_server.cli import add_serve_arguments, run_serve
    except ImportError:
        add_serve_arguments = run_serve = None
    if add_serve_arguments is not None:
        add_serve_arguments(parser)
    args = parser.parse_args(argv)
    if run_serve is None:
        print("querator: 'serve' needs the server: pip install querator-server", file=sys.stderr)
        return 2
    return int(run_serve(args, argv))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _client(args) as client:
            return int(args.func(args, client))
    except (UsageError, ValueError) as exc:
        print(f"querator: {exc}", file=sys.stderr)
        return 2
    except QueratorError as exc:
        print(f"querator: {exc.status}: {exc.message}", file=sys.stderr)
        if isinstance(exc, InvalidRequest):
            for violation in exc.field_violations:
                print(f"  {violation.field}: {violation.description}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. | head
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
