"""``querator keys ...``: API keys of a server with auth on."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .._client import Client
from .._models import ROLES, ApiKey
from ._common import Commands, done
from ._output import emit_json, emit_table

KEY_HEADERS = ["KEY_ID", "ROLE", "QUEUES", "DESCRIPTION", "CREATED_AT"]


def key_row(key: ApiKey) -> list[Any]:
    return [key.key_id, key.role, ",".join(key.queues), key.description, key.created_at]


def cmd_create(args: argparse.Namespace, client: Client) -> int:
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


def cmd_list(args: argparse.Namespace, client: Client) -> int:
    keys = client.list_keys()
    if args.json:
        emit_json(keys, sys.stdout)
    else:
        emit_table(KEY_HEADERS, [key_row(k) for k in keys], sys.stdout)
    return 0


def cmd_revoke(args: argparse.Namespace, client: Client) -> int:
    client.revoke_key(args.key_id)
    return done(args, f"revoked key {args.key_id}", revoked=args.key_id)


def register(commands: Commands) -> None:
    keys = commands.group("keys", "API keys (a server with auth on; needs an admin token for '*')")
    p = keys.leaf("create", cmd_create, "create a key and print its token (shown only once)")
    p.add_argument(
        "--queues", nargs="+", action="extend", required=True, metavar="PATTERN",
        help="queue-name patterns the key may touch, e.g. 'orders*' or '*'",
    )  # fmt: skip
    p.add_argument("--role", required=True, choices=ROLES, help="producer, consumer or admin")
    p.add_argument("--description", default="", help="a note, e.g. the service that uses the key")
    keys.leaf("list", cmd_list, "list keys (never their tokens)")
    p = keys.leaf("revoke", cmd_revoke, "revoke a key: calls with its token fail from now on")
    p.add_argument("key_id")
