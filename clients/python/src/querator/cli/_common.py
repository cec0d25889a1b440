"""What every command shares: value parsing, the connection options, the client, registration."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from .._client import Client
from .._config import ADDRESS_ENV, DEFAULT_ADDRESS
from .._convert import parse_duration as _parse_duration
from ._output import emit_json

TOKEN_ENV = "QUERATOR_TOKEN"
TLS_CA_ENV = "QUERATOR_TLS_CA"


class UsageError(Exception):
    """Bad command-line input: exit code 2."""


Command = Callable[[argparse.Namespace, Client], int]


# -- parsing values -----------------------------------------------------------------------


def parse_duration(text: str) -> timedelta:
    """``1.5`` (seconds), ``500ms``, ``30s``, ``5m``, ``1h30m``, ``2d`` (the SDK's parser)."""
    try:
        return _parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_time(text: str) -> datetime:
    """An ISO 8601 time; without a zone it is taken as UTC."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r} (e.g. 2030-01-02T03:04:05Z)") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


# -- registering commands ------------------------------------------------------------------


class Commands:
    """A level of subcommands; command modules add theirs through :meth:`leaf` and :meth:`group`.

    A leaf's ``rest`` names its ``nargs="*"`` positional (ids, payloads): argparse fills it
    only from the words before the first option, so the words left after the options are
    appended to it (``complete Q -p 0 ID ID``), and any other leftover is refused with the
    leaf's own usage.
    """

    def __init__(self, action: Any, common: argparse.ArgumentParser) -> None:
        self._action = action
        self._common = common

    def leaf(self, name: str, func: Command, help: str, *, rest: str | None = None) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = self._action.add_parser(name, parents=[self._common], help=help, description=help)
        parser.set_defaults(func=func, leaf_parser=parser, leaf_rest=rest)
        return parser

    def group(self, name: str, help: str) -> Commands:
        parser = self._action.add_parser(name, help=help, description=help)
        action = parser.add_subparsers(dest=f"{name}_command", required=True, metavar="ACTION")
        return Commands(action, self._common)

    def raw(self, name: str, help: str) -> argparse.ArgumentParser:
        """A command that parses its own arguments (``serve``), without the connection options."""
        parser: argparse.ArgumentParser = self._action.add_parser(name, help=help, description=help, add_help=False)
        return parser


# -- connection and output options -----------------------------------------------------------


def add_common(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
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


def common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    add_common(common, defaults=False)
    return common


def client_options(args: argparse.Namespace) -> dict[str, Any]:
    """The client's options from the connection options (all but the address)."""

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
    return dict(
        timeout=args.timeout,
        tls=args.tls or None,
        root_certificates=read(args.tls_ca),
        certificate_chain=read(args.tls_cert),
        private_key=read(args.tls_key),
        bearer_token=args.token or None,
    )


def make_client(args: argparse.Namespace) -> Client:
    return Client(args.address, **client_options(args))


def done(args: argparse.Namespace, message: str, **fields: Any) -> int:
    """A command's one-line result: ``message`` for people, ``fields`` with ``--json``."""
    if args.json:
        emit_json(fields, sys.stdout)
    else:
        print(message)
    return 0
