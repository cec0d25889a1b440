"""The ``querator`` parser and entry point; the commands live in modules by concern.

A command module has ``register(commands)``, adding its leaves (parsers with a
``func(args, client) -> exit code``); :data:`COMMAND_MODULES` lists them in the order
``--help`` shows them.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from types import ModuleType

from ..errors import FailedPrecondition, InvalidRequest, QueratorError
from . import cluster, console, dlq, items, keys, queues, serve, work, worker
from ._common import Commands, UsageError, add_common, common_options, make_client

COMMAND_MODULES: tuple[ModuleType, ...] = (serve, queues, work, worker, items, dlq, keys, cluster, console)

# Top-level options that take a value: needed to find the command word before parsing.
_VALUE_OPTIONS = frozenset({"--address", "--timeout", "--token", "--tls-ca", "--ca-file", "--tls-cert", "--cert-file", "--tls-key", "--key-file"})


def _version() -> str:
    out = []
    for dist in ("querator-client", "querator-server"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out) or "unknown version"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="querator",
        description="Querator work-queue service: run the server, or talk to one.",
        epilog="Exit codes: 0 ok, 1 the server answered an error (status printed), 2 bad usage.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s ({_version()})")
    add_common(parser, defaults=True)
    action = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands = Commands(action, common_options())
    for module in COMMAND_MODULES:
        module.register(commands)
    return parser


def _command_index(argv: list[str]) -> int | None:
    """Where the command word stands in ``argv`` (after any top-level options)."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return i + 1 if i + 1 < len(argv) else None
        if not word.startswith("-") or word == "-":
            return i
        i += 2 if word in _VALUE_OPTIONS else 1
    return None


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; words after a leaf's options join its trailing positional (ids,
    payloads), anything else left over is refused with the leaf's own usage."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        leaf: argparse.ArgumentParser = getattr(args, "leaf_parser", None) or parser
        rest: str | None = getattr(args, "leaf_rest", None)
        cut = extra.index("--") if "--" in extra else len(extra)
        options = [w for w in extra[:cut] if w.startswith("-") and w != "-"]
        if rest is None or options:
            leaf.error(f"unrecognized arguments: {' '.join(options or extra)}")
        getattr(args, rest).extend(extra[:cut] + extra[cut + 1 :])
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    at = _command_index(argv)
    if at is not None and argv[at] == "serve":
        top = argparse.ArgumentParser(prog="querator", add_help=False)
        add_common(top, defaults=False)
        client_only = [w.split("=")[0] for w in argv[:at] if w.split("=")[0] not in ("--address", "--json")]
        client_only = [w for w in client_only if w.startswith("--")]
        if client_only:
            top.error(f"{', '.join(client_only)} before 'serve': only --address and --json apply to the server")
        return serve.run(top.parse_args(argv[:at]), argv[at + 1 :])
    args = parse(parser, argv)
    try:
        with make_client(args) as client:
            return int(args.func(args, client))
    except (UsageError, ValueError) as exc:
        print(f"querator: {exc}", file=sys.stderr)
        return 2
    except QueratorError as exc:
        message = exc.message
        if isinstance(exc, FailedPrecondition):
            message = message.replace("set force to", "add --force to")
        print(f"querator: {exc.status}: {message}", file=sys.stderr)
        if isinstance(exc, InvalidRequest):
            for violation in exc.field_violations:
                print(f"  {violation.field}: {violation.description}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. | head
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        return 130
